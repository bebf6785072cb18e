"""Write a Kubernetes manifest (a JobSet, or an indexed Job + headless Service) for N pods.

    python launch/k8s.py --nodes 4 --gpus-per-node 8 --image REGISTRY/stencil:latest --variant dense \
        --preset 1b -o job.yaml -- --steps 20000 --run_dir /data/runs/dense-1b
    kubectl apply -f job.yaml

Each pod runs one process: JOB_COMPLETION_INDEX (set by Kubernetes for indexed Jobs) is
the process id, STENCIL_COORDINATOR points at pod 0 through the headless service's DNS
name, STENCIL_NUM_PROCESSES = N (see shared/runtime/distributed.py; no Kubernetes API access or
`kubernetes` package is needed). The image must hold this repository at --workdir and the
run directory should be on a shared volume (add it to the pod spec). --kind jobset needs the
JobSet controller. Not applied to a real cluster here.

Preemption and restarts (docs/launching.md): Kubernetes sends SIGTERM to a pod it stops, then
SIGKILL after terminationGracePeriodSeconds (--grace-period); train.py finishes its step, saves
a checkpoint and exits 75. The Job's podFailurePolicy replaces a pod that exits 75 (or that
Kubernetes disrupted) without counting it, replaces one that exits 70 (hang watchdog) up to
--max-hung-restarts times per pod, and fails the Job on any other exit code. The container runs
`sh -c`: it adds --resume true exactly when <run_dir>/checkpoints holds a checkpoint, then
`exec`s python (so python, not sh, gets the SIGTERM). --run_dir defaults to runs/<name>.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys

import yaml

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import (
    EXIT_HUNG,
    EXIT_PREEMPTED,
    add_train_args,
    flag_value,
    has_flag,
    if_checkpoint,  # noqa: E402
    refuse_resume_flags,
    train_args,
    write_output,
)

PORT = 1234


def pod_spec(args, cmd: list[str], coordinator: str, subdomain: str) -> dict:
    container = {
        "name": "train",
        "image": args.image,
        "workingDir": args.workdir,
        "command": cmd,
        "env": [
            {"name": "STENCIL_COORDINATOR", "value": coordinator},
            {"name": "STENCIL_NUM_PROCESSES", "value": str(args.nodes)},
            {"name": "STENCIL_INIT_TIMEOUT", "value": "600"},
        ],
        "ports": [{"containerPort": PORT}],
    }
    if args.gpus_per_node:
        container["resources"] = {"limits": {"nvidia.com/gpu": args.gpus_per_node}}
    # restartPolicy Never: a failed pod is replaced by the Job (podFailurePolicy requires it), not restarted in place
    return {
        "subdomain": subdomain,
        "restartPolicy": "Never",
        "terminationGracePeriodSeconds": args.grace_period,
        "containers": [container],
    }


def command(cmd: list[str]) -> list[str]:
    """sh -c: --resume true when the run dir holds a checkpoint (a replaced pod continues), then exec python."""
    run_dir = flag_value(cmd, "--run_dir")
    script = "; ".join(
        [
            f"RUN_DIR={shlex.quote(run_dir)}",
            "set --",
            if_checkpoint(cmd, '"$RUN_DIR"', "set -- --resume true"),
            "exec " + " ".join(shlex.quote(a) for a in cmd) + ' "$@"',
        ]
    )
    return ["/bin/sh", "-c", script]


def pod_failure_policy() -> dict:
    """Rules go in order, the first match wins. 75 (preempted, checkpoint saved) and a disruption by
    Kubernetes (preemption, eviction, node drain): replace the pod, not counted. 70 (hung): replace it,
    counted against backoffLimit. Any other exit code: the Job fails."""
    return {
        "rules": [
            {"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget"}]},
            {
                "action": "Ignore",
                "onExitCodes": {"containerName": "train", "operator": "In", "values": [EXIT_PREEMPTED]},
            },
            {"action": "Count", "onExitCodes": {"containerName": "train", "operator": "In", "values": [EXIT_HUNG]}},
            {
                "action": "FailJob",
                "onExitCodes": {
                    "containerName": "train",
                    "operator": "NotIn",
                    "values": sorted([EXIT_HUNG, EXIT_PREEMPTED]),
                },
            },
        ]
    }


def job_spec(args, cmd, coordinator, subdomain) -> dict:
    # a hang usually stops every pod (each has its own watchdog), so allow max_hung_restarts x nodes counted failures
    return {
        "completionMode": "Indexed",
        "completions": args.nodes,
        "parallelism": args.nodes,
        "backoffLimit": args.max_hung_restarts * args.nodes,
        "podFailurePolicy": pod_failure_policy(),
        "template": {
            "metadata": {"labels": {"app": args.name}},
            "spec": pod_spec(args, command(cmd), coordinator, subdomain),
        },
    }


def manifests(args: argparse.Namespace) -> list[dict]:
    cmd = train_args(args, args.python)
    refuse_resume_flags(cmd, "launch/k8s.py")
    if not has_flag(cmd, "--run_dir"):
        cmd += ["--run_dir", f"runs/{args.name}"]  # put it on a volume every pod shares, or a new pod starts over
    if args.kind == "jobset":
        # JobSet pods are <jobset>-<replicatedJob>-<job index>-<pod index>.<jobset> (its own headless service)
        coordinator = f"{args.name}-workers-0-0.{args.name}:{PORT}"
        return [
            {
                "apiVersion": "jobset.x-k8s.io/v1alpha2",
                "kind": "JobSet",
                "metadata": {"name": args.name},
                "spec": {
                    "failurePolicy": {"maxRestarts": 0},
                    "replicatedJobs": [
                        {
                            "name": "workers",
                            "replicas": 1,
                            "template": {"spec": job_spec(args, cmd, coordinator, args.name)},
                        }
                    ],
                },
            }
        ]
    coordinator = f"{args.name}-0.{args.name}:{PORT}"  # indexed Job pods are <job>-<index>.<subdomain>
    service = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": args.name},
        "spec": {
            "clusterIP": "None",
            "publishNotReadyAddresses": True,
            "selector": {"app": args.name},
            "ports": [{"port": PORT, "name": "coordinator"}],
        },
    }
    job = {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {"name": args.name},
        "spec": job_spec(args, cmd, coordinator, args.name),
    }
    return [service, job]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--kind", choices=("jobset", "job"), default="jobset")
    p.add_argument("--name", default="stencil")
    p.add_argument("--nodes", type=int, default=2, help="pods = processes")
    p.add_argument("--gpus-per-node", type=int, default=8, help="0 = CPU pods")
    p.add_argument("--image", required=True)
    p.add_argument("--workdir", default="/stencil", help="the repository inside the image")
    p.add_argument("--python", default="python")
    p.add_argument(
        "--grace-period",
        type=int,
        default=300,
        help="terminationGracePeriodSeconds: how long a stopped pod has between SIGTERM and SIGKILL to "
        "finish its step and save; more than one step plus one checkpoint save (default 300)",
    )
    p.add_argument(
        "--max-hung-restarts",
        type=int,
        default=3,
        help="pods exiting 70 (hang watchdog) are replaced until this many x --nodes have failed "
        "(the Job's backoffLimit); pods exiting 75 (preempted) are always replaced (default 3)",
    )
    p.add_argument("-o", "--output", default="-")
    add_train_args(p)
    args = p.parse_args(argv)
    if args.grace_period < 1:
        p.error(f"--grace-period must be >= 1 second, got {args.grace_period}")
    if args.max_hung_restarts < 0:
        p.error(f"--max-hung-restarts must be >= 0, got {args.max_hung_restarts}")
    return write_output(
        yaml.safe_dump_all(manifests(args), sort_keys=False), args.output, "start with: kubectl apply -f"
    )


if __name__ == "__main__":
    sys.exit(main())
