"""Honest FLOP counting and MFU.

Training FLOPs per token = 3 x forward (forward, plus backward at twice the forward).
Matmuls count 2 FLOPs per multiply-add. Attention counts the query-key pairs that the causal
mask (and a window, where a layer has one) lets through in a row of T = seq_len tokens:
(T+1)/2 keys per query on average, min(t+1, W) keys for query t under a window W.

Packed rows are counted as one sequence of T tokens: document boundaries are not subtracted.
A row holding documents of lengths L_1..L_n has sum_i L_i (L_i + 1) / 2 useful causal pairs,
fewer than the T (T + 1) / 2 counted; the attention score and value matmuls are then overstated
by that ratio (for example 8 documents of T/8 tokens: about 8x), while every weight matmul is
exact. This is the usual convention (MFU comparable across data), and it is what the
reference attention computes (the full causal score matrix, the segment mask applied after);
a kernel that skips blocks between documents does less work than counted. The count does not
depend on the data, so it is the same for every step of a run.

Nothing is rounded up; remat recomputation is not counted (it is not useful work), so MFU is
model FLOPs utilisation.

Peaks are dense (no 2:4 sparsity) tensor-core / MXU figures from vendor data sheets.
On CPU no data sheet applies, so the peak is a large fp32 matmul measured in the same
process at the start of the run (about a second), never a figure from another moment.
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp

# device_kind substring -> {dtype: peak FLOP/s per device}. Order matters: first match wins.
PEAKS = [
    ("H200", {"bfloat16": 989e12, "float32": 67e12}),
    ("H100", {"bfloat16": 989e12, "float32": 67e12}),  # SXM; PCIe parts are lower
    ("B200", {"bfloat16": 2250e12, "float32": 75e12}),
    ("A100", {"bfloat16": 312e12, "float32": 19.5e12}),
    ("TPU v6", {"bfloat16": 918e12, "float32": 918e12 / 4}),  # v6e (Trillium)
    ("TPU v5p", {"bfloat16": 459e12, "float32": 459e12 / 4}),
    ("TPU v5", {"bfloat16": 459e12, "float32": 459e12 / 4}),  # v5p reports "TPU v5"
    ("TPU v4", {"bfloat16": 275e12, "float32": 275e12 / 4}),
]


def attention_pairs_per_token(seq_len: int, window: int | None = None, causal: bool = True) -> float:
    """Mean number of keys one query attends to in a row of `seq_len` tokens."""
    T = seq_len
    if not causal:
        return float(T if window is None else min(window, T))
    if window is None or window >= T:
        return (T + 1) / 2
    W = window  # queries 0..W-1 see t+1 keys, the rest see W
    return (W * (W + 1) / 2 + (T - W) * W) / T


def attention_flops_per_token(seq_len, n_heads, head_dim, window=None, causal=True) -> float:
    """Training FLOPs per token of one attention layer's score and value matmuls."""
    pairs = attention_pairs_per_token(seq_len, window, causal)
    return 3 * (2 * 2 * n_heads * head_dim * pairs)  # QK^T and PV, fwd + 2x bwd


def matmul_flops_per_token(n_matmul_params: int) -> float:
    """Training FLOPs per token of weight matmuls with this many weights (6 N)."""
    return 6.0 * n_matmul_params


def measure_cpu_peak(n: int = 1024, repeats: int = 5) -> float:
    """Best FLOP/s of an n x n fp32 matmul on one CPU device, measured now (about a second).

    Never cached across processes: a shared machine's speed changes with its load, so a
    figure from another moment says nothing about this run.
    """
    a = jnp.ones((n, n), jnp.float32)
    mm = jax.jit(lambda x: x @ x)
    mm(a).block_until_ready()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        mm(a).block_until_ready()
        best = min(best, time.perf_counter() - t0)
    return 2 * n**3 / best


_measured: dict = {}  # this process's CPU peak, measured on the first device_peak call


def device_peak(dtype: str = "bfloat16", device=None) -> tuple[float, str]:
    """(peak FLOP/s of one device for this compute dtype, where the figure comes from)."""
    device = device or jax.devices()[0]
    if device.platform == "cpu":
        # Measured in this process the first time it is asked (the start of a run). With
        # fake host devices all "devices" share the same cores: the measured peak is for
        # the whole process, so divide it among them.
        if "cpu" not in _measured:
            _measured["cpu"] = measure_cpu_peak()
        peak = _measured["cpu"]
        return peak / jax.local_device_count(), f"measured fp32 matmul, {peak / 1e9:.0f} GFLOP/s at start"
    kind = device.device_kind
    for sub, peaks in PEAKS:
        if sub in kind:
            return peaks["bfloat16" if dtype in ("bfloat16", "float16") else "float32"], f"data sheet {sub}"
    raise ValueError(f"no peak FLOP/s known for device kind {kind!r}; add it to shared/flops.py PEAKS")


def mfu(flops_per_token: float, tokens_per_s: float, n_devices: int, peak_per_device: float) -> float:
    return flops_per_token * tokens_per_s / (n_devices * peak_per_device)
