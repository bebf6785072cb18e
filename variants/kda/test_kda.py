"""shared/kernels/kda.py and variants/kda: the chunked KDA kernel against the one-token-at-a-time
recurrence (outputs, final state, gradients), document resets, the Gated DeltaNet special
case, the public building blocks (unit_lower_inverse, reshape, runs, run_masks), strong
decay, the Pallas kernel (interpret mode, CUDA lowering), FLOP accounting as computed, and
the variant's layer pattern, convolution and sharding.
"""

import dataclasses
import os

import jax
import jax.extend.core
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from decode_check import decode_against_forward
from shared.kernels import kda as K
from shared.variant import load

HERE = os.path.dirname(os.path.abspath(__file__))  # this folder: a copy's tests test the copy

LONG = pytest.mark.integration  # a slow case of a parametrized check (the other cases stay in the fast tier)

model = load(os.path.join(HERE, "model.py"))


def inputs(rng, B, T, H, Dk, Dv, decay=1.0):
    """Random KDA inputs as the model makes them: unit q and k, log decay <= 0, beta in (0, 1)."""
    unit = lambda x: x / np.linalg.norm(x, axis=-1, keepdims=True)  # noqa: E731
    q = unit(rng.standard_normal((B, T, H, Dk)))
    k = unit(rng.standard_normal((B, T, H, Dk)))
    v = rng.standard_normal((B, T, H, Dv))
    g = -decay * np.exp(rng.standard_normal((B, T, H, Dk)) - 1.0)
    beta = 1 / (1 + np.exp(-rng.standard_normal((B, T, H))))
    return tuple(jnp.asarray(x, jnp.float32) for x in (q, k, v, g, beta))


def close(a, b, tol, what):
    a, b = np.asarray(a), np.asarray(b)
    err = np.max(np.abs(a - b)) / max(1.0, np.max(np.abs(b)))
    assert err < tol, f"{what}: max error {err:.2e} (relative to max |ref| = {np.max(np.abs(b)):.2e})"


# ---------------------------------------------------------------- chunked == recurrent


# two cases in the fast tier (a partial last chunk with a state; two chunks of 32 without); the rest integration
@pytest.mark.parametrize(
    "T,chunk,with_state",
    [(45, 16, True), (70, 32, False)]
    + [
        pytest.param(T, c, s, marks=LONG)
        for T, c, s in ((64, 16, False), (64, 16, True), (45, 16, False), (70, 32, True), (5, 16, False), (5, 16, True))
    ],
)
def test_chunked_matches_recurrent(T, chunk, with_state):
    """Outputs, final state and the gradients of every input, at lengths that are and are not
    multiples of the chunk size, with and without an initial state."""
    rng = np.random.default_rng(T * 7 + chunk + with_state)
    B, H, Dk, Dv = 2, 2, 16, 8
    q, k, v, g, beta = inputs(rng, B, T, H, Dk, Dv)
    s0 = jnp.asarray(rng.standard_normal((B, H, Dk, Dv)), jnp.float32) if with_state else None
    ct_o = jnp.asarray(rng.standard_normal((B, T, H, Dv)), jnp.float32)
    ct_s = jnp.asarray(rng.standard_normal((B, H, Dk, Dv)), jnp.float32)

    def loss(fn, *args):
        o, s = fn(*args[:5], initial_state=args[5] if with_state else None)
        return jnp.sum(o * ct_o) + jnp.sum(s * ct_s), (o, s)

    args = (q, k, v, g, beta) + ((s0,) if with_state else ())
    argnums = tuple(range(len(args)))
    chunked = jax.jit(
        jax.value_and_grad(
            lambda *a: loss(lambda *x, **kw: K.kda(*x, chunk_size=chunk, **kw), *a), argnums, has_aux=True
        )
    )
    recurrent = jax.jit(jax.value_and_grad(lambda *a: loss(K.kda_recurrent, *a), argnums, has_aux=True))
    (_, (o1, s1)), g1 = chunked(*args)
    (_, (o2, s2)), g2 = recurrent(*args)
    close(o1, o2, 1e-5, "output")
    close(s1, s2, 1e-5, "final state")
    for name, a, b in zip(("q", "k", "v", "g", "beta", "initial_state"), g1, g2):
        close(a, b, 1e-4, f"gradient of {name}")


