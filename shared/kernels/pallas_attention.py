"""Flash attention in Pallas (Triton lowering for NVIDIA GPUs): our own kernels, forward and backward.

UNVERIFIED ON GPU: written and checked on CPU only, where the same kernels run in Pallas
interpret mode against the XLA reference (forward and gradients) and lower for the `cuda`
platform (`jax.jit(f).trace(...).lower(lowering_platforms=("cuda",))`); no Triton
compilation to PTX and no run on a GPU has happened. Block sizes and warp counts are
untuned first guesses.

Semantics are the reference's (shared/kernels/attention.py): q [B, T, H, D], k and v
[B, S, Hkv, D] with H a multiple of Hkv, masks causal / window W (t - s < W) / segment ids
combined with AND, optional logit soft-capping c * tanh(x / c), fp32 softmax statistics.

Forward: one program per (query block, batch, head) streams key blocks with an online
softmax, visiting only the key blocks the causal and window masks can let through, so a
window W costs O(T * W) work. It saves the per-row log-sum-exp for the backward and
returns it (`return_lse=True`); a cotangent on it enters the backward through delta, see
`_backward`.
Backward: two kernels, as in FlashAttention-2: dK/dV per (key block, batch, q head),
streaming the query blocks that can see that key block, and dQ per (query block, batch,
head), streaming key blocks as the forward does. With grouped-query attention (G = H / Hkv
> 1) dK/dV are produced per q head in fp32 and summed over each group by XLA, which
costs G times the dK/dV memory; a fused group reduction would avoid it.

Sequences are padded to a multiple of the block and head_dim to a power of two (>= 16) by
XLA before the kernels (the padded keys are masked, the padded rows sliced off).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

NEG = -1e30  # masked logit; rows always keep >= 1 visible key (see `refuses` in attention.py)


def _compiler_params(num_warps):
    from jax.experimental.pallas import triton as plgpu  # GPU-only import, inside the call

    return plgpu.CompilerParams(num_warps=num_warps, num_stages=2)


def _dot_t(a, b):  # a [m, d] @ b[n, d]^T in fp32
    return lax.dot_general(a, b, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)


def _dot(a, b):  # a [m, n] @ b [n, d] in fp32
    return lax.dot_general(a, b, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32)


def _dot_tn(a, b):  # a[m, n]^T @ b [m, d] in fp32
    return lax.dot_general(a, b, (((0,), (0,)), ((), ())), preferred_element_type=jnp.float32)


def _scores(q, k, scale, softcap):
    """Scaled, soft-capped fp32 logits and the soft-cap's derivative factor (None without it)."""
    x = _dot_t(q, k) * scale
    if softcap:
        t = jnp.tanh(x / softcap)
        return softcap * t, 1.0 - t * t
    return x, None


def _visible(qpos, kpos, *, T, S, causal, window, sq=None, sk=None):
    ok = (kpos[None, :] < S) & (qpos[:, None] < T)
    if causal:
        ok = ok & (kpos[None, :] <= qpos[:, None])
    if window is not None:
        ok = ok & (qpos[:, None] - kpos[None, :] < window)
    if sq is not None:
        ok = ok & (sq[:, None] == sk[None, :])
    return ok


def _key_range(i, *, block, nk, causal, window):
    """Key blocks [lo, hi) that query block i can see."""
    hi = jnp.minimum(i + 1, nk) if causal else nk
    lo = 0 if window is None else jnp.maximum(i * block - window + 1, 0) // block
    return lo, hi


