"""Print the gcloud line that runs a variant's train.py on every worker of a TPU VM slice.

    python launch/tpu_vm.py --name my-v5p-64 --zone us-east5-a --variant dense --preset 8b -- --steps 20000

Every worker runs one process with STENCIL_DISTRIBUTED=auto, so shared/runtime/distributed.py
calls jax.distributed.initialize() with no arguments and JAX reads the slice's topology
from the TPU metadata server. The repository must already be at --workdir on every worker
(e.g. `gcloud compute tpus tpu-vm scp --recurse . NAME:~/stencil --worker=all`, then
`pip install -e .` and `pip install 'jax[tpu]'`). Not run on a real TPU here: UNVERIFIED.

Preemption (docs/launching.md), as in slurm.py: nothing requeues a TPU VM, so the line is made to be
run again. It adds --resume true exactly when <run_dir>/checkpoints holds a checkpoint, and `exec`s
python, so that python gets the SIGTERM of a VM that stops (a Spot / preemptible TPU gets about
30 s: train.py finishes its step, saves and exits 75, which the line reports; frequent --save_every
is the real protection). --run_dir defaults to runs/<name>; put it on a filesystem every worker
shares and that outlives the VM (Filestore, a GCS FUSE mount), or a recreated TPU starts over. The
run is tied to the ssh session: if gcloud's connection drops, sshd sends SIGHUP and the run ends
without a save (run gcloud inside tmux or screen).
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import add_train_args, flag_value, has_flag, if_checkpoint, refuse_resume_flags, shell, train_args  # noqa: E402


def command(args: argparse.Namespace) -> list[str]:
    cmd = train_args(args, args.python)
    refuse_resume_flags(cmd, "launch/tpu_vm.py")
    if not has_flag(cmd, "--run_dir"):
        cmd += ["--run_dir", f"runs/{args.name}"]  # a fixed path: the same line run again resumes
    remote = "; ".join(
        [
            f"cd {args.workdir} || exit 1",
            f"RUN_DIR={shell([flag_value(cmd, '--run_dir')])}",
            "set --",
            if_checkpoint(cmd, '"$RUN_DIR"', "set -- --resume true"),
            f'STENCIL_DISTRIBUTED=auto exec {shell(cmd)} "$@"',
        ]
    )
    return [
        "gcloud",
        "compute",
        "tpus",
        "tpu-vm",
        "ssh",
        args.name,
        "--zone",
        args.zone,
        "--worker=all",
        "--command",
        remote,
    ]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--name", required=True, help="the TPU VM")
    p.add_argument("--zone", required=True)
    p.add_argument("--workdir", default="~/stencil", help="the repository on each worker")
    p.add_argument("--python", default="python3")
    add_train_args(p)
    print(shlex.join(command(p.parse_args(argv))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
