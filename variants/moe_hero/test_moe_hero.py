"""variants/moe_hero: expert parallelism equals one device (loss and gradients, EP = 2, 4, 8),
the router (the bias picks experts, the unbiased scores weigh them), dropless and capacity
dispatch against a per-token reference, the tiled grouped matmul against ragged_dot (EP = 1
and 2, 4), the aux-loss-free bias update on real data, the train-loop metrics, the FLOP count
by active parameters and the executed / active expert FLOPs.

XLA:CPU has no ragged all-to-all, so the "ragged" exchange runs here with an emulation of
`jax.lax.ragged_all_to_all` built from all_gather (tests only); on GPU and TPU the model
calls the real collective. The "dense" exchange (fixed capacity) runs as it is.
"""

import dataclasses
import functools
import json
import math
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from decode_check import decode_against_forward
from shared import data, flops
from shared.variant import load

HERE = os.path.dirname(os.path.abspath(__file__))  # this folder: a copy's tests test the copy

LONG = pytest.mark.integration  # a slow case of a parametrized check (the other cases stay in the fast tier)

train = load(os.path.join(HERE, "train.py"))
model = train.model
AXES = ("data", "expert", "model")


def small(**over):
    kw = dict(
        vocab_size=64,
        d_model=32,
        n_layers=2,
        n_dense_layers=1,
        n_heads=4,
        n_kv_heads=2,
        head_dim=8,
        d_ff=64,
        n_experts=8,
        top_k=2,
        n_shared=1,
        d_expert=16,
        window=4,
        global_every=2,
        remat="none",
    )
    kw.update(over)
    return model.ModelConfig(**kw)


def mesh(shape):
    return jax.make_mesh(shape, AXES, axis_types=(AxisType.Explicit,) * 3, devices=jax.devices()[: math.prod(shape)])


def emulated_ragged_all_to_all(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, *, axis_name):
    """jax.lax.ragged_all_to_all from all_gather: rows operand[input_offsets[j]:+send_sizes[j]] of
    device i land in device j's output at output_offsets[j] (offsets as device i computed them)."""
    me = jax.lax.axis_index(axis_name)
    src = jax.lax.all_gather(operand, axis_name)  # [ep, A, D]
    in_off, sizes, out_off = (
        jax.lax.all_gather(x, axis_name)[:, me] for x in (input_offsets, send_sizes, output_offsets)
    )
    r = jnp.arange(output.shape[0])
    for i in range(src.shape[0]):  # from source i: rows out_off[i] .. out_off[i] + sizes[i] of my output
        hit = (r >= out_off[i]) & (r < out_off[i] + sizes[i])
        rows = src[i][jnp.clip(in_off[i] + r - out_off[i], 0, src.shape[1] - 1)]
        output = jnp.where(hit[:, None], rows, output)
    return output


@pytest.fixture
def ragged_on_cpu(monkeypatch):
    monkeypatch.setattr(model, "RAGGED_ALL_TO_ALL", emulated_ragged_all_to_all)


def params_and_batch(cfg, B=8, T=16, seed=0):
    with jax.set_mesh(mesh((1, 1, 1))):
        params = jax.tree.map(np.asarray, jax.jit(lambda k: model.init(cfg, k))(jax.random.key(seed)))
    rng = np.random.default_rng(seed)
    toks = rng.integers(0, cfg.vocab_size, (B, T + 1)).astype(np.int32)
    seg = np.sort(rng.integers(0, 3, (B, T)), axis=1).astype(np.int32)
    batch = {
        "tokens": toks[:, :-1],
        "targets": toks[:, 1:],
        "segment_ids": seg,
        "loss_mask": np.ones((B, T), np.float32),
    }
    return params, batch


def loss_and_grads(cfg, shape, params, batch):
    m = mesh(shape)
    with jax.set_mesh(m):
        p = jax.tree.map(lambda w, s: jax.device_put(w, NamedSharding(m, s)), params, model.param_specs(cfg))
        b = {k: jax.device_put(v, NamedSharding(m, P(model.BATCH, None))) for k, v in batch.items()}
        (loss, metrics), grads = jax.jit(jax.value_and_grad(lambda p, b: model.loss_fn(p, b, cfg), has_aux=True))(p, b)
    return float(loss), jax.tree.map(np.asarray, grads), jax.tree.map(np.asarray, metrics)


