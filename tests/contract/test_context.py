"""shared/kernels/context.py: each mixer with the row split over `context` equals the unsplit call.

On 8 CPU devices, meshes (data 2, context 2, model 2) and (data 2, context 4, model 1): packed rows whose
documents cross the shard boundaries (and one that starts exactly at a boundary), values and gradients,
against the same kernel on the same mesh without a context axis."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from shared import kernels
from shared.kernels import context
from shared.kernels.kda import kda as kda_plain
from shared.kernels.kda import runs

B, T = 2, 32


def mesh_of(c):
    shape = (2, c, 8 // (2 * c))
    return jax.make_mesh(
        shape, ("data", "context", "model"), axis_types=(AxisType.Explicit,) * 3, devices=jax.devices()[:8]
    )


def put(mesh, x, *rest):
    return jax.device_put(x, NamedSharding(mesh, P("data", "context", *rest)))


def segments():
    """Row 0: documents crossing every boundary of 2 and 4 shards; row 1: a document starting exactly at
    token 16 (a boundary for 2 and 4 shards) and another at 8 (a boundary for 4)."""
    s0 = np.repeat([0, 1, 2], [5, 14, 13])
    s1 = np.repeat([3, 4, 5], [8, 8, 16])
    return jnp.asarray(np.stack([s0, s1]), jnp.int32)


def close(a, b, tol=2e-5):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=tol, atol=tol)


@pytest.mark.parametrize(
    "c,window,block,ring",
    [
        (2, None, 512, True),
        (4, None, 512, True),
        (2, None, 8, True),
        (4, None, 8, False),
        (2, 5, 512, True),
        (4, 5, 512, True),
    ],
)
def test_attention_split_over_context_equals_unsplit(c, window, block, ring, monkeypatch):
    """Block 8: each device's 16 or 8 queries go in blocks of 8 (context.QUERY_BLOCK), as long rows do.
    ring False: full attention's zigzag takes its key halves from the all-gathered row instead of the ring."""
    monkeypatch.setattr(context, "QUERY_BLOCK", block)
    monkeypatch.setattr(context, "RING", ring)
    H, Hkv, D = 4, 2, 8
    ks = jax.random.split(jax.random.key(0), 4)
    q = jax.random.normal(ks[0], (B, T, H, D))
    k = jax.random.normal(ks[1], (B, T, Hkv, D))
    v = jax.random.normal(ks[2], (B, T, Hkv, D))
    seg = segments()

    def loss(q, k, v, seg):
        o, lse = context.attention(
            q, k, v, segment_ids=seg, causal=True, window=window, softcap=5.0, return_lse=True, backend="reference"
        )
        return jnp.sum(o * jnp.cos(o)) + jnp.sum(jnp.sin(lse)), (o, lse)

    want = jax.jit(lambda *a: jax.grad(loss, argnums=(0, 1, 2), has_aux=True)(*a))(q, k, v, seg)
    mesh = mesh_of(c)
    with jax.set_mesh(mesh):
        args = (put(mesh, q, None, None), put(mesh, k, None, None), put(mesh, v, None, None), put(mesh, seg))
        got = jax.jit(lambda *a: jax.grad(loss, argnums=(0, 1, 2), has_aux=True)(*a))(*args)
    close(got, want)


@pytest.mark.parametrize("c", [2, 4])
def test_short_conv_split_over_context_equals_unsplit(c):
    x = jax.random.normal(jax.random.key(1), (B, T, 8))
    w = jax.random.normal(jax.random.key(2), (4, 8))
    docs = runs(segments(), B, T)
    f = lambda x, w, d: jnp.sum(jnp.tanh(context.short_conv(x, w, d)) * x)  # noqa: E731
    want = jax.jit(jax.value_and_grad(f, argnums=(0, 1)))(x, w, docs)
    mesh = mesh_of(c)
    with jax.set_mesh(mesh):
        got = jax.jit(jax.value_and_grad(f, argnums=(0, 1)))(put(mesh, x, None), w, put(mesh, docs))
    close(got, want)


@pytest.mark.parametrize("c", [2, pytest.param(4, marks=pytest.mark.integration(reason="a long compile; 2 is fast"))])
def test_kda_split_over_context_equals_unsplit(c):
    H, K, V = 2, 8, 8
    ks = jax.random.split(jax.random.key(3), 5)
    l2 = lambda x: x / jnp.linalg.norm(x, axis=-1, keepdims=True)  # noqa: E731
    q, k = l2(jax.random.normal(ks[0], (B, T, H, K))), l2(jax.random.normal(ks[1], (B, T, H, K)))
    v = jax.random.normal(ks[2], (B, T, H, V))
    g = -jax.nn.softplus(jax.random.normal(ks[3], (B, T, H, K)))
    beta = jax.nn.sigmoid(jax.random.normal(ks[4], (B, T, H)))
    seg = segments()

    def loss(q, k, v, g, beta, seg, fn):
        o, S = fn(q, k, v, g, beta, segment_ids=seg, chunk_size=4)
        return jnp.sum(o * jnp.cos(o)) + jnp.sum(jnp.sin(S)), (o, S)

    grad = lambda fn: jax.jit(jax.grad(lambda *a: loss(*a, fn), argnums=(0, 1, 2, 3, 4), has_aux=True))  # noqa: E731
    want = grad(kda_plain)(q, k, v, g, beta, seg)
    mesh = mesh_of(c)
    with jax.set_mesh(mesh):
        x4 = lambda x: put(mesh, x, None, None)  # noqa: E731
        got = grad(context.kda)(x4(q), x4(k), x4(v), x4(g), put(mesh, beta, None), put(mesh, seg))
    close(got, want, 1e-4)


