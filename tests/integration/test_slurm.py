"""launch/slurm.py on a real SLURM: munged, slurmctld and slurmd started on this machine (one node,
`localhost`, its CPUs) by the `cluster` fixture, and the generated sbatch script submitted with
`--gpus-per-node 0`, 2 tasks on the node, 4 CPU devices per task.

- a 2-task job trains dense under SLURM's own environment (JAX's SLURM detection), with the
  losses of one process on 8 devices;
- SIGUSR1 to the job's tasks (what `#SBATCH --signal=USR1@<lead>` makes SLURM send before the time
  limit): they save and exit 75, the script requeues the job, the requeued job resumes and finishes
  with every loss of an uninterrupted job, bit for bit;
- a task killed with SIGKILL fails the job in bounded time, srun naming the task.

Skipped, with the reason, where SLURM cannot start: not root (slurmd and munged run as root here),
or slurm-wlm / munge not installed (`.ci/run` installs them with apt-get). docs/launching.md shows
how to bring the same SLURM up by hand."""

import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from shared.variant import ROOT, load

from helpers import losses, sub_env  # noqa: E402  (tests/helpers.py)

sys.path.insert(0, os.path.join(ROOT, "launch"))
import slurm  # noqa: E402  (launch/slurm.py)
from local import free_port  # noqa: E402  (launch/local.py)

pytestmark = pytest.mark.integration  # a real single-node SLURM (munged, slurmctld, slurmd) runs 2-task jobs

train = load(os.path.join(ROOT, "variants", "dense", "train.py"))  # the one tiny_dense (conftest) runs
# every job: the tiny dense run's 500-step schedule, stopped at STOP_AT, evaluated and saved at the end only
JOB = {"steps": 500, "save_every": 0, "eval_every": 1000, "eval_batches": 1}

SBIN = os.pathsep.join([os.environ.get("PATH", ""), "/usr/sbin", "/usr/bin", "/sbin"])
DAEMONS, CLIENTS = ("munged", "slurmctld", "slurmd"), ("sbatch", "srun", "scontrol", "scancel", "sinfo", "squeue")
REQUEUE_DELAY = 5  # cred_expire: a requeued job starts again after this + 1 s (SLURM's default is 120 s)
STOP_AT, SIGNAL_AFTER = 40, 3  # every job runs the same 500-step schedule, stopped at step 40


def why_slurm_cannot_start() -> str | None:
    if os.geteuid() != 0:
        return (
            "the SLURM tests start munged, slurmctld and slurmd, which run as root here: run pytest as root (CI does)"
        )
    missing = [b for b in DAEMONS + CLIENTS if shutil.which(b, path=SBIN) is None]
    if missing:
        how = "apt-get install -y slurm-wlm munge" if shutil.which("apt-get") else "no apt-get here to install them"
        return f"SLURM is not installed (missing {', '.join(missing)}): {how} (.ci/run does this)"
    return None


def slurm_conf(d: str, ctld_port: int, slurmd_port: int, cpus: int) -> str:
    """One node called localhost with `cpus` CPUs, no cgroups, no accounting, state and logs in d.

    Job ids start at a random number: JAX derives a SLURM job's coordinator port from its job id, so two
    test clusters on one machine that both count from 1 would send their jobs' tasks to one coordinator."""
    return "\n".join(
        [
            f"FirstJobId={random.randrange(1000, 60000)}",
            "ClusterName=stencil",
            "SlurmctldHost=localhost",
            f"SlurmctldPort={ctld_port}",
            f"SlurmdPort={slurmd_port}",
            "SlurmUser=root",
            "SlurmdUser=root",
            "AuthType=auth/munge",
            f"AuthInfo=socket={d}/munge.socket,cred_expire={REQUEUE_DELAY}",
            "CredType=cred/munge",
            f"StateSaveLocation={d}/state",
            f"SlurmdSpoolDir={d}/spool",
            f"SlurmctldPidFile={d}/slurmctld.pid",
            f"SlurmdPidFile={d}/slurmd.pid",
            f"SlurmctldLogFile={d}/slurmctld.log",
            f"SlurmdLogFile={d}/slurmd.log",
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "JobAcctGatherType=jobacct_gather/none",
            "AccountingStorageType=accounting_storage/none",
            "JobCompType=jobcomp/none",
            "MpiDefault=none",
            "MailProg=/bin/true",
            "SchedulerType=sched/builtin",
            "SchedulerParameters=sched_interval=2",  # a requeued job waits for the next pass (60 s by default)
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_CPU",
            "ReturnToService=2",
            "JobRequeue=1",
            "KillWait=10",
            "SlurmdParameters=config_overrides",  # the node's CPUs as stated, whatever the hardware says
            f"NodeName=localhost CPUs={cpus} State=UNKNOWN",
            "PartitionName=debug Nodes=localhost Default=YES MaxTime=INFINITE State=UP",
            "",
        ]
    )


