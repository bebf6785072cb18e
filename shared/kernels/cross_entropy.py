"""Cross-entropy from hidden states, without the full [tokens, vocab] fp32 logits at once.

The sequence is cut into chunks along T; each chunk's logits are computed (an XLA matmul),
reduced to per-token log-sum-exp and loss, and dropped. With more than one chunk,
`jax.checkpoint` on the chunk makes the backward pass recompute them chunk by chunk too, so
peak logits memory is one chunk. When the whole sequence fits in one chunk there is nothing
to save by recomputing, so the logits are kept for the backward pass (no second matmul).

The row reduction (logits [M, V] -> loss and log-sum-exp per row) has named backends, in
the order `auto` tries them:
  quack      QuACK's CuTe-DSL cross-entropy kernels (package `quack-kernels`): one pass
             for loss and log-sum-exp, one for the logits' gradient, on NVIDIA sm90/sm100
             through `dispatch.torch_call`. UNVERIFIED ON GPU: the glue ran on CPU with a
             torch stand-in for the kernels. `auto` passes it over (unmeasured against
             XLA's fused reductions); name it with backend="quack" or
             STENCIL_KERNELS=cross_entropy=quack. It needs whole vocabulary rows per device,
             so it refuses logits sharded over `model`.
  reference  XLA: logsumexp and the target logit, fp32. Always available; the ground truth.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P
from jax.sharding import reshard

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

# Largest number of logits (batch * chunk * vocab) materialised at once, before sharding.
MAX_LOGITS = 2**27


class CrossEntropyError(KernelError):
    """A cross-entropy backend cannot run this call."""


@dataclass(frozen=True)
class Call:
    logits_shape: tuple  # one chunk's [B, c, V]
    vocab_sharded: bool


def _chunk_len(B, T, V, max_logits):
    """Largest divisor of T whose chunk holds at most `max_logits` logits (at least 1)."""
    best = 1
    for c in range(1, T + 1):
        if T % c == 0 and B * c * V <= max_logits:
            best = c
    return best


def _rows_reference(logits, targets):
    """fp32 logits [..., V], targets [...] -> (loss = lse - target logit, lse), each [...].

    The target logit is a gather where each device holds whole vocabulary rows: XLA then
    writes the logits' gradient once (softmax, minus one at the target). That includes a
    vocabulary "sharded" over a `model` axis of size 1, whose sharding is dropped first (no
    data moves). Logits split over the vocabulary between devices take it as a masked sum
    instead, which each shard computes on its own slice before one all-reduce; a gather there
    would need the whole row. The masked sum costs more: on CPU it made the whole train step
    about 1.1x slower at the CPU default (tools/bench/bench_step.py).
    """
    lse = jax.nn.logsumexp(logits, axis=-1)
    if not split(logits, -1):
        s = spec(logits)
        if s[-1] is not None:
            logits = reshard(logits, P(*s[:-1], None))
        target = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
    else:
        hit = jnp.arange(logits.shape[-1]) == targets[..., None]
        target = jnp.sum(jnp.where(hit, logits, 0.0), axis=-1)
    return lse - target, lse


# ---------------------------------------------------------------- QuACK (CuTe DSL, torch)


def _quack_torch_kernels():
    """(fwd, bwd) on torch tensors, filling the outputs; the tests swap these for a torch stand-in."""
    from quack import cross_entropy as qc

    def fwd(x, target, loss, lse):
        qc.cross_entropy_fwd_out(x, target, None, loss, lse, None, None)

    def bwd(x, target, dloss, lse, dx):
        qc.cross_entropy_bwd_out(x, target, dloss, lse, dx)

    return fwd, bwd


QUACK_KERNELS = None  # (fwd, bwd); None = quack.cross_entropy, loaded on first use


def _quack_kernel(i):
    return lambda *ts, **kw: (QUACK_KERNELS or _quack_torch_kernels())[i](*ts, **kw)


@jax.custom_vjp
def _rows_quack_local(logits, targets):
    return _quack_fwd(logits, targets)[0]


def _quack_call(logits, targets):
    M = logits.shape[0]
    outs = (jax.ShapeDtypeStruct((M,), jnp.float32),) * 2
    return torch_call(_quack_kernel(0), outs, logits, targets.astype(jnp.int32))


def _quack_fwd(logits, targets):
    loss, lse = _quack_call(logits, targets)
    return (loss, lse), (logits, targets, lse)


def _quack_bwd(res, cts):
    """d loss / d logits = softmax - onehot; d lse / d logits = softmax = (softmax - onehot) + onehot.
    So one QuACK pass with per-row weight (g_loss + g_lse), plus g_lse at each row's target."""
    logits, targets, lse = res
    g_loss, g_lse = cts
    dx = torch_call(
        _quack_kernel(1),
        (jax.ShapeDtypeStruct(logits.shape, logits.dtype),),
        logits,
        targets.astype(jnp.int32),
        (g_loss + g_lse).astype(jnp.float32),
        lse,
    )[0]
    dx = dx.at[jnp.arange(logits.shape[0]), targets].add(g_lse.astype(dx.dtype))
    return dx, None


