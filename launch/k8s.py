"""Write a Kubernetes manifest (a JobSet, or an indexed Job + headless Service) for N pods.

    python launch/k8s.py --nodes 4 --gpus-per-node 8 --image REGISTRY/stencil:latest --variant dense \
        --preset 1b -o job.yaml -- --steps 20000 --run_dir /data/runs/dense-1b
    kubectl apply -f job.yaml

Each pod runs one process: JOB_COMPLETION_INDEX (set by Kubernetes for indexed Jobs) is
the process id, STENCIL_COORDINATOR points at pod 0 through the headless service's DNS
name, STENCIL_NUM_PROCESSES = N (see shared/distributed.py; no Kubernetes API access or
`kubernetes` package is needed). The image must hold this repository at --workdir and the
run directory should be on a shared volume (add it to the pod spec). --kind jobset needs the
JobSet controller. Not applied to a real cluster here.
"""

from __future__ import annotations

import argparse
import os
import sys

import yaml

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import add_train_args, train_args, write_output  # noqa: E402

PORT = 1234


def pod_spec(args, cmd: list[str], coordinator: str, subdomain: str) -> dict:
    container = {
        "name": "train", "image": args.image, "workingDir": args.workdir, "command": cmd,
        "env": [{"name": "STENCIL_COORDINATOR", "value": coordinator},
                {"name": "STENCIL_NUM_PROCESSES", "value": str(args.nodes)},
                {"name": "STENCIL_INIT_TIMEOUT", "value": "600"}],
        "ports": [{"containerPort": PORT}],
    }
    if args.gpus_per_node:
        container["resources"] = {"limits": {"nvidia.com/gpu": args.gpus_per_node}}
    return {"subdomain": subdomain, "restartPolicy": "Never", "containers": [container]}


def job_spec(args, cmd, coordinator, subdomain) -> dict:
    return {"completionMode": "Indexed", "completions": args.nodes, "parallelism": args.nodes, "backoffLimit": 0,
            "template": {"metadata": {"labels": {"app": args.name}},
                         "spec": pod_spec(args, cmd, coordinator, subdomain)}}


def manifests(args: argparse.Namespace) -> list[dict]:
    cmd = train_args(args, args.python)
    if args.kind == "jobset":
        # JobSet pods are <jobset>-<replicatedJob>-<job index>-<pod index>.<jobset> (its own headless service)
        coordinator = f"{args.name}-workers-0-0.{args.name}:{PORT}"
        return [{"apiVersion": "jobset.x-k8s.io/v1alpha2", "kind": "JobSet", "metadata": {"name": args.name},
                 "spec": {"failurePolicy": {"maxRestarts": 0},
                          "replicatedJobs": [{"name": "workers", "replicas": 1,
                                              "template": {"spec": job_spec(args, cmd, coordinator, args.name)}}]}}]
    coordinator = f"{args.name}-0.{args.name}:{PORT}"  # indexed Job pods are <job>-<index>.<subdomain>
    service = {"apiVersion": "v1", "kind": "Service", "metadata": {"name": args.name},
               "spec": {"clusterIP": "None", "publishNotReadyAddresses": True, "selector": {"app": args.name},
                        "ports": [{"port": PORT, "name": "coordinator"}]}}
    job = {"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": args.name},
           "spec": job_spec(args, cmd, coordinator, args.name)}
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
    p.add_argument("-o", "--output", default="-")
    add_train_args(p)
    args = p.parse_args(argv)
    return write_output(yaml.safe_dump_all(manifests(args), sort_keys=False), args.output, "start with: kubectl apply -f")


if __name__ == "__main__":
    sys.exit(main())