@pytest.mark.integration  # long: several compiled kernel calls, 10-33 s
def test_output_dtype_and_default_scale():
    rng = np.random.default_rng(0)
    q, k, v, g, beta = inputs(rng, 1, 20, 2, 16, 16)
    o, s = K.kda(q, k, v.astype(jnp.bfloat16), g, beta, chunk_size=16)
    assert o.dtype == jnp.bfloat16 and s.dtype == jnp.float32
    o1, _ = K.kda(q, k, v, g, beta, chunk_size=16)
    o2, _ = K.kda(q, k, v, g, beta, chunk_size=16, scale=16**-0.5)
    o3, _ = K.kda(q, k, v, g, beta, chunk_size=16, scale=1.0)
    np.testing.assert_array_equal(np.asarray(o1), np.asarray(o2))
    close(o3, o1 * 4.0, 1e-6, "scale multiplies the output")


# ---------------------------------------------------------------- documents


@pytest.mark.parametrize("impl", ["chunked", "recurrent"])
def test_segment_resets_match_separate_documents(impl):
    """A packed row gives each document the output it gets alone from a zero state, whatever
    the initial state; the final state is the last document's."""
    rng = np.random.default_rng(3)
    H, Dk, Dv = 2, 16, 8
    lengths = [7, 20, 1, 18]  # documents cross chunk boundaries; one is a single token
    T = sum(lengths)
    q, k, v, g, beta = inputs(rng, 1, T, H, Dk, Dv)
    seg = jnp.asarray(np.repeat([5, 2, 9, 2], lengths)[None], jnp.int32)  # ids may repeat: a change starts a document
    s0 = jnp.asarray(rng.standard_normal((1, H, Dk, Dv)), jnp.float32)
    fn = (lambda *a, **kw: K.kda(*a, chunk_size=16, **kw)) if impl == "chunked" else K.kda_recurrent
    o, s = jax.jit(lambda *a: fn(*a[:5], initial_state=a[5], segment_ids=a[6]))(q, k, v, g, beta, s0, seg)
    start = 0
    for i, n in enumerate(lengths):
        part = lambda x: x[:, start : start + n]  # noqa: E731
        alone_o, alone_s = K.kda_recurrent(*map(part, (q, k, v, g, beta)), initial_state=s0 if i == 0 else None)
        close(o[:, start : start + n], alone_o, 1e-5, f"document {i}")
        start += n
    close(s, alone_s, 1e-5, "final state = the last document's")


# ---------------------------------------------------------------- Gated DeltaNet


def gated_delta_net(q, k, v, alpha, beta, scale):
    """Gated DeltaNet (a scalar gate per head and token) in float64 numpy, written from its rule:
    S_t = alpha_t (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T, o_t = scale * S_t^T q_t."""
    q, k, v, alpha, beta = (np.asarray(x, np.float64) for x in (q, k, v, alpha, beta))
    B, T, H, Dk = q.shape
    out = np.zeros(v.shape)
    for b in range(B):
        for h in range(H):
            S = np.zeros((Dk, v.shape[-1]))
            for t in range(T):
                kt = k[b, t, h][:, None]
                S = (
                    alpha[b, t, h] * (np.eye(Dk) - beta[b, t, h] * kt @ kt.T) @ S
                    + beta[b, t, h] * kt @ v[b, t, h][None]
                )
                out[b, t, h] = scale * S.T @ q[b, t, h]
    return out


def test_equal_gate_across_channels_is_gated_delta_net():
    rng = np.random.default_rng(5)
    B, T, H, Dk, Dv = 2, 37, 2, 16, 8
    q, k, v, _, beta = inputs(rng, B, T, H, Dk, Dv)
    log_alpha = -np.exp(rng.standard_normal((B, T, H)) - 1.5)
    g = jnp.asarray(np.repeat(log_alpha[..., None], Dk, axis=-1), jnp.float32)
    o, _ = jax.jit(lambda *a: K.kda(*a, chunk_size=16))(q, k, v, g, beta)
    close(
        o, gated_delta_net(q, k, v, np.exp(log_alpha), beta, Dk**-0.5), 1e-5, "KDA with a scalar gate vs Gated DeltaNet"
    )


# ---------------------------------------------------------------- the public building blocks


