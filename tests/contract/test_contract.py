"""The variant contract: every folder under templates/ and variants/ with model.py and
train.py is found here and must expose the same names and pass the same checks.

model.py: frozen, self-validating `ModelConfig`; `init(cfg, key)`; `param_specs(cfg)`
matching `init`'s pytree; `forward(params, tokens, cfg, *, segment_ids=None) -> logits`;
`loss_fn(params, batch, cfg) -> (loss, metrics)`; `COPIED_FROM` naming its parent; decoding
with a cache: `cache_specs(cfg)`, `init_cache(cfg, batch, max_len)`, `prefill(params, tokens,
cache, cfg, *, lengths=None)` and `decode_step(params, token, cache, cfg)` (CACHE_API).
train.py: `TrainConfig`, `make_mesh`, `make_optimizer`, `init_state`, `make_train_step`,
`make_eval_step`, `batch_spec`, `CONTRACT_TINY`, `main` (EXPORTS lists every name used).

The concrete checks run on an 8-device CPU mesh (data=4, model=2, or what the variant's
CONTRACT_TINY sets: e.g. an `expert` axis), at a tiny config that the variant's own
CONTRACT_TINY adjusts so its distinctive path runs (a window shorter than the row, several
KDA chunks, experts over devices, an auxiliary loss switched on), all from one TinyRun per
folder (three compiled programs): two real train steps with grad_accum = 2; causality and
document isolation of `forward`'s logits and of `loss_fn`'s loss (so any auxiliary term is
covered); accumulation that does not depend on how the batch is split; shared weights that
start as the parent's; and (two more programs, prefill and one decoding step) that decoding
with the cache gives `forward`'s logits and greedy tokens for prompts of mixed lengths. Batches are placed with the variant's `batch_spec`. The tests at the
end break a copy of dense on purpose and check that each of these checks catches it.

Abstract traces allocate nothing, so every preset of every variant is traced too, at its own
scale: its own batch and mesh, on an AbstractMesh of as many devices as the preset's mesh
sizes multiply to (AT_SCALE_DEVICES when it leaves mesh_data at -1), lowered for CUDA. For
that, `make_mesh(cfg, devices)` accepts a device count and returns an AbstractMesh. Each
preset's first line states its parameter count, checked against `num_params`.
"""

import dataclasses
import functools
import importlib
import math
import os
import re
import typing

import draccus
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from shared import cli, kernels, weights
from shared.runtime import memory
from shared.config import ConfigError
from shared.variant import ROOT, discover, load

from helpers import fast_tier  # noqa: E402  (tests/helpers.py)

VARIANTS = discover()


def modules(variant):
    return load(os.path.join(ROOT, variant, "model.py")), load(os.path.join(ROOT, variant, "train.py"))