# ---------------------------------------------------------------- expert parallelism


def ep_case(a2a):
    cfg = small(a2a=a2a, router_z_loss=1e-3, balance_loss=1e-2)
    params, batch = params_and_batch(cfg)
    # a non-zero router bias, so the biased choice is exercised too
    params["moe_layers"]["router_bias"] = (
        np.random.default_rng(1).normal(0, 0.05, (cfg.n_moe_layers, 8)).astype(np.float32)
    )
    return cfg, params, batch


@functools.cache
def single_device():
    """Loss, gradients and metrics on one device (no exchange: the same for either a2a setting)."""
    return loss_and_grads(*ep_case("dense")[0:1], (1, 1, 1), *ep_case("dense")[1:])


@pytest.mark.parametrize(
    "shape,a2a",
    [
        pytest.param((2, 2, 2), "dense", marks=LONG),
        pytest.param((2, 4, 1), "ragged", marks=LONG),
        pytest.param((1, 8, 1), "dense", marks=LONG),
        pytest.param((1, 8, 1), "ragged", marks=LONG),
    ],  # 20-110 s each: integration
    # (the fast tier's contract runs moe_hero's train step with mesh_expert 2)
    ids=["ep2-dense", "ep4-ragged", "ep8-dense", "ep8-ragged"],
)
def test_expert_parallel_equals_single_device(shape, a2a, ragged_on_cpu):
    cfg, params, batch = ep_case(a2a)
    loss1, g1, m1 = single_device()
    lossn, gn, mn = loss_and_grads(cfg, shape, params, batch)
    np.testing.assert_allclose(lossn, loss1, rtol=1e-6)
    np.testing.assert_array_equal(mn["load"], m1["load"])
    for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(gn)[0], jax.tree.leaves(g1)):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6, err_msg=f"gradient of {jax.tree_util.keystr(path)}")
    assert np.all(g1["moe_layers"]["router_bias"] == 0), "the router bias must get no gradient"


# ---------------------------------------------------------------- router


def test_bias_chooses_experts_but_never_weighs_them():
    cfg = small(top_k=2, routed_scale=2.5)
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((16, cfg.d_model)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((cfg.d_model, cfg.n_experts)), jnp.float32)
    bias = jnp.zeros(cfg.n_experts).at[jnp.array([5, 6])].set(100.0)  # forces experts 5 and 6
    idx0, w0, _, scores = model.route(x, w, jnp.zeros(cfg.n_experts), cfg)
    idx, wts, _, scores_b = model.route(x, w, bias, cfg)
    np.testing.assert_array_equal(scores, scores_b)  # the bias never enters the scores
    assert set(np.asarray(idx).ravel()) == {5, 6} and set(np.asarray(idx0).ravel()) != {5, 6}
    for i, ws, s in ((idx, wts, scores), (idx0, w0, scores)):
        chosen = np.take_along_axis(np.asarray(s), np.asarray(i), axis=-1)
        np.testing.assert_allclose(ws, chosen / chosen.sum(-1, keepdims=True) * 2.5, rtol=1e-6)
    g = jax.grad(lambda b: jnp.sum(model.route(x, w, b, cfg)[1] ** 2))(bias)
    assert np.all(np.asarray(g) == 0)


def test_balance_bias_moves_against_the_load():
    load = jnp.array([[10.0, 2.0, 4.0, 4.0]])
    new = train.balance_bias(jnp.zeros((1, 4)), load, 0.01)
    np.testing.assert_allclose(new, [[-0.01, 0.01, 0.01, 0.01]])  # mean 5: only expert 0 is over it
    stats = jax.tree.map(float, train.load_stats(load))
    assert stats["load_min"] == pytest.approx(0.4) and stats["load_max"] == pytest.approx(2.0)
    assert stats["load_cv"] == pytest.approx(float(np.std([2.0, 0.4, 0.8, 0.8])))


# ---------------------------------------------------------------- dispatch against a per-token reference


