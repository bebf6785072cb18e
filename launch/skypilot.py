"""Write a SkyPilot task YAML that runs a variant's train.py on N nodes.

    python launch/skypilot.py --nodes 2 --accelerators H100:8 --variant dense --preset 1b -o task.yaml \
        -- --steps 20000 --run_dir /shared/runs/dense-1b
    sky jobs launch -n stencil task.yaml      # a managed job: recovered after a preemption
    sky launch -c stencil task.yaml           # or on a cluster of your own (no recovery)

SkyPilot syncs this repository as the workdir, installs it, and runs the command on every
node with SKYPILOT_NODE_RANK, SKYPILOT_NUM_NODES and SKYPILOT_NODE_IPS set; the run script
maps them to STENCIL_COORDINATOR (first node's IP), STENCIL_NUM_PROCESSES and
STENCIL_PROCESS_ID (see shared/runtime/distributed.py). Not run on a real cloud here: UNVERIFIED.

Preemption and recovery (docs/launching.md), as in slurm.py and k8s.py: the run script adds
--resume true exactly when <run_dir>/checkpoints holds a checkpoint and then `exec`s python (so
python, not bash, gets the SIGTERM of a stopping VM; train.py saves and exits 75). A managed job
(`sky jobs launch`) is recovered on a new cluster when its VMs are preempted, and when train.py
exits 75 (`job_recovery.recover_on_exit_codes`, SkyPilot >= 0.10); any other failure, the hang
watchdog's 70 included, is restarted up to --max-restarts-on-errors times. A recovered job runs on
new machines: --run_dir (default runs/<name>) must be on storage every node shares and that
outlives the cluster (a volume or bucket you add to file_mounts), or it starts over.
"""

from __future__ import annotations

import argparse
import os
import sys

import yaml

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import (
    EXIT_PREEMPTED,
    ROOT,
    add_train_args,
    flag_value,
    has_flag,
    if_checkpoint,
    refuse_resume_flags,  # noqa: E402
    shell,
    train_args,
    write_output,
)

PORT = 1234


def task(args: argparse.Namespace) -> dict:
    cmd = train_args(args, "python")
    refuse_resume_flags(cmd, "launch/skypilot.py")
    name = args.name or f"stencil-{args.variant}"
    if not has_flag(cmd, "--run_dir"):
        cmd += ["--run_dir", f"runs/{name}"]  # a fixed path, so that a recovered job finds its checkpoints
    run = "\n".join(
        [
            "set -euo pipefail",
            'export STENCIL_COORDINATOR="$(echo "$SKYPILOT_NODE_IPS" | head -n1):%d"' % PORT,
            'export STENCIL_NUM_PROCESSES="$SKYPILOT_NUM_NODES"',
            'export STENCIL_PROCESS_ID="$SKYPILOT_NODE_RANK"',
            f"RUN_DIR={shell([flag_value(cmd, '--run_dir')])}",
            "set --",
            if_checkpoint(cmd, '"$RUN_DIR"', "set -- --resume true"),
            "exec " + shell(cmd) + ' "$@"',
            "",
        ]
    )
    extra = "[gpu]" if args.accelerators and not args.accelerators.lower().startswith("tpu") else ""
    out = {
        "name": name,
        "num_nodes": args.nodes,
        "workdir": args.workdir,
        "resources": {
            "job_recovery": {
                "max_restarts_on_errors": args.max_restarts_on_errors,
                "recover_on_exit_codes": [EXIT_PREEMPTED],
            }
        },
        "setup": f"pip install -e '.{extra}'\n",
        "run": run,
    }
    if args.accelerators:
        out["resources"]["accelerators"] = args.accelerators
    if args.cloud:
        out["resources"]["cloud"] = args.cloud
    if args.use_spot:
        out["resources"]["use_spot"] = True
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nodes", type=int, default=2)
    p.add_argument("--accelerators", default="H100:8", help="SkyPilot accelerator spec, '' = CPU nodes")
    p.add_argument("--cloud", default="")
    p.add_argument(
        "--name", default=None, help="the task's name and the default run dir runs/<name> (default stencil-<variant>)"
    )
    p.add_argument(
        "--use-spot", action="store_true", help="spot VMs (with `sky jobs launch`: recovered when preempted)"
    )
    p.add_argument(
        "--max-restarts-on-errors",
        type=int,
        default=3,
        help="a managed job that fails otherwise than by exit 75 (a crash, the hang watchdog's 70) is "
        "restarted from its last checkpoint this many times (default 3)",
    )
    p.add_argument("--workdir", default=ROOT)
    p.add_argument("-o", "--output", default="-")
    add_train_args(p)
    args = p.parse_args(argv)
    if args.nodes < 1 or args.max_restarts_on_errors < 0:
        p.error(
            f"--nodes must be >= 1 and --max-restarts-on-errors >= 0, got {args.nodes} and "
            f"{args.max_restarts_on_errors}"
        )
    return write_output(
        yaml.safe_dump(task(args), sort_keys=False),
        args.output,
        "start with: sky jobs launch -n stencil (recovered when preempted), or sky launch -c stencil",
    )


if __name__ == "__main__":
    sys.exit(main())