_rows_quack_local.defvjp(_quack_fwd, _quack_bwd)


def _rows_quack(logits, targets):
    """[B, c, V] fp32 logits -> ([B, c], [B, c]), per device under a mesh."""

    def local(lg, t):
        loss, lse = _rows_quack_local(lg.reshape(-1, lg.shape[-1]), t.reshape(-1))
        return loss.reshape(t.shape), lse.reshape(t.shape)

    ls = spec(logits)
    return per_shard(local, (logits, targets), (ls, ls[:2]), [ls[:2], ls[:2]])


def _quack_unavailable():
    return not_nvidia_gpu("QuACK cross-entropy", min_cc=(9, 0), max_cc=(10, 3)) or missing(
        "torch", "tvm_ffi", "quack.cross_entropy"
    )


def _quack_refuses(c: Call):
    if c.vocab_sharded:
        return "QuACK cross-entropy needs whole vocabulary rows per device; the logits are sharded over the vocabulary"
    return None


BACKENDS: dict[str, Backend] = {
    "quack": Backend(
        "quack",
        _quack_unavailable,
        _quack_refuses,
        _rows_quack,
        lambda c: "not measured against XLA's fused reductions",
    ),
    "reference": Backend("reference", lambda: None, lambda c: None, _rows_reference),
}


def _sequence_split(x) -> int:
    """How many devices x's axis 1 (the sequence) is split over: > 1 under context parallelism."""
    names = spec(x)[1]
    if names is None:
        return 1
    sizes = dict(zip(jax.sharding.get_abstract_mesh().axis_names, jax.sharding.get_abstract_mesh().axis_sizes))
    return math.prod(sizes[a] for a in (names if isinstance(names, tuple) else (names,)))


def cross_entropy(hidden, w_out, targets, mask, *, max_logits=MAX_LOGITS, backend="auto"):
    """Summed next-token loss terms. hidden [B, T, D], w_out [D, V], targets/mask [B, T].

    Returns (nll_sum, lse_sq_sum): the masked sums of -log p(target) and of
    log-sum-exp squared (the z-loss term). Logits are computed in fp32.
    """
    B, T, D = hidden.shape
    V = w_out.shape[1]
    S = _sequence_split(hidden)  # > 1 under context parallelism: each device's part of a row is chunked
    c = _chunk_len(B * S, T // S, V, max_logits)
    n = T // (S * c)
    call = Call((B, S * c, V), split(w_out, -1))
    rows = choose(
        "cross_entropy", BACKENDS, call, backend, error=CrossEntropyError, key=f"logits chunk {call.logits_shape}"
    ).run

    def by_chunk(x):  # [B, T, ...] -> [n, B, c, ...], or [n, B, S, c, ...]: the n-th chunk of each device's part
        if S == 1:
            return jnp.moveaxis(x.reshape(B, n, c, *x.shape[2:]), 1, 0)
        return jnp.moveaxis(x.reshape(B, S, n, c, *x.shape[2:]), 2, 0)

    def chunk(carry, xs):
        h, t, m = xs
        logits = jnp.einsum("...d,dv->...v", h, w_out, preferred_element_type=jnp.float32)
        loss, lse = rows(logits, t)
        nll, zsq = carry
        return (nll + jnp.sum(loss * m), zsq + jnp.sum(lse**2 * m)), None

    zero = jnp.zeros((), jnp.float32)
    if n == 1:  # one chunk holds every logit anyway: keep them for the backward pass
        (nll, zsq), _ = chunk((zero, zero), (hidden, targets, mask.astype(jnp.float32)))
        return nll, zsq
    (nll, zsq), _ = jax.lax.scan(
        jax.checkpoint(chunk), (zero, zero), (by_chunk(hidden), by_chunk(targets), by_chunk(mask.astype(jnp.float32)))
    )
    return nll, zsq


__all__ = ["BACKENDS", "CrossEntropyError", "cross_entropy"]
