"""Chunked KDA against full causal softmax attention (the XLA reference), forward + backward.

    python variants/kda/bench_kda.py                       # T = 1k..8k, on CPU, about 2 minutes
    python variants/kda/bench_kda.py --seq 2048 4096 --heads 8 --chunk 32

For each row length T: the best wall time of forward + backward (gradients of every input)
over a few runs after a warm-up, and the compiled program's temporary memory
(`memory_analysis().temp_size_in_bytes`). KDA's cost grows about linearly in T (a fixed
[K, V] state per head, chunks of `chunk` tokens); softmax attention grows as T^2.
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp

from shared import kernels
from shared.kernels.kda import kda


def kda_fwd_bwd(chunk):
    def loss(q, k, v, g, beta, ct):
        return jnp.sum(kda(q, k, v, g, beta, chunk_size=chunk)[0] * ct)

    return jax.jit(jax.grad(loss, (0, 1, 2, 3, 4)))


def attention_fwd_bwd():
    def loss(q, k, v, g, beta, ct):
        return jnp.sum(kernels.attention(q, k, v, causal=True, backend="reference") * ct)

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
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--heads", type=int, default=2)
    ap.add_argument("--head_dim", type=int, default=64)
    ap.add_argument("--chunk", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=2)
    a = ap.parse_args()
    B, H, D = a.batch, a.heads, a.head_dim
    print(
        f"fwd+bwd, fp32, B={B} H={H} head_dim={D}, KDA chunk={a.chunk}, "
        f"{jax.devices()[0].platform} x{jax.local_device_count()}"
    )
    print(f"{'T':>6} | {'kda ms':>9} {'kda MiB':>8} | {'attn ms':>9} {'attn MiB':>9} | {'kda ms/T vs first':>17}")
    key = jax.random.key(0)
    first = None
    for T in a.seq:
        ks = jax.random.split(jax.random.fold_in(key, T), 6)
        unit = lambda x: x / jnp.linalg.norm(x, axis=-1, keepdims=True)  # noqa: E731
        q, k = unit(jax.random.normal(ks[0], (B, T, H, D))), unit(jax.random.normal(ks[1], (B, T, H, D)))
        v = jax.random.normal(ks[2], (B, T, H, D))
        g = -jnp.exp(jax.random.normal(ks[3], (B, T, H, D)) - 3.0)
        beta = jax.nn.sigmoid(jax.random.normal(ks[4], (B, T, H)))
        ct = jax.random.normal(ks[5], (B, T, H, D))
        args = (q, k, v, g, beta, ct)
        tk, mk = measure(kda_fwd_bwd(a.chunk), args, a.repeats)
        ta, ma = measure(attention_fwd_bwd(), args, a.repeats)
        per = tk / T
        first = first or per
        print(
            f"{T:>6} | {tk * 1e3:>9.1f} {mk / 2**20:>8.1f} | {ta * 1e3:>9.1f} {ma / 2**20:>9.1f} | "
            f"{per / first:>17.2f}",
            flush=True,
        )


if __name__ == "__main__":
    main()