@pytest.mark.parametrize("n", [1, 2, 16, 64])
def test_unit_lower_inverse_is_the_inverse(n):
    """M^-1 M = I for unit lower-triangular blocks; what lies above the diagonal is never read."""
    rng = np.random.default_rng(n)
    M = np.tril(rng.standard_normal((2, 3, n, n)) * 0.3, -1) + np.eye(n)
    inv = np.asarray(jax.jit(K.unit_lower_inverse)(jnp.asarray(M, jnp.float32)))
    np.testing.assert_allclose(inv @ M, np.broadcast_to(np.eye(n), M.shape), atol=2e-5)
    np.testing.assert_allclose(inv, np.linalg.inv(M), rtol=1e-4, atol=1e-5)
    upper = M + np.triu(rng.standard_normal(M.shape), 1)  # garbage above the diagonal
    np.testing.assert_array_equal(
        np.asarray(K.unit_lower_inverse(jnp.asarray(upper, jnp.float32))),
        np.asarray(K.unit_lower_inverse(jnp.asarray(M, jnp.float32))),
    )


def test_reshape_round_trips_and_keeps_the_leading_sharding():
    """[B, H, T, K] -> [B, H, N, C, K] -> back under a data=4 x model=2 mesh: the same values,
    rows and heads sharded as before, the rest unsharded."""
    x = np.random.default_rng(0).standard_normal((4, 2, 24, 3)).astype(np.float32)
    mesh = jax.make_mesh((4, 2), ("data", "model"), axis_types=(AxisType.Explicit,) * 2)
    with jax.set_mesh(mesh):
        xs = jax.device_put(x, NamedSharding(mesh, P("data", "model", None, None)))
        chunked = jax.jit(lambda a: K.reshape(a, (4, 2, 3, 8, 3), 2))(xs)
        back = jax.jit(lambda a: K.reshape(a, (4, 2, 24, 3), 2))(chunked)
    assert chunked.sharding.spec == P("data", "model", None, None, None)
    assert back.sharding.spec == P("data", "model", None, None)
    np.testing.assert_array_equal(np.asarray(chunked), x.reshape(4, 2, 3, 8, 3))
    np.testing.assert_array_equal(np.asarray(back), x)


def _same_document(ids, i, j):
    """Brute force from segment ids: tokens i and j (padding = the last token) lie in one run of equal ids."""
    i, j = sorted((min(i, len(ids) - 1), min(j, len(ids) - 1)))
    return bool(np.all(ids[i : j + 1] == ids[i]))


