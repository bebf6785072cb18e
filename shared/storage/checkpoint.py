"""Checkpoints on any storage: one tensorstore (zarr3) array per pytree leaf, plus JSON metadata.

Where: `directory` is any location of shared/storage/objstore.py (a local path, `file://PATH`,
`gs://BUCKET/PREFIX` or `s3://BUCKET/PREFIX`, with the drivers' own credentials). Every operation
(list, write, commit, read, delete) goes through tensorstore's kvstore drivers, so nothing here
needs a rename or a directory.

Layout of a checkpoint directory:

    step_00000100/
        arrays/<leaf name>/  one zarr3 array per leaf (or one OCDBT store, `ocdbt=True`);
                             chunks shaped like the shards of the saved mesh, every chunk written
        files.p<i>.json      what process i wrote: each file's size and CRC32 (or its error)
        metadata.json        THE COMMIT RECORD: step, config, data-loader state, leaves, files

Commit protocol (no rename anywhere):
  1. A save first deletes whatever is stored under its own step's name (a partial save of that
     step from a killed run, or an older save of it: its commit record first), then every
     process passes a barrier.
  2. Each process copies the shards it owns (replica 0 of each) to host memory; that is all the
     loop waits for. A background thread writes them, reads them back for their sizes and
     CRC32s, and writes `files.p<i>.json`.
  3. Process 0 waits until every process's `files.p<i>.json` is there (a barrier through the
     store: no collective runs off the main thread), then writes `metadata.json` last, with
     every file's size and CRC32. One object written in one request: it exists whole or not.
  4. A checkpoint is complete if and only if its commit record exists (and what it records is
     there, `verify`). A folder without one is a partial save: invisible to `latest`,
     `all_checkpoints` and `find`, and deleted by the next save. Nothing a killed save leaves
     can hide or damage the newest complete checkpoint.
  5. Deleting a checkpoint (keep-N, or a retried step) removes its commit record first, then
     the rest: a deletion killed half-way leaves a partial folder, never a damaged checkpoint.
     (Leftovers named `.tmp` / `.deleting` by the older rename-based protocol are deleted too.)
  A save that fails (a full disk, a bucket that disappears) deletes what it wrote and raises
  `CheckpointError`; the earlier checkpoints stay as they were.

Asynchronous saves (`Saver`): at most one save in flight. `Saver.save` blocks for step 1
and the device-to-host copy of this process's shards (on CPU into host buffers the Saver keeps
and reuses, one copy of this process's shards of the state), then returns while the
background thread checks that copy for non-finite values and does steps 2-5. The next
`save`, `wait` (the end of a run, a preemption) wait for it; `check()` (called every step) raises a failed save's error in the
loop; nothing is swallowed. The metadata (data-loader state) is taken when `save` is called,
with the host copy of the same step's state. `save()` is the synchronous form.

Never a bad state: a tree with a non-finite floating-point value (NaN or inf weights) is not
saved (nothing of it is written, and no other process's part is committed); the error names
the leaf, and reaches the loop at its next `check()` like any failed save.

Integrity: a complete checkpoint's commit record lists every file under `arrays/` with its
size and CRC32. Listing checks that each is there at its size (one small ranged read per
file); `restore` also checks the CRC32s (one read of the files). A missing chunk is an error,
never zeros. A damaged newest checkpoint is never skipped in silence: `latest` raises, naming
it, what is wrong, and the complete ones.

Each process writes only the shards it holds, into chunks shaped like those shards, so
multi-process saves never write the same chunk twice. Restoring takes target shardings:
each process reads only the slices its devices need, so a checkpoint restores onto any mesh
shape or device count. (Tested with two processes: to the local S3 server in
tests/fast/test_launch.py, to a local directory under SLURM in tests/integration/test_slurm.py.)
"""

from __future__ import annotations

import collections
import functools
import json
import math
import re
import sys
import threading
import time
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import tensorstore as ts

from shared.storage import objstore
from shared.errors import StencilError

_STEP_DIR = re.compile(r"^step_(\d{8})$")
_LEFTOVER = re.compile(r"^step_(\d{8})\.(tmp|deleting)$")  # left by the older rename-based protocol
COMMIT = "metadata.json"  # the commit record: a checkpoint is complete iff it exists
RESTORE_WINDOW_BYTES = 1 << 30  # how much of a checkpoint `restore` reads ahead of the arrays it makes
COMMIT_TIMEOUT_S = 3600.0  # how long process 0 waits for the other processes' files.p<i>.json


