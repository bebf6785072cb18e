"""Cross-entropy from hidden states, without the full [tokens, vocab] fp32 logits at once.

The sequence is cut into chunks along T; each chunk's logits are computed, reduced to
per-token log-sum-exp and target logit, and dropped. `jax.checkpoint` on the chunk makes
the backward pass recompute them chunk by chunk too, so peak logits memory is one chunk.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

# Largest number of logits (batch * chunk * vocab) materialised at once, before sharding.
MAX_LOGITS = 2**27


def _chunk_len(B, T, V, max_logits):
    """Largest divisor of T whose chunk holds at most `max_logits` logits (at least 1)."""
    best = 1
    for c in range(1, T + 1):
        if T % c == 0 and B * c * V <= max_logits:
            best = c
    return best


def cross_entropy(hidden, w_out, targets, mask, *, max_logits=MAX_LOGITS):
    """Summed next-token loss terms. hidden [B, T, D], w_out [D, V], targets/mask [B, T].

    Returns (nll_sum, lse_sq_sum): the masked sums of -log p(target) and of
    log-sum-exp squared (the z-loss term). Logits are computed in fp32.
    """
    B, T, D = hidden.shape
    V = w_out.shape[1]
    c = _chunk_len(B, T, V, max_logits)
    n = T // c

    def split(x):  # [B, T, ...] -> [n, B, c, ...]
        return jnp.moveaxis(x.reshape(B, n, c, *x.shape[2:]), 1, 0)

    @jax.checkpoint
    def chunk(carry, xs):
        h, t, m = xs
        logits = jnp.einsum("bcd,dv->bcv", h, w_out, preferred_element_type=jnp.float32)
        lse = jax.nn.logsumexp(logits, axis=-1)
        hit = jnp.arange(V) == t[..., None]
        target_logit = jnp.sum(jnp.where(hit, logits, 0.0), axis=-1)
        nll, zsq = carry
        return (nll + jnp.sum((lse - target_logit) * m), zsq + jnp.sum(lse**2 * m)), None

    zero = jnp.zeros((), jnp.float32)
    (nll, zsq), _ = jax.lax.scan(chunk, (zero, zero), (split(hidden), split(targets), split(mask.astype(jnp.float32))))
    return nll, zsq
