"""Short causal depthwise convolution over time, with named backends.

    out[b, t, c] = sum_{j < W} w[W-1-j, c] * x[b, t-j, c],  only over t - j >= 0 in t's document

x [B, T, C], w [W, C] (the last tap weighs the current token), docs [B, T] int document
index of every token (None = one document per row). It is the q/k/v convolution of
linear-attention layers (KDA, Gated DeltaNet, Mamba): W is small (4), C wide.

Backends, in the order `auto` tries them:
  triton     jax-triton calling our Triton kernels (shared/kernels/triton_conv.py), forward
             and backward, NVIDIA GPUs. UNVERIFIED ON GPU: the Triton kernels were checked on
             CPU under Triton's interpreter; the jax-triton call has never run (jax-triton
             needs a GPU build of jaxlib to import). `auto` passes it over until measured
             (STENCIL_KERNELS=short_conv=triton names it). Under a mesh it runs per device
             (channels may be split over `model`, the taps with them).
  reference  XLA: W shifted, masked multiply-adds. Always available; the ground truth.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp

from shared.kernels.dispatch import Backend, KernelError, choose, missing, not_nvidia_gpu, per_shard, spec, split

BLOCK_T, BLOCK_C = 32, 64


class ConvError(KernelError):
    """A convolution backend cannot run this call."""


@dataclass(frozen=True)
class Call:
    x_shape: tuple
    taps: int
    time_sharded: bool


def reference(x, w, docs):
    W, T = w.shape[0], x.shape[1]
    out = x * w[W - 1]
    for j in range(1, W):
        shifted = jnp.pad(x, [(0, 0), (j, 0), (0, 0)])[:, :T]
        same = jnp.pad(docs, [(0, 0), (j, 0)], constant_values=-1)[:, :T] == docs
        out = out + jnp.where(same[..., None], shifted, 0) * w[W - 1 - j]
    return out


# ---------------------------------------------------------------- jax-triton


def _triton_local(x, w, docs):
    import jax_triton as jt

    from shared.kernels import triton_conv as tc

    B, T, C = x.shape
    W = w.shape[0]
    NT, NC = -(-T // BLOCK_T), -(-C // BLOCK_C)
    grid = (B, NT, NC)
    docs = docs.astype(jnp.int32)

    @jax.custom_vjp
    def conv(x, w):
        return _fwd(x, w)

    def _fwd(x, w):
        return jt.triton_call(
            x,
            w,
            docs,
            kernel=tc.conv_fwd,
            out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
            grid=grid,
            T=T,
            C=C,
            W=W,
            BLOCK_T=BLOCK_T,
            BLOCK_C=BLOCK_C,
        )

    def fwd(x, w):
        return _fwd(x, w), (x, w)

    def bwd(res, dout):
        x, w = res
        dx, parts = jt.triton_call(
            x,
            w,
            docs,
            dout.astype(x.dtype),
            kernel=tc.conv_bwd,
            out_shape=(jax.ShapeDtypeStruct(x.shape, x.dtype), jax.ShapeDtypeStruct((B, NT, W, C), jnp.float32)),
            grid=grid,
            T=T,
            C=C,
            NT=NT,
            W=W,
            BLOCK_T=BLOCK_T,
            BLOCK_C=BLOCK_C,
        )
        dw = jnp.sum(parts, axis=(0, 1))
        return dx, dw.astype(w.dtype)  # summed over the batch shards by shard_map's transpose

    conv.defvjp(fwd, bwd)
    return conv(x, w)


def _triton(x, w, docs):
    xs = spec(x)
    return per_shard(_triton_local, (x, w, docs), (xs, (None, xs[2]), xs[:2]), xs)


def _triton_unavailable():
    return not_nvidia_gpu("jax-triton convolution", min_cc=(8, 0)) or missing("jax_triton", "triton")


def _triton_refuses(c: Call):
    if c.time_sharded:
        return "the Triton convolution needs whole rows in time on each device; T is sharded"
    return None


BACKENDS: dict[str, Backend] = {
    "triton": Backend(
        "triton", _triton_unavailable, _triton_refuses, _triton, lambda c: "not measured against XLA's fused shifts"
    ),
    "reference": Backend("reference", lambda: None, lambda c: None, reference),
}


def short_conv(x, w, docs=None, *, backend="auto"):
    """Causal depthwise convolution over time within documents (see the module docstring)."""
    B, T, C = x.shape
    if w.ndim != 2 or w.shape[1] != C:
        raise ConvError(f"taps must be [W, C={C}], got {w.shape}")
    if docs is None:
        docs = jnp.zeros((B, T), jnp.int32)
    if docs.shape != (B, T):
        raise ConvError(f"docs must be [B, T] = {(B, T)}, got {docs.shape}")
    call = Call(tuple(x.shape), w.shape[0], split(x, 1))
    b = choose("short_conv", BACKENDS, call, backend, error=ConvError, key=f"x{call.x_shape} W={call.taps}")
    return b.run(x, w, docs)
