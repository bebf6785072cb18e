"""Triton kernels of the short causal depthwise convolution (shared/kernels/conv.py), for jax-triton.

Imported only when the `triton` backend runs (it needs the `triton` package). The kernels
take row-major [B, T, C] activations, [W, C] taps and [B, T] int32 document ids; each
program covers BLOCK_T time steps and BLOCK_C channels of one row.

UNVERIFIED ON GPU: these kernels were checked on CPU under Triton's interpreter
(TRITON_INTERPRET=1, on torch tensors) against the XLA reference; they have not been
compiled for or run on a GPU, and the jax-triton call in conv.py has not run at all
(jax-triton does not import without a GPU build of jaxlib).
"""

import triton
import triton.language as tl


@triton.jit
def conv_fwd(
    x_ptr,
    w_ptr,
    doc_ptr,
    out_ptr,
    T: tl.constexpr,
    C: tl.constexpr,
    W: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    """out[b, t, c] = sum_j w[W-1-j, c] x[b, t-j, c] over t-j >= 0 in t's document."""
    b, it, ic = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    t = it * BLOCK_T + tl.arange(0, BLOCK_T)
    c = ic * BLOCK_C + tl.arange(0, BLOCK_C)
    tm, cm = t < T, c < C
    doc = tl.load(doc_ptr + b * T + t, mask=tm, other=-1)
    acc = tl.zeros((BLOCK_T, BLOCK_C), dtype=tl.float32)
    for j in tl.static_range(W):
        s = t - j
        ok = tm & (s >= 0)
        ok = ok & (tl.load(doc_ptr + b * T + s, mask=ok, other=-2) == doc)
        xs = tl.load(x_ptr + (b * T + s)[:, None] * C + c[None, :], mask=ok[:, None] & cm[None, :], other=0.0)
        wj = tl.load(w_ptr + (W - 1 - j) * C + c, mask=cm, other=0.0)
        acc += xs.to(tl.float32) * wj.to(tl.float32)[None, :]
    tl.store(
        out_ptr + (b * T + t)[:, None] * C + c[None, :],
        acc.to(out_ptr.dtype.element_ty),
        mask=tm[:, None] & cm[None, :],
    )


@triton.jit
def conv_bwd(
    x_ptr,
    w_ptr,
    doc_ptr,
    dout_ptr,
    dx_ptr,
    dw_part_ptr,
    T: tl.constexpr,
    C: tl.constexpr,
    NT: tl.constexpr,
    W: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    """dx[b, s, c] = sum_j w[W-1-j, c] dout[b, s+j, c] over s+j < T in s's document; per-program
    partial dw[W-1-j, c] = sum_t dout[b, t, c] x[b, t-j, c] into dw_part[b, it, :, :] (summed by the caller)."""
    b, it, ic = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    t = it * BLOCK_T + tl.arange(0, BLOCK_T)
    c = ic * BLOCK_C + tl.arange(0, BLOCK_C)
    tm, cm = t < T, c < C
    doc = tl.load(doc_ptr + b * T + t, mask=tm, other=-1)
    dout = tl.load(dout_ptr + (b * T + t)[:, None] * C + c[None, :], mask=tm[:, None] & cm[None, :], other=0.0)
    dout = dout.to(tl.float32)
    dx = tl.zeros((BLOCK_T, BLOCK_C), dtype=tl.float32)
    for j in tl.static_range(W):
        wj = tl.load(w_ptr + (W - 1 - j) * C + c, mask=cm, other=0.0).to(tl.float32)
        # dx: the output at s + j reads x at s
        u = t + j
        ok = tm & (u < T)
        ok = ok & (tl.load(doc_ptr + b * T + u, mask=ok, other=-2) == doc)
        du = tl.load(dout_ptr + (b * T + u)[:, None] * C + c[None, :], mask=ok[:, None] & cm[None, :], other=0.0)
        dx += du.to(tl.float32) * wj[None, :]
        # dw: the output at t read x at t - j
        s = t - j
        ok2 = tm & (s >= 0)
        ok2 = ok2 & (tl.load(doc_ptr + b * T + s, mask=ok2, other=-2) == doc)
        xs = tl.load(x_ptr + (b * T + s)[:, None] * C + c[None, :], mask=ok2[:, None] & cm[None, :], other=0.0)
        part = tl.sum(dout * xs.to(tl.float32), axis=0)
        tl.store(dw_part_ptr + ((b * NT + it) * W + (W - 1 - j)) * C + c, part, mask=cm)
    tl.store(
        dx_ptr + (b * T + t)[:, None] * C + c[None, :], dx.to(dx_ptr.dtype.element_ty), mask=tm[:, None] & cm[None, :]
    )
