"""The dense train loop as a user relies on it: exact resume, restore on other device
counts, gradient accumulation, early config errors, clear data errors, NaN handling, the
kernels a run used in its run.json, and a default warmup that fits any run length."""

import dataclasses
import functools
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from shared import data, flops, run
from shared.storage import checkpoint
from shared.variant import ROOT, load

from helpers import arrays, wrap_step  # noqa: E402  (tests/helpers.py)

train = load(os.path.join(ROOT, "variants", "dense", "train.py"))  # the one tiny_dense (conftest) runs
model = train.model
SCRIPT = os.path.join(ROOT, "variants", "dense", "train.py")


def test_resume_is_bit_exact(tiny_dense, tmp_path):
    straight = train.main(tiny_dense.config(tmp_path / "a"))
    first = train.main(tiny_dense.config(tmp_path / "b", stop_at=3))
    assert sorted(first["losses"]) == [1, 2, 3]
    resumed = train.main(tiny_dense.config(tmp_path / "b", resume=True))
    assert sorted(resumed["losses"]) == [4, 5, 6]
    assert {**first["losses"], **resumed["losses"]} == straight["losses"]  # exact floats, same data order
    for a, b in zip(arrays(straight["state"]), arrays(resumed["state"])):
        np.testing.assert_array_equal(a, b)
    meta_a = checkpoint.read_metadata(checkpoint.latest(str(tmp_path / "a" / "checkpoints")))
    meta_b = checkpoint.read_metadata(checkpoint.latest(str(tmp_path / "b" / "checkpoints")))
    assert meta_a["loader"] == meta_b["loader"] and meta_a["step"] == meta_b["step"] == 6


def test_fresh_run_refuses_to_overwrite_checkpoints(tiny_dense, tmp_path):
    train.main(tiny_dense.config(tmp_path, steps=2, save_every=0))
    with pytest.raises(run.TrainingError, match="--resume"):
        train.main(tiny_dense.config(tmp_path, steps=2, save_every=0))
    with pytest.raises(run.TrainingError, match="model config differs"):
        train.main(
            tiny_dense.config(
                tmp_path,
                steps=4,
                save_every=0,
                resume=True,
                model=model.ModelConfig(
                    vocab_size=512, d_model=64, n_layers=3, n_heads=4, n_kv_heads=2, head_dim=16, d_ff=128
                ),
            )
        )
    # another optimizer, or the weight average turned on: a clear refusal, not a leaf mismatch
    with pytest.raises(
        run.TrainingError,
        match=r"holds the state of --optimizer adamw, and this run asks for "
        r"--optimizer muon.*resume with --optimizer adamw",
    ):
        train.main(tiny_dense.config(tmp_path, steps=4, save_every=0, resume=True, optimizer="muon"))
    with pytest.raises(run.TrainingError, match=r"saved with --optim.ema 0.0 and this run asks for --optim.ema 0.9"):
        train.main(
            tiny_dense.config(
                tmp_path,
                steps=4,
                save_every=0,
                resume=True,
                optim=dataclasses.replace(train.TrainConfig().optim, ema=0.9),
            )
        )


def _batch(cfg, mesh, accum):
    corpus = data.load_corpus(cfg.data, cfg.model.vocab_size, progress=False)
    rows = data.Loader(corpus.train, cfg.seq_len, cfg.batch_size, 0).next()
    return train.to_device(rows, mesh, (accum,))


def test_grad_accumulation_equals_large_batch(tiny_dense, tmp_path):
    cfg1 = tiny_dense.config(tmp_path, batch_size=16)
    cfg4 = tiny_dense.config(tmp_path, batch_size=16, grad_accum=2)
    mesh = train.make_mesh(cfg1)
    opt, schedule = train.make_optimizer(cfg1)
    with jax.set_mesh(mesh):
        init = jax.jit(lambda k: train.init_state(cfg1, opt, k))
        s1, m1 = train.make_train_step(cfg1, opt, schedule)(init(jax.random.key(0)), _batch(cfg1, mesh, 1))
        s4, m4 = train.make_train_step(cfg4, opt, schedule)(init(jax.random.key(0)), _batch(cfg4, mesh, 2))
    np.testing.assert_allclose(float(m1["train/loss"]), float(m4["train/loss"]), rtol=1e-6)
    np.testing.assert_allclose(float(m1["optim/grad_norm"]), float(m4["optim/grad_norm"]), rtol=1e-5)
    for a, b in zip(arrays(s1["params"]), arrays(s4["params"])):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)


