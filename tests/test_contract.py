"""The variant contract: every folder under templates/ and variants/ with model.py and
train.py is found here and must expose the same names and pass the same checks.

model.py: frozen, self-validating `ModelConfig`; `init(cfg, key)`; `param_specs(cfg)`
matching `init`'s pytree; `forward(params, tokens, cfg, *, segment_ids=None) -> logits`;
`loss_fn(params, batch, cfg) -> (loss, metrics)`; `COPIED_FROM` naming its parent.
train.py: `TrainConfig`, `make_mesh`, `make_optimizer`, `init_state`, `make_train_step`,
`make_eval_step`, `batch_spec`, `CONTRACT_TINY`, `main` (EXPORTS lists every name used).

Each check runs on an 8-device CPU mesh (data=4, model=2, or what the variant's
CONTRACT_TINY sets: e.g. an `expert` axis), at a tiny config that the variant's own
CONTRACT_TINY adjusts so its distinctive path runs (a window shorter than the row, several
KDA chunks, experts over devices). Batches are placed with the variant's `batch_spec`. Abstract traces allocate
nothing, so every preset of every variant is traced too, at its own scale: its own
batch and mesh, on an AbstractMesh of as many devices as the preset's mesh sizes multiply
to (AT_SCALE_DEVICES when it leaves mesh_data at -1), lowered for CUDA. For that,
`make_mesh(cfg, devices)` accepts a device count and returns an AbstractMesh.
"""

import dataclasses
import functools
import math
import os

import draccus
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from shared import cli
from shared.variant import ROOT, discover, load

VARIANTS = discover()


def modules(variant):
    return load(os.path.join(ROOT, variant, "model.py")), load(os.path.join(ROOT, variant, "train.py"))


# Every name main() and these tests use. A variant missing one fails test_exports, listing them all.
EXPORTS = {
    "model": ("COPIED_FROM", "ConfigError", "ModelConfig", "check", "init", "param_specs", "forward", "loss_fn",
              "num_params", "flops_per_token"),
    "train": ("TrainConfig", "CONTRACT_TINY", "make_mesh", "make_optimizer", "init_state", "make_train_step",
              "make_eval_step", "batch_spec", "to_device", "main"),
}


def tiny(train, **over):
    """The built-in CPU default with 8 rows of 32 tokens on the 8 devices (data=4 x model=2 unless the
    variant's CONTRACT_TINY says otherwise), plus the variant's CONTRACT_TINY overrides, then `over`."""
    own = dict(train.CONTRACT_TINY)
    model_over = own.pop("model", {})
    kw = dict(seq_len=32, batch_size=8, steps=4, warmup_steps=0, mesh_data=-1, mesh_model=2, wandb="disabled")
    kw.update(own)
    kw.update(over)
    return train.TrainConfig(model=dataclasses.replace(train.TrainConfig().model, **model_over), **kw)


AT_SCALE_DEVICES = 64  # a preset that leaves mesh_data at -1 is traced on this many devices


PRESETS = [(v, name) for v in VARIANTS for name in cli.presets(os.path.join(ROOT, v))]


def at_scale_devices(cfg) -> int:
    """The device count a preset is written for: the product of its mesh_* sizes, if it fixes mesh_data."""
    sizes = [v for k, v in dataclasses.asdict(cfg).items() if k.startswith("mesh_")]
    return math.prod(sizes) if cfg.mesh_data > 0 else AT_SCALE_DEVICES


def batch_spec(train, mesh, cfg):
    micro = cfg.batch_size // cfg.grad_accum
    s = NamedSharding(mesh, train.batch_spec(1))
    shape = (cfg.grad_accum, micro, cfg.seq_len)
    return {"tokens": jax.ShapeDtypeStruct(shape, jnp.int32, sharding=s),
            "targets": jax.ShapeDtypeStruct(shape, jnp.int32, sharding=s),
            "segment_ids": jax.ShapeDtypeStruct(shape, jnp.int32, sharding=s),
            "loss_mask": jax.ShapeDtypeStruct(shape, jnp.float32, sharding=s)}


@pytest.mark.parametrize("variant", VARIANTS)
def test_exports(variant):
    mods = dict(zip(("model", "train"), modules(variant)))
    missing = [f"{m}.{n}" for m, names in EXPORTS.items() for n in names if not hasattr(mods[m], n)]
    assert not missing, f"{variant} lacks {missing}"
    model, train = mods["model"], mods["train"]
    assert isinstance(train.CONTRACT_TINY, dict), f"{variant}: CONTRACT_TINY must be a dict of TrainConfig overrides"
    assert isinstance(train.batch_spec(1), P) and len(train.batch_spec(1)) == 3, \
        f"{variant}: batch_spec(1) must be the PartitionSpec of a [grad_accum, rows, T] array"
    assert dataclasses.is_dataclass(model.ModelConfig), f"{variant}: ModelConfig is not a dataclass"
    assert model.ModelConfig.__dataclass_params__.frozen, f"{variant}: ModelConfig must be frozen"
    assert dataclasses.is_dataclass(train.TrainConfig), f"{variant}: TrainConfig is not a dataclass"


