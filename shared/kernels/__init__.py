"""Kernels behind one dispatch: the XLA reference everywhere, faster backends where present.

Variants call these entry points and never a backend directly, so a faster backend
arrives without any variant file changing:

    from shared import kernels
    out = kernels.attention(q, k, v, segment_ids=seg, window=None, backend="auto")
    nll_sum, z_sum = kernels.cross_entropy(hidden, w_unembed, targets, mask)
    y = kernels.rms_norm(x, w, eps=1e-5)
    y = kernels.short_conv(x, taps, docs)        # causal depthwise convolution over time

    from shared.kernels.kda import kda           # Kimi Delta Attention, chunked (imported on use)
    o, final_state = kda(q, k, v, g, beta, segment_ids=seg, chunk_size=64)

Each entry point's module lists its backends (attention: cudnn, flash4, pallas, reference;
cross_entropy and rms_norm: quack, reference; short_conv: triton, reference). `backend="auto"`
takes the first that is available here, can express the call and has not been passed over;
a backend named explicitly (argument, or STENCIL_KERNELS=op=name) runs or raises, never falls
back. `available_backends()` says what this process can use; `python -m shared.kernels.selfcheck`
compares every available backend with the reference and times it.
"""

from shared.kernels import attention as _attention
from shared.kernels import conv as _conv
from shared.kernels import cross_entropy as _cross_entropy
from shared.kernels import rms_norm as _rms_norm
from shared.kernels.attention import BACKENDS, AttentionError, attention
from shared.kernels.conv import ConvError, short_conv
from shared.kernels.cross_entropy import CrossEntropyError, cross_entropy
from shared.kernels.dispatch import KernelError
from shared.kernels.rms_norm import NormError, rms_norm

REGISTRIES = {"attention": _attention.BACKENDS, "cross_entropy": _cross_entropy.BACKENDS,
              "rms_norm": _rms_norm.BACKENDS, "short_conv": _conv.BACKENDS}


def available_backends(op: str = "attention") -> list[str]:
    """The backends of `op` that can run in this process (platform and packages), in `auto`'s order."""
    return [name for name, b in REGISTRIES[op].items() if b.unavailable() is None]


__all__ = ["BACKENDS", "REGISTRIES", "AttentionError", "ConvError", "CrossEntropyError", "KernelError", "NormError",
           "attention", "available_backends", "cross_entropy", "rms_norm", "short_conv"]
