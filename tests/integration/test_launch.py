"""The integration tier of tests/fast/test_launch.py (launch/ and shared/runtime/distributed.py: a real 2-process
x 4-device run on loopback whose checkpoint a single 8-device process resumes with the same losses, the
generators' output, and failures that stop the whole run instead of hanging it): the checks that start real
processes or servers, or run long. What they share with the fast half is imported from it."""

import os
import signal
import subprocess
import sys
import time
import jax.numpy as jnp
import numpy as np
import pytest
from shared.storage import checkpoint
from shared.variant import ROOT
from helpers import finish, losses, sub_env
from fast.test_launch import LAUNCH, LOCAL, SCRIPT, _calls, _port, _stubs, train  # (tests/fast/test_launch.py)

import slurm  # noqa: E402  (launch/slurm.py, on the path the fast half puts launch/ on)


@pytest.mark.integration  # multi-process: a real 2-process run on loopback (jax.distributed)
def test_two_processes_then_resume_on_one(tiny_dense, tmp_path, s3):
    """Two processes save a checkpoint to the local S3 server together (each its own shards, process 0
    commits); one process resumes from it with the same losses as a run that never stopped."""
    url = s3.bucket(f"stencil-mp-{os.getpid()}") + "/ck"
    t0 = time.perf_counter()  # first, so the tokenizer and CPU peak are cached for the subprocesses
    straight = train.main(tiny_dense.config(tmp_path / "single", **LAUNCH))
    t_single = time.perf_counter() - t0
    assert sorted(straight["losses"]) == [1, 2, 3, 4]
    mp_dir = tmp_path / "mp"
    t0 = time.perf_counter()
    r = subprocess.run(
        [
            sys.executable,
            LOCAL,
            "--nproc",
            "2",
            "--devices",
            "4",
            "--variant",
            "dense",
            "--",
            *tiny_dense.flags(mp_dir, **LAUNCH, stop_at=2, checkpoint_dir=url),
        ],
        env=sub_env(),
        capture_output=True,
        text=True,
        timeout=400,
    )
    t_mp = time.perf_counter() - t0
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
    assert "[p1] stencil: distributed (explicit): process 1 of 2, 4 local / 8 global devices" in r.stdout
    assert "mesh {'data': 8, 'context': 1, 'model': 1}" in r.stdout
    [saved] = checkpoint.all_checkpoints(url)
    assert saved.endswith("/step_00000002") and checkpoint.verify(saved, checksums=True) == []
    assert sorted(losses(mp_dir)) == [1, 2]

    resumed = train.main(tiny_dense.config(mp_dir, **LAUNCH, resume=True, checkpoint_dir=url))  # one process, 8 devices
    assert sorted(resumed["losses"]) == [3, 4]
    got, want = losses(mp_dir), losses(tmp_path / "single")
    assert sorted(got) == sorted(want) == [1, 2, 3, 4]
    np.testing.assert_allclose([got[s] for s in range(1, 5)], [want[s] for s in range(1, 5)], rtol=1e-5)
    print(
        f"\nwall time: 2 processes x 4 devices, 2 steps + save (subprocess, incl. start-up) {t_mp:.1f}s; "
        f"single process x 8 devices, 4 steps (in-process, cold tokenizer cache) {t_single:.1f}s"
    )


def _children(pid):
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        return [int(c) for c in f.read().split()]


