"""shared/kernels backends: the GPU ones as far as a CPU machine can check them, and blocked attention.

- Dispatch: the GPU backends are unavailable on CPU and `auto` takes the reference there for
  every op but attention, where blocked attention's measured rule may pick it; a backend named
  explicitly (by argument or STENCIL_KERNELS) that cannot run says why and never falls back; a
  backend that cannot express a mask refuses; every choice, named or `auto`, is logged once and
  recorded (`kernels.choices()`).
- A CPU-capable backend (a test-only one): available on CPU, listed by `usable` only for the
  calls it does not refuse, run when named, passed over by `auto` until measured on CPU.
- Blocked attention (plain JAX, the one backend besides the reference that runs on CPU, and
  `auto`'s choice there where its measured rule says so): against the reference (forward, lse
  and gradients, every mask), its plan of blocks, its cost (linear in T for a window), per
  device under a mesh, its refusals.
- Pallas attention: our kernels in interpret mode against the reference (forward and
  gradients, every mask), also per device under a mesh; lowering for CUDA.
- The torch glue (FlashAttention-4, QuACK RMSNorm and cross-entropy): run on CPU with torch
  stand-ins in place of the GPU kernels, so the buffers, the in-place outputs, the custom
  VJPs and the per-device split are checked; the kernels themselves need a GPU.
- The Triton convolution kernels under Triton's interpreter (a subprocess).
- The optional packages of the `kernels` extra import on a CPU machine.
- The self-check: a wrong backend fails it, a crashing one too, a refusal is reported and does not.
"""

import importlib
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from shared import kernels
from shared.variant import ROOT

A = importlib.import_module("shared.kernels.attention")
CE = importlib.import_module("shared.kernels.cross_entropy")
NORM = importlib.import_module("shared.kernels.rms_norm")
CONV = importlib.import_module("shared.kernels.conv")
DISPATCH = importlib.import_module("shared.kernels.dispatch")
PALLAS = importlib.import_module("shared.kernels.pallas_attention")
BLOCKED = importlib.import_module("shared.kernels.blocked_attention")


def rand(rng, *shape, dtype=jnp.float32):
    return jnp.asarray(rng.standard_normal(shape), dtype)


def close(a, b, tol, what):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    err = np.max(np.abs(a - b)) / max(1.0, np.max(np.abs(b)))
    assert err < tol, f"{what}: max error {err:.2e}"


def mesh42():
    return jax.make_mesh((4, 2), ("data", "model"), axis_types=(AxisType.Explicit,) * 2)


# ---------------------------------------------------------------- dispatch

GPU_ONLY = {
    "attention": ("cudnn", "flash4", "pallas"),
    "cross_entropy": ("quack",),
    "rms_norm": ("quack",),
    "short_conv": ("triton",),
}


@pytest.fixture
def fresh_record(monkeypatch):
    """An empty record of dispatch choices (and of what was logged) for this test."""
    monkeypatch.setattr(DISPATCH, "_choices", {})
    monkeypatch.setattr(DISPATCH, "_logged", set())


def test_auto_on_cpu_takes_the_reference_or_blocked_by_the_measured_rule(monkeypatch, fresh_record):
    """The GPU backends are unavailable on CPU, and `auto` takes the reference for every op there but
    attention, where it takes blocked where the rule measured on CPU says it pays (float32, causal,
    T >= 128, no window or one of at least 48; shared/kernels/blocked_attention.py). A rule of the
    call's shape alone: the same call picks the same backend every time (a resumed run too)."""
    monkeypatch.delenv("STENCIL_KERNELS", raising=False)
    assert set(GPU_ONLY) == set(kernels.REGISTRIES)
    for op, gpu in GPU_ONLY.items():
        here = kernels.available_backends(op)
        assert "reference" in here and not set(gpu) & set(here), (op, here)
    assert kernels.available_backends("attention") == ["blocked", "reference"]
    rng = np.random.default_rng(0)
    x, w = rand(rng, 2, 5, 8), jnp.ones(8)
    np.testing.assert_allclose(kernels.rms_norm(x, w, eps=1e-5), NORM.reference(x, w, eps=1e-5))
    taps, docs = rand(rng, 4, 8), jnp.zeros((2, 5), jnp.int32)
    np.testing.assert_allclose(kernels.short_conv(x, taps, docs), CONV.reference(x, taps, docs))
    kernels.cross_entropy(x, rand(rng, 8, 16), jnp.zeros((2, 5), jnp.int32), jnp.ones((2, 5)))

    def auto(T, dtype=jnp.float32, **kw):  # the backend auto picks (the choice is made while tracing)
        x = jax.ShapeDtypeStruct((2, T, 4, 16), dtype)
        kv = jax.ShapeDtypeStruct((2, T, 2, 16), dtype)
        before = {b: len(keys) for b, keys in kernels.choices().get("attention", {}).items()}
        jax.eval_shape(lambda q, k, v: kernels.attention(q, k, v, **kw), x, kv, kv)
        after = kernels.choices()["attention"]
        return [b for b, keys in after.items() if len(keys) > before.get(b, 0)]

    assert auto(128) == ["blocked"] and auto(256, window=64) == ["blocked"] and auto(512, window=48) == ["blocked"]
    assert auto(64) == ["reference"] and auto(512, window=32) == ["reference"]
    assert auto(136, jnp.bfloat16) == ["reference"] and auto(144, causal=False) == ["reference"]  # (a new shape
    # each: the record keeps one entry per backend and shape)
    assert auto(128) == [] and auto(64) == []  # the same calls again: the same choice, not recorded twice
    chosen = kernels.choices()
    assert set(chosen) == set(GPU_ONLY) and all(
        list(per) == ["reference"] for op, per in chosen.items() if op != "attention"
    ), chosen
    call = kernels.AttentionCall((2, 256, 4, 16), (2, 256, 2, 16), jnp.dtype(jnp.float32), True, None, False)
    assert A.BACKENDS["blocked"].auto_skip(call) is None
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")  # elsewhere auto passes over it: measured on CPU only
    assert A.BACKENDS["blocked"].auto_skip(call) == "measured to pay on CPU only, not on 'gpu'"


