"""Train the dense variant.

    python variants/dense/train.py                    # CPU default: a few minutes on 2 cores
    python variants/dense/train.py --preset 125m      # an accelerator shape (presets/*.yaml)
    python variants/dense/train.py --resume true      # continue the newest run of this variant
    python variants/dense/train.py --help             # every setting

Copied from templates/base/train.py; `python tools/review/variant_diff.py variants/dense` shows what differs.

What a variant may change is here: its config, mesh, optimizer, state, step, evaluation, sampling
and the loop in `main()`. What no variant edits (the run directory and its lock, resume checks,
checkpoints, signals, the watchdog, logging, throughput) is shared/run.py. One process per host;
the mesh spans every device of every process. A run directory holds metrics.jsonl, config.json,
the tokenizer, wandb files and checkpoints/.
"""

from __future__ import annotations

import os
import signal
import sys
from dataclasses import dataclass, field

if __name__ == "__main__":  # Ctrl-C during the imports below ends the process at once: nothing is written yet
    signal.signal(signal.SIGINT, signal.SIG_DFL)  # (cli.parse takes the signals over: shared/runtime/guard.py)

import jax
import jax.numpy as jnp
import optax
from jax.sharding import AbstractMesh, AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from shared import cli, data, decode, evals, optim, run
from shared.runtime import guard
from shared.config import TRAIN_FIELDS, check, check_fields
from shared.errors import StencilError
from shared.kernels import context
from shared.variant import sibling

model = sibling(__file__, "model")
HERE = os.path.dirname(os.path.abspath(__file__))


# The run's own fields (--run_dir, --resume, ...) come from shared/run.py's RunConfig, the evaluation's
# (--probes.*, --lm_eval_*) from shared/evals' EvalConfig.
@dataclass
class TrainConfig(run.RunConfig, evals.EvalConfig):
    model: model.ModelConfig = field(default_factory=model.ModelConfig)  # the architecture (model.py)
    data: data.DataConfig = field(default_factory=data.DataConfig)  # what it trains and evaluates on (shared/data/)
    seq_len: int = 128  # tokens per row
    batch_size: int = 32  # rows per optimizer step, over all devices
    grad_accum: int = 1  # micro-batches per step (batch_size must divide)
    steps: int = 220  # optimizer steps of the whole run (sets the schedule)
    stop_at: int = 0  # stop early after this step with a checkpoint (time-limited jobs); 0 = run to `steps`
    optimizer: str = "adamw"  # adamw | muon | muonh | adamh (shared/optim.py: which weights each updates how)
    optim: optim.OptimConfig = field(default_factory=optim.OptimConfig)  # schedule, lr_mult, ema, Muon's settings
    lr: float = 3e-3  # peak learning rate
    min_lr_ratio: float = 0.1  # final lr = lr * min_lr_ratio (end of the cosine or WSD decay)
    warmup_steps: int = -1  # linear warmup steps, in [0, steps); -1 = min(20, steps // 10)
    weight_decay: float = 0.1  # decoupled, on the roles optim.DECAY_ROLES (matrices, embeddings), never norms
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0  # global-norm clipping; 0 = off
    mesh_data: int = -1  # size of the `data` (FSDP) mesh axis; -1 = all devices / mesh_model
    mesh_model: int = 1  # size of the `model` (tensor-parallel) mesh axis
    mesh_context: int = 1  # size of the `context` mesh axis: rows' sequences split over it (shared/kernels/context.py)
    eval_every: int = 50  # evaluate every this many steps, and at the end; 0 = only at the end
    eval_batches: int = 4  # micro-batches of held-out rows per evaluation
    init_from: str = ""  # "hf:DIR": start from a Hugging Face model's weights, architecture and tokenizer (hf.py here)
    sample_every: int = 0  # sample `sample_tokens` tokens every this many steps; 0 = only at the end
    sample_tokens: int = 64  # tokens sampled (0 = never sample)
    sample_prompt: str = "def "
    seed: int = 0

    def __post_init__(self):
        run.RunConfig.__post_init__(self)  # the run's own fields (shared/run.py)
        evals.EvalConfig.__post_init__(self)  # the probes' and lm-eval's (shared/evals/__init__.py)
        self.probes.check_fits(self.seq_len)  # every probe fits in a row
        check_fields(self, TRAIN_FIELDS)  # types, and each field's own range or choices (shared/config.py)
        check(
            self.batch_size % self.grad_accum == 0,
            "grad_accum",
            f"{self.grad_accum} must divide batch_size={self.batch_size}",
        )
        check(
            self.warmup_steps == -1 or 0 <= self.warmup_steps < self.steps,
            "warmup_steps",
            f"{self.warmup_steps} must be -1 (= min(20, steps // 10)) or in [0, steps={self.steps})",
        )
        check(self.stop_at <= self.steps, "stop_at", f"{self.stop_at} must be in [0, steps={self.steps}]")
        optim.make_schedule(self.optim, self.lr, self.steps, warmup(self), self.min_lr_ratio)  # WSD decay vs warmup
        check(
            self.sample_prompt != "" or self.sample_tokens == 0,
            "sample_prompt",
            "is empty: sampling continues a prompt (or set sample_tokens 0)",
        )
        check(
            self.profile_steps == "" or run.profile_range(self) is not None,
            "profile_steps",
            f"must be A:B with 0 < A <= B <= steps={self.steps}, got {self.profile_steps!r}",
        )
        why = model.context_refusal(self.model, self.seq_len, self.mesh_context)  # the rows' split (model.py)
        check(why is None or bool(self.init_from), "mesh_context", why)  # init_from: DIR's model, in hf.init_config
        check(
            not self.init_from or os.path.isfile(os.path.join(HERE, "hf.py")),
            "init_from",
            f"{os.path.basename(HERE)} has no hf.py: no Hugging Face class maps to it (see the README's table)",
        )


