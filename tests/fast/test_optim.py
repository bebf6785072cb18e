"""shared/optim.py and shared/weights.py: Newton-Schulz, the four optimizers sharded and not, the
hyperball, roles, lr multipliers, schedules, config checks. Tiny shapes; a few seconds."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

from shared import optim
from shared.weights import Weight, init_params, normal, ones, zeros


L, E, D, F, V = 4, 4, 16, 24, 32


def decl(expert: bool) -> dict:
    """A small model's declaration: stacked matrices both ways round, experts, embedding, norms, a gain,
    a rate, a bias, and (with experts) a router and a buffer."""
    batch = ("data", "expert") if expert else "data"
    layers = {
        "norm": Weight((L, D), P(None, None), "norm", ones),
        "w_in": Weight((L, D, F), P(None, batch, "model"), "matrix", normal(0.1), fan_in=1, fan_out=2),
        "w_out": Weight((L, F, D), P(None, "model", batch), "matrix", normal(0.1), fan_in=1, fan_out=2),
        "rate": Weight((L, F), P(None, "model"), "rate", normal(1.0)),
        "gate": Weight((L, F), P(None, "model"), "gain", zeros),
        "bias": Weight((L, F), P(None, "model"), "bias", normal(0.1)),
    }
    if expert:
        layers |= {
            "ex_up": Weight(
                (L, E, D, F), P(None, "expert", "data", "model"), "expert_matrix", normal(0.1), fan_in=2, fan_out=3
            ),
            "router": Weight((L, D, E), P(None, batch, None), "router", normal(0.1), fan_in=1, fan_out=2),
            "router_bias": Weight((L, E), P(None, None), "buffer", zeros, dtype="float32"),
        }
    return {
        "embed": Weight((V, D), P("model", batch), "embedding", normal(0.1), fan_in=0, fan_out=1),
        "layers": layers,
        "final_norm": Weight((D,), P(None), "norm", ones),
    }


HYPER = dict(lr=0.02, steps=10, warmup=1, min_lr_ratio=0.1, weight_decay=0.1, b1=0.9, b2=0.95, grad_clip=1.0)


def grads_at(params, i):
    """Deterministic gradient-like pytree for step i (same on every mesh)."""
    leaves, treedef = jax.tree.flatten(params)
    keys = jax.random.split(jax.random.fold_in(jax.random.key(100), i), len(leaves))
    return jax.tree.unflatten(
        treedef,
        [
            jax.random.normal(k, p.shape, jnp.float32, out_sharding=jax.typeof(p).sharding.spec).astype(p.dtype)
            + 0.5 * p
            for k, p in zip(keys, leaves)
        ],
    )


def run(d, name, steps, mesh=None, oc=optim.OptimConfig(), **over):
    """`steps` optimizer steps from init at seed 0 on `mesh` (default: one device, every mesh axis of
    size 1); params after each step, as numpy, and the last optimizer state."""
    opt, _ = optim.make(d, name, oc, **(HYPER | over))

    def go():
        params, state = jax.jit(lambda k: (lambda p: (p, opt.init(p)))(init_params(d, k, "float32")))(jax.random.key(0))
        out = []

        @jax.jit
        def step(p, s, i):
            u, s = opt.update(grads_at(p, i), s, p)
            return jax.tree.map(lambda a, b: a + b, p, u), s

        for i in range(steps):
            params, state = step(params, state, i)
            out.append(jax.tree.map(np.asarray, params))
        return out, state

    with jax.set_mesh(mesh or one_device()):
        return go()


def mesh_of(shape, names):
    n = int(np.prod(shape))
    return jax.make_mesh(shape, names, axis_types=(AxisType.Explicit,) * len(names), devices=jax.devices()[:n])


def one_device():
    """Every mesh axis of size 1: the single-device reference."""
    return mesh_of((1, 1, 1), ("data", "expert", "model"))


@pytest.fixture(autouse=True)
def _one_device_mesh():
    """Tests run on the single-device mesh unless they set another one."""
    with jax.set_mesh(one_device()):
        yield


# ---------------------------------------------------------------- Newton-Schulz


@pytest.mark.parametrize("m,n", [(64, 64), (32, 128), (128, 32), (96, 48)])
def test_newton_schulz_singular_values_in_band(m, n):
    lo, hi = optim.NS_BAND
    xs = [jax.random.normal(jax.random.key(s), (m, n)) for s in range(3)]
    # and a spread spectrum: singular values log-spaced down to the documented floor
    u, _ = jnp.linalg.qr(jax.random.normal(jax.random.key(7), (m, min(m, n))))
    v, _ = jnp.linalg.qr(jax.random.normal(jax.random.key(8), (n, min(m, n))))
    xs.append(u @ jnp.diag(jnp.logspace(np.log10(optim.NS_FLOOR), 0, min(m, n))) @ v.T)
    for x in xs:
        s_in = np.linalg.svd(np.asarray(x), compute_uv=False)
        s = np.linalg.svd(np.asarray(optim.newton_schulz(x, 5)), compute_uv=False)
        s = s[s_in >= optim.NS_FLOOR * s_in[0] * (1 - 1e-4)]
        assert lo <= s.min() and s.max() <= hi, (m, n, s.min(), s.max())


NS = jax.jit(lambda m: optim.newton_schulz(m, 5))  # one matrix at a time: the reference


@pytest.mark.parametrize("sharded", [False, True])
def test_orthogonalize_batched_equals_per_matrix_loop(sharded):
    """[L, in, out] and [L, E, in, out], both aspect ratios, equal Newton-Schulz of each slice; sharded
    on a data x expert x model = 2x2x2 mesh (the all-to-all plan) they still do."""
    d = decl(expert=True)["layers"]
    cases = [
        d["w_in"],
        d["w_out"],
        d["ex_up"],
        Weight((3, D, F), P(None, "data", "model"), "matrix", normal(1.0), fan_in=1, fan_out=2),
    ]  # 3 layers: padded to the mesh
    mesh = mesh_of((2, 2, 2), ("data", "expert", "model")) if sharded else None
    for i, w in enumerate(cases):
        x = np.asarray(jax.random.normal(jax.random.key(i), w.shape))
        flat = x.reshape(-1, *x.shape[-2:])
        want = np.stack([np.asarray(NS(m)) for m in flat]).reshape(x.shape)
        if sharded:
            with jax.set_mesh(mesh):
                xs = jax.device_put(x, w.spec)
                got = jax.jit(lambda a: optim.orthogonalize(a, w, 5))(xs)
                assert got.sharding.spec == w.spec or tuple(got.sharding.spec) == tuple(w.spec)
        else:
            got = optim.orthogonalize(jnp.asarray(x), w, 5)
        np.testing.assert_allclose(np.asarray(got), want, atol=2e-5, err_msg=str(w.shape))


def test_orthogonalize_moves_fan_axes():
    """fan_in / fan_out anywhere: the same as with them last."""
    x = jax.random.normal(jax.random.key(3), (D, L, F))
    w = Weight((D, L, F), P(), "matrix", normal(1.0), fan_in=0, fan_out=2)
    want = optim.newton_schulz(jnp.transpose(x, (1, 0, 2)), 5)
    np.testing.assert_allclose(
        np.asarray(optim.orthogonalize(x, w, 5)), np.asarray(jnp.transpose(want, (1, 0, 2))), atol=2e-5
    )


# ---------------------------------------------------------------- optimizers


@pytest.mark.parametrize("name", optim.OPTIMIZERS)
def test_roles_that_never_decay(name):
    """With zero gradients and a large weight decay, norms, rates, biases and buffers stay put; a
    decayed role (embedding) shrinks. A buffer with a gradient stays put too."""
    d = decl(expert=True)
    opt, _ = optim.make(d, name, optim.OptimConfig(), **(HYPER | dict(weight_decay=0.5, warmup=0)))
    params = init_params(d, jax.random.key(0), "float32")
    params["layers"]["router_bias"] = params["layers"]["router_bias"] + 1.0
    state = opt.init(params)
    zero = jax.tree.map(jnp.zeros_like, params)
    zero["layers"]["router_bias"] = jnp.ones_like(params["layers"]["router_bias"])
    p = params
    step = jax.jit(lambda p, s: opt.update(zero, s, p))
    for _ in range(3):
        u, state = step(p, state)
        p = jax.tree.map(lambda a, b: a + b, p, u)
    for key in ("norm", "rate", "bias", "router_bias"):
        np.testing.assert_array_equal(np.asarray(p["layers"][key]), np.asarray(params["layers"][key]), err_msg=key)
    np.testing.assert_array_equal(np.asarray(p["final_norm"]), np.asarray(params["final_norm"]))
    assert np.linalg.norm(p["embed"]) < 0.99 * np.linalg.norm(params["embed"])


def test_renaming_a_weight_changes_nothing_but_its_key():
    """The same values under another name get the same updates from every optimizer."""
    d = decl(expert=True)
    renamed = {**d, "layers": {("zz_" + k): w for k, w in d["layers"].items()}}
    params = init_params(d, jax.random.key(0), "float32")
    params_r = {**params, "layers": {("zz_" + k): v for k, v in params["layers"].items()}}
    g = grads_at(params, 0)
    g_r = {**g, "layers": {("zz_" + k): v for k, v in g["layers"].items()}}
    for name in ("adamw", "muonh"):  # the Adam path, and Newton-Schulz + the hyperball
        o1, _ = optim.make(d, name, optim.OptimConfig(), **HYPER)
        o2, _ = optim.make(renamed, name, optim.OptimConfig(), **HYPER)
        u1, _ = jax.jit(lambda g, p: o1.update(g, o1.init(p), p))(g, params)
        u2, _ = jax.jit(lambda g, p: o2.update(g, o2.init(p), p))(g_r, params_r)
        for k in d["layers"]:
            np.testing.assert_array_equal(np.asarray(u1["layers"][k]), np.asarray(u2["layers"]["zz_" + k]))


def test_adding_a_weight_leaves_every_other_init_bit_identical():
    d = decl(expert=False)
    more = {
        **d,
        "extra": Weight((D, D), P(), "matrix", normal(0.1), fan_in=0, fan_out=1),
        "layers": {**d["layers"], "another": Weight((L, D), P(), "gain", normal(1.0))},
    }
    a = init_params(d, jax.random.key(3), "float32")
    b = init_params(more, jax.random.key(3), "float32")
    jax.tree.map(
        lambda x, y: np.testing.assert_array_equal(np.asarray(x), np.asarray(y)),
        a,
        {
            k: ({kk: vv for kk, vv in v.items() if kk != "another"} if k == "layers" else v)
            for k, v in b.items()
            if k != "extra"
        },
    )


def test_lr_mult_per_role():
    """embedding=0 freezes the embedding; matrix=2 doubles AdamW's first matrix step (no decay, no clip)."""
    d = decl(expert=False)
    params = init_params(d, jax.random.key(0), "float32")
    g = grads_at(params, 0)
    hyper = HYPER | dict(weight_decay=0.0, grad_clip=0.0, warmup=0)
    base, _ = optim.make(d, "adamw", optim.OptimConfig(), **hyper)
    mult, _ = optim.make(d, "adamw", optim.OptimConfig(lr_mult="embedding=0,matrix=2"), **hyper)
    u0, _ = jax.jit(lambda g, p: base.update(g, base.init(p), p))(g, params)
    u1, _ = jax.jit(lambda g, p: mult.update(g, mult.init(p), p))(g, params)
    assert not np.any(np.asarray(u1["embed"]))
    np.testing.assert_allclose(np.asarray(u1["layers"]["w_in"]), 2 * np.asarray(u0["layers"]["w_in"]), rtol=1e-6)
    np.testing.assert_allclose(np.asarray(u1["layers"]["norm"]), np.asarray(u0["layers"]["norm"]), rtol=1e-6)


