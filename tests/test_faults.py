"""Faults a long run meets: an object store that throttles, resets connections and stalls (the local S3
server behind tools/fault_proxy.py, both on 127.0.0.1), a process other than 0 failing its part of a
save in a 2-process run, and a soak of SIGKILLs at random moments.

Every request the store is asked is retried by the driver within the budget STENCIL_STORE_RETRIES sets
(shared/objstore.py); past it the run stops with one error naming the checkpoint, and the previous
checkpoint stays complete."""

import os
import subprocess
import sys

import jax
import numpy as np
import pytest

from shared import checkpoint, data, pretokenize
from shared.data import DataConfig, load_corpus
from shared.variant import ROOT, load

from helpers import ckpt_tree, losses, mesh, sub_env  # noqa: E402  (tests/helpers.py)

pytestmark = pytest.mark.integration  # real S3 server and fault proxy on 127.0.0.1, subprocesses, kill loops

train = load(os.path.join(ROOT, "variants", "dense", "train.py"))  # the one tiny_dense (conftest) runs
fault_proxy = load(os.path.join(ROOT, "tools", "fault_proxy.py"))
END_ONLY = {"eval_every": 1000, "eval_batches": 1}  # evaluated only at the end
FAST_RETRIES = "12,0.01,0.2"  # a small budget, so that a store failing for good fails the test in seconds


@pytest.fixture
def faulty(s3, monkeypatch):
    """The fault proxy in front of the session's S3 server, the AWS endpoint pointed at it (this process and
    the subprocesses it starts), with a small retry budget. Faults start at 0%: the test sets `fail`."""
    with fault_proxy.fault_proxy(s3.endpoint, fail=0.0, delay_s=0.05, seed=0) as p:
        monkeypatch.setenv("AWS_ENDPOINT_URL_S3", p.url)
        monkeypatch.setenv("STENCIL_STORE_RETRIES", FAST_RETRIES)
        p.s3 = s3
        yield p


def _bucket(faulty, name):
    return faulty.s3.bucket(f"stencil-{name}-{os.getpid()}")


def test_saves_listings_restores_and_token_store_reads_retry_through_a_faulty_store(faulty, small_corpus, tmp_path):
    """30% of requests throttled (503 SlowDown), reset or delayed: asynchronous saves (with keep-2
    deletions), listings, verification, restores and a token store's reads all succeed, bit for bit."""
    url = _bucket(faulty, "flaky") + "/ck"
    m = mesh(8, (4, 2))
    src = ckpt_tree(m)
    faulty.fail = 0.3
    saver = checkpoint.Saver()
    with jax.set_mesh(m):
        for step in range(1, 5):
            saver.save(url, step, src, {"loader": {"position": step}}, keep=2)
        saver.wait()
        assert [os.path.basename(p) for p in checkpoint.all_checkpoints(url)] == ["step_00000003", "step_00000004"]
        last = checkpoint.latest(url)
        assert checkpoint.verify(last, checksums=True) == []
        got, meta = checkpoint.restore(last, jax.eval_shape(lambda: src))
    assert meta["loader"] == {"position": 4}
    for k in src:
        np.testing.assert_array_equal(np.asarray(got[k]), np.asarray(src[k]))

    faulty.fail = 0.0  # a token store written whole, then read with and without faults
    store = _bucket(faulty, "tokens") + "/web"
    pretokenize.run([small_corpus], store, vocab_size=512, workers=1, progress=False)
    rows = []
    for fail in (0.0, 0.3):
        faulty.fail = fail
        corpus = load_corpus(DataConfig(source=store, val_fraction=0.1, cache_dir=str(tmp_path / "c")), 512,
                             progress=False)
        loader = data.make_loader(corpus, 32, 8, seed=1)
        rows.append([loader.next() for _ in range(6)] + data.eval_batches(corpus.val, 32, 4, 2))
    assert len(rows[0]) == len(rows[1]) == 8
    for x, y in zip(*rows):
        assert sorted(x) == sorted(y)
        for k in x:
            np.testing.assert_array_equal(x[k], y[k])
    c = faulty.counts
    assert min(c["503"], c["reset"], c["delay"]) > 5 and c["requests"] > 200, c


def test_a_run_through_a_faulty_store_resumes_bit_exactly(faulty, tiny_dense, tmp_path):
    """The run's lock, asynchronous saves, listing and restore on a store failing 20% of requests."""
    url = _bucket(faulty, "run") + "/ck"
    faulty.fail = 0.2
    first = train.main(tiny_dense.config(tmp_path / "run", **END_ONLY, steps=6, stop_at=4, save_every=2,
                                         checkpoint_dir=url))
    resumed = train.main(tiny_dense.config(tmp_path / "run", **END_ONLY, steps=6, save_every=2, resume=True,
                                           checkpoint_dir=url))
    straight = train.main(tiny_dense.config(tmp_path / "straight", **END_ONLY, steps=6, save_every=0))
    assert {**first["losses"], **resumed["losses"]} == straight["losses"]
    for x, y in zip(jax.tree.leaves(resumed["state"]), jax.tree.leaves(straight["state"])):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    assert faulty.counts["503"] + faulty.counts["reset"] > 10, faulty.counts


def test_a_store_failing_past_the_retry_budget_stops_the_run_naming_the_checkpoint(faulty, tiny_dense, tmp_path):
    """Every request of step 4's save fails: the run stops with one error naming step_00000004 and the
    budget, step 2 stays complete, and a resume from it (the store healthy again) is bit-exact."""
    url = _bucket(faulty, "budget") + "/ck"
    run = tmp_path / "run"
    faulty.fail, faulty.only = 1.0, r"/step_00000004/"
    r = subprocess.run([sys.executable, tiny_dense.script, *tiny_dense.flags(run, **END_ONLY, steps=8, save_every=2,
                                                                              checkpoint_dir=url)],
                       env=sub_env(), capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert r.returncode == 1, r.stderr[-3000:]
    errors = [ln for ln in r.stderr.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in r.stderr, r.stderr[-3000:]
    assert errors[0].startswith(f"error: saving step 4 to {url}/step_00000004 failed (the object store kept failing "
                                "past the retry budget, STENCIL_STORE_RETRIES)"), errors[0]
    assert f"the last checkpoint is {url}/step_00000002" in errors[0], errors[0]
    assert 4 <= max(losses(run)) < 8  # stopped a step or so after the save began, not at the end
    faulty.fail = 0.0
    assert checkpoint.all_checkpoints(url) == [f"{url}/step_00000002"]
    assert checkpoint.verify(f"{url}/step_00000002", checksums=True) == []
    resumed = train.main(tiny_dense.config(run, **END_ONLY, steps=8, save_every=2, resume=True, checkpoint_dir=url))
    straight = train.main(tiny_dense.config(tmp_path / "straight", **END_ONLY, steps=8, save_every=0))
    assert resumed["losses"] == {k: v for k, v in straight["losses"].items() if k > 2}
    for x, y in zip(jax.tree.leaves(resumed["state"]), jax.tree.leaves(straight["state"])):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