def test_impossible_configs_fail_before_compiling(tiny_dense, tmp_path, monkeypatch):
    with pytest.raises(ValueError, match="grad_accum"):
        tiny_dense.config(tmp_path, batch_size=6, grad_accum=4)
    with pytest.raises(ValueError, match="n_heads"):
        model.ModelConfig(n_heads=6, n_kv_heads=4)
    with pytest.raises(ValueError, match="compute_dtype"):
        model.ModelConfig(compute_dtype="float16")
    monkeypatch.setattr(train, "make_train_step", lambda *a: pytest.fail("compiled before validating"))
    with pytest.raises(ValueError, match="batch_size.*divisible by the data axis"):
        train.main(tiny_dense.config(tmp_path, batch_size=4))  # 8 devices on `data`
    with pytest.raises(ValueError, match="mesh_data"):
        train.main(tiny_dense.config(tmp_path, mesh_data=3))
    with pytest.raises(ValueError, match="n_kv_heads"):
        train.main(tiny_dense.config(tmp_path, mesh_data=2, mesh_model=4))


def test_warmup_default_fits_any_run_length():
    """warmup_steps = -1 (the default) is min(20, steps // 10): below `steps` however short the run."""
    for steps, want in ((1, 0), (5, 0), (19, 1), (50, 5), (220, 20), (10_000, 20)):
        assert train.warmup(train.TrainConfig(steps=steps)) == want, steps
    assert train.warmup(train.TrainConfig(steps=5, warmup_steps=4)) == 4
    for steps, warmup in ((5, 5), (5, -2)):
        with pytest.raises(model.ConfigError, match="warmup_steps"):
            train.TrainConfig(steps=steps, warmup_steps=warmup)


def test_run_json_records_the_kernels_the_step_used(tiny_dense, tmp_path, capsys):
    """Which backend each kernel op took (chosen while the first step compiled) is in the run's run.json; so is
    the peak MFU is against, which the log names once at the start (not on every line)."""
    train.main(tiny_dense.config(tmp_path, steps=2, save_every=0, eval_every=2))
    out = capsys.readouterr().out
    with open(tmp_path / "run.json") as f:
        recorded = json.load(f)
    with open(tmp_path / "config.json") as f:
        assert not {"peak", "kernels"} & set(json.load(f)), "config.json holds the settings only (a --config_path)"
    peak, src = flops.device_peak()
    assert recorded["peak"] == {"per_device": peak, "source": src} and "fp32 matmul measured at start" in src
    assert [line for line in out.splitlines() if "GFLOP/s" in line] == [
        f"MFU is against {peak / 1e9:,.1f} GFLOP/s per device: {src}"
    ]  # once, not on every step's line
    used = recorded["kernels"]
    assert {"attention", "cross_entropy", "rms_norm"} <= set(used), used
    assert "q(8, 32, 4, 16) window=None" in used["attention"]["reference"], used  # CPU: the reference


def test_missing_or_empty_data_path(tmp_path):
    cfg = train.TrainConfig(
        data=data.DataConfig(source=str(tmp_path / "nowhere" / "*.jsonl")),
        run_dir=str(tmp_path / "run"),
        wandb="disabled",
    )
    with pytest.raises(data.DataError, match="nowhere"):
        train.main(cfg)
    (tmp_path / "empty.txt").write_text("")
    cfg = train.TrainConfig(
        data=data.DataConfig(source=str(tmp_path / "empty.txt")), run_dir=str(tmp_path / "run2"), wandb="disabled"
    )
    with pytest.raises(data.DataError, match="empty"):
        train.main(cfg)


