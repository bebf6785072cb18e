"""kernels.attention(..., return_lse=True): the log-sum-exp, learned sinks built on it, refusals.

Sinks are a learned per-head logit s_h that joins each query's softmax denominator without
a value. On the public API: out_sink = out * sigmoid(lse - s_h), since
sum_j e^l_j v_j / (Z + e^s) = out * Z / (Z + e^s) with Z = e^lse. Checked here, values and
gradients, against the plain definition (a sink column in the dense masked logits), on the
reference (dense and blockwise-window paths), on blocked attention (plain JAX, blocks of 16
here, so several per row) and on Pallas in interpret mode.
"""

import functools
import importlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from shared import kernels

A = importlib.import_module("shared.kernels.attention")
PALLAS = importlib.import_module("shared.kernels.pallas_attention")
BLOCKED = importlib.import_module("shared.kernels.blocked_attention")

CASES = {  # name: (B, T, H, Hkv, D, kwargs, segments)
    "causal": (2, 40, 4, 2, 8, dict(causal=True), False),
    "segments": (2, 40, 4, 2, 8, dict(causal=True), True),
    "window": (2, 40, 6, 2, 8, dict(causal=True, window=7, softcap=3.0), True),  # W < T: blockwise path; G = 3
}


def inputs(B, T, H, Hkv, D, segments, seed=0):
    rng = np.random.default_rng(seed)
    q, k, v = (jnp.asarray(rng.standard_normal(s), jnp.float32) for s in [(B, T, H, D), (B, T, Hkv, D), (B, T, Hkv, D)])
    seg = jnp.asarray(np.sort(rng.integers(0, 3, (B, T)), axis=1), jnp.int32) if segments else None
    sinks = jnp.asarray(rng.standard_normal(H), jnp.float32)
    return q, k, v, seg, sinks, jnp.asarray(rng.standard_normal((B, T, H, D)), jnp.float32)


