"""Train the moe_hero variant (fine-grained MoE, aux-loss-free routing, expert parallelism, SWA).

    python variants/moe_hero/train.py                         # CPU default: a few minutes on 2 cores
    python variants/moe_hero/train.py --mesh_expert 4         # experts over 4 devices (needs 4+ devices)
    python variants/moe_hero/train.py --preset 1b_a200m       # an accelerator shape (presets/*.yaml)
    python variants/moe_hero/train.py --resume true           # continue the newest run of this variant
    python variants/moe_hero/train.py --help                  # every setting

Copied from variants/swa_hybrid/train.py; this file adds the `expert` mesh axis (batch rows
and FSDP shards over ("data", "expert")), the aux-loss-free router-bias update after every
step (`bias_rate`), and the MoE metrics (per-expert load, dropped tokens, bias norm,
router z-loss, balance loss).

One process per host; the mesh spans every device of every process. A run directory
holds metrics.jsonl, the tokenizer, wandb files and checkpoints/.
"""

from __future__ import annotations

import dataclasses
import math
import os
import sys
import time
from dataclasses import dataclass, field

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402
from jax.sharding import AbstractMesh, AxisType, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from shared import checkpoint, cli, data, distributed, flops, generate, guard, kernels, metrics, optim  # noqa: E402
from shared.variant import sibling  # noqa: E402

model = sibling(__file__, "model")
HERE = os.path.dirname(os.path.abspath(__file__))
VARIANT = os.path.basename(HERE)
check = model.check