@pytest.mark.parametrize("variant", VARIANTS)
def test_lineage(variant):
    model, _ = modules(variant)
    parent = model.COPIED_FROM
    if variant == "templates/base":
        assert parent is None, "templates/base is the root and declares no parent"
        return
    assert isinstance(parent, str) and parent, f"{variant}: COPIED_FROM must name the folder it was copied from"
    assert parent != variant, f"{variant}: COPIED_FROM names itself"
    assert os.path.isfile(os.path.join(ROOT, parent, "model.py")), \
        f"{variant}: declared parent {parent!r} does not exist (no {parent}/model.py)"


@pytest.mark.parametrize("variant", VARIANTS)
def test_config_validates(variant):
    model, train = modules(variant)
    cfg = model.ModelConfig()
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.n_layers = 3
    with pytest.raises(ValueError, match="n_layers"):
        dataclasses.replace(cfg, n_layers=0)
    with pytest.raises(ValueError, match="batch_size"):
        train.TrainConfig(batch_size=0)


@pytest.mark.parametrize("variant", VARIANTS)
def test_param_specs_match_params(variant):
    model, train = modules(variant)
    cfg = tiny(train)
    with jax.set_mesh(train.make_mesh(cfg)):
        params = jax.eval_shape(lambda k: model.init(cfg.model, k), jax.random.key(0))
        specs = model.param_specs(cfg.model)
        assert jax.tree.structure(params) == jax.tree.structure(specs, is_leaf=lambda s: isinstance(s, P)), \
            f"{variant}: param_specs does not have the pytree structure of init"
        for (path, x), spec in zip(jax.tree_util.tree_flatten_with_path(params)[0],
                                   jax.tree.leaves(specs, is_leaf=lambda s: isinstance(s, P))):
            name = jax.tree_util.keystr(path)
            assert len(spec) == x.ndim, f"{variant}: spec {spec} for {name} has rank {len(spec)}, leaf has {x.ndim}"
            got = x.sharding.spec
            assert tuple(got) + (None,) * (x.ndim - len(got)) == tuple(spec), \
                f"{variant}: init places {name} as {got}, param_specs says {spec}"


def _trace(train, cfg, n_devices=None):
    """Trace and lower one train step: on this machine's devices, or on an AbstractMesh of n_devices
    (nothing allocated or compiled; lowered for CUDA, as no device of that mesh exists here)."""
    opt, schedule = train.make_optimizer(cfg)
    mesh = train.make_mesh(cfg, n_devices)
    with jax.set_mesh(mesh) if n_devices is None else jax.sharding.use_abstract_mesh(mesh):
        state = jax.eval_shape(lambda: train.init_state(cfg, opt, jax.random.key(0)))
        step = train.make_train_step(cfg, opt, schedule)
        traced = step.trace(state, batch_spec(train, mesh, cfg))
        lowered = traced.lower() if n_devices is None else traced.lower(lowering_platforms=("cuda",))
        out_state, metrics = lowered.out_info
    assert jax.tree.structure(out_state) == jax.tree.structure(state)
    assert "loss" in metrics


@pytest.mark.parametrize("variant", VARIANTS)
def test_trace_tiny(variant):
    _, train = modules(variant)
    _trace(train, tiny(train, grad_accum=2))


# ids end in "<variant>]" like every other test here, so -k "<variant>]" selects them too
@pytest.mark.parametrize("variant,preset", PRESETS, ids=[f"{p}@{v}" for v, p in PRESETS])
def test_trace_preset_at_scale(variant, preset):
    """Every preset's train step traces at its own batch, sequence length and mesh."""
    _, train = modules(variant)
    cfg = draccus.parse(train.TrainConfig, config_path=cli.presets(os.path.join(ROOT, variant))[preset], args=[])
    n = at_scale_devices(cfg)
    try:
        _trace(train, cfg, n)
    except Exception as e:
        raise AssertionError(f"{variant}: preset {preset!r} does not trace on {n} devices: {e}") from e


