"""Faults a long run meets: an object store that throttles, resets connections and stalls (the local S3
server behind tools/servers/fault_proxy.py, both on 127.0.0.1), a process other than 0 failing its part of a
save in a 2-process run, and a soak of SIGKILLs at random moments.

Every request the store is asked is retried by the driver within the budget STENCIL_STORE_RETRIES sets
(shared/storage/objstore.py); past it the run stops with one error naming the checkpoint, and the previous
checkpoint stays complete."""

import os
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

from shared import data, pretokenize
from shared.storage import checkpoint
from shared.data import DataConfig, load_corpus
from shared.variant import ROOT, load

from helpers import ckpt_tree, finish, losses, mesh, sub_env  # noqa: E402  (tests/helpers.py)

pytestmark = pytest.mark.integration  # real S3 server and fault proxy on 127.0.0.1, subprocesses, kill loops

train = load(os.path.join(ROOT, "variants", "dense", "train.py"))  # the one tiny_dense (conftest) runs
fault_proxy = load(os.path.join(ROOT, "tools", "servers", "fault_proxy.py"))
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
        corpus = load_corpus(
            DataConfig(source=store, val_fraction=0.1, cache_dir=str(tmp_path / "c")), 512, progress=False
        )
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
    """The run's lock, asynchronous saves, listing and restore on a store faulting 20% of requests."""
    url = _bucket(faulty, "run") + "/ck"
    faulty.fail = 0.2
    first = train.main(
        tiny_dense.config(tmp_path / "run", **END_ONLY, steps=6, stop_at=4, save_every=2, checkpoint_dir=url)
    )
    resumed = train.main(
        tiny_dense.config(tmp_path / "run", **END_ONLY, steps=6, save_every=2, resume=True, checkpoint_dir=url)
    )
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
    faulty.fail, faulty.only, faulty.kinds = 1.0, r"/step_00000004/", ("503", "reset")  # a delay would pass
    r = subprocess.run(
        [
            sys.executable,
            tiny_dense.script,
            *tiny_dense.flags(run, **END_ONLY, steps=8, save_every=2, checkpoint_dir=url),
        ],
        env=sub_env(),
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert r.returncode == 1, r.stderr[-3000:]
    errors = [ln for ln in r.stderr.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in r.stderr, r.stderr[-3000:]
    assert errors[0].startswith(
        f"error: saving step 4 to {url}/step_00000004 failed (the object store kept failing "
        "past the retry budget, STENCIL_STORE_RETRIES)"
    ), errors[0]
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


# ---------------------------------------------------------------- a process other than 0 fails its part of a save


def _free_port():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start_pair(args, endpoints):
    """Processes 0 and 1 of a 2 x 4-device run, started by hand (no launcher to stop the other): each talks
    to the S3 endpoint given for it (process 1's through the fault proxy)."""
    port, procs = _free_port(), []
    for i, endpoint in enumerate(endpoints):
        env = sub_env(
            STENCIL_COORDINATOR=f"127.0.0.1:{port}",
            STENCIL_NUM_PROCESSES="2",
            STENCIL_PROCESS_ID=str(i),
            STENCIL_HEARTBEAT_TIMEOUT="10",
            XLA_FLAGS="--xla_force_host_platform_device_count=4",
            AWS_ENDPOINT_URL_S3=endpoint,
        )
        procs.append(
            subprocess.Popen(
                [sys.executable, SCRIPT, *args],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                cwd=ROOT,
            )
        )
    return procs


def _resume_redoes_the_same_steps(faulty, run, url, logged):
    """Resume both processes from step 2 (the store healthy) to step 4: the redone steps' losses are the ones
    the failed run logged, bit for bit."""
    faulty.fail = 0.0
    args = tiny_dense_flags(run, url, resume="true", stop_at=4)
    outs = finish(_start_pair(args, [faulty.s3.endpoint, faulty.url]), 400)
    assert [rc for _, rc in outs] == [0, 0], outs[0][0][-3000:] + outs[1][0][-3000:]
    got = losses(run)
    assert sorted(got) == [1, 2, 3, 4] and {s: got[s] for s in (3, 4)} == {s: logged[s] for s in (3, 4)}, (got, logged)
    [last] = [c for c in checkpoint.all_checkpoints(url) if c.endswith("step_00000004")]
    assert checkpoint.verify(last, checksums=True) == []


SCRIPT = os.path.join(ROOT, "variants", "dense", "train.py")
TINY = {}  # filled by the tiny_dense fixture of each test below (its flags need the session's corpus)


def tiny_dense_flags(run, url, **over):
    return TINY["flags"](run, **{**END_ONLY, "steps": 8, "save_every": 2, "checkpoint_dir": url, **over})


@pytest.fixture
def two(faulty, tiny_dense):
    TINY["flags"] = tiny_dense.flags
    return faulty


def test_process_1_refused_its_writes_of_a_save(two, tmp_path):
    """Process 1's writes of step 4's shards are refused (its own endpoint fails them all): both processes
    exit non-zero, naming process 1, in bounded time; step 4 never counts as complete; a resume from step 2
    is bit-exact."""
    url, run = _bucket(two, "p1-refused") + "/ck", tmp_path / "run"
    two.fail, two.only, two.kinds = 1.0, r"/step_00000004/arrays/", ("503", "reset")  # a delay would pass
    t0 = time.monotonic()
    (out0, rc0), (out1, rc1) = finish(_start_pair(tiny_dense_flags(run, url), [two.s3.endpoint, two.url]), 400)
    took = time.monotonic() - t0
    print(f"\nprocess 1's writes refused: both stopped {took:.0f} s after the start")
    assert rc0 != 0 and rc1 != 0, out0[-3000:] + out1[-3000:]
    assert "error: process 1 of 2: saving step 4 to" in out1, out1[-3000:]
    assert (
        "process 1 could not write its shards of step 4" in out0
        or "The following tasks are unhealthy (stopped sending heartbeats):\n1\n" in out0
    ), out0[-3000:]
    two.fail, two.kinds = 0.0, fault_proxy.KINDS
    assert [os.path.basename(c) for c in checkpoint.all_checkpoints(url)] == ["step_00000002"]
    logged = losses(run)
    assert max(logged) >= 4
    _resume_redoes_the_same_steps(two, run, url, logged)


def test_process_1_killed_in_the_middle_of_a_save(two, tmp_path):
    """Process 1 is SIGKILLed while its writes of step 4 are held up: process 0 exits non-zero within the
    heartbeat timeout, naming process 1; step 4 never counts as complete; a resume from step 2 is bit-exact."""
    url, run = _bucket(two, "p1-killed") + "/ck", tmp_path / "run"
    two.fail, two.only, two.kinds, two.delay_s = 1.0, r"/step_00000004/arrays/", ("delay",), 600.0
    p0, p1 = _start_pair(tiny_dense_flags(run, url), [two.s3.endpoint, two.url])
    try:
        deadline = time.monotonic() + 300
        while two.counts["delay"] == 0 and time.monotonic() < deadline and p1.poll() is None:
            time.sleep(0.1)
        assert two.counts["delay"] > 0, "process 1 never began writing step 4"
        p1.kill()
        t0 = time.monotonic()
        out0, _ = p0.communicate(timeout=120)
        took = time.monotonic() - t0
    finally:
        for p in (p0, p1):
            if p.poll() is None:
                p.kill()
    p1.communicate()
    print(f"\nprocess 1 killed mid-save: process 0 exited {took:.0f} s later with {p0.returncode}")
    assert p0.returncode != 0 and took < 60, out0[-3000:]
    # JAX's coordination service names it (task 1 = process 1) and aborts process 0; launch/local.py would
    # also print "process 1 was killed by SIGKILL" (tests/fast/test_launch.py)
    assert "The following tasks are unhealthy (stopped sending heartbeats):\n1\n" in out0, out0[-3000:]
    two.fail, two.kinds, two.delay_s = 0.0, fault_proxy.KINDS, 0.05
    assert [os.path.basename(c) for c in checkpoint.all_checkpoints(url)] == ["step_00000002"]
    logged = losses(run)
    assert max(logged) >= 4
    _resume_redoes_the_same_steps(two, run, url, logged)


# ---------------------------------------------------------------- the soak

LOCAL = os.path.join(ROOT, "launch", "local.py")


def _children(pid):
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        return [int(c) for c in f.read().split()]


def _leaves(path):
    meta = checkpoint.read_metadata(path)
    return {name: checkpoint.open_leaf(path, name).read().result() for name in sorted(meta["leaves"])}


def _logged(run):
    """The newest step in a run's metrics.jsonl (0 before any)."""
    return max(losses(run), default=0) if (run / "metrics.jsonl").exists() else 0


def test_soak_sigkill_at_random_moments_of_a_two_process_run(tiny_dense, tmp_path):
    """A 2-process run (launch/local.py) saving every step and keeping 2 (so every step also deletes one),
    one of its processes SIGKILLed at a random moment (start-up, compilation, steps, saves, deletions) 16
    times (STENCIL_SOAK_KILLS=30 for the long soak, with STENCIL_SOAK_STEPS=160) and resumed each time: the
    newest complete checkpoint always verifies, and the final losses and weights equal those of the same run
    never killed. Each kill costs a restart of two processes (about 30 s on a loaded 2-core machine), so the
    integration tier runs 16 (half of them in start-up or compilation, half in steps, saves and deletions)."""
    import random

    kills_wanted = int(os.environ.get("STENCIL_SOAK_KILLS", "16"))
    # 30 kills took a run of 2 devices a process to about step 80; 16 to about 45
    rng, steps = random.Random(0), int(os.environ.get("STENCIL_SOAK_STEPS", "96"))
    run, straight = tmp_path / "run", tmp_path / "straight"

    def launch(run_dir, *extra):
        flags = tiny_dense.flags(run_dir, **END_ONLY, steps=steps, save_every=1, keep_checkpoints=2)
        return subprocess.Popen(
            [sys.executable, LOCAL, "--nproc", "2", "--devices", "2", "--", *flags, *extra],
            env=sub_env(STENCIL_HEARTBEAT_TIMEOUT="10"),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            cwd=ROOT,
        )

    p = launch(straight)
    out, _ = p.communicate(timeout=900)
    assert p.returncode == 0, out[-3000:]
    ck, kills, resumes, t_first = str(run / "checkpoints"), 0, 0, 8.0  # t_first: seconds to a first step, learnt
    while kills < kills_wanted:
        resume = ["--resume", "true"] if checkpoint.latest(ck) else []
        resumes += bool(resume)
        p = launch(run, *resume)
        t0 = time.monotonic()
        try:
            if kills % 2 == 0:  # any moment from the start: start-up, compilation, the first steps
                time.sleep(rng.uniform(0.0, t_first))
            else:  # a moment after this start's first logged step: steps, saves, deletions
                seen = _logged(run)
                while p.poll() is None and _logged(run) <= seen:
                    time.sleep(0.05)
                t_first = 0.8 * t_first + 0.2 * (time.monotonic() - t0)
                time.sleep(rng.uniform(0.0, 1.5))
            if p.poll() is not None:  # ended before this kill: only by completing the run
                assert p.returncode == 0, p.communicate()[0][-3000:]
                break
            kids = _children(p.pid)
            if kids:
                os.kill(rng.choice(kids), 9)
                kills += 1
            p.communicate(timeout=120)
        finally:
            if p.poll() is None:
                p.kill()
        last = checkpoint.latest(ck)  # never raises: nothing damaged is named a checkpoint
        assert last is None or checkpoint.verify(last, checksums=True) == []
    at_last_kill = _logged(run)
    p = launch(run, "--resume", "true")
    out, _ = p.communicate(timeout=900)
    assert p.returncode == 0, out[-3000:]
    print(
        f"\nsoak: {kills} SIGKILLs, {resumes + 1} resumes; step {at_last_kill} logged at the last kill; the run "
        f"reached step {steps}"
    )
    assert kills >= kills_wanted
    got, want = losses(run), losses(straight)
    assert sorted(got) == list(range(1, steps + 1)) and got == want
    a, b = _leaves(checkpoint.latest(ck)), _leaves(checkpoint.latest(str(straight / "checkpoints")))
    assert sorted(a) == sorted(b)
    for name in a:
        np.testing.assert_array_equal(a[name], b[name], err_msg=name)