def reference_routed(x, layer, cfg, slots=None):
    """The routed experts token by token in numpy float64: each expert keeps its first `slots`
    assignments in token order (all of them if None). Returns (output [N, D], dropped)."""
    xj = jnp.asarray(x, jnp.float32)
    idx, w, _, _ = (np.asarray(a, np.float64) for a in model.route(xj, layer["router"], layer["router_bias"], cfg))
    idx = idx.astype(int)
    out, used, dropped = np.zeros(x.shape), np.zeros(cfg.n_experts, int), 0
    g, u, d = (np.asarray(layer[k], np.float64) for k in ("ex_gate", "ex_up", "ex_down"))
    for n in range(x.shape[0]):
        for j in range(cfg.top_k):
            e = idx[n, j]
            used[e] += 1
            if slots is not None and used[e] > slots:
                dropped += 1
                continue
            a, b = x[n] @ g[e], x[n] @ u[e]
            out[n] += w[n, j] * ((a / (1 + np.exp(-a)) * b) @ d[e])
    return out, dropped


def routed_output(cfg, layer, x):
    m = mesh((1, 1, 1))
    with jax.set_mesh(m):
        h = jax.device_put(x[None], NamedSharding(m, P(model.BATCH, None, None)))
        y, stats = jax.jit(lambda h, l: model.moe_ffn(h, l, cfg))(h, layer)
    return np.asarray(y[0]), jax.tree.map(np.asarray, stats)


@pytest.mark.parametrize("dispatch,cf", [("dropless", 1.0), ("capacity", 0.5), ("capacity", 1.0), ("capacity", 4.0)])
def test_dispatch_matches_per_token_reference(dispatch, cf):
    """Dropless drops nothing; capacity mode drops exactly each expert's assignments past its
    ceil(cf * N * k / E) slots (later tokens first) and reports how many."""
    cfg = small(n_shared=0, dispatch=dispatch, capacity_factor=cf)
    params, _ = params_and_batch(cfg)
    layer = jax.tree.map(lambda w: w[0], params["moe_layers"])
    layer["router_bias"] = np.linspace(-0.3, 0.3, cfg.n_experts).astype(np.float32)  # skewed load: overflow
    x = np.random.default_rng(3).standard_normal((40, cfg.d_model)).astype(np.float32)
    slots = model.capacity(cfg, 40) if dispatch == "capacity" else None
    want, want_dropped = reference_routed(x.astype(np.float64), layer, cfg, slots)
    got, stats = routed_output(cfg, layer, x)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-6)
    assert int(stats["dropped"]) == want_dropped
    assert int(stats["load"].sum()) == 40 * cfg.top_k
    if dispatch == "dropless":
        assert want_dropped == 0
    elif cf == 0.5:
        assert want_dropped > 0, "the test should make some expert overflow"


# ---------------------------------------------------------------- the grouped matmul: tiled against ragged


def grouped_grads(f, x, sizes, wg, wu, wd, ct):
    """f's output and its gradients (rows, three expert weights) under the cotangent ct."""
    out = jax.jit(f)(x, sizes, wg, wu, wd)
    grads = jax.jit(jax.grad(lambda *a: jnp.sum(f(*a) * ct), argnums=(0, 2, 3, 4)))(x, sizes, wg, wu, wd)
    return [np.asarray(out)] + [np.asarray(g) for g in grads]


@pytest.mark.parametrize(
    "sizes,pad,tile",
    [
        ([5, 0, 13, 1, 0, 9], 0, 4),  # uneven, empty experts, several tiles per expert
        ([0, 0, 7, 0], 6, 3),  # one expert, padding rows after the groups (EP's receive buffer)
        ([5, 5, 5, 5], 0, 4),  # every group one row past a tile: exactly the n_tiles bound
        ([17, 0, 2], 9, 32),  # a tile larger than every group
    ],
    ids=["uneven-empty", "padding-rows", "at-the-bound", "one-tile"],
)
def test_tiled_equals_ragged(sizes, pad, tile):
    """_experts_tiled computes what ragged_dot does, outputs and gradients, fp32; padding rows give 0."""
    rng = np.random.default_rng(0)
    R, El, D, F = sum(sizes) + pad, len(sizes), 8, 6
    x = jnp.asarray(rng.standard_normal((R, D)), jnp.float32)
    wg, wu = (jnp.asarray(rng.standard_normal((El, D, F)), jnp.float32) for _ in range(2))
    wd = jnp.asarray(rng.standard_normal((El, F, D)), jnp.float32)
    ct = jnp.asarray(rng.standard_normal((R, D)), jnp.float32)
    sizes = jnp.asarray(sizes, jnp.int32)
    ragged = grouped_grads(functools.partial(model._experts_grouped, matmul="ragged"), x, sizes, wg, wu, wd, ct)
    tiled = grouped_grads(functools.partial(model._experts_tiled, tile=tile), x, sizes, wg, wu, wd, ct)
    for name, a, b in zip(("output", "d rows", "d gate", "d up", "d down"), tiled, ragged):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5, err_msg=name)
    assert np.all(tiled[0][R - pad :] == 0) and np.any(tiled[0][: R - pad] != 0)


