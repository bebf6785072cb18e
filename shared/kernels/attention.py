"""One attention entry point with named backends.

Shapes: q [B, T, H, D]; k, v [B, S, Hkv, D] with H a multiple of Hkv (grouped-query
attention). Masks, all optional and combined with AND:
  causal       query t sees key s only if s <= t (T == S required);
  window=W     query t sees key s only if t - s < W (the W most recent tokens, itself included);
  segment_ids  [B, T] ints; query and key must carry the same id (packed documents).
Logit soft-capping, optional: softcap=c > 0 replaces each scaled logit x by c * tanh(x / c)
before the masks and the softmax (0 = off).

`return_lse=True` returns `(out, lse)`: lse [B, T, H] float32 (out's layout without D) is each
query's log-sum-exp over its visible keys of the scaled, soft-capped logits, i.e. the log of
its softmax denominator. It is differentiable (d lse / d logit = the softmax weight), so a
variant can build on it; e.g. learned attention sinks, a per-head logit s joining the
denominator without a value: `out * jax.nn.sigmoid(lse - s)[..., None]`. A query with no
visible key (possible only with causal=False, a window, and T > S + W - 1; pallas and
blocked refuse such calls) gets lse = -1e30, the value masked logits take. Backends that cannot return a
correct, differentiable lse refuse `return_lse` by name (cudnn, flash4), so `auto` passes
over them.

Backends, in the order `auto` tries them:
  cudnn      `jax.nn.dot_product_attention(implementation="cudnn")`, NVIDIA GPUs only.
             UNVERIFIED ON GPU: it was written and checked for refusal logic on CPU only.
             Segment ids are passed as a dense [B, 1, T, S] boolean mask, which costs
             O(T*S) memory, so `auto` passes it over for packed rows longer than 4096.
             A window only with the causal mask; no soft-capping; refuses `return_lse`
             (`jax.nn.dot_product_attention` does not return the log-sum-exp).
  flash4     FlashAttention-4 CuTe-DSL kernels (package `flash-attn-4`, module
             `flash_attn.cute`), Hopper (sm90) and Blackwell (sm100) GPUs, forward and
             backward. UNVERIFIED ON GPU: the JAX-to-torch glue (see `_flash4`) was run on
             CPU with a torch stand-in for the kernels; the kernels themselves never ran.
             Causal, window (with causal), soft-capping, grouped-query attention; refuses
             segment ids (its dense interface has none) and `return_lse` (its backward
             takes no lse cotangent). `auto` passes it over below
             T = 1024 (a guess, not a measurement: each call is a Python launch).
  pallas     our Pallas flash attention (shared/kernels/pallas_attention.py), Triton
             lowering, NVIDIA GPUs (sm80+), forward and backward kernels. UNVERIFIED ON GPU:
             checked on CPU in Pallas interpret mode against the reference and lowered for
             CUDA; never compiled by Triton nor run on a GPU. Every mask the reference has
             (causal, window, segment ids, soft-capping, GQA) and `return_lse`; O(T * W)
             work for a window.
  blocked    plain JAX, any platform (shared/kernels/blocked_attention.py): keys in blocks with
             an online softmax and a FlashAttention-style custom VJP; the blocks that the causal
             mask or a window hides entirely are never computed (O(T * W) for a window). Every
             mask, soft-capping, GQA and `return_lse`; refuses a window without the causal mask
             when T != S (as pallas). `auto` takes it on CPU only, by a rule of the call's shape
             measured there (float32, causal, T >= 128, window >= 48: `blocked_attention.auto_skip`,
             with the figures); the reference otherwise. UNVERIFIED ON GPU.
  reference  XLA einsums with an fp32 softmax. Always available; the ground truth.
             Causal calls with a window W < T take a blockwise path: queries in blocks of
             Bq = min(W, 512), each block against its own and the previous ceil((W-1)/Bq)
             key blocks, so time and memory grow as T * (W + Bq), not T^2. Every other
             call builds the full [T, S] masked logits.

The kernel backends (flash4, pallas, blocked) take whole local arrays: under an explicit mesh
they run per device through `jax.shard_map` over the batch (`data`) and head (`model`) axes;
a sharded sequence or head_dim axis is refused.

`backend="auto"` takes the first backend in BACKENDS that is available on this platform,
can express the call and does not pass on it. Every choice, named or `auto`, is logged once
and recorded (`kernels.choices()`). On CPU two backends run, blocked and the reference, and
`auto` takes blocked where its rule says it was measured faster (above; a rule of the
call's shape, so a resumed run makes the same choice), else the reference. Pallas runs on
CPU only in interpret mode, called directly, never as a backend; dispatch.py says when a
CPU-capable backend may enter `auto`. A backend named explicitly that is unavailable, or
cannot express the masks asked for, raises AttentionError saying why; there is never a
silent fallback. The order (cuDNN before FA4 before Pallas) is the
expected speed on a GPU, unmeasured: `python -m shared.kernels.selfcheck` on a GPU measures it.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from shared.kernels.dispatch import (
    Backend,
    KernelError,
    choose,
    missing,
    named,
    not_nvidia_gpu,
    per_shard,
    spec,
    torch_call,
)

__all__ = ["AttentionError", "Backend", "BACKENDS", "Call", "attention", "available_backends", "reference"]


class AttentionError(KernelError):
    """An attention backend cannot run this call (unavailable, or a mask it cannot express)."""


@dataclass(frozen=True)
class Call:
    """What a backend needs to know to decide whether it can run a call."""

    q_shape: tuple
    kv_shape: tuple
    dtype: jnp.dtype
    causal: bool
    window: int | None
    has_segments: bool
    softcap: float = 0.0
    return_lse: bool = False


# ---------------------------------------------------------------- reference (XLA)


def _mask(T, S, causal, window, seg_q, seg_k):
    """Boolean [B or 1, 1, 1, T, S] mask: True where a query may attend to a key."""
    t = jnp.arange(T)[:, None]
    s = jnp.arange(S)[None, :]
    ok = jnp.ones((T, S), bool)
    if causal:
        ok = ok & (s <= t)
    if window is not None:
        ok = ok & (t - s < window)
    ok = ok[None, None, None]
    if seg_q is not None:
        ok = ok & (seg_q[:, None, None, :, None] == seg_k[:, None, None, None, :])
    return ok


def _logits(qg, k, scale, softcap, spec):
    """Scaled (and soft-capped) fp32 logits of a grouped query view against keys."""
    logits = jnp.einsum(spec, qg, k, preferred_element_type=jnp.float32) * scale
    return softcap * jnp.tanh(logits / softcap) if softcap else logits


def reference(q, k, v, *, segment_ids=None, causal=True, window=None, scale=None, softcap=0.0, return_lse=False):
    kw = dict(segment_ids=segment_ids, scale=scale, softcap=softcap, return_lse=return_lse)
    if causal and window is not None and window < q.shape[1]:
        return _windowed(q, k, v, window=window, **kw)
    return _dense(q, k, v, causal=causal, window=window, **kw)


def _dense(q, k, v, *, segment_ids=None, causal=True, window=None, scale=None, softcap=0.0, return_lse=False):
    """Every query against every key, then the mask: O(T*S) time and memory."""
    B, T, H, D = q.shape
    S, Hkv = k.shape[1], k.shape[2]
    scale = D**-0.5 if scale is None else scale
    # Keep q's head sharding on the kv-head axis of the grouped view (explicit meshes).
    b, t, h, d = spec(q)
    qg = q.reshape(B, T, Hkv, H // Hkv, D, out_sharding=named(b, t, h, None, d))
    logits = _logits(qg, k, scale, softcap, "btkgd,bskd->bkgts")
    ok = _mask(T, S, causal, window, segment_ids, segment_ids)
    logits = jnp.where(ok, logits, -1e30)
    probs = jax.nn.softmax(logits, axis=-1)
    out = jnp.einsum("bkgts,bskd->btkgd", probs.astype(v.dtype), v)
    out = out.reshape(B, T, H, D, out_sharding=named(b, t, h, d))
    if not return_lse:
        return out
    lse = jax.nn.logsumexp(logits, axis=-1).transpose(0, 3, 1, 2)  # [B, Hkv, G, T] -> [B, T, Hkv, G]
    return out, lse.reshape(B, T, H, out_sharding=named(b, t, h))


def _windowed(q, k, v, *, segment_ids=None, window, scale=None, softcap=0.0, block=None, return_lse=False):
    """Causal sliding-window attention in query blocks: O(T * (W + Bq)) time and memory.

    The sequence is padded to n blocks of Bq queries. Block i holds queries i*Bq .. i*Bq+Bq-1,
    which need keys back to i*Bq - (W-1): its own key block and the nb = ceil((W-1)/Bq)
    before it. Keys are padded on the left by nb blocks so every block finds nb predecessors;
    the mask (causal, window, real key, same segment) is applied inside each block.
    """
    B, T, H, D = q.shape
    Hkv = k.shape[2]
    W = window
    scale = D**-0.5 if scale is None else scale
    Bq = min(W, 512) if block is None else block
    n, nb = -(-T // Bq), -(-(W - 1) // Bq)
    Tp, S = n * Bq, (nb + 1) * Bq  # padded length, keys seen by one query block
    b, _, h, d = spec(q)
    bk, _, hk, dk = spec(k)

    def key_windows(x):  # [B, T, ...] -> [B, n, S, ...]: block i gets key blocks i-nb .. i
        x = jnp.pad(x, [(0, 0), (nb * Bq, Tp - T)] + [(0, 0)] * (x.ndim - 2))
        rest = spec(x)[2:]
        x = x.reshape(B, n + nb, Bq, *x.shape[2:], out_sharding=named(bk, None, None, *rest))
        return jnp.concatenate([x[:, j : j + n] for j in range(nb + 1)], axis=2)

    qp = jnp.pad(q, [(0, 0), (0, Tp - T), (0, 0), (0, 0)])
    qb = qp.reshape(B, n, Bq, Hkv, H // Hkv, D, out_sharding=named(b, None, None, h, None, d))
    kw, vw = key_windows(k), key_windows(v)
    logits = _logits(qb, kw, scale, softcap, "bnqkgd,bnskd->bnkgqs")  # [B, n, Hkv, G, Bq, S]

    qpos = jnp.arange(n)[:, None, None] * Bq + jnp.arange(Bq)[None, :, None]  # [n, Bq, 1]
    kpos = (jnp.arange(n)[:, None, None] - nb) * Bq + jnp.arange(S)[None, None, :]  # [n, 1, S]
    ok = ((kpos <= qpos) & (qpos - kpos < W) & (kpos >= 0))[None, :, None, None]
    if segment_ids is not None:
        sb = spec(segment_ids)[0]
        sq = jnp.pad(segment_ids, [(0, 0), (0, Tp - T)]).reshape(B, n, Bq, out_sharding=named(sb, None, None))
        sk = key_windows(segment_ids)
        ok = ok & (sq[:, :, None, None, :, None] == sk[:, :, None, None, None, :])
    logits = jnp.where(ok, logits, -1e30)
    probs = jax.nn.softmax(logits, axis=-1)
    out = jnp.einsum("bnkgqs,bnskd->bnqkgd", probs.astype(v.dtype), vw)
    out = out.reshape(B, Tp, H, D, out_sharding=named(b, None, h, d))[:, :T]
    if not return_lse:
        return out
    lse = jax.nn.logsumexp(logits, axis=-1).transpose(0, 1, 4, 2, 3)  # [B, n, Hkv, G, Bq] -> [B, n, Bq, Hkv, G]
    return out, lse.reshape(B, Tp, H, out_sharding=named(b, None, h))[:, :T]


# ---------------------------------------------------------------- cuDNN (GPU)


def _cudnn_unavailable():
    return not_nvidia_gpu("cuDNN attention")


def _cudnn_auto_skip(c: Call):
    T, S = c.q_shape[1], c.kv_shape[1]
    if c.has_segments and T * S > 4096 * 4096:
        return f"segment ids would cost a dense [B, 1, {T}, {S}] mask in memory (pallas streams them)"
    return None


def _cudnn_refuses(c: Call):
    if c.return_lse:
        return "cuDNN attention (jax.nn.dot_product_attention) cannot return the log-sum-exp (return_lse)"
    if c.dtype not in (jnp.bfloat16, jnp.float16):
        return f"cuDNN attention takes bfloat16/float16 inputs, got {c.dtype}"
    if c.q_shape[-1] % 8 or c.q_shape[-1] > 256:
        return f"cuDNN attention needs head_dim a multiple of 8 and <= 256, got {c.q_shape[-1]}"
    if c.window is not None and not c.causal:
        return "cuDNN attention expresses a sliding window only together with the causal mask"
    if c.softcap:
        return f"cuDNN attention has no logit soft-capping, got softcap={c.softcap}"
    return None


def _cudnn(q, k, v, *, segment_ids=None, causal=True, window=None, scale=None, softcap=0.0, return_lse=False):
    assert not softcap and not return_lse, "refused in _cudnn_refuses"
    mask = None
    if segment_ids is not None:
        mask = segment_ids[:, None, :, None] == segment_ids[:, None, None, :]
    return jax.nn.dot_product_attention(
        q,
        k,
        v,
        mask=mask,
        scale=scale,
        is_causal=causal,
        local_window_size=None if window is None else (window - 1, 0),
        implementation="cudnn",
    )


# ---------------------------------------------------------------- whole-array kernels under a mesh


def _local(fn, q, k, v, segment_ids, return_lse=False):
    """Run a whole-array kernel `fn(q, k, v, segment_ids)` per device under an explicit mesh.

    Batch may be sharded (over any axes) and heads too, as long as q, k and v shard them
    alike, so that each device holds whole kv groups. Sequence and head_dim must be whole.
    With `return_lse`, fn returns (out [B, T, H, D], lse [B, T, H]).
    """
    if jax.sharding.get_abstract_mesh().empty:
        return fn(q, k, v, segment_ids)
    qs, ks, vs = spec(q), spec(k), spec(v)
    if qs[1] is not None or qs[3] is not None or ks[1] is not None or ks[3] is not None:
        raise AttentionError(f"this kernel needs whole sequences and head_dims per device; got q {qs}, k {ks}")
    if (qs[0], qs[2]) != (ks[0], ks[2]) or vs != ks:
        raise AttentionError(f"q, k and v must shard batch and heads alike; got q {qs}, k {ks}, v {vs}")
    seg_spec = (qs[0], None)
    if segment_ids is not None and spec(segment_ids) != seg_spec:
        segment_ids = jax.sharding.reshard(segment_ids, P(*seg_spec))
    return per_shard(fn, (q, k, v, segment_ids), (qs, ks, vs, seg_spec), [qs, qs[:3]] if return_lse else qs)


# ---------------------------------------------------------------- FlashAttention-4 (CuTe DSL, torch)
#
# flash_attn.cute is called on XLA's own buffers through `dispatch.torch_call` (DLPack views,
# XLA's stream; see there). FA4 allocates its scratch (backward accumulators) through torch's
# caching allocator, outside XLA's pool: leave it room (XLA_PYTHON_CLIENT_MEM_FRACTION=0.8 or
# so). UNVERIFIED ON GPU.


def _fa4_torch_kernels():
    """(fwd, bwd) taking torch tensors and filling the outputs; the tests swap these for a torch stand-in."""
    from flash_attn.cute import interface as fa

    def fwd(q, k, v, out, lse, *, scale, causal, softcap, window_left):
        fa._flash_attn_fwd(
            q,
            k,
            v,
            softmax_scale=scale,
            causal=causal,
            softcap=softcap or None,
            window_size_left=window_left,
            window_size_right=0 if window_left is not None else None,
            return_lse=True,
            out=out,
            lse=lse,
        )

    def bwd(q, k, v, out, dout, lse, dq, dk, dv, *, scale, causal, softcap, window_left):
        fa._flash_attn_bwd(
            q,
            k,
            v,
            out,
            dout,
            lse,
            scale,
            causal,
            softcap,
            window_size_left=window_left,
            window_size_right=0 if window_left is not None else None,
            dq=dq,
            dk=dk,
            dv=dv,
        )

    return fwd, bwd


FA4_KERNELS = None  # (fwd, bwd); None = flash_attn.cute, loaded on first use


def _fa4_kernel(i):
    return lambda *ts, **kw: (FA4_KERNELS or _fa4_torch_kernels())[i](*ts, **kw)


def _fa4_fwd_call(q, k, v, opts):
    B, T, H, _ = q.shape
    out = (jax.ShapeDtypeStruct(q.shape, q.dtype), jax.ShapeDtypeStruct((B, H, T), jnp.float32))
    return torch_call(_fa4_kernel(0), out, q, k, v, opts=opts)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _fa4(q, k, v, opts):
    return _fa4_fwd_call(q, k, v, opts)[0]


def _fa4_fwd(q, k, v, opts):
    o, lse = _fa4_fwd_call(q, k, v, opts)
    return o, (q, k, v, o, lse)


def _fa4_bwd(opts, res, do):
    q, k, v, o, lse = res
    out = tuple(jax.ShapeDtypeStruct(x.shape, x.dtype) for x in (q, k, v))
    return torch_call(_fa4_kernel(1), out, q, k, v, o, do.astype(o.dtype), lse, opts=opts)


_fa4.defvjp(_fa4_fwd, _fa4_bwd)


def _flash4_unavailable():
    why = not_nvidia_gpu("FlashAttention-4", min_cc=(9, 0), max_cc=(10, 3)) or missing(
        "torch", "tvm_ffi", "flash_attn.cute"
    )
    if why is None:
        import torch

        if not torch.cuda.is_available():
            why = f"FlashAttention-4 needs a CUDA build of torch; this torch is {torch.__version__} without CUDA"
    return why


def _flash4_refuses(c: Call):
    if c.return_lse:
        return (
            "FlashAttention-4's backward takes no log-sum-exp cotangent, so gradients through "
            "return_lse would be wrong (pallas returns a differentiable lse)"
        )
    if c.dtype not in (jnp.bfloat16, jnp.float16):
        return f"FlashAttention-4 takes bfloat16/float16 inputs, got {c.dtype}"
    if c.q_shape[-1] % 8 or c.q_shape[-1] > 128:
        return f"FlashAttention-4 here takes head_dim a multiple of 8 and <= 128, got {c.q_shape[-1]}"
    if c.has_segments:
        return "FlashAttention-4 has no segment ids in its dense interface (use pallas or cudnn for packed documents)"
    if c.window is not None and not c.causal:
        return "FlashAttention-4 is used here for a sliding window only together with the causal mask"
    return None


def _flash4_auto_skip(c: Call):
    if c.q_shape[1] < 1024:
        return f"T={c.q_shape[1]} < 1024: a Python launch per call is not expected to pay (unmeasured)"
    return None


def _flash4(q, k, v, *, segment_ids=None, causal=True, window=None, scale=None, softcap=0.0, return_lse=False):
    assert segment_ids is None and not return_lse, "refused in _flash4_refuses"
    opts = (
        ("scale", q.shape[-1] ** -0.5 if scale is None else float(scale)),
        ("causal", bool(causal)),
        ("softcap", float(softcap)),
        ("window_left", None if window is None else int(window) - 1),
    )
    return _local(lambda q, k, v, _: _fa4(q, k, v, opts), q, k, v, None)


# ---------------------------------------------------------------- Pallas (Triton lowering, GPU)


def _pallas_unavailable():
    return not_nvidia_gpu("Pallas (Triton) attention", min_cc=(8, 0))


def _pallas_refuses(c: Call):
    if c.dtype not in (jnp.bfloat16, jnp.float16, jnp.float32):
        return f"Pallas attention takes bfloat16/float16/float32 inputs, got {c.dtype}"
    if c.q_shape[-1] > 256:
        return f"Pallas attention takes head_dim <= 256, got {c.q_shape[-1]}"
    if c.window is not None and not c.causal and c.q_shape[1] != c.kv_shape[1]:
        return "Pallas attention: a window without the causal mask and T != S can leave a query no key"
    return None


def _pallas(
    q, k, v, *, segment_ids=None, causal=True, window=None, scale=None, softcap=0.0, return_lse=False, interpret=False
):
    from shared.kernels import pallas_attention

    def run(q, k, v, seg):
        return pallas_attention.attention(
            q,
            k,
            v,
            segment_ids=seg,
            causal=causal,
            window=window,
            scale=scale,
            softcap=softcap,
            return_lse=return_lse,
            interpret=interpret,
        )

    return _local(run, q, k, v, segment_ids, return_lse)


# ---------------------------------------------------------------- blocked (plain JAX, any platform)


def _blocked_refuses(c: Call):
    if c.window is not None and not c.causal and c.q_shape[1] != c.kv_shape[1]:
        return "blocked attention: a window without the causal mask and T != S can leave a query no key"
    return None


def _blocked_auto_skip(c: Call):
    from shared.kernels import blocked_attention

    return blocked_attention.auto_skip(c)


def _blocked(
    q, k, v, *, segment_ids=None, causal=True, window=None, scale=None, softcap=0.0, return_lse=False, block=None
):
    from shared.kernels import blocked_attention

    def run(q, k, v, seg):
        return blocked_attention.attention(
            q,
            k,
            v,
            segment_ids=seg,
            causal=causal,
            window=window,
            scale=scale,
            softcap=softcap,
            return_lse=return_lse,
            block=block,
        )

    return _local(run, q, k, v, segment_ids, return_lse)


# ---------------------------------------------------------------- dispatch

BACKENDS: dict[str, Backend] = {
    "cudnn": Backend("cudnn", _cudnn_unavailable, _cudnn_refuses, _cudnn, _cudnn_auto_skip),
    "flash4": Backend("flash4", _flash4_unavailable, _flash4_refuses, _flash4, _flash4_auto_skip),
    "pallas": Backend("pallas", _pallas_unavailable, _pallas_refuses, _pallas),
    "blocked": Backend("blocked", lambda: None, _blocked_refuses, _blocked, _blocked_auto_skip),
    "reference": Backend("reference", lambda: None, lambda c: None, reference),
}


def available_backends() -> list[str]:
    return [name for name, b in BACKENDS.items() if b.unavailable() is None]


def _choose(call: Call, backend: str) -> Backend:
    return choose(
        "attention",
        BACKENDS,
        call,
        backend,
        error=AttentionError,
        key=f"q{call.q_shape} window={call.window}" + (" return_lse" if call.return_lse else ""),
    )


def attention(
    q, k, v, *, segment_ids=None, causal=True, window=None, scale=None, softcap=0.0, return_lse=False, backend="auto"
):
    """Multi-head attention with optional causal, sliding-window and document masks and logit soft-capping.

    Returns out [B, T, H, D] in q's dtype, or with `return_lse=True` the pair (out, lse), lse
    [B, T, H] float32: each query's log-sum-exp over its visible keys (module docstring).
    """
    B, T, H, D = q.shape
    if k.shape != v.shape or k.shape[0] != B or k.shape[3] != D or H % k.shape[2]:
        raise AttentionError(f"bad shapes: q {q.shape}, k {k.shape}, v {v.shape}")
    if causal and k.shape[1] != T:
        raise AttentionError(f"causal attention needs as many keys as queries, got {T} and {k.shape[1]}")
    if window is not None and window < 1:
        raise AttentionError(f"window must be >= 1, got {window}")
    if not softcap >= 0:
        raise AttentionError(f"softcap must be >= 0 (0 = off), got {softcap}")
    if segment_ids is not None and (segment_ids.shape != (B, T) or k.shape[1] != T):
        raise AttentionError(f"segment_ids must be [B, T] = {(B, T)} with T == S, got {segment_ids.shape}")
    call = Call(
        tuple(q.shape),
        tuple(k.shape),
        jnp.dtype(q.dtype),
        causal,
        window,
        segment_ids is not None,
        float(softcap),
        bool(return_lse),
    )
    b = _choose(call, backend)
    kw = dict(return_lse=True) if return_lse else {}  # only when asked: backends that refuse it need no such argument
    return b.run(q, k, v, segment_ids=segment_ids, causal=causal, window=window, scale=scale, softcap=softcap, **kw)
