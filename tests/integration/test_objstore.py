"""Checkpoints on object storage and asynchronous saves (shared/storage/checkpoint.py, the train loop).

Real servers on 127.0.0.1, started by session fixtures (tools/servers/local_objstore.py): moto's S3
server and fake-gcs-server, which tensorstore's s3 and gcs drivers are pointed at. Each test
gets a fresh bucket. The train.py runs use test_preemption's tiny dense config."""

import itertools
import os
import signal
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from shared.runtime import guard
from shared.storage import checkpoint
from shared.variant import ROOT, load

from helpers import ckpt_tree, losses, mesh, wait_for_step  # noqa: E402  (tests/helpers.py)

pytestmark = pytest.mark.integration  # real S3 and GCS servers on 127.0.0.1, subprocesses and kill loops

train = load(os.path.join(ROOT, "variants", "dense", "train.py"))  # the one tiny_dense (conftest) runs
END_ONLY = {"eval_every": 1000, "eval_batches": 1}  # evaluated only at the end
_names = itertools.count()
# the servers: the session fixtures s3 and gcs of conftest.py


@pytest.fixture(params=["s3", "gs"])
def bucket(request):
    """A fresh, empty bucket on the store named by the parameter, as a URL with a prefix."""
    server = request.getfixturevalue("s3" if request.param == "s3" else "gcs")
    return server.bucket(f"stencil-{request.param}-{os.getpid()}-{next(_names)}") + "/run/checkpoints"


def keys(url):
    return sorted(k.decode() for k in checkpoint._store(url).list().result())


# ---------------------------------------------------------------- every store


def test_round_trip_onto_other_meshes(bucket):
    src = ckpt_tree(mesh(8, (4, 2)))
    path = checkpoint.save(bucket, 7, src, {"loader": {"seed": 0, "position": 56}})
    assert path == bucket + "/step_00000007" and checkpoint.latest(bucket) == path
    assert len([k for k in keys(path) if k.startswith("arrays/w/c/")]) == 8  # one chunk per shard of 4 x 2
    for shape in ((1, 8), (1, 1)):
        m = mesh(shape[0] * shape[1], shape)
        target = {
            "w": jax.ShapeDtypeStruct((64, 16), jnp.float32, sharding=NamedSharding(m, P(None, "model"))),
            "b": jax.ShapeDtypeStruct((16,), jnp.bfloat16, sharding=NamedSharding(m, P(None))),
            "step": jax.ShapeDtypeStruct((), jnp.int32, sharding=NamedSharding(m, P())),
        }
        got, meta = checkpoint.restore(path, target)
        assert meta["step"] == 7 and meta["loader"] == {"seed": 0, "position": 56}
        assert got["w"].sharding.mesh.size == m.size
        for k in src:
            np.testing.assert_array_equal(np.asarray(got[k]), np.asarray(src[k]))


def test_keeps_last_n(bucket):
    src = ckpt_tree(mesh(1))
    for s in range(1, 5):
        checkpoint.save(bucket, s, src, {}, keep=2)
    assert [os.path.basename(p) for p in checkpoint.all_checkpoints(bucket)] == ["step_00000003", "step_00000004"]
    assert {k.split("/")[0] for k in keys(bucket)} == {"step_00000003", "step_00000004"}  # nothing else left


def test_an_uncommitted_checkpoint_is_invisible_and_cleaned_up(bucket):
    src = ckpt_tree(mesh(8, (4, 2)))
    first = checkpoint.save(bucket, 1, src, {})
    # a save of step 2 killed before its commit record: every array written, no metadata.json
    second = checkpoint.save(bucket, 2, src, {})
    checkpoint._store(second).write("metadata.json", None).result()
    assert keys(second) and "metadata.json" not in keys(second)
    assert checkpoint.latest(bucket) == first and checkpoint.all_checkpoints(bucket) == [first]
    with pytest.raises(checkpoint.CheckpointError, match=r"no checkpoint .*step_00000002.*\['step_00000001'\]"):
        checkpoint.find(bucket, "2")
    checkpoint.save(bucket, 3, src, {})  # the next save deletes the partial one
    assert not keys(second)
    assert [os.path.basename(p) for p in checkpoint.all_checkpoints(bucket)] == ["step_00000001", "step_00000003"]


