"""The dispatch every kernel entry point shares: named backends, refusals, `auto`, a record of choices.

A backend is four things: a name, `unavailable()` (None when it can run in this process,
else the reason: wrong platform, package missing), `refuses(call)` (None when it can
compute this call exactly, else the reason) and `run`. `auto_skip(call)` is optional: a
reason why `auto` should not pick a backend that could run the call (it does not pay at
this shape, or it has not been measured to pay); a backend named explicitly ignores it.

`choose` picks a backend for one call. A backend named explicitly that is unavailable or
refuses raises `KernelError` (or the op's subclass) saying why, with the reason in its
`refusal` attribute; `auto` takes the first backend in the registry's order that is
available, does not refuse and is not skipped. There is never a silent fallback from a
named backend. Every choice, named or `auto`, is kept in a process-wide record, `choices()`:
{op: {backend: [call shapes]}}, and logged (logger `stencil.kernels`) once per (op, backend, how
it was chosen, the backends `auto` skipped), not per call shape. Choices happen while a program
is traced, so the train loop writes the record into the run's run.json after its first step has
compiled.

`usable(registry, call)` lists the backends that are available here and do not refuse a
call: what can run it, as opposed to `available` (can run something here). Tests that run
"every backend" on a call iterate over `usable`, never over the available ones.

Platforms. `unavailable()` says where a backend can run at all; nothing assumes that a
backend other than the reference is a GPU backend. The registry's order is `auto`'s order
on the platform the fast backends were written for (NVIDIA GPUs: cuDNN, FlashAttention-4,
Pallas, by expected speed); on any other platform a backend enters `auto` only after a
benchmark on that platform shows it beats the backends after it, with the figure written in
its docstring. Until then its `auto_skip` says so (`not_measured_here(*platforms it was
measured on)`): it runs when named, and `auto` passes over it. Once measured, its `auto_skip`
is a rule of the call alone (shapes, dtype, masks: the shape classes where it was measured to
pay), never a timing taken while the program runs: two runs of one config, and a run and its
resumption, must pick the same backend. On CPU today: attention has two backends that run
there, `blocked` (plain JAX; `auto` takes it where its rule says it pays, see
shared/kernels/blocked_attention.py) and the reference; every other op has the reference
alone. Pallas kernels do run on CPU in Pallas interpret mode, but only when called directly
with `interpret=True` (the tests and `selfcheck`): the interpreter checks numerics and is far
slower than XLA, so it is never a backend and never in `auto`.

`STENCIL_KERNELS` (environment) names backends per op for the whole process, in place of
"auto": `STENCIL_KERNELS=attention=pallas,rms_norm=quack`. A backend a config names
explicitly still wins. This is how a backend that `auto` skips (unmeasured here) is tried
without editing a variant.

`torch_call` is the glue for kernels written for torch (FlashAttention-4, QuACK): XLA's own
buffers are handed to a Python callback inside the compiled program, viewed as torch
tensors without a copy, and the kernel writes the outputs in place on XLA's stream.
"""

from __future__ import annotations

import functools
import importlib
import logging
import math
import os
from dataclasses import dataclass
from typing import Callable

import jax
from jax.sharding import PartitionSpec as P

from shared.errors import StencilError

log = logging.getLogger("stencil.kernels")


class KernelError(StencilError, ValueError):
    """A kernel backend cannot run this call (unknown, unavailable, or a call it cannot express).

    `refusal` holds the backend's own reason when a backend named explicitly cannot run the
    call (unknown, unavailable here, or it refuses the call), None for any other error.
    """

    def __init__(self, message: str, refusal: str | None = None):
        super().__init__(message)
        self.refusal = refusal


@dataclass(frozen=True)
class Backend:
    name: str
    unavailable: Callable[[], str | None]  # None when usable here, else the reason
    refuses: Callable[[object], str | None]  # None when it can express the call, else the reason
    run: Callable
    auto_skip: Callable[[object], str | None] = lambda call: None  # why `auto` passes it over, or None