def test_muon_update_rms_matches_the_convention():
    """Muon's first step on a matrix (no decay) has RMS lr * muon_rms (its singular values near 1)."""
    d = {"w": Weight((L, D, F), P(), "matrix", normal(0.1), fan_in=1, fan_out=2)}
    params = init_params(d, jax.random.key(0), "float32")
    opt, _ = optim.make(d, "muon", optim.OptimConfig(), **(HYPER | dict(weight_decay=0.0, warmup=0)))
    u, _ = jax.jit(lambda p: opt.update(grads_at(p, 0), opt.init(p), p))(params)
    rms = np.sqrt(np.mean(np.asarray(u["w"]) ** 2, axis=(1, 2)))
    np.testing.assert_allclose(rms, HYPER["lr"] * 0.2, rtol=0.2)


def test_wsd_schedule():
    s = optim.make_schedule(optim.OptimConfig(schedule="wsd", decay_frac=0.2), 1.0, 100, 10, 0.1)
    assert float(s(0)) == 0.0 and float(s(10)) == pytest.approx(1.0) and float(s(79)) == pytest.approx(1.0)
    assert float(s(90)) == pytest.approx(0.55) and float(s(100)) == pytest.approx(0.1)
    with pytest.raises(optim.OptimError, match="optim.decay_frac"):
        optim.make_schedule(optim.OptimConfig(schedule="wsd", decay_frac=0.95), 1.0, 100, 10, 0.1)


