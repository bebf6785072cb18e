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
import os
import sys
import time
from dataclasses import dataclass, field

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import AbstractMesh, AxisType, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from shared import checkpoint, cli, data, distributed, flops, guard, kernels, metrics  # noqa: E402
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
    lr: float = 3e-3  # peak learning rate
    min_lr_ratio: float = 0.1  # final lr = lr * min_lr_ratio (cosine decay)
    warmup_steps: int = -1  # linear warmup steps, in [0, steps); -1 = min(20, steps // 10)
    weight_decay: float = 0.1  # on matrices only, not norms
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0  # global-norm clipping; 0 = off
    mesh_data: int = -1  # size of the `data` (FSDP) mesh axis; -1 = all devices / (mesh_expert * mesh_model)
    mesh_expert: int = 1  # size of the `expert` mesh axis (expert parallelism; also shards batch rows and FSDP)
    mesh_model: int = 1  # size of the `model` (tensor-parallel) mesh axis
    bias_rate: float = 1e-2  # aux-loss-free balancing: bias += bias_rate * sign(mean load - load) each step
    # (1e-2 suits the short CPU default; the presets use DeepSeek-V3's 1e-3 for long runs)
    eval_every: int = 50
    eval_batches: int = 4
    log_every: int = 10
    save_every: int = 100  # also saved at the end; 0 = only at the end
    keep_checkpoints: int = 3
    run_dir: str = ""  # "" = runs/<variant>-<time>; with --resume, the newest runs/<variant>-*
    checkpoint_dir: str = ""  # "" = <run_dir>/checkpoints; or a path, file://, gs://bucket/prefix, s3://bucket/prefix
    resume: bool = False  # continue from the newest good checkpoint in run_dir
    resume_from: str = ""  # continue from this checkpoint: a step of run_dir's, or a checkpoint's path
    watchdog_s: int = 1800  # abort (exit 70, every thread's stack written) if no step completes this long; 0 = off
    wandb: str = "auto"  # auto | online | offline | disabled
    sample_tokens: int = 64  # tokens sampled at the end (0 = no sample)
    sample_prompt: str = "def "
    seed: int = 0

    def __post_init__(self):
        check(self.seq_len > 1, "seq_len", f"must be > 1, got {self.seq_len}")
        check(self.batch_size > 0, "batch_size", f"must be positive, got {self.batch_size}")
        check(self.grad_accum > 0 and self.batch_size % self.grad_accum == 0, "grad_accum",
              f"{self.grad_accum} must divide batch_size={self.batch_size}")
        check(self.steps > 0, "steps", f"must be positive, got {self.steps}")
        check(self.warmup_steps == -1 or 0 <= self.warmup_steps < self.steps, "warmup_steps",
              f"{self.warmup_steps} must be -1 (= min(20, steps // 10)) or in [0, steps={self.steps})")
        check(0 <= self.stop_at <= self.steps, "stop_at", f"{self.stop_at} must be in [0, steps={self.steps}]")
        check(self.lr > 0, "lr", f"must be positive, got {self.lr}")
        check(self.mesh_model > 0, "mesh_model", f"must be positive, got {self.mesh_model}")
        check(self.mesh_expert > 0, "mesh_expert", f"must be positive, got {self.mesh_expert}")
        check(self.bias_rate >= 0, "bias_rate", f"must be >= 0 (0 = no balancing), got {self.bias_rate}")
        check(self.mesh_data == -1 or self.mesh_data > 0, "mesh_data", f"must be -1 or positive, got {self.mesh_data}")
        check(self.eval_every > 0 and self.log_every > 0, "eval_every", "eval_every and log_every must be positive")
        check(self.watchdog_s >= 0, "watchdog_s", f"must be >= 0 (0 = off), got {self.watchdog_s}")
        check(not self.checkpoint_dir or not checkpoint.location_error(self.checkpoint_dir), "checkpoint_dir",
              str(checkpoint.location_error(self.checkpoint_dir or ".")))


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
    """AdamW on every weight but the router bias, which the optimizer leaves alone (`balance_bias` moves it)."""
    schedule = optax.warmup_cosine_decay_schedule(0.0, cfg.lr, warmup(cfg), cfg.steps, cfg.lr * cfg.min_lr_ratio)
    decay = lambda params: jax.tree_util.tree_map_with_path(  # noqa: E731
        lambda path, _: "norm" not in jax.tree_util.keystr(path), params)
    adamw = optax.adamw(schedule, cfg.beta1, cfg.beta2, weight_decay=cfg.weight_decay, mask=decay)
    opt = optax.chain(optax.clip_by_global_norm(cfg.grad_clip), adamw) if cfg.grad_clip > 0 else adamw
    labels = lambda params: jax.tree_util.tree_map_with_path(  # noqa: E731
        lambda path, _: "bias" if "router_bias" in jax.tree_util.keystr(path) else "trained", params)
    return optax.multi_transform({"trained": opt, "bias": optax.set_to_zero()}, labels), schedule


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
    params = model.init(cfg.model, key)
    return {"params": params, "opt": optimizer.init(params), "step": jnp.zeros((), jnp.int32)}


