#!/usr/bin/env python3
"""Time a variant's jitted train step against the plainest JAX step of the same math.

    python tools/bench/bench_step.py                                   # dense, CPU default config
    python tools/bench/bench_step.py --model.d_model 512 --model.head_dim 64 --model.d_ff 1536
    python tools/bench/bench_step.py --variant swa_hybrid --no-reference   # step time and peak fraction only
    python tools/bench/bench_step.py --variant swa_hybrid --attention-backends blocked,reference
    python tools/bench/bench_step.py --help

Flags this tool does not know go to the variant's TrainConfig, exactly as for its train.py
(`--preset NAME` too). The step runs on one device.

What it does, in one process:
1. Builds the variant's `make_train_step` (A) and, for dense, `plain_step` below (B): the
   same network written the plainest way (full [B, T, V] logits and optax's cross-entropy,
   `jax.nn.dot_product_attention` with a causal-and-same-document mask, the same remat
   policy and scan, optax AdamW with clipping). A second, separately compiled copy of A
   (A') gives the A/A noise.
2. Checks A and B compute the same thing before timing them: the loss and every gradient
   of one batch, and the parameters after one optimizer step (rtol 2e-4 in fp32).
3. Interleaved rounds A, B, A' (the order rotates each round), each `--steps-per-round`
   steps on the same batch; per round it records wall and process CPU seconds per step, and
   measures a large fp32 matmul for the in-process peak. Prints medians, the per-round
   ratios A/B and A/A' (median, min, max), and the fraction of the best in-process matmul
   peak that A reaches (model FLOPs from the variant's `flops_per_token`, remat not counted).

With `--attention-backends X,Y,...` the arms are instead the variant's step with each
attention backend named on every attention layer (`attention_backend`, and
`local_attention_backend` where the variant has one), plus a second compile of the first
(the noise floor); each arm's tokens/s and its per-round ratio to the last arm are printed.
This is how a change of `auto`'s choice is measured: the old choice against the new one.

The machine is shared: quote the median ratios, with the A/A' spread as the noise floor.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from shared import cli, flops  # noqa: E402
from shared.variant import load  # noqa: E402

RTOL = 2e-4


# ---------------------------------------------------------------- the plainest dense step


def plain_loss(params, batch, mc):
    """Dense's loss, written the plainest way: no kernels, no sharding, full logits."""
    tokens, seg = batch["tokens"], batch["segment_ids"]
    B, T = tokens.shape
    H, K, hd = mc.n_heads, mc.n_kv_heads, mc.head_dim
    dt = jnp.dtype(mc.compute_dtype)

    def norm(x, w):
        x32 = x.astype(jnp.float32)
        return (x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, -1, keepdims=True) + mc.norm_eps) * w).astype(x.dtype)

    t = jnp.broadcast_to(jnp.arange(T), (B, T))
    starts = (t == 0) | (seg != jnp.roll(seg, 1, axis=1))
    pos = t - jax.lax.cummax(jnp.where(starts, t, 0), axis=1)
    half = hd // 2
    ang = pos[..., None].astype(jnp.float32) * mc.rope_theta ** (-jnp.arange(half, dtype=jnp.float32) / half)
    cos, sin = jnp.cos(ang)[:, :, None], jnp.sin(ang)[:, :, None]

    def rope(x):
        x1, x2 = x[..., :half].astype(jnp.float32), x[..., half:].astype(jnp.float32)
        return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1).astype(x.dtype)

    mask = (t[:, :, None] >= t[:, None, :]) & (seg[:, :, None] == seg[:, None, :])  # [B, T, S]

    def layer(x, p):
        h = norm(x, p["attn_norm"])
        q = rope((h @ p["wq"].astype(dt)).reshape(B, T, H, hd))
        k = rope((h @ p["wk"].astype(dt)).reshape(B, T, K, hd))
        v = (h @ p["wv"].astype(dt)).reshape(B, T, K, hd)
        o = jax.nn.dot_product_attention(q, k, v, mask=mask[:, None])
        x = x + o.reshape(B, T, H * hd) @ p["wo"].astype(dt)
        h = norm(x, p["mlp_norm"])
        return x + (jax.nn.silu(h @ p["w_gate"].astype(dt)) * (h @ p["w_up"].astype(dt))) @ p["w_down"].astype(dt), None

    policy = {
        "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
        "full": jax.checkpoint_policies.nothing_saveable,
    }.get(mc.remat)
    x, _ = jax.lax.scan(
        jax.checkpoint(layer, policy=policy) if policy else layer, params["embed"][tokens].astype(dt), params["layers"]
    )
    x = norm(x, params["final_norm"])
    w_out = params["embed"].T if mc.tie_embeddings else params["unembed"]
    logits = jnp.einsum("btd,dv->btv", x, w_out.astype(dt), preferred_element_type=jnp.float32)
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"])
    n = jnp.maximum(jnp.sum(batch["loss_mask"]), 1.0)
    loss = jnp.sum(ce * batch["loss_mask"]) / n
    if mc.z_loss:
        loss = loss + mc.z_loss * jnp.sum(jax.nn.logsumexp(logits, -1) ** 2 * batch["loss_mask"]) / n
    return loss


