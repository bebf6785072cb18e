#!/usr/bin/env python3
"""Time attention backends side by side in one process at one shape, forward and forward + backward.

    python tools/bench/bench_attention.py --shape 8,512,4,2,32                  # blocked against reference
    python tools/bench/bench_attention.py --shape 16,256,4,2,32 --window 64     # swa_hybrid's local layers
    python tools/bench/bench_attention.py --shape 32,128,4,2,32 --backends blocked@16,blocked@32,reference
    python tools/bench/bench_attention.py --help

--shape is B,T,H,Hkv,D (batch, tokens, query heads, kv heads, head_dim); the call is causal,
with a window if --window is given, soft-capping if --softcap is, and packed documents
(--segments documents of random lengths per row, as the loader packs them; 0 for none).
A backend is a name of shared/kernels/attention.py's registry, run through
`kernels.attention(..., backend=NAME)` exactly as a variant calls it; `blocked@N` is the
blocked backend with N-token blocks (for choosing its block size).

What it does, in one process on one device:
1. Jits, for each backend, the forward (out) and the forward + backward (the gradients of
   sum(out * ct) with respect to q, k and v), and checks every backend against the last
   one before timing: the largest error of the output and of each gradient relative to
   its largest value. It refuses to time backends that disagree (1e-4 in float32,
   3e-2 in bfloat16), and reports a backend that refuses the call with its reason.
2. Interleaved rounds (the order rotates each round): each backend's forward, then its
   forward + backward, each called --calls times; per round the mean time per call.
3. Prints per backend the median over the rounds (with the min and max) and, per round,
   the ratio of each backend's time to the last backend's (the baseline): the median
   ratio with its min and max. The machine is shared: quote the ratios, not the times.
"""

from __future__ import annotations

import argparse
import importlib
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from shared import kernels  # noqa: E402
from shared.kernels.selfcheck import parse_shape  # noqa: E402

BLOCKED = importlib.import_module("shared.kernels.blocked_attention")
A = importlib.import_module("shared.kernels.attention")


def packed_segments(rng, B: int, T: int, docs: int):
    """[B, T] int32 ids of `docs` documents of random lengths per row (None for docs=0)."""
    if docs == 0:
        return None
    cuts = np.stack([np.sort(rng.choice(np.arange(1, T), size=docs - 1, replace=False)) for _ in range(B)])
    return jnp.asarray((np.arange(T)[None, :, None] >= cuts[:, None, :]).sum(-1), jnp.int32)


def backend_fn(name: str, kw: dict):
    """(q, k, v) -> out for one backend name (or blocked@N)."""
    if "@" in name:
        base, _, block = name.partition("@")
        if base != "blocked" or not block.isdigit() or int(block) < 1:
            raise ValueError(f"{name!r}: only the blocked backend takes a block size, as blocked@N with N >= 1")
        return lambda q, k, v: A._blocked(q, k, v, block=int(block), **kw)
    if name not in kernels.REGISTRIES["attention"]:
        raise ValueError(f"unknown attention backend {name!r}; known: {sorted(kernels.REGISTRIES['attention'])}")
    return lambda q, k, v: kernels.attention(q, k, v, backend=name, **kw)


def err(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b)) / max(1.0, float(np.max(np.abs(b)))))


def timed(f, args, calls: int) -> float:
    t0 = time.perf_counter()
    for _ in range(calls):
        out = f(*args)
    jax.block_until_ready(out)
    return (time.perf_counter() - t0) / calls


