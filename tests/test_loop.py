"""The train loop of every folder uses the shared run (shared/run.py) correctly: for each folder with a
model.py and a train.py, at the contract's tiny size on the 4 x 2 CPU mesh, in this process:

- cadences: a metrics row at the first step and every log_every, eval rows every eval_every and at the
  end, checkpoints every save_every and at the end;
- a stop signal during a step: that step is saved, main() raises run.Preempted (train.py exits 75),
  and the resume continues bit-exactly (the same losses and final weights as the run never stopped);
- a non-finite loss stops the run without saving, naming the last good checkpoint;
- a resume that would change the data (seq_len, the corpus) or the optimizer is refused before anything runs.
The straight run (cadences) is the fast tier's smoke test of every folder's loop; the stop, the resume,
the non-finite loss and the refusals (four more runs of each loop) are in the integration tier, and
test_train.py checks them on dense in the fast tier.

The harness's own behaviour in depth (locks, kill -9, the watchdog, object stores, every refusal) is
tested once, on dense, in test_train.py, test_preemption.py and test_objstore.py."""

import dataclasses
import glob
import json
import os
import signal

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from shared import checkpoint, data, run
from shared.variant import ROOT, discover, load

from helpers import wrap_step  # noqa: E402  (tests/helpers.py)

VARIANTS = discover()


def tiny(train, corpus, run_dir, **over):
    """The contract's tiny size (8 rows of 32 tokens, data x model = 4 x 2, the folder's CONTRACT_TINY)
    with a small vocabulary, on the test corpus, logging every step."""
    own = dict(train.CONTRACT_TINY)
    model_over = {"vocab_size": 512, **own.pop("model", {})}
    kw = dict(seq_len=32, batch_size=8, steps=4, warmup_steps=0, mesh_data=-1, mesh_model=2, wandb="disabled",
              data=data.DataConfig(source=corpus, val_fraction=0.1), eval_every=2, eval_batches=1, log_every=1,
              save_every=2, sample_tokens=0, run_dir=str(run_dir))
    kw.update(own)
    kw.update(over)
    return train.TrainConfig(model=dataclasses.replace(train.TrainConfig().model, **model_over), **kw)


def rows(run_dir):
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


@pytest.mark.parametrize("variant", VARIANTS)
def test_the_loop_uses_the_run(variant, small_corpus, tmp_path):
    train = load(os.path.join(ROOT, variant, "train.py"))

    # a straight run: cadences
    train.main(tiny(train, small_corpus, tmp_path / "a"))
    logged = rows(tmp_path / "a")
    assert [r["step"] for r in logged] == [1, 2, 3, 4]
    assert ["eval/loss" in r for r in logged] == [False, True, False, True]
    assert all(np.isfinite(r["train/loss"]) and "optim/grad_norm" in r for r in logged)
    assert "throughput/tokens_per_second" in logged[-1]
    assert [os.path.basename(c) for c in checkpoint.all_checkpoints(str(tmp_path / "a" / "checkpoints"))] == \
        ["step_00000002", "step_00000004"]


@pytest.mark.integration  # a long run: four more runs of each folder's loop (its straight run is in the fast tier above)
@pytest.mark.parametrize("variant", VARIANTS)
def test_the_loop_stops_resumes_and_refuses(variant, small_corpus, tmp_path, monkeypatch):
    train = load(os.path.join(ROOT, variant, "train.py"))
    straight = train.main(tiny(train, small_corpus, tmp_path / "a"))

    # a stop signal during step 2: saved at 2, Preempted; the resume equals the straight run bit for bit
    wrap_step(monkeypatch, train, lambda n, s, m: os.kill(os.getpid(), signal.SIGTERM) if n == 2 else None)
    with pytest.raises(run.Preempted, match="preempted after step 2"):
        train.main(tiny(train, small_corpus, tmp_path / "b", save_every=0))
    monkeypatch.undo()
    assert checkpoint.latest(str(tmp_path / "b" / "checkpoints")).endswith("step_00000002")
    resumed = train.main(tiny(train, small_corpus, tmp_path / "b", save_every=0, resume=True))
    assert resumed["losses"] == {k: v for k, v in straight["losses"].items() if k > 2}
    for x, y in zip(jax.tree.leaves(resumed["state"]), jax.tree.leaves(straight["state"])):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))

    # refusals of a resume that would change the data or the optimizer, before anything runs
    with pytest.raises(run.TrainingError, match=r"data stream differs.*'seq_len': \(32, 16\)"):
        train.main(tiny(train, small_corpus, tmp_path / "b", steps=6, seq_len=16, resume=True))
    with pytest.raises(run.TrainingError, match="resume with --optimizer adamw"):
        train.main(tiny(train, small_corpus, tmp_path / "b", steps=6, resume=True, optimizer="muon"))
    other = tmp_path / "other"  # another corpus (tokenized with the run's own tokenizer)
    other.mkdir()
    for path in sorted(glob.glob(small_corpus))[:3]:
        (other / os.path.basename(path)).write_text(open(path).read())
    with pytest.raises(run.TrainingError, match=r"data stream differs.*'corpus'"):
        train.main(tiny(train, small_corpus, tmp_path / "b", steps=6, resume=True,
                        data=data.DataConfig(source=str(other / "*.txt"), val_fraction=0.1)))

    # a non-finite loss at step 3: stopped without saving, the last good checkpoint named and kept
    def poison(n, state, m):
        if n == 3:
            nan = jax.tree.map(lambda x: x * jnp.nan if jnp.issubdtype(x.dtype, jnp.floating) else x, state)
            return nan, {**m, "train/loss": m["train/loss"] * jnp.nan}
    wrap_step(monkeypatch, train, poison)
    with pytest.raises(run.TrainingError, match=r"loss nan, .* at step 3.*Last good checkpoint: .*step_00000002 \(untouched\)"):
        train.main(tiny(train, small_corpus, tmp_path / "c"))
    assert [os.path.basename(c) for c in checkpoint.all_checkpoints(str(tmp_path / "c" / "checkpoints"))] == \
        ["step_00000002"]