_logged: set = set()
_choices: dict[str, dict[str, list[str]]] = {}  # {op: {backend: [call shapes]}}, in the order chosen


def forced(op: str) -> str | None:
    """The backend STENCIL_KERNELS names for `op`, if any."""
    for item in os.environ.get("STENCIL_KERNELS", "").split(","):
        name, _, value = item.partition("=")
        if name.strip() == op and value.strip():
            return value.strip()
    return None


def refusal(registry: dict, name: str, call, *, here: bool = True) -> str | None:
    """Why backend `name` cannot run `call`, or None if it can.

    Unknown names and the backend's `refuses(call)` always count; `unavailable()` (platform,
    packages) only with `here=True`. A config that names a backend checks it with
    `here=False`: it may be written on one machine and run on another."""
    if name not in registry:
        return f"unknown backend {name!r}; known: {sorted(registry)} or 'auto'"
    b = registry[name]
    return (b.unavailable() if here else None) or b.refuses(call)


def usable(registry: dict, call) -> list[str]:
    """The backends that are available here and do not refuse `call`, in `auto`'s order."""
    return [name for name in registry if refusal(registry, name, call) is None]


def not_measured_here(*measured_on: str):
    """For an `auto_skip`: None on a platform in `measured_on` ("gpu", "cpu", "tpu"), where a
    benchmark recorded in the backend's docstring shows it pays; else the reason `auto` passes it over."""
    platform = jax.default_backend()
    if platform in measured_on:
        return None
    return f"not measured to pay on {platform!r} (measured on: {', '.join(measured_on) or 'nothing yet'})"


def choices() -> dict[str, dict[str, list[str]]]:
    """Every backend chosen in this process so far, named or `auto`: {op: {backend: [call shapes]}}."""
    return {op: {b: list(keys) for b, keys in per.items()} for op, per in _choices.items()}


def _note(op: str, name: str, key: str, how: str, skipped: tuple = ()) -> None:
    """Record a choice once per (op, backend, call shape) (`choices()`, a run's run.json), and log it once per
    (op, backend, how it was chosen, the backends `auto` skipped): another shape chosen alike is not said again."""
    k = (op, name, key)
    if k in _logged:
        return
    _logged.add(k)
    _choices.setdefault(op, {}).setdefault(name, []).append(key)
    said = ("said", op, name, how.split(";")[0], skipped)
    if said not in _logged:
        _logged.add(said)
        log.info("%s backend %s for %s (%s)", op, name, key, how)


def choose(op: str, registry: dict, call, backend: str, *, error=KernelError, key=None) -> Backend:
    """The backend that runs `call`: `backend` by name, or the first suitable one for "auto"."""
    key = str(call if key is None else key)
    how = "named"
    if backend == "auto" and forced(op) is not None:
        backend, how = forced(op), "named by STENCIL_KERNELS"
    if backend != "auto":
        if backend not in registry:
            raise error(
                f"unknown {op} backend {backend!r}; known: {sorted(registry)} or 'auto'",
                refusal=refusal(registry, backend, call),
            )
        why = refusal(registry, backend, call)
        if why:
            raise error(f"{op} backend {backend!r} cannot run this call: {why}", refusal=why)
        _note(op, backend, key, how)
        return registry[backend]
    skipped = []
    for b in registry.values():
        why = b.unavailable() or b.refuses(call) or b.auto_skip(call)
        if why is None:
            note = "; ".join(f"{n}: {w}" for n, w in skipped)
            _note(op, b.name, key, "auto" + (f"; skipped {note}" if note else ""), tuple(n for n, _ in skipped))
            return b
        skipped.append((b.name, why))
    raise error(f"no {op} backend can run this call: {skipped}")


# ---------------------------------------------------------------- helpers for backends