def moe_ffn_grads(cfg, shape, layer, h, ct):
    """moe_ffn's output and its gradients (input, router, three expert weights) on a mesh."""
    m = mesh(shape)
    names = ("router", "ex_gate", "ex_up", "ex_down")
    specs = {k: P(*model.param_specs(cfg)["moe_layers"][k][1:]) for k in names}
    with jax.set_mesh(m):
        w = {k: jax.device_put(layer[k], NamedSharding(m, specs[k])) for k in names}
        w["router_bias"] = jax.device_put(layer["router_bias"], NamedSharding(m, P(None)))
        x, c = (jax.device_put(a, NamedSharding(m, P(model.BATCH, None, None))) for a in (h, ct))
        f = lambda x, w: jnp.sum(model.moe_ffn(x, w, cfg)[0] * c)  # noqa: E731
        y, stats = jax.jit(lambda x, w: model.moe_ffn(x, w, cfg))(x, w)
        gx, gw = jax.jit(jax.grad(f, argnums=(0, 1)))(x, w)
    return {
        "output": np.asarray(y),
        "d input": np.asarray(gx),
        **{f"d {k}": np.asarray(gw[k]) for k in names},
        "load": np.asarray(stats["load"]),
    }


@pytest.mark.parametrize(
    "shape,a2a",
    [
        ((1, 1, 1), "dense"),
        pytest.param((2, 2, 2), "dense", marks=LONG),
        pytest.param((1, 4, 1), "ragged", marks=LONG),
    ],  # 10-16 s each: integration
    ids=["ep1", "ep2-tp2-dense", "ep4-ragged"],
)
def test_tiled_equals_ragged_in_moe_ffn(shape, a2a, ragged_on_cpu, monkeypatch):
    """The routed experts with expert_matmul tiled and ragged, with expert parallelism: the same output
    and gradients; tiles of 4 rows (several per expert), two experts never chosen."""
    monkeypatch.setattr(model, "MAX_TILE", 4)
    monkeypatch.setattr(model, "MIN_TILE", 4)
    cfg = small(n_shared=0, a2a=a2a)
    params, _ = params_and_batch(cfg)
    layer = jax.tree.map(lambda w: w[0], params["moe_layers"])
    layer["router_bias"] = np.linspace(0.0, 0.05, cfg.n_experts).astype(np.float32)  # uneven load
    layer["router_bias"][[1, 4]] = -10.0  # scores are in (0, 1): experts 1 and 4 get nothing
    rng = np.random.default_rng(3)
    h, ct = (rng.standard_normal((8, 10, cfg.d_model)).astype(np.float32) for _ in range(2))
    ragged = moe_ffn_grads(dataclasses.replace(cfg, expert_matmul="ragged"), shape, layer, h, ct)
    tiled = moe_ffn_grads(dataclasses.replace(cfg, expert_matmul="tiled"), shape, layer, h, ct)
    for name in ragged:
        np.testing.assert_allclose(tiled[name], ragged[name], rtol=1e-5, atol=1e-6, err_msg=name)
    load = ragged["load"]
    assert list(load > 0) == [e not in (1, 4) for e in range(cfg.n_experts)], load
    assert load.max() > 2 * load[load > 0].min(), load