def test_every_choice_is_logged_once_and_recorded(monkeypatch, fresh_record, caplog):
    """Named and `auto` choices alike: one log line per (op, backend, how chosen and what `auto` skipped), not per
    call shape (a run's sample would repeat its training's lines); every call shape in kernels.choices()."""
    monkeypatch.delenv("STENCIL_KERNELS", raising=False)
    q, q2 = jnp.ones((1, 8, 2, 16)), jnp.ones((1, 16, 2, 16))
    with caplog.at_level("INFO", logger="stencil.kernels"):
        for _ in range(2):
            kernels.attention(q, q, q, backend="reference")
            kernels.attention(q, q, q, window=4)
            kernels.attention(q2, q2, q2)
        monkeypatch.setenv("STENCIL_KERNELS", "rms_norm=reference")
        kernels.rms_norm(jnp.ones((2, 8)), jnp.ones(8))
    lines = [r.getMessage() for r in caplog.records if r.name == "stencil.kernels"]
    assert len(lines) == 3, lines  # q2's auto choice is q's with window=4's: not said again
    assert "attention backend reference for q(1, 8, 2, 16) window=None (named)" in lines
    assert any(
        ln.startswith("attention backend reference for q(1, 8, 2, 16) window=4 (auto; skipped cudnn") for ln in lines
    ), lines
    assert "rms_norm backend reference for x(2, 8) (named by STENCIL_KERNELS)" in lines
    assert kernels.choices() == {
        "attention": {
            "reference": ["q(1, 8, 2, 16) window=None", "q(1, 8, 2, 16) window=4", "q(1, 16, 2, 16) window=None"]
        },
        "rms_norm": {"reference": ["x(2, 8)"]},
    }
    kernels.choices()["attention"]["reference"].clear()  # a copy: the record is not changed through it
    assert len(kernels.choices()["attention"]["reference"]) == 3


# ---------------------------------------------------------------- a backend that runs on CPU


def _no_windows(c):
    return "this test backend has no sliding window" if c.window is not None else None


@pytest.fixture
def cpu_backend(monkeypatch):
    """A test-only attention backend that runs on CPU (the reference's math, counted), refuses windows,
    and is not measured to pay on CPU; first in `auto`'s order. Returns the list its runs append to."""
    ran = []

    def run(q, k, v, **kw):
        ran.append(kw.get("window"))
        return A.reference(q, k, v, **kw)

    b = A.Backend("cpu_test", lambda: None, _no_windows, run, lambda c: DISPATCH.not_measured_here("gpu"))
    registry = {"cpu_test": b, **A.BACKENDS}
    monkeypatch.setattr(A, "BACKENDS", registry)
    monkeypatch.setitem(kernels.REGISTRIES, "attention", registry)
    return ran


