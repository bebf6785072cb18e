"""Multi-process start-up on JAX's own distributed runtime; `shared/cli.parse` calls `initialize()`.

One process per host (or per GPU under SLURM, see below); after `initialize()`
`jax.devices()` lists every device of every process, so train.py's mesh spans them all.
A single-process run needs nothing and gets nothing: `initialize()` returns at once.

Modes, checked in this order (the first that matches wins):

    STENCIL_DISTRIBUTED=0       off: never initialise (e.g. a debugging run inside an allocation)
    explicit / Kubernetes       STENCIL_COORDINATOR=host:port (process 0 listens there)
                                STENCIL_NUM_PROCESSES=N
                                STENCIL_PROCESS_ID=i, or else JOB_COMPLETION_INDEX=i (set by an
                                indexed Job / JobSet, see launch/k8s.py); launch/local.py uses this
                                mode. JAX's cluster detection is switched off here.
    SLURM                       SLURM_JOB_ID, SLURM_STEP_NODELIST, SLURM_PROCID, SLURM_LOCALID and
                                SLURM_NTASKS > 1 (inside `srun`): delegated to JAX's own detection
                                (coordinator = first node of the step, port from the job id, or
                                JAX_COORDINATOR_PORT). On GPUs JAX then gives each task one GPU
                                (SLURM_LOCALID) unless JAX_LOCAL_DEVICE_IDS is set (launch/slurm.py
                                runs one task per node and sets it to all the node's GPUs).
    Open MPI                    OMPI_COMM_WORLD_SIZE > 1 (mpirun): delegated to JAX.
    TPU VM slice / GKE TPU      TPU_WORKER_HOSTNAMES or TPU_PROCESS_ADDRESSES with more than one
                                host: delegated to JAX (which reads the TPU metadata itself).
    STENCIL_DISTRIBUTED=auto    delegate to whatever JAX detects (GCE TPU VM metadata, k8s through
                                the `kubernetes` package, mpi4py, ...); launch/tpu_vm.py sets this.

Tunables: STENCIL_INIT_TIMEOUT (seconds to reach the coordinator, default 300),
STENCIL_HEARTBEAT_TIMEOUT (seconds after which a silent process counts as dead and the
others stop, default 100). On CPU the cross-process collectives are gloo
(`jax_cpu_collectives_implementation`, already the default in jax 0.10; set explicitly).

After start-up, `check_same_config` fails the run naming any process whose config differs
from process 0's, and `install_failure_hook` makes an uncaught exception on process i print
"process i failed: ..." and exit at once (status 1) instead of waiting at JAX's shutdown
barrier; the other processes then fail on a broken collective or on the coordination
service's missed heartbeats, so nobody hangs forever.

Only the local (loopback) and explicit modes are exercised by the tests; SLURM, Kubernetes,
Open MPI and TPU detection follow JAX's documented behaviour but have not been run on real
clusters here.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import sys
import time
import traceback

from shared.errors import StencilError

log = logging.getLogger("stencil")
_START = time.time()  # replaced by process 0's clock once the processes have joined


class DistributedError(StencilError, RuntimeError):
    pass


def _int_env(name: str, default: int | None = None) -> int | None:
    v = os.environ.get(name)
    if v is None or v == "":
        return default
    try:
        return int(v)
    except ValueError:
        raise DistributedError(f"{name}={v!r} is not an integer") from None


def detect() -> tuple[str, dict]:
    """(mode, kwargs for jax.distributed.initialize); mode "single" means do nothing."""
    env = os.environ
    switch = env.get("STENCIL_DISTRIBUTED", "").lower()
    if switch in ("0", "off", "false", "no"):
        return "single", {}
    if env.get("STENCIL_COORDINATOR"):
        n = _int_env("STENCIL_NUM_PROCESSES")
        pid = _int_env("STENCIL_PROCESS_ID", _int_env("JOB_COMPLETION_INDEX"))
        if n is None or pid is None:
            raise DistributedError(
                "STENCIL_COORDINATOR is set, so STENCIL_NUM_PROCESSES and STENCIL_PROCESS_ID "
                "(or JOB_COMPLETION_INDEX) must be too"
            )
        if not 0 <= pid < n:
            raise DistributedError(f"process id {pid} is not in [0, STENCIL_NUM_PROCESSES={n})")
        if n == 1:
            return "single", {}
        return "explicit", dict(
            coordinator_address=env["STENCIL_COORDINATOR"],
            num_processes=n,
            process_id=pid,
            cluster_detection_method="deactivate",
        )
    slurm = ("SLURM_JOB_ID", "SLURM_STEP_NODELIST", "SLURM_NTASKS", "SLURM_PROCID", "SLURM_LOCALID")
    if all(k in env for k in slurm) and _int_env("SLURM_NTASKS", 1) > 1:
        return "slurm", dict(cluster_detection_method="slurm")
    if _int_env("OMPI_COMM_WORLD_SIZE", 1) > 1:
        return "ompi", dict(cluster_detection_method="ompi")
    hosts = env.get("TPU_PROCESS_ADDRESSES") or env.get("TPU_WORKER_HOSTNAMES") or ""
    if len([h for h in hosts.split(",") if h]) > 1:
        return "tpu", {}
    if switch == "auto":
        return "auto", {}
    return "single", {}


def initialize() -> str:
    """Start JAX's distributed runtime if this process is one of several; returns the mode.

    Must run before anything touches a JAX backend (jax.devices(), an array, a jit call).
    """
    import jax

    if jax.distributed.is_initialized():
        return "already"
    mode, kw = detect()
    if mode == "single":
        return mode
    jax.config.update("jax_cpu_collectives_implementation", "gloo")  # only used by the CPU backend
    timeout = _int_env("STENCIL_INIT_TIMEOUT", 300)
    heartbeat = _int_env("STENCIL_HEARTBEAT_TIMEOUT", 100)
    where = kw.get("coordinator_address", "the coordinator JAX detects")
    if kw.get("process_id", 0) != 0:  # JAX aborts the process (no exception) when it cannot register
        _wait_for(where, timeout, kw["process_id"], mode)
    try:
        jax.distributed.initialize(initialization_timeout=timeout, heartbeat_timeout_seconds=heartbeat, **kw)
    except Exception as e:  # noqa: BLE001 - the runtime raises bare XlaRuntimeError / RuntimeError
        pid = kw.get("process_id", "?")
        raise DistributedError(
            f"process {pid} ({mode} mode) could not join the run at {where} within "
            f"{timeout}s (STENCIL_INIT_TIMEOUT): {str(e).strip().splitlines()[0]}"
        ) from e
    global _START
    import numpy as np
    from jax.experimental import multihost_utils

    t = int(_START)
    t = multihost_utils.broadcast_one_to_all(np.array([t >> 16, t & 0xFFFF], np.int32))
    _START = float((int(t[0]) << 16) + int(t[1]))
    log.info(
        "distributed (%s): process %d of %d, %d local / %d global devices",
        mode,
        jax.process_index(),
        jax.process_count(),
        jax.local_device_count(),
        jax.device_count(),
    )
    return mode


def start_time() -> float:
    """When this run started (time.time()), the same on every process: e.g. for run directory names."""
    return _START


def _wait_for(address: str, timeout: int, pid: int, mode: str) -> None:
    """Poll until process 0's coordinator accepts TCP connections, or raise a clear error."""
    import socket

    host, port = address.rsplit(":", 1)
    deadline, err = time.monotonic() + timeout, None
    while time.monotonic() < deadline:
        try:
            socket.create_connection((host.strip("[]"), int(port)), timeout=min(5.0, timeout)).close()
            return
        except OSError as e:
            err = e
            time.sleep(0.5)
    raise DistributedError(
        f"process {pid} ({mode} mode) could not join the run at {address} within {timeout}s "
        f"(STENCIL_INIT_TIMEOUT): {err}; is process 0 running and the address reachable?"
    )