# What the contract test (tests/contract/test_contract.py) runs on 8 CPU devices: the CPU default at 32
# tokens a row and 8 rows on a data x model = 4 x 2 mesh, with these overrides on top ("model": {...}
# for ModelConfig fields). A copy that adds a path the default never reaches at that size (a window
# shorter than the row, several chunks, another mesh axis) sets it here, so the contract runs it.
CONTRACT_TINY: dict = {}
# The long checks of this folder that stay in the fast tier, each under 30 s on 2 cores (the rest run in the
# integration tier; docs/testing.md, "What a folder costs"): "loop" (the train loop with every feature on),
# "context" (the row split over context 2). tools/review/check_variant.py prints what each costs here.
FAST_TIER: tuple = ("loop", "context")


# ---------------------------------------------------------------- mesh, optimizer, steps


def make_mesh(cfg: TrainConfig, devices=None):
    """The (data, context, model) mesh. `devices`: the devices to use (default: all of them), or a number
    of devices, for an AbstractMesh that traces a preset at its real scale on a machine without them."""
    devices = jax.devices() if devices is None else devices
    n, cp, tp = (devices if isinstance(devices, int) else len(devices)), cfg.mesh_context, cfg.mesh_model
    check(
        cfg.mesh_data != -1 or n % (cp * tp) == 0,
        "mesh_context" if cp > 1 else "mesh_model",
        f"mesh_context {cp} x mesh_model {tp} = {cp * tp} devices does not divide the {n} devices",
    )
    dp = n // (cp * tp) if cfg.mesh_data == -1 else cfg.mesh_data
    check(
        dp * cp * tp == n,
        "mesh_data",
        f"mesh {dp} (data) x {cp} (context) x {tp} (model) does not use exactly the {n} devices",
    )
    micro = cfg.batch_size // cfg.grad_accum
    check(
        micro % dp == 0,
        "batch_size",
        f"micro-batch batch_size/grad_accum={micro} is not divisible by the data axis ({dp} devices)",
    )
    m = cfg.model
    for name, size in model.sharded_dims(m):  # what the `model` axis splits (model.py)
        check(size % tp == 0, f"model.{name}", f"{size} is not divisible by mesh_model={tp}")
    check(m.d_model % dp == 0, "model.d_model", f"{m.d_model} is not divisible by the data axis ({dp})")
    shape, axes = (dp, cp, tp), ("data", "context", "model")
    if isinstance(devices, int):
        return AbstractMesh(shape, axes, axis_types=(AxisType.Explicit,) * 3)
    return jax.make_mesh(shape, axes, axis_types=(AxisType.Explicit,) * 3, devices=devices)