class CheckpointError(StencilError, RuntimeError):
    """A checkpoint that is missing, damaged, or cannot be written; the message names it."""


def _sync(name: str) -> None:
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices(name)


# ---------------------------------------------------------------- storage locations (shared/storage/objstore.py)

is_url, join, location_error = objstore.is_url, objstore.join, objstore.location_error
_parent, _basename = objstore.parent, objstore.basename


def _store(location: str):
    try:
        return objstore.store(location)
    except objstore.LocationError as e:
        raise CheckpointError(str(e)) from e


def _delete(folder: str) -> None:
    """Delete everything stored under `folder`: its commit record first, then the rest."""
    objstore.delete(folder, first=COMMIT)


# ---------------------------------------------------------------- saving


def leaf_names(tree) -> list[str]:
    """Stable file-safe names for the leaves of a pytree, e.g. 'params.layers.wq'."""
    paths = jax.tree_util.tree_flatten_with_path(tree)[0]
    names = [re.sub(r"[^A-Za-z0-9_.\-]", "_", jax.tree_util.keystr(p, simple=True, separator=".")) for p, _ in paths]
    if len(set(names)) != len(names):
        raise CheckpointError(f"pytree leaf names collide: {names}")
    return names


def _spec(root: str, name: str, ocdbt: bool) -> dict:
    if ocdbt:
        kv = {"driver": "ocdbt", "base": objstore.kvstore_spec(join(root, "arrays")), "path": name}
    else:
        kv = objstore.kvstore_spec(join(join(root, "arrays"), name))
    # every chunk is stored, a fill-valued one too: a missing chunk is then always an error, never zeros
    return {"driver": "zarr3", "kvstore": kv, "store_data_equal_to_fill_value": True}


def _sizes_and_crcs(store, keys: list[str], batch: int = 64) -> dict:
    """{key: [size, crc32]}, read back from `store`, `batch` reads at a time."""
    out = {}
    for i in range(0, len(keys), batch):
        part = keys[i : i + batch]
        for key, fut in [(k, store.read(k)) for k in part]:
            r = fut.result()
            if r.state != "value":
                raise CheckpointError(f"{key} was written but is not there when read back")
            out[key] = [len(r.value), zlib.crc32(r.value)]
    return out


def _layout(chunk):
    return ts.ChunkLayout(chunk_shape=chunk) if chunk else None


@functools.lru_cache(maxsize=1024)
def _zarr_json(dtype: str, shape: tuple, chunk: tuple) -> bytes:
    """The zarr.json tensorstore writes for such an array (made in memory)."""
    arr = ts.open(
        {"driver": "zarr3", "kvstore": {"driver": "memory"}},
        create=True,
        dtype=ts.dtype(dtype),
        shape=shape,
        chunk_layout=_layout(chunk),
    ).result()
    return arr.kvstore.read("zarr.json").result().value