def test_a_cpu_backend_is_usable_only_for_the_calls_it_does_not_refuse(cpu_backend, monkeypatch, fresh_record):
    """Against the other backends that run here, whichever they are (the test does not list them)."""
    monkeypatch.delenv("STENCIL_KERNELS", raising=False)
    others = [b for b in kernels.available_backends("attention") if b != "cpu_test"]
    assert kernels.available_backends("attention") == ["cpu_test", *others] and "reference" in others
    rng = np.random.default_rng(4)
    q, k, v = rand(rng, 2, 8, 4, 16), rand(rng, 2, 8, 2, 16), rand(rng, 2, 8, 2, 16)
    call = lambda window: kernels.AttentionCall(q.shape, k.shape, q.dtype, True, window, False)  # noqa: E731
    assert kernels.usable("attention", call(None))[0] == "cpu_test"
    windowed = kernels.usable("attention", call(4))
    assert "cpu_test" not in windowed and "reference" in windowed
    assert kernels.refusal("attention", "cpu_test", call(4)) == "this test backend has no sliding window"
    assert kernels.refusal("attention", "cpu_test", call(None)) is None
    assert kernels.refusal("attention", "cudnn", call(None)).startswith("cuDNN attention takes bfloat16")  # any machine
    assert kernels.refusal("attention", "nope", call(None)).startswith("unknown backend 'nope'")
    assert kernels.refusal("attention", "auto", call(4)) is None
    # named: it runs (and equals the reference), or raises with its reason; never falls back
    close(kernels.attention(q, k, v, backend="cpu_test"), A.reference(q, k, v), 1e-6, "cpu_test")
    assert cpu_backend == [None]
    with pytest.raises(kernels.AttentionError, match="'cpu_test' cannot run this call: .*no sliding window") as e:
        kernels.attention(q, k, v, window=4, backend="cpu_test")
    assert e.value.refusal == "this test backend has no sliding window"
    # auto: not measured on CPU, so passed over in favour of the next backend that takes the call
    kernels.attention(q, k, v)
    assert cpu_backend == [None] and kernels.choices()["attention"]["cpu_test"] == ["q(2, 8, 4, 16) window=None"]
    assert len(kernels.choices()["attention"]) == 2, kernels.choices()  # and auto's choice, another backend
    # once a CPU measurement lets it into `auto`, auto takes it where it does not refuse
    b = A.BACKENDS["cpu_test"]
    monkeypatch.setitem(A.BACKENDS, "cpu_test", A.Backend(b.name, b.unavailable, b.refuses, b.run))
    kernels.attention(q, k, v)
    kernels.attention(q, k, v, window=4)
    assert cpu_backend == [None, None]


def test_not_measured_here_names_the_platform():
    assert DISPATCH.not_measured_here("cpu") is None
    assert "not measured to pay on 'cpu'" in DISPATCH.not_measured_here("gpu")
    assert "nothing yet" in DISPATCH.not_measured_here()


@pytest.mark.parametrize(
    "op,name,call",
    [
        ("attention", "flash4", lambda b: kernels.attention(*(jnp.ones((1, 8, 2, 16), jnp.bfloat16),) * 3, backend=b)),
        ("attention", "pallas", lambda b: kernels.attention(*(jnp.ones((1, 8, 2, 16)),) * 3, backend=b)),
        ("rms_norm", "quack", lambda b: kernels.rms_norm(jnp.ones((2, 8)), jnp.ones(8), backend=b)),
        (
            "cross_entropy",
            "quack",
            lambda b: kernels.cross_entropy(
                jnp.ones((1, 4, 8)), jnp.ones((8, 16)), jnp.zeros((1, 4), jnp.int32), jnp.ones((1, 4)), backend=b
            ),
        ),
        ("short_conv", "triton", lambda b: kernels.short_conv(jnp.ones((1, 4, 8)), jnp.ones((4, 8)), backend=b)),
    ],
)
def test_named_gpu_backend_on_cpu_says_why(op, name, call, monkeypatch):
    monkeypatch.delenv("STENCIL_KERNELS", raising=False)
    with pytest.raises(kernels.KernelError, match=f"{op} backend '{name}' cannot run this call: .*NVIDIA GPU"):
        call(name)
    monkeypatch.setenv("STENCIL_KERNELS", f"{op}={name}")  # named for the whole process: the same error
    with pytest.raises(kernels.KernelError, match=f"{op} backend '{name}' cannot run"):
        call("auto")
    monkeypatch.setenv("STENCIL_KERNELS", f"{op}=reference")
    call("auto")
    with pytest.raises(kernels.KernelError, match=f"unknown {op} backend 'nope'"):
        call("nope")