def config_digest(config) -> str:
    import dataclasses

    d = dataclasses.asdict(config) if dataclasses.is_dataclass(config) else config
    return hashlib.sha256(json.dumps(d, sort_keys=True, default=str).encode()).hexdigest()


def check_same_config(config) -> None:
    """All-gather a hash of `config`; raise naming every process whose config differs from process 0's."""
    import jax

    if jax.process_count() == 1:
        return
    import numpy as np
    from jax.experimental import multihost_utils

    digest = config_digest(config)
    mine = np.frombuffer(bytes.fromhex(digest)[:16], np.int32)
    every = np.asarray(multihost_utils.process_allgather(mine)).reshape(jax.process_count(), -1)
    bad = [i for i in range(len(every)) if not np.array_equal(every[i], every[0])]
    if bad:
        raise DistributedError(
            f"config of process(es) {bad} differs from process 0's (this is process "
            f"{jax.process_index()}); every process must get the same preset and flags"
        )


def install_failure_hook() -> None:
    """Uncaught exception on process i: print "process i failed: ..." with the traceback and exit 1 now."""
    import jax

    if jax.process_count() == 1:
        return
    i = jax.process_index()

    def hook(kind, value, tb):
        traceback.print_exception(kind, value, tb)
        print(f"process {i} failed: {kind.__name__}: {value}", file=sys.stderr, flush=True)
        sys.stdout.flush()
        os._exit(1)  # skip JAX's shutdown barrier, which would wait for the processes still running

    sys.excepthook = hook


def read(x):
    """A host value of `x`, also when it is a global array other processes hold parts of.

    Fully replicated arrays (the scalars a train step returns) are read from a local
    copy; others must be fully addressable (make them replicated first).
    """
    import numpy as np

    if hasattr(x, "is_fully_addressable") and not x.is_fully_addressable:
        if not x.is_fully_replicated:
            raise DistributedError(f"array of shape {x.shape} is split across processes; replicate it to read it")
        x = x.addressable_data(0)
    return np.asarray(x)