@functools.cache
def missing(*modules: str) -> str | None:
    """None if every module imports, else which one does not and why (optional `kernels` extra).

    Cached: a failed import is not retried on every call. Call it after the platform check,
    so that a CPU process never imports torch.
    """
    for m in modules:
        try:
            importlib.import_module(m)
        except Exception as e:  # ImportError, or a library that refuses to load without its GPU
            return f"cannot import {m!r} ({type(e).__name__}: {e}); install the extra: pip install -e '.[kernels]'"
    return None


def not_nvidia_gpu(what: str, min_cc: tuple[int, int] | None = None, max_cc: tuple[int, int] | None = None):
    """None on an NVIDIA GPU of a compute capability in [min_cc, max_cc], else the reason."""
    if jax.default_backend() != "gpu":
        return f"{what} needs an NVIDIA GPU; this process runs on {jax.default_backend()!r}"
    dev = jax.devices()[0]
    cc = getattr(dev, "compute_capability", None)  # "9.0" on CUDA devices; absent on ROCm
    if cc is None:
        return f"{what} needs an NVIDIA GPU; this device is {dev.device_kind!r}"
    major, minor = (int(x) for x in str(cc).split(".")[:2])
    if (min_cc and (major, minor) < min_cc) or (max_cc and (major, minor) > max_cc):
        return f"{what} needs compute capability {min_cc} to {max_cc}; this GPU ({dev.device_kind}) is {major}.{minor}"
    return None


def spec(x):
    """The PartitionSpec of x under an explicit mesh, padded with None (all None without a mesh)."""
    s = tuple(jax.typeof(x).sharding.spec) if not jax.sharding.get_abstract_mesh().empty else ()
    return s + (None,) * (x.ndim - len(s))


def divided(x) -> tuple:
    """x's spec with only the mesh axes of more than one device: what each axis of x is divided over.
    P('data', None, 'model') on a mesh whose `model` axis has size 1 is ('data', None, None)."""
    sizes = jax.sharding.get_abstract_mesh().shape

    def over(s):
        names = tuple(a for a in (s if isinstance(s, tuple) else (s,)) if s is not None and sizes[a] > 1)
        return None if not names else names[0] if len(names) == 1 else names

    return tuple(over(s) for s in spec(x))


def check_alike(op: str, ref_name: str, ref, others: dict, error=KernelError) -> None:
    """Raise `error` naming the input and the spec expected when an input is divided between devices unlike
    `ref` on the axes they share: `others` maps a name to (array or None, {its axis: ref's axis}, the axes'
    names). Only mesh axes of more than one device count (`divided`): an axis sharded over a size-1 mesh axis
    is whole everywhere, and JAX computes such calls. Where the division differs, XLA stops at the first
    operation that mixes the two, naming no argument ("All operands should have the same sharding ...")."""
    if jax.sharding.get_abstract_mesh().empty:
        return
    want, full = divided(ref), spec(ref)
    for name, (x, axes, labels) in others.items():
        if x is None or all(divided(x)[a] == want[b] for a, b in axes.items()):
            continue
        expected = list(spec(x))
        for a, b in axes.items():
            expected[a] = full[b]
        raise error(
            f"{op}: {name} is sharded {P(*spec(x))} and {ref_name} {P(*full)}; {name}'s {labels} must be divided "
            f"between devices as {ref_name}'s: expected {name} {P(*expected)} "
            f"(jax.sharding.reshard({name}, {P(*expected)}))"
        )