class Slurm:
    """A running single-node SLURM: its folder, and the environment its clients (and jobs) need."""

    def __init__(self, d: str):
        self.dir = d
        self.env = sub_env(SLURM_CONF=os.path.join(d, "slurm.conf"), PATH=SBIN)
        for k in [k for k in self.env if k.startswith(("SLURM_", "SBATCH_", "SRUN_"))]:
            if k != "SLURM_CONF":
                del self.env[k]
        # No persistent compilation cache in the jobs: only process 0 writes it and process 1 misses it
        # (jax 0.10), so process 1 compiles for tens of seconds while process 0 waits in a collective,
        # and gloo gives up on a peer after 30 s. Both processes compiling keeps them together.
        self.env.pop("JAX_COMPILATION_CACHE_DIR", None)
        self.env["JAX_ENABLE_COMPILATION_CACHE"] = "false"
        self.procs: list[subprocess.Popen] = []

    def run(self, *cmd, check=True, env=None, cwd=None) -> str:
        r = subprocess.run(cmd, env=env or self.env, cwd=cwd, capture_output=True, text=True, timeout=60)
        if check and r.returncode:
            raise AssertionError(f"{' '.join(cmd)} exited {r.returncode}: {r.stderr.strip()}\n{self.logs()}")
        return r.stdout

    def start(self, name: str, *args) -> None:
        log = open(os.path.join(self.dir, name + ".out"), "w")
        self.procs.append(
            subprocess.Popen(
                [shutil.which(name, path=SBIN), *args],
                env=self.env,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        )

    def logs(self, n: int = 15) -> str:
        out = []
        for name in ("munged.out", "slurmctld.log", "slurmd.log"):
            path = os.path.join(self.dir, name)
            if os.path.exists(path):
                out.append(f"--- {path} (last {n} lines)\n" + "".join(open(path).readlines()[-n:]))
        return "\n".join(out)

    def submit(self, script: str, cwd, **env) -> int:
        out = self.run("sbatch", "--parsable", script, cwd=cwd, env={**self.env, **env})
        return int(out.strip().split(";")[0])

    def job(self, jobid: int) -> dict:
        out = self.run("scontrol", "show", "job", "-o", str(jobid))
        return dict(re.findall(r"(\w+)=(\S*)", out))

    def wait(self, jobid: int, until, what: str, timeout: float, output=None) -> dict:
        t = time.monotonic()
        while time.monotonic() - t < timeout:
            job = self.job(jobid)
            if until(job):
                return job
            time.sleep(0.5)
        text = open(output).read()[-4000:] if output and os.path.exists(output) else "(no job output)"
        raise AssertionError(
            f"job {jobid}: {what} not within {timeout:.0f} s; now {job.get('JobState')} "
            f"({job.get('Reason')}).\n{text}\n{self.logs()}"
        )

    def tasks(self, jobid: int) -> dict[int, int]:
        """{SLURM_PROCID: pid} of this job's python processes (srun's tasks, not srun), found through /proc."""
        found, python = {}, os.path.realpath(sys.executable)
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                with open(f"/proc/{pid}/environ", "rb") as f:
                    env = dict(kv.split(b"=", 1) for kv in f.read().split(b"\0") if b"=" in kv)
                exe = os.path.realpath(f"/proc/{pid}/exe")
            except OSError:
                continue
            if env.get(b"SLURM_JOB_ID") == str(jobid).encode() and exe == python and b"SLURM_PROCID" in env:
                found[int(env[b"SLURM_PROCID"])] = int(pid)
        return found

    def stop(self) -> None:
        """Cancel every job, wait for them to go, stop the daemons; then end any process a job left."""
        if any(p.poll() is None for p in self.procs):
            self.run("scancel", "--user", "root", check=False)
            t = time.monotonic()
            while time.monotonic() - t < 30 and self.run("squeue", "-h", check=False).strip():
                time.sleep(0.5)
        for p in reversed(self.procs):
            if p.poll() is None:
                p.terminate()
                try:
                    p.wait(15)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()
        conf = self.env["SLURM_CONF"].encode()
        for pid in filter(str.isdigit, os.listdir("/proc")):  # slurmstepd and tasks of this cluster, if any
            try:
                with open(f"/proc/{pid}/environ", "rb") as f:
                    mine = b"SLURM_CONF=" + conf + b"\0" in f.read() + b"\0"
                if mine and int(pid) != os.getpid():
                    os.kill(int(pid), signal.SIGKILL)
            except OSError:
                continue


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """munged, slurmctld and slurmd in a temporary folder; stopped after the module's tests, whatever happens."""
    why = why_slurm_cannot_start()
    if why:
        pytest.skip(why)
    d = str(tmp_path_factory.mktemp("slurm"))
    os.chmod(d, 0o711)  # munged wants its socket's folder searchable
    for sub in ("state", "spool"):
        os.makedirs(os.path.join(d, sub))
    with open(os.path.join(d, "munge.key"), "wb") as f:
        f.write(os.urandom(128))
    os.chmod(os.path.join(d, "munge.key"), 0o600)
    with open(os.path.join(d, "slurm.conf"), "w") as f:
        f.write(slurm_conf(d, free_port(), free_port(), max(2, os.cpu_count() or 1)))
    s = Slurm(d)
    try:
        s.start(
            "munged",
            "--foreground",
            "--force",
            f"--socket={d}/munge.socket",
            f"--key-file={d}/munge.key",
            f"--pid-file={d}/munged.pid",
            f"--seed-file={d}/munged.seed",
            f"--log-file={d}/munged.log",
        )
        t = time.monotonic()
        while not os.path.exists(f"{d}/munge.socket"):
            assert s.procs[0].poll() is None and time.monotonic() - t < 30, "munged did not start\n" + s.logs()
            time.sleep(0.1)
        s.start("slurmctld", "-D")
        s.start("slurmd", "-D", "-N", "localhost")
        t = time.monotonic()
        while s.run("sinfo", "-h", "-n", "localhost", "-o", "%t", check=False).strip() != "idle":
            dead = [p.args[0] for p in s.procs if p.poll() is not None]
            assert not dead and time.monotonic() - t < 60, f"SLURM did not come up (exited: {dead})\n{s.logs()}"
            time.sleep(0.5)
        yield s
    finally:
        s.stop()


def generate(tmp_path, run_dir, tiny_dense, *train_flags) -> str:
    """launch/slurm.py's script for 2 tasks x 4 CPU devices on the one node."""
    script = str(tmp_path / "job.sbatch")
    assert (
        slurm.main(
            [
                "--nodes",
                "1",
                "--tasks-per-node",
                "2",
                "--gpus-per-node",
                "0",
                "--cpu-devices",
                "4",
                "--time",
                "10",
                "--max-requeues",
                "2",
                "--python",
                sys.executable,
                "--workdir",
                ROOT,
                "-o",
                script,
                "--",
                *tiny_dense.flags(run_dir, **JOB, stop_at=STOP_AT),
                *train_flags,
            ]
        )
        == 0
    )
    return script


def wait_for_step(run_dir, step: int, jobid: int, cluster: Slurm, timeout=240) -> None:
    t = time.monotonic()
    while not (os.path.exists(run_dir / "metrics.jsonl") and max(losses(run_dir), default=0) >= step):
        state = cluster.job(jobid)["JobState"]
        assert state in ("PENDING", "RUNNING", "CONFIGURING"), f"job {jobid} is {state} before step {step}"
        assert time.monotonic() - t < timeout, f"job {jobid}: no step {step} within {timeout} s"
        time.sleep(0.2)


def ended(job: dict) -> bool:
    return job["JobState"] in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY")


@pytest.fixture(scope="module")
def uninterrupted(cluster, tiny_dense, tmp_path_factory):
    """One 2-task job of the shared schedule, never signalled: (its losses, its output)."""
    tmp = tmp_path_factory.mktemp("uninterrupted")
    jobid = cluster.submit(generate(tmp, tmp / "run", tiny_dense), cwd=tmp)
    out = tmp / f"slurm-{jobid}.out"
    job = cluster.wait(jobid, ended, "end", 300, out)
    text = out.read_text()
    assert job["JobState"] == "COMPLETED" and job["ExitCode"] == "0:0", text[-4000:]
    return losses(tmp / "run"), text


def test_two_tasks_train_under_slurm_with_the_losses_of_one_process(uninterrupted, tiny_dense, tmp_path):
    got, text = uninterrupted
    for i in (0, 1):  # JAX's SLURM detection: both tasks, 4 devices each
        assert f"stencil: distributed (slurm): process {i} of 2, 4 local / 8 global devices" in text, text[-4000:]
    assert "mesh {'data': 8, 'context': 1, 'model': 1}" in text and "no checkpoint yet, a fresh start" in text
    one = train.main(tiny_dense.config(tmp_path / "one", **JOB, stop_at=STOP_AT))["losses"]  # 1 process, 8 devices
    assert sorted(got) == sorted(one) == list(range(1, STOP_AT + 1))
    np.testing.assert_allclose([got[s] for s in sorted(got)], [one[s] for s in sorted(one)], rtol=1e-5)


def test_usr1_saves_requeues_and_the_requeued_job_resumes_bit_exact(cluster, uninterrupted, tiny_dense, tmp_path):
    run = tmp_path / "run"
    jobid = cluster.submit(generate(tmp_path, run, tiny_dense), cwd=tmp_path)
    out = tmp_path / f"slurm-{jobid}.out"
    wait_for_step(run, SIGNAL_AFTER, jobid, cluster)
    t = time.monotonic()
    # what `#SBATCH --signal=USR1@<lead>` makes SLURM do <lead> s before the time limit: SIGUSR1 to every
    # task of the job's steps, not to the batch shell
    cluster.run("scancel", "--signal=USR1", str(jobid))
    job = cluster.wait(jobid, ended, "requeue, resume and end", 300, out)
    text = out.read_text()
    assert job["JobState"] == "COMPLETED" and job["ExitCode"] == "0:0" and job["Restarts"] == "1", text[-5000:]
    [step] = {int(s) for s in re.findall(r"stopped by a signal after step (\d+)", text)}
    assert SIGNAL_AFTER <= step < STOP_AT, text[-5000:]
    assert "srun: error: localhost: tasks 0-1: Exited with exit code 75" in text  # both saved and exited 75
    assert f"train.py exited 75; requeueing job {jobid}" in text
    assert f"job {jobid} (requeued 1 times): {run}, resuming from its newest checkpoint" in text
    got, want = losses(run), uninterrupted[0]
    assert got == want  # every loss, before the signal and after the resume, bit for bit
    print(f"\nsignal at step {step}; signal to the requeued job's end {time.monotonic() - t:.1f} s")


def test_a_task_killed_with_sigkill_fails_the_job_naming_it(cluster, tiny_dense, tmp_path):
    run = tmp_path / "run"
    jobid = cluster.submit(generate(tmp_path, run, tiny_dense), cwd=tmp_path, STENCIL_HEARTBEAT_TIMEOUT="10")
    out = tmp_path / f"slurm-{jobid}.out"
    t = time.monotonic()  # both tasks have joined the run (no need to wait for the compilation and a step)
    while not all(
        f"distributed (slurm): process {i} of 2" in (out.read_text() if out.exists() else "") for i in (0, 1)
    ):
        assert time.monotonic() - t < 240 and not ended(cluster.job(jobid)), "the tasks did not start"
        time.sleep(0.2)
    tasks = cluster.tasks(jobid)
    assert sorted(tasks) == [0, 1], tasks
    t = time.monotonic()
    os.kill(tasks[1], signal.SIGKILL)
    job = cluster.wait(jobid, ended, "end after a task was killed", 120, out)
    took, text = time.monotonic() - t, out.read_text()
    assert job["JobState"] == "FAILED" and job["ExitCode"] != "0:0" and job["Restarts"] == "0", (job, text[-4000:])
    assert "srun: error: localhost: task 1: Killed" in text, text[-4000:]
    # srun's code: task 1's SIGKILL (137), or task 0's abort when it was compiling and its heartbeats stopped
    assert re.search(r"stencil: train.py failed \(exit 13[47]: a task was killed by SIG(KILL|ABRT)", text)
    assert "not requeued" in text and took < 90
    print(f"\nSIGKILL to task 1 -> job {job['JobState']} ({job['ExitCode']}) in {took:.1f} s")