# Every name main() and these tests use. A variant missing one fails test_exports, listing them all.
EXPORTS = {
    "model": (
        "COPIED_FROM",
        "ConfigError",
        "ModelConfig",
        "check",
        "weights",
        "init",
        "param_specs",
        "forward",
        "loss_fn",
        "num_params",
        "flops_per_token",
        "sharded_dims",
        "context_refusal",
        "cache_specs",
        "init_cache",
        "prefill",
        "decode_step",
    ),
    "train": (
        "TrainConfig",
        "CONTRACT_TINY",
        "make_mesh",
        "make_optimizer",
        "init_state",
        "make_train_step",
        "make_eval_step",
        "batch_spec",
        "to_device",
        "main",
    ),
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
    return {
        "tokens": jax.ShapeDtypeStruct(shape, jnp.int32, sharding=s),
        "targets": jax.ShapeDtypeStruct(shape, jnp.int32, sharding=s),
        "segment_ids": jax.ShapeDtypeStruct(shape, jnp.int32, sharding=s),
        "loss_mask": jax.ShapeDtypeStruct(shape, jnp.float32, sharding=s),
    }


@pytest.mark.parametrize("variant", VARIANTS)
def test_exports(variant):
    mods = dict(zip(("model", "train"), modules(variant)))
    missing = [f"{m}.{n}" for m, names in EXPORTS.items() for n in names if not hasattr(mods[m], n)]
    assert not missing, f"{variant} lacks {missing}"
    model, train = mods["model"], mods["train"]
    assert isinstance(train.CONTRACT_TINY, dict), f"{variant}: CONTRACT_TINY must be a dict of TrainConfig overrides"
    assert isinstance(train.batch_spec(1), P) and len(train.batch_spec(1)) == 3, (
        f"{variant}: batch_spec(1) must be the PartitionSpec of a [grad_accum, rows, T] array"
    )
    assert dataclasses.is_dataclass(model.ModelConfig), f"{variant}: ModelConfig is not a dataclass"
    assert model.ModelConfig.__dataclass_params__.frozen, f"{variant}: ModelConfig must be frozen"
    assert dataclasses.is_dataclass(train.TrainConfig), f"{variant}: TrainConfig is not a dataclass"


# Values every check should catch, by declared type: a field whose every candidate is accepted has no
# check. Wrong types are tried only for bools (any other field must check its range, not only its type).
BAD_VALUES = {
    int: (-1, 0, -(10**9), 10**18),
    float: (-1.0, float("nan"), float("inf"), 0.0, 1.5, 1e9),
    str: ("", "no-such-choice", "\0"),
    bool: ("yes", 2),
    dict: ({"no-such-name": -1.0}, {"no-such-name": float("nan")}, "not-a-mapping"),
}


def config_fields(cls, prefix=""):
    """(dataclass, field name, declared type, dotted name) of every leaf field, nested configs included."""
    for name, tp in typing.get_type_hints(cls).items():
        if dataclasses.is_dataclass(tp):
            yield from config_fields(tp, f"{prefix}{name}.")
        else:
            yield cls, name, tp, prefix + name


@pytest.mark.parametrize("variant", VARIANTS)
def test_every_config_field_rejects_a_bad_value(variant):
    """Each field of TrainConfig and of the configs inside it (ModelConfig, DataConfig, ...) refuses at
    least one of BAD_VALUES with an error naming it, when its config is built (so before anything
    compiles): a field nobody checks trains something wrong with exit 0."""
    _, train = modules(variant)
    unchecked, unnamed = [], []
    for cls, name, tp, dotted in config_fields(train.TrainConfig):
        caught = False
        for bad in BAD_VALUES.get(tp) or BAD_VALUES[typing.get_origin(tp) or tp]:
            try:
                cls(**{name: bad})
            except Exception as e:  # noqa: BLE001 - any refusal counts, if it names the field
                if name in str(e):
                    caught = True
                    break
                unnamed.append(f"{dotted}={bad!r}: {type(e).__name__}: {e}")
        if not caught:
            unchecked.append(dotted)
    assert not unchecked, f"{variant}: these fields accept every value of {BAD_VALUES}: {unchecked}"
    assert not unnamed, f"{variant}: refused without naming the field: {unnamed}"


def test_a_bad_flag_names_itself(tmp_path):
    """The command line's error for a value of the wrong type names the flag and the type expected."""
    import subprocess
    import sys

    cases = []
    for flags, expected in (
        (["--steps", "abc"], "--steps: couldn't parse 'abc' into an int"),
        (["--model.n_layers", "2.5"], "--model.n_layers: couldn't parse '2.5' into an int"),
        (["--resume", "maybe"], "--resume: couldn't parse 'maybe' into a bool"),
        (["--profile_steps", "5:6", "--steps", "3"], "profile_steps: must be A:B"),
        (["--step", "10"], "error: unknown flag --step; did you mean --steps? (--help lists"),
        (["--data.weights", "a=1"], "--data.weights: 'a=1' is not a mapping; give it as YAML"),
    ):
        cases.append(
            (
                flags,
                expected,
                subprocess.Popen(
                    [sys.executable, os.path.join(ROOT, "templates/base/train.py"), *flags],
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    text=True,
                    cwd=tmp_path,
                ),
            )
        )
    for flags, expected, p in cases:  # started together: each spends its time importing
        _, err = p.communicate(timeout=120)
        assert p.returncode != 0 and expected in err and "Traceback" not in err, (flags, err)


@pytest.mark.parametrize("variant", VARIANTS)
def test_a_context_axis_larger_than_the_devices_names_itself(variant):
    """A mesh axis the user set that does not divide the devices is named, not blamed on the data axis."""
    _, train = modules(variant)
    with pytest.raises(ConfigError, match=r"^mesh_context: mesh_.*= 8 devices does not divide the 4 devices"):
        train.make_mesh(train.TrainConfig(mesh_context=8, seq_len=4096), 4)


@pytest.mark.parametrize("variant", VARIANTS)
def test_help_lists_every_field(variant, capsys):
    """`train.py --help` (the README's first command) prints every field with its help and the presets.
    Field comments are free text: a `%` in one (`(i+1) % global_every`) once crashed argparse's help."""
    _, train = modules(variant)
    with pytest.raises(SystemExit) as e:
        cli.parse(train.TrainConfig, os.path.join(ROOT, variant), ["--help"])
    out = capsys.readouterr().out
    assert e.value.code in (0, None), f"{variant}: --help exited with {e.value.code}"
    missing = [dotted for _, _, _, dotted in config_fields(train.TrainConfig) if f"--{dotted} " not in out]
    assert not missing, f"{variant}: --help does not list {missing}"
    lines = out.splitlines() + [""]
    bare = [
        line
        for line, after in zip(lines, lines[1:])
        if re.fullmatch(r"  --[\w.]+ [\w\[\],]+\s*", line) and not after.startswith(" " * 20)
    ]
    assert not bare, f"{variant}: flags with no help and no default: {bare[:5]}"  # each shows at least its default
    assert "presets (--preset NAME" in out


def test_help_text_is_taken_literally():
    """A help text with `%`, `%(default)s`-like and `%d` pieces prints as written, not formatted."""
    import argparse

    p = argparse.ArgumentParser(formatter_class=cli.HelpFormatter)
    p.add_argument("--x", type=int, default=3, help="layer i is global iff (i+1) % every; 50%% %d %(prog)s")
    text = " ".join(p.format_help().split())
    assert "iff (i+1) % every; 50%% %d %(prog)s (default: 3)" in text, text


@pytest.mark.parametrize("variant", VARIANTS)
def test_lineage(variant):
    model, _ = modules(variant)
    parent = model.COPIED_FROM
    if variant == "templates/base":
        assert parent is None, "templates/base is the root and declares no parent"
        return
    assert isinstance(parent, str) and parent, f"{variant}: COPIED_FROM must name the folder it was copied from"
    assert parent != variant, f"{variant}: COPIED_FROM names itself"
    assert os.path.isfile(os.path.join(ROOT, parent, "model.py")), (
        f"{variant}: declared parent {parent!r} does not exist (no {parent}/model.py)"
    )


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
        assert jax.tree.structure(params) == jax.tree.structure(specs, is_leaf=lambda s: isinstance(s, P)), (
            f"{variant}: param_specs does not have the pytree structure of init"
        )
        for (path, x), spec in zip(
            jax.tree_util.tree_flatten_with_path(params)[0], jax.tree.leaves(specs, is_leaf=lambda s: isinstance(s, P))
        ):
            name = jax.tree_util.keystr(path)
            assert len(spec) == x.ndim, f"{variant}: spec {spec} for {name} has rank {len(spec)}, leaf has {x.ndim}"
            got = x.sharding.spec
            assert tuple(got) + (None,) * (x.ndim - len(got)) == tuple(spec), (
                f"{variant}: init places {name} as {got}, param_specs says {spec}"
            )


@pytest.mark.parametrize("variant", VARIANTS)
def test_every_weight_has_a_role(variant):
    """model.weights declares every leaf of init once (shared/weights.py), with a role; a matrix role has
    exactly two non-batch axes (fan_in, fan_out), an expert_matrix an expert axis besides, other roles none."""
    model, train = modules(variant)
    cfg = tiny(train)
    decl = model.weights(cfg.model)
    with jax.set_mesh(train.make_mesh(cfg)):
        params = jax.eval_shape(lambda k: model.init(cfg.model, k), jax.random.key(0))
    assert jax.tree.structure(params) == jax.tree.structure(decl, is_leaf=weights.is_weight), (
        f"{variant}: model.weights does not declare exactly the leaves of init"
    )
    for (path, x), w in zip(
        jax.tree_util.tree_flatten_with_path(params)[0], jax.tree.leaves(decl, is_leaf=weights.is_weight)
    ):
        name = jax.tree_util.keystr(path)
        assert isinstance(w, weights.Weight) and w.role in weights.ROLES, f"{variant}: {name} has no known role"
        assert tuple(w.shape) == x.shape, f"{variant}: {name} declared {w.shape}, init gives {x.shape}"
        fans = {a % x.ndim for a in (w.fan_in, w.fan_out) if a is not None}
        if w.role in weights.MATRIX_ROLES:
            assert len(fans) == 2 and x.ndim - len(w.batch_axes()) == 2, (
                f"{variant}: {name} ({w.role}) needs two fan axes"
            )
        else:
            assert not fans, f"{variant}: {name} ({w.role}) is not a matrix but declares fan axes"
        if w.role == "expert_matrix":
            assert w.batch_axes(), f"{variant}: {name} is an expert_matrix without an expert axis"


# XLA:CPU's LLVM optimisation level 0 for every program compiled here: about 2.5x faster to
# compile (kda's tiny train step: 30 s -> 12 s on 2 cores), the same numbers; these programs run
# for milliseconds, so their speed does not matter.
COMPILE = {"xla_backend_optimization_level": 0}


def _trace(train, cfg, n_devices):
    """Trace and lower one train step on an AbstractMesh of n_devices (nothing allocated or
    compiled; lowered for CUDA, as no device of that mesh exists here)."""
    opt, schedule = train.make_optimizer(cfg)
    mesh = train.make_mesh(cfg, n_devices)
    with jax.sharding.use_abstract_mesh(mesh):
        state = jax.eval_shape(lambda: train.init_state(cfg, opt, jax.random.key(0)))
        step = train.make_train_step(cfg, opt, schedule)
        batch = batch_spec(train, mesh, cfg)
        lowered = step.trace(state, batch).lower(lowering_platforms=("cuda",))
        out_state, metrics = lowered.out_info
        micro = jax.tree.map(
            lambda b: jax.ShapeDtypeStruct(b.shape[1:], b.dtype, sharding=NamedSharding(mesh, train.batch_spec(0))),
            batch,
        )
        est = memory.estimate(
            state, lambda p, b: train.model.loss_fn(p, b, cfg.model)[0], micro, grad_accum=cfg.grad_accum
        )
    assert jax.tree.structure(out_state) == jax.tree.structure(state)
    assert "train/loss" in metrics
    return est


# ids end in "<variant>]" like every other test here, so -k "<variant>]" selects them too
@pytest.mark.parametrize("variant,preset", PRESETS, ids=[f"{p}@{v}" for v, p in PRESETS])
def test_trace_preset_at_scale(variant, preset):
    """Every preset's train step traces at its own batch, sequence length and mesh, and its estimated
    memory per device (shared/runtime/memory.py) fits the device its header names (`# device: H100 80 GB`)."""
    _, train = modules(variant)
    path = cli.presets(os.path.join(ROOT, variant))[preset]
    cfg = draccus.parse(train.TrainConfig, config_path=path, args=[])
    n = at_scale_devices(cfg)
    try:
        est = _trace(train, cfg, n)
    except Exception as e:
        raise AssertionError(f"{variant}: preset {preset!r} does not trace on {n} devices: {e}") from e
    with open(path) as f:
        device = memory.device_capacity(f.read())
    assert device is not None, f"{path}: no '# device: <name> <n> GB' line naming the device it is written for"
    name, capacity = device
    print(f"\n{variant} {preset} on {n} devices, per device: {memory.report(est)} (device: {name})")
    assert memory.fits(est, capacity), (
        f"{path}: needs ~{est['total'] / 1e9:.1f} GB per device on {n} devices ({memory.report(est)}), more than "
        f"{1 - memory.HEADROOM:.0%} of the {name} it names: raise grad_accum, shard wider or use remat"
    )


STATED = re.compile(r"~(\d+(?:\.(\d+))?)([MB]) parameters")


@pytest.mark.parametrize("variant,preset", PRESETS, ids=[f"{p}@{v}" for v, p in PRESETS])
def test_preset_states_its_parameter_count(variant, preset):
    """A preset's first line says '~<n>M parameters' or '~<n>B parameters', and n is num_params
    rounded to the digits it states."""
    model, train = modules(variant)
    path = cli.presets(os.path.join(ROOT, variant))[preset]
    with open(path) as f:
        first = f.readline()
    m = STATED.search(first)
    assert m, f"{path}: the first line must state the parameter count as '~<n>M parameters' or '~<n>B parameters'"
    cfg = draccus.parse(train.TrainConfig, config_path=path, args=[])
    n = model.num_params(cfg.model) / (1e6 if m.group(3) == "M" else 1e9)
    digits = len(m.group(2) or "")
    assert round(n, digits) == float(m.group(1)), (
        f"{path} states ~{m.group(1)}{m.group(3)} parameters; num_params gives {n:.{digits + 2}f}{m.group(3)}"
    )


# ---------------------------------------------------------------- the tiny run
#
# Everything concrete runs once per folder, in one TinyRun: three compiled programs (init_state,
# the train step with grad_accum = 2, and a "model program" giving forward's logits and loss_fn's
# loss and metrics, without gradients), called on the inputs every check below needs.
# The checks are functions of a TinyRun, so the tests at the end of this file can run them on a
# deliberately broken copy of a variant and see them fail.

ROWS, T = 8, 32  # every input here: the tiny config's global batch
CUT = 13  # the packed rows' document boundary: document 1 is [0, CUT), document 2 [CUT, T)
LATER = 20  # causality: tokens (and targets) from here on change


def _model_program(model, cfg):
    def f(params, batch):
        loss, metrics = model.loss_fn(params, batch, cfg.model)
        logits = model.forward(params, batch["tokens"], cfg.model, segment_ids=batch["segment_ids"])
        return logits, loss, metrics

    return f


def _inputs(vocab):
    """Named host batches of [ROWS, T] arrays (tokens, targets, segment_ids, loss_mask)."""
    rng = np.random.default_rng(0)
    rand = lambda *shape: rng.integers(0, vocab, shape, dtype=np.int32)  # noqa: E731
    toks = rand(ROWS, T + 1)
    a = {"tokens": toks[:, :-1], "targets": toks[:, 1:]}
    one_doc = np.ones((ROWS, T), np.int32)
    packed = np.where(np.arange(T) < CUT, 1, 2).astype(np.int32)[None].repeat(ROWS, 0)
    full = np.ones((ROWS, T), np.float32)
    before = (np.arange(T) < LATER).astype(np.float32)[None].repeat(ROWS, 0)
    doc1, doc2 = (packed == 1).astype(np.float32), (packed == 2).astype(np.float32)

    def changed(batch, cols):  # new tokens and targets in columns `cols`
        out = {k: v.copy() for k, v in batch.items()}
        for k in ("tokens", "targets"):
            out[k][:, cols] = rand(ROWS, len(range(T)[cols]))
        return out

    def shifted(lo, hi):  # the tokens of [lo, hi) moved to the start of a row, zeros after
        out = {k: np.zeros_like(v) for k, v in a.items()}
        for k in a:
            out[k][:, : hi - lo] = a[k][:, lo:hi]
        return out

    alone_seg = lambda n: np.where(np.arange(T) < n, 1, 2).astype(np.int32)[None].repeat(ROWS, 0)  # noqa: E731
    # accumulation: rows 0-3 have a third of the loss tokens of rows 4-7 (see ACCUMULATION)
    uneven = full.copy()
    uneven[: ROWS // 2, ::3] = 0
    uneven[: ROWS // 2, 1::3] = 0
    uneven[: ROWS // 2 - 1] = np.roll(uneven[: ROWS // 2 - 1], 1, axis=1)
    b = lambda toks, seg, mask: {**toks, "segment_ids": seg, "loss_mask": mask}  # noqa: E731
    return {
        "causal_a": b(a, one_doc, before),
        "causal_b": b(changed(a, slice(LATER, None)), one_doc, before),
        "packed_mask1": b(a, packed, doc1),
        "packed_mask1_doc2_changed": b(changed(a, slice(CUT, None)), packed, doc1),
        "packed_mask2": b(a, packed, doc2),
        "packed_mask2_doc1_changed": b(changed(a, slice(0, CUT)), packed, doc2),
        "alone1": b(shifted(0, CUT), alone_seg(CUT), full),
        "alone2": b(shifted(CUT, T), alone_seg(T - CUT), full),
        "uneven": b(a, packed, uneven),
        # the same batch with the loss mask on rows 0-3 only, then on rows 4-7 only
        "uneven_first": b(a, packed, uneven * (np.arange(ROWS) < ROWS // 2)[:, None]),
        "uneven_second": b(a, packed, uneven * (np.arange(ROWS) >= ROWS // 2)[:, None]),
    }


# The train step's micro-batches, as rows of the "uneven" batch: once split 1:3 in loss tokens,
# once evenly. Token-weighted accumulation of exact terms gives the same step for any split; a
# term averaged over its own count (rows, all tokens, its own mask) is right only for the even one.
ACCUMULATION = {"uneven_split": [[0, 1, 2, 3], [4, 5, 6, 7]], "even_split": [[0, 1, 4, 5], [2, 3, 6, 7]]}


class TinyRun:
    """One folder's tiny config run for real on the 8 CPU devices; see the comment above. The model
    program and the train steps run when a check first asks for their results."""

    def __init__(self, folder):
        self.folder = folder
        self.model, self.train = modules(folder)
        self.cfg = cfg = tiny(self.train, grad_accum=2)
        assert cfg.batch_size == ROWS and cfg.seq_len == T, f"{folder}: CONTRACT_TINY must keep 8 rows of 32 tokens"
        self.opt, self.schedule = self.train.make_optimizer(cfg)
        self.mesh = self.train.make_mesh(cfg)
        self.key = jax.random.key(0)
        self.inputs = _inputs(cfg.model.vocab_size)
        with jax.set_mesh(self.mesh):
            self.init = jax.jit(lambda k: self.train.init_state(cfg, self.opt, k)).lower(self.key).compile(COMPILE)
            self.params_before = jax.tree.map(np.asarray, self.init(self.key)["params"])

    def put(self, x, lead):
        return jax.device_put(x, NamedSharding(self.mesh, self.train.batch_spec(lead)))

    @functools.cached_property
    def program(self):
        """The model program (_model_program), compiled for one batch of the inputs' shapes."""
        with jax.set_mesh(self.mesh):
            params = self.init(self.key)["params"]
            first = {k: self.put(v, 0) for k, v in self.inputs["causal_a"].items()}
            return jax.jit(_model_program(self.model, self.cfg)).lower(params, first).compile(COMPILE)

    @functools.cached_property
    def out(self) -> dict:
        """input name -> (logits, loss, metrics) of the model program, as numpy."""
        with jax.set_mesh(self.mesh):
            params = self.init(self.key)["params"]
            return {
                name: jax.tree.map(np.asarray, self.program(params, {k: self.put(v, 0) for k, v in batch.items()}))
                for name, batch in self.inputs.items()
            }

    @functools.cached_property
    def decoding(self) -> dict:
        """Greedy decoding with the cache (DECODE_LENGTHS, DECODE_STEPS): prefill, then one compiled decoding
        step at a time. Returns numpy: "logits" [DECODE_STEPS + 1, ROWS, V] (prefill's, then each step's),
        "tokens" [ROWS, T] (each row's prompt, its greedy tokens, then filler), "forward" (the model
        program's logits on those rows), "shardings" (where each cache leaf sits: after init, prefill, the
        last step), "specs" (cache_specs)."""
        model, cfg = self.model, self.cfg.model
        lengths = np.asarray(DECODE_LENGTHS, np.int32)
        longest = int(lengths.max())
        rng = np.random.default_rng(1)
        rows = rng.integers(0, cfg.vocab_size, (ROWS, T), dtype=np.int32)  # prompts, and filler after them
        prompts = rng.integers(0, cfg.vocab_size, (ROWS, longest), dtype=np.int32)  # random left padding
        for b, n in enumerate(lengths):
            prompts[b, longest - n :] = rows[b, :n]
        put = lambda x: self.put(x, 0) if x.ndim == 2 else self.put(x[:, None], 0)[:, 0]  # noqa: E731 rows as batches
        where = lambda c: jax.tree.map(lambda a: tuple(a.sharding.spec), c)  # noqa: E731
        with jax.set_mesh(self.mesh):
            params = self.init(self.key)["params"]
            cache = jax.jit(model.init_cache, static_argnums=(0, 1, 2))(cfg, ROWS, T)
            shardings = [where(cache)]
            prefill = jax.jit(lambda p, t, c, n: model.prefill(p, t, c, cfg, lengths=n))
            logits, cache = prefill.lower(params, put(prompts), cache, put(lengths)).compile(COMPILE)(
                params, put(prompts), cache, put(lengths)
            )
            shardings.append(where(cache))
            step, out = None, [np.asarray(logits)]
            for i in range(DECODE_STEPS):
                token = out[-1].argmax(-1).astype(np.int32)
                rows[np.arange(ROWS), lengths + i] = token
                if step is None:
                    step = (
                        jax.jit(lambda p, t, c: model.decode_step(p, t, c, cfg))
                        .lower(params, put(token), cache)
                        .compile(COMPILE)
                    )
                logits, cache = step(params, put(token), cache)
                out.append(np.asarray(logits))
            shardings.append(where(cache))
            batch = {
                "tokens": rows,
                "targets": np.zeros_like(rows),
                "segment_ids": np.ones_like(rows),
                "loss_mask": np.ones(rows.shape, np.float32),
            }
            forward = np.asarray(self.program(params, {k: self.put(v, 0) for k, v in batch.items()})[0])
        return {
            "logits": np.stack(out),
            "tokens": rows,
            "forward": forward,
            "shardings": shardings,
            "specs": model.cache_specs(cfg),
        }

    @functools.cached_property
    def metrics(self) -> dict:
        """The train step from the same initial state on each split of the uneven batch (ACCUMULATION),
        and a second step after the first split's ("second_step"); sets params_after and the structures."""
        out, step = {}, self.train.make_train_step(self.cfg, self.opt, self.schedule)
        with jax.set_mesh(self.mesh):
            for name, rows in ACCUMULATION.items():
                micro = {k: self.put(v[np.asarray(rows)], 1) for k, v in self.inputs["uneven"].items()}
                state = self.init(self.key)
                if name == "uneven_split":
                    self.state_structure = jax.tree.structure(state)
                    step = step.trace(state, micro).lower().compile(COMPILE)
                state, m = step(state, micro)
                out[name] = jax.tree.map(np.asarray, m)
                if name == "uneven_split":
                    state, m = step(state, micro)
                    out["second_step"] = jax.tree.map(np.asarray, m)
                    self.params_after = jax.tree.map(np.asarray, state["params"])
                    self.out_structure = jax.tree.structure(state)
        return out


@functools.cache
def tiny_run(folder) -> TinyRun:
    return TinyRun(folder)


def check_step(r: TinyRun):
    """Two real train steps: the first loss near ln(V), the second lower, every parameter moved."""
    loss, loss2 = float(r.metrics["uneven_split"]["train/loss"]), float(r.metrics["second_step"]["train/loss"])
    assert r.out_structure == r.state_structure, f"{r.folder}: the train step changes the state's pytree"
    assert np.isfinite(loss), f"{r.folder}: first loss is {loss}"
    assert abs(loss - np.log(r.cfg.model.vocab_size)) < 1.0, f"{r.folder}: initial loss {loss} far from ln(V)"
    assert loss2 < loss, f"{r.folder}: a second step on the same batch did not lower the loss ({loss} -> {loss2})"
    changed = jax.tree.map(lambda a, b: not np.array_equal(a, b), r.params_before, r.params_after)
    assert all(jax.tree.leaves(changed)), f"{r.folder}: some parameters did not change: {changed}"


def check_causality(r: TinyRun):
    """Tokens (and targets) from position LATER on never change forward's logits before LATER, nor
    the loss when the loss mask covers only positions before LATER: any auxiliary term in loss_fn
    (another head, a router loss) that looks ahead fails here."""
    (la, loss_a, *_), (lb, loss_b, *_) = r.out["causal_a"], r.out["causal_b"]
    np.testing.assert_array_equal(
        la[:, :LATER], lb[:, :LATER], err_msg=f"{r.folder}: later tokens leak into earlier logits (forward)"
    )
    assert not np.allclose(la[:, LATER:], lb[:, LATER:]), f"{r.folder}: logits ignore the tokens"
    assert loss_a == loss_b, (
        f"{r.folder}: loss_fn with the loss mask on positions < {LATER} changes when only "
        f"later tokens change ({loss_a!r} -> {loss_b!r}): a term of the loss looks ahead"
    )


def check_document_isolation(r: TinyRun):
    """A packed row gives each document the logits it gets alone (forward), and with the loss mask
    on one document only, the loss does not move when the other document's tokens change."""
    packed, alone1, alone2 = (r.out[k][0] for k in ("packed_mask1", "alone1", "alone2"))
    np.testing.assert_allclose(
        packed[:, :CUT],
        alone1[:, :CUT],
        rtol=1e-5,
        atol=1e-5,
        err_msg=f"{r.folder}: document 1 sees document 2 (forward)",
    )
    np.testing.assert_allclose(
        packed[:, CUT:],
        alone2[:, : T - CUT],
        rtol=1e-5,
        atol=1e-5,
        err_msg=f"{r.folder}: document 2 sees document 1 (forward)",
    )
    for mine, other in ((1, 2), (2, 1)):
        a = r.out[f"packed_mask{mine}"][1]
        b = r.out[f"packed_mask{mine}_doc{other}_changed"][1]
        np.testing.assert_allclose(
            a,
            b,
            rtol=1e-6,
            atol=0,
            err_msg=(
                f"{r.folder}: loss_fn with the loss mask on document {mine} only changes when document {other}'s "
                f"tokens change: a term of the loss crosses documents"
            ),
        )


def check_loss_accumulation(r: TinyRun):
    """loss_fn on a batch equals the token-weighted mean of loss_fn on its two halves (the loss mask
    on rows 0-3 only, then on rows 4-7 only, 1:3 in loss tokens): true when every term of the loss
    is a sum over the loss tokens divided by their count, which is what makes train.py's
    token-weighted gradient accumulation exact. A term averaged over its own count (all tokens,
    rows, its own mask) fails."""
    whole, first, second = (r.out[k] for k in ("uneven", "uneven_first", "uneven_second"))
    n1, n2 = float(first[2]["tokens"]), float(second[2]["tokens"])
    weighted = (n1 * float(first[1]) + n2 * float(second[1])) / (n1 + n2)
    np.testing.assert_allclose(
        float(whole[1]),
        weighted,
        rtol=1e-5,
        err_msg=(
            f"{r.folder}: loss_fn on a batch is not the token-weighted mean of loss_fn on its parts, so gradient "
            "accumulation is inexact; every term of loss_fn must be a sum over the batch's loss tokens divided "
            "by their count (AGENTS.md, 'Auxiliary losses')"
        ),
    )


def check_step_accumulation(r: TinyRun):
    """The train step with grad_accum = 2 gives the same loss and gradient norm whether the global
    batch's rows are split 1:3 or evenly in loss tokens (ACCUMULATION), and the loss of loss_fn on
    the whole batch at once."""
    uneven, even = r.metrics["uneven_split"], r.metrics["even_split"]
    np.testing.assert_allclose(
        uneven["optim/grad_norm"],
        even["optim/grad_norm"],
        rtol=2e-5,
        err_msg=(
            f"{r.folder}: the gradient accumulated over 2 micro-batches depends on how the rows are split; every "
            "term of loss_fn must be a sum over the batch's loss tokens divided by their count (AGENTS.md, "
            "'Auxiliary losses')"
        ),
    )
    whole = r.out["uneven"][2]
    for name, m in (("split 1:3", uneven), ("even split", even)):
        np.testing.assert_allclose(
            m["train/loss"],
            whole["loss"],
            rtol=2e-6,
            err_msg=(
                f"{r.folder}: the loss accumulated over 2 micro-batches ({name}) differs from loss_fn's on the whole batch"
            ),
        )


@pytest.mark.parametrize("variant", VARIANTS)
def test_step(variant):
    check_step(tiny_run(variant))


@pytest.mark.parametrize("variant", VARIANTS)
def test_causality(variant):
    check_causality(tiny_run(variant))


@pytest.mark.parametrize("variant", VARIANTS)
def test_document_isolation(variant):
    check_document_isolation(tiny_run(variant))


@pytest.mark.parametrize("variant", VARIANTS)
def test_accumulation_is_exact(variant):
    r = tiny_run(variant)
    check_loss_accumulation(r)
    check_step_accumulation(r)


@pytest.mark.parametrize("variant", [v for v in VARIANTS if v != "templates/base"])
def test_shared_weights_start_as_the_parents(variant):
    """At the same seed, every weight a variant shares with its declared parent (same path, same
    shape) starts from the same values, so a variant and its parent can be compared from identical
    starting weights (init derives each weight's key from its name)."""
    mine, parents = tiny_run(variant), tiny_run(modules(variant)[0].COPIED_FROM)
    flat = lambda r: {jax.tree_util.keystr(p): x for p, x in jax.tree_util.tree_flatten_with_path(r.params_before)[0]}  # noqa: E731
    a, b = flat(mine), flat(parents)
    shared = [k for k in a if k in b and a[k].shape == b[k].shape]
    assert "['embed']" in shared, f"{variant}: shares no embedding with its parent at the tiny config"
    differ = [k for k in shared if not np.array_equal(a[k], b[k])]
    assert not differ, f"{variant}: weights shared with its parent start from other values: {differ}"


# Decoding: one prompt a row, of these lengths (left-padded to the longest), then DECODE_STEPS greedy tokens;
# they cross swa_hybrid's and moe_hero's 16-token window and kda's 8-token chunks (CONTRACT_TINY).
DECODE_LENGTHS = (1, 5, 17, 20, 3, 20, 9, 12)
DECODE_STEPS = 6
CACHE_API = ("cache_specs", "init_cache", "prefill", "decode_step")


def check_decoding(r: TinyRun):
    """Decoding with the cache is `forward`: the logits prefill gives for each row's next token, and those of
    every decoding step, equal forward's at that position on the whole sequence (prompt + the tokens decoded
    so far) within fp32 tolerance, and each greedy token is forward's argmax there; prompts of mixed lengths
    in one batch; every cache leaf stays where cache_specs puts it (rows over the batch's axes)."""
    missing = [n for n in CACHE_API if not hasattr(r.model, n)]
    assert not missing, (
        f"{r.folder}: model.py cannot decode with a cache (it lacks {', '.join(missing)}). Add, as "
        "templates/base/model.py does under 'decoding with a cache' and adapted to this model's layers: "
        "cache_specs(cfg) (a PartitionSpec per cache leaf), init_cache(cfg, batch, max_len) (an empty cache), "
        "prefill(params, tokens, cache, cfg, *, lengths=None) -> (logits [B, V], cache) for left-padded "
        "prompts, and decode_step(params, token, cache, cfg) -> (logits [B, V], cache) for one token a row"
    )
    d = r.decoding
    lengths = np.asarray(DECODE_LENGTHS)
    for i, logits in enumerate(d["logits"]):
        want = d["forward"][np.arange(ROWS), lengths - 1 + i]  # the position whose next token step i predicts
        what = "prefill" if i == 0 else f"decoding step {i}"
        np.testing.assert_allclose(
            logits,
            want,
            rtol=1e-4,
            atol=1e-4,
            err_msg=(
                f"{r.folder}: the logits of {what} differ from forward's at the same position (prompt lengths "
                f"{DECODE_LENGTHS})"
            ),
        )
        if i < DECODE_STEPS:
            token = d["tokens"][np.arange(ROWS), lengths + i]
            top2 = np.sort(want, axis=-1)[:, -2:]
            tie = top2[:, 1] - top2[:, 0] < 1e-4  # forward's own top two within tolerance: either may win
            wrong = (token != want.argmax(-1)) & ~tie
            assert not wrong.any(), (
                f"{r.folder}: greedy token {i} of rows {np.flatnonzero(wrong)} is not forward's argmax"
            )
    norm = lambda spec, n: tuple(spec) + (None,) * (n - len(spec))  # noqa: E731
    specs = jax.tree.leaves(d["specs"], is_leaf=lambda s: isinstance(s, P))
    for when, where in zip(("init_cache", "prefill", "decode_step"), d["shardings"]):
        got = jax.tree.leaves(where, is_leaf=lambda s: isinstance(s, tuple))
        assert len(got) == len(specs), f"{r.folder}: cache_specs does not match the cache's pytree after {when}"
        for g, spec in zip(got, specs):
            assert norm(g, len(spec)) == tuple(spec), (
                f"{r.folder}: after {when} a cache leaf sits at {g}, cache_specs says {spec}"
            )


@pytest.mark.parametrize("variant", VARIANTS)
def test_decoding_with_the_cache_is_forward(variant):
    check_decoding(tiny_run(variant))
    check_a_cache_sharded_otherwise_is_named(tiny_run(variant))


def check_a_cache_sharded_otherwise_is_named(r: TinyRun):
    """A hand-built cache whose first array leaf is not where cache_specs puts it (here: whole on every device)
    is refused by prefill and decode_step naming the leaf and the spec expected (kernels.check_specs), not
    by XLA deep inside an update ("All operands should have the same sharding")."""
    cfg = r.cfg.model
    with jax.set_mesh(r.mesh):
        cache = jax.eval_shape(lambda: r.model.init_cache(cfg, ROWS, T))
        leaves, tree = jax.tree_util.tree_flatten_with_path(cache)
        path = next(p for p, leaf in leaves if leaf.ndim >= 2)
        bad = jax.tree_util.tree_unflatten(
            tree,
            [
                jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=NamedSharding(r.mesh, P())) if p == path else leaf
                for p, leaf in leaves
            ],
        )
        params = r.init(r.key)["params"]
        for fn, call in (
            ("prefill", lambda p, c: r.model.prefill(p, jnp.zeros((ROWS, 4), jnp.int32), c, cfg)),
            ("decode_step", lambda p, c: r.model.decode_step(p, jnp.zeros((ROWS,), jnp.int32), c, cfg)),
        ):
            with pytest.raises(kernels.KernelError, match=rf"^{fn}: cache\[.*\] is sharded P\(None.*, expected P\("):
                jax.eval_shape(call, params, bad)


def test_a_folder_without_a_cache_is_told_what_to_add():
    import types

    r = types.SimpleNamespace(folder="variants/nocache", model=types.ModuleType("model"))
    with pytest.raises(
        AssertionError,
        match=r"lacks cache_specs, init_cache, prefill, decode_step\)\. Add, as "
        r"templates/base/model\.py does",
    ):
        check_decoding(r)


# Context parallelism: each row split over CONTEXT devices on the `context` axis gives the logits, loss and
# gradients of the whole row (fp32 tolerance), for packed rows whose documents cross the shard boundaries
# (row 0: inside both halves, row 1: a document starting exactly at token 16, a boundary of 2 and 4 shards,
# others at 8 and 24, boundaries of 4 shards).
CONTEXT_DOCS = [[0, 5, 14, 27], [0, 8, 16, 24], [0, 3], [0, 17], [0], [0, 30], [0, 11, 12, 13], [0, 31]]


def _context_batch(vocab):
    rng = np.random.default_rng(1)
    toks = rng.integers(0, vocab, (ROWS, T + 1), dtype=np.int32)
    seg = np.zeros((ROWS, T), np.int32)
    for i, starts in enumerate(CONTEXT_DOCS):
        seg[i] = np.searchsorted(starts, np.arange(T), side="right")
    mask = np.ones((ROWS, T), np.float32)
    mask[3, 20:] = 0
    return {"tokens": toks[:, :-1], "targets": toks[:, 1:], "segment_ids": seg, "loss_mask": mask}


def context_config(r: TinyRun, context: int):
    """r's tiny config with `context` devices on the context axis (model axis 1 at 4); a window longer
    than a shard (swa_hybrid, moe_hero at 4: 16 > 8 + 1) is shortened to the longest one allowed."""
    over = dict(mesh_context=context, **({"mesh_model": 1} if context > 2 else {}))
    model_cfg = r.cfg.model
    if hasattr(model_cfg, "window") and model_cfg.window - 1 > T // context:
        model_cfg = dataclasses.replace(model_cfg, window=T // context + 1)
    return dataclasses.replace(r.cfg, model=model_cfg, **over), model_cfg


def context_outputs(r: TinyRun, cfg) -> tuple:
    """(logits, loss, gradients) as numpy for the context batch, at config `cfg` on its own mesh."""
    mesh = r.train.make_mesh(cfg)
    with jax.set_mesh(mesh):
        params = jax.jit(lambda k: r.train.init_state(cfg, r.train.make_optimizer(cfg)[0], k))(r.key)["params"]
        batch = {
            k: jax.device_put(v, NamedSharding(mesh, r.train.batch_spec(0)))
            for k, v in _context_batch(cfg.model.vocab_size).items()
        }

        def f(params, batch):
            (loss, _), grads = jax.value_and_grad(lambda p: r.model.loss_fn(p, batch, cfg.model), has_aux=True)(params)
            return r.model.forward(params, batch["tokens"], cfg.model, segment_ids=batch["segment_ids"]), loss, grads

        return jax.tree.map(np.asarray, jax.jit(f).lower(params, batch).compile(COMPILE)(params, batch))


def check_context_parallel(r: TinyRun, context: int):
    cfg, model_cfg = context_config(r, context)
    whole = context_outputs(r, dataclasses.replace(r.cfg, model=model_cfg))
    split = context_outputs(r, cfg)
    for what, a, b in (("logits", split[0], whole[0]), ("loss", split[1], whole[1])):
        np.testing.assert_allclose(
            a,
            b,
            rtol=2e-5,
            atol=2e-5,
            err_msg=(
                f"{r.folder}: the {what} with each row split over mesh_context={context} differ from the whole row's"
            ),
        )
    for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(split[2])[0], jax.tree.leaves(whole[2])):
        np.testing.assert_allclose(
            a,
            b,
            rtol=1e-4,
            atol=1e-6,
            err_msg=(
                f"{r.folder}: the gradient of {jax.tree_util.keystr(path)} with mesh_context={context} differs "
                f"from the whole row's"
            ),
        )


LONG_CONTEXT = pytest.mark.integration(reason="a long compile: the model's gradients at two more meshes")


@pytest.mark.parametrize(
    "context,variant",
    [
        pytest.param(c, v, marks=LONG_CONTEXT) if c == 4 or "context" not in fast_tier(v) else (c, v)
        for v in VARIANTS
        for c in (2, 4)
    ],
)  # ids end in the folder
def test_context_parallel_is_exact(variant, context):
    """Context 2 in the fast tier for the folders whose train.py keeps "context" in FAST_TIER
    (tests/helpers.fast_tier; the mixers kda and moe_hero split are checked there on their own,
    tests/contract/test_context.py); every folder at 2 and 4 in the integration tier."""
    check_context_parallel(tiny_run(variant), context)


def _with_attention_backend(cfg, name):
    """(cfg with attention backend `name`, the layer kinds it runs on): every attention layer, or where a
    variant has sliding-window layers and its config refuses `name` for them, the global layers only
    (the local ones on `auto`). (None, []) if the config refuses `name` altogether."""
    if not hasattr(cfg.model, "local_attention_backend"):
        tries = [({"attention_backend": name}, ["attention"])]
    else:
        tries = [
            ({"attention_backend": name, "local_attention_backend": name}, ["global", "local"]),
            ({"attention_backend": name, "local_attention_backend": "auto"}, ["global"]),
        ]
    for fields, layers in tries:
        try:
            return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, **fields)), layers
        except ValueError:
            continue
    return None, []


def _autos_attention_backends(r: TinyRun) -> set:
    """The attention backends `auto` runs in r's model program (r.out): the program traced, not compiled,
    with the process's record of kernel choices emptied meanwhile."""
    dispatch = importlib.import_module("shared.kernels.dispatch")
    saved = dispatch._choices, dispatch._logged
    dispatch._choices, dispatch._logged = {}, set()
    try:
        with jax.set_mesh(r.mesh):
            batch = {k: r.put(v, 0) for k, v in r.inputs["packed_mask1"].items()}
            jax.jit(_model_program(r.model, r.cfg)).trace(r.init(r.key)["params"], batch)
        return set(dispatch._choices.get("attention", {}))
    finally:
        dispatch._choices, dispatch._logged = saved


def compare_attention_backends(r: TinyRun, names) -> tuple[dict, dict]:
    """Run the model program with each attention backend in `names` named explicitly and check its
    logits and loss against `auto`'s (r.out). Returns ({layer kind: [backends compared on it]},
    {backend: why} for those refused). Layer kinds: "attention" (every attention layer of a variant
    with one kind), or "global" and "local" (a variant with sliding-window layers). A backend that
    `auto` itself runs on every attention layer is auto's program: listed as "NAME (auto's choice)",
    not run again."""
    compared, refused = {}, {}
    autos = _autos_attention_backends(r)
    for name in names:
        cfg, layers = _with_attention_backend(r.cfg, name)
        if cfg is None:
            refused[name] = "refused by the config"
            continue
        if autos == {name}:
            for kind in layers:
                compared.setdefault(kind, []).append(f"{name} (auto's choice)")
            continue
        with jax.set_mesh(r.mesh):
            params = r.init(r.key)["params"]
            batch = {k: r.put(v, 0) for k, v in r.inputs["packed_mask1"].items()}
            try:
                logits, loss, _ = jax.jit(_model_program(r.model, cfg))(params, batch)
            except kernels.KernelError as e:
                refused[name] = str(e)
                continue
        want_logits, want_loss, _ = r.out["packed_mask1"]
        tol = 2e-2 if cfg.model.compute_dtype == "bfloat16" else 1e-5
        np.testing.assert_allclose(float(loss), want_loss, rtol=tol, err_msg=f"{r.folder}: attention backend {name}")
        np.testing.assert_allclose(
            np.asarray(logits), want_logits, rtol=tol, atol=tol, err_msg=f"{r.folder}: attention backend {name}"
        )
        for kind in layers:
            compared.setdefault(kind, []).append(name)
    return compared, refused


@pytest.mark.parametrize("variant", VARIANTS)
def test_every_attention_backend_gives_autos_loss(variant):
    """The model program with each attention backend available here, named explicitly (on every
    layer, or on the global layers where the config refuses it for the local ones), gives the logits
    and loss of `auto`'s choice; a backend that refuses the tiny config's calls is passed over with
    its reason. On CPU: blocked and the reference (auto takes the reference at the tiny T = 32, so
    blocked is what runs)."""
    names = kernels.available_backends("attention")
    if names == ["reference"]:
        pytest.skip("only the reference attention runs here, and auto picks it: nothing to compare")
    compared, refused = compare_attention_backends(tiny_run(variant), names)
    assert compared, f"{variant}: no attention backend ran ({refused})"
    if "blocked" in names:  # it has every mask, sliding windows included: it runs on every kind of layer
        assert all(any(n.startswith("blocked") for n in ran) for ran in compared.values()), (variant, compared)
    print(
        f"{variant}: "
        + "; ".join(f"{kind} layers compared {sorted(b)}" for kind, b in compared.items())
        + f"; refused {refused}"
    )


def test_backend_comparison_catches_a_wrong_backend(monkeypatch):
    """Two test-only CPU attention backends: the reference's math passes, 0.1% off fails."""
    A = importlib.import_module("shared.kernels.attention")  # the module (kernels.attention is the function)

    def backend(name, factor):
        return A.Backend(
            name,
            lambda: None,
            lambda c: None,
            lambda q, k, v, **kw: A.reference(q, k, v, **kw) * factor,
            lambda c: "test-only: never picked by auto",
        )

    registry = {"right": backend("right", 1.0), "wrong": backend("wrong", 1.001), **A.BACKENDS}
    monkeypatch.setattr(A, "BACKENDS", registry)
    monkeypatch.setitem(kernels.REGISTRIES, "attention", registry)
    r = tiny_run("variants/dense")
    assert compare_attention_backends(r, ["right"]) == ({"attention": ["right"]}, {})
    with pytest.raises(AssertionError, match="attention backend wrong"):
        compare_attention_backends(r, ["wrong"])


def test_backend_comparison_names_the_layers_each_backend_ran_on(monkeypatch):
    """swa_hybrid: a backend without sliding windows is compared on the global layers only, and the
    report says so (test_every_attention_backend_gives_autos_loss checks that blocked, which has
    windows, is compared on both kinds)."""
    A = importlib.import_module("shared.kernels.attention")
    no_windows = lambda c: "no sliding window" if c.window is not None else None  # noqa: E731
    registry = {
        "global_only": A.Backend(
            "global_only",
            lambda: None,
            no_windows,
            lambda q, k, v, **kw: A.reference(q, k, v, **kw),
            lambda c: "test-only",
        ),
        **A.BACKENDS,
    }
    monkeypatch.setattr(A, "BACKENDS", registry)
    monkeypatch.setitem(kernels.REGISTRIES, "attention", registry)
    compared, refused = compare_attention_backends(tiny_run("variants/swa_hybrid"), ["global_only"])
    assert compared == {"global": ["global_only"]} and refused == {}, (compared, refused)


# ---------------------------------------------------------------- the contract catches what it should
#
# Copies of variants/dense whose loss_fn adds one broken auxiliary term (the forward pass is
# untouched, so only the checks through the loss can see it). Each must fail its check.

BROKEN = {
    # a head that reads the next position's hidden state: causal in forward, not in the loss
    "looks_ahead": (
        "check_causality",
        """
    aux = jnp.sum(batch["loss_mask"][:, :-1] * jnp.sum(h[:, 1:] * h[:, :-1], -1)) / n""",
    ),
    # a causal running mean over the whole row, blind to document boundaries
    "crosses_documents": (
        "check_document_isolation",
        """
    run = jnp.cumsum(h, axis=1) / jnp.arange(1, h.shape[1] + 1)[None, :, None]
    aux = jnp.sum(batch["loss_mask"] * jnp.sum(run * h, -1)) / n""",
    ),
    # exact under masks and documents, but averaged per row instead of over the loss tokens
    "normalised_per_row": (
        "check_loss_accumulation",
        """
    aux = jnp.sum(batch["loss_mask"] * jnp.sum(h * h, -1)) / batch["tokens"].shape[0]""",
    ),
}


def broken_copy(tmp_path, kind):
    folder = tmp_path / f"dense_{kind}"
    for name in ("model.py", "train.py"):
        folder.mkdir(exist_ok=True)
        (folder / name).write_text(open(os.path.join(ROOT, "variants/dense", name)).read())
    with open(folder / "model.py", "a") as f:
        f.write(f"""

_loss_without_aux = loss_fn


def loss_fn(params, batch, cfg: ModelConfig):
    loss, metrics = _loss_without_aux(params, batch, cfg)
    h = hidden_states(params, batch["tokens"], cfg, segment_ids=batch["segment_ids"]).astype(jnp.float32)
    n = jnp.maximum(jnp.sum(batch["loss_mask"]), 1.0){BROKEN[kind][1]}
    return loss + 10.0 * aux, metrics
""")
    return str(folder)


@pytest.mark.integration  # a long run: a tiny run of a deliberately broken copy of dense for each kind
@pytest.mark.parametrize("kind", BROKEN)
def test_contract_catches_a_broken_auxiliary_loss(kind, tmp_path):
    check = globals()[BROKEN[kind][0]]
    r = TinyRun(broken_copy(tmp_path, kind))
    with pytest.raises(AssertionError, match="a term of the loss|every term of loss_fn"):
        check(r)


@pytest.mark.parametrize("variant", VARIANTS)
def test_config_json_is_a_config_path(variant, tmp_path):
    """What a run writes as config.json (run.settings) parses back as --config_path into the same config, for
    every folder's fields (a resume starts from it: shared/cli.py)."""
    import json

    from shared import run

    _, train = modules(variant)
    cfg = train.TrainConfig(lr=1e-3, steps=7, run_dir=str(tmp_path / "r"), wandb="disabled")
    path = tmp_path / "config.json"
    path.write_text(json.dumps(run.settings(cfg), default=str))
    again = cli.parse(train.TrainConfig, os.path.join(ROOT, variant), ["--config_path", str(path)])
    assert run.settings(again) == run.settings(cfg)
