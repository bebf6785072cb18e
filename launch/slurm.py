"""Write an sbatch script that runs a variant's train.py on N nodes, one task per node.

    python launch/slurm.py --nodes 2 --gpus-per-node 8 --variant dense --preset 125m -o job.sbatch -- --steps 5000
    sbatch job.sbatch

Inside `srun`, shared/distributed.py hands start-up to JAX's SLURM detection (coordinator
= first node of the step, port from the job id; process id = SLURM_PROCID). One task per
node sees all of its GPUs through JAX_LOCAL_DEVICE_IDS. --run_dir defaults to
runs/<variant>-$SLURM_JOB_ID so a requeued job resumes itself (--resume true is added when
the job was requeued). Written for a generic SLURM site; not run on a real cluster here.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import ROOT, add_train_args, has_flag, shell, train_args, write_output  # noqa: E402


def script(args: argparse.Namespace) -> str:
    cmd = train_args(args, args.python)
    if not has_flag(cmd, "--run_dir"):
        cmd += ["--run_dir", f"runs/{args.variant}-$SLURM_JOB_ID"]
    lines = ["#!/bin/bash", f"#SBATCH --job-name=stencil-{args.variant}", f"#SBATCH --nodes={args.nodes}",
             "#SBATCH --ntasks-per-node=1", f"#SBATCH --time={args.time}", "#SBATCH --output=slurm-%j.out",
             "#SBATCH --requeue"]
    if args.gpus_per_node:
        lines.append(f"#SBATCH --gpus-per-node={args.gpus_per_node}")
    if args.cpus_per_task:
        lines.append(f"#SBATCH --cpus-per-task={args.cpus_per_task}")
    for flag in ("partition", "account"):
        if getattr(args, flag):
            lines.append(f"#SBATCH --{flag}={getattr(args, flag)}")
    lines += ["", "set -euo pipefail", f"cd {shell([args.workdir])}"]
    if args.gpus_per_node:
        lines.append("export JAX_LOCAL_DEVICE_IDS=" + ",".join(str(i) for i in range(args.gpus_per_node)))
    lines += ["export STENCIL_INIT_TIMEOUT=${STENCIL_INIT_TIMEOUT:-600}",
              'RESUME=(); if [ "${SLURM_RESTART_COUNT:-0}" -gt 0 ]; then RESUME=(--resume true); fi',
              "", f'srun --kill-on-bad-exit=1 {shell(cmd)} "${{RESUME[@]}}"', ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nodes", type=int, default=2)
    p.add_argument("--gpus-per-node", type=int, default=8, help="0 = CPU nodes")
    p.add_argument("--cpus-per-task", type=int, default=0)
    p.add_argument("--time", default="24:00:00")
    p.add_argument("--partition", default="")
    p.add_argument("--account", default="")
    p.add_argument("--workdir", default=ROOT, help="the repository on the cluster (default: this checkout)")
    p.add_argument("--python", default="python")
    p.add_argument("-o", "--output", default="-", help="file to write (default: stdout)")
    add_train_args(p)
    args = p.parse_args(argv)
    return write_output(script(args), args.output, "submit with: sbatch")


if __name__ == "__main__":
    sys.exit(main())
