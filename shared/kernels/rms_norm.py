"""RMSNorm with named backends: y = x / sqrt(mean(x^2, last axis) + eps) * w.

x [..., D] in any float dtype, w [D]; statistics in fp32, the output in x's dtype.

Backends, in the order `auto` tries them:
  quack      QuACK's CuTe-DSL RMSNorm kernels (package `quack-kernels`), forward and
             backward, on NVIDIA sm90/sm100 through `dispatch.torch_call`. UNVERIFIED ON
             GPU: the glue ran on CPU with a torch stand-in for the kernels; the kernels
             never ran. `auto` passes it over: XLA fuses a norm into its neighbours, and a
             Python callback per norm has not been measured to beat that (name it with
             backend="quack" or STENCIL_KERNELS=rms_norm=quack, after
             `python -m shared.kernels.selfcheck` shows it pays). Under a mesh it runs per
             device on x's own shards (D must be whole on each device); the transpose of
             shard_map sums w's gradient over the devices.
  reference  XLA, fp32 statistics. Always available; the ground truth.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import jax
import jax.numpy as jnp

from shared.kernels.dispatch import (
    Backend,
    KernelError,
    choose,
    missing,
    not_nvidia_gpu,
    per_shard,
    spec,
    split,
    torch_call,
)


class NormError(KernelError):
    """An RMSNorm backend cannot run this call."""


@dataclass(frozen=True)
class Call:
    x_shape: tuple
    dtype: jnp.dtype
    sharded_last: bool  # D split over devices


def reference(x, w, *, eps):
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return (y * w.astype(jnp.float32)).astype(x.dtype)


# ---------------------------------------------------------------- QuACK (CuTe DSL, torch)


def _quack_torch_kernels():
    """(fwd, bwd) on torch tensors, filling the outputs; the tests swap these for a torch stand-in."""
    from quack import rmsnorm as qr

    def fwd(x, w, out, rstd, *, eps):
        qr._rmsnorm_fwd(x, w, out, None, rstd, None, None, None, eps)

    def bwd(x, w, dout, rstd, dx, dw):
        gx, gw, _, _ = qr.rmsnorm_bwd(x, w, dout, rstd)
        dx.copy_(gx)
        dw.copy_(gw)

    return fwd, bwd


QUACK_KERNELS = None  # (fwd, bwd); None = quack.rmsnorm, loaded on first use


def _quack_kernel(i):
    return lambda *ts, **kw: (QUACK_KERNELS or _quack_torch_kernels())[i](*ts, **kw)


def _quack_local(x, w, eps):
    """One device's rows: x [..., D] -> y. Under a mesh, shard_map sums w's per-device gradient."""

    @jax.custom_vjp
    def norm(x2, w):
        return _fwd(x2, w)[0]

    def _fwd(x2, w):
        M, D = x2.shape
        outs = (jax.ShapeDtypeStruct((M, D), x2.dtype), jax.ShapeDtypeStruct((M,), jnp.float32))
        return torch_call(_quack_kernel(0), outs, x2, w, opts=(("eps", float(eps)),))

    def fwd(x2, w):
        y, rstd = _fwd(x2, w)
        return y, (x2, w, rstd)

    def bwd(res, dy):
        x2, w, rstd = res
        outs = (jax.ShapeDtypeStruct(x2.shape, x2.dtype), jax.ShapeDtypeStruct(w.shape, w.dtype))
        dx, dw = torch_call(_quack_kernel(1), outs, x2, w, dy.astype(x2.dtype), rstd)
        return dx, dw

    norm.defvjp(fwd, bwd)
    return norm(x.reshape(-1, x.shape[-1]), w).reshape(x.shape)


def _quack(x, w, *, eps):
    xs = spec(x)
    return per_shard(functools.partial(_quack_local, eps=eps), (x, w), (xs, (None,)), xs)


def _quack_unavailable():
    return not_nvidia_gpu("QuACK RMSNorm", min_cc=(9, 0), max_cc=(10, 3)) or missing(
        "torch", "tvm_ffi", "quack.rmsnorm"
    )


def _quack_refuses(c: Call):
    if c.dtype not in (jnp.float32, jnp.float16, jnp.bfloat16):
        return f"QuACK RMSNorm takes float32/float16/bfloat16, got {c.dtype}"
    if c.sharded_last:
        return "QuACK RMSNorm needs whole rows on each device; the normalised axis is sharded"
    return None


BACKENDS: dict[str, Backend] = {
    "quack": Backend(
        "quack",
        _quack_unavailable,
        _quack_refuses,
        _quack,
        lambda c: "a Python callback per norm is not measured to beat XLA's fused norm",
    ),
    "reference": Backend("reference", lambda: None, lambda c: None, reference),
}


def rms_norm(x, w, *, eps: float = 1e-5, backend: str = "auto"):
    """RMSNorm over the last axis (see the module docstring); the output has x's dtype."""
    if w.shape != x.shape[-1:]:
        raise NormError(f"weight must be [{x.shape[-1]}] for x {x.shape}, got {w.shape}")
    call = Call(tuple(x.shape), jnp.dtype(x.dtype), split(x, -1))
    return choose("rms_norm", BACKENDS, call, backend, error=NormError, key=f"x{call.x_shape}").run(x, w, eps=eps)