def test_kernel_backends_refuse_what_they_cannot_express(monkeypatch):
    """Pretend each GPU backend is present: calls it cannot express are refused by name, never run."""
    ran = []
    for name in ("flash4", "pallas"):
        b = A.BACKENDS[name]
        monkeypatch.setitem(A.BACKENDS, name, A.Backend(name, lambda: None, b.refuses, lambda *a, **k: ran.append(1)))
    q = jnp.ones((1, 8, 2, 16), jnp.bfloat16)
    seg = jnp.ones((1, 8), jnp.int32)
    with pytest.raises(kernels.AttentionError, match="flash4.*no segment ids"):
        kernels.attention(q, q, q, segment_ids=seg, backend="flash4")
    with pytest.raises(kernels.AttentionError, match="flash4.*head_dim"):
        kernels.attention(*(jnp.ones((1, 8, 2, 256), jnp.bfloat16),) * 3, backend="flash4")
    with pytest.raises(kernels.AttentionError, match="pallas.*can leave a query no key"):
        kernels.attention(
            q,
            jnp.ones((1, 12, 2, 16), jnp.bfloat16),
            jnp.ones((1, 12, 2, 16), jnp.bfloat16),
            causal=False,
            window=2,
            backend="pallas",
        )
    assert not ran
    # auto passes over a backend that refuses (flash4: segment ids) and takes the next one that can
    kernels.attention(q, q, q, segment_ids=seg)
    assert ran == [1]
    for registry, name in ((CE.BACKENDS, "quack"), (NORM.BACKENDS, "quack"), (CONV.BACKENDS, "triton")):
        b = registry[name]
        monkeypatch.setitem(registry, name, b.__class__(name, lambda: None, b.refuses, lambda *a, **k: ran.append(2)))
    m = mesh42()
    with jax.set_mesh(m):
        put = lambda x, *s: jax.device_put(x, NamedSharding(m, P(*s)))  # noqa: E731
        with pytest.raises(kernels.CrossEntropyError, match="whole vocabulary rows"):
            kernels.cross_entropy(
                put(jnp.ones((4, 4, 8)), "data"),
                put(jnp.ones((8, 16)), None, "model"),
                put(jnp.zeros((4, 4), jnp.int32), "data"),
                put(jnp.ones((4, 4)), "data"),
                backend="quack",
            )
        with pytest.raises(kernels.NormError, match="whole rows"):
            kernels.rms_norm(put(jnp.ones((4, 8)), "data", "model"), jnp.ones(8), backend="quack")
        with pytest.raises(kernels.ConvError, match="whole rows in time"):
            kernels.short_conv(put(jnp.ones((4, 8, 4)), "data", "model"), jnp.ones((4, 4)), backend="triton")
    assert ran == [1]


# ---------------------------------------------------------------- blocked attention (plain JAX, runs on CPU)

BLOCKED_CASES = {  # name: B, T, S, H, Hkv, D, causal, window, segments, softcap; blocks of 8 tokens
    "causal, GQA, documents, T not a multiple of the block": (2, 21, 21, 4, 2, 8, True, None, True, 0.0),
    "window 10 across blocks, G=3, softcap": (2, 21, 21, 6, 2, 8, True, 10, False, 3.0),  # offset 2: 1 pair
    "window 1, MQA": (1, 16, 16, 4, 1, 8, True, 1, False, 0.0),
    "non-causal window, documents, softcap": (2, 19, 19, 4, 2, 8, False, 5, True, 2.0),
    "non-causal, S > T": (2, 12, 20, 4, 2, 8, False, None, False, 0.0),
}


@pytest.mark.parametrize("case", list(BLOCKED_CASES))
def test_blocked_attention_matches_reference(case):
    """Output, lse and the gradients of q, k, v (with a cotangent on out and on lse) against the reference's
    dense masked path (the definition; variants/swa_hybrid/test_swa_hybrid.py checks its blockwise path against it)."""
    B, T, S, H, Hkv, D, causal, window, segments, softcap = BLOCKED_CASES[case]
    rng = np.random.default_rng(T + S + H)
    q, k, v = rand(rng, B, T, H, D), rand(rng, B, S, Hkv, D), rand(rng, B, S, Hkv, D)
    seg = jnp.asarray(np.sort(rng.integers(0, 3, (B, T)), axis=1), jnp.int32) if segments else None
    ct, ct_lse = rand(rng, B, T, H, D), rand(rng, B, T, H)
    kw = dict(segment_ids=seg, causal=causal, window=window, softcap=softcap, return_lse=True)

    @jax.jit
    def both(q, k, v):
        outs = []
        for f in (lambda q, k, v: BLOCKED.attention(q, k, v, block=8, **kw), lambda q, k, v: A._dense(q, k, v, **kw)):
            (out, lse), vjp = jax.vjp(f, q, k, v)
            outs.append((out, lse, *vjp((ct, ct_lse))))
        return outs

    got, want = both(q, k, v)
    for name, a, b in zip(["out", "lse", "dq", "dk", "dv"], got, want):
        close(a, b, 1e-5, f"{case}: {name}")