def spread(xs, scale=1.0, fmt="{:.2f}"):
    return f"{fmt.format(statistics.median(xs) * scale)} ({fmt.format(min(xs) * scale)}-{fmt.format(max(xs) * scale)})"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        prog="python tools/bench/bench_attention.py",
        description=__doc__.split("\n\n")[0],
        epilog=__doc__.split("\n\n", 1)[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--shape", required=True, help="B,T,H,Hkv,D, e.g. 8,512,4,2,32")
    ap.add_argument("--window", type=int, default=None, help="sliding window W (t - s < W); default none")
    ap.add_argument("--softcap", type=float, default=0.0, help="logit soft-capping c (default 0 = off)")
    ap.add_argument("--segments", type=int, default=4, help="documents packed per row (default 4; 0 = no segment ids)")
    ap.add_argument(
        "--backends",
        default="blocked,reference",
        help="comma-separated; the last is the baseline of the ratios (default blocked,reference)",
    )
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--rounds", type=int, default=7, help="interleaved rounds (default 7)")
    ap.add_argument("--calls", type=int, default=3, help="calls timed per backend, program and round (default 3)")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    try:
        B, T, H, Hkv, D = parse_shape(a.shape)
    except ValueError as e:
        ap.error(str(e))
    if a.window is not None and a.window < 1:
        ap.error(f"--window must be >= 1, got {a.window}")
    if a.segments < 0 or a.segments > T:
        ap.error(f"--segments must be between 0 and T={T}, got {a.segments}")
    if a.softcap < 0:
        ap.error(f"--softcap must be >= 0, got {a.softcap}")
    if a.rounds < 1 or a.calls < 1:
        ap.error("--rounds and --calls must be >= 1")
    names = [n.strip() for n in a.backends.split(",") if n.strip()]
    if len(names) < 1 or len(set(names)) != len(names):
        ap.error(f"--backends must name distinct backends, got {a.backends!r}")

    rng = np.random.default_rng(a.seed)
    dt = jnp.dtype(a.dtype)
    q, k, v, ct = (
        jnp.asarray(rng.standard_normal(s), dt) for s in ((B, T, H, D), (B, T, Hkv, D), (B, T, Hkv, D), (B, T, H, D))
    )
    seg = packed_segments(rng, B, T, a.segments)
    kw = dict(segment_ids=seg, causal=True, window=a.window, softcap=a.softcap)
    progs = {}
    for name in names:
        try:
            fn = backend_fn(name, kw)
        except ValueError as e:
            ap.error(str(e))
        fwd = jax.jit(fn)
        grad = jax.jit(jax.grad(lambda q, k, v, fn=fn: jnp.sum(fn(q, k, v).astype(jnp.float32) * ct), (0, 1, 2)))
        progs[name] = (fwd, grad)

    dev = jax.devices()[0]
    what = (
        f"attention B{B} T{T} H{H}/{Hkv} D{D} causal"
        + (f" window {a.window}" if a.window else "")
        + (f" softcap {a.softcap:g}" if a.softcap else "")
        + (f", {a.segments} documents a row" if seg is not None else ", no segment ids")
    )
    print(f"{what}, {a.dtype}, {dev.platform} ({dev.device_kind}, {os.cpu_count()} CPUs)")

    outs, refused = {}, {}
    for name, (fwd, grad) in progs.items():
        try:
            outs[name] = (fwd(q, k, v), grad(q, k, v))
        except kernels.KernelError as e:
            if e.refusal is None:
                raise
            refused[name] = e.refusal
            print(f"{name}: refused: {e.refusal}")
    for name in refused:
        del progs[name]
    if not progs:
        print("no backend can run this call")
        return 1
    base = list(progs)[-1]
    tol = 1e-4 if a.dtype == "float32" else 3e-2
    bad = []
    for name in progs:
        if name == base:
            continue
        (y, g), (y0, g0) = outs[name], outs[base]
        e_out, e_grad = err(y, y0), max(err(x, x0) for x, x0 in zip(g, g0))
        print(
            f"check {name} against {base}: out {e_out:.1e}, grads {e_grad:.1e} (largest error relative to "
            f"the largest value)"
        )
        if not (e_out <= tol and e_grad <= tol):
            bad.append(name)
    if bad:
        print(f"error: {bad} disagree with {base} beyond {tol:g}; not timed")
        return 1

    times = {n: {"fwd": [], "fwd+bwd": []} for n in progs}
    order = list(progs)
    for r in range(a.rounds):
        for name in order[r % len(order) :] + order[: r % len(order)]:
            fwd, grad = progs[name]
            times[name]["fwd"].append(timed(fwd, (q, k, v), a.calls))
            times[name]["fwd+bwd"].append(timed(grad, (q, k, v), a.calls))
    print(
        f"\n{a.rounds} interleaved rounds of {a.calls} calls; ms per call, median (min-max) over the rounds; "
        f"ratio to {base} per round, median (min-max)"
    )
    print(f"{'backend':<14} {'fwd ms':>22} {'fwd+bwd ms':>22} {'fwd ratio':>22} {'fwd+bwd ratio':>22}")
    for name in progs:
        cols = [spread(times[name][p], 1e3) for p in ("fwd", "fwd+bwd")]
        cols += [
            spread([x / y for x, y in zip(times[name][p], times[base][p])], fmt="{:.3f}") for p in ("fwd", "fwd+bwd")
        ]
        print(f"{name:<14} " + " ".join(f"{c:>22}" for c in cols))
    return 0


if __name__ == "__main__":
    sys.exit(main())