def plain_optimizer(tc, warmup: int):
    """optax AdamW with clipping, weight decay on every weight but the norms (dense's roles: matrices,
    embeddings decayed; norms not). `warmup`: the warmup steps train.py resolves (`train.warmup(tc)`)."""
    schedule = optax.warmup_cosine_decay_schedule(0.0, tc.lr, warmup, tc.steps, tc.lr * tc.min_lr_ratio)
    decay = lambda ps: jax.tree_util.tree_map_with_path(lambda p, _: "norm" not in jax.tree_util.keystr(p), ps)  # noqa: E731
    opt = optax.adamw(schedule, tc.beta1, tc.beta2, weight_decay=tc.weight_decay, mask=decay)
    return optax.chain(optax.clip_by_global_norm(tc.grad_clip), opt) if tc.grad_clip > 0 else opt


def plain_state(tc, warmup: int, params):
    """B's state on one plain device: the weights and plain_optimizer's state."""
    params = unsharded(params)
    return {"params": params, "opt": plain_optimizer(tc, warmup).init(params), "step": jnp.zeros((), jnp.int32)}


def plain_step(tc, warmup: int):
    """The plainest train step for dense: value_and_grad, optax AdamW with clipping, no accumulation."""
    opt = plain_optimizer(tc, warmup)

    def step(state, batch):
        loss, g = jax.value_and_grad(plain_loss)(state["params"], batch, tc.model)
        updates, o = opt.update(g, state["opt"], state["params"])
        return {"params": optax.apply_updates(state["params"], updates), "opt": o, "step": state["step"] + 1}, loss

    return jax.jit(step, donate_argnums=0)


# ---------------------------------------------------------------- data, checks, timing


def synthetic_batch(tc, seed=0):
    """One batch of random tokens packed as documents of random length (segment ids, loss mask)."""
    rng = np.random.default_rng(seed)
    B, T, V = tc.batch_size, tc.seq_len, tc.model.vocab_size
    row = rng.integers(0, V, (B, T + 1), dtype=np.int32)
    seg = np.cumsum(rng.random((B, T + 1)) < 4.0 / T, axis=1).astype(np.int32)
    tokens, targets = row[:, :-1], row[:, 1:]
    mask = (seg[:, :-1] == seg[:, 1:]).astype(np.float32)
    return {"tokens": tokens, "targets": targets, "segment_ids": seg[:, :-1], "loss_mask": mask}


def check_same(train, tc, params, batch, dev_batch, accum_batch, mesh):
    """A's and B's losses, gradients and one-step parameters agree (raises with the worst leaf)."""
    la, ga = jax.jit(jax.value_and_grad(lambda p: train.model.loss_fn(p, dev_batch, tc.model)[0]))(params)
    lb, gb = jax.jit(jax.value_and_grad(lambda p: plain_loss(p, batch, tc.model)))(unsharded(params))
    worst = []

    def cmp(what, a, b):
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        err = np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-30)
        worst.append((err, what))

    cmp("loss", la, lb)
    for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(ga)[0], jax.tree.leaves(gb)):
        cmp("grad" + jax.tree_util.keystr(path), a, b)
    opt, sched = train.make_optimizer(tc)
    sa = {"params": params, "opt": opt.init(params), "step": jnp.zeros((), jnp.int32)}
    sa = jax.tree.map(jnp.copy, sa)
    sb = plain_state(tc, train.warmup(tc), params)
    sa, _ = train.make_train_step(tc, opt, sched)(sa, accum_batch)
    sb, _ = plain_step(tc, train.warmup(tc))(sb, batch)
    for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(sa["params"])[0], jax.tree.leaves(sb["params"])):
        cmp("step1" + jax.tree_util.keystr(path), a, b)
    err, what = max(worst)
    if not err <= RTOL:
        raise SystemExit(f"error: the two steps differ: {what} max relative error {err:.2e} > {RTOL:g}")
    return float(la), err