def test_blocked_plan_visits_every_visible_block_pair_and_no_hidden_one():
    """The offsets `plan` lists hold every (query, key) pair the masks let through, and each holds one;
    windows on either side of a multiple of the block (W = 10 reaches 2 blocks back by one pair)."""
    block = 8
    for causal in (True, False):
        for window in (None, 1, 2, 7, 8, 9, 10, 16, 17, 40):
            for T, S in ((45, 45), (45, 21), (21, 45)):
                if T != S and (causal or window):  # causal needs T == S; blocked refuses such windows
                    continue
                t, s = np.arange(T)[:, None], np.arange(S)[None, :]
                ok = np.ones((T, S), bool) & ((s <= t) if causal else True) & ((t - s < window) if window else True)
                steps = BLOCKED.plan(-(-T // block), -(-S // block), block, causal, window)
                pairs = {(i, i - d) for d, lo, hi in steps for i in range(lo, hi)}
                visible = {(a // block, b // block) for a, b in zip(*np.nonzero(ok))}
                assert pairs == visible, (causal, window, T, S, sorted(pairs ^ visible))
                assert len({d for d, _, _ in steps}) == len(steps)


def test_blocked_attention_cost_is_linear_in_T_for_a_window():
    """Blocks outside the window are never computed: at a fixed window the forward's FLOPs double
    when T doubles (the reference's dense path would quadruple); causal attention computes about half the
    logits of the dense reference."""
    H, D = 2, 16

    def fl(T, f):  # XLA's count of the lowered program (no compilation)
        q = jax.ShapeDtypeStruct((1, T, H, D), jnp.float32)
        return jax.jit(f).lower(q, q, q).cost_analysis()["flops"]

    blocked = lambda W: lambda q, k, v: BLOCKED.attention(q, k, v, window=W, block=32)  # noqa: E731
    f1, f2 = fl(1024, blocked(64)), fl(2048, blocked(64))
    assert 1.8 < f2 / f1 < 2.2, (f1, f2)
    causal = fl(256, blocked(None)) / fl(256, lambda q, k, v: A._dense(q, k, v))
    assert 0.45 < causal < 0.65, causal


def test_blocked_attention_runs_per_device_under_a_mesh():
    """kernels.attention(backend="blocked") with batch over `data`, heads over `model` (4 x 2): the values and
    gradients of the unsharded reference, the output sharded like q."""
    rng = np.random.default_rng(3)
    B, T, H, Hkv, D = 4, 24, 4, 2, 8
    q, k, v = rand(rng, B, T, H, D), rand(rng, B, T, Hkv, D), rand(rng, B, T, Hkv, D)
    seg = jnp.asarray(np.sort(rng.integers(0, 2, (B, T)), axis=1), jnp.int32)

    def loss(backend):
        return lambda q, k, v, s: jnp.sum(
            kernels.attention(q, k, v, segment_ids=s, window=12, softcap=3.0, backend=backend) ** 2
        )

    want = jax.jit(jax.value_and_grad(loss("reference"), (0, 1, 2)))(q, k, v, seg)
    m = mesh42()
    with jax.set_mesh(m):
        heads = NamedSharding(m, P("data", None, "model", None))
        args = [jax.device_put(x, heads) for x in (q, k, v)] + [jax.device_put(seg, NamedSharding(m, P("data", None)))]
        out = jax.jit(
            lambda q, k, v, s: kernels.attention(q, k, v, segment_ids=s, window=12, softcap=3.0, backend="blocked")
        )(*args)
        got = jax.jit(jax.value_and_grad(loss("blocked"), (0, 1, 2)))(*args)
    assert out.sharding.spec == P("data", None, "model", None), out.sharding.spec
    close(got[0], want[0], 1e-5, "loss")
    for name, a, b in zip("qkv", got[1], want[1]):
        assert a.sharding.spec == P("data", None, "model", None), (name, a.sharding.spec)
        close(a, b, 1e-5, f"d{name}")


def test_blocked_attention_refuses_what_it_cannot_express():
    q = jnp.ones((1, 8, 2, 16))
    kv = jnp.ones((1, 12, 2, 16))
    with pytest.raises(kernels.AttentionError, match="'blocked' cannot run this call: .*can leave a query no key"):
        kernels.attention(q, kv, kv, causal=False, window=2, backend="blocked")


# ---------------------------------------------------------------- Pallas attention

PALLAS_CASES = [  # B, T, H, Hkv, D, causal, window, segments, softcap
    (2, 40, 4, 2, 16, True, None, False, 0.0),  # T not a multiple of the block; GQA
    (1, 64, 2, 2, 32, True, 10, True, 0.0),  # window + packed documents
    (1, 48, 4, 1, 24, True, None, True, 5.0),  # MQA, head_dim padded to 32, soft-capping
    (2, 32, 2, 2, 16, False, None, True, 0.0),  # non-causal with documents
]


@pytest.mark.parametrize("B,T,H,Hkv,D,causal,window,segments,softcap", PALLAS_CASES)
def test_pallas_attention_matches_reference(B, T, H, Hkv, D, causal, window, segments, softcap):
    rng = np.random.default_rng(T + H)
    q, k, v = rand(rng, B, T, H, D), rand(rng, B, T, Hkv, D), rand(rng, B, T, Hkv, D)
    seg = jnp.asarray(np.sort(rng.integers(0, 3, (B, T)), axis=1), jnp.int32) if segments else None
    ct = rand(rng, B, T, H, D)
    kw = dict(segment_ids=seg, causal=causal, window=window, softcap=softcap)

    def loss(fn):
        return jax.jit(jax.value_and_grad(lambda q, k, v: jnp.sum(fn(q, k, v) * ct), (0, 1, 2)))

    got = loss(lambda q, k, v: PALLAS.attention(q, k, v, block=16, interpret=True, **kw))(q, k, v)
    want = loss(lambda q, k, v: A.reference(q, k, v, **kw))(q, k, v)
    close(got[0], want[0], 1e-5, "loss")
    for name, a, b in zip("qkv", got[1], want[1]):
        close(a, b, 1e-4, f"d{name}")


def test_pallas_attention_runs_per_device_under_a_mesh():
    """Batch over `data`, heads over `model`: each device runs the kernel on its own block."""
    rng = np.random.default_rng(3)
    B, T, H, Hkv, D = 4, 32, 4, 2, 16
    q, k, v = rand(rng, B, T, H, D), rand(rng, B, T, Hkv, D), rand(rng, B, T, Hkv, D)
    seg = jnp.asarray(np.sort(rng.integers(0, 2, (B, T)), axis=1), jnp.int32)
    want = A.reference(q, k, v, segment_ids=seg, window=8)
    m = mesh42()
    with jax.set_mesh(m):
        heads = NamedSharding(m, P("data", None, "model", None))
        args = [jax.device_put(x, heads) for x in (q, k, v)]
        got = jax.jit(lambda q, k, v, s: A._pallas(q, k, v, segment_ids=s, window=8, interpret=True))(
            *args, jax.device_put(seg, NamedSharding(m, P("data", None)))
        )
    close(got, want, 1e-5, "sharded pallas attention")


def test_pallas_attention_lowers_for_cuda():
    x = jax.ShapeDtypeStruct((2, 256, 4, 64), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((2, 256, 2, 64), jnp.bfloat16)
    seg = jax.ShapeDtypeStruct((2, 256), jnp.int32)
    f = jax.grad(
        lambda q, k, v, s: jnp.sum(
            PALLAS.attention(q, k, v, segment_ids=s, window=64, softcap=30.0).astype(jnp.float32)
        ),
        (0, 1, 2),
    )
    text = jax.jit(f).trace(x, kv, kv, seg).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("xla.gpu.triton") == 3, "expected the forward, dQ and dK/dV Triton kernels"


# ---------------------------------------------------------------- torch glue with stand-ins


@pytest.fixture
def torch():
    return pytest.importorskip(
        "torch",
        reason="torch is not installed: pip install torch==2.13.0 (a CPU build), then -e '.[kernels]' (README, 'Set up and run')",
    )


def _torch_attention(torch, q, k, v, scale, causal, softcap, window_left):
    G = q.shape[2] // k.shape[2]
    k, v = k.repeat_interleave(G, dim=2), v.repeat_interleave(G, dim=2)
    s = torch.einsum("bthd,bshd->bhts", q, k) * scale
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    T = q.shape[1]
    t, u = torch.arange(T)[:, None], torch.arange(T)[None, :]
    ok = torch.ones(T, T, dtype=torch.bool)
    if causal:
        ok &= u <= t
    if window_left is not None:
        ok &= t - u <= window_left
    s = s.masked_fill(~ok, float("-inf"))
    return torch.einsum("bhts,bshd->bthd", torch.softmax(s, -1), v), torch.logsumexp(s, -1)


def test_flash4_glue_with_a_torch_stand_in(torch, monkeypatch):
    def fwd(q, k, v, out, lse, *, scale, causal, softcap, window_left):
        o, l = _torch_attention(torch, q, k, v, scale, causal, softcap, window_left)
        out.copy_(o)
        lse.copy_(l)

    def bwd(q, k, v, out, dout, lse, dq, dk, dv, *, scale, causal, softcap, window_left):
        leaves = [x.detach().clone().requires_grad_(True) for x in (q, k, v)]
        o, _ = _torch_attention(torch, *leaves, scale, causal, softcap, window_left)
        for g, d in zip(torch.autograd.grad(o, leaves, dout), (dq, dk, dv)):
            d.copy_(g)

    monkeypatch.setattr(A, "FA4_KERNELS", (fwd, bwd))
    rng = np.random.default_rng(0)
    q, k, v, ct = rand(rng, 2, 24, 4, 16), rand(rng, 2, 24, 2, 16), rand(rng, 2, 24, 2, 16), rand(rng, 2, 24, 4, 16)
    for kw in (dict(causal=True), dict(causal=True, window=5, softcap=3.0)):

        def loss(fn):
            return jax.jit(jax.value_and_grad(lambda q, k, v: jnp.sum(fn(q, k, v) * ct), (0, 1, 2)))

        got = loss(lambda q, k, v: A._flash4(q, k, v, **kw))(q, k, v)
        want = loss(lambda q, k, v: A.reference(q, k, v, **kw))(q, k, v)
        close(got[0], want[0], 1e-5, f"{kw} loss")
        for name, a, b in zip("qkv", got[1], want[1]):
            close(a, b, 1e-4, f"{kw} d{name}")


def test_quack_rms_norm_glue_with_a_torch_stand_in(torch, monkeypatch):
    def ref(x, w, eps):
        rstd = torch.rsqrt((x.float() ** 2).mean(-1) + eps)
        return (x.float() * rstd[:, None] * w.float()).to(x.dtype), rstd

    def fwd(x, w, out, rstd, *, eps):
        o, r = ref(x, w, eps)
        out.copy_(o)
        rstd.copy_(r)

    def bwd(x, w, dout, rstd, dx, dw):
        xl, wl = x.detach().clone().requires_grad_(True), w.detach().clone().requires_grad_(True)
        gx, gw = torch.autograd.grad(ref(xl, wl, 1e-5)[0], (xl, wl), dout)
        dx.copy_(gx)
        dw.copy_(gw)

    monkeypatch.setattr(NORM, "QUACK_KERNELS", (fwd, bwd))
    rng = np.random.default_rng(1)
    x, w, ct = rand(rng, 4, 6, 16), 1 + 0.1 * rand(rng, 16), rand(rng, 4, 6, 16)

    def grads(fn):
        return jax.jit(jax.value_and_grad(lambda x, w: jnp.sum(fn(x, w) * ct), (0, 1)))

    want = grads(lambda x, w: NORM.reference(x, w, eps=1e-5))(x, w)
    got = grads(lambda x, w: NORM._quack(x, w, eps=1e-5))(x, w)
    m = mesh42()
    with jax.set_mesh(m):  # rows over `data`: w's gradient must be summed over the 4 row shards
        xs = jax.device_put(x, NamedSharding(m, P("data", None, None)))
        sharded = grads(lambda x, w: NORM._quack(x, w, eps=1e-5))(xs, jax.device_put(w, NamedSharding(m, P())))
    for g in (got, sharded):
        close(g[0], want[0], 1e-5, "value")
        close(g[1][0], want[1][0], 1e-5, "dx")
        close(g[1][1], want[1][1], 1e-5, "dw")


def test_quack_cross_entropy_glue_with_a_torch_stand_in(torch, monkeypatch):
    def fwd(x, target, loss, lse):
        lse.copy_(torch.logsumexp(x, -1))
        loss.copy_(lse - x.gather(1, target.long()[:, None])[:, 0])

    def bwd(x, target, dloss, lse, dx):
        p = torch.softmax(x, -1)
        p[torch.arange(x.shape[0]), target.long()] -= 1
        dx.copy_(dloss[:, None] * p)

    monkeypatch.setattr(CE, "QUACK_KERNELS", (fwd, bwd))
    rng = np.random.default_rng(2)
    B, T, D, V = 2, 12, 16, 50
    h, w = rand(rng, B, T, D), 0.3 * rand(rng, D, V)
    t = jnp.asarray(rng.integers(0, V, (B, T)), jnp.int32)
    m = jnp.asarray(rng.random((B, T)) > 0.2, jnp.float32)

    def total(h, w, backend):
        nll, zsq = kernels.cross_entropy(h, w, t, m, max_logits=B * 4 * V, backend=backend)
        return nll + 0.1 * zsq  # both outputs carry gradient: the z-loss path is checked too

    monkeypatch.setitem(CE.BACKENDS, "quack", CE.Backend("quack", lambda: None, CE._quack_refuses, CE._rows_quack))
    got = jax.jit(jax.value_and_grad(lambda h, w: total(h, w, "quack"), (0, 1)))(h, w)
    want = jax.jit(jax.value_and_grad(lambda h, w: total(h, w, "reference"), (0, 1)))(h, w)
    close(got[0], want[0], 1e-5, "loss")
    close(got[1][0], want[1][0], 1e-5, "dh")
    close(got[1][1], want[1][1], 1e-5, "dw")


# ---------------------------------------------------------------- Triton convolution (interpreter)

TRITON_CHECK = r"""
import os, sys
os.environ["TRITON_INTERPRET"] = "1"
sys.path.insert(0, sys.argv[1])
import jax, jax.numpy as jnp, numpy as np, torch
from shared.kernels import triton_conv as tc
from shared.kernels.conv import reference
B, T, C, W, BT, BC = 2, 37, 70, 4, 16, 32
rng = np.random.default_rng(0)
x, w, dout = (rng.standard_normal(s).astype(np.float32) for s in ((B, T, C), (W, C), (B, T, C)))
docs = np.sort(rng.integers(0, 3, (B, T)), axis=1).astype(np.int32)
NT, NC = -(-T // BT), -(-C // BC)
out, dx, parts = torch.zeros(B, T, C), torch.zeros(B, T, C), torch.zeros(B, NT, W, C)
args = [torch.tensor(a) for a in (x, w, docs)]
tc.conv_fwd[(B, NT, NC)](*args, out, T=T, C=C, W=W, BLOCK_T=BT, BLOCK_C=BC)
tc.conv_bwd[(B, NT, NC)](*args, torch.tensor(dout), dx, parts, T=T, C=C, NT=NT, W=W, BLOCK_T=BT, BLOCK_C=BC)
y, vjp = jax.vjp(lambda x, w: reference(x, w, jnp.asarray(docs)), jnp.asarray(x), jnp.asarray(w))
gx, gw = vjp(jnp.asarray(dout))
errs = [np.abs(out.numpy() - np.asarray(y)).max(), np.abs(dx.numpy() - np.asarray(gx)).max(),
        np.abs(parts.sum((0, 1)).numpy() - np.asarray(gw)).max()]
print("errors", errs)
assert max(errs) < 1e-4, errs
"""


def test_triton_conv_kernels_match_reference_in_the_interpreter(torch):
    pytest.importorskip("triton", reason="triton is not installed (the `kernels` extra brings it)")
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    r = subprocess.run([sys.executable, "-c", TRITON_CHECK, ROOT], capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 0, r.stdout + r.stderr[-3000:]


# ---------------------------------------------------------------- the `kernels` extra


@pytest.mark.parametrize(
    "module",
    ["torch", "tvm_ffi", "cutlass", "flash_attn.cute", "quack.rmsnorm", "quack.cross_entropy", "triton", "jax_triton"],
)
def test_kernels_extra_imports_on_cpu(module):
    """Each optional package imports in a CPU environment, or the test says why it cannot here."""
    try:
        importlib.import_module(module.split(".")[0])
    except ModuleNotFoundError:
        pytest.skip(
            f"{module}: the `kernels` extra is not installed here (pip install torch==<cpu build>; "
            "pip install -e '.[kernels]')"
        )
    except ImportError as e:
        if "GPU" in str(e) or "CUDA" in str(e) or "cuda" in str(e):
            pytest.skip(f"{module} cannot import without a GPU: {str(e).splitlines()[0]}")
        raise
    importlib.import_module(module)


# ---------------------------------------------------------------- the self-check


def test_selfcheck_reports_every_backend_and_flags_a_wrong_one(monkeypatch):
    import io

    from shared.kernels import selfcheck

    out = io.StringIO()
    assert selfcheck.run(quick=True, repeats=1, ops=("rms_norm", "short_conv"), out=out) == 0, out.getvalue()
    text = out.getvalue()
    assert "rms_norm" in text and "short_conv" in text and "GB/s" in text and "all backends within tolerance" in text
    # a backend that is 1% off must be caught
    wrong = NORM.Backend("wrong", lambda: None, lambda c: None, lambda x, w, eps: NORM.reference(x, w, eps=eps) * 1.01)
    monkeypatch.setitem(NORM.BACKENDS, "wrong", wrong)
    out = io.StringIO()
    assert selfcheck.run(quick=True, repeats=1, ops=("rms_norm",), out=out) == 1
    assert "wrong" in out.getvalue() and "over tolerance" in out.getvalue()


def test_selfcheck_takes_an_attention_shape(capsys):
    """--shape B,T,H,Hkv,D sets the attention cases' shape and --window their window case, with blocked
    among the backends checked on CPU; bad values are refused by name."""
    from shared.kernels import selfcheck

    cases = [c for c in selfcheck._cases(True, False, (2, 24, 4, 2, 8), 6) if c[0] == "attention"]
    assert [c[1] for c in cases] == [
        "causal B2 T24 H4/2 D8",
        "window 6 B2 T24 H4/2 D8",
        "causal + documents B2 T24 H4/2 D8",
        "causal + softcap 30 B2 T24 H4/2 D8",
    ]
    assert [x.shape for x in cases[0][4]] == [(2, 24, 4, 8), (2, 24, 2, 8), (2, 24, 2, 8)]
    assert {"blocked", "reference"} <= set(cases[0][2])
    for bad, msg in (
        (["--shape", "1,2,3"], "five positive integers"),
        (["--shape", "1,8,3,2,8"], "not a multiple"),
        (["--window", "0"], "--window must be >= 1"),
    ):
        with pytest.raises(SystemExit):
            selfcheck.main(bad)
        assert msg in capsys.readouterr().err


def test_selfcheck_reports_a_refusal_and_does_not_count_it(monkeypatch):
    """A backend that refuses a case (as cuDNN refuses soft-capping on a GPU) is listed with its reason and
    leaves the exit status at 0; one that crashes while running fails the check."""
    import io

    from shared.kernels import selfcheck

    refuser = NORM.Backend(
        "refuser",
        lambda: None,
        lambda c: "this backend takes no rows of 256",
        lambda x, w, eps: pytest.fail("a refused call ran"),
    )
    monkeypatch.setitem(NORM.BACKENDS, "refuser", refuser)
    out = io.StringIO()
    assert selfcheck.run(quick=True, repeats=1, ops=("rms_norm",), out=out) == 0, out.getvalue()
    text = out.getvalue()
    assert "refuser" in text and "refused: this backend takes no rows of 256" in text, text
    assert "1 case(s) refused by a backend (not failures)" in text and "all backends within tolerance" in text

    def crash(x, w, eps):
        raise RuntimeError("kernel launch failed")

    monkeypatch.setitem(NORM.BACKENDS, "crasher", NORM.Backend("crasher", lambda: None, lambda c: None, crash))
    out = io.StringIO()
    assert selfcheck.run(quick=True, repeats=1, ops=("rms_norm",), out=out) == 1
    assert "crasher" in out.getvalue() and "FAILED: RuntimeError: kernel launch failed" in out.getvalue()
