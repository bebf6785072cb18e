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
On CPU no data sheet applies, so the peak is fp32 matmuls measured in the same process at the
start of the run (about two seconds), never a figure from another moment: `cpu_peak` runs the same
measurement every time (each of CPU_PEAK_SIZES warmed up, then timed CPU_PEAK_REPEATS times), counts
FLOPs per CPU-second of the process times the cores it may use (so other jobs on a shared machine do
not move it), and takes the best repetition of the best size; the spread of that size's repetitions
is reported with it. A single matmul timed by the wall clock varied about 2x between identical runs
on a busy machine. A run that gets only part of a shared machine shows it as a lower MFU.
"""

from __future__ import annotations

import os
import statistics
import time
from dataclasses import dataclass

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
    """Best FLOP/s of an n x n fp32 matmul on one CPU device, measured now (about a second); `cpu_peak` is the
    steadier measurement a run's MFU uses.

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


CPU_PEAK_SIZES = (512, 1024)  # n of the n x n fp32 matmuls timed
CPU_PEAK_REPEATS = 7  # timed repetitions of each, after one untimed warm-up repetition


def usable_cores() -> int:
    """The CPU cores this process may run on (its affinity mask; os.cpu_count() where there is none)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


@dataclass(frozen=True)
class CpuPeak:
    flops: float  # the peak: FLOPs per CPU-second of the best repetition of the best size, times `cores`
    size: int  # that size
    cores: int
    spread: tuple  # (min, median, max) of that size's repetitions, as `flops`
    by_size: dict  # n -> the best repetition's figure
    wall: float  # the best repetition of that size by the wall clock: what this process got of the machine

    def describe(self) -> str:
        lo, mid, hi = (x / 1e9 for x in self.spread)
        return (
            f"fp32 matmul measured at start, {self.flops / 1e9:.0f} GFLOP/s = {self.flops / self.cores / 1e9:.0f} "
            f"per CPU-second x {self.cores} cores (best of {CPU_PEAK_REPEATS} after a warm-up, n={self.size}; its "
            f"repetitions {lo:.0f}-{hi:.0f}, median {mid:.0f}; sizes "
            + ", ".join(f"{n}: {v / 1e9:.0f}" for n, v in self.by_size.items())
            + f"); by the wall clock {self.wall / 1e9:.0f} GFLOP/s, {self.wall / self.flops:.0%} of it"
        )


def cpu_peak(sizes: tuple = CPU_PEAK_SIZES, repeats: int = CPU_PEAK_REPEATS) -> CpuPeak:
    """The CPU peak, the same measurement every run: for each n in `sizes`, an n x n fp32 matmul compiled and run
    once untimed (a warm-up), then `repeats` timed repetitions of about 2 GFLOP each (several matmuls for a
    small n). Each repetition's FLOPs are divided by the CPU time this process spent (all its threads), times
    the cores it may use: what the machine does when the run has it to itself, so other jobs on a shared
    machine do not move it (a wall-clock figure varied about 2x between identical runs; this one by a few %,
    docs/performance.md). The peak is the best repetition of the best size, with that size's spread; the
    wall-clock figure beside it says how much of the machine the process got."""
    cores = usable_cores()
    by_size, reps, walls = {}, {}, {}
    for n in sizes:
        a = jnp.ones((n, n), jnp.float32)
        mm = jax.jit(lambda x: x @ x)
        iters = max(1, 2**31 // (2 * n**3))
        rates, wall = [], []
        for r in range(repeats + 1):
            t0, c0 = time.perf_counter(), time.process_time()
            for _ in range(iters):
                mm(a).block_until_ready()
            t1, c1 = time.perf_counter(), time.process_time()
            if r:  # the first is the warm-up (and the compile)
                rates.append(2 * n**3 * iters / max(c1 - c0, 1e-9) * cores)
                wall.append(2 * n**3 * iters / (t1 - t0))
        by_size[n], reps[n], walls[n] = max(rates), rates, max(wall)
    best = max(by_size, key=by_size.get)
    r = reps[best]
    return CpuPeak(by_size[best], best, cores, (min(r), statistics.median(r), max(r)), by_size, walls[best])


_measured: dict = {}  # this process's CPU peak, measured on the first device_peak call


def device_peak(dtype: str = "bfloat16", device=None) -> tuple[float, str]:
    """(peak FLOP/s of one device for this compute dtype, where the figure comes from)."""
    device = device or jax.devices()[0]
    if device.platform == "cpu":
        # Measured in this process the first time it is asked (the start of a run). With
        # fake host devices all "devices" share the same cores: the measured peak is for
        # the whole process, so divide it among them.
        if "cpu" not in _measured:
            _measured["cpu"] = cpu_peak()
        peak = _measured["cpu"]
        return peak.flops / jax.local_device_count(), peak.describe()
    kind = device.device_kind
    for sub, peaks in PEAKS:
        if sub in kind:
            return peaks["bfloat16" if dtype in ("bfloat16", "float16") else "float32"], f"data sheet {sub}"
    raise ValueError(f"no peak FLOP/s known for device kind {kind!r}; add it to shared/flops.py PEAKS")


def mfu(flops_per_token: float, tokens_per_s: float, n_devices: int, peak_per_device: float) -> float:
    return flops_per_token * tokens_per_s / (n_devices * peak_per_device)