def test_a_preempted_run_resumes_from_the_bucket_bit_exactly(bucket, tiny_dense, tmp_path, straight_run):
    run = tmp_path / "run"  # local: metrics and tokenizer; the checkpoints go to the bucket
    proc = tiny_dense.start(
        run, "--steps", "500", "--warmup_steps", "1", "--save_every", "2", "--checkpoint_dir", bucket, **END_ONLY
    )
    wait_for_step(run, 3, proc)
    assert "LOCK" in keys(bucket)  # the bucket is locked while the run uses it
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == guard.EXIT_PREEMPTED, err[-3000:]
    saved = checkpoint.latest(bucket)
    step = checkpoint.read_metadata(saved)["step"]
    assert saved.startswith(bucket) and f"stopped by a signal after step {step}: saved {saved}" in out + err
    assert "LOCK" not in keys(bucket) and not (run / "checkpoints").exists()
    first = losses(run)
    end = straight_run["end"]
    assert 3 <= step < end and max(first) == step
    resumed = train.main(
        tiny_dense.config(run, **END_ONLY, steps=500, save_every=0, stop_at=end, resume=True, checkpoint_dir=bucket)
    )
    assert {**first, **resumed["losses"]} == straight_run["losses"]  # every loss, before and after the stop
    for a, b in zip(jax.tree.leaves(resumed["state"]), jax.tree.leaves(straight_run["state"])):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_branching_back_on_object_storage_is_refused_with_the_way_to_branch(bucket, tiny_dense, tmp_path):
    """A checkpoint directory on a bucket is not rearranged: a --resume_from that would leave later
    checkpoints behind is refused, naming them and how to branch into a new run directory; that works."""
    run = tmp_path / "run"
    train.main(tiny_dense.config(run, save_every=2, stop_at=4, checkpoint_dir=bucket, **END_ONLY))
    before = keys(bucket)
    with pytest.raises(
        train.run.TrainingError,
        match=r"after step 2 \(step_00000004\).*--run_dir NEW --resume_from "
        rf"{bucket}/step_00000002",
    ):
        train.main(tiny_dense.config(run, save_every=2, resume_from="2", checkpoint_dir=bucket, **END_ONLY))
    assert keys(bucket) == before and not [d for d in os.listdir(run) if d.startswith("abandoned")]
    other = bucket.rsplit("/", 2)[0] + "/branch/checkpoints"
    out = train.main(
        tiny_dense.config(
            tmp_path / "branch", save_every=0, resume_from=f"{bucket}/step_00000002", checkpoint_dir=other, **END_ONLY
        )
    )
    assert sorted(out["losses"]) == [3, 4, 5, 6] and checkpoint.latest(other).endswith("step_00000006")


@pytest.fixture(scope="module")
def straight_run(tiny_dense, tmp_path_factory):
    """The 500-step schedule run straight to step 12, never stopped, checkpoints local."""
    out = train.main(
        tiny_dense.config(
            tmp_path_factory.mktemp("straight"), **END_ONLY, steps=500, save_every=0, stop_at=12, warmup_steps=1
        )
    )
    return {"losses": out["losses"], "state": out["state"], "end": 12}


# ---------------------------------------------------------------- asynchronous saves


def big_tree(m, seed=0):
    """16 MB of float32 on a 4 x 2 mesh: a write that takes a while."""
    with jax.set_mesh(m):
        return {
            "w": jax.random.normal(jax.random.key(seed), (2048, 2048), jnp.float32, out_sharding=P("data", "model")),
            "n": jnp.asarray(seed, jnp.int32),
        }


# stands in for a train step: a new state from the old one, whose buffers it takes (donates)
_step = jax.jit(lambda state: {"w": state["w"] * 0.5 + 1.0, "n": state["n"] + 1}, donate_argnums=0)


