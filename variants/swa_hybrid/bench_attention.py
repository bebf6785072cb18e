"""Sliding-window against full causal attention on the reference (XLA) backend.

    python variants/swa_hybrid/bench_attention.py                  # T = 1k..8k, W = 256, on CPU
    python variants/swa_hybrid/bench_attention.py --window 512 --seq 2048 4096 --heads 8

For each row length T: the best wall time of forward + backward (gradients of q, k, v)
over a few runs after a warm-up, and the compiled program's temporary memory
(`memory_analysis().temp_size_in_bytes`). At fixed W the windowed path grows about
linearly in T; full attention grows as T^2.
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp

from shared import kernels


def fwd_bwd(window):
    def loss(q, k, v, ct):
        return jnp.sum(kernels.attention(q, k, v, causal=True, window=window, backend="reference") * ct)

    return jax.jit(jax.grad(loss, (0, 1, 2)))


def measure(f, args, repeats):
    compiled = f.lower(*args).compile()
    temp = compiled.memory_analysis().temp_size_in_bytes
    jax.block_until_ready(compiled(*args))  # warm-up
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(compiled(*args))
        best = min(best, time.perf_counter() - t0)
    return best, temp


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seq", type=int, nargs="+", default=[1024, 2048, 4096, 8192])
    ap.add_argument("--window", type=int, default=256)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--heads", type=int, default=2)
    ap.add_argument("--kv_heads", type=int, default=1)
    ap.add_argument("--head_dim", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=2)
    a = ap.parse_args()
    B, H, Hkv, D, W = a.batch, a.heads, a.kv_heads, a.head_dim, a.window
    print(
        f"reference attention fwd+bwd, fp32, B={B} H={H} Hkv={Hkv} head_dim={D}, window={W}, "
        f"{jax.devices()[0].platform} x{jax.local_device_count()}"
    )
    print(
        f"{'T':>6} | {'window ms':>10} {'window MiB':>11} | {'full ms':>10} {'full MiB':>10} | {'time x':>7} {'mem x':>6}"
    )
    key = jax.random.key(0)
    for T in a.seq:
        kq, kk, kv, kc = jax.random.split(jax.random.fold_in(key, T), 4)
        args = (
            jax.random.normal(kq, (B, T, H, D)),
            jax.random.normal(kk, (B, T, Hkv, D)),
            jax.random.normal(kv, (B, T, Hkv, D)),
            jax.random.normal(kc, (B, T, H, D)),
        )
        tw, mw = measure(fwd_bwd(W), args, a.repeats)
        tf, mf = measure(fwd_bwd(None), args, a.repeats)
        print(
            f"{T:>6} | {tw * 1e3:>10.1f} {mw / 2**20:>11.1f} | {tf * 1e3:>10.1f} {mf / 2**20:>10.1f} | "
            f"{tf / tw:>7.1f} {mf / mw:>6.1f}",
            flush=True,
        )


if __name__ == "__main__":
    main()