@pytest.mark.parametrize("T,C", [(21, 4), (16, 8), (5, 8)])
def test_runs_and_run_masks_match_a_brute_force_construction(T, C):
    """runs: the document index; run_masks: same / reads / keeps / carries, each built here token by
    token from the segment ids (documents are runs of equal ids; an id that comes back is a new one)."""
    rng = np.random.default_rng(T + C)
    ids = np.stack([np.repeat([5, 2, 5, 7], [3, 5, 1, T]), rng.integers(0, 2, T + 9)])[:, :T].astype(np.int32)
    ids[1, C : 2 * C] = 9  # a document that starts on a chunk boundary and fills the chunk
    B, N = ids.shape[0], -(-T // C)
    doc = np.asarray(K.runs(jnp.asarray(ids), B, T))
    for b in range(B):
        assert doc[b, 0] == 0 and all(doc[b, t] == doc[b, t - 1] + (ids[b, t] != ids[b, t - 1]) for t in range(1, T))
    np.testing.assert_array_equal(np.asarray(K.runs(None, B, T)), np.zeros((B, T)))
    same, reads, keeps, carries = (np.asarray(m) for m in K.run_masks(jnp.asarray(doc), C))
    assert same.shape == (B, N, C, C) and reads.shape == keeps.shape == (B, N, C) and carries.shape == (B, N, 1)
    for b in range(B):
        sd = lambda i, j: float(_same_document(ids[b], i, j))  # noqa: E731
        for n in range(N):
            before, end = max(n * C - 1, 0), n * C + C - 1  # the incoming state's token (chunk 0: token 0), the last
            assert carries[b, n, 0] == sd(before, end), (b, n)
            for t in range(C):
                tt = n * C + t
                assert reads[b, n, t] == sd(before, tt), (b, n, t)
                assert keeps[b, n, t] == sd(tt, end), (b, n, t)
                for s in range(C):
                    assert same[b, n, t, s] == sd(tt, n * C + s), (b, n, t, s)


# ---------------------------------------------------------------- strong decay


@pytest.mark.parametrize("decay", [pytest.param(30.0, marks=LONG), 1e4])  # 30.0: 10-35 s, integration
def test_strong_decay_stays_finite_and_exact(decay):
    """Log decays of -30 .. -1e4 per token: exp(-G) would overflow fp32; the kernel never forms it."""
    rng = np.random.default_rng(7)
    q, k, v, g, beta = inputs(rng, 1, 64, 2, 16, 8, decay=decay)
    g = g.at[:, ::5].set(-1e-3)  # mix strong and weak decay

    def loss(fn):
        return lambda *a: jnp.sum(fn(*a)[0] ** 2)

    o1, s1 = jax.jit(lambda *a: K.kda(*a, chunk_size=32))(q, k, v, g, beta)
    o2, s2 = jax.jit(K.kda_recurrent)(q, k, v, g, beta)
    grads = jax.jit(jax.grad(loss(lambda *a: K.kda(*a, chunk_size=32)), (0, 1, 2, 3, 4)))(q, k, v, g, beta)
    assert np.all(np.isfinite(np.asarray(o1))) and np.all(np.isfinite(np.asarray(s1)))
    assert all(np.all(np.isfinite(np.asarray(x))) for x in grads), "a gradient is not finite"
    close(o1, o2, 1e-5, "output under strong decay")
    close(s1, s2, 1e-5, "state under strong decay")


# ---------------------------------------------------------------- errors


def test_bad_calls_raise_clear_errors():
    rng = np.random.default_rng(0)
    q, k, v, g, beta = inputs(rng, 1, 8, 2, 16, 8)
    with pytest.raises(K.KDAError, match="power of two"):
        K.kda(q, k, v, g, beta, chunk_size=48)
    with pytest.raises(K.KDAError, match="beta"):
        K.kda(q, k, v, g, beta[..., :1])
    with pytest.raises(K.KDAError, match="initial_state"):
        K.kda(q, k, v, g, beta, initial_state=jnp.zeros((1, 2, 8, 16)))
    with pytest.raises(K.KDAError, match="impl"):
        K.kda(q, k, v, g, beta, impl="cuda")
    with pytest.raises(K.KDAError, match="multiple of 16"):
        K.kda(q, k, v, g, beta, chunk_size=8, impl="pallas_interpret")


# ---------------------------------------------------------------- Pallas


@pytest.mark.integration  # long: the Pallas kernel in the interpreter, 20-60 s on 2 cores
def test_pallas_interpret_matches_xla():
    """The Pallas pairwise kernel (interpret mode on CPU) against the XLA path, forward and gradients."""
    rng = np.random.default_rng(11)
    q, k, v, g, beta = inputs(rng, 1, 40, 2, 16, 8, decay=5.0)
    seg = jnp.asarray(np.repeat([1, 2], [13, 27])[None], jnp.int32)

    def run(impl):
        def f(*a):
            o, s = K.kda(*a, segment_ids=seg, chunk_size=32, impl=impl)
            return jnp.sum(o**2) + jnp.sum(s), (o, s)

        return jax.jit(jax.value_and_grad(f, (0, 1, 2, 3, 4), has_aux=True))(q, k, v, g, beta)

    (_, (o1, s1)), g1 = run("pallas_interpret")
    (_, (o2, s2)), g2 = run("xla")
    close(o1, o2, 1e-5, "pallas output")
    close(s1, s2, 1e-5, "pallas state")
    for a, b in zip(g1, g2):
        close(a, b, 1e-4, "pallas gradient")


def test_pallas_lowers_for_cuda():
    """The Triton kernel lowers for the CUDA platform on this CPU machine (it is not run)."""
    x = jax.ShapeDtypeStruct((2, 64, 2, 16), jnp.bfloat16)
    b = jax.ShapeDtypeStruct((2, 64, 2), jnp.float32)
    f = jax.grad(
        lambda q, k, v, g, be: jnp.sum(K.kda(q, k, v, g, be, chunk_size=32, impl="pallas")[0]), (0, 1, 2, 3, 4)
    )
    text = (
        jax.jit(f)
        .trace(x, x, x, jax.ShapeDtypeStruct((2, 64, 2, 16), jnp.float32), b)
        .lower(lowering_platforms=("cuda",))
        .as_text()
    )
    assert "xla.gpu.triton" in text, "no Triton kernel in the CUDA lowering"


# ---------------------------------------------------------------- FLOPs as computed


def dot_flops(jaxpr) -> float:
    """2 x multiply-adds of every dot_general in a jaxpr, scan bodies times their length."""
    total = 0.0
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "dot_general":
            (lc, _), _ = eqn.params["dimension_numbers"]
            lhs = eqn.invars[0].aval.shape
            total += 2 * np.prod(eqn.outvars[0].aval.shape) * np.prod([lhs[i] for i in lc])
        mult = eqn.params["length"] if eqn.primitive.name == "scan" else 1
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            total += mult * dot_flops(sub)
    return total


@pytest.mark.parametrize("T,chunk", [(128, 32), (100, 64)])
def test_flops_per_token_counts_the_matmuls_as_computed(T, chunk):
    B, H, Dk, Dv = 2, 2, 16, 32
    x = jax.ShapeDtypeStruct((B, T, H, Dk), jnp.float32)
    args = (x, x, jax.ShapeDtypeStruct((B, T, H, Dv), jnp.float32), x, jax.ShapeDtypeStruct((B, T, H), jnp.float32))
    jaxpr = jax.make_jaxpr(lambda *a: K.kda(*a, chunk_size=chunk))(*args).jaxpr
    counted = K.kda_flops_per_token(T, H, Dk, Dv, chunk, training=False) * B * T
    assert dot_flops(jaxpr) == pytest.approx(counted, rel=1e-9)


# ---------------------------------------------------------------- the variant


def one_device():
    return jax.make_mesh((1, 1), ("data", "model"), axis_types=(AxisType.Explicit,) * 2, devices=jax.devices()[:1])


def small(**over):
    kw = dict(
        vocab_size=64, d_model=32, n_layers=4, n_heads=2, n_kv_heads=1, head_dim=16, d_ff=64, gate_rank=8, chunk_size=16
    )
    kw.update(over)
    return model.ModelConfig(**kw)


def test_layer_pattern_and_counts():
    assert model.attention_layers(small(n_layers=8, global_every=4)) == [False, False, False, True] * 2
    assert model.attention_layers(small(n_layers=6, global_every=4)) == [False, False, False, True, False, True]
    assert model.layer_counts(small(n_layers=6, global_every=4)) == (4, 2)
    shapes = model.param_shapes(small(n_layers=6, global_every=4))
    assert shapes["kda"]["wq"][0] == 4 and shapes["attn"]["wq"][0] == 2


@pytest.mark.parametrize(
    "field,value", [("global_every", 1), ("chunk_size", 24), ("kda_impl", "cuda"), ("conv_size", 0), ("gate_rank", 0)]
)
def test_config_errors_name_the_field(field, value):
    with pytest.raises(model.ConfigError, match=f"model.{field}"):
        small(**{field: value})


@pytest.mark.integration  # long: a full model per pattern on the mesh, 25-80 s; the contract runs the pattern
def test_layers_run_in_pattern_order():
    """hidden_states (two stacks: a scanned super-block of 3 KDA + 1 attention layers, then a tail of
    1 KDA + 1 attention layer) equals the layers applied one by one in attention_layers' order."""
    cfg = small(n_layers=6, global_every=4)
    with jax.set_mesh(one_device()):
        params = jax.jit(lambda k: model.init(cfg, k))(jax.random.key(0))
        tokens = jnp.asarray(np.random.default_rng(0).integers(0, 64, (2, 24)), jnp.int32)
        got = jax.jit(lambda p, t: model.hidden_states(p, t, cfg))(params, tokens)
        want = jax.jit(lambda p, t: _layer_by_layer(p, t, cfg))(params, tokens)
    close(got, want, 1e-5, "hidden states")


def _layer_by_layer(params, tokens, cfg):
    x = params["embed"].at[tokens].get(out_sharding=P())
    angles = model.rope_angles(model.positions(tokens, None), cfg.head_dim, cfg.rope_theta)
    docs = model.documents(None, *tokens.shape)
    ik = ia = 0
    for is_attn in model.attention_layers(cfg):
        if is_attn:
            x, _ = model.block(x, jax.tree.map(lambda w: w[ia], params["attn"]), angles, None, cfg)
            ia += 1
        else:
            x, _ = model.kda_block(x, jax.tree.map(lambda w: w[ik], params["kda"]), docs, None, cfg)
            ik += 1
    return model.rms_norm(x, params["final_norm"], cfg.norm_eps)


def test_short_conv_is_causal_and_stays_in_its_document():
    rng = np.random.default_rng(2)
    x = jnp.asarray(rng.standard_normal((1, 12, 3)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((4, 3)), jnp.float32)
    docs = jnp.asarray([[0] * 5 + [1] * 7])
    out = np.asarray(model.short_conv(x, w, docs))
    xn, wn = np.asarray(x), np.asarray(w)
    for t in range(12):
        start = 0 if t < 5 else 5
        want = sum(wn[3 - j] * xn[0, t - j] for j in range(4) if t - j >= start)
        np.testing.assert_allclose(out[0, t], want, rtol=1e-5, atol=1e-6)


@pytest.mark.integration  # long: two compiled models (4 x 2 mesh and one device), 25-75 s
def test_sharded_forward_equals_single_device():
    """The data=4 x model=2 mesh gives the logits of one device (heads and gates sharded over model)."""
    cfg = small(n_heads=4, n_kv_heads=2, d_model=64)
    rng = np.random.default_rng(4)
    tokens = rng.integers(0, 64, (4, 40)).astype(np.int32)
    seg = np.sort(rng.integers(0, 3, (4, 40)), axis=1).astype(np.int32)
    with jax.set_mesh(one_device()):
        params = model.init(cfg, jax.random.key(0))
        want = model.forward(params, jnp.asarray(tokens), cfg, segment_ids=jnp.asarray(seg))
    mesh = jax.make_mesh((4, 2), ("data", "model"), axis_types=(AxisType.Explicit,) * 2)
    with jax.set_mesh(mesh):
        sharded = jax.tree.map(lambda w, s: jax.device_put(w, NamedSharding(mesh, s)), params, model.param_specs(cfg))
        row = NamedSharding(mesh, P("data", None))
        got = jax.jit(lambda p, t, s: model.forward(p, t, cfg, segment_ids=s))(
            sharded, jax.device_put(tokens, row), jax.device_put(seg, row)
        )
    close(got, want, 1e-4, "sharded logits")


def test_flops_per_token_adds_kda_kernel_and_projections():
    cfg = small(n_layers=4, global_every=4)  # 3 KDA layers, 1 attention layer
    T = 256
    more = dataclasses.replace(cfg, n_layers=8)  # 6 KDA, 2 attention: the non-embedding part doubles
    unembed = 6 * cfg.d_model * cfg.vocab_size
    assert model.flops_per_token(more, T) - unembed == pytest.approx(2 * (model.flops_per_token(cfg, T) - unembed))
    kernel = K.kda_flops_per_token(T, cfg.n_heads, cfg.head_dim, cfg.head_dim, cfg.chunk_size)
    assert kernel > 0 and model.flops_per_token(cfg, T) > 3 * kernel


@pytest.mark.integration  # long: compiles the same layer several times, 20-60 s
def test_one_chunk_layer_compiles_to_the_same_result_every_time():
    """Regression: with T <= chunk_size and no initial state, XLA:CPU once compiled a KDA layer into
    programs whose outputs differed from one compilation to the next (garbage up to 1e22). The
    optimization barrier on delta in shared/kernels/kda.py prevents it; this recompiles and compares."""
    cfg = model.ModelConfig(n_layers=2)  # the CPU default's widths; T = 32 < chunk_size = 64
    rng = np.random.default_rng(1)
    tokens = rng.integers(0, cfg.vocab_size, (4, 32)).astype(np.int32)
    with jax.set_mesh(one_device()):
        params = model.init(cfg, jax.random.key(1))
        layer = jax.tree.map(lambda w: w[0], params["kda"])

        def f(p, t):
            x = p["embed"].at[t].get(out_sharding=P())
            return model.kda_block(x, layer, model.documents(None, *t.shape), None, cfg)[0]

        outs = []
        for _ in range(3):  # the bad programs came in most compilations
            jax.clear_caches()
            outs.append(np.asarray(jax.jit(f)(params, tokens)))
    for o in outs[1:]:
        np.testing.assert_array_equal(o, outs[0], err_msg="a recompilation changed the output")


@pytest.mark.integration  # long: prefill and decode of a whole model, 20-60 s; the contract decodes kda
def test_decoding_matches_forward_with_a_tail_of_layers():
    """prefill + greedy decoding equal forward when n_layers is not a multiple of global_every (KDA,
    attention, then the tail's attention layer: the prompt's states come from the scanned super-block and
    from the tail), with prompts of 1 to 13 tokens crossing 4-token chunks and the short convolution's 4
    taps reaching back into the prompt, on a 4 x 2 mesh."""
    cfg = small(n_layers=3, global_every=2, chunk_size=4, n_heads=4, n_kv_heads=2, head_dim=8)
    mesh = jax.make_mesh((4, 2), ("data", "model"), axis_types=(AxisType.Explicit,) * 2)
    with jax.set_mesh(mesh):
        params = jax.jit(lambda k: model.init(cfg, k))(jax.random.key(2))
    err, same = decode_against_forward(model, cfg, mesh, params, [1, 13, 2, 7], steps=5, max_len=18)
    assert err < 1e-4 and same, (err, same)
