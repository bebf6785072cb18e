"""Check every kernel backend this process can use against the XLA reference, and time it.

    python -m shared.kernels.selfcheck            # realistic shapes (meant for a GPU)
    python -m shared.kernels.selfcheck --quick    # small shapes, seconds (CPU, or a smoke test)
    python -m shared.kernels.selfcheck --ops attention --shape 16,256,4,2,32 --window 64   # one shape

For each op and case, every backend `kernels.available_backends(op)` lists (and, for the
chunked KDA kernel, each `impl`) runs forward and backward under `jax.jit`. It prints the
largest error of the output and of the gradients relative to the reference (max |a - b| /
max(1, max |b|)), the best wall time of forward + backward, and for matmul-bound ops the
achieved TFLOP/s and its ratio to the device's peak (`shared.flops.device_peak`): FLOPs
are counted as computed (attention: the causal or windowed pairs; KDA: its chunked
matmuls; cross-entropy: the unembedding matmul). Memory-bound ops (RMSNorm, the short
convolution) report GB/s of their inputs and outputs instead.

`--shape B,T,H,Hkv,D` sets the attention cases' shape (batch, tokens, query heads, kv heads,
head_dim) and `--window W` their window case (default T // 4), e.g. a variant's own: the
time column then compares the backends at that shape (tools/bench/bench_attention.py times two
of them side by side with the spread over interleaved rounds).

A backend that refuses a case (e.g. cuDNN has no soft-capping, FlashAttention-4 no segment
ids) is listed as `refused` with its reason: that is the backend declining a call it cannot
compute, which `auto` passes over, not a failure. On a machine without a GPU the Pallas
kernels run in interpret mode (correctness only: their times mean nothing) and everything
else is whatever backends run on CPU (today blocked attention and the reference). The exit
status is 1 if any backend that ran misses its tolerance (1e-4 in fp32, 3e-2 in bf16) or
crashes, else 0; refusals never change it.
"""

from __future__ import annotations

import argparse
import importlib
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from shared import flops, kernels

# the modules (the package's `attention` and `rms_norm` are the entry-point functions)
A = importlib.import_module("shared.kernels.attention")
CONV = importlib.import_module("shared.kernels.conv")
KDA = importlib.import_module("shared.kernels.kda")
NORM = importlib.import_module("shared.kernels.rms_norm")


def _time(f, args, repeats):
    jax.block_until_ready(f(*args))
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(f(*args))
        best = min(best, time.perf_counter() - t0)
    return best


def _err(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b)) / max(1.0, float(np.max(np.abs(b)))))


def _fwd_bwd(fn, n_diff):
    """jit(value_and_grad) of sum(fn(*args) * ct) w.r.t. the first n_diff args; ct is the last arg."""

    def loss(*args):
        *xs, ct = args
        return jnp.sum(fn(*xs).astype(jnp.float32) * ct)

    return jax.jit(jax.value_and_grad(loss, tuple(range(n_diff))))