@dataclass
class TrainConfig:
    model: model.ModelConfig = field(default_factory=model.ModelConfig)
    data: data.DataConfig = field(default_factory=data.DataConfig)
    seq_len: int = 256  # tokens per row (4 windows of the default model.window = 64)
    batch_size: int = 16  # rows per optimizer step, over all devices
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
    mesh_data: int = -1  # size of the `data` (FSDP) mesh axis; -1 = all devices / (mesh_expert * mesh_model)
    mesh_expert: int = 1  # size of the `expert` mesh axis (expert parallelism; also shards batch rows and FSDP)
    mesh_model: int = 1  # size of the `model` (tensor-parallel) mesh axis
    bias_rate: float = 1e-2  # aux-loss-free balancing: bias += bias_rate * sign(mean load - load) each step
    # (1e-2 suits the short CPU default; the presets use DeepSeek-V3's 1e-3 for long runs)
    eval_every: int = 50  # evaluate every this many steps, and at the end; 0 = only at the end
    eval_batches: int = 4  # micro-batches of held-out rows per evaluation
    log_every: int = 10  # a metrics row and a log line every this many steps (and the first and last step)
    save_every: int = 100  # also saved at the end; 0 = only at the end
    keep_checkpoints: int = 3
    run_dir: str = ""  # "" = runs/<variant>-<time>; with --resume, the newest runs/<variant>-*
    checkpoint_dir: str = ""  # "" = <run_dir>/checkpoints; or a path, file://, gs://bucket/prefix, s3://bucket/prefix
    resume: bool = False  # continue from the newest good checkpoint in run_dir
    resume_from: str = ""  # continue from this checkpoint: a step of run_dir's, or a checkpoint's path
    init_from: str = ""  # "hf:DIR": start from a Hugging Face model's weights, architecture and tokenizer (hf.py here)
    watchdog_s: int = 1800  # abort (exit 70, every thread's stack written) if no step completes this long; 0 = off
    wandb: str = "auto"  # auto | online | offline | disabled
    sample_every: int = 0  # sample `sample_tokens` tokens every this many steps; 0 = only at the end
    sample_tokens: int = 64  # tokens sampled (0 = never sample)
    sample_prompt: str = "def "
    profile_steps: str = ""  # "A:B": a jax.profiler trace of steps A..B into <run_dir>/profile ("" = none)
    seed: int = 0

    def __post_init__(self):
        model.check_types(self)
        check(self.seq_len > 1, "seq_len", f"must be > 1, got {self.seq_len}")
        check(self.batch_size > 0, "batch_size", f"must be positive, got {self.batch_size}")
        check(self.grad_accum > 0 and self.batch_size % self.grad_accum == 0, "grad_accum",
              f"{self.grad_accum} must divide batch_size={self.batch_size}")
        check(self.steps > 0, "steps", f"must be positive, got {self.steps}")
        check(self.warmup_steps == -1 or 0 <= self.warmup_steps < self.steps, "warmup_steps",
              f"{self.warmup_steps} must be -1 (= min(20, steps // 10)) or in [0, steps={self.steps})")
        check(0 <= self.stop_at <= self.steps, "stop_at", f"{self.stop_at} must be in [0, steps={self.steps}]")
        check(self.lr > 0 and math.isfinite(self.lr), "lr", f"must be positive and finite, got {self.lr}")
        check(0 <= self.min_lr_ratio <= 1, "min_lr_ratio", f"must be in [0, 1], got {self.min_lr_ratio}")
        check(0 <= self.weight_decay < 1, "weight_decay", f"must be in [0, 1), got {self.weight_decay}")
        for name in ("beta1", "beta2"):
            check(0 <= getattr(self, name) < 1, name, f"must be in [0, 1), got {getattr(self, name)}")
        check(self.grad_clip >= 0, "grad_clip", f"must be >= 0 (0 = off), got {self.grad_clip}")
        check(self.optimizer in optim.OPTIMIZERS, "optimizer", f"must be one of {optim.OPTIMIZERS}, got {self.optimizer!r}")
        optim.make_schedule(self.optim, self.lr, self.steps, warmup(self), self.min_lr_ratio)  # a WSD decay overlapping the warmup
        check(self.mesh_model > 0, "mesh_model", f"must be positive, got {self.mesh_model}")
        check(self.mesh_expert > 0, "mesh_expert", f"must be positive, got {self.mesh_expert}")
        check(self.bias_rate >= 0, "bias_rate", f"must be >= 0 (0 = no balancing), got {self.bias_rate}")
        check(self.mesh_data == -1 or self.mesh_data > 0, "mesh_data", f"must be -1 or positive, got {self.mesh_data}")
        for name in ("eval_every", "save_every", "sample_every", "sample_tokens", "watchdog_s", "seed"):
            check(getattr(self, name) >= 0, name, f"must be >= 0, got {getattr(self, name)}")
        check(self.eval_batches > 0, "eval_batches", f"must be positive, got {self.eval_batches}")
        check(self.log_every > 0, "log_every", f"must be positive, got {self.log_every}")
        check(self.keep_checkpoints > 0, "keep_checkpoints", f"must be positive, got {self.keep_checkpoints}")
        check("\0" not in self.run_dir, "run_dir", "contains a NUL byte")
        check(not os.path.isfile(self.run_dir), "run_dir", f"{self.run_dir!r} is a file, not a directory")
        check(not self.resume_from.lstrip("-").isdigit() or int(self.resume_from) > 0, "resume_from",
              f"a step must be positive, got {self.resume_from}")
        check("\0" not in self.resume_from, "resume_from", "contains a NUL byte")
        check(self.wandb in WANDB_MODES, "wandb", f"must be one of {', '.join(WANDB_MODES)}, got {self.wandb!r}")
        check(self.sample_prompt != "" or self.sample_tokens == 0, "sample_prompt",
              "is empty: sampling continues a prompt (or set sample_tokens 0)")
        check(self.profile_steps == "" or profile_range(self) is not None, "profile_steps",
              f"must be A:B with 0 < A <= B <= steps={self.steps}, got {self.profile_steps!r}")
        check(not self.init_from or (self.init_from.startswith("hf:") and len(self.init_from) > 3), "init_from",
              f"must be '' or hf:DIR (a Hugging Face model directory), got {self.init_from!r}")
        check(not self.init_from or os.path.isfile(os.path.join(HERE, "hf.py")), "init_from",
              f"{VARIANT} has no hf.py: no Hugging Face class maps to it (see the README's table)")
        check(not self.checkpoint_dir or not checkpoint.location_error(self.checkpoint_dir), "checkpoint_dir",
              str(checkpoint.location_error(self.checkpoint_dir or ".")))