def unsharded(tree):
    """A copy on one plain device, without the mesh's axis names (for the plain step)."""
    return jax.device_put(jax.tree.map(np.asarray, tree), jax.devices()[0])


def matmul_peak(n=1024):
    """FLOP/s of one n x n fp32 matmul on this process's device, now (best of 3)."""
    return (
        flops.measure_cpu_peak(n, repeats=3) if jax.devices()[0].platform == "cpu" else flops.device_peak("float32")[0]
    )


def time_arm(step, state, batch, k):
    """Run k steps; (state, wall s/step, cpu s/step)."""
    w0, c0 = time.perf_counter(), time.process_time()
    for _ in range(k):
        state, out = step(state, batch)
    jax.block_until_ready((state, out))
    return state, (time.perf_counter() - w0) / k, (time.process_time() - c0) / k


def setup(folder: str, flags: list[str]):
    """(train module, TrainConfig from `flags` as for its train.py, one-device mesh) for a variant folder."""
    train = load(os.path.join(ROOT, folder, "train.py"))
    tc = cli.parse(train.TrainConfig, os.path.join(ROOT, folder), flags)
    one = {"mesh_data": 1, "mesh_model": 1, **({"mesh_expert": 1} if hasattr(tc, "mesh_expert") else {})}
    tc = dataclasses.replace(tc, **one)
    return train, tc, train.make_mesh(tc, devices=jax.devices()[:1])


def attention_backend(tc, name: str):
    """tc with attention backend `name` on every attention layer (ValueError if the config refuses it)."""
    local = {"local_attention_backend": name} if hasattr(tc.model, "local_attention_backend") else {}
    return dataclasses.replace(tc, model=dataclasses.replace(tc.model, attention_backend=name, **local))


def med(xs):
    return statistics.median(xs)


def summary(name, xs, unit="ms", scale=1e3):
    return f"{name:<28} median {med(xs) * scale:9.2f} {unit}  (min {min(xs) * scale:.2f}, max {max(xs) * scale:.2f})"


def ratios(a, b):
    r = [x / y for x, y in zip(a, b)]
    return f"median {med(r):.3f}x  (min {min(r):.3f}, max {max(r):.3f}, {len(r)} rounds)"