def warmup(cfg: TrainConfig) -> int:
    """Warmup steps: `warmup_steps`, or for -1 min(20, n // 10) for a schedule of n steps (`steps`, or
    `optim.schedule_steps` when set), which is below n for any run length."""
    return cfg.warmup_steps if cfg.warmup_steps >= 0 else min(20, (cfg.optim.schedule_steps or cfg.steps) // 10)


def make_optimizer(cfg: TrainConfig):
    """(optimizer, schedule): `cfg.optimizer` over the roles of model.weights (shared/optim.py)."""
    return optim.make(
        model.weights(cfg.model),
        cfg.optimizer,
        cfg.optim,
        lr=cfg.lr,
        steps=cfg.steps,
        warmup=warmup(cfg),
        min_lr_ratio=cfg.min_lr_ratio,
        weight_decay=cfg.weight_decay,
        b1=cfg.beta1,
        b2=cfg.beta2,
        grad_clip=cfg.grad_clip,
    )


def init_state(cfg: TrainConfig, optimizer, key):
    """params, optimizer state (leaves sharded like the weights), step; and the weights' moving
    average `ema` when optim.ema > 0."""
    params = model.init(cfg.model, key)
    state = {"params": params, "opt": optimizer.init(params), "step": jnp.zeros((), jnp.int32)}
    if cfg.optim.ema > 0:
        state["ema"] = jax.tree.map(jnp.copy, params)
    return state


def eval_params(state):
    """The weights evaluation uses: the moving average when it is kept, else the weights."""
    return state.get("ema", state["params"])


def make_train_step(cfg: TrainConfig, optimizer, schedule):
    """state, batch -> state, metrics. batch leaves are [grad_accum, micro_batch, T]. metrics: scalars
    named as they are logged (`train/...` from loss_fn's metrics, `optim/...`)."""

    def train_step(state, batch):
        params = state["params"]
        total = jnp.sum(batch["loss_mask"])

        def micro(acc, mb):
            (_, m), g = jax.value_and_grad(model.loss_fn, has_aux=True)(params, mb, cfg.model)
            w = m["tokens"] / total  # token-weighted, so accumulation equals the large batch
            return jax.tree.map(lambda a, b: a + w * b, acc, g), m

        grads, ms = jax.lax.scan(micro, jax.tree.map(jnp.zeros_like, params), batch)
        updates, opt = optimizer.update(grads, state["opt"], params)
        new = {"params": optax.apply_updates(params, updates), "opt": opt, "step": state["step"] + 1}
        if "ema" in state:
            new["ema"] = optim.ema_update(state["ema"], new["params"], cfg.optim.ema)
        # every per-token metric of loss_fn (loss, z, and whatever a variant adds), token-weighted over
        # the micro-batches; the loop logs every key of `out` as it is
        out = {f"train/{k}": jnp.sum(v * ms["tokens"]) / total for k, v in ms.items() if k != "tokens"}
        out |= {"optim/grad_norm": optax.tree.norm(grads), "optim/learning_rate": schedule(state["step"])}
        return new, out

    return jax.jit(train_step, donate_argnums=0)


def make_eval_step(cfg: TrainConfig):
    @jax.jit
    def eval_step(params, batch):
        _, m = model.loss_fn(params, batch, cfg.model)
        return m["loss"] * m["tokens"], m["tokens"]

    return eval_step


def batch_spec(leading: int = 0) -> P:
    """PartitionSpec of a batch array [*leading axes, rows, T]: rows over `data`, each row's tokens over
    `context` when the current mesh splits rows (shared/kernels/context.py). The loop and the contract test
    (tests/contract/test_contract.py) both place batches with it, under the run's mesh."""
    return P(*([None] * leading), "data", context.axis())


def to_device(batch: dict, mesh, leading: tuple = ()):
    """Host numpy rows of this process -> global arrays sharded over `data` on the row axis."""
    spec = batch_spec(len(leading))
    out = {}
    for k, v in batch.items():
        v = v.reshape(*leading, -1, v.shape[-1])
        shape = (*leading, v.shape[len(leading)] * jax.process_count(), v.shape[-1])
        out[k] = jax.make_array_from_process_local_data(NamedSharding(mesh, spec), v, shape)
    return out


# The metrics shown in each log line and on the progress bar, with their format; every metric is in
# metrics.jsonl and wandb whether shown or not.
SHOWN = {
    "train/loss": ("loss", ".4f"),
    "eval/loss": ("val", ".4f"),
    "throughput/tokens_per_second": ("tok/s", ",.0f"),
    "throughput/mfu": ("MFU", ".1%"),
}


def sample(params, cfg: TrainConfig, corpus, mesh, n_tokens: int, key) -> str:
    """Temperature-0.8 sampling from `sample_prompt` with the model's cache: the path of `python -m
    shared.generate` (shared/decode.py). The prompt runs on as many rows as the mesh splits a batch
    into (every row samples its own continuation; the first is shown), up to seq_len tokens or the
    end-of-text token."""
    prompt = corpus.encode(cfg.sample_prompt)[: cfg.seq_len - 1] or [corpus.eos_id]
    rows = decode.rows_multiple(model, cfg.model, mesh)
    done = decode.generate(
        model,
        params,
        cfg.model,
        [prompt] * rows,
        mesh=mesh,
        max_new_tokens=n_tokens,
        max_len=cfg.seq_len,
        sampling=decode.Sampling(temperature=0.8),
        key=key,
        eos_id=corpus.eos_id,
    )
    return corpus.decode(prompt + done[0].tokens)


# ---------------------------------------------------------------- the loop


def main(cfg: TrainConfig) -> dict:
    if cfg.init_from:  # hf:DIR: the architecture and the tokenizer of a Hugging Face model (hf.py in this folder)
        cfg = sibling(__file__, "hf").init_config(cfg)
    mesh = make_mesh(cfg)  # validates mesh/batch/width divisibility before anything is compiled
    optimizer, schedule = make_optimizer(cfg)
    evaluator = evals.Evaluator(cfg, model, mesh)  # probes and lm-eval tasks on the eval cadence, if asked for
    with (
        run.Run(cfg, HERE, mesh, evaluator) as r,
        jax.set_mesh(mesh),
    ):  # run dir, lock, resume checks, data (shared/run.py)
        key = jax.random.key(cfg.seed)
        if r.checkpoint:  # resuming: the checkpoint's state, and the data where it was
            state = r.restore(jax.eval_shape(lambda k: init_state(cfg, optimizer, k), key))
        elif cfg.init_from:  # the Hugging Face model's weights, a fresh optimizer state
            params = sibling(__file__, "hf").init_params(cfg)
            state = jax.jit(lambda p: {"params": p, "opt": optimizer.init(p), "step": jnp.zeros((), jnp.int32)})(params)
        else:
            state = jax.jit(lambda k: init_state(cfg, optimizer, k))(key)
        train_step, eval_step = make_train_step(cfg, optimizer, schedule), make_eval_step(cfg)
        r.begin(
            model.num_params(cfg.model), model.flops_per_token(cfg.model, cfg.seq_len), schedule
        )  # logger, saver, ...

        for step in r.steps():
            batch = to_device(r.loader.next(), mesh, (cfg.grad_accum,))
            state, metrics = train_step(state, batch)
            due = r.step_done(step, metrics)  # the previous step's metrics are checked while this one runs
            if not due:
                continue
            row = r.fetch()  # this step's metrics on the host (a non-finite loss stops the run here)
            if due.profile_end:
                r.end_profile(state, train_step.lower(state, batch))
            if due.eval:  # eval/loss and eval/bpb of the held-out rows and every --data.eval set; probes, lm-eval tasks
                row |= r.evaluate(lambda b: eval_step(eval_params(state), to_device(b, mesh)), eval_params(state))
            if due.log:
                r.log(step, row, SHOWN)  # metrics.jsonl, wandb, the bar, a line; tokens/s and MFU added
            if due.save:
                r.save(step, state)  # asynchronous: the loop waits for the host copy only
            if due.sample:  # every process takes part, one prints
                r.show_sample(
                    step,
                    lambda: sample(
                        state["params"], cfg, r.corpus, mesh, cfg.sample_tokens, jax.random.key(cfg.seed + 1)
                    ),
                )
            if due.stop:
                r.preempted(step)  # a stop signal: waits for the save, raises run.Preempted (exit 75)
        return r.finish(state)


if __name__ == "__main__":
    config = cli.parse(TrainConfig, HERE)
    try:
        main(config)
    except run.Preempted as e:
        print(e, file=sys.stderr)
        sys.exit(guard.EXIT_PREEMPTED)
    except StencilError as e:
        sys.exit(f"error: {e}")