WANDB_MODES = ("auto", "online", "offline", "disabled")


def profile_range(cfg: TrainConfig) -> tuple[int, int] | None:
    """`profile_steps` "A:B" as (A, B), None when it is empty or malformed."""
    a, sep, b = cfg.profile_steps.partition(":")
    if not (sep and a.isdigit() and b.isdigit() and 0 < int(a) <= int(b) <= cfg.steps):
        return None
    return int(a), int(b)


# What the contract test (tests/test_contract.py) runs on 8 CPU devices: the CPU default at 32
# tokens a row and 8 rows on a data x model = 4 x 2 mesh, with these overrides on top ("model": {...}
# for ModelConfig fields). A copy that adds a path the default never reaches at that size (a window
# shorter than the row, several chunks, another mesh axis) sets it here, so the contract runs it.
# experts over 2 devices (all-to-all); a sliding window; the router z-loss and balance loss switched
# on, so the contract's causality, document and accumulation checks through the loss cover them
CONTRACT_TINY: dict = {"mesh_expert": 2, "model": {"window": 16, "router_z_loss": 0.1, "balance_loss": 0.1}}


# ---------------------------------------------------------------- mesh, optimizer, steps

def make_mesh(cfg: TrainConfig, devices=None):
    """The (data, expert, model) mesh. `devices`: the devices to use (default: all of them), or a
    number of devices, for an AbstractMesh that traces a preset at its real scale on a machine
    without them (nothing can run on it)."""
    devices = jax.devices() if devices is None else devices
    n, ep, tp = (devices if isinstance(devices, int) else len(devices)), cfg.mesh_expert, cfg.mesh_model
    dp = n // (ep * tp) if cfg.mesh_data == -1 else cfg.mesh_data
    check(dp * ep * tp == n, "mesh_data",
          f"mesh {dp} (data) x {ep} (expert) x {tp} (model) does not use exactly the {n} devices")
    micro = cfg.batch_size // cfg.grad_accum
    check(micro % (dp * ep) == 0, "batch_size",
          f"micro-batch batch_size/grad_accum={micro} is not divisible by data x expert = {dp * ep} devices")
    m = cfg.model
    check(m.n_experts % ep == 0, "model.n_experts", f"{m.n_experts} is not divisible by mesh_expert={ep}")
    for name, size in (("n_kv_heads", m.n_kv_heads), ("d_ff", m.d_ff), ("vocab_size", m.vocab_size),
                       ("d_expert", m.d_expert)):
        check(size % tp == 0, f"model.{name}", f"{size} is not divisible by mesh_model={tp}")
    check(m.d_model % (dp * ep) == 0, "model.d_model",
          f"{m.d_model} is not divisible by data x expert = {dp * ep} (FSDP shards d_model over both)")
    names, types = ("data", "expert", "model"), (AxisType.Explicit,) * 3
    if isinstance(devices, int):
        return AbstractMesh((dp, ep, tp), names, axis_types=types)
    return jax.make_mesh((dp, ep, tp), names, axis_types=types, devices=devices)


