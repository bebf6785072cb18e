"""N processes of a variant's train.py on this machine, joined through a coordinator on loopback.

    python launch/local.py --nproc 2 --devices 4 --variant dense -- --steps 20 --run_dir runs/local

Each process gets STENCIL_COORDINATOR=127.0.0.1:<free port>, STENCIL_NUM_PROCESSES and
STENCIL_PROCESS_ID (see shared/runtime/distributed.py) and either K fake CPU devices
(--platform cpu, the default: XLA_FLAGS=--xla_force_host_platform_device_count=K) or its
share of this machine's GPUs (--platform gpu: CUDA_VISIBLE_DEVICES=i*K..i*K+K-1). Output is
streamed line by line, prefixed with [pI]. If any process exits non-zero the others are
stopped (SIGTERM, then SIGKILL 1 s later: without it they can take no step) and this exits non-zero
naming it.

Preemption: SIGTERM, SIGINT (Ctrl-C) and SIGUSR1 sent to this launcher are passed on to every
process (they run in their own sessions, so a terminal's Ctrl-C reaches them only this way,
once). The processes agree on a step, save a checkpoint and exit with 75 (shared/runtime/guard.py);
then this exits with 75 too ("requeue": continue with --resume true). A second signal is
passed on as well, and the processes exit at once. The GPU mode is not
exercised by the tests (no GPU here).
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import EXIT_PREEMPTED, ROOT, add_train_args, train_args  # noqa: E402


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def process_env(i: int, n: int, port: int, devices: int, platform: str, base: dict | None = None) -> dict:
    env = dict(os.environ if base is None else base)
    env.update(
        STENCIL_COORDINATOR=f"127.0.0.1:{port}",
        STENCIL_NUM_PROCESSES=str(n),
        STENCIL_PROCESS_ID=str(i),
        PYTHONUNBUFFERED="1",
    )
    if platform == "cpu":
        flags = re.sub(r"--xla_force_host_platform_device_count=\S+", "", env.get("XLA_FLAGS", "")).strip()
        env["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={devices}".strip()
        env["JAX_PLATFORMS"] = "cpu"
    else:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(str(i * devices + d) for d in range(devices))
    return env


def _pump(i: int, stream, out) -> None:
    for line in iter(stream.readline, b""):
        out.write(f"[p{i}] " + line.decode(errors="replace"))
        out.flush()
    stream.close()


STOP_GRACE_S = 10.0  # SIGTERM to SIGKILL when every process is alive (a timeout, Ctrl-C): time to save
PEER_GONE_GRACE_S = 1.0  # ... when one has died: the rest cannot take a step or a save without it


def _stop(procs: list, grace: float) -> None:
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + grace
    for p in procs:
        try:
            p.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def _describe(rc: int) -> str:
    if rc < 0:
        try:
            return f"was killed by {signal.Signals(-rc).name}"
        except ValueError:
            return f"was killed by signal {-rc}"
    return f"exited with status {rc}"


def _cause(bad: list[tuple[int, int]]) -> str:
    """Which of the failed (process, status) pairs to report: one killed by a signal is the likelier
    cause (its peers then fail on the lost connection), else the lowest process index."""
    i, rc = min(bad, key=lambda b: (b[1] >= 0, b[0]))
    return f"process {i} {_describe(rc)}"


def launch(cmd: list[str], nproc: int, devices: int, platform: str = "cpu", timeout: float = 0, out=sys.stdout) -> int:
    """Run cmd as nproc processes; 0 when all succeed, else 1 after stopping the rest."""
    port = free_port()
    procs = [
        subprocess.Popen(
            cmd,
            cwd=ROOT,
            env=process_env(i, nproc, port, devices, platform),
            start_new_session=True,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        for i in range(nproc)
    ]

    def forward(signum, frame):
        for p in procs:
            if p.poll() is None:
                p.send_signal(signum)

    forwarded = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)
    previous = (
        {s: signal.signal(s, forward) for s in forwarded}
        if threading.current_thread() is threading.main_thread()
        else {}
    )
    pumps = [threading.Thread(target=_pump, args=(i, p.stdout, out), daemon=True) for i, p in enumerate(procs)]
    for t in pumps:
        t.start()
    start, failed = time.monotonic(), None
    try:
        while failed is None and any(p.poll() is None for p in procs):
            if any(p.poll() not in (None, 0, EXIT_PREEMPTED) for p in procs):  # 75: stopping on a signal, saved
                time.sleep(0.5)  # let a peer that failed with it be reaped too
                failed = _cause([(i, p.poll()) for i, p in enumerate(procs) if p.poll() not in (None, 0)])
                break
            if failed is None and timeout and time.monotonic() - start > timeout:
                failed = f"timed out after {timeout:.0f}s"
            time.sleep(0.2)
        if failed is None:
            bad = [(i, p.returncode) for i, p in enumerate(procs) if p.returncode not in (0, EXIT_PREEMPTED)]
            if bad:
                failed = _cause(bad)
    except KeyboardInterrupt:
        failed = "interrupted"
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
    if failed is not None:
        _stop(procs, PEER_GONE_GRACE_S if any(p.poll() is not None for p in procs) else STOP_GRACE_S)
    for t in pumps:
        t.join(5)
    if failed is not None:
        print(f"launch/local.py: {failed}; stopped the other processes", file=sys.stderr, flush=True)
        return 1
    if any(p.returncode == EXIT_PREEMPTED for p in procs):
        print(
            f"launch/local.py: stopped on a signal after a checkpoint; exiting with {EXIT_PREEMPTED} "
            "(continue with --resume true)",
            file=sys.stderr,
            flush=True,
        )
        return EXIT_PREEMPTED
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--nproc", type=int, default=2, help="processes (default 2)")
    p.add_argument("--devices", type=int, default=4, help="devices per process (fake CPU devices, or GPUs)")
    p.add_argument("--platform", choices=("cpu", "gpu"), default="cpu")
    p.add_argument("--timeout", type=float, default=0, help="stop everything after this many seconds (0 = never)")
    add_train_args(p)
    args = p.parse_args(argv)
    if args.nproc < 1 or args.devices < 1:
        p.error("--nproc and --devices must be positive")
    return launch(train_args(args, sys.executable), args.nproc, args.devices, args.platform, args.timeout)


if __name__ == "__main__":
    sys.exit(main())