def main(argv=None):
    ap = argparse.ArgumentParser(
        prog="python tools/bench/bench_step.py",
        description=__doc__.split("\n\n")[0],
        epilog=__doc__.split("\n\n", 1)[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--variant", default="dense", help="folder under variants/ (or templates/base); default dense")
    ap.add_argument("--rounds", type=int, default=9, help="interleaved rounds (default 9)")
    ap.add_argument("--steps-per-round", type=int, default=3, help="steps timed per arm per round (default 3)")
    ap.add_argument(
        "--no-reference",
        action="store_true",
        help="skip the plain step (it is written for dense's math only): time the variant alone",
    )
    ap.add_argument("--check-only", action="store_true", help="check the two steps agree, then stop")
    ap.add_argument(
        "--attention-backends",
        default="",
        help="comma-separated attention backends: time the variant's step with each (named on every "
        "attention layer) side by side, instead of against the plain step; ratios to the last",
    )
    args, rest = ap.parse_known_args(argv)
    if args.rounds < 1 or args.steps_per_round < 1:
        ap.error("--rounds and --steps-per-round must be >= 1")
    folder = args.variant if "/" in args.variant else f"variants/{args.variant}"
    if not os.path.isfile(os.path.join(ROOT, folder, "train.py")):
        ap.error(f"no train.py in {folder}")
    backends = [b.strip() for b in args.attention_backends.split(",") if b.strip()]
    reference = not args.no_reference and not backends
    if reference and folder != "variants/dense":
        ap.error(f"the plain step is written for variants/dense's math; for {folder} pass --no-reference")
    train, tc, mesh = setup(folder, rest)
    try:
        with_backend = {b: attention_backend(tc, b) for b in backends}
    except ValueError as e:  # the config refuses a backend for this variant's layers
        ap.error(str(e))

    batch = synthetic_batch(tc)
    with jax.set_mesh(mesh):
        sharding = NamedSharding(mesh, P())
        accum = {k: jax.device_put(v.reshape(tc.grad_accum, -1, v.shape[-1]), sharding) for k, v in batch.items()}
        dev_batch = {k: jax.device_put(v, sharding) for k, v in batch.items()}
        plain_batch = unsharded(batch)
        opt, sched = train.make_optimizer(tc)
        state0 = jax.jit(lambda k: train.init_state(tc, opt, k))(jax.random.key(tc.seed))
        params = state0["params"]
        fpt = train.model.flops_per_token(tc.model, tc.seq_len)
        tokens = tc.batch_size * tc.seq_len
        print(
            f"{folder}: {train.model.num_params(tc.model) / 1e6:.2f}M params, batch {tc.batch_size} x {tc.seq_len}, "
            f"d_model {tc.model.d_model}, {fpt / 1e6:.1f} MFLOP/token, {jax.devices()[0].device_kind}, "
            f"{os.cpu_count()} CPUs"
        )
        if reference:
            loss, err = check_same(train, tc, params, plain_batch, dev_batch, accum, mesh)
            print(
                f"check: loss {loss:.5f}; losses, gradients and one-step parameters of A and B agree "
                f"(max relative error {err:.1e} <= {RTOL:g})"
            )
            if args.check_only:
                return 0

        if backends:
            arms = {f"attention={b}": (train.make_train_step(with_backend[b], opt, sched), accum) for b in backends}
            arms[f"attention={backends[0]}, again"] = (
                train.make_train_step(with_backend[backends[0]], opt, sched),
                accum,
            )
            a, a2 = f"attention={backends[0]}", f"attention={backends[0]}, again"
        else:
            arms = {
                "A  variant step": (train.make_train_step(tc, opt, sched), accum),
                "A' variant step, again": (train.make_train_step(tc, opt, sched), accum),
            }
            a, a2 = "A  variant step", "A' variant step, again"
        if reference:
            arms["B  plain JAX step"] = (plain_step(tc, train.warmup(tc)), plain_batch)
        states = {
            name: plain_state(tc, train.warmup(tc), state0["params"])
            if name.startswith("B")
            else jax.tree.map(jnp.copy, state0)
            for name in arms
        }
        for name, (step, b) in arms.items():  # compile + warm up
            states[name], _, _ = time_arm(step, states[name], b, 2)
        wall = {n: [] for n in arms}
        cpu = {n: [] for n in arms}
        peaks = []
        names = list(arms)
        for r in range(args.rounds):
            for name in names[r % len(names) :] + names[: r % len(names)]:
                step, b = arms[name]
                states[name], w, c = time_arm(step, states[name], b, args.steps_per_round)
                wall[name].append(w)
                cpu[name].append(c)
            peaks.append(matmul_peak())
        print(f"\nper step, {args.rounds} interleaved rounds of {args.steps_per_round} steps:")
        for name in names:
            print(summary(name + " wall", wall[name]))
            print(summary(name + " cpu", cpu[name]))
        print(f"\nA/A' (noise)   wall {ratios(wall[a], wall[a2])}")
        print(f"               cpu  {ratios(cpu[a], cpu[a2])}")
        if backends:
            last = f"attention={backends[-1]}"
            for b in backends:
                name = f"attention={b}"
                print(
                    f"{name:<28} {tokens / med(wall[name]):7.0f} tokens/s (median wall); / {last}: "
                    f"wall {ratios(wall[name], wall[last])}; cpu {ratios(cpu[name], cpu[last])}"
                )
        if reference:
            b = "B  plain JAX step"
            print(f"A/B            wall {ratios(wall[a], wall[b])}")
            print(f"               cpu  {ratios(cpu[a], cpu[b])}")
        peak = max(peaks)
        achieved = fpt * tokens / med(wall[a])
        print(
            f"\nA: {achieved / 1e9:.1f} GFLOP/s (model FLOPs) = {achieved / peak:.1%} of the best in-process "
            f"fp32 matmul ({peak / 1e9:.1f} GFLOP/s best, {med(peaks) / 1e9:.1f} median over the rounds)"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