def warmup(cfg: TrainConfig) -> int:
    """Warmup steps: `warmup_steps`, or for -1 min(20, steps // 10), which is below `steps` for any run length."""
    return cfg.warmup_steps if cfg.warmup_steps >= 0 else min(20, cfg.steps // 10)


def make_optimizer(cfg: TrainConfig):
    """(optimizer, schedule): `cfg.optimizer` over the roles of model.weights (shared/optim.py). The router
    bias (role `buffer`) is left alone by the optimizer: `balance_bias` moves it."""
    return optim.make(model.weights(cfg.model), cfg.optimizer, cfg.optim, lr=cfg.lr, steps=cfg.steps,
                      warmup=warmup(cfg), min_lr_ratio=cfg.min_lr_ratio, weight_decay=cfg.weight_decay,
                      b1=cfg.beta1, b2=cfg.beta2, grad_clip=cfg.grad_clip)


def balance_bias(bias, load, rate):
    """Aux-loss-free balancing (DeepSeek-V3): per MoE layer, raise the bias of experts that got fewer
    assignments than the mean this step and lower it for those that got more, by `rate`.
    bias, load: [n_moe_layers, n_experts]. The bias only changes which experts are chosen."""
    return bias + rate * jnp.sign(jnp.mean(load, axis=-1, keepdims=True) - load)


def load_stats(load):
    """Per-expert load relative to the mean (1 = balanced) from assignment counts [layers, experts]:
    the smallest and largest over all layers, and the coefficient of variation averaged over layers."""
    rel = load / jnp.maximum(jnp.mean(load, axis=-1, keepdims=True), 1e-9)
    return {"load_min": jnp.min(rel), "load_max": jnp.max(rel), "load_cv": jnp.mean(jnp.std(rel, axis=-1))}


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
        new_params = optax.apply_updates(params, updates)
        load = jnp.sum(ms["load"], axis=0)  # [n_moe_layers, n_experts]: assignments this step
        bias = balance_bias(params["moe_layers"]["router_bias"], load, cfg.bias_rate)
        new_params = {**new_params, "moe_layers": {**new_params["moe_layers"], "router_bias": bias}}
        new = {"params": new_params, "opt": opt, "step": state["step"] + 1}
        if "ema" in state:
            new["ema"] = optim.ema_update(state["ema"], new["params"], cfg.optim.ema)
        # loss_fn's per-token metrics, token-weighted over the micro-batches, then the routing's; the
        # loop logs every key of `out` as it is
        out = {f"train/{k}": jnp.sum(ms[k] * ms["tokens"]) / total for k in ("loss", "z", "router_z", "balance")}
        out |= {"optim/grad_norm": optax.tree.norm(grads), "optim/learning_rate": schedule(state["step"])}
        routing = {"dropped": jnp.sum(ms["dropped"]) / jnp.sum(ms["assignments"]), "bias_norm": jnp.linalg.norm(bias),
                   **load_stats(load)}
        out |= {f"train/{k}": v for k, v in routing.items()}
        return new, out

    return jax.jit(train_step, donate_argnums=0)


def make_eval_step(cfg: TrainConfig):
    @jax.jit
    def eval_step(params, batch):
        _, m = model.loss_fn(params, batch, cfg.model)
        return m["loss"] * m["tokens"], m["tokens"]

    return eval_step


def batch_spec(leading: int = 0) -> P:
    """PartitionSpec of a batch array [*leading axes, rows, T]: rows over `data` and `expert` (model.BATCH).
    The loop and the contract test (tests/test_contract.py) both place batches with it."""
    return P(*([None] * leading), model.BATCH, None)


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
SHOWN = {"train/loss": ("loss", ".4f"), "eval/loss": ("val", ".4f"),
         "throughput/tokens_per_second": ("tok/s", ",.0f"), "throughput/mfu": ("MFU", ".1%"),
         "train/load_min": ("load min", ".2f"), "train/load_max": ("max", ".2f"), "train/load_cv": ("cv", ".3f"),
         "train/dropped": ("dropped", ".2%")}


def evaluate(eval_step, params, batches, mesh) -> float:
    nll, n = 0.0, 0.0
    for b in batches:
        s, c = eval_step(params, to_device(b, mesh))
        nll, n = nll + float(s), n + float(c)
    return nll / max(n, 1.0)


def evaluate_sets(eval_step, params, sets, mesh) -> dict:
    """eval/loss (the held-out split, set "") and eval/<name>/loss of every named set, each with its bits per
    byte of the original text (eval/bpb, eval/<name>/bpb) when the set's text is known."""
    row = {}
    for name, s in sets.items():
        key = f"eval/{name}/" if name else "eval/"
        row[key + "loss"] = evaluate(eval_step, params, s.batches, mesh)
        if s.bpb(row[key + "loss"]) is not None:
            row[key + "bpb"] = s.bpb(row[key + "loss"])
    return row


def sample(params, cfg: TrainConfig, corpus, mesh, n_tokens: int, key) -> str:
    """Temperature-0.8 sampling from `sample_prompt` with the model's cache: the path of `python -m
    shared.generate` (shared/generate.py). The prompt runs on as many rows as the mesh splits a batch
    into (every row samples its own continuation; the first is shown), up to seq_len tokens or the
    end-of-text token."""
    prompt = corpus.encode(cfg.sample_prompt)[: cfg.seq_len - 1] or [corpus.eos_id]
    rows = generate.rows_multiple(model, cfg.model, mesh)
    done = generate.generate(model, params, cfg.model, [prompt] * rows, mesh=mesh, max_new_tokens=n_tokens,
                             max_len=cfg.seq_len, sampling=generate.Sampling(temperature=0.8), key=key,
                             eos_id=corpus.eos_id)
    return corpus.decode(prompt + done[0].tokens)


# ---------------------------------------------------------------- the run

class TrainingError(RuntimeError):
    """The run cannot go on (a non-finite loss, a checkpoint that does not match)."""


class Preempted(Exception):
    """Stopped on SIGTERM, SIGINT or SIGUSR1 after saving a checkpoint; exit with guard.EXIT_PREEMPTED."""


def pick_run_dir(cfg: TrainConfig) -> str:
    if cfg.run_dir:
        return cfg.run_dir
    if cfg.resume_from and not cfg.resume_from.isdigit() and not checkpoint.is_url(cfg.resume_from):  # a local step_X
        return os.path.dirname(os.path.dirname(os.path.abspath(cfg.resume_from)))
    if cfg.resume or (cfg.resume_from and not checkpoint.is_url(cfg.resume_from)):  # a URL's: a new run dir
        runs = sorted(d for d in os.listdir("runs") if d.startswith(VARIANT + "-")) if os.path.isdir("runs") else []
        runs = [os.path.join("runs", d) for d in runs if checkpoint.latest(os.path.join("runs", d, "checkpoints"))]
        if not runs:
            raise TrainingError(f"--resume: no runs/{VARIANT}-*/ with a checkpoint in {os.getcwd()}; pass --run_dir")
        return runs[-1]
    stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(distributed.start_time()))  # process 0's clock
    return os.path.join("runs", f"{VARIANT}-{stamp}")


