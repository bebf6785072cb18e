"""launch/ and shared/runtime/distributed.py: a real 2-process x 4-device run on loopback whose
checkpoint a single 8-device process resumes with the same losses, the generators' output,
and failures that stop the whole run instead of hanging it."""

import os
import re
import subprocess
import sys

import pytest
import yaml

from shared.variant import ROOT, load

from helpers import sub_env  # noqa: E402  (tests/helpers.py)

sys.path.insert(0, os.path.join(ROOT, "launch"))
import k8s  # noqa: E402
import skypilot  # noqa: E402
import slurm  # noqa: E402
import tpu_vm  # noqa: E402

train = load(os.path.join(ROOT, "variants", "dense", "train.py"))
LOCAL = os.path.join(ROOT, "launch", "local.py")
SCRIPT = os.path.join(ROOT, "variants", "dense", "train.py")
LAUNCH = {"steps": 4, "eval_every": 2, "save_every": 2}  # the tiny dense run (conftest's tiny_dense), 4 steps


def _port():
    import local

    return local.free_port()


def test_unreachable_coordinator_times_out():
    env = sub_env(
        STENCIL_COORDINATOR=f"127.0.0.1:{_port()}",
        STENCIL_NUM_PROCESSES="2",
        STENCIL_PROCESS_ID="1",
        STENCIL_INIT_TIMEOUT="3",
    )
    r = subprocess.run(
        [sys.executable, SCRIPT, "--steps", "2", "--warmup_steps", "0"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 1
    assert "process 1 (explicit mode) could not join the run at 127.0.0.1:" in r.stderr, r.stderr[-2000:]
    assert "within 3s (STENCIL_INIT_TIMEOUT)" in r.stderr


def test_detect_modes(monkeypatch):
    from shared.runtime import distributed

    for k in list(os.environ):
        if k.startswith(("STENCIL_", "SLURM_", "OMPI_", "TPU_")) or k == "JOB_COMPLETION_INDEX":
            monkeypatch.delenv(k, raising=False)
    assert distributed.detect()[0] == "single"
    monkeypatch.setenv("STENCIL_COORDINATOR", "pod-0.svc:1234")
    monkeypatch.setenv("STENCIL_NUM_PROCESSES", "4")
    monkeypatch.setenv("JOB_COMPLETION_INDEX", "3")
    assert distributed.detect() == (
        "explicit",
        dict(
            coordinator_address="pod-0.svc:1234", num_processes=4, process_id=3, cluster_detection_method="deactivate"
        ),
    )
    monkeypatch.setenv("STENCIL_PROCESS_ID", "4")
    with pytest.raises(distributed.DistributedError, match="not in"):
        distributed.detect()
    for k in ("STENCIL_COORDINATOR", "STENCIL_NUM_PROCESSES", "STENCIL_PROCESS_ID"):
        monkeypatch.delenv(k)
    for k, v in dict(
        SLURM_JOB_ID="7", SLURM_STEP_NODELIST="n[1-2]", SLURM_NTASKS="2", SLURM_PROCID="1", SLURM_LOCALID="0"
    ).items():
        monkeypatch.setenv(k, v)
    assert distributed.detect() == ("slurm", {"cluster_detection_method": "slurm"})
    monkeypatch.setenv("SLURM_NTASKS", "1")
    assert distributed.detect()[0] == "single"
    monkeypatch.setenv("TPU_WORKER_HOSTNAMES", "w0,w1")
    assert distributed.detect()[0] == "tpu"
    monkeypatch.setenv("STENCIL_DISTRIBUTED", "0")
    assert distributed.detect()[0] == "single"


# ---------------------------------------------------------------- generators

OVER = ["--", "--steps", "1000", "--model.n_layers", "8"]
TRAIN = ["variants/dense/train.py", "--preset", "125m", "--steps", "1000", "--model.n_layers", "8"]


def _run(mod, argv, capsys):
    assert mod.main(argv) == 0
    return capsys.readouterr().out


def test_slurm_script(capsys):
    out = _run(
        slurm,
        ["--nodes", "4", "--gpus-per-node", "8", "--partition", "gpu", "--variant", "dense", "--preset", "125m", *OVER],
        capsys,
    )
    assert out.startswith("#!/bin/bash\n")
    for line in (
        "#SBATCH --nodes=4",
        "#SBATCH --ntasks-per-node=1",
        "#SBATCH --gpus-per-node=8",
        "#SBATCH --partition=gpu",
        "export JAX_LOCAL_DEVICE_IDS=0,1,2,3,4,5,6,7",
    ):
        assert line in out.splitlines()
    for line in ("#SBATCH --requeue", "#SBATCH --signal=USR1@180", "#SBATCH --open-mode=append"):
        assert line in out.splitlines()
    [srun] = [ln for ln in out.splitlines() if ln.startswith("srun ")]
    assert "python " + " ".join(TRAIN) + ' --run_dir "runs/dense-$SLURM_JOB_ID"' in srun
    r = subprocess.run(["bash", "-n"], input=out, text=True, capture_output=True)
    assert r.returncode == 0, r.stderr
    out = _run(slurm, ["--signal-lead", "600", "--max-requeues", "3", *OVER], capsys)
    assert "#SBATCH --signal=USR1@600" in out.splitlines() and "MAX_REQUEUES=3" in out.splitlines()
    for bad in (["--signal-lead", "0"], ["--max-requeues", "-1"]):
        with pytest.raises(SystemExit):
            slurm.main(bad)
    for flag in (["--resume", "true"], ["--resume_from", "100"]):
        with pytest.raises(SystemExit, match="adds --resume true itself"):
            slurm.main(["--", *flag])


def test_slurm_script_tasks_devices_and_time(capsys):
    """Several tasks per node (CPU processes with their own XLA devices, or a task per GPU), and the
    options checked against each other before any script is written."""
    lines = _run(
        slurm,
        ["--nodes", "1", "--tasks-per-node", "2", "--gpus-per-node", "0", "--cpu-devices", "4", "--time", "30", *OVER],
        capsys,
    ).splitlines()
    assert "#SBATCH --ntasks-per-node=2" in lines and "#SBATCH --time=30" in lines
    assert 'export XLA_FLAGS="${XLA_FLAGS:-} --xla_force_host_platform_device_count=4"' in lines
    assert "export JAX_PLATFORMS=cpu" in lines and not any("GPU" in ln or "gpus" in ln for ln in lines)
    lines = _run(slurm, ["--tasks-per-node", "8", "--gpus-per-node", "8", *OVER], capsys).splitlines()
    assert "#SBATCH --ntasks-per-node=8" in lines  # a task per GPU: JAX maps SLURM_LOCALID to its GPU
    assert not any("JAX_LOCAL_DEVICE_IDS" in ln or "XLA_FLAGS" in ln for ln in lines)
    assert [slurm.time_limit_s(t) for t in ("30", "30:15", "2:00:00", "1-0", "1-2:30", "1-0:0:5", "UNLIMITED")] == [
        1800,
        1815,
        7200,
        86400,
        95400,
        86405,
        0,
    ]
    for bad, why in (
        (["--tasks-per-node", "3"], "use 1 .* or 8"),
        (["--cpu-devices", "4"], "for CPU nodes"),
        (["--time", "2"], "not shorter than --time 2"),
        (["--time", "1:2:3:4"], "not in a format"),
        (["--time", "-5"], "not in a format"),
        (["--tasks-per-node", "0"], "must be >= 1"),
        (["--gpus-per-node", "0", "--cpu-devices", "-1"], "must be >= 0"),
    ):
        with pytest.raises(SystemExit):
            slurm.main(bad)
        assert re.search(why, capsys.readouterr().err), bad


def _stubs(tmp_path, names):
    """Executables in a folder of their own that append their argv (one line, space-joined) to
    <tmp>/<name>.calls and exit with $<NAME>_RC (0 if unset)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    for name in names:
        stub = bin_dir / name
        stub.write_text(f'#!/bin/sh\necho "$*" >> "{tmp_path / (name + ".calls")}"\nexit "${{{name.upper()}_RC:-0}}"\n')
        stub.chmod(0o755)
    return str(bin_dir)


def _calls(tmp_path, name):
    path = tmp_path / (name + ".calls")
    return path.read_text().splitlines() if path.exists() else []


def test_slurm_script_requeues_on_75_and_70_only(tmp_path, capsys):
    """The generated script run by bash, srun and scontrol stubbed: which exit codes requeue, the cap,
    and --resume true exactly when the run dir holds a finished checkpoint."""
    job = tmp_path / "job.sbatch"
    assert slurm.main(["--nodes", "2", "--workdir", str(tmp_path), "--max-requeues", "2", "-o", str(job), *OVER]) == 0
    capsys.readouterr()
    path = _stubs(tmp_path, ["srun", "scontrol"])

    def run(srun_rc, restarts=None, scontrol_rc=0):
        for name in ("srun", "scontrol"):
            (tmp_path / (name + ".calls")).unlink(missing_ok=True)
        env = dict(
            os.environ,
            PATH=path + os.pathsep + os.environ["PATH"],
            SLURM_JOB_ID="42",
            SRUN_RC=str(srun_rc),
            SCONTROL_RC=str(scontrol_rc),
        )
        env.pop("SLURM_RESTART_COUNT", None)
        if restarts is not None:
            env["SLURM_RESTART_COUNT"] = str(restarts)
        r = subprocess.run(["bash", str(job)], env=env, capture_output=True, text=True, timeout=30)
        [srun] = _calls(tmp_path, "srun")
        return r, srun, _calls(tmp_path, "scontrol")

    r, srun, scontrol = run(0)
    assert r.returncode == 0 and scontrol == [], r.stderr
    assert srun.startswith("--kill-on-bad-exit=0 python variants/dense/train.py ")
    assert srun.endswith("--run_dir runs/dense-42"), srun  # no checkpoint yet: no --resume
    assert "runs/dense-42, no checkpoint yet" in r.stdout
    for rc in (75, 70):
        r, srun, scontrol = run(rc)
        assert r.returncode == 0 and scontrol == ["requeue 42"], (rc, r.stderr)
        assert "requeueing job 42" in r.stderr
    r, srun, scontrol = run(75, scontrol_rc=1)  # a job that cannot be requeued fails, with srun's code
    assert r.returncode == 75 and scontrol == ["requeue 42"] and "scontrol requeue failed" in r.stderr
    lock = tmp_path / "runs" / "dense-42" / "LOCK"
    lock.parent.mkdir(parents=True)
    for rc in (1, 137):
        lock.write_text("{}")
        r, srun, scontrol = run(rc)
        assert r.returncode == rc and scontrol == [], (rc, r.stderr)
        why = ": a task was killed by SIGKILL" if rc == 137 else ")"  # srun's 128 + n: a task died of signal n
        assert f"train.py failed (exit {rc}{why}" in r.stderr and "not requeued" in r.stderr
        assert lock.exists()  # maybe another run's (a refused second run exits 1)
    run(70)
    assert not lock.exists()  # left by an abort of this job's process 0, which has exited
    r, srun, scontrol = run(75, restarts=1)
    assert scontrol == ["requeue 42"]
    r, srun, scontrol = run(70, restarts=2)  # the cap: requeued twice already
    assert r.returncode == 70 and scontrol == [], r.stderr
    assert "already requeued 2 times (MAX_REQUEUES=2): not requeued" in r.stderr

    ckpts = tmp_path / "runs" / "dense-42" / "checkpoints"
    (ckpts / "step_00000002.tmp").mkdir(parents=True)  # an unfinished save is not a checkpoint
    (ckpts / "step_00000003" / "arrays").mkdir(parents=True)  # nor is one without its commit record
    assert run(75)[1].endswith("--run_dir runs/dense-42")
    (ckpts / "step_00000001").mkdir()
    (ckpts / "step_00000001" / "metadata.json").write_text("{}")
    r, srun, scontrol = run(75, restarts=1)
    assert srun.endswith("--run_dir runs/dense-42 --resume true"), srun
    assert "resuming from its newest checkpoint" in r.stdout and scontrol == ["requeue 42"]


@pytest.mark.parametrize("kind", ["jobset", "job"])
def test_k8s_manifest(kind, capsys):
    docs = list(
        yaml.safe_load_all(
            _run(
                k8s,
                [
                    "--kind",
                    kind,
                    "--nodes",
                    "4",
                    "--image",
                    "reg/stencil:1",
                    "--name",
                    "run1",
                    "--variant",
                    "dense",
                    "--preset",
                    "125m",
                    *OVER,
                ],
                capsys,
            )
        )
    )
    if kind == "jobset":
        [js] = docs
        assert js["kind"] == "JobSet" and js["spec"]["replicatedJobs"][0]["replicas"] == 1
        job = js["spec"]["replicatedJobs"][0]["template"]["spec"]
        coordinator = "run1-workers-0-0.run1:1234"
    else:
        svc, j = docs
        assert svc["kind"] == "Service" and svc["spec"]["clusterIP"] == "None"
        assert svc["spec"]["selector"] == j["spec"]["template"]["metadata"]["labels"]
        job, coordinator = j["spec"], "run1-0.run1:1234"
    assert job["completionMode"] == "Indexed" and job["completions"] == job["parallelism"] == 4
    pod = job["template"]["spec"]
    assert pod["subdomain"] == "run1"
    [c] = pod["containers"]
    assert c["image"] == "reg/stencil:1" and c["command"][:2] == ["/bin/sh", "-c"]
    assert c["command"][2].endswith("exec python " + " ".join(TRAIN) + ' --run_dir runs/run1 "$@"')
    assert pod["restartPolicy"] == "Never" and pod["terminationGracePeriodSeconds"] == 300
    rules = job["podFailurePolicy"]["rules"]
    assert rules == [
        {"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget"}]},
        {"action": "Ignore", "onExitCodes": {"containerName": "train", "operator": "In", "values": [75]}},
        {"action": "Count", "onExitCodes": {"containerName": "train", "operator": "In", "values": [70]}},
        {"action": "FailJob", "onExitCodes": {"containerName": "train", "operator": "NotIn", "values": [70, 75]}},
    ]
    assert job["backoffLimit"] == 3 * 4  # --max-hung-restarts (3) per pod
    env = {e["name"]: e["value"] for e in c["env"]}
    assert env["STENCIL_COORDINATOR"] == coordinator and env["STENCIL_NUM_PROCESSES"] == "4"
    assert c["resources"]["limits"]["nvidia.com/gpu"] == 8


def test_k8s_command_resumes_from_a_checkpoint(tmp_path, capsys):
    """The container's sh -c line run by sh, python stubbed: --resume true exactly when the run dir
    holds a finished checkpoint, and python replaces sh (exec), so it is what gets SIGTERM."""
    docs = list(
        yaml.safe_load_all(
            _run(
                k8s,
                [
                    "--kind",
                    "job",
                    "--image",
                    "i",
                    "--grace-period",
                    "900",
                    "--max-hung-restarts",
                    "1",
                    "--nodes",
                    "2",
                    "--",
                    "--steps",
                    "10",
                    "--run_dir",
                    "/data/r x",
                ],
                capsys,
            )
        )
    )
    job = docs[1]["spec"]
    assert job["template"]["spec"]["terminationGracePeriodSeconds"] == 900 and job["backoffLimit"] == 2
    [c] = job["template"]["spec"]["containers"]
    assert c["command"][:2] == ["/bin/sh", "-c"]
    run_dir = tmp_path / "data" / "r x"
    _resumes(c["command"][2].replace("/data/r x", str(run_dir)), run_dir, tmp_path)
    for bad in (["--grace-period", "0"], ["--max-hung-restarts", "-1"]):
        with pytest.raises(SystemExit):
            k8s.main(["--image", "i", *bad])
    with pytest.raises(SystemExit, match="adds --resume true itself"):
        k8s.main(["--image", "i", "--", "--resume", "true"])


def test_skypilot_task(capsys):
    t = yaml.safe_load(
        _run(
            skypilot,
            ["--nodes", "3", "--accelerators", "H100:8", "--variant", "dense", "--preset", "125m", "--use-spot", *OVER],
            capsys,
        )
    )
    assert t["num_nodes"] == 3 and t["resources"]["accelerators"] == "H100:8" and t["resources"]["use_spot"]
    assert t["resources"]["job_recovery"] == {"max_restarts_on_errors": 3, "recover_on_exit_codes": [75]}
    assert t["workdir"] and "pip install" in t["setup"]
    lines = t["run"].splitlines()
    assert "exec python " + " ".join(TRAIN) + ' --run_dir runs/stencil-dense "$@"' in lines
    assert any('STENCIL_PROCESS_ID="$SKYPILOT_NODE_RANK"' in ln for ln in lines)
    for bad in (["--max-restarts-on-errors", "-1"], ["--", "--resume", "true"]):
        with pytest.raises(SystemExit):
            skypilot.main(bad)


def _resumes(script: str, run_dir, tmp_path, shell: str = "/bin/sh", **env) -> None:
    """Run a generated shell line with `python` / `python3` stubbed: no --resume while the run dir holds
    no finished checkpoint, --resume true once it does, and python replaces the shell (exec), so it
    gets the signals a stopping machine sends."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    for name in ("python", "python3"):
        (bin_dir / name).write_text('#!/bin/sh\necho "$$ $*"\n')
        (bin_dir / name).chmod(0o755)
    env = dict(os.environ, PATH=str(bin_dir) + os.pathsep + os.environ["PATH"], **env)

    def run():
        p = subprocess.Popen([shell, "-c", script], env=env, cwd=tmp_path, stdout=subprocess.PIPE, text=True)
        out, _ = p.communicate(timeout=30)
        pid, args = out.strip().split(" ", 1)
        assert p.returncode == 0 and int(pid) == p.pid, out  # exec: python has the shell's pid
        return args

    first = run()
    assert first.startswith("variants/dense/train.py ") and first.endswith(f" --run_dir {run_dir}"), first
    (run_dir / "checkpoints" / "step_00000004.tmp").mkdir(parents=True)  # an unfinished save
    (run_dir / "checkpoints" / "step_00000005").mkdir()  # a partial save: no commit record
    assert run() == first
    (run_dir / "checkpoints" / "step_00000003").mkdir()
    (run_dir / "checkpoints" / "step_00000003" / "metadata.json").write_text("{}")  # committed
    assert run() == first + " --resume true"


def test_skypilot_and_tpu_lines_resume_from_a_checkpoint(tmp_path, capsys):
    t = yaml.safe_load(_run(skypilot, ["--", "--steps", "10", "--run_dir", str(tmp_path / "sky")], capsys))
    _resumes(
        t["run"],
        tmp_path / "sky",
        tmp_path,
        shell="bash",
        SKYPILOT_NODE_IPS="10.0.0.1\n10.0.0.2",
        SKYPILOT_NUM_NODES="2",
        SKYPILOT_NODE_RANK="1",
    )
    import shlex

    argv = shlex.split(
        _run(
            tpu_vm,
            [
                "--name",
                "v5p",
                "--zone",
                "z",
                "--workdir",
                str(tmp_path),
                "--",
                "--steps",
                "10",
                "--run_dir",
                str(tmp_path / "tpu"),
            ],
            capsys,
        )
    )
    _resumes(argv[10], tmp_path / "tpu", tmp_path)
    with pytest.raises(SystemExit, match="adds --resume true itself"):
        tpu_vm.main(["--name", "v5p", "--zone", "z", "--", "--resume_from", "3"])


def test_tpu_vm_command(capsys):
    import shlex

    out = _run(
        tpu_vm, ["--name", "v5p", "--zone", "us-east5-a", "--variant", "dense", "--preset", "125m", *OVER], capsys
    )
    argv = shlex.split(out)
    assert argv[:9] == ["gcloud", "compute", "tpus", "tpu-vm", "ssh", "v5p", "--zone", "us-east5-a", "--worker=all"]
    assert argv[9] == "--command"
    assert "STENCIL_DISTRIBUTED=auto exec python3 " + " ".join(TRAIN) + ' --run_dir runs/v5p "$@"' in argv[10]


def test_generators_reject_unknown_variant_and_preset():
    with pytest.raises(SystemExit, match="unknown variant"):
        slurm.main(["--variant", "nope"])
    with pytest.raises(SystemExit, match="no preset"):
        skypilot.main(["--preset", "nope"])