@pytest.mark.parametrize("c", [2, 4])
def test_zigzag_gives_device_r_halves_r_and_the_mirror_and_back(c):
    """Full attention's load balance: with the row cut into 2c halves, device r attends for half r and half
    2c-1-r (so every device has one early and one late half), and the outputs go back where they came from."""
    from shared.kernels.dispatch import per_shard

    mesh = mesh_of(c)
    pos = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    with jax.set_mesh(mesh):
        x = put(mesh, pos)
        zig = jax.jit(
            lambda x: per_shard(
                lambda y: context._zigzag_halves(y, c), (x,), (P("data", "context"),), P("data", "context")
            )
        )(x)
        back = jax.jit(
            lambda x: per_shard(
                lambda y: context._contiguous_halves(y, c), (x,), (P("data", "context"),), P("data", "context")
            )
        )(zig)
    h = T // (2 * c)
    want = np.concatenate([np.r_[r * h : (r + 1) * h, (2 * c - 1 - r) * h : (2 * c - r) * h] for r in range(c)])
    np.testing.assert_array_equal(np.asarray(zig)[0], want)
    np.testing.assert_array_equal(np.asarray(back), np.asarray(pos))


def test_refusals_name_the_setting():
    assert context.refusal(30, 4) == "seq_len 30 is not divisible by mesh_context=4"
    assert "multiple of mesh_context * chunk_size = 128" in context.refusal(96, 2, chunk=64)
    assert "a window of 17 needs the previous 16 tokens" in context.refusal(32, 4, window=17)
    assert context.refusal(32, 4, window=9) is None
    assert "cannot run under context parallelism" in context.refusal(32, 2, backend="flash4")
    assert context.refusal(30, 1, window=100, chunk=7, backend="flash4") is None


def test_without_a_context_axis_it_is_the_kernel():
    """No mesh, or a mesh without `context`: the wrappers are the kernels themselves (same values)."""
    x = jax.random.normal(jax.random.key(4), (B, T, 4, 8))
    assert context.size() == 1 and context.axis() is None
    np.testing.assert_array_equal(
        context.attention(x, x, x, backend="reference"), kernels.attention(x, x, x, backend="reference")
    )
    mesh = jax.make_mesh((4, 2), ("data", "model"), axis_types=(AxisType.Explicit,) * 2)
    with jax.set_mesh(mesh):
        assert context.size() == 1 and context.axis() is None
    with jax.set_mesh(mesh_of(2)):
        assert context.size() == 2 and context.axis() == "context"


@pytest.mark.integration  # a long run: every folder's loop with the context axis is in tests/contract/test_loop.py's integration runs
def test_a_run_with_mesh_context_2_trains(tiny_dense, tmp_path):
    """dense's own loop with every row split over 2 devices (data 2 x context 2 x model 2): the loss falls
    over the run's 6 steps, every step finite, and the config it records names the context axis."""
    import json
    import os

    out = tiny_dense.train.main(tiny_dense.config(tmp_path, mesh_context=2, mesh_model=2))
    losses = [out["losses"][s] for s in sorted(out["losses"])]
    assert len(losses) == 6 and all(np.isfinite(losses)), losses
    assert losses[-1] < losses[0] - 0.1, losses
    with open(os.path.join(tmp_path, "config.json")) as f:
        assert json.load(f)["mesh_context"] == 2


def test_cross_entropy_chunks_each_devices_part_of_a_row():
    """The loss's chunked scan (kernels.cross_entropy, more logits than one chunk holds) with the rows split
    over `context`: the n-th chunk of every device's part at once, the same sums and gradients."""
    h = jax.random.normal(jax.random.key(5), (B, T, 16))
    w = jax.random.normal(jax.random.key(6), (16, 64))
    t = jax.random.randint(jax.random.key(7), (B, T), 0, 64)
    m = (jax.random.uniform(jax.random.key(8), (B, T)) > 0.2).astype(jnp.float32)

    def loss(h, w, t, m):
        nll, zsq = kernels.cross_entropy(h, w, t, m, max_logits=B * 4 * 64, backend="reference")  # 8 chunks of 4
        return nll + 0.1 * zsq

    want = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))(h, w, t, m)
    for c in (2, 4):
        mesh = mesh_of(c)
        with jax.set_mesh(mesh):
            got = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))(put(mesh, h, None), w, put(mesh, t), put(mesh, m))
        close(got, want, 1e-4)