def random_batch(cfg, rng):
    micro = cfg.batch_size // cfg.grad_accum
    toks = rng.integers(0, cfg.model.vocab_size, (cfg.grad_accum, micro, cfg.seq_len + 1), dtype=np.int32)
    seg = np.ones(toks[..., 1:].shape, np.int32)
    seg[..., cfg.seq_len // 2:] = 2
    mask = np.ones(seg.shape, np.float32)
    mask[..., cfg.seq_len // 2 - 1] = 0
    return {"tokens": toks[..., :-1], "targets": toks[..., 1:], "segment_ids": seg, "loss_mask": mask}


@pytest.mark.parametrize("variant", VARIANTS)
def test_concrete_step(variant):
    _, train = modules(variant)
    cfg = tiny(train)
    opt, schedule = train.make_optimizer(cfg)
    mesh = train.make_mesh(cfg)
    with jax.set_mesh(mesh):
        state = jax.jit(lambda k: train.init_state(cfg, opt, k))(jax.random.key(0))
        before = jax.tree.map(np.asarray, state["params"])
        batch = {k: jax.device_put(v, NamedSharding(mesh, train.batch_spec(1)))
                 for k, v in random_batch(cfg, np.random.default_rng(0)).items()}
        step = train.make_train_step(cfg, opt, schedule)
        state, m = step(state, batch)
        state, m2 = step(state, batch)
    loss, loss2 = float(m["loss"]), float(m2["loss"])
    assert np.isfinite(loss), f"{variant}: first loss is {loss}"
    assert abs(loss - np.log(cfg.model.vocab_size)) < 1.0, f"{variant}: initial loss {loss} far from ln(V)"
    assert loss2 < loss, f"{variant}: a second step on the same batch did not lower the loss ({loss} -> {loss2})"
    changed = jax.tree.map(lambda a, b: not np.array_equal(a, np.asarray(b)), before, state["params"])
    assert all(jax.tree.leaves(changed)), f"{variant}: some parameters did not change: {changed}"


@functools.cache
def _forward_fn(variant):
    model, train = modules(variant)
    cfg = tiny(train)
    mesh = train.make_mesh(cfg)
    with jax.set_mesh(mesh):
        params = jax.jit(lambda k: model.init(cfg.model, k))(jax.random.key(1))
    put = lambda x: jax.device_put(jnp.asarray(x), NamedSharding(mesh, train.batch_spec()))  # noqa: E731
    return mesh, params, put, jax.jit(lambda p, t, s: model.forward(p, t, cfg.model, segment_ids=s))


def _forward(variant, tokens, segment_ids=None):
    mesh, params, put, f = _forward_fn(variant)
    if segment_ids is None:  # one compiled program for both tests: no ids = one document per row
        segment_ids = np.ones_like(tokens)
    with jax.set_mesh(mesh):
        return np.asarray(f(params, put(tokens), put(segment_ids)))


@pytest.mark.parametrize("variant", VARIANTS)
def test_causality(variant):
    """Changing a later token never changes the logits of earlier positions."""
    _, train = modules(variant)
    V, T = tiny(train).model.vocab_size, 32
    rng = np.random.default_rng(0)
    a = rng.integers(0, V, (4, T), dtype=np.int32)
    b = a.copy()
    b[:, 20:] = rng.integers(0, V, (4, T - 20), dtype=np.int32)
    la, lb = _forward(variant, a), _forward(variant, b)
    np.testing.assert_array_equal(la[:, :20], lb[:, :20], err_msg=f"{variant}: later tokens leak into earlier logits")
    assert not np.allclose(la[:, 20:], lb[:, 20:]), f"{variant}: logits ignore the tokens"


@pytest.mark.parametrize("variant", VARIANTS)
def test_document_isolation(variant):
    """A packed row gives each document the logits it gets alone."""
    _, train = modules(variant)
    V, T, cut = tiny(train).model.vocab_size, 32, 13
    rng = np.random.default_rng(1)
    packed = rng.integers(0, V, (4, T), dtype=np.int32)
    seg = np.where(np.arange(T) < cut, 1, 2).astype(np.int32)[None].repeat(4, 0)
    out = _forward(variant, packed, seg)
    first = np.zeros_like(packed)
    first[:, :cut] = packed[:, :cut]
    second = np.zeros_like(packed)
    second[:, : T - cut] = packed[:, cut:]
    alone1 = _forward(variant, first, np.where(np.arange(T) < cut, 1, 2).astype(np.int32)[None].repeat(4, 0))
    alone2 = _forward(variant, second, np.where(np.arange(T) < T - cut, 1, 2).astype(np.int32)[None].repeat(4, 0))
    np.testing.assert_allclose(out[:, :cut], alone1[:, :cut], rtol=1e-5, atol=1e-5,
                               err_msg=f"{variant}: document 1 sees document 2")
    np.testing.assert_allclose(out[:, cut:], alone2[:, : T - cut], rtol=1e-5, atol=1e-5,
                               err_msg=f"{variant}: document 2 sees document 1")