def test_expert_matmul_choice_and_flops_ratio():
    """auto: tiled on CPU, ragged on GPU/TPU; executed / active expert FLOPs of each path."""
    cfg = small()  # 8 experts, top 2
    assert [model.expert_matmul(cfg, p) for p in ("cpu", "gpu", "tpu")] == ["tiled", "ragged", "ragged"]
    ragged, tiled = (dataclasses.replace(cfg, expert_matmul=m) for m in ("ragged", "tiled"))
    assert model.expert_matmul(ragged, "cpu") == "ragged" and model.expert_matmul(tiled, "gpu") == "tiled"
    # 40 tokens: 80 rows; XLA:CPU's ragged_dot runs every row with every expert, at any EP
    assert model.expert_flops_ratio(ragged, 40, "cpu") == 8.0
    assert model.expert_flops_ratio(ragged, 40, "cpu", ep=2) == 8.0  # 160 buffer rows x 4 experts / 80
    assert model.expert_flops_ratio(cfg, 40, "gpu") == 1.0
    assert model.expert_tile(80, 8) == 32  # the smallest tile: (80 + 8 * 31) // 32 = 10 tiles
    assert model.expert_flops_ratio(cfg, 40, "cpu") == 10 * 32 / 80
    assert model.expert_flops_ratio(tiled, 40, "gpu") == 10 * 32 / 80
    # the CPU default: 4096 tokens per device, 8192 rows, tiles of 256
    default = model.ModelConfig()
    assert model.expert_tile(8192, 8) == 256
    assert model.expert_flops_ratio(default, 4096, "cpu") == 39 * 256 / 8192  # (8192 + 8 * 255) // 256 tiles
    assert model.expert_flops_ratio(default, 2048, "cpu", ep=2) == 35 * 256 / 4096  # 8192 buffer rows, 4 experts
    assert model.expert_flops_ratio(dataclasses.replace(default, expert_matmul="ragged"), 4096, "cpu") == 8.0
    capacity = small(dispatch="capacity", capacity_factor=1.25)  # ceil(1.25 * 80 / 8) = 13 slots per expert
    assert model.expert_flops_ratio(capacity, 40, "cpu") == 8 * 13 / 80


def test_expert_matmul_config_error_names_the_field():
    with pytest.raises(model.ConfigError, match="model.expert_matmul"):
        small(expert_matmul="dense")


def test_local_and_global_attention_backends_are_checked_in_the_config():
    """One backend setting per kind of attention layer, each refused at config time when it cannot run them."""
    with pytest.raises(model.ConfigError, match="model.local_attention_backend: 'nope' cannot run the sliding-window"):
        small(local_attention_backend="nope")
    with pytest.raises(model.ConfigError, match="model.attention_backend: 'cudnn' cannot run the global layers"):
        small(attention_backend="cudnn", local_attention_backend="reference")  # cuDNN takes no float32
    assert model.local_backend(small(attention_backend="reference")) == "reference"
    assert model.local_backend(small(attention_backend="reference", local_attention_backend="auto")) == "auto"


# ---------------------------------------------------------------- the train loop


@pytest.mark.integration  # a long run: 30 steps on real data
def test_bias_update_balances_load_on_real_data(small_corpus, tmp_path):
    """With the weights frozen (lr ~ 0), only the router bias moves: the per-expert load spread of
    the stdlib text must shrink over the run, and without the update it must not."""

    def run(rate, sub):
        cfg = train.TrainConfig(
            data=data.DataConfig(source=small_corpus, val_fraction=0.1),
            model=small(vocab_size=512, d_model=64, n_experts=16, top_k=2, d_expert=32, init_std=0.3),
            seq_len=64,
            batch_size=16,
            steps=30,
            warmup_steps=0,
            lr=1e-9,
            bias_rate=rate,
            eval_every=30,
            eval_batches=1,
            log_every=10,
            save_every=0,
            run_dir=str(tmp_path / sub),
            wandb="disabled",
            sample_tokens=0,
            mesh_expert=2,
        )
        train.main(cfg)
        with open(tmp_path / sub / "metrics.jsonl") as f:
            rows = [json.loads(line) for line in f]
        return [r["train/load_cv"] for r in rows if "train/load_cv" in r], rows[-1]

    cv, last = run(0.01, "bias")
    cv0, _ = run(0.0, "none")
    assert len(cv) == 4  # step 1 (before any update), 10, 20, 30
    assert cv[-1] < 0.5 * cv[0], f"load spread did not shrink: {cv}"
    assert cv0[-1] > 0.8 * cv0[0], f"without the bias update the spread shrank anyway: {cv0}"
    assert last["train/bias_norm"] > 0 and last["train/dropped"] == 0


