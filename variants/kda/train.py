"""Train the kda variant (Kimi Delta Attention layers, a softmax-attention layer every global_every).

    python variants/kda/train.py                      # CPU default: a few minutes on 2 cores
    python variants/kda/train.py --preset 1b_8k       # an accelerator shape (presets/*.yaml)
    python variants/kda/train.py --resume true        # continue the newest run of this variant
    python variants/kda/train.py --help               # every setting

Copied from variants/dense/train.py; only this docstring and the weight-decay mask (no decay on the
forget gate's A_log and dt_bias) differ.

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
    seq_len: int = 128  # tokens per row
    batch_size: int = 32  # rows per optimizer step, over all devices
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
    mesh_data: int = -1  # size of the `data` (FSDP) mesh axis; -1 = all devices / mesh_model
    mesh_model: int = 1  # size of the `model` (tensor-parallel) mesh axis
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
        check(self.mesh_data == -1 or self.mesh_data > 0, "mesh_data", f"must be -1 or positive, got {self.mesh_data}")
        check(self.eval_every > 0 and self.log_every > 0, "eval_every", "eval_every and log_every must be positive")
        check(self.watchdog_s >= 0, "watchdog_s", f"must be >= 0 (0 = off), got {self.watchdog_s}")
        check(not self.checkpoint_dir or not checkpoint.location_error(self.checkpoint_dir), "checkpoint_dir",
              str(checkpoint.location_error(self.checkpoint_dir or ".")))


# What the contract test (tests/test_contract.py) runs on 8 CPU devices: the CPU default at 32
# tokens a row and 8 rows on a data x model = 4 x 2 mesh, with these overrides on top ("model": {...}
# for ModelConfig fields). A copy that adds a path the default never reaches at that size (a window
# shorter than the row, several chunks, another mesh axis) sets it here, so the contract runs it.
CONTRACT_TINY: dict = {"model": {"chunk_size": 8}}  # four KDA chunks per 32-token row: the state crosses chunks


# ---------------------------------------------------------------- mesh, optimizer, steps

def make_mesh(cfg: TrainConfig, devices=None):
    """The (data, model) mesh. `devices`: the devices to use (default: all of them), or a number of
    devices, for an AbstractMesh that traces a preset at its real scale on a machine without them."""
    devices = jax.devices() if devices is None else devices
    n, tp = (devices if isinstance(devices, int) else len(devices)), cfg.mesh_model
    dp = n // tp if cfg.mesh_data == -1 else cfg.mesh_data
    check(dp * tp == n, "mesh_data", f"mesh {dp} (data) x {tp} (model) does not use exactly the {n} devices")
    micro = cfg.batch_size // cfg.grad_accum
    check(micro % dp == 0, "batch_size",
          f"micro-batch batch_size/grad_accum={micro} is not divisible by the data axis ({dp} devices)")
    m = cfg.model
    for name, size in (("n_kv_heads", m.n_kv_heads), ("d_ff", m.d_ff), ("vocab_size", m.vocab_size)):
        check(size % tp == 0, f"model.{name}", f"{size} is not divisible by mesh_model={tp}")
    check(m.d_model % dp == 0, "model.d_model", f"{m.d_model} is not divisible by the data axis ({dp})")
    if isinstance(devices, int):
        return AbstractMesh((dp, tp), ("data", "model"), axis_types=(AxisType.Explicit,) * 2)
    return jax.make_mesh((dp, tp), ("data", "model"), axis_types=(AxisType.Explicit,) * 2, devices=devices)


def warmup(cfg: TrainConfig) -> int:
    """Warmup steps: `warmup_steps`, or for -1 min(20, steps // 10), which is below `steps` for any run length."""
    return cfg.warmup_steps if cfg.warmup_steps >= 0 else min(20, cfg.steps // 10)


def make_optimizer(cfg: TrainConfig):
    schedule = optax.warmup_cosine_decay_schedule(0.0, cfg.lr, warmup(cfg), cfg.steps, cfg.lr * cfg.min_lr_ratio)
    no_decay = ("norm", "A_log", "dt_bias")  # norms, and the KDA forget gate's rate and bias (as in Kimi Linear)
    decay = lambda params: jax.tree_util.tree_map_with_path(  # noqa: E731
        lambda path, _: not any(n in jax.tree_util.keystr(path) for n in no_decay), params)
    adamw = optax.adamw(schedule, cfg.beta1, cfg.beta2, weight_decay=cfg.weight_decay, mask=decay)
    opt = optax.chain(optax.clip_by_global_norm(cfg.grad_clip), adamw) if cfg.grad_clip > 0 else adamw
    return opt, schedule


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
        new = {"params": optax.apply_updates(params, updates), "opt": opt, "step": state["step"] + 1}
        out = {"loss": jnp.sum(ms["loss"] * ms["tokens"]) / total, "z": jnp.sum(ms["z"] * ms["tokens"]) / total,
               "grad_norm": optax.tree.norm(grads), "lr": schedule(state["step"])}
        return new, out

    return jax.jit(train_step, donate_argnums=0)


def make_eval_step(cfg: TrainConfig):
    @jax.jit
    def eval_step(params, batch):
        _, m = model.loss_fn(params, batch, cfg.model)
        return m["loss"] * m["tokens"], m["tokens"]

    return eval_step


def batch_spec(leading: int = 0) -> P:
    """PartitionSpec of a batch array [*leading axes, rows, T]: rows over `data`. The loop and the
    contract test (tests/test_contract.py) both place batches with it."""
    return P(*([None] * leading), "data", None)


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
    rows = mesh.shape["data"]
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
                    settle(*pending)
                    pending = None
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
                           "mfu": flops.mfu(fpt, tok_s, mesh.size, peak)}
                    if step % cfg.eval_every == 0 or step == end:
                        val_loss = evaluate(eval_step, state["params"], val, mesh)
                        row["val_loss"] = val_loss
                    log.log(step, row)
                    log.progress(step, loss=row["loss"], tok_s=f"{tok_s:,.0f}", mfu=f"{row['mfu']:.1%}")
                    log.write(f"step {step:6d}  loss {row['loss']:.4f}  "
                              + (f"val {val_loss:.4f}  " if "val_loss" in row else "")
                              + f"{tok_s:,.0f} tok/s  MFU {row['mfu']:.1%} ({peak_src})")
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
