"""Write an sbatch script that runs a variant's train.py on N nodes, one task per node.

    python launch/slurm.py --nodes 2 --gpus-per-node 8 --variant dense --preset 125m -o job.sbatch -- --steps 5000
    sbatch job.sbatch

Inside `srun`, shared/runtime/distributed.py hands start-up to JAX's SLURM detection (coordinator
= first node of the step, port from the job id; process id = SLURM_PROCID). One task per
node sees all of its GPUs through JAX_LOCAL_DEVICE_IDS (or, with --tasks-per-node equal to
--gpus-per-node, each task gets the GPU of its SLURM_LOCALID from JAX); on CPU nodes,
--tasks-per-node N --cpu-devices K runs N processes with K XLA CPU devices each. Written for a
generic SLURM site. tests/integration/test_slurm.py runs it on a real single-node SLURM (CPU: 2 tasks x 4
devices, a preemption with requeue and resume, a task killed); the GPU lines are UNVERIFIED.

Preemption and requeue (docs/launching.md): `#SBATCH --signal=USR1@<--signal-lead>` makes SLURM
send SIGUSR1 to every task that long before the time limit; train.py finishes its step, saves
a checkpoint and exits 75. On 75, or 70 (its hang watchdog fired), the script requeues the job
(`scontrol requeue`: same job id, so the same run directory) unless it has already been
requeued --max-requeues times; any other failure fails the job. --run_dir defaults to
runs/<variant>-$SLURM_JOB_ID, and --resume true is added exactly when <run_dir>/checkpoints
holds a checkpoint (train.py refuses --resume without one, and a run dir with one without it).
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import (
    EXIT_HUNG,
    EXIT_PREEMPTED,
    ROOT,
    add_train_args,
    flag_value,
    has_flag,
    if_checkpoint,  # noqa: E402
    refuse_resume_flags,
    shell,
    train_args,
    write_output,
)


def script(args: argparse.Namespace) -> str:
    cmd = train_args(args, args.python)
    refuse_resume_flags(cmd, "launch/slurm.py")
    if not has_flag(cmd, "--run_dir"):
        cmd += ["--run_dir", f"runs/{args.variant}-$SLURM_JOB_ID"]
    run_dir = flag_value(cmd, "--run_dir")
    lines = [
        "#!/bin/bash",
        f"#SBATCH --job-name=stencil-{args.variant}",
        f"#SBATCH --nodes={args.nodes}",
        f"#SBATCH --ntasks-per-node={args.tasks_per_node}",
        f"#SBATCH --time={args.time}",
        "#SBATCH --output=slurm-%j.out",
        "#SBATCH --open-mode=append",  # a requeued job keeps its earlier output (a hang's stacks)
        "#SBATCH --requeue",
        f"#SBATCH --signal=USR1@{args.signal_lead}",
    ]
    if args.gpus_per_node:
        lines.append(f"#SBATCH --gpus-per-node={args.gpus_per_node}")
    if args.cpus_per_task:
        lines.append(f"#SBATCH --cpus-per-task={args.cpus_per_task}")
    for flag in ("partition", "account"):
        if getattr(args, flag):
            lines.append(f"#SBATCH --{flag}={getattr(args, flag)}")
    lines += ["", "set -euo pipefail", f"cd {shell([args.workdir])}"]
    if args.gpus_per_node and args.tasks_per_node == 1:  # one task sees all of its node's GPUs
        lines.append("export JAX_LOCAL_DEVICE_IDS=" + ",".join(str(i) for i in range(args.gpus_per_node)))
    # (a task per GPU: JAX gives task SLURM_LOCALID its GPU by itself)
    if args.cpu_devices:  # the last --xla_force_host_platform_device_count wins
        lines += [
            "export JAX_PLATFORMS=cpu",
            f'export XLA_FLAGS="${{XLA_FLAGS:-}} --xla_force_host_platform_device_count={args.cpu_devices}"',
        ]
    lines += [
        "export STENCIL_INIT_TIMEOUT=${STENCIL_INIT_TIMEOUT:-600}",
        "",
        f"# Preemption (docs/launching.md): SIGUSR1 reaches every task {args.signal_lead} s before the time limit;",
        f"# train.py saves a checkpoint and exits {EXIT_PREEMPTED}. On {EXIT_PREEMPTED}, or {EXIT_HUNG} (its hang "
        "watchdog fired), the job",
        "# requeues itself (same job id, same RUN_DIR) at most MAX_REQUEUES times and resumes from the newest",
        "# checkpoint in RUN_DIR. Any other failure fails the job.",
        f"RUN_DIR={shell([run_dir])}",
        f"MAX_REQUEUES={args.max_requeues}",
        'RESUME=(); START="no checkpoint yet, a fresh start"',
        if_checkpoint(cmd, '"$RUN_DIR"', 'RESUME=(--resume true); START="resuming from its newest checkpoint"'),
        'echo "stencil: job $SLURM_JOB_ID (requeued ${SLURM_RESTART_COUNT:-0} times): $RUN_DIR, $START"',
        "",
        # not --kill-on-bad-exit: the first task to exit 75 would get the others killed by a signal while
        # they shut down, and srun reports a signal (128+n) over any exit code. A crashed task's peers are
        # stopped by JAX's coordination service instead (heartbeats, docs/launching.md).
        "rc=0",
        f'srun --kill-on-bad-exit=0 {shell(cmd)} ${{RESUME[@]+"${{RESUME[@]}}"}} || rc=$?',
        'case "$rc" in',
        "  0) ;;",
        f"  {EXIT_PREEMPTED}|{EXIT_HUNG})",
        # srun has returned, so this run's process 0 is gone; an abort (hang, a second signal) leaves its
        # LOCK behind, naming a node the requeued job may not get (shared/runtime/guard.py RunLock)
        '    rm -f "$RUN_DIR/LOCK"',
        '    if [ "${SLURM_RESTART_COUNT:-0}" -lt "$MAX_REQUEUES" ]; then',
        '      echo "stencil: train.py exited $rc; requeueing job $SLURM_JOB_ID to resume from $RUN_DIR" >&2',
        '      scontrol requeue "$SLURM_JOB_ID" || { echo "stencil: scontrol requeue failed" >&2; exit "$rc"; }',
        "    else",
        '      echo "stencil: train.py exited $rc, but the job was already requeued ${SLURM_RESTART_COUNT:-0} times'
        " (MAX_REQUEUES=$MAX_REQUEUES): not requeued. To continue from its checkpoint, submit a script made with"
        ' -- --run_dir $RUN_DIR" >&2',
        '      exit "$rc"',
        "    fi ;;",
        '  *) why=""',
        # srun exits 128+n when a task was killed by signal n; its own "task N: Killed" line names the task
        '     if [ "$rc" -gt 128 ]; then why=": a task was killed by SIG$(kill -l $((rc - 128)) 2>/dev/null || echo '
        "$((rc - 128))) (the out-of-memory killer, a node problem, or by hand); srun's lines above name it\"; fi",
        '     echo "stencil: train.py failed (exit $rc$why); not requeued" >&2; exit "$rc" ;;',
        "esac",
        "",
    ]
    return "\n".join(lines)


def time_limit_s(text: str) -> int | None:
    """sbatch --time in seconds (0 = no limit), or None if sbatch would not read it."""
    t = text.strip().lower()
    if t in ("unlimited", "infinite", "-1"):
        return 0
    days, dash, rest = t.partition("-") if "-" in t else ("", "", t)
    if dash and not days:
        return None
    try:
        d = int(days) if days else 0
        parts = [int(x) for x in rest.split(":")]
    except ValueError:
        return None
    if d < 0 or any(x < 0 for x in parts) or not 1 <= len(parts) <= 3:
        return None
    if days:  # D-H, D-H:M, D-H:M:S
        h, m, s = (parts + [0, 0])[:3]
    elif len(parts) == 3:
        h, m, s = parts
    else:  # M or M:S
        h, (m, s) = 0, (parts + [0])[:2]
    return ((d * 24 + h) * 60 + m) * 60 + s


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nodes", type=int, default=2)
    p.add_argument(
        "--tasks-per-node",
        type=int,
        default=1,
        help="processes per node (default 1: one process sees all of its node's GPUs); with GPUs, 1 or "
        "--gpus-per-node (a process per GPU)",
    )
    p.add_argument("--gpus-per-node", type=int, default=8, help="0 = CPU nodes")
    p.add_argument(
        "--cpu-devices",
        type=int,
        default=0,
        help="with --gpus-per-node 0: this many XLA CPU devices per process (JAX_PLATFORMS=cpu); "
        "0 = JAX's default (one)",
    )
    p.add_argument("--cpus-per-task", type=int, default=0)
    p.add_argument("--time", default="24:00:00", help="the job's time limit, in sbatch's --time format")
    p.add_argument(
        "--signal-lead",
        type=int,
        default=180,
        help="seconds before the time limit at which every task gets SIGUSR1 (train.py saves and exits "
        "75): more than one step plus one checkpoint save (default 180)",
    )
    p.add_argument(
        "--max-requeues",
        type=int,
        default=20,
        help="requeue on exit 75 (preempted) or 70 (hung) while SLURM_RESTART_COUNT is below this; "
        "every requeue counts (SLURM's own too): allow runtime / --time of them (default 20)",
    )
    p.add_argument("--partition", default="")
    p.add_argument("--account", default="")
    p.add_argument("--workdir", default=ROOT, help="the repository on the cluster (default: this checkout)")
    p.add_argument("--python", default="python")
    p.add_argument("-o", "--output", default="-", help="file to write (default: stdout)")
    add_train_args(p)
    args = p.parse_args(argv)
    if not 1 <= args.signal_lead <= 65535:  # SLURM's limit for --signal's time
        p.error(f"--signal-lead must be 1..65535 seconds, got {args.signal_lead}")
    limit = time_limit_s(args.time)
    if limit is None:
        p.error(
            f"--time {args.time!r} is not in a format sbatch reads: M, M:S, H:M:S, D-H, D-H:M, D-H:M:S, or UNLIMITED"
        )
    if limit and args.signal_lead >= limit:
        p.error(
            f"--signal-lead {args.signal_lead} s is not shorter than --time {args.time} ({limit} s): the "
            "preemption signal would come at the start"
        )
    if args.nodes < 1 or args.tasks_per_node < 1:
        p.error(f"--nodes and --tasks-per-node must be >= 1, got {args.nodes} and {args.tasks_per_node}")
    if args.gpus_per_node < 0 or args.cpu_devices < 0 or args.cpus_per_task < 0:
        p.error("--gpus-per-node, --cpu-devices and --cpus-per-task must be >= 0")
    if args.gpus_per_node and args.tasks_per_node not in (1, args.gpus_per_node):
        p.error(
            f"--tasks-per-node {args.tasks_per_node} with --gpus-per-node {args.gpus_per_node}: use 1 (a "
            f"process sees every GPU of its node) or {args.gpus_per_node} (a process per GPU)"
        )
    if args.gpus_per_node and args.cpu_devices:
        p.error("--cpu-devices is for CPU nodes (--gpus-per-node 0)")
    if args.max_requeues < 0:
        p.error(f"--max-requeues must be >= 0, got {args.max_requeues}")
    return write_output(script(args), args.output, "submit with: sbatch")


if __name__ == "__main__":
    sys.exit(main())