def test_a_refused_run_leaves_nothing_on_disk(tiny_dense, tmp_path, monkeypatch):
    """Every refusal comes before anything is written: no empty run directory, no LOCK left behind."""
    monkeypatch.chdir(tmp_path)  # the default run directory, runs/dense-<time>, would be made here
    nowhere = data.DataConfig(source=str(tmp_path / "nowhere" / "*.txt"))
    for run_dir in ("", str(tmp_path / "r1")):
        with pytest.raises(data.DataError, match="nowhere"):
            train.main(tiny_dense.config(run_dir, data=nowhere))
    with pytest.raises(checkpoint.CheckpointError, match="no checkpoint .*step_00000007"):
        train.main(tiny_dense.config(tmp_path / "r2", resume_from="7"))
    with pytest.raises(run.TrainingError, match="no complete checkpoint"):
        train.main(tiny_dense.config(tmp_path / "r3", resume=True))
    assert sorted(os.listdir(tmp_path)) == []
    # a run that exists: a refused resume adds nothing to it (no lock, no rows, no config)
    train.main(tiny_dense.config(tmp_path / "r4", steps=2, save_every=0, eval_every=0))
    before = sorted(os.listdir(tmp_path / "r4"))
    with pytest.raises(checkpoint.CheckpointError, match="no checkpoint"):
        train.main(tiny_dense.config(tmp_path / "r4", steps=4, resume_from="1"))
    with pytest.raises(data.DataError, match="nowhere"):
        train.main(tiny_dense.config(tmp_path / "r4", steps=4, resume=True, data=nowhere))
    assert sorted(os.listdir(tmp_path / "r4")) == before and "LOCK" not in before


def test_branching_back_moves_the_abandoned_future_aside(tiny_dense, tmp_path, capsys):
    """--resume_from an earlier step of the same run directory: the later checkpoints and their metric rows
    go into a named folder (kept), so --resume continues the chosen branch and metrics.jsonl is one history.
    (The tiny run's schedule, steps=6, throughout: the step other tests compiled.)"""
    run = functools.partial(tiny_dense.config, tmp_path, save_every=2, eval_every=0)
    train.main(run(stop_at=4))  # checkpoints 2, 4
    old_rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    branch = train.main(run(resume_from="2", stop_at=3))  # the branch: 3, saved at 3
    assert sorted(branch["losses"]) == [3]
    [aside] = [d for d in os.listdir(tmp_path) if d.startswith("abandoned-after-2-")]
    assert f"moved aside to {tmp_path / aside}" in capsys.readouterr().out
    assert sorted(os.listdir(tmp_path / aside / "checkpoints")) == ["step_00000004"]
    assert checkpoint.read_metadata(str(tmp_path / aside / "checkpoints" / "step_00000004"))["step"] == 4
    assert [os.path.basename(c) for c in checkpoint.all_checkpoints(str(tmp_path / "checkpoints"))] == [
        "step_00000002",
        "step_00000003",
    ]
    moved = [json.loads(line) for line in (tmp_path / aside / "metrics.jsonl").read_text().splitlines()]
    assert moved == [r for r in old_rows if r["step"] > 2]  # the abandoned branch's rows, as they were
    # --resume continues the branch (from 3, not the abandoned 4); metrics.jsonl holds one history
    resumed = train.main(run(resume=True))
    assert sorted(resumed["losses"]) == [4, 5, 6]
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]
    assert rows[:2] == old_rows[:2] and {r["step"]: r["train/loss"] for r in rows[2:]} == {
        **branch["losses"],
        **resumed["losses"],
    }