def _cases(quick: bool, gpu: bool, shape=None, window=None):
    dt = jnp.bfloat16 if gpu else jnp.float32
    rng = np.random.default_rng(0)

    def rand(*shape, dtype=dt, scale=1.0):
        return jnp.asarray(scale * rng.standard_normal(shape), dtype)

    B, T, H, Hkv, D = shape or ((1, 256, 4, 2, 64) if quick else (4, 4096, 32, 8, 128))
    q, k, v = rand(B, T, H, D), rand(B, T, Hkv, D), rand(B, T, Hkv, D)
    seg = jnp.asarray((np.arange(T) * 4 // T)[None].repeat(B, 0), jnp.int32)  # 4 documents a row
    W = window or max(1, T // 4)
    for name, kw in (
        ("causal", {}),
        (f"window {W}", {"window": W}),
        ("causal + documents", {"segment_ids": seg}),
        ("causal + softcap 30", {"softcap": 30.0}),
    ):
        fl = flops.attention_flops_per_token(T, H, D, window=kw.get("window")) * B * T
        impls = {
            b: (lambda b, kw: lambda q, k, v: kernels.attention(q, k, v, backend=b, **kw))(b, kw)
            for b in kernels.available_backends("attention")
        }
        if not gpu:
            impls["pallas (interpret)"] = (lambda kw: lambda q, k, v: A._pallas(q, k, v, interpret=True, **kw))(kw)
        ref = (lambda kw: lambda q, k, v: A.reference(q, k, v, **kw))(kw)
        yield "attention", f"{name} B{B} T{T} H{H}/{Hkv} D{D}", impls, ref, (q, k, v), 3, rand(B, T, H, D), fl, None

    Tk, Hk, Dk = (128, 2, 32) if quick else (8192, 16, 128)
    unit = lambda x: x / jnp.linalg.norm(x.astype(jnp.float32), axis=-1, keepdims=True).astype(x.dtype)  # noqa: E731
    kq, kk, kv = unit(rand(B, Tk, Hk, Dk)), unit(rand(B, Tk, Hk, Dk)), rand(B, Tk, Hk, Dk)
    g = -jnp.exp(rand(B, Tk, Hk, Dk, dtype=jnp.float32) - 3.0)
    beta = jax.nn.sigmoid(rand(B, Tk, Hk, dtype=jnp.float32))
    fl = KDA.kda_flops_per_token(Tk, Hk, Dk, Dk, 64) * B * Tk
    impls = {"xla": lambda *a: KDA.kda(*a, chunk_size=64)[0]}
    if gpu:
        impls["pallas"] = lambda *a: KDA.kda(*a, chunk_size=64, impl="pallas")[0]
    else:
        impls["pallas (interpret)"] = lambda *a: KDA.kda(*a, chunk_size=64, impl="pallas_interpret")[0]
    yield (
        "kda",
        f"B{B} T{Tk} H{Hk} K=V={Dk} chunk 64",
        impls,
        lambda *a: KDA.kda_recurrent(*a)[0],
        (kq, kk, kv, g, beta),
        5,
        rand(B, Tk, Hk, Dk),
        fl,
        None,
    )

    M, Dn = (512, 256) if quick else (16384, 4096)
    x, w = rand(M, Dn), 1 + 0.1 * rand(Dn, dtype=jnp.float32)
    impls = {
        b: (lambda b: lambda x, w: kernels.rms_norm(x, w, backend=b))(b) for b in kernels.available_backends("rms_norm")
    }
    nbytes = 2 * x.size * x.dtype.itemsize
    yield (
        "rms_norm",
        f"[{M}, {Dn}]",
        impls,
        lambda x, w: NORM.reference(x, w, eps=1e-5),
        (x, w),
        2,
        rand(M, Dn),
        None,
        3 * nbytes,
    )  # forward reads x, writes y; backward reads x, dy, writes dx

    Bc, Tc, C = (2, 256, 128) if quick else (4, 4096, 4096)
    xc, taps = rand(Bc, Tc, C), rand(4, C, scale=0.5)
    docs = jnp.asarray(np.repeat(np.arange(4), Tc // 4)[None].repeat(Bc, 0), jnp.int32)
    impls = {
        b: (lambda b: lambda x, w: kernels.short_conv(x, w, docs, backend=b))(b)
        for b in kernels.available_backends("short_conv")
    }
    yield (
        "short_conv",
        f"[{Bc}, {Tc}, {C}] W4",
        impls,
        lambda x, w: CONV.reference(x, w, docs),
        (xc, taps),
        2,
        rand(Bc, Tc, C),
        None,
        5 * xc.size * xc.dtype.itemsize,
    )

    Be, Te, De, V = (2, 64, 64, 1000) if quick else (4, 2048, 2048, 32768)
    h, wu = rand(Be, Te, De), rand(De, V, scale=De**-0.5)
    tg = jnp.asarray(rng.integers(0, V, (Be, Te)), jnp.int32)
    mask = jnp.ones((Be, Te), jnp.float32)

    def ce(backend):
        return lambda h, w: jnp.stack(kernels.cross_entropy(h, w, tg, mask, backend=backend))

    impls = {b: ce(b) for b in kernels.available_backends("cross_entropy")}
    fl = 6.0 * Be * Te * De * V  # the unembedding matmul, forward and backward
    yield "cross_entropy", f"[{Be * Te}, {De}] x V{V}", impls, ce("reference"), (h, wu), 2, jnp.ones(2), fl, None


OPS = ("attention", "kda", "rms_norm", "short_conv", "cross_entropy")


def parse_shape(text: str) -> tuple[int, int, int, int, int]:
    """ "B,T,H,Hkv,D" -> five positive ints with H a multiple of Hkv; ValueError saying what is wrong."""
    parts = text.split(",")
    if len(parts) != 5 or not all(p.strip().isdigit() and int(p) > 0 for p in parts):
        raise ValueError(f"--shape must be five positive integers B,T,H,Hkv,D, got {text!r}")
    B, T, H, Hkv, D = (int(p) for p in parts)
    if H % Hkv:
        raise ValueError(f"--shape: H={H} is not a multiple of Hkv={Hkv}")
    return B, T, H, Hkv, D


def run(quick: bool = False, repeats: int = 3, ops=OPS, out=sys.stdout, shape=None, window=None) -> int:
    """Check and time every backend; `shape` (B, T, H, Hkv, D) and `window` set the attention cases'."""
    gpu = jax.default_backend() == "gpu"
    dtype = "bfloat16" if gpu else "float32"
    peak, src = flops.device_peak(dtype)
    dev = jax.devices()[0]
    print(f"selfcheck on {dev.platform} ({dev.device_kind}), {dtype}, peak {peak / 1e12:.1f} TFLOP/s ({src})", file=out)
    tol = 3e-2 if gpu else 1e-4
    failed, refused = [], []
    header = f"{'op':<13} {'case':<38} {'backend':<19} {'out err':>8} {'grad err':>8} {'ms':>9} {'rate':>15}"
    print(header, file=out)
    for op, case, impls, ref, args, n_diff, ct, fl, nbytes in _cases(quick, gpu, shape, window):
        if op not in ops:
            continue
        n = min(n_diff, len(args))
        _, want_g = _fwd_bwd(ref, n)(*args, ct)
        want_y = jax.jit(ref)(*args)
        for name, fn in impls.items():
            f = _fwd_bwd(fn, n)
            try:
                (_, g), y = f(*args, ct), jax.jit(fn)(*args)
            except Exception as e:  # a backend that fails is a finding, reported and counted
                if isinstance(e, kernels.KernelError) and e.refusal is not None:  # it declined: not a failure
                    print(f"{op:<13} {case:<38} {name:<19} refused: {e.refusal}", file=out)
                    refused.append((op, case, name))
                    continue
                print(
                    f"{op:<13} {case:<38} {name:<19} FAILED: {type(e).__name__}: {str(e).splitlines()[0][:120]}",
                    file=out,
                )
                failed.append((op, case, name))
                continue
            e_out = _err(y, want_y)
            e_grad = max(_err(a, b) for a, b in zip(g, want_g))
            interp = "interpret" in name
            secs = _time(f, (*args, ct), repeats) if not interp else float("nan")
            if interp:
                rate = "(interpret)"
            elif fl is not None:
                rate = f"{fl / secs / 1e12:7.3f} TF {fl / secs / peak:5.1%}"
            else:
                rate = f"{nbytes / secs / 1e9:7.1f} GB/s"
            ok = e_out <= tol and e_grad <= tol
            if not ok:
                failed.append((op, case, name))
            print(
                f"{op:<13} {case:<38} {name:<19} {e_out:8.1e} {e_grad:8.1e} {secs * 1e3:9.2f} {rate:>15}"
                + ("" if ok else "  <-- over tolerance"),
                file=out,
            )
    if refused:
        print(f"{len(refused)} case(s) refused by a backend (not failures): {refused}", file=out)
    print(f"{len(failed)} backend check(s) failed: {failed}" if failed else "all backends within tolerance", file=out)
    return 1 if failed else 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="small shapes (seconds)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--ops", default=",".join(OPS), help=f"comma-separated subset of {','.join(OPS)}")
    ap.add_argument(
        "--shape",
        default=None,
        help="B,T,H,Hkv,D of the attention cases, e.g. 32,128,4,2,32 "
        "(default 1,256,4,2,64 with --quick, else 4,4096,32,8,128)",
    )
    ap.add_argument("--window", type=int, default=None, help="the attention window case's W (default T // 4)")
    a = ap.parse_args(argv)
    ops = tuple(a.ops.split(","))
    unknown = set(ops) - set(OPS)
    if unknown:
        ap.error(f"unknown ops {sorted(unknown)}; known: {', '.join(OPS)}")
    shape = None
    if a.shape is not None:
        try:
            shape = parse_shape(a.shape)
        except ValueError as e:
            ap.error(str(e))
    if a.window is not None and a.window < 1:
        ap.error(f"--window must be >= 1, got {a.window}")
    return run(quick=a.quick, repeats=a.repeats, ops=ops, shape=shape, window=a.window)


if __name__ == "__main__":
    sys.exit(main())