@pytest.mark.integration  # multi-process: a real 2-process run on loopback (jax.distributed)
def test_killed_process_stops_the_run(tiny_dense, tmp_path):
    p = subprocess.Popen(
        [
            sys.executable,
            LOCAL,
            "--nproc",
            "2",
            "--devices",
            "4",
            "--",
            *tiny_dense.flags(tmp_path / "run", **LAUNCH | {"steps": 200}),
        ],
        env=sub_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        out = []
        for line in p.stdout:
            out.append(line)
            if "[p1] stencil: distributed" in line:
                break
        kids = _children(p.pid)
        assert len(kids) == 2, out
        os.kill(kids[1], signal.SIGKILL)  # Popen order: process 1
        rest, _ = p.communicate(timeout=120)
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode != 0
    assert "launch/local.py: process 1 was killed by SIGKILL; stopped the other processes" in rest


def _pair(extra0, extra1, args, port, timeout=120):
    """Processes 0 and 1 started by hand (no launcher), each with its own env additions and args."""
    procs = []
    for i, (extra, a) in enumerate(((extra0, args[0]), (extra1, args[1]))):
        env = sub_env(
            STENCIL_COORDINATOR=f"127.0.0.1:{port}",
            STENCIL_NUM_PROCESSES="2",
            STENCIL_PROCESS_ID=str(i),
            STENCIL_HEARTBEAT_TIMEOUT="10",
            XLA_FLAGS="--xla_force_host_platform_device_count=4",
            **extra,
        )
        procs.append(
            subprocess.Popen(
                [sys.executable, SCRIPT, *a], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
            )
        )
    return finish(procs, timeout)


@pytest.mark.integration  # multi-process: a real 2-process run on loopback (jax.distributed)
def test_failing_process_is_named_and_heartbeat_stops_the_rest(tiny_dense, tmp_path):
    """No launcher to kill anyone: process 1 raises; JAX's coordination service stops process 0."""
    (tmp_path / "not_a_dir").write_text("")
    args = tiny_dense.flags(tmp_path / "run", **LAUNCH)
    t0 = time.perf_counter()
    (out0, rc0), (out1, rc1) = _pair({}, {"STENCIL_CACHE": str(tmp_path / "not_a_dir")}, [args, args], _port())
    assert rc1 == 1 and "process 1 failed: NotADirectoryError" in out1, out1[-3000:]
    assert rc0 != 0 and "stopped sending heartbeats" in out0, out0[-3000:]
    assert time.perf_counter() - t0 < 110


@pytest.mark.integration  # multi-process: a real 2-process run on loopback (jax.distributed)
def test_mismatched_configs_are_named(tiny_dense, tmp_path):
    a = tiny_dense.flags(tmp_path / "run", **LAUNCH)
    (out0, rc0), (out1, rc1) = _pair({}, {}, [a, a + ["--seed", "1"]], _port())
    for out, rc in ((out0, rc0), (out1, rc1)):
        assert rc == 1 and "config of process(es) [1] differs from process 0's" in out, out[-3000:]


@pytest.mark.integration  # the generated script run against the S3 server on 127.0.0.1
def test_slurm_script_resumes_from_a_checkpoint_dir_on_s3(tmp_path, s3, capsys):
    """With --checkpoint_dir s3://..., the script lists the bucket (python -m shared.checkpoint list):
    no --resume before a committed checkpoint is there, --resume true after, and a store it cannot
    list stops the job instead of starting the run over."""
    url = s3.bucket(f"stencil-launch-{os.getpid()}") + "/ck"
    job = tmp_path / "job.sbatch"
    assert (
        slurm.main(
            ["--workdir", ROOT, "-o", str(job), "--", "--run_dir", str(tmp_path / "run"), "--checkpoint_dir", url]
        )
        == 0
    )
    capsys.readouterr()
    path = _stubs(tmp_path, ["srun", "scontrol"])

    def run(**extra):
        (tmp_path / "srun.calls").unlink(missing_ok=True)
        env = dict(
            os.environ,
            PATH=os.pathsep.join([path, os.path.dirname(sys.executable), os.environ["PATH"]]),
            SLURM_JOB_ID="7",
            SRUN_RC="0",
            **extra,
        )
        r = subprocess.run(["bash", str(job)], env=env, capture_output=True, text=True, timeout=120)
        return r, _calls(tmp_path, "srun")

    r, [srun] = run()
    assert r.returncode == 0 and "no checkpoint yet" in r.stdout and "--resume" not in srun, (r.stdout, r.stderr)
    checkpoint._store(url + "/step_00000003").write("arrays/w/zarr.json", b"{}").result()  # partial: no commit record
    assert "--resume" not in run()[1][0]
    checkpoint.save(url, 2, {"w": jnp.ones((4,))}, {})
    r, [srun] = run()
    assert srun.endswith(f"--checkpoint_dir {url} --resume true") and "resuming from its newest" in r.stdout, srun
    r, calls = run(AWS_ENDPOINT_URL_S3="http://127.0.0.1:9", AWS_ENDPOINT_URL="http://127.0.0.1:9")  # nothing there
    assert r.returncode == 1 and calls == [] and f"cannot list the checkpoints in {url}" in r.stderr, r.stderr


@pytest.mark.integration  # multi-process: a real 2-process run on loopback (jax.distributed)
def test_sigterm_to_the_launcher_stops_every_process_at_one_step_and_resumes(tiny_dense, tmp_path):
    """SIGTERM to launch/local.py reaches both processes; they agree on a step, save it and exit
    75, and so does the launcher; one process then resumes to the losses of an uninterrupted run."""
    run = tmp_path / "mp"
    proc = subprocess.Popen(
        [
            sys.executable,
            LOCAL,
            "--nproc",
            "2",
            "--devices",
            "4",
            "--variant",
            "dense",
            "--",
            *tiny_dense.flags(run, **LAUNCH | {"steps": 500, "save_every": 0}),
        ],
        env=sub_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    t = time.time()
    while not (os.path.exists(run / "metrics.jsonl") and max(losses(run), default=0) >= 3):
        assert proc.poll() is None and time.time() - t < 300, (proc.poll(), proc.stdout.read()[-4000:])
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    out = proc.communicate(timeout=180)[0]
    assert proc.returncode == 75, out[-4000:]
    [saved] = checkpoint.all_checkpoints(str(run / "checkpoints"))
    step = checkpoint.read_metadata(saved)["step"]
    assert 3 <= step < 500 and out.count(f"stopped by a signal after step {step}") == 1  # logged by process 0
    assert "[p1] SIGTERM: finishing this step" in out and "[p0] SIGTERM: finishing this step" in out
    end = step + 2  # the same 500-step schedule, stopped early
    resumed = train.main(tiny_dense.config(run, **LAUNCH | {"steps": 500, "save_every": 0}, stop_at=end, resume=True))
    assert sorted(resumed["losses"]) == [step + 1, end]
    straight = train.main(
        tiny_dense.config(tmp_path / "single", **LAUNCH | {"steps": 500, "save_every": 0}, stop_at=end)
    )
    got, want = losses(run), straight["losses"]
    np.testing.assert_allclose([got[s] for s in range(1, end + 1)], [want[s] for s in range(1, end + 1)], rtol=1e-5)