def _query_range(j, *, block, nq, causal, window):
    """Query blocks [lo, hi) that can see key block j."""
    lo = j if causal else 0
    hi = nq if window is None else jnp.minimum(((j + 1) * block + window - 2) // block + 1, nq)
    return lo, hi


# ---------------------------------------------------------------- forward


def _fwd_kernel(*refs, scale, softcap, causal, window, T, S, block, nk, has_seg):
    if has_seg:
        q_ref, k_ref, v_ref, sq_ref, sk_ref, o_ref, lse_ref = refs
    else:
        (q_ref, k_ref, v_ref, o_ref, lse_ref), sq_ref, sk_ref = refs, None, None
    i = pl.program_id(0)
    q = q_ref[...]
    qpos = i * block + jnp.arange(block)
    sq = sq_ref[...] if has_seg else None
    Dp = q.shape[-1]

    def body(j, carry):
        acc, m, l = carry
        ks = pl.ds(j * block, block)
        k, v = k_ref[ks, :], v_ref[ks, :]
        s, _ = _scores(q, k, scale, softcap)
        ok = _visible(
            qpos,
            j * block + jnp.arange(block),
            T=T,
            S=S,
            causal=causal,
            window=window,
            sq=sq,
            sk=sk_ref[ks] if has_seg else None,
        )
        s = jnp.where(ok, s, NEG)
        m_new = jnp.maximum(m, jnp.max(s, axis=1))
        alpha = jnp.exp(m - m_new)
        p = jnp.where(ok, jnp.exp(s - m_new[:, None]), 0.0)
        l = alpha * l + jnp.sum(p, axis=1)
        acc = alpha[:, None] * acc + _dot(p.astype(v.dtype), v)
        return acc, m_new, l

    lo, hi = _key_range(i, block=block, nk=nk, causal=causal, window=window)
    init = (
        jnp.zeros((block, Dp), jnp.float32),
        jnp.full((block,), -jnp.inf, jnp.float32),
        jnp.zeros((block,), jnp.float32),
    )
    acc, m, l = lax.fori_loop(lo, hi, body, init)
    l = jnp.where(l == 0.0, 1.0, l)  # padded rows only: they are sliced off
    o_ref[...] = (acc / l[:, None]).astype(o_ref.dtype)
    lse_ref[...] = m + jnp.log(l)


def _forward(q, k, v, seg, *, scale, softcap, causal, window, T, S, block, interpret):
    B, Tp, H, Dp = q.shape
    Sp, Hkv = k.shape[1], k.shape[2]
    G, nq, nk = H // Hkv, Tp // block, Sp // block
    has_seg = seg is not None
    in_specs = [
        pl.BlockSpec((None, block, None, Dp), lambda i, b, h: (b, i, h, 0)),
        pl.BlockSpec((None, Sp, None, Dp), lambda i, b, h: (b, 0, h // G, 0)),
        pl.BlockSpec((None, Sp, None, Dp), lambda i, b, h: (b, 0, h // G, 0)),
    ]
    args = [q, k, v]
    if has_seg:
        in_specs += [
            pl.BlockSpec((None, block), lambda i, b, h: (b, i)),
            pl.BlockSpec((None, Sp), lambda i, b, h: (b, 0)),
        ]
        args += [seg, seg]
    kernel = functools.partial(
        _fwd_kernel,
        scale=scale,
        softcap=softcap,
        causal=causal,
        window=window,
        T=T,
        S=S,
        block=block,
        nk=nk,
        has_seg=has_seg,
    )
    return pl.pallas_call(
        kernel,
        grid=(nq, B, H),
        in_specs=in_specs,
        out_specs=[
            pl.BlockSpec((None, block, None, Dp), lambda i, b, h: (b, i, h, 0)),
            pl.BlockSpec((None, None, block), lambda i, b, h: (b, h, i)),
        ],
        out_shape=[jax.ShapeDtypeStruct(q.shape, q.dtype), jax.ShapeDtypeStruct((B, H, Tp), jnp.float32)],
        compiler_params=None if interpret else _compiler_params(4 if Dp <= 64 else 8),
        interpret=interpret,
        name="stencil_flash_fwd",
    )(*args)


# ---------------------------------------------------------------- backward


def _dq_kernel(*refs, scale, softcap, causal, window, T, S, block, nk, has_seg):
    if has_seg:
        q_ref, k_ref, v_ref, do_ref, lse_ref, dl_ref, sq_ref, sk_ref, dq_ref = refs
    else:
        (q_ref, k_ref, v_ref, do_ref, lse_ref, dl_ref, dq_ref), sq_ref, sk_ref = refs, None, None
    i = pl.program_id(0)
    q, do, lse, delta = q_ref[...], do_ref[...], lse_ref[...], dl_ref[...]
    qpos = i * block + jnp.arange(block)
    sq = sq_ref[...] if has_seg else None

    def body(j, dq):
        ks = pl.ds(j * block, block)
        k, v = k_ref[ks, :], v_ref[ks, :]
        s, dcap = _scores(q, k, scale, softcap)
        ok = _visible(
            qpos,
            j * block + jnp.arange(block),
            T=T,
            S=S,
            causal=causal,
            window=window,
            sq=sq,
            sk=sk_ref[ks] if has_seg else None,
        )
        p = jnp.where(ok, jnp.exp(s - lse[:, None]), 0.0)
        ds = p * (_dot_t(do, v) - delta[:, None])
        if dcap is not None:
            ds = ds * dcap
        return dq + _dot(ds.astype(k.dtype), k)

    lo, hi = _key_range(i, block=block, nk=nk, causal=causal, window=window)
    dq = lax.fori_loop(lo, hi, body, jnp.zeros(q.shape, jnp.float32))
    dq_ref[...] = (dq * scale).astype(dq_ref.dtype)


def _dkv_kernel(*refs, scale, softcap, causal, window, T, S, block, nq, has_seg):
    if has_seg:
        q_ref, k_ref, v_ref, do_ref, lse_ref, dl_ref, sq_ref, sk_ref, dk_ref, dv_ref = refs
    else:
        (q_ref, k_ref, v_ref, do_ref, lse_ref, dl_ref, dk_ref, dv_ref), sq_ref, sk_ref = refs, None, None
    j = pl.program_id(0)
    k, v = k_ref[...], v_ref[...]
    kpos = j * block + jnp.arange(block)
    sk = sk_ref[...] if has_seg else None

    def body(i, carry):
        dk, dv = carry
        qs = pl.ds(i * block, block)
        q, do, lse, delta = q_ref[qs, :], do_ref[qs, :], lse_ref[qs], dl_ref[qs]
        s, dcap = _scores(q, k, scale, softcap)
        ok = _visible(
            i * block + jnp.arange(block),
            kpos,
            T=T,
            S=S,
            causal=causal,
            window=window,
            sq=sq_ref[qs] if has_seg else None,
            sk=sk,
        )
        p = jnp.where(ok, jnp.exp(s - lse[:, None]), 0.0)
        dv = dv + _dot_tn(p.astype(do.dtype), do)
        ds = p * (_dot_t(do, v) - delta[:, None])
        if dcap is not None:
            ds = ds * dcap
        dk = dk + _dot_tn(ds.astype(q.dtype), q)
        return dk, dv

    lo, hi = _query_range(j, block=block, nq=nq, causal=causal, window=window)
    zeros = jnp.zeros(k.shape, jnp.float32)
    dk, dv = lax.fori_loop(lo, hi, body, (zeros, zeros))
    dk_ref[...] = (dk * scale).astype(dk_ref.dtype)
    dv_ref[...] = dv.astype(dv_ref.dtype)


def _backward(q, k, v, seg, o, lse, do, dlse, *, scale, softcap, causal, window, T, S, block, interpret):
    B, Tp, H, Dp = q.shape
    Sp, Hkv = k.shape[1], k.shape[2]
    G, nq, nk = H // Hkv, Tp // block, Sp // block
    has_seg = seg is not None
    # dS = P * (dP - delta) with delta = rowsum(dO * O); a cotangent g on lse adds P * g
    # (d lse / d S = P), so it is folded into delta.
    delta = jnp.einsum("bthd,bthd->bht", o.astype(jnp.float32), do.astype(jnp.float32)) - dlse
    common = dict(scale=scale, softcap=softcap, causal=causal, window=window, T=T, S=S, block=block, has_seg=has_seg)
    params = None if interpret else _compiler_params(4 if Dp <= 64 else 8)

    # dQ: one program per (query block, b, h), as the forward.
    qblk = pl.BlockSpec((None, block, None, Dp), lambda i, b, h: (b, i, h, 0))
    kall = pl.BlockSpec((None, Sp, None, Dp), lambda i, b, h: (b, 0, h // G, 0))
    rowblk = pl.BlockSpec((None, None, block), lambda i, b, h: (b, h, i))
    in_specs = [qblk, kall, kall, qblk, rowblk, rowblk]
    args = [q, k, v, do, lse, delta]
    if has_seg:
        in_specs += [
            pl.BlockSpec((None, block), lambda i, b, h: (b, i)),
            pl.BlockSpec((None, Sp), lambda i, b, h: (b, 0)),
        ]
        args += [seg, seg]
    dq = pl.pallas_call(
        functools.partial(_dq_kernel, nk=nk, **common),
        grid=(nq, B, H),
        in_specs=in_specs,
        out_specs=qblk,
        out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
        compiler_params=params,
        interpret=interpret,
        name="stencil_flash_dq",
    )(*args)

    # dK, dV: one program per (key block, b, q head h); per-q-head results, summed over groups below.
    qall = pl.BlockSpec((None, Tp, None, Dp), lambda j, b, h: (b, 0, h, 0))
    kblk = pl.BlockSpec((None, block, None, Dp), lambda j, b, h: (b, j, h // G, 0))
    rowall = pl.BlockSpec((None, None, Tp), lambda j, b, h: (b, h, 0))
    outblk = pl.BlockSpec((None, block, None, Dp), lambda j, b, h: (b, j, h, 0))
    in_specs = [qall, kblk, kblk, qall, rowall, rowall]
    args = [q, k, v, do, lse, delta]
    if has_seg:
        in_specs += [
            pl.BlockSpec((None, Tp), lambda j, b, h: (b, 0)),
            pl.BlockSpec((None, block), lambda j, b, h: (b, j)),
        ]
        args += [seg, seg]
    out_dtype = k.dtype if G == 1 else jnp.float32
    dk, dv = pl.pallas_call(
        functools.partial(_dkv_kernel, nq=nq, **common),
        grid=(nk, B, H),
        in_specs=in_specs,
        out_specs=[outblk, outblk],
        out_shape=[jax.ShapeDtypeStruct((B, Sp, H, Dp), out_dtype)] * 2,
        compiler_params=params,
        interpret=interpret,
        name="stencil_flash_dkv",
    )(*args)
    if G > 1:
        dk = dk.reshape(B, Sp, Hkv, G, Dp).sum(3).astype(k.dtype)
        dv = dv.reshape(B, Sp, Hkv, G, Dp).sum(3).astype(v.dtype)
    return dq, dk, dv


# ---------------------------------------------------------------- custom VJP and entry point


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _flash(q, k, v, seg, opts):
    """(out [B, Tp, H, Dp], lse [B, H, Tp] fp32), both differentiable."""
    return tuple(_forward(q, k, v, seg, **dict(opts)))


def _flash_fwd(q, k, v, seg, opts):
    o, lse = _forward(q, k, v, seg, **dict(opts))
    return (o, lse), (q, k, v, seg, o, lse)


def _flash_bwd(opts, res, cts):
    q, k, v, seg, o, lse = res
    do, dlse = cts  # dlse is zeros when the caller dropped lse
    dq, dk, dv = _backward(q, k, v, seg, o, lse, do, dlse, **dict(opts))
    return dq, dk, dv, None


_flash.defvjp(_flash_fwd, _flash_bwd)


def default_block(T: int) -> int:
    return 16 if T <= 16 else 32 if T <= 32 else 64


def attention(
    q,
    k,
    v,
    *,
    segment_ids=None,
    causal=True,
    window=None,
    scale=None,
    softcap=0.0,
    return_lse=False,
    block=None,
    interpret=False,
):
    """Pallas flash attention on whole local arrays (no mesh handling: see attention.py's wrapper).

    Returns out [B, T, H, D], or with `return_lse` (out, lse [B, T, H] float32), as the reference.

    `interpret=True` runs the same kernels through Pallas' interpreter (any platform; slow;
    for tests). Otherwise the Triton lowering is used, which needs an NVIDIA GPU.
    """
    B, T, H, D = q.shape
    S = k.shape[1]
    scale = D**-0.5 if scale is None else float(scale)
    block = default_block(max(T, S)) if block is None else block
    Dp = max(16, 1 << (D - 1).bit_length())
    Tp, Sp = -(-T // block) * block, -(-S // block) * block

    def pad(x, L):
        return jnp.pad(x, [(0, 0), (0, L - x.shape[1]), (0, 0), (0, Dp - D)])

    seg = None if segment_ids is None else jnp.pad(segment_ids.astype(jnp.int32), [(0, 0), (0, Tp - T)])
    opts = (
        ("scale", scale),
        ("softcap", float(softcap)),
        ("causal", bool(causal)),
        ("window", window),
        ("T", T),
        ("S", S),
        ("block", block),
        ("interpret", bool(interpret)),
    )
    out, lse = _flash(pad(q, Tp), pad(k, Sp), pad(v, Sp), seg, opts)
    out = out[:, :T, :, :D]
    return (out, lse[:, :, :T].transpose(0, 2, 1)) if return_lse else out
