"""Print the gcloud line that runs a variant's train.py on every worker of a TPU VM slice.

    python launch/tpu_vm.py --name my-v5p-64 --zone us-east5-a --variant dense --preset 8b -- --steps 20000

Every worker runs one process with STENCIL_DISTRIBUTED=auto, so shared/distributed.py
calls jax.distributed.initialize() with no arguments and JAX reads the slice's topology
from the TPU metadata server. The repository must already be at --workdir on every worker
(e.g. `gcloud compute tpus tpu-vm scp --recurse . NAME:~/stencil --worker=all`, then
`pip install -e .` and `pip install 'jax[tpu]'`). Not run on a real TPU here.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import add_train_args, shell, train_args  # noqa: E402


def command(args: argparse.Namespace) -> list[str]:
    remote = f"cd {args.workdir} && STENCIL_DISTRIBUTED=auto {shell(train_args(args, args.python))}"
    return ["gcloud", "compute", "tpus", "tpu-vm", "ssh", args.name, "--zone", args.zone, "--worker=all",
            "--command", remote]


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
