"""One attention entry point with named backends.

Shapes: q [B, T, H, D]; k, v [B, S, Hkv, D] with H a multiple of Hkv (grouped-query
attention). Masks, all optional and combined with AND:
  causal       query t sees key s only if s <= t (T == S required);
  window=W     query t sees key s only if t - s < W (the W most recent tokens, itself included);
  segment_ids  [B, T] ints; query and key must carry the same id (packed documents).
Logit soft-capping, optional: softcap=c > 0 replaces each scaled logit x by c * tanh(x / c)
before the masks and the softmax (0 = off).

Backends:
  reference  XLA einsums with an fp32 softmax. Always available; the ground truth.
             Causal calls with a window W < T take a blockwise path: queries in blocks of
             Bq = min(W, 512), each block against its own and the previous ceil((W-1)/Bq)
             key blocks, so time and memory grow as T * (W + Bq), not T^2. Every other
             call builds the full [T, S] masked logits.
  cudnn      `jax.nn.dot_product_attention(implementation="cudnn")`, NVIDIA GPUs only.
             UNVERIFIED ON GPU: it was written and checked for refusal logic on CPU only.
             Segment ids are passed as a dense [B, 1, T, S] boolean mask, which costs
             O(T*S) memory. A window only with the causal mask; no soft-capping.

`backend="auto"` takes the first backend in BACKENDS that is available on this platform
and can express the call, and logs that choice once. A backend named explicitly that is
unavailable, or cannot express the masks asked for, raises AttentionError saying why;
there is never a silent fallback.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

log = logging.getLogger("stencil.kernels")


class AttentionError(ValueError):
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


@dataclass(frozen=True)
class Backend:
    name: str
    unavailable: Callable[[], str | None]  # None when usable here, else the reason
    refuses: Callable[[Call], str | None]  # None when it can express the call, else the reason
    run: Callable


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


def reference(q, k, v, *, segment_ids=None, causal=True, window=None, scale=None, softcap=0.0):
    if causal and window is not None and window < q.shape[1]:
        return _windowed(q, k, v, segment_ids=segment_ids, window=window, scale=scale, softcap=softcap)
    return _dense(q, k, v, segment_ids=segment_ids, causal=causal, window=window, scale=scale, softcap=softcap)


def _dense(q, k, v, *, segment_ids=None, causal=True, window=None, scale=None, softcap=0.0):
    """Every query against every key, then the mask: O(T*S) time and memory."""
    B, T, H, D = q.shape
    S, Hkv = k.shape[1], k.shape[2]
    scale = D**-0.5 if scale is None else scale
    # Keep q's head sharding on the kv-head axis of the grouped view (explicit meshes).
    b, t, h, d = _spec(q)
    qg = q.reshape(B, T, Hkv, H // Hkv, D, out_sharding=_named(b, t, h, None, d))
    logits = _logits(qg, k, scale, softcap, "btkgd,bskd->bkgts")
    ok = _mask(T, S, causal, window, segment_ids, segment_ids)
    logits = jnp.where(ok, logits, -1e30)
    probs = jax.nn.softmax(logits, axis=-1)
    out = jnp.einsum("bkgts,bskd->btkgd", probs.astype(v.dtype), v)
    return out.reshape(B, T, H, D, out_sharding=_named(b, t, h, d))


def _windowed(q, k, v, *, segment_ids=None, window, scale=None, softcap=0.0, block=None):
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
    b, _, h, d = _spec(q)
    bk, _, hk, dk = _spec(k)

    def key_windows(x):  # [B, T, ...] -> [B, n, S, ...]: block i gets key blocks i-nb .. i
        x = jnp.pad(x, [(0, 0), (nb * Bq, Tp - T)] + [(0, 0)] * (x.ndim - 2))
        rest = _spec(x)[2:]
        x = x.reshape(B, n + nb, Bq, *x.shape[2:], out_sharding=_named(bk, None, None, *rest))
        return jnp.concatenate([x[:, j:j + n] for j in range(nb + 1)], axis=2)

    qp = jnp.pad(q, [(0, 0), (0, Tp - T), (0, 0), (0, 0)])
    qb = qp.reshape(B, n, Bq, Hkv, H // Hkv, D, out_sharding=_named(b, None, None, h, None, d))
    kw, vw = key_windows(k), key_windows(v)
    logits = _logits(qb, kw, scale, softcap, "bnqkgd,bnskd->bnkgqs")  # [B, n, Hkv, G, Bq, S]

    qpos = jnp.arange(n)[:, None, None] * Bq + jnp.arange(Bq)[None, :, None]  # [n, Bq, 1]
    kpos = (jnp.arange(n)[:, None, None] - nb) * Bq + jnp.arange(S)[None, None, :]  # [n, 1, S]
    ok = ((kpos <= qpos) & (qpos - kpos < W) & (kpos >= 0))[None, :, None, None]
    if segment_ids is not None:
        sb = _spec(segment_ids)[0]
        sq = jnp.pad(segment_ids, [(0, 0), (0, Tp - T)]).reshape(B, n, Bq, out_sharding=_named(sb, None, None))
        sk = key_windows(segment_ids)
        ok = ok & (sq[:, :, None, None, :, None] == sk[:, :, None, None, None, :])
    probs = jax.nn.softmax(jnp.where(ok, logits, -1e30), axis=-1)
    out = jnp.einsum("bnkgqs,bnskd->bnqkgd", probs.astype(v.dtype), vw)
    return out.reshape(B, Tp, H, D, out_sharding=_named(b, None, h, d))[:, :T]


def _spec(x):
    """The PartitionSpec of x under an explicit mesh (4 Nones when there is no mesh)."""
    spec = tuple(jax.typeof(x).sharding.spec) if not jax.sharding.get_abstract_mesh().empty else ()
    return spec + (None,) * (x.ndim - len(spec))


def _named(*spec):
    return None if jax.sharding.get_abstract_mesh().empty else P(*spec)


# ---------------------------------------------------------------- cuDNN (GPU)

def _cudnn_unavailable():
    if jax.default_backend() != "gpu":
        return f"cuDNN attention needs an NVIDIA GPU; this process runs on {jax.default_backend()!r}"
    return None


def _cudnn_refuses(c: Call):
    if c.dtype not in (jnp.bfloat16, jnp.float16):
        return f"cuDNN attention takes bfloat16/float16 inputs, got {c.dtype}"
    if c.q_shape[-1] % 8 or c.q_shape[-1] > 256:
        return f"cuDNN attention needs head_dim a multiple of 8 and <= 256, got {c.q_shape[-1]}"
    if c.window is not None and not c.causal:
        return "cuDNN attention expresses a sliding window only together with the causal mask"
    if c.softcap:
        return f"cuDNN attention has no logit soft-capping, got softcap={c.softcap}"
    return None


def _cudnn(q, k, v, *, segment_ids=None, causal=True, window=None, scale=None, softcap=0.0):
    assert not softcap, "refused in _cudnn_refuses"
    mask = None
    if segment_ids is not None:
        mask = segment_ids[:, None, :, None] == segment_ids[:, None, None, :]
    return jax.nn.dot_product_attention(
        q, k, v, mask=mask, scale=scale, is_causal=causal,
        local_window_size=None if window is None else (window - 1, 0),
        implementation="cudnn",
    )


# ---------------------------------------------------------------- dispatch

BACKENDS: dict[str, Backend] = {
    "cudnn": Backend("cudnn", _cudnn_unavailable, _cudnn_refuses, _cudnn),
    "reference": Backend("reference", lambda: None, lambda c: None, reference),
}
_logged: set = set()


def available_backends() -> list[str]:
    return [name for name, b in BACKENDS.items() if b.unavailable() is None]


def _choose(call: Call, backend: str) -> Backend:
    if backend != "auto":
        if backend not in BACKENDS:
            raise AttentionError(f"unknown attention backend {backend!r}; known: {sorted(BACKENDS)} or 'auto'")
        b = BACKENDS[backend]
        why = b.unavailable() or b.refuses(call)
        if why:
            raise AttentionError(f"attention backend {backend!r} cannot run this call: {why}")
        return b
    skipped = []
    for b in BACKENDS.values():
        why = b.unavailable() or b.refuses(call)
        if why is None:
            key = (b.name, call.q_shape, call.window)
            if key not in _logged:
                _logged.add(key)
                note = "; ".join(f"{n}: {w}" for n, w in skipped)
                log.info("attention backend %s for q%s window=%s%s", b.name, call.q_shape, call.window,
                         f" (skipped {note})" if note else "")
            return b
        skipped.append((b.name, why))
    raise AttentionError(f"no attention backend can run this call: {skipped}")


def attention(q, k, v, *, segment_ids=None, causal=True, window=None, scale=None, softcap=0.0, backend="auto"):
    """Multi-head attention with optional causal, sliding-window and document masks and logit soft-capping."""
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
    call = Call(tuple(q.shape), tuple(k.shape), jnp.dtype(q.dtype), causal, window, segment_ids is not None,
                float(softcap))
    b = _choose(call, backend)
    return b.run(q, k, v, segment_ids=segment_ids, causal=causal, window=window, scale=scale, softcap=softcap)