def main(cfg: TrainConfig) -> dict:
    if cfg.init_from:  # hf:DIR: the architecture and the tokenizer of a Hugging Face model (hf.py in this folder)
        cfg = sibling(__file__, "hf").init_config(cfg)
    mesh = make_mesh(cfg)  # validates mesh/batch/width divisibility before anything is compiled
    run_dir = pick_run_dir(cfg)
    ckpt_dir = cfg.checkpoint_dir or os.path.join(run_dir, "checkpoints")
    lock = guard.RunLock(run_dir, ckpt_dir)  # one run per directory: a second one is refused, naming the first
    resume = cfg.resume or bool(cfg.resume_from)
    last = checkpoint.find(ckpt_dir, cfg.resume_from) if cfg.resume_from else checkpoint.latest(ckpt_dir)
    if last and not resume:
        raise TrainingError(f"{run_dir} already has checkpoints ({os.path.basename(last)}); "
                            "pass --resume true to continue it, or another --run_dir")
    if resume and not last:
        raise TrainingError(f"--resume: no complete checkpoint in {ckpt_dir}")

    tokenizer_file = os.path.join(run_dir, "tokenizer.json")
    data_cfg = cfg.data
    if last and not data_cfg.tokenizer and os.path.exists(tokenizer_file):
        data_cfg = dataclasses.replace(data_cfg, tokenizer=tokenizer_file)  # the run's own: token ids keep their meaning
    corpus = data.load_corpus(data_cfg, cfg.model.vocab_size, progress=jax.process_index() == 0)
    stream = {"corpus": corpus.digest, "tokenizer": corpus.tokenizer_digest, "seq_len": cfg.seq_len}
    loader = data.make_loader(corpus, cfg.seq_len, cfg.batch_size, cfg.data.seed,
                              process_index=jax.process_index(), process_count=jax.process_count())
    evals = data.eval_sets(corpus, cfg.seq_len, cfg.batch_size // cfg.grad_accum, cfg.eval_batches,
                           process_index=jax.process_index(), process_count=jax.process_count())
    optimizer, schedule = make_optimizer(cfg)

    with jax.set_mesh(mesh):
        key = jax.random.key(cfg.seed)
        start = 0
        if last:
            saved_meta = checkpoint.read_metadata(last)
            saved = saved_meta["config"]
            for part in ("model", "data"):
                now = dataclasses.asdict(getattr(cfg, part))
                paths = ("source", "tokenizer", "cache_dir", "eval") if part == "data" else ()  # content: compared below
                diff = {k: (saved[part].get(k), v) for k, v in now.items() if saved[part].get(k) != v and k not in paths}
                if diff:
                    raise TrainingError(f"--resume: {part} config differs from {last}: {diff} (saved, now)")
            was = saved_meta.get("stream", {})
            diff = {k: (was[k], v) for k, v in stream.items() if k in was and was[k] != v}
            if diff:
                raise TrainingError(f"--resume: the data stream differs from {last}'s: {diff} (saved, now). A changed "
                                    "corpus, tokenizer or seq_len would change the data or the meaning of token ids")
            if saved.get("optimizer", "adamw") != cfg.optimizer:  # another optimizer state: its tree does not match
                raise TrainingError(f"--resume: {last} holds the state of --optimizer {saved.get('optimizer', 'adamw')}, "
                                    f"and this run asks for --optimizer {cfg.optimizer}: an optimizer state does not "
                                    f"carry over to another optimizer; resume with --optimizer "
                                    f"{saved.get('optimizer', 'adamw')}")
            if (saved.get("optim", {}).get("ema", 0.0) > 0) != (cfg.optim.ema > 0):  # the average is in the state or not
                raise TrainingError(f"--resume: {last} was saved with --optim.ema {saved.get('optim', {}).get('ema', 0.0)}"
                                    f" and this run asks for --optim.ema {cfg.optim.ema}: a weight average can be "
                                    "retuned on resume, not turned on or off")
            if saved_meta["step"] >= (cfg.stop_at or cfg.steps):
                raise TrainingError(f"--resume: {last} is at step {saved_meta['step']}, and this run ends at step "
                                    f"{cfg.stop_at or cfg.steps} (--steps / --stop_at): nothing to train")
            abstract = jax.eval_shape(lambda k: init_state(cfg, optimizer, k), key)
            state, meta = checkpoint.restore(last, abstract)
            loader.restore(meta["loader"])
            start = meta["step"]
        elif cfg.init_from:  # the Hugging Face model's weights, a fresh optimizer state
            params = sibling(__file__, "hf").init_params(cfg)
            state = jax.jit(lambda p: {"params": p, "opt": optimizer.init(p), "step": jnp.zeros((), jnp.int32)})(params)
        else:
            state = jax.jit(lambda k: init_state(cfg, optimizer, k))(key)
        train_step, eval_step = make_train_step(cfg, optimizer, schedule), make_eval_step(cfg)

        n_params = model.num_params(cfg.model)
        fpt = model.flops_per_token(cfg.model, cfg.seq_len)
        peak, peak_src = flops.device_peak(cfg.model.compute_dtype)
        tokens_per_step = cfg.batch_size * cfg.seq_len
        end = cfg.stop_at or cfg.steps
        log = metrics.Logger(run_dir, dataclasses.asdict(cfg), total_steps=end, wandb_mode=cfg.wandb,
                             name=os.path.basename(run_dir), start_step=start, process_index=jax.process_index())
        if corpus.tokenizer is not None and jax.process_index() == 0 and not os.path.exists(tokenizer_file):
            corpus.tokenizer.save(tokenizer_file)  # never over the run's own
        log.write(f"{VARIANT}: {n_params / 1e6:.2f}M params, {fpt / 1e6:.1f} MFLOP/token, mesh {dict(mesh.shape)}, "
                  f"{tokens_per_step} tokens/step, steps {start}->{end}, run dir {run_dir}")
        platform = jax.default_backend()
        rows = cfg.batch_size // cfg.grad_accum // (mesh.shape["data"] * mesh.shape["expert"])
        waste = model.expert_flops_ratio(cfg.model, rows * cfg.seq_len, platform, ep=cfg.mesh_expert)
        how = cfg.model.dispatch + ("" if cfg.model.dispatch == "capacity" else f", {model.expert_matmul(cfg.model, platform)}")
        log.write(f"routed experts execute {waste:.2f}x their active FLOPs on {platform} ({how}); "
                  "MFU counts active FLOPs only (variants/moe_hero/README.md, 'On CPU')")

        def save(step, state):
            meta = {"config": dataclasses.asdict(cfg), "loader": loader.state(), "variant": VARIANT, "stream": stream}
            return saver.save(ckpt_dir, step, state, meta, keep=cfg.keep_checkpoints)  # waits for the host copy only

        saver = checkpoint.Saver()  # asynchronous saves, one in flight

        def due(every, step):  # a cadence: every `every` steps and at the end; 0 = only at the end
            return step == end or (every > 0 and step % every == 0)

        losses, val_loss, text = {}, None, ""
        pending = None  # (step, metrics on device): fetched one step late, so the host never stalls the device

        def fetch() -> dict:
            """The pending step's metrics, on the host and checked."""
            nonlocal pending
            step, m = pending
            pending, m = None, {k: float(v) for k, v in jax.device_get(m).items()}
            if not (math.isfinite(m["train/loss"]) and math.isfinite(m["optim/grad_norm"])):  # a bad update too
                saver.wait()  # an earlier step's save in flight ends first, so the message names it
                raise TrainingError(f"loss {m['train/loss']}, grad_norm {m['optim/grad_norm']} at step {step}; stopped "
                                    f"without saving. Last good checkpoint: {checkpoint.latest_name(ckpt_dir)} (untouched)")
            losses[step] = m["train/loss"]
            watchdog.beat()  # a step completed (the first beat arms it: compilation is not counted)
            return m

        clock = {"t": 0.0, "step": start + 1, "aside": 0.0}  # for throughput: since the last log line, less the
        profile = profile_range(cfg)                          # time eval, saves and samples took
        stop = guard.StopSignals()  # SIGTERM / SIGINT / SIGUSR1: finish the step, save, exit 75
        watchdog = guard.Watchdog(cfg.watchdog_s, run_dir)
        try:
            for step in range(start + 1, end + 1):
                if profile and step == profile[0]:
                    jax.profiler.start_trace(os.path.join(run_dir, "profile"))
                batch = to_device(loader.next(), mesh, (cfg.grad_accum,))
                state, m = train_step(state, batch)
                saver.check()  # a background save that failed stops the run here
                if pending is not None:
                    fetch()  # the step before, while this one runs
                pending = (step, m)
                first, stopping = step == start + 1, step != end and stop.requested()  # every process agrees
                log_now, eval_now = first or due(cfg.log_every, step), due(cfg.eval_every, step)
                save_now, sample_now = due(cfg.save_every, step) or stopping, due(cfg.sample_every, step)
                sample_now = sample_now and cfg.sample_tokens > 0 and corpus.tokenizer is not None
                profile_end = profile and step == profile[1]
                if not (log_now or eval_now or save_now or sample_now or profile_end):
                    continue
                row = fetch()  # this step's metrics and state are needed now
                if profile_end:
                    jax.block_until_ready(state)
                    jax.profiler.stop_trace()
                    if jax.process_index() == 0:  # the compiled program's text: which scope each op comes from
                        with open(os.path.join(run_dir, "profile", "jit_train_step.hlo.txt"), "w") as f:
                            f.write(train_step.lower(state, batch).compile().as_text())
                    log.write(f"profile of steps {profile[0]}-{profile[1]}: {run_dir}/profile; the top ops: "
                              f"python tools/profile_top.py {run_dir}/profile")
                if first:  # compiled and run once: throughput counts from here
                    clock.update(t=time.perf_counter(), step=step, aside=0.0)
                    log.record("kernels", kernels.choices())  # the backends the compiled step uses, per op
                t_aside = time.perf_counter()
                if eval_now:
                    row |= evaluate_sets(eval_step, eval_params(state), evals, mesh)  # eval/loss, eval/<name>/loss, .../bpb
                    val_loss = row["eval/loss"]
                clock["aside"] += time.perf_counter() - t_aside
                if log_now or eval_now:  # logged before the save: a checkpoint's step always has its row
                    if step > clock["step"]:
                        tok_s = tokens_per_step * (step - clock["step"]) / (time.perf_counter() - clock["t"] - clock["aside"])
                        row |= {"throughput/tokens_per_second": tok_s,
                                "throughput/mfu": flops.mfu(fpt, tok_s, mesh.size, peak)}
                        clock.update(t=time.perf_counter(), step=step, aside=0.0)
                    log.log(step, row)
                    shown = {label: format(row[k], f) for k, (label, f) in SHOWN.items() if k in row}
                    log.progress(step, **shown)
                    log.write(f"step {step:6d}  " + "  ".join(f"{k} {v}" for k, v in shown.items()) + f"  ({peak_src})")
                t_aside = time.perf_counter()
                if save_now:
                    path = save(step, state)
                if sample_now:  # every process takes part, one prints
                    text = sample(state["params"], cfg, corpus, mesh, cfg.sample_tokens, jax.random.key(cfg.seed + 1))
                    log.write(f"--- sample after {step} steps ---\n{text}\n---")
                clock["aside"] += time.perf_counter() - t_aside
                if stopping:
                    saver.wait()
                    log.write(f"stopped by a signal after step {step}: saved {path}; exiting with code "
                              f"{guard.EXIT_PREEMPTED}. Continue with --resume true --run_dir {run_dir}")
                    raise Preempted(f"preempted after step {step}; checkpoint {path}")
            saver.wait()  # the last save is complete before the run ends
        finally:
            saver.close()  # an error on the way out: the save in flight still ends (or is reported)
            watchdog.stop()
            stop.restore()
            log.close()
            lock.release()
    return {"run_dir": run_dir, "losses": losses, "val_loss": val_loss, "step": end, "sample": text,
            "state": state}


if __name__ == "__main__":
    config = cli.parse(TrainConfig, HERE)
    try:
        main(config)
    except Preempted as e:
        print(e, file=sys.stderr)
        sys.exit(guard.EXIT_PREEMPTED)
    except (model.ConfigError, optim.OptimError, data.DataError, TrainingError, checkpoint.CheckpointError, guard.RunLockError) as e:
        sys.exit(f"error: {e}")
