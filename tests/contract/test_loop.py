"""The train loop of every folder uses the shared run (shared/run.py) correctly, with every feature a run can
switch on switched on together: for each folder with a model.py and a train.py, at the contract's tiny size
on 8 CPU devices, in this process, the rows split over `context` (2) beside tensor parallelism (`model` 2,
and moe_hero's `expert` 2), two micro-batches a step, a weight average, a mixture of two sources evaluated
per source, a probe and a sample on their cadences (FEATURES):

- cadences: a metrics row at the first step and every log_every, eval rows every eval_every and at the
  end (eval/loss, each source's eval/<source>/loss, the probe's accuracy), checkpoints every save_every
  and at the end (with the weight average), a sample every sample_every;
- a stop signal during a step: that step is saved, main() raises run.Preempted (train.py exits 75),
  and the resume continues bit-exactly (the same losses and final weights as the run never stopped),
  with in-loop lm-eval tasks too (a generation task and a multiple-choice one);
- a non-finite loss stops the run without saving, naming the last good checkpoint (the plain tiny run:
  every feature off);
- a resume that would change the data (seq_len, the corpus) or the optimizer is refused before anything runs.
The straight run is the fast tier's test of a folder's loop with the features together, for the folders
whose train.py keeps "loop" in FAST_TIER (tests/helpers.fast_tier; docs/testing.md); the stop, the resume,
the non-finite loss and the refusals (four more runs of each loop, after a straight run of its own) are in
the integration tier,
and test_train.py checks them on dense in the fast tier. Features meeting in the rarer ways are tested
where they live: a Hugging Face start with the context split, tensor parallelism, micro-batches, a probe
and the sample in tests/integration/test_hf.py (test_import_a_transformers_model_and_train_from_it), every attention
backend against auto's in tests/contract/test_contract.py, a restore onto other device counts in test_train.py;
every documented training command runs in tests/fast/test_doc_commands.py.

The harness's own behaviour in depth (locks, kill -9, the watchdog, object stores, every refusal) is
tested once, on dense, in test_train.py, test_preemption.py and test_objstore.py."""

import dataclasses
import glob
import os
import signal

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from shared import data, run
from shared.storage import checkpoint
from shared.evals import probes
from shared.variant import ROOT, discover, load

from helpers import fast_tier, metric_rows, wrap_step  # noqa: E402  (tests/helpers.py)

VARIANTS = discover()


def tiny(train, corpus, run_dir, **over):
    """The contract's tiny size (8 rows of 32 tokens, data x model = 4 x 2, the folder's CONTRACT_TINY)
    with a small vocabulary, on the test corpus, logging every step."""
    own = dict(train.CONTRACT_TINY)
    model_over = {"vocab_size": 512, **own.pop("model", {})}
    kw = dict(
        seq_len=32,
        batch_size=8,
        steps=4,
        warmup_steps=0,
        mesh_data=-1,
        mesh_model=2,
        wandb="disabled",
        data=data.DataConfig(source=corpus, val_fraction=0.1),
        eval_every=2,
        eval_batches=1,
        log_every=1,
        save_every=2,
        sample_tokens=0,
        run_dir=str(run_dir),
    )
    kw.update(own)
    kw.update(over)
    return train.TrainConfig(model=dataclasses.replace(train.TrainConfig().model, **model_over), **kw)


def mixture(corpus: str) -> str:
    """Two named sources of the test corpus (its glob's folder): json's coders and the rest, weights 1 and 2."""
    d = os.path.dirname(corpus)
    return f"code={d}/*coder.py.txt@1,lib={d}/*s*.py.txt@2"


def features(train, corpus, *, context=2, lm_eval=False) -> dict:
    """Every feature of a run on at once (TrainConfig overrides on top of `tiny`): rows split over `context`
    devices (2; 1 = not split) beside `model` 2 (moe_hero: `expert` 2 from its CONTRACT_TINY), two
    micro-batches, a weight average, a mixture of two sources (evaluated per source), the mqar probe and a
    4-token sample every 2 steps; with `lm_eval`, two offline lm-eval tasks (generation, multiple choice)."""
    over = dict(
        mesh_context=context,
        mesh_model=2,
        grad_accum=2,
        sample_every=2,
        sample_tokens=4,
        optim=dataclasses.replace(train.TrainConfig().optim, ema=0.9),
        probes=probes.ProbeConfig(sets="mqar", rows=8, mqar_pairs=2, mqar_gap=4),
        data=data.DataConfig(source=mixture(corpus), val_fraction=0.2),
    )
    if lm_eval:
        over |= dict(
            lm_eval_tasks="stencil_gen,stencil_mc",
            lm_eval_limit=2,
            lm_eval_include=os.path.join(ROOT, "evals", "tasks"),
        )
    return over


@pytest.mark.parametrize("variant", [v for v in VARIANTS if "loop" in fast_tier(v)])
def test_the_loop_uses_the_run(variant, small_corpus, tmp_path, capsys):
    """The fast tier's straight run, for the folders whose train.py keeps "loop" in FAST_TIER; the others'
    straight run (the same checks, with the context axis and lm-eval on too) opens
    test_the_loop_stops_resumes_and_refuses in the integration tier."""
    train = load(os.path.join(ROOT, variant, "train.py"))

    # a straight run with every feature on but the context axis (the integration tier's runs below split the rows
    # too; tests/fast/test_generate.py decodes and scores on a mesh that splits them): cadences, what each feature leaves
    out = train.main(tiny(train, small_corpus, tmp_path / "a", **features(train, small_corpus, context=1)))
    check_straight(tmp_path / "a", out, capsys.readouterr().out)


