"""shared/kernels: the reference attention against a plain loop, dispatch rules, cross-entropy."""

import importlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from shared import kernels

attn_mod = importlib.import_module("shared.kernels.attention")  # the module, not the function


def loop_attention(q, k, v, seg, causal, window):
    """One query at a time in numpy float64: the definition of the masks."""
    B, T, H, D = q.shape
    G = H // k.shape[2]
    out = np.zeros(q.shape)
    for b in range(B):
        for h in range(H):
            for t in range(T):
                keys = [
                    s
                    for s in range(k.shape[1])
                    if (not causal or s <= t)
                    and (window is None or t - s < window)
                    and (seg is None or seg[b, s] == seg[b, t])
                ]
                logits = np.array([q[b, t, h] @ k[b, s, h // G] for s in keys]) / np.sqrt(D)
                p = np.exp(logits - logits.max())
                p /= p.sum()
                out[b, t, h] = sum(pi * v[b, s, h // G] for pi, s in zip(p, keys))
    return out


@pytest.mark.parametrize(
    "causal,window,segments",
    [(True, None, False), (True, 3, False), (True, None, True), (True, 4, True), (False, None, True)],
)
def test_reference_matches_loop(causal, window, segments):
    rng = np.random.default_rng(0)
    B, T, H, Hkv, D = 2, 9, 4, 2, 8
    q, k, v = (rng.standard_normal(s).astype(np.float32) for s in [(B, T, H, D), (B, T, Hkv, D), (B, T, Hkv, D)])
    seg = np.array([[1] * 4 + [2] * 5, [1] * 9], np.int32) if segments else None
    got = kernels.attention(
        jnp.asarray(q),
        jnp.asarray(k),
        jnp.asarray(v),
        causal=causal,
        window=window,
        segment_ids=None if seg is None else jnp.asarray(seg),
        backend="reference",
    )
    np.testing.assert_allclose(np.asarray(got), loop_attention(q, k, v, seg, causal, window), rtol=1e-5, atol=1e-5)


def test_auto_is_reference_on_cpu_and_named_backends_never_fall_back(monkeypatch):
    assert jax.default_backend() == "cpu"
    here = kernels.available_backends()  # a CPU-capable backend may be here; the GPU ones may not
    assert "reference" in here and not {"cudnn", "flash4", "pallas"} & set(here), here
    q = jnp.ones((1, 4, 2, 8), jnp.bfloat16)
    calls = []
    monkeypatch.setitem(
        attn_mod.BACKENDS,
        "reference",
        attn_mod.Backend(
            "reference", lambda: None, lambda c: None, lambda *a, **kw: calls.append(1) or attn_mod.reference(*a, **kw)
        ),
    )
    kernels.attention(q, q, q)
    assert calls == [1], "auto did not pick the reference on CPU"
    with pytest.raises(kernels.AttentionError, match="needs an NVIDIA GPU"):
        kernels.attention(q, q, q, backend="cudnn")
    with pytest.raises(kernels.AttentionError, match="unknown attention backend 'flash'"):
        kernels.attention(q, q, q, backend="flash")


def test_backend_refuses_masks_it_cannot_express(monkeypatch):
    """Pretend cuDNN is present: a call it cannot express is refused by name, not run without the mask."""
    cud = attn_mod.BACKENDS["cudnn"]
    ran = []
    monkeypatch.setitem(
        attn_mod.BACKENDS, "cudnn", attn_mod.Backend("cudnn", lambda: None, cud.refuses, lambda *a, **kw: ran.append(1))
    )
    q16 = jnp.ones((1, 8, 2, 16), jnp.bfloat16)
    with pytest.raises(kernels.AttentionError, match="sliding window only together with the causal mask"):
        kernels.attention(q16, q16, q16, causal=False, window=4, backend="cudnn")
    with pytest.raises(kernels.AttentionError, match="bfloat16/float16"):
        kernels.attention(q16.astype(jnp.float32), q16.astype(jnp.float32), q16.astype(jnp.float32), backend="cudnn")
    assert not ran
    # auto skips the refusing backend and lands on the reference, which honours the window
    out = kernels.attention(q16, q16, q16, causal=False, window=4)
    assert out.shape == q16.shape and not ran


def test_bad_shapes_and_window_are_rejected():
    q = jnp.ones((1, 4, 3, 8))
    with pytest.raises(kernels.AttentionError, match="bad shapes"):
        kernels.attention(q, jnp.ones((1, 4, 2, 8)), jnp.ones((1, 4, 2, 8)))
    with pytest.raises(kernels.AttentionError, match="window must be >= 1"):
        kernels.attention(q, q, q, window=0)


def test_cross_entropy_matches_full_logits_and_gradients():
    rng = np.random.default_rng(0)
    B, T, D, V = 2, 12, 16, 50
    h = jnp.asarray(rng.standard_normal((B, T, D)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((D, V)) * 0.3, jnp.float32)
    t = jnp.asarray(rng.integers(0, V, (B, T)), jnp.int32)
    m = jnp.asarray(rng.random((B, T)) > 0.2, jnp.float32)

    def full(h, w):
        logits = h @ w
        lse = jax.nn.logsumexp(logits, -1)
        nll = lse - jnp.take_along_axis(logits, t[..., None], -1)[..., 0]
        return jnp.sum(nll * m) + 0.1 * jnp.sum(lse**2 * m)

    def chunked(h, w):  # max_logits forces chunks of 2 positions: 6 chunks
        nll, zsq = kernels.cross_entropy(h, w, t, m, max_logits=B * 2 * V)
        return nll + 0.1 * zsq

    assert kernels.cross_entropy.__module__.endswith("cross_entropy")
    np.testing.assert_allclose(chunked(h, w), full(h, w), rtol=1e-5)
    for a, b in zip(jax.grad(chunked, (0, 1))(h, w), jax.grad(full, (0, 1))(h, w)):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("vocab", [None, "model"], ids=["whole-rows", "vocab-sharded"])
@pytest.mark.parametrize("chunks", [1, 4])
def test_cross_entropy_on_a_mesh(vocab, chunks):
    """Both target-logit formulations (gather on whole rows, masked sum when the vocabulary is
    sharded over `model`), one chunk and several, equal full logits on a 4 x 2 mesh, gradients too."""
    from jax.sharding import AxisType, NamedSharding
    from jax.sharding import PartitionSpec as P

    rng = np.random.default_rng(1)
    B, T, D, V = 4, 8, 16, 64
    h = rng.standard_normal((B, T, D)).astype(np.float32)
    w = (rng.standard_normal((D, V)) * 0.3).astype(np.float32)
    t = rng.integers(0, V, (B, T)).astype(np.int32)
    m = (rng.random((B, T)) > 0.2).astype(np.float32)

    def full(h, w):
        logits = h @ w
        lse = jax.nn.logsumexp(logits, -1)
        return jnp.sum((lse - jnp.take_along_axis(logits, t[..., None], -1)[..., 0]) * m) + 0.1 * jnp.sum(lse**2 * m)

    want, want_g = full(h, w), jax.grad(full, (0, 1))(h, w)
    mesh = jax.make_mesh((4, 2), ("data", "model"), axis_types=(AxisType.Explicit,) * 2)
    with jax.set_mesh(mesh):
        put = lambda x, *s: jax.device_put(x, NamedSharding(mesh, P(*s)))  # noqa: E731
        hs, ws, ts, ms = put(h, "data"), put(w, None, vocab), put(t, "data"), put(m, "data")

        def sharded(h, w):
            nll, zsq = kernels.cross_entropy(h, w, ts, ms, max_logits=B * (T // chunks) * V)
            return nll + 0.1 * zsq

        got, got_g = jax.jit(jax.value_and_grad(sharded, (0, 1)))(hs, ws)
    np.testing.assert_allclose(got, want, rtol=1e-5)
    for a, b in zip(got_g, want_g):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize(
    "mesh_shape,vocab,gathers",
    [((4, 2), None, True), ((4, 2), "model", False), ((8, 1), "model", True)],
    ids=["whole-rows", "vocab-split", "vocab-over-model-of-1"],
)
def test_cross_entropy_gathers_the_target_logit_unless_the_vocabulary_is_split(mesh_shape, vocab, gathers):
    """The cheap formulation (a gather of the target logit) wherever each device holds whole
    vocabulary rows, including a vocabulary sharded over a `model` axis of size 1, as on one
    device: the masked sum there made the CPU default's train step about 1.1x slower. The masked
    sum only where the vocabulary is split between devices. Losses and gradients equal full logits."""
    from jax.sharding import AxisType, NamedSharding
    from jax.sharding import PartitionSpec as P

    rng = np.random.default_rng(2)
    B, T, D, V = 8, 4, 16, 64
    h = rng.standard_normal((B, T, D)).astype(np.float32)
    w = (rng.standard_normal((D, V)) * 0.3).astype(np.float32)
    t = rng.integers(0, V, (B, T)).astype(np.int32)
    m = np.ones((B, T), np.float32)
    logits = h @ w
    want = np.sum(jax.nn.logsumexp(logits, -1) - np.take_along_axis(logits, t[..., None], -1)[..., 0])
    mesh = jax.make_mesh(mesh_shape, ("data", "model"), axis_types=(AxisType.Explicit,) * 2)
    with jax.set_mesh(mesh):
        put = lambda x, *s: jax.device_put(x, NamedSharding(mesh, P(*s)))  # noqa: E731
        ts, ms = put(t, "data"), put(m, "data")
        loss = jax.jit(jax.value_and_grad(lambda h, w: kernels.cross_entropy(h, w, ts, ms)[0], (0, 1)))
        args = put(h, "data"), put(w, None, vocab)
        text = loss.lower(*args).as_text()
        got, _ = loss(*args)
    assert ("gather" in text) == gathers, text
    np.testing.assert_allclose(got, want, rtol=1e-5)


def test_cross_entropy_one_chunk_does_not_recompute_the_logits():
    """With one chunk, the backward pass reuses the forward's logits: one [.., V] matmul forward and
    two backward (for h and for w), not a fourth recomputing them."""
    B, T, D, V = 2, 8, 16, 64
    h, w = jnp.ones((B, T, D)), jnp.ones((D, V)) * 0.01
    t, m = jnp.zeros((B, T), jnp.int32), jnp.ones((B, T))
    loss = lambda h, w: kernels.cross_entropy(h, w, t, m)[0]  # noqa: E731
    text = jax.jit(jax.value_and_grad(loss, (0, 1))).lower(h, w).as_text()
    assert text.count("dot_general") == 3, text.count("dot_general")


def test_cross_entropy_holds_one_chunk_of_logits():
    """The compiled program's temporaries stay near one chunk, far below the full logits."""
    B, T, D, V = 4, 256, 32, 8192
    h, w = jnp.ones((B, T, D)), jnp.ones((D, V)) * 0.01
    t, m = jnp.zeros((B, T), jnp.int32), jnp.ones((B, T))
    full_bytes = B * T * V * 4
    loss = lambda h, w: kernels.cross_entropy(h, w, t, m, max_logits=B * 16 * V)[0]  # noqa: E731
    mem = jax.jit(jax.grad(loss, (0, 1))).lower(h, w).compile().memory_analysis()
    assert mem.temp_size_in_bytes < full_bytes / 4, (mem.temp_size_in_bytes, full_bytes)


def test_split_tells_an_axis_divided_between_devices_from_one_over_a_mesh_axis_of_one():
    """Backends refuse or pick a formulation by whether an axis is divided between devices; an
    axis sharded over a size-1 mesh axis is whole on each device (one device's `model` of 1)."""
    from jax.sharding import AxisType, NamedSharding
    from jax.sharding import PartitionSpec as P

    from shared.kernels.dispatch import split

    x = np.zeros((8, 4), np.float32)
    assert not split(jnp.asarray(x), 0)  # no mesh
    for shape, want in [((4, 2), [True, True]), ((8, 1), [True, False]), ((1, 1), [False, False])]:
        mesh = jax.make_mesh(
            shape, ("data", "model"), axis_types=(AxisType.Explicit,) * 2, devices=jax.devices()[: shape[0] * shape[1]]
        )
        with jax.set_mesh(mesh):
            xs = jax.device_put(x, NamedSharding(mesh, P("data", "model")))
            assert [split(xs, 0), split(xs, -1)] == want, shape
            both = jax.device_put(x, NamedSharding(mesh, P(("data", "model"), None)))
            assert split(both, 0) == (shape != (1, 1)) and not split(both, 1), shape


def test_kda_inputs_divided_unlike_each_other_are_named_and_whole_axes_pass():
    """kda, which a copy calls directly, names the input divided between devices unlike q and the spec it
    expects (g's heads whole while q's are split over `model` of 2), instead of failing deep inside the chunked
    kernel. A difference on a mesh axis of one device is no difference (the axis is whole everywhere): such
    calls compute, as on the one-device meshes of a variant's own tests. (Attention and the short convolution
    need no check: JAX reshards their mismatched inputs and computes, below.)"""
    from jax.sharding import AxisType, NamedSharding
    from jax.sharding import PartitionSpec as P

    from shared.kernels import kda as kda_mod

    def inputs(mesh, g_spec):
        put = lambda x, *s: jax.device_put(x, NamedSharding(mesh, P(*s)))  # noqa: E731
        q = put(jnp.ones((8, 8, 2, 4)), "data", None, "model")
        return q, put(jnp.ones((8, 8, 2, 4)), *g_spec), put(jnp.ones((8, 8, 2)), "data", None, "model")

    split = jax.make_mesh((4, 2), ("data", "model"), axis_types=(AxisType.Explicit,) * 2)
    with jax.set_mesh(split):
        q, g, beta = inputs(split, ("data", None, None))
        with pytest.raises(
            kda_mod.KDAError,
            match=r"^kda: g is sharded P\('data', None, None, None\) and q P\('data', None, 'model', None\).* "
            r"expected g P\('data', None, 'model', None\)",
        ):
            kda_mod.kda(q, q, q, g, beta)
        assert kernels.attention(q, g, g).shape == q.shape  # k, v unlike q: resharded by JAX, computed
    whole = jax.make_mesh((8, 1), ("data", "model"), axis_types=(AxisType.Explicit,) * 2)
    with jax.set_mesh(whole):  # `model` has one device: g's whole heads are q's, and kda's checks pass them
        q, g, beta = inputs(whole, ("data", None, None))
        kda_mod._check(q, q, q, g, beta, None, None, 64, "xla")  # (variants/kda's tests run such calls whole)
