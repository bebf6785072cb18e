"""One attention entry point with named backends.

Shapes: q [B, T, H, D]; k, v [B, S, Hkv, D] with H a multiple of Hkv (grouped-query
attention). Masks, all optional and combined with AND:
  causal       query t sees key s only if s <= t (T == S required);
  window=W     query t sees key s only if t - s < W (the W most recent tokens, itself included);
  segment_ids  [B, T] ints; query and key must carry the same id (packed documents).

Backends:
  reference  XLA einsums with an fp32 softmax. Always available; the ground truth.
  cudnn      `jax.nn.dot_product_attention(implementation="cudnn")`, NVIDIA GPUs only.
             UNVERIFIED ON GPU: it was written and checked for refusal logic on CPU only.
             Segment ids are passed as a dense [B, 1, T, S] boolean mask, which costs
             O(T*S) memory.

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


def reference(q, k, v, *, segment_ids=None, causal=True, window=None, scale=None):
    B, T, H, D = q.shape
    S, Hkv = k.shape[1], k.shape[2]
    scale = D**-0.5 if scale is None else scale
    # Keep q's head sharding on the kv-head axis of the grouped view (explicit meshes).
    b, t, h, d = _spec(q)
    qg = q.reshape(B, T, Hkv, H // Hkv, D, out_sharding=_named(b, t, h, None, d))
    logits = jnp.einsum("btkgd,bskd->bkgts", qg, k, preferred_element_type=jnp.float32) * scale
    ok = _mask(T, S, causal, window, segment_ids, segment_ids)
    logits = jnp.where(ok, logits, -1e30)
    probs = jax.nn.softmax(logits, axis=-1)
    out = jnp.einsum("bkgts,bskd->btkgd", probs.astype(v.dtype), v)
    return out.reshape(B, T, H, D, out_sharding=_named(b, t, h, d))


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
    return None


def _cudnn(q, k, v, *, segment_ids=None, causal=True, window=None, scale=None):
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


def attention(q, k, v, *, segment_ids=None, causal=True, window=None, scale=None, backend="auto"):
    """Multi-head attention with optional causal, sliding-window and document masks."""
    B, T, H, D = q.shape
    if k.shape != v.shape or k.shape[0] != B or k.shape[3] != D or H % k.shape[2]:
        raise AttentionError(f"bad shapes: q {q.shape}, k {k.shape}, v {v.shape}")
    if causal and k.shape[1] != T:
        raise AttentionError(f"causal attention needs as many keys as queries, got {T} and {k.shape[1]}")
    if window is not None and window < 1:
        raise AttentionError(f"window must be >= 1, got {window}")
    if segment_ids is not None and (segment_ids.shape != (B, T) or k.shape[1] != T):
        raise AttentionError(f"segment_ids must be [B, T] = {(B, T)} with T == S, got {segment_ids.shape}")
    call = Call(tuple(q.shape), tuple(k.shape), jnp.dtype(q.dtype), causal, window, segment_ids is not None)
    b = _choose(call, backend)
    return b.run(q, k, v, segment_ids=segment_ids, causal=causal, window=window, scale=scale)