def test_extending_a_run_says_how_its_schedule_changes(tiny_dense, tmp_path, capsys):
    """--steps 6 -> 8 on a finished run recomputes the cosine: the resume names the old and the new learning
    rate of its first step; --optim.schedule_steps keeps the saved schedule (no warning)."""
    six, eight = tiny_dense.config(tmp_path, save_every=0), tiny_dense.config(tmp_path, steps=8, save_every=0)
    old, new = train.make_optimizer(six)[1], train.make_optimizer(eight)[1]
    train.main(six)
    meta = checkpoint.read_metadata(checkpoint.latest(str(tmp_path / "checkpoints")))
    assert meta["next_learning_rate"] == pytest.approx(float(old(6)), rel=1e-6)  # what step 7 would have used
    capsys.readouterr()
    resume = dataclasses.replace(eight, resume=True)
    with run.Run(resume, train.HERE, train.make_mesh(resume)) as r:  # the resume up to its first step (no compile)
        r.begin(1, 1.0, new)
    out = capsys.readouterr().out
    assert (
        f"warning: the learning-rate schedule changed at the resumed step 6: step 7 was to run at lr "
        f"{float(old(6)):.3g} and runs at {float(new(6)):.3g} (--steps 6 -> 8). The schedule spans --steps"
    ) in out
    assert "--optim.schedule_steps 6" in out and float(new(6)) != pytest.approx(float(old(6)))
    # the saved schedule kept: the same lr at every step of the first 6, its final value after them
    keep = tiny_dense.config(tmp_path, steps=8, optim=dataclasses.replace(six.optim, schedule_steps=6))
    kept = train.make_optimizer(keep)[1]
    assert [float(kept(s)) for s in range(9)] == [float(old(s)) for s in range(7)] + [float(old(6))] * 2
    assert run.schedule_change(keep, meta, float(kept(6)), 6) is None
    assert "(--lr 0.003 -> 0.001)" in run.schedule_change(dataclasses.replace(six, lr=1e-3), meta, 1e-4, 6)
    # a fresh decay: WSD's stable phase does not depend on --steps, so a resume from it with more steps agrees
    wsd = [tiny_dense.config(tmp_path, steps=n, optim=dataclasses.replace(six.optim, schedule="wsd")) for n in (20, 40)]
    w20, w40 = (train.make_optimizer(c)[1] for c in wsd)
    stable = {"next_learning_rate": float(w20(16)), "config": dataclasses.asdict(wsd[0])}
    assert run.schedule_change(wsd[1], stable, float(w40(16)), 16) is None and float(w40(16)) == pytest.approx(six.lr)


def poison(monkeypatch, at: int, metrics: tuple = ()):
    """From now on train.make_train_step's step number `at` returns NaN parameters (and NaN for each
    of `metrics`), as a diverging update would."""

    def nan(n, state, m):
        if n == at:
            state = jax.tree.map(lambda x: x * jnp.nan if jnp.issubdtype(x.dtype, jnp.floating) else x, state)
            return state, {**m, **{k: m[k] * jnp.nan for k in metrics}}

    wrap_step(monkeypatch, train, nan)


def test_nan_loss_stops_and_keeps_last_good_checkpoint(tiny_dense, tmp_path, monkeypatch):
    poison(monkeypatch, 5, ("train/loss",))  # step 5 blows up: NaN loss and NaN parameters
    with pytest.raises(run.TrainingError, match=r"loss nan, grad_norm .* at step 5.*step_00000003"):
        train.main(tiny_dense.config(tmp_path, steps=8, save_every=3))
    ckpts = checkpoint.all_checkpoints(str(tmp_path / "checkpoints"))
    assert [os.path.basename(c) for c in ckpts] == ["step_00000003"]
    cfg = tiny_dense.config(tmp_path, steps=8, save_every=3)
    opt, _ = train.make_optimizer(cfg)
    with jax.set_mesh(train.make_mesh(cfg)):
        target = jax.eval_shape(lambda k: train.init_state(cfg, opt, k), jax.random.key(0))
        state, meta = checkpoint.restore(ckpts[0], target)
    assert meta["step"] == 3 and all(np.isfinite(a).all() for a in arrays(state["params"]))