def check_straight(run_dir, out, printed):
    logged = metric_rows(run_dir)
    assert [r["step"] for r in logged] == [1, 2, 3, 4]
    assert ["eval/loss" in r for r in logged] == [False, True, False, True]
    for key in ("eval/code/loss", "eval/lib/loss", "eval/mqar/accuracy"):
        assert all(np.isfinite(r[key]) for r in logged if "eval/loss" in r), key
    assert all(np.isfinite(r["train/loss"]) and "optim/grad_norm" in r for r in logged)
    assert "throughput/tokens_per_second" in logged[-1]
    saved = [os.path.basename(c) for c in checkpoint.all_checkpoints(str(run_dir / "checkpoints"))]
    assert saved == ["step_00000002", "step_00000004"]
    assert "ema" in out["state"]
    assert printed.count("--- sample after") == 2 and out["sample"].strip(), printed[-2000:]


@pytest.mark.integration  # a long run: four more runs of each folder's loop (its straight run is in the fast tier above)
@pytest.mark.parametrize("variant", VARIANTS)
def test_the_loop_stops_resumes_and_refuses(variant, small_corpus, tmp_path, monkeypatch, capsys):
    pytest.importorskip("lm_eval", reason="the eval extra: pip install -e '.[eval]'")
    train = load(os.path.join(ROOT, variant, "train.py"))
    on = features(train, small_corpus, lm_eval=True)
    straight = train.main(tiny(train, small_corpus, tmp_path / "a", **on))
    check_straight(tmp_path / "a", straight, capsys.readouterr().out)
    assert {"eval/lm_eval/stencil_gen/exact_match", "eval/lm_eval/stencil_mc/acc"} <= set(
        metric_rows(tmp_path / "a")[-1]
    )

    # a stop signal during step 2: saved at 2, Preempted; the resume equals the straight run bit for bit
    wrap_step(monkeypatch, train, lambda n, s, m: os.kill(os.getpid(), signal.SIGTERM) if n == 2 else None)
    with pytest.raises(run.Preempted, match="preempted after step 2"):
        train.main(tiny(train, small_corpus, tmp_path / "b", **{**on, "save_every": 0}))
    monkeypatch.undo()
    assert checkpoint.latest(str(tmp_path / "b" / "checkpoints")).endswith("step_00000002")
    resumed = train.main(tiny(train, small_corpus, tmp_path / "b", **{**on, "save_every": 0}, resume=True))
    assert resumed["losses"] == {k: v for k, v in straight["losses"].items() if k > 2}
    for x, y in zip(jax.tree.leaves(resumed["state"]), jax.tree.leaves(straight["state"])):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    last = lambda d: {k: v for k, v in metric_rows(d)[-1].items() if not k.startswith("throughput/")}  # noqa: E731
    assert last(tmp_path / "b") == last(tmp_path / "a")  # the evaluations, probes and lm-eval after the resume

    # refusals of a resume that would change the data or the optimizer, before anything runs (rows of 16 tokens
    # are not split: a window's halo would not fit in 8)
    with pytest.raises(run.TrainingError, match=r"data stream differs.*'seq_len': \(32, 16\)"):
        train.main(
            tiny(train, small_corpus, tmp_path / "b", **{**on, "mesh_context": 1}, steps=6, seq_len=16, resume=True)
        )
    with pytest.raises(run.TrainingError, match="resume with --optimizer adamw"):
        train.main(tiny(train, small_corpus, tmp_path / "b", **on, steps=6, resume=True, optimizer="muon"))
    other = tmp_path / "other"  # another corpus (tokenized with the run's own tokenizer)
    other.mkdir()
    for path in sorted(glob.glob(small_corpus))[:3]:
        (other / os.path.basename(path)).write_text(open(path).read())
    with pytest.raises(run.TrainingError, match=r"data stream differs.*'corpus'"):
        train.main(
            tiny(
                train,
                small_corpus,
                tmp_path / "b",
                **{**on, "data": data.DataConfig(source=str(other / "*.txt"), val_fraction=0.2)},
                steps=6,
                resume=True,
            )
        )

    # a non-finite loss at step 3: stopped without saving, the last good checkpoint named and kept
    def poison(n, state, m):
        if n == 3:
            nan = jax.tree.map(lambda x: x * jnp.nan if jnp.issubdtype(x.dtype, jnp.floating) else x, state)
            return nan, {**m, "train/loss": m["train/loss"] * jnp.nan}

    wrap_step(monkeypatch, train, poison)
    with pytest.raises(
        run.TrainingError, match=r"loss nan, .* at step 3.*Last good checkpoint: .*step_00000002 \(untouched\)"
    ):
        train.main(tiny(train, small_corpus, tmp_path / "c"))
    assert [os.path.basename(c) for c in checkpoint.all_checkpoints(str(tmp_path / "c" / "checkpoints"))] == [
        "step_00000002"
    ]