def test_async_save_writes_the_state_of_its_step_while_training_goes_on(s3):
    url = s3.bucket(f"stencil-async-{os.getpid()}") + "/ck"
    m = mesh(8, (4, 2))
    state = big_tree(m)
    expected = {k: np.array(v) for k, v in state.items()}
    loader = {"seed": 0, "position": 96}
    saver = checkpoint.Saver()
    with jax.set_mesh(m):
        path = saver.save(url, 3, state, {"loader": loader}, keep=2)
        assert saver.in_flight  # the write goes on in the background ...
        for _ in range(5):  # ... while the loop trains on, donating the saved state's buffers
            state = _step(state)
            loader["position"] += 32
            saver.check()
        jax.block_until_ready(state)
        saver.wait()
        got, meta = checkpoint.restore(path, jax.eval_shape(lambda: state))
    assert meta["loader"] == {"seed": 0, "position": 96} and int(got["n"]) == 0 and int(state["n"]) == 5
    for k in expected:
        np.testing.assert_array_equal(np.asarray(got[k]), expected[k])
    assert checkpoint.verify(path, checksums=True) == []


def test_a_bucket_removed_mid_save_is_raised_in_the_loop(s3):
    url = s3.bucket(f"stencil-vanish-{os.getpid()}") + "/ck"
    m = mesh(8, (4, 2))
    saver = checkpoint.Saver()
    state = big_tree(m)
    with jax.set_mesh(m):
        saver.save(url, 1, state, {})
        s3.reset()  # the bucket and everything in it are gone while the save writes
        with pytest.raises(checkpoint.CheckpointError, match=r"saving step 1 to s3://.*failed: .*NoSuchBucket"):
            for _ in range(10_000):  # the loop: the error comes out of check() at a step
                state = _step(state)
                jax.block_until_ready(state)
                saver.check()
                time.sleep(0.01)
    assert not saver.in_flight
    saver.wait()  # raised once, in the loop; nothing is left to raise


def _as_user_without_dac_override() -> list[str]:
    """As root, a read-only directory is writable: run the child without the capability that allows it."""
    return ["setpriv", "--bounding-set=-dac_override,-dac_read_search"] if os.geteuid() == 0 else []


def test_a_read_only_checkpoint_dir_stops_the_run_at_the_next_step(tiny_dense, tmp_path):
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    (run / "checkpoints").chmod(0o555)
    cmd = [
        *_as_user_without_dac_override(),
        sys.executable,
        os.path.join(ROOT, "variants", "dense", "train.py"),
        *tiny_dense.flags(run, **END_ONLY, steps=40, save_every=2),
    ]
    out = subprocess.run(
        cmd, capture_output=True, text=True, cwd=ROOT, env={**os.environ, "PYTHONPATH": ROOT}, timeout=300
    )
    (run / "checkpoints").chmod(0o755)
    assert out.returncode == 1, out.stderr[-3000:]
    assert "error: saving step 2 to" in out.stderr and "Permission denied" in out.stderr, out.stderr[-3000:]
    # raised in the loop a step or so after the save began, not at the end of the run
    assert 2 <= max(losses(run)) < 40
    assert os.listdir(run / "checkpoints") == []  # the failed save's partial files were removed


def test_kill_9_during_async_saves_to_the_bucket_never_loses_the_previous_checkpoint(s3, tiny_dense, tmp_path):
    """A checkpoint to the bucket every step (keep 2: every save also deletes one), the run killed
    with SIGKILL at random moments three times: the newest complete checkpoint always restores."""
    import random

    rng, run, url = random.Random(1), tmp_path / "run", s3.bucket(f"stencil-kill-{os.getpid()}") + "/ck"
    args = [
        "--steps",
        "60",
        "--warmup_steps",
        "1",
        "--save_every",
        "1",
        "--keep_checkpoints",
        "2",
        "--checkpoint_dir",
        url,
    ]
    seen, steps = 0, []
    for _ in range(3):
        resume = ["--resume", "true"] if checkpoint.all_checkpoints(url) else []
        proc = tiny_dense.start(run, *args, *resume, **END_ONLY)
        wait_for_step(run, seen + 2, proc)
        while not (before := checkpoint.latest(url)) or checkpoint.read_metadata(before)["step"] <= seen:
            time.sleep(0.3)  # a save of this run committed: the one the kill must not lose
        time.sleep(rng.uniform(0.0, 0.4))
        proc.kill()
        proc.wait()
        seen = max(losses(run))
        last = checkpoint.latest(url)  # never raises: nothing damaged is named a checkpoint
        assert last is not None and checkpoint.verify(last, checksums=True) == []
        steps.append(checkpoint.read_metadata(last)["step"])
        assert steps[-1] >= checkpoint.read_metadata(before)["step"]
    assert steps == sorted(steps)