def check_specs(where: str, tree: dict, specs: dict, error=KernelError) -> None:
    """Raise `error` naming the leaf and both specs when a leaf of `tree` (a model's decoding cache) is not
    sharded as `specs` (its cache_specs) says, under an explicit mesh: a hand-built cache otherwise fails deep
    in the first update that mixes it with the model's activations, naming no argument."""
    if jax.sharding.get_abstract_mesh().empty:
        return
    for name, want in specs.items():
        x = tree.get(name) if isinstance(tree, dict) else None
        if isinstance(want, dict):
            check_specs(f"{where}[{name!r}]", x or {}, want, error)
        elif x is not None:
            got, want = spec(x), tuple(want) + (None,) * (x.ndim - len(tuple(want)))
            if got != want:
                raise error(
                    f"{where}[{name!r}] is sharded {P(*got)}, expected {P(*want)} (the model's cache_specs; "
                    f"init_cache builds it so, or jax.sharding.reshard(..., {P(*want)}))"
                )


def split(x, dim: int) -> bool:
    """Whether axis `dim` of x is divided between devices: sharded over mesh axes whose sizes
    multiply to more than 1. An axis sharded over a size-1 mesh axis (a `model` axis of 1 on
    one device) is whole on every device, and backends treat it as unsharded."""
    s = spec(x)[dim]
    if s is None:
        return False
    sizes = jax.sharding.get_abstract_mesh().shape
    return math.prod(sizes[a] for a in (s if isinstance(s, tuple) else (s,))) > 1


def named(*s):
    """P(*s) under an explicit mesh, else None: for `out_sharding=` in code that also runs without a mesh."""
    return None if jax.sharding.get_abstract_mesh().empty else P(*s)


def per_shard(fn, args, in_specs, out_specs):
    """Run `fn(*args)` on each device's shard under an explicit mesh (plain call without one).

    For kernels (Pallas, FFI, callbacks) that take whole local arrays: `jax.shard_map` hands
    each device its own block, so no gather happens. `None` entries of args pass through.
    Specs are tuples of axis names (as `spec` gives them); `out_specs` is one such tuple for
    one output, or a list of them for a tuple of outputs.
    """
    if jax.sharding.get_abstract_mesh().empty:
        return fn(*args)
    idx = [i for i, a in enumerate(args) if a is not None]

    def inner(*xs):
        full = list(args)
        for i, x in zip(idx, xs):
            full[i] = x
        return fn(*full)

    return jax.shard_map(
        inner,
        in_specs=tuple(P(*in_specs[i]) for i in idx),
        out_specs=tuple(P(*o) for o in out_specs) if isinstance(out_specs, list) else P(*out_specs),
        check_vma=False,
    )(*[args[i] for i in idx])


# ---------------------------------------------------------------- torch kernels inside a JAX program


def torch_call(host, out_shapes, *args, opts: tuple = ()):
    """Run `host(*inputs, *outputs, **dict(opts))` on torch views of XLA's buffers, in the compiled program.

    `jax.experimental.buffer_callback` passes the callback XLA's device buffers (the inputs and
    the outputs to fill) and XLA's CUDA stream. The buffers become torch tensors by DLPack
    (zero copy); `host` must write every output in place. On a GPU the call runs with XLA's
    stream as torch's current stream and as TVM-FFI's (CuTe-DSL kernels launch on it), so it
    is ordered with the rest of the program and no data goes through the host. The cost is
    one Python call per use, and such a program cannot be captured into a CUDA graph.
    `out_shapes`: a tuple of jax.ShapeDtypeStruct; returns a tuple of arrays.
    """
    from jax.experimental.buffer_callback import buffer_callback

    return buffer_callback(functools.partial(_torch_host, host, tuple(opts)), tuple(out_shapes))(*args)


def _torch_host(host, opts, ctx, outs, *ins):
    import torch

    ts = [torch.from_dlpack(b) for b in (*ins, *outs)]
    if ts and ts[0].device.type == "cuda":
        import tvm_ffi

        dev = ts[0].device
        with (
            torch.cuda.stream(torch.cuda.ExternalStream(ctx.stream, device=dev)),
            tvm_ffi.use_raw_stream(tvm_ffi.device(f"cuda:{dev.index}"), ctx.stream),
        ):
            host(*ts, **dict(opts))
    else:
        host(*ts, **dict(opts))