def dense_logits(q, k, seg, causal=True, window=None, softcap=0.0):
    """[B, H, T, S] scaled, soft-capped logits, -inf where masked: the definition."""
    B, T, H, D = q.shape
    kk = jnp.repeat(k, H // k.shape[2], axis=2)
    x = jnp.einsum("bthd,bshd->bhts", q, kk) / np.sqrt(D)
    if softcap:
        x = softcap * jnp.tanh(x / softcap)
    t, s = np.arange(T)[:, None], np.arange(k.shape[1])[None, :]
    ok = np.ones((T, k.shape[1]), bool) & ((s <= t) if causal else True) & ((t - s < window) if window else True)
    ok = jnp.asarray(ok)[None, None]
    if seg is not None:
        ok = ok & (seg[:, None, :, None] == seg[:, None, None, :])
    return jnp.where(ok, x, -jnp.inf)


def dense_sinks(q, k, v, sinks, seg, **kw):
    """Append a sink column of logit s_h, softmax, drop the column, weight the values."""
    logits = dense_logits(q, k, seg, **kw)
    B, H, T, _ = logits.shape
    col = jnp.broadcast_to(sinks[None, :, None, None], (B, H, T, 1))
    p = jax.nn.softmax(jnp.concatenate([logits, col], axis=-1), axis=-1)[..., :-1]
    return jnp.einsum("bhts,bshd->bthd", p, jnp.repeat(v, H // v.shape[2], axis=2))


def api_sinks(q, k, v, sinks, seg, backend, **kw):
    """Learned sinks on the public API: what a variant writes."""
    out, lse = kernels.attention(q, k, v, segment_ids=seg, return_lse=True, backend=backend, **kw)
    return out * jax.nn.sigmoid(lse - sinks)[..., None].astype(out.dtype)


@pytest.fixture
def pallas_on_cpu(monkeypatch):
    """Make `backend="pallas"` run our kernels in interpret mode, and pallas and blocked run in blocks of 16
    (several per row)."""
    monkeypatch.setitem(
        A.BACKENDS,
        "pallas",
        A.Backend("pallas", lambda: None, A._pallas_refuses, functools.partial(A._pallas, interpret=True)),
    )
    monkeypatch.setattr(PALLAS, "default_block", lambda T: 16)
    monkeypatch.setattr(BLOCKED, "default_block", lambda T, window: 16)


def close(a, b, tol, what):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    err = np.max(np.abs(a - b)) / max(1.0, np.max(np.abs(b)))
    assert err < tol, f"{what}: max error {err:.2e}"


@pytest.mark.parametrize("backend", ["reference", "pallas"])  # blocked: tests/fast/test_kernel_backends.py
@pytest.mark.parametrize("case", list(CASES))
def test_lse_is_logsumexp_of_the_masked_logits(case, backend, pallas_on_cpu):
    B, T, H, Hkv, D, kw, segments = CASES[case]
    q, k, v, seg, _, _ = inputs(B, T, H, Hkv, D, segments)
    out, lse = jax.jit(
        lambda q, k, v: kernels.attention(q, k, v, segment_ids=seg, return_lse=True, backend=backend, **kw)
    )(q, k, v)
    assert lse.shape == (B, T, H) and lse.dtype == jnp.float32
    want = jax.nn.logsumexp(dense_logits(q, k, seg, **kw), axis=-1).transpose(0, 2, 1)  # [B, H, T] -> [B, T, H]
    close(lse, want, 1e-5, "lse")
    close(out, kernels.attention(q, k, v, segment_ids=seg, backend="reference", **kw), 1e-5, "out")


@pytest.mark.parametrize("backend", ["reference", "blocked", "pallas"])
@pytest.mark.parametrize("case", list(CASES))
def test_sinks_on_the_public_api_match_the_dense_definition(case, backend, pallas_on_cpu):
    B, T, H, Hkv, D, kw, segments = CASES[case]
    q, k, v, seg, sinks, ct = inputs(B, T, H, Hkv, D, segments, seed=1)

    def loss(fn):
        return jax.jit(jax.value_and_grad(lambda q, k, v, s: jnp.sum(fn(q, k, v, s) * ct), (0, 1, 2, 3)))

    got = loss(lambda q, k, v, s: api_sinks(q, k, v, s, seg, backend, **kw))(q, k, v, sinks)
    want = loss(lambda q, k, v, s: dense_sinks(q, k, v, s, seg, **kw))(q, k, v, sinks)
    close(got[0], want[0], 1e-5, "loss")
    for name, a, b in zip(["dq", "dk", "dv", "dsinks"], got[1], want[1]):
        close(a, b, 1e-5, name)


def test_lse_under_a_mesh_keeps_the_head_sharding(pallas_on_cpu):
    """Batch on `data`, heads on `model`: lse [B, T, H] comes back sharded like out, same values."""
    B, T, H, Hkv, D, kw, _ = CASES["segments"]
    q, k, v, seg, _, _ = inputs(4, T, H, Hkv, D, True, seed=2)
    want = kernels.attention(q, k, v, segment_ids=seg, return_lse=True, backend="reference")[1]
    mesh = jax.make_mesh((4, 2), ("data", "model"), axis_types=(AxisType.Explicit,) * 2)
    with jax.set_mesh(mesh):
        heads = NamedSharding(mesh, P("data", None, "model", None))
        args = [jax.device_put(x, heads) for x in (q, k, v)] + [jax.device_put(seg, NamedSharding(mesh, P("data")))]
        for backend in ("reference", "blocked", "pallas"):
            for window in (None, 8):  # dense and blockwise reference paths
                _, lse = jax.jit(
                    lambda q, k, v, s: kernels.attention(
                        q, k, v, segment_ids=s, window=window, return_lse=True, backend=backend
                    )
                )(*args)
                assert lse.sharding.spec == P("data", None, "model"), (backend, lse.sharding.spec)
                ref = (
                    want
                    if window is None
                    else kernels.attention(
                        q, k, v, segment_ids=seg, window=window, return_lse=True, backend="reference"
                    )[1]
                )
                close(lse, ref, 1e-5, f"{backend} window={window} lse")


def test_backends_that_cannot_return_lse_refuse_it_by_name(monkeypatch):
    """Pretend cuDNN and FA4 are present: return_lse is refused by name when they are named,
    `auto` passes over them (to the reference on CPU), and without return_lse they would run."""
    ran = []
    for name in ("cudnn", "flash4"):
        b = A.BACKENDS[name]
        monkeypatch.setitem(
            A.BACKENDS, name, A.Backend(name, lambda: None, b.refuses, lambda *a, name=name, **kw: ran.append(name))
        )
    monkeypatch.delenv("STENCIL_KERNELS", raising=False)
    q = jnp.ones((1, 8, 2, 16), jnp.bfloat16)
    for name in ("cudnn", "flash4"):
        with pytest.raises(kernels.AttentionError, match=f"'{name}' cannot run this call: .*return_lse"):
            kernels.attention(q, q, q, return_lse=True, backend=name)
    assert not ran
    out, lse = kernels.attention(q, q, q, return_lse=True)  # auto: cudnn and flash4 refuse, pallas is unavailable
    assert out.shape == q.shape and lse.shape == (1, 8, 2) and not ran
    kernels.attention(q, q, q, backend="cudnn")
    assert ran == ["cudnn"]