def test_mesh_errors_name_the_field():
    cfg = train.TrainConfig(model=small(n_experts=6), mesh_expert=4, batch_size=8)
    with pytest.raises(model.ConfigError, match="model.n_experts"):
        train.make_mesh(cfg)
    with pytest.raises(model.ConfigError, match="batch_size"):
        train.make_mesh(train.TrainConfig(model=small(), mesh_expert=8, batch_size=4))
    with pytest.raises(model.ConfigError, match="^mesh_expert: mesh_expert 3 .* does not divide the 8 devices"):
        train.make_mesh(train.TrainConfig(model=small(), mesh_expert=3))  # the axis the user set, not mesh_data


# ---------------------------------------------------------------- FLOPs


def test_flops_count_active_parameters():
    cfg = small(n_layers=4, n_dense_layers=1, n_experts=8, top_k=2, n_shared=1)
    T = 256
    more_experts = dataclasses.replace(cfg, n_experts=64)  # idle experts add parameters, not FLOPs
    assert model.num_params(more_experts) > model.num_params(cfg)
    router = 6 * cfg.n_moe_layers * cfg.d_model * (64 - 8)  # only the router grows with E
    assert model.flops_per_token(more_experts, T) - model.flops_per_token(cfg, T) == pytest.approx(router)
    one_more = dataclasses.replace(cfg, top_k=3)  # one more routed expert per token per MoE layer
    expert = 6 * cfg.n_moe_layers * 3 * cfg.d_model * cfg.d_expert
    assert model.flops_per_token(one_more, T) - model.flops_per_token(cfg, T) == pytest.approx(expert)
    local = flops.attention_flops_per_token(T, cfg.n_heads, cfg.head_dim, window=cfg.window)
    glob = flops.attention_flops_per_token(T, cfg.n_heads, cfg.head_dim)
    wide = dataclasses.replace(cfg, window=T)
    n_local = model.global_layers(cfg).count(False)
    assert model.flops_per_token(wide, T) - model.flops_per_token(cfg, T) == pytest.approx(n_local * (glob - local))


@pytest.mark.integration  # long: prefill and decode of a whole MoE model, 25-75 s; the contract decodes moe_hero
def test_decoding_routes_as_forward_and_drops_nothing():
    """Decoding (prefill, then greedy steps; experts over 2 devices, a 4-token window) routes each token
    to forward's experts and runs them dropless whatever `dispatch` says (model.prefill). Under
    dispatch="capacity" with a factor at which forward drops assignments (0.5), decoding equals forward
    with dispatch="dropless", not forward as configured; at a factor that drops nothing (8) it equals it."""
    cfg = small(dispatch="capacity", capacity_factor=0.5)  # a dense local layer, then a MoE global one
    params, _ = params_and_batch(cfg)
    params["moe_layers"]["router_bias"] = (
        np.random.default_rng(1).normal(0, 0.05, (cfg.n_moe_layers, 8)).astype(np.float32)
    )
    m = mesh((2, 2, 2))
    with jax.set_mesh(m):
        p = jax.tree.map(lambda w, s: jax.device_put(w, NamedSharding(m, s)), params, model.param_specs(cfg))
    forwards = [dataclasses.replace(cfg, dispatch="dropless"), cfg, dataclasses.replace(cfg, capacity_factor=8.0)]
    (err, same), (err_dropping, _), (err_roomy, same_roomy) = decode_against_forward(
        model, cfg, m, p, [1, 9, 4, 6, 2, 9, 3, 5], steps=5, max_len=16, forward_cfgs=forwards
    )
    assert err < 1e-4 and same, (err, same)
    assert err_dropping > 1e-3, "forward at capacity_factor 0.5 dropped nothing: the test shows nothing"
    assert err_roomy < 1e-4 and same_roomy, (err_roomy, same_roomy)
