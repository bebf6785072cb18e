"""Write a SkyPilot task YAML that runs a variant's train.py on N nodes.

    python launch/skypilot.py --nodes 2 --accelerators H100:8 --variant dense --preset 1b -o task.yaml -- --steps 20000
    sky launch -c stencil task.yaml

SkyPilot syncs this repository as the workdir, installs it, and runs the command on every
node with SKYPILOT_NODE_RANK, SKYPILOT_NUM_NODES and SKYPILOT_NODE_IPS set; the run script
maps them to STENCIL_COORDINATOR (first node's IP), STENCIL_NUM_PROCESSES and
STENCIL_PROCESS_ID (see shared/distributed.py). Not run on a real cloud here.
"""

from __future__ import annotations

import argparse
import os
import sys

import yaml

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import ROOT, add_train_args, shell, train_args, write_output  # noqa: E402

PORT = 1234


def task(args: argparse.Namespace) -> dict:
    cmd = train_args(args, "python")
    run = "\n".join([
        "set -euo pipefail",
        'export STENCIL_COORDINATOR="$(echo "$SKYPILOT_NODE_IPS" | head -n1):%d"' % PORT,
        'export STENCIL_NUM_PROCESSES="$SKYPILOT_NUM_NODES"',
        'export STENCIL_PROCESS_ID="$SKYPILOT_NODE_RANK"',
        shell(cmd), ""])
    extra = "[gpu]" if args.accelerators and not args.accelerators.lower().startswith("tpu") else ""
    out = {"name": f"stencil-{args.variant}", "num_nodes": args.nodes, "workdir": args.workdir,
           "resources": {}, "setup": f"pip install -e '.{extra}'\n", "run": run}
    if args.accelerators:
        out["resources"]["accelerators"] = args.accelerators
    if args.cloud:
        out["resources"]["cloud"] = args.cloud
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nodes", type=int, default=2)
    p.add_argument("--accelerators", default="H100:8", help="SkyPilot accelerator spec, '' = CPU nodes")
    p.add_argument("--cloud", default="")
    p.add_argument("--workdir", default=ROOT)
    p.add_argument("-o", "--output", default="-")
    add_train_args(p)
    args = p.parse_args(argv)
    return write_output(yaml.safe_dump(task(args), sort_keys=False), args.output, "start with: sky launch -c stencil")


if __name__ == "__main__":
    sys.exit(main())
