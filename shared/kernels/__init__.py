"""Kernels behind one dispatch: the XLA reference everywhere, faster backends where present.

Variants call these entry points and never a backend directly, so a faster backend
arrives without any variant file changing:

    from shared import kernels
    out = kernels.attention(q, k, v, segment_ids=seg, window=None, backend="auto")
    nll_sum, z_sum = kernels.cross_entropy(hidden, w_unembed, targets, mask)

    from shared.kernels.kda import kda           # Kimi Delta Attention, chunked (imported on use)
    o, final_state = kda(q, k, v, g, beta, segment_ids=seg, chunk_size=64)
"""

from shared.kernels.attention import BACKENDS, AttentionError, attention, available_backends
from shared.kernels.cross_entropy import cross_entropy

__all__ = ["BACKENDS", "AttentionError", "attention", "available_backends", "cross_entropy"]