def test_ema_update():
    e = optim.ema_update({"a": jnp.zeros(3)}, {"a": jnp.ones(3)}, 0.9)
    np.testing.assert_allclose(np.asarray(e["a"]), 0.1, rtol=1e-6)


@pytest.mark.parametrize(
    "field,value",
    [
        ("schedule", "linear"),
        ("decay_frac", 0.0),
        ("decay_frac", 1.5),
        ("lr_mult", "embedding"),
        ("lr_mult", "nonsense=1"),
        ("lr_mult", "norm=-1"),
        ("lr_mult", "norm=1,norm=2"),
        ("momentum", 1.0),
        ("ns_steps", 0),
        ("muon_rms", 0.0),
        ("eps", 0.0),
        ("ema", 1.0),
        ("ema", -0.1),
        ("schedule_steps", -1),
    ],
)
def test_config_rejects(field, value):
    with pytest.raises(optim.OptimError, match=f"optim.{field}"):
        optim.OptimConfig(**{field: value})


def test_unknown_optimizer_and_bad_declarations():
    with pytest.raises(optim.OptimError, match="optimizer"):
        optim.make(decl(False), "sgd", optim.OptimConfig(), **HYPER)
    with pytest.raises(ValueError, match="role"):
        Weight((D, F), P(), "matrix", normal(1.0))  # a matrix without fan axes
    with pytest.raises(ValueError, match="role"):
        Weight((D,), P(), "weird", ones)
    with pytest.raises(ValueError, match="not a matrix"):
        Weight((D,), P(), "norm", ones, fan_in=0, fan_out=0)