@pytest.mark.parametrize("poison_", ["grad_norm", "params"])
def test_a_bad_update_with_a_finite_loss_is_never_saved(tiny_dense, tmp_path, monkeypatch, poison_):
    """The loss of step N comes before step N's update: a step whose update is bad (a non-finite
    gradient norm; or weights gone non-finite with finite metrics) is never saved as good."""
    poison(monkeypatch, 6, ("optim/grad_norm",) if poison_ == "grad_norm" else ())  # step 6, a save step
    error = (
        (run.TrainingError, r"loss [0-9.]+, grad_norm nan at step 6.*step_00000003")
        if poison_ == "grad_norm"
        else (checkpoint.CheckpointError, r"not saving step 6: non-finite values.*step_00000003")
    )
    with pytest.raises(error[0], match=error[1]):
        train.main(tiny_dense.config(tmp_path, steps=8, save_every=3))
    assert [os.path.basename(c) for c in checkpoint.all_checkpoints(str(tmp_path / "checkpoints"))] == ["step_00000003"]


def test_profile_steps_capture_a_trace_whose_top_ops_name_the_model_scopes(tiny_dense, tmp_path, capsys):
    """--profile_steps A:B writes a jax.profiler trace and the compiled step's text into <run_dir>/profile;
    tools/bench/profile_top.py lists the ops by self time with the named scopes of the model they come from."""
    train.main(tiny_dense.config(tmp_path, steps=4, save_every=0, profile_steps="2:3"))
    top = load(os.path.join(ROOT, "tools", "bench", "profile_top.py"))
    capsys.readouterr()
    assert top.main([str(tmp_path / "profile"), "--csv", str(tmp_path / "ops.csv")]) == 0
    out = capsys.readouterr().out
    for scope in ("layer/attention", "layer/mlp", "layer/attention (bwd)"):
        assert f"  {scope}\n" in out, out
    rows = (tmp_path / "ops.csv").read_text().splitlines()
    assert rows[0] == "module,op,scope,self_ns,calls" and len(rows) > 20
    assert top.main([str(tmp_path / "nothing-here")]) == 2


class Said(__import__("logging").Handler):
    """The lines the `stencil` logger says (shared/cli.py's resume line among them)."""

    def __init__(self):
        super().__init__()
        self.lines = []

    def emit(self, record):
        self.lines.append(record.getMessage())


def test_a_resume_takes_the_runs_own_settings_and_names_what_the_flags_change(tiny_dense, tmp_path):
    """--resume starts from the run's config.json: a run started with --lr 1e-3 and resumed with nothing but
    --resume and --run_dir goes on at 1e-3 (bit for bit as a run never stopped); flags given now override it and
    the log names each; config.json holds the run's settings only (not --resume or --stop_at, not the peak) and
    is a valid --config_path for a new run."""
    import logging

    from shared import cli

    said, log = Said(), logging.getLogger("stencil")
    level = log.level
    log.addHandler(said)
    log.setLevel(logging.INFO)
    try:
        train, rd = tiny_dense.train, tmp_path / "run"
        parse = functools.partial(cli.parse, train.TrainConfig, train.HERE)
        train.main(parse(tiny_dense.flags(rd, lr=1e-3, save_every=2) + ["--stop_at", "2"]))
        cfg = parse(["--resume", "true", "--run_dir", str(rd)])
        assert (cfg.lr, cfg.steps, cfg.model.n_layers, cfg.stop_at, cfg.resume) == (1e-3, 6, 2, 0, True)
        assert said.lines[-1] == f"resume: the settings of {rd / 'config.json'}, none changed"
        resumed = train.main(cfg)
        straight = train.main(tiny_dense.config(tmp_path / "straight", lr=1e-3, save_every=0))
        assert resumed["losses"] == {k: v for k, v in straight["losses"].items() if k > 2}
        cfg = parse(["--resume", "true", "--run_dir", str(rd), "--lr", "2e-3", "--steps", "8"])
        assert cfg.lr == 2e-3 and said.lines[-1].endswith("; changed now: --lr 0.001 -> 0.002, --steps 6 -> 8")
        saved = json.loads((rd / "config.json").read_text())
        assert (saved["resume"], saved["stop_at"], "peak" in saved) == (False, 0, False)
        new = parse(["--config_path", str(rd / "config.json"), "--run_dir", str(tmp_path / "new")])
        assert run.settings(new) == {**saved, "run_dir": str(tmp_path / "new")}
    finally:
        log.removeHandler(said)
        log.setLevel(level)