def _chunk_key(index, chunk) -> str:
    if not chunk:
        return "c"
    return "c/" + "/".join(str((s.start or 0) // c) for s, c in zip(index, chunk))


def _host_copy(names, leaves, buffers: dict | None = None) -> list[dict]:
    """What this process saves of each leaf, copied to host memory: the only part of a save the loop waits for.

    On CPU a shard's NumPy view is its device buffer (no transfer), which the next step reuses
    (donation): it is copied into `buffers` (kept by the Saver and reused by every save, so that
    after the first save this is one memcpy into memory already mapped, not a fresh allocation's
    page faults). On an accelerator the transfer itself makes the host copy (unverified on GPU)."""
    for x in leaves:
        for shard in x.addressable_shards:
            if shard.replica_id == 0:
                shard.data.copy_to_host_async()
    buffers = {} if buffers is None else buffers
    out = []
    for name, x in zip(names, leaves):
        chunk = tuple(x.sharding.shard_shape(x.shape)) if x.ndim else ()
        shards = []
        for shard in x.addressable_shards:
            if shard.replica_id != 0:
                continue
            data = np.asarray(shard.data)
            if shard.device.platform == "cpu":  # a view of the buffer the next step overwrites: copy it now
                key = (name, str(shard.index), data.shape, data.dtype.str)
                if key not in buffers:
                    buffers[key] = np.empty(data.shape, data.dtype)
                np.copyto(buffers[key], data)
                data = buffers[key]
            shards.append((shard.index, data))
        out.append(
            {
                "name": name,
                "shape": tuple(x.shape),
                "dtype": np.dtype(x.dtype).name,
                "chunk": chunk,
                "shards": shards,
                "floating": bool(jnp.issubdtype(x.dtype, jnp.floating)),
            }
        )
    return out


def _nonfinite_host(host: list[dict]) -> list[str]:
    """Names of the floating-point leaves whose host copy (this process's shards) holds a NaN or an inf."""
    return [h["name"] for h in host if h["floating"] and not all(np.isfinite(d).all() for _, d in h["shards"])]


def _start(directory: str, step: int, tree, metadata: dict, keep: int, ocdbt: bool, buffers: dict | None = None):
    """The blocking part of a save (clearing the step's name, barrier, host copy). Returns
    (path, write): `write()` does the rest (first the finiteness check) and may run on another thread."""
    if ocdbt and jax.process_count() > 1:
        raise CheckpointError("ocdbt=True is single-process only here; use the default zarr3 layout for multi-process")
    names = leaf_names(tree)
    leaves = jax.tree.leaves(tree)
    final = join(directory, f"step_{step:08d}")
    try:
        if jax.process_index() == 0 and _store(final).list().result():
            _delete(final)  # a partial save of this step by a killed run, or an older save of it
    except Exception as e:
        raise CheckpointError(
            f"saving step {step} to {final} failed: cannot clear its name: {type(e).__name__}: {e}"
        ) from e
    _sync(f"ckpt-clear-{step}")
    host = _host_copy(names, leaves, buffers)
    meta = dict(
        metadata,
        step=step,
        ocdbt=ocdbt,
        leaves={h["name"]: {"shape": list(h["shape"]), "dtype": h["dtype"]} for h in host},
    )
    meta = json.loads(json.dumps(meta))  # a copy, taken now: the loader moves on while the write runs
    return final, functools.partial(_write, directory, final, step, host, meta, keep, ocdbt)


class _NotFinite(Exception):
    """A floating-point leaf of the state to save holds a NaN or an inf (raised as CheckpointError)."""


def _write(directory, final, step, host, meta, keep, ocdbt) -> None:
    """The background part of a save: write the shards, record them, commit (process 0), delete old ones."""
    me, n = jax.process_index(), jax.process_count()
    store = _store(final)
    try:
        bad = _nonfinite_host(host)  # before anything is written: a bad state never reaches the store
        if bad:
            raise _NotFinite(f"not saving step {step}: non-finite values in {len(bad)} leaves, e.g. {bad[:3]}")
        pending, mine = [], []
        for h in host:
            if ocdbt:
                arr = ts.open(
                    _spec(final, h["name"], ocdbt),
                    create=True,
                    open=True,
                    dtype=ts.dtype(h["dtype"]),
                    shape=h["shape"],
                    chunk_layout=_layout(h["chunk"]),
                ).result()
            else:  # zarr.json by a plain write (the same bytes from every process), then opened: no conditional
                # create, which tensorstore's s3 driver retries forever when the bucket is gone
                store.write(f"arrays/{h['name']}/zarr.json", _zarr_json(h["dtype"], h["shape"], h["chunk"])).result()
                arr = ts.open(_spec(final, h["name"], ocdbt), open=True).result()
            for index, data in h["shards"]:
                pending.append(arr[index].write(data))
                mine.append(f"arrays/{h['name']}/{_chunk_key(index, h['chunk'])}")
            if me == 0:
                mine.append(f"arrays/{h['name']}/zarr.json")
        for p in pending:
            p.result()
        h = None
        host.clear()  # the host copy is written: let it go before reading back
        if ocdbt:  # its own file layout: record every file under arrays/ (single process)
            mine = ["arrays/" + k.decode() for k in _store(join(final, "arrays")).list().result()]
        files = {k[len("arrays/") :]: v for k, v in _sizes_and_crcs(store, sorted(mine)).items()}
        if n > 1:
            store.write(f"files.p{me}.json", json.dumps({"files": files})).result()
        if me == 0:
            for other in range(1, n):
                files.update(_wait_for_files(store, other, step))
            store.write(COMMIT, json.dumps(dict(meta, files=files), indent=1)).result()
    except Exception as e:
        if n > 1:  # the other processes' commit waits end now, not at the timeout
            try:
                store.write(f"files.p{me}.json", json.dumps({"error": f"{type(e).__name__}: {e}"})).result()
            except Exception:
                pass
        removed = False
        if me == 0:
            try:
                _delete(final)
                removed = True
            except Exception:
                pass  # unreachable storage: the next save deletes it; without a commit record it is invisible
        who = f"process {me} of {n}: " if n > 1 else ""  # which process's part failed
        if isinstance(e, _NotFinite):
            raise CheckpointError(f"{who}{e}; the last checkpoint in {directory} is {latest_name(directory)}") from None
        what = (
            "Its partial files were removed"
            if removed
            else "It has no commit record, so it is not a checkpoint (its partial files are deleted by the next save)"
        )
        budget = (
            " (the object store kept failing past the retry budget, STENCIL_STORE_RETRIES)"
            if "retry attempts failed" in str(e)
            else ""
        )
        raise CheckpointError(
            f"{who}saving step {step} to {final} failed{budget}: {type(e).__name__}: {e}. {what}; "
            f"the last checkpoint is {latest_name(directory)}"
        ) from e
    if me == 0:
        _tidy(directory, final, keep)


def _wait_for_files(store, process: int, step: int) -> dict:
    deadline, pause = time.monotonic() + COMMIT_TIMEOUT_S, 0.01
    while time.monotonic() < deadline:
        r = store.read(f"files.p{process}.json").result()
        if r.state == "value":
            got = json.loads(r.value)
            if "error" in got:
                raise CheckpointError(f"process {process} could not write its shards of step {step}: {got['error']}")
            return got["files"]
        time.sleep(pause)  # 10 ms at first (the other process is usually a moment behind), then up to 0.5 s
        pause = min(2 * pause, 0.5)
    raise CheckpointError(f"process {process} did not finish writing step {step} within {COMMIT_TIMEOUT_S:.0f} s")


def _tidy(directory: str, final: str, keep: int) -> None:
    """After a commit: delete partial saves and leftovers, and every committed checkpoint older than the newest
    `keep` complete ones. `final` was just written and read back: complete without a second look. The others
    are verified newest first only until `keep` complete ones are found (a damaged one among them is passed
    over and kept, so `keep` complete ones always remain); what is older is deleted unread. One listing and,
    at keep 2, one verification a save, not one of every checkpoint (each a request per file on a bucket)."""
    scan = objstore.scan(directory)
    for name, keys in scan.items():
        if _LEFTOVER.match(name) or (_STEP_DIR.match(name) and COMMIT not in keys):
            _delete(join(directory, name))
    if keep <= 0:
        return
    committed = [
        join(directory, name) for name in sorted(scan, reverse=True) if _STEP_DIR.match(name) and COMMIT in scan[name]
    ]
    complete = 0
    for path in committed:
        if complete < keep:
            complete += path == final or not verify(path)
        elif path != final:
            _delete(path)


class Saver:
    """Asynchronous checkpoints, at most one in flight (see the module docstring).

    saver = Saver()
    saver.save(dir, step, state, meta)   # returns after the host copy; the write goes on
    saver.check()                        # every step: raises a failed save's error
    saver.wait()                         # end of run, preemption: the save is committed (or raises)
    """

    def __init__(self):
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._buffers: dict = {}  # host buffers the CPU copy reuses from one save to the next (_host_copy)

    def save(self, directory: str, step: int, tree, metadata: dict, *, keep: int = 3, ocdbt: bool = False) -> str:
        """Start saving `tree` and `metadata` as checkpoint `step` once the previous save is done; return its path."""
        self.wait()
        path, write = _start(directory, step, tree, metadata, keep, ocdbt, self._buffers)

        def run():
            try:
                write()
            except BaseException as e:  # noqa: BLE001 - handed to the loop by check() / wait()
                self._error = e

        self._thread = threading.Thread(target=run, name=f"stencil-checkpoint-{step}", daemon=True)
        self._thread.start()
        return path

    @property
    def in_flight(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def check(self) -> None:
        """Raise the error of a save that has finished and failed (cheap: no waiting)."""
        if self._thread is not None and not self._thread.is_alive():
            self.wait()

    def wait(self) -> None:
        """Wait for the save in flight; raise its error, if it failed."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            e, self._error = self._error, None
            raise e

    def close(self) -> None:
        """For a `finally:` block: wait for the save in flight. Its error is raised, unless another
        exception is already on its way out, in which case it is printed (never dropped)."""
        outer = sys.exc_info()[1]  # in a finally block: the exception propagating through it, if any
        try:
            self.wait()
        except Exception as e:
            if outer is None:
                raise
            print(f"error: the checkpoint save in flight failed too: {e}", file=sys.stderr, flush=True)


def save(directory: str, step: int, tree, metadata: dict, *, keep: int = 3, ocdbt: bool = False) -> str:
    """Write `tree` (a pytree of jax.Arrays) and `metadata` as checkpoint `step` and commit it; return its path.

    Raises CheckpointError, writing nothing, if a floating-point leaf is not finite; and,
    deleting what it wrote, if the storage fails (the earlier checkpoints are untouched)."""
    saver = Saver()
    path = saver.save(directory, step, tree, metadata, keep=keep, ocdbt=ocdbt)
    saver.wait()
    _sync(f"ckpt-done-{step}")
    return path


# ---------------------------------------------------------------- listing, reading


def _damage(meta: dict, path: str, checksums: bool) -> list[str]:
    store, problems, files = _store(path), [], sorted(meta.get("files", {}).items())
    for i in range(0, len(files), 64):
        part = files[i : i + 64]
        # listing reads one byte at the recorded end, and asks for the rest: exactly one byte back if the size is right
        futs = [
            store.read("arrays/" + rel, byte_range=None if checksums else slice(max(size - 1, 0), None))
            for rel, (size, _) in part
        ]
        for (rel, (size, crc)), fut in zip(part, futs):
            try:
                r = fut.result()
            except ValueError as e:
                if "OUT_OF_RANGE" not in str(e):
                    raise
                r = store.read("arrays/" + rel).result()  # shorter than recorded: read it for its size
                problems.append(f"arrays/{rel} is {len(r.value)} bytes, {size} were written")
                continue
            if r.state != "value":
                problems.append(f"arrays/{rel} is missing")
            elif checksums and len(r.value) != size:
                problems.append(f"arrays/{rel} is {len(r.value)} bytes, {size} were written")
            elif not checksums and len(r.value) != min(size, 1):
                problems.append(f"arrays/{rel} is longer than the {size} bytes that were written")
            elif checksums and zlib.crc32(r.value) != crc:
                problems.append(f"arrays/{rel} has another CRC32 than was written")
    return problems


def verify(path: str, checksums: bool = False) -> list[str]:
    """What is wrong with checkpoint `path` (empty if nothing): no or unreadable commit record
    (metadata.json), a recorded file missing or of another size, with `checksums` a CRC32 that
    differs. A checkpoint from before files were recorded is checked for its metadata only."""
    try:
        meta = read_metadata(path)
    except (OSError, ValueError) as e:
        return [f"metadata.json unreadable ({type(e).__name__}: {e})"]
    try:
        return _damage(meta, path, checksums)
    except ValueError as e:
        return [f"unreadable: {e}"]


def _step_dirs(directory: str) -> list[str]:
    """Committed checkpoints (a commit record is there), oldest first, whatever their state.
    Partial saves (no commit record) and leftovers of the older protocol are not listed."""
    scan = objstore.scan(directory)
    return [join(directory, name) for name in sorted(scan) if _STEP_DIR.match(name) and COMMIT in scan[name]]


def partial(directory: str) -> list[tuple[str, str]]:
    """(name, why) of every step folder in `directory` that is not a checkpoint because it has no commit
    record: skipped by `latest` and a resume, and deleted by the next save."""
    out = []
    for name, keys in sorted(objstore.scan(directory).items()):
        if _STEP_DIR.match(name) and COMMIT not in keys:
            what = (f"{len(keys)} files, but " if keys else "") + f"no {COMMIT} (its commit record)"
            why = (
                f"{what}: a save that did not finish, or a deleted commit record; not a checkpoint, skipped "
                "(the next save deletes it)"
            )
            out.append((name, why))
    return out


def all_checkpoints(directory: str) -> list[str]:
    """Complete checkpoints in `directory`, oldest first: committed, metadata readable, every
    recorded file there at its size (partial saves and deletions excluded)."""
    return [d for d in _step_dirs(directory) if not verify(d)]


def later(directory: str, step: int) -> list[str]:
    """The committed checkpoints in `directory` after `step` (complete or damaged), oldest first: what a
    resume from `step` would leave behind for `latest` to pick."""
    try:
        dirs = _step_dirs(directory)
    except ValueError as e:
        raise CheckpointError(f"cannot list checkpoints in {directory}: {e}") from e
    return [d for d in dirs if int(_STEP_DIR.match(_basename(d)).group(1)) > step]


def latest_name(directory: str) -> str:
    try:
        good = all_checkpoints(directory)
    except ValueError as e:
        return f"unknown ({directory} cannot be listed: {e})"
    return good[-1] if good else "none"


def latest(directory: str) -> str | None:
    """The newest checkpoint, or None if there is none. Raises CheckpointError if the newest
    committed checkpoint is damaged: it is never skipped in silence."""
    try:
        dirs = _step_dirs(directory)
    except ValueError as e:
        raise CheckpointError(f"cannot list checkpoints in {directory}: {e}") from e
    if not dirs:
        return None
    problems = verify(dirs[-1])
    if problems:
        good = all_checkpoints(directory)
        raise CheckpointError(
            f"checkpoint {dirs[-1]} is damaged: {'; '.join(problems[:5])}"
            + (f" (and {len(problems) - 5} more)" if len(problems) > 5 else "")
            + f". Complete checkpoints: {[_basename(g) for g in good] or 'none'}. To resume from the newest "
            f"of them, move the damaged one away or delete its metadata.json (its commit record)"
        )
    return dirs[-1]


def find(directory: str, which: str) -> str:
    """The checkpoint `which` names: a step number (of `directory`) or a checkpoint's path or URL.
    Raises CheckpointError if it does not exist or is damaged, listing the complete ones."""
    path = join(directory, f"step_{int(which):08d}") if which.isdigit() else which.rstrip("/")
    try:
        good = [_basename(g) for g in all_checkpoints(_parent(path))]
        committed = _store(path).read(COMMIT).result().state == "value"
    except ValueError as e:
        raise CheckpointError(f"cannot read {path}: {e}") from e
    if not committed:
        raise CheckpointError(f"no checkpoint {path}; complete checkpoints there: {good or 'none'}")
    problems = verify(path)
    if problems:
        raise CheckpointError(
            f"checkpoint {path} is damaged: {'; '.join(problems[:5])}. Complete checkpoints there: {good or 'none'}"
        )
    return path


def read_metadata(path: str) -> dict:
    """A checkpoint's metadata (its commit record). OSError if there is none, ValueError if unreadable."""
    r = _store(path).read(COMMIT).result()
    if r.state != "value":
        raise FileNotFoundError(f"{join(path, COMMIT)} does not exist")
    meta = json.loads(r.value)
    if not isinstance(meta, dict) or "step" not in meta or "leaves" not in meta:
        raise ValueError("not a checkpoint's metadata (no step or leaves)")
    return meta


def _concrete_sharding(t, name):
    """The sharding to read leaf `name` into. Abstract ones (from jax.eval_shape: an
    AbstractMesh, or none at all for scalars) are placed on the current mesh."""
    s = t.sharding
    if isinstance(s, jax.sharding.NamedSharding) and not isinstance(s.mesh, jax.sharding.AbstractMesh):
        return s
    if s is not None and not isinstance(s, jax.sharding.NamedSharding):
        return s
    mesh = jax.sharding.get_mesh()
    if mesh.empty:
        raise CheckpointError(f"target leaf {name} has an abstract sharding and no mesh is set (use jax.set_mesh)")
    return jax.sharding.NamedSharding(mesh, s.spec if s is not None else jax.sharding.PartitionSpec())


def restore(path: str, target):
    """Read checkpoint `path` into the structure, shapes, dtypes and shardings of `target`.

    `target` is a pytree of jax.Arrays or jax.ShapeDtypeStruct, e.g. from jax.eval_shape
    under `jax.set_mesh` (abstract shardings are placed on that mesh; none = replicated).
    Returns (tree, metadata).
    """
    problems = verify(path, checksums=True)
    if problems:
        try:
            good = [_basename(g) for g in all_checkpoints(_parent(path)) if g != path]
        except ValueError:
            good = []
        raise CheckpointError(
            f"checkpoint {path} is damaged: {'; '.join(problems[:5])}. Complete checkpoints beside it: {good or 'none'}"
        )
    meta = read_metadata(path)
    names = leaf_names(target)
    leaves, treedef = jax.tree.flatten(target)
    missing = [n for n in names if n not in meta["leaves"]]
    if missing:
        raise CheckpointError(f"{path} lacks {len(missing)} leaves the run expects, e.g. {missing[:3]}")
    for name, t in zip(names, leaves):
        saved = meta["leaves"][name]
        if tuple(saved["shape"]) != tuple(t.shape) or saved["dtype"] != np.dtype(t.dtype).name:
            raise CheckpointError(
                f"{path}: leaf {name} is {saved['dtype']}{saved['shape']} on disk "
                f"but the run expects {np.dtype(t.dtype).name}{list(t.shape)}"
            )
    # Every slice this process's devices need is asked for before any is waited on (on a bucket each is a
    # request: hundreds in flight, not one after another), with at most RESTORE_WINDOW_BYTES read ahead of
    # the arrays made from them, so host memory holds a window of the state, not all of it.
    opening = [ts.open(_spec(path, name, meta.get("ocdbt", False)), open=True) for name in names]
    out, ahead, ahead_bytes = [], collections.deque(), 0

    def made(name, t, sharding, reads):
        try:
            return jax.make_array_from_callback(tuple(t.shape), sharding, lambda idx: reads[_slice_key(idx)].result())
        except (ValueError, RuntimeError, OSError) as e:
            raise CheckpointError(f"checkpoint {path}: leaf {name} cannot be read: {type(e).__name__}: {e}") from e

    for name, t, opened in zip(names, leaves, opening):
        try:
            arr, sharding = opened.result(), _concrete_sharding(t, name)
            reads = {}
            for idx in sharding.addressable_devices_indices_map(tuple(t.shape)).values():
                if _slice_key(idx) not in reads:  # a slice several devices hold (replicas) is read once
                    reads[_slice_key(idx)] = arr[idx].read()
        except (ValueError, RuntimeError, OSError) as e:
            if isinstance(e, CheckpointError):
                raise
            raise CheckpointError(f"checkpoint {path}: leaf {name} cannot be read: {type(e).__name__}: {e}") from e
        ahead.append((name, t, sharding, reads))
        ahead_bytes += math.prod(t.shape) * np.dtype(t.dtype).itemsize
        while ahead and (ahead_bytes > RESTORE_WINDOW_BYTES or len(ahead) + len(out) == len(names)):
            name_, t_, sharding_, reads_ = ahead.popleft()
            out.append(made(name_, t_, sharding_, reads_))
            ahead_bytes -= math.prod(t_.shape) * np.dtype(t_.dtype).itemsize
    return jax.tree.unflatten(treedef, out), meta


def _slice_key(index) -> tuple:
    """A hashable key for a tuple of slices (a device's part of an array)."""
    return tuple((s.start, s.stop, s.step) for s in index)


def open_leaf(path: str, name: str):
    """Open leaf `name` of checkpoint `path` for reading by slices (a tensorstore array:
    `a[i].read().result()`), for tools that stream a checkpoint leaf by leaf (shared/modelio/hf.py)
    instead of restoring it whole. Check the checkpoint first with `verify(path, checksums=True)`."""
    meta = read_metadata(path)
    if name not in meta["leaves"]:
        raise CheckpointError(f"checkpoint {path} has no leaf {name}; it has {sorted(meta['leaves'])[:8]} ...")
    try:
        return ts.open(_spec(path, name, meta.get("ocdbt", False)), open=True).result()
    except (ValueError, RuntimeError, OSError) as e:
        raise CheckpointError(f"checkpoint {path}: leaf {name} cannot be read: {type(e).__name__}: {e}") from e
