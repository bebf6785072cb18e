"""The dropless grouped matmul on CPU: ragged (jax.lax.ragged_dot) against tiled, interleaved.

    python variants/moe_hero/bench_dispatch.py                 # CPU default shape, about 2 minutes on 2 cores
    python variants/moe_hero/bench_dispatch.py --rounds 7 --tiles 128 256 --no-step

On one device, at the CPU default (ModelConfig(), TrainConfig's batch_size x seq_len tokens):
1. the routed experts alone: forward + backward (gradients of the rows and the three expert
   weights) of the grouped matmul on the tokens x top_k assignments sorted by expert
   (a uniform random choice), ragged against tiled at each `--tiles` (and the tile
   `expert_tile` picks);
2. the whole train step (train.make_train_step on random tokens) with
   expert_matmul = ragged against tiled.
Each round runs every candidate once (`--reps` calls of part 1, `--steps` steps of part 2),
in the same order; a table gives the median time and, per round, ragged's time over the
candidate's (median, min-max over rounds), and expert_flops_ratio: FLOPs the expert matmuls
execute / their active FLOPs. The machine is shared: quote the per-round ratios.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from shared.variant import sibling

train = sibling(__file__, "train")
model = train.model


def interleave(candidates: dict, rounds: int, calls: int) -> dict:
    """{name: run()} -> {name: [seconds per call, one per round]}, every round through all names."""
    times = {name: [] for name in candidates}
    for _ in range(rounds):
        for name, run in candidates.items():
            t0 = time.perf_counter()
            for _ in range(calls):
                run()
            times[name].append((time.perf_counter() - t0) / calls)
    return times


def table(title: str, times: dict, flops_ratio: dict) -> None:
    print(f"\n{title}")
    print(f"{'path':>12} | {'median ms':>10} | {'ragged / this (min-max)':>24} | {'executed / active FLOPs':>23}")
    base = times["ragged"]
    for name, t in times.items():
        r = [b / x for b, x in zip(base, t)]
        spread = f"{statistics.median(r):.2f} ({min(r):.2f}-{max(r):.2f})"
        print(f"{name:>12} | {statistics.median(t) * 1e3:>10.1f} | {spread:>24} | {flops_ratio[name]:>23.2f}")


def bench_experts(mc, tokens: int, tiles: list[int], rounds: int, reps: int) -> None:
    A, D, F, E = tokens * mc.top_k, mc.d_model, mc.d_expert, mc.n_experts
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((A, D)), jnp.float32)
    wg, wu = (jnp.asarray(rng.normal(0, 0.1, (E, D, F)), jnp.float32) for _ in range(2))
    wd = jnp.asarray(rng.normal(0, 0.1, (E, F, D)), jnp.float32)
    sizes = jnp.asarray(np.bincount(rng.integers(0, E, A), minlength=E), jnp.int32)
    auto = model.expert_tile(A, E)
    paths = {"ragged": functools.partial(model._experts_grouped, matmul="ragged")}
    ratio = {"ragged": float(E)}  # every row times every expert
    for m in sorted(set(tiles) | {auto}):
        name = f"tiled {m}" + ("*" if m == auto else "")
        paths[name] = functools.partial(model._experts_tiled, tile=m)
        ratio[name] = m * model.n_tiles(A, E, m) / A
    args = (x, sizes, wg, wu, wd)
    grad = lambda f: jax.jit(jax.grad(lambda *a: jnp.sum(f(*a) ** 2), argnums=(0, 2, 3, 4)))  # noqa: E731
    steps = {name: grad(f) for name, f in paths.items()}
    want = steps["ragged"](*args)
    for name, f in steps.items():  # the same gradients, or the timing means nothing
        for a, b in zip(f(*args), want):
            np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5 * float(jnp.max(jnp.abs(b))), err_msg=name)
    times = interleave({name: (lambda f=f: jax.block_until_ready(f(*args))) for name, f in steps.items()}, rounds, reps)
    table(
        f"1. routed experts alone, fwd+bwd: {A} rows ({tokens} tokens x top_k {mc.top_k}), {E} experts, "
        f"d_model {D}, d_expert {F} (* = the tile expert_tile picks)",
        times,
        ratio,
    )


def bench_step(cfg, rounds: int, steps: int) -> None:
    mesh = train.make_mesh(cfg, jax.devices()[:1])
    optimizer, schedule = train.make_optimizer(cfg)
    rng = np.random.default_rng(0)
    B, T = cfg.batch_size, cfg.seq_len
    toks = rng.integers(0, cfg.model.vocab_size, (B, T + 1)).astype(np.int32)
    host = {
        "tokens": toks[:, :-1],
        "targets": toks[:, 1:],
        "segment_ids": np.zeros((B, T), np.int32),
        "loss_mask": np.ones((B, T), np.float32),
    }
    runs, ratio = {}, {}
    with jax.set_mesh(mesh):
        batch = train.to_device(host, mesh, (cfg.grad_accum,))
        for path in ("ragged", "tiled"):
            c = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, expert_matmul=path))
            step = train.make_train_step(c, optimizer, schedule)
            box = [jax.jit(lambda k, c=c: train.init_state(c, optimizer, k))(jax.random.key(0))]

            def run(step=step, box=box):
                box[0], m = step(box[0], batch)
                jax.block_until_ready(m)

            run()  # compile
            runs[path] = run
            ratio[path] = model.expert_flops_ratio(c.model, B * T // cfg.grad_accum, "cpu")
        times = interleave(runs, rounds, steps)
    table(f"2. train step (make_train_step), {B} x {T} tokens, one device, remat {cfg.model.remat}", times, ratio)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--reps", type=int, default=2, help="calls per round in part 1")
    ap.add_argument("--steps", type=int, default=1, help="train steps per round in part 2")
    ap.add_argument("--tiles", type=int, nargs="+", default=[64, 128, 256, 512])
    ap.add_argument("--batch_size", type=int, default=train.TrainConfig.batch_size)
    ap.add_argument("--seq_len", type=int, default=train.TrainConfig.seq_len)
    ap.add_argument("--no-step", dest="step", action="store_false", help="part 1 only")
    a = ap.parse_args()
    cfg = train.TrainConfig(batch_size=a.batch_size, seq_len=a.seq_len)
    print(
        f"moe_hero grouped matmul, fp32, {jax.devices()[0].platform}, {os.cpu_count()} CPUs; "
        f"auto picks {model.expert_matmul(cfg.model, jax.default_backend())} here"
    )
    bench_experts(cfg.model, a.batch_size * a.seq_len, a.tiles, a.rounds, a.reps)
    if a.step:
        bench_step(cfg, a.rounds, a.steps)


if __name__ == "__main__":
    main()