def make_train_step(cfg: TrainConfig, optimizer, schedule):
    """state, batch -> state, metrics. batch leaves are [grad_accum, micro_batch, T]."""

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
        out = {"loss": jnp.sum(ms["loss"] * ms["tokens"]) / total, "z": jnp.sum(ms["z"] * ms["tokens"]) / total,
               "grad_norm": optax.tree.norm(grads), "lr": schedule(state["step"]),
               "router_z": jnp.sum(ms["router_z"] * ms["tokens"]) / total,
               "balance": jnp.sum(ms["balance"] * ms["tokens"]) / total,
               "dropped": jnp.sum(ms["dropped"]) / jnp.sum(ms["assignments"]), "bias_norm": jnp.linalg.norm(bias),
               **load_stats(load)}
        return new, out

    return jax.jit(train_step, donate_argnums=0)


MOE_METRICS = ("router_z", "balance", "dropped", "bias_norm", "load_min", "load_max", "load_cv")


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


def evaluate(eval_step, params, batches, mesh) -> float:
    nll, n = 0.0, 0.0
    for b in batches:
        s, c = eval_step(params, to_device(b, mesh))
        nll, n = nll + float(s), n + float(c)
    return nll / max(n, 1.0)


def sample(params, cfg: TrainConfig, corpus, mesh, n_tokens: int, key) -> str:
    """Temperature-0.8 sampling from `sample_prompt`, recomputing the full row each token."""
    prompt = corpus.encode(cfg.sample_prompt)[: cfg.seq_len - 1] or [corpus.eos_id]
    rows = mesh.shape["data"] * mesh.shape["expert"]
    buf = np.full((rows, cfg.seq_len), corpus.eos_id, np.int32)
    buf[:, : len(prompt)] = prompt

    @jax.jit
    def next_token(params, tokens, i, key):
        logits = model.forward(params, tokens, cfg.model)
        last = jax.lax.dynamic_index_in_dim(logits, i - 1, axis=1, keepdims=False)
        # replicated, so every process can read it (multi-process)
        return jax.sharding.reshard(jax.random.categorical(key, last / 0.8, axis=-1), P())

    tokens = jax.device_put(buf, NamedSharding(mesh, batch_spec()))
    out = list(prompt)
    for i in range(len(prompt), min(len(prompt) + n_tokens, cfg.seq_len)):
        key, sub = jax.random.split(key)
        t = int(np.asarray(next_token(params, tokens, i, sub))[0])
        out.append(t)
        tokens = tokens.at[:, i].set(t)
    return corpus.decode(out)


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
    loader = data.Loader(corpus.train, cfg.seq_len, cfg.batch_size, cfg.data.seed,
                         process_index=jax.process_index(), process_count=jax.process_count())
    val = data.eval_batches(corpus.val, cfg.seq_len, cfg.batch_size // cfg.grad_accum, cfg.eval_batches,
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
                paths = ("source", "tokenizer", "cache_dir") if part == "data" else ()  # content: compared below
                diff = {k: (saved[part].get(k), v) for k, v in now.items() if saved[part].get(k) != v and k not in paths}
                if diff:
                    raise TrainingError(f"--resume: {part} config differs from {last}: {diff} (saved, now)")
            was = saved_meta.get("stream", {})
            diff = {k: (was[k], v) for k, v in stream.items() if k in was and was[k] != v}
            if diff:
                raise TrainingError(f"--resume: the data stream differs from {last}'s: {diff} (saved, now). A changed "
                                    "corpus, tokenizer or seq_len would change the data or the meaning of token ids")
            if saved_meta["step"] >= (cfg.stop_at or cfg.steps):
                raise TrainingError(f"--resume: {last} is at step {saved_meta['step']}, and this run ends at step "
                                    f"{cfg.stop_at or cfg.steps} (--steps / --stop_at): nothing to train")
            abstract = jax.eval_shape(lambda k: init_state(cfg, optimizer, k), key)
            state, meta = checkpoint.restore(last, abstract)
            loader.restore(meta["loader"])
            start = meta["step"]
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

        losses, val_loss, pending = {}, None, None
        t_mark, step_mark = None, None

        def settle(step, m):
            """Fetch step's metrics (one step late, so the host never stalls the device)."""
            m = jax.device_get(m)
            loss, grad_norm = float(m["loss"]), float(m["grad_norm"])
            if not (np.isfinite(loss) and np.isfinite(grad_norm)):  # a non-finite gradient: step's update is bad too
                saver.wait()  # an earlier step's save in flight ends first, so the message names it
                raise TrainingError(f"loss {loss}, grad_norm {grad_norm} at step {step}; stopped without saving. "
                                    f"Last good checkpoint: {checkpoint.latest_name(ckpt_dir)} (untouched)")
            losses[step] = loss
            watchdog.beat()  # a step completed (the first beat arms it: compilation is not counted)
            return m

        stop = guard.StopSignals()  # SIGTERM / SIGINT / SIGUSR1: finish the step, save, exit 75
        watchdog = guard.Watchdog(cfg.watchdog_s, run_dir)
        try:
            for step in range(start + 1, end + 1):
                b = loader.next()
                state, m = train_step(state, to_device(b, mesh, (cfg.grad_accum,)))
                saver.check()  # a background save that failed stops the run here
                if pending is not None:
                    settle(*pending)
                pending = (step, m)
                if step == start + 1:  # exclude compilation from throughput
                    first = settle(*pending)
                    pending = None
                    if step % cfg.log_every and step != end:  # the routing before any balancing (no throughput yet)
                        log.log(step, {"loss": float(first["loss"]), **{k: float(first[k]) for k in MOE_METRICS}})
                    t_mark, step_mark = time.perf_counter(), step
                    log.record("kernels", kernels.choices())  # the backends the compiled step uses, per op
                if step % cfg.log_every == 0 or step == end:
                    if pending is not None:
                        mm = settle(*pending)
                        pending = None
                    else:
                        mm = jax.device_get(m)
                    dt = time.perf_counter() - t_mark
                    tok_s = tokens_per_step * (step - step_mark) / dt if step > step_mark else float("nan")
                    row = {"loss": float(mm["loss"]), "z": float(mm["z"]), "grad_norm": float(mm["grad_norm"]),
                           "lr": float(mm["lr"]), "tokens_per_s": tok_s,
                           "mfu": flops.mfu(fpt, tok_s, mesh.size, peak), **{k: float(mm[k]) for k in MOE_METRICS}}
                    if step % cfg.eval_every == 0 or step == end:
                        val_loss = evaluate(eval_step, state["params"], val, mesh)
                        row["val_loss"] = val_loss
                    log.log(step, row)
                    log.progress(step, loss=row["loss"], tok_s=f"{tok_s:,.0f}", mfu=f"{row['mfu']:.1%}")
                    log.write(f"step {step:6d}  loss {row['loss']:.4f}  "
                              + (f"val {val_loss:.4f}  " if "val_loss" in row else "")
                              + f"{tok_s:,.0f} tok/s  MFU {row['mfu']:.1%} ({peak_src})  "
                              + f"load {row['load_min']:.2f}-{row['load_max']:.2f} cv {row['load_cv']:.3f}  "
                              + f"dropped {row['dropped']:.2%}")
                    t_mark, step_mark = time.perf_counter(), step
                if cfg.save_every and step % cfg.save_every == 0 and step != end:
                    if pending is not None:
                        settle(*pending)
                        pending = None
                    save(step, state)
                if step != end and stop.requested():  # every process stops at the same step
                    if pending is not None:
                        settle(*pending)
                        pending = None
                    path = save(step, state)
                    saver.wait()
                    log.write(f"stopped by a signal after step {step}: saved {path}; exiting with code "
                              f"{guard.EXIT_PREEMPTED}. Continue with --resume true --run_dir {run_dir}")
                    raise Preempted(f"preempted after step {step}; checkpoint {path}")
            if pending is not None:
                settle(*pending)
            if end > start:
                save(end, state)
            saver.wait()
        finally:
            saver.close()  # an error on the way out: the save in flight still ends (or is reported)
            watchdog.stop()
            stop.restore()
            log.close()
            lock.release()

        text = ""
        if cfg.sample_tokens and corpus.tokenizer is not None:  # every process takes part, one prints
            text = sample(state["params"], cfg, corpus, mesh, cfg.sample_tokens, jax.random.key(cfg.seed + 1))
            if jax.process_index() == 0:
                print(f"--- sample after {end} steps ---\n{text}\n---")
    return {"run_dir": run_dir, "losses": losses, "val_loss": val_loss, "step": end, "sample": text,
            "state": state}


if __name__ == "__main__":
    config = cli.parse(TrainConfig, HERE)
    try:
        main(config)
    except Preempted as e:
        print(e, file=sys.stderr)
        sys.exit(guard.EXIT_PREEMPTED)
    except (model.ConfigError, data.DataError, TrainingError, checkpoint.CheckpointError, guard.RunLockError) as e:
        sys.exit(f"error: {e}")
