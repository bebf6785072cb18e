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

Each entry point's module lists its backends (attention: cudnn, flash4, pallas, blocked, reference;
cross_entropy and rms_norm: quack, reference; short_conv: triton, reference). `backend="auto"`
takes the first that is available here, can express the call and has not been passed over;
a backend named explicitly (argument, or STENCIL_KERNELS=op=name) runs or raises, never falls
back. `available_backends(op)` says what this process can use at all; `usable(op, call)` what
can run one call here (available and not refusing it); `refusal(op, name, call)` why a named
backend cannot compute a call wherever it runs (for configs, before anything is traced);
`choices()` which backend each op took so far in this process (the train loop writes it into
the run's run.json). `check_specs(where, cache, cache_specs)` names a cache leaf sharded otherwise
than a model's cache_specs (prefill and decode_step call it). `python -m shared.kernels.selfcheck` compares every available backend
with the reference and times it. See shared/kernels/dispatch.py for the rules (platforms, `auto`).
"""

from shared.kernels import attention as _attention
from shared.kernels import conv as _conv
from shared.kernels import cross_entropy as _cross_entropy
from shared.kernels import rms_norm as _rms_norm
from shared.kernels import dispatch as _dispatch
from shared.kernels.attention import BACKENDS, AttentionError, attention
from shared.kernels.attention import Call as AttentionCall
from shared.kernels.conv import ConvError, short_conv
from shared.kernels.cross_entropy import CrossEntropyError, cross_entropy
from shared.kernels.dispatch import KernelError, check_specs, choices  # noqa: F401  (kernels.check_specs)
from shared.kernels.rms_norm import NormError, rms_norm

REGISTRIES = {
    "attention": _attention.BACKENDS,
    "cross_entropy": _cross_entropy.BACKENDS,
    "rms_norm": _rms_norm.BACKENDS,
    "short_conv": _conv.BACKENDS,
}


def available_backends(op: str = "attention") -> list[str]:
    """The backends of `op` that can run in this process (platform and packages), in `auto`'s order."""
    return [name for name, b in REGISTRIES[op].items() if b.unavailable() is None]


def usable(op: str, call) -> list[str]:
    """The backends of `op` that are available here and do not refuse `call`, in `auto`'s order.

    `call` is the op's call description: `AttentionCall` for attention, the `Call` dataclass of
    shared/kernels/<op>.py for the others (what the entry point builds from its arguments).
    What a test should run when it means "every backend that can run this call"."""
    return _dispatch.usable(REGISTRIES[op], call)


def refusal(op: str, backend: str, call) -> str | None:
    """Why `backend` cannot compute `call` on any machine (an unknown name, or the backend refuses
    the call), else None; "auto" is never refused. Whether it is available here is not checked,
    so a config can check the backend it names before tracing, on any machine."""
    return None if backend == "auto" else _dispatch.refusal(REGISTRIES[op], backend, call, here=False)


__all__ = [
    "BACKENDS",
    "REGISTRIES",
    "AttentionCall",
    "AttentionError",
    "ConvError",
    "CrossEntropyError",
    "KernelError",
    "NormError",
    "attention",
    "available_backends",
    "choices",
    "cross_entropy",
    "refusal",
    "rms_norm",
    "short_conv",
    "usable",
]
