"""Checkpoints: one tensorstore (zarr3) array per pytree leaf, plus JSON metadata.

Layout of a run's checkpoint directory:

    step_00000100/
        metadata.json        step, config, data-loader state, leaf names/shapes/dtypes
        arrays/<leaf name>/  one zarr3 array per leaf (or one OCDBT store, `ocdbt=True`)

Saving is atomic: everything is written under `step_XXXXXXXX.tmp/`, and only when every
array and the metadata are on disk is the folder renamed to its final name. A process
killed mid-save leaves a `.tmp` folder that `latest()` ignores and the next save removes,
so the newest good checkpoint is never damaged. A save that fails (a full disk, storage
that refuses the write) removes its partial files and raises `CheckpointError`; the
previous checkpoints stay as they were. After a save, all but the newest `keep`
checkpoints are deleted, each first renamed to `step_XXXXXXXX.deleting` (so a process
killed while deleting never leaves a half-deleted folder under a checkpoint's name).

Never a bad state: `save` refuses a tree with a non-finite floating-point value (NaN or
inf weights are not a checkpoint) and names the leaf.

Integrity: `metadata.json` records every file written under `arrays/` with its size and
CRC32. A folder counts as a complete checkpoint only if its metadata parses and every
recorded file is there at its recorded size (`verify`, by `stat`, when listing); `restore`
also checks the CRC32s before it reads (one extra read of the files). A missing chunk is
an error, never zeros (zarr would fill it). A damaged newest checkpoint is never skipped
in silence: `latest` raises, naming it, what is wrong, and the complete ones.

Each process writes only the shards it holds (replica 0 of each), into chunks shaped like
those shards, so multi-process saves are cooperative and never write the same chunk twice.
Restoring takes target shardings: each process reads only the slices its devices need,
so a checkpoint restores onto any mesh shape or device count.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import tensorstore as ts

_STEP_DIR = re.compile(r"^step_(\d{8})$")
_LEFTOVER = re.compile(r"^step_(\d{8})\.(tmp|deleting)$")  # a killed save or deletion


class CheckpointError(RuntimeError):
    pass


def _sync(name: str) -> None:
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices(name)


def leaf_names(tree) -> list[str]:
    """Stable file-safe names for the leaves of a pytree, e.g. 'params.layers.wq'."""
    paths = jax.tree_util.tree_flatten_with_path(tree)[0]
    names = [re.sub(r"[^A-Za-z0-9_.\-]", "_", jax.tree_util.keystr(p, simple=True, separator=".")) for p, _ in paths]
    if len(set(names)) != len(names):
        raise CheckpointError(f"pytree leaf names collide: {names}")
    return names


def _spec(root: str, name: str, ocdbt: bool) -> dict:
    root = os.path.abspath(root)  # tensorstore's file driver refuses ".." in a path: normalise it here
    if ocdbt:
        kv = {"driver": "ocdbt", "base": {"driver": "file", "path": os.path.join(root, "arrays")}, "path": name}
    else:
        kv = {"driver": "file", "path": os.path.join(root, "arrays", name)}
    return {"driver": "zarr3", "kvstore": kv}


@jax.jit
def _finite(leaves):
    return [jnp.all(jnp.isfinite(x)) for x in leaves]


def _nonfinite(names, leaves) -> list[str]:
    """Names of the floating-point leaves holding a NaN or an inf."""
    floats = [(n, x) for n, x in zip(names, leaves) if jnp.issubdtype(x.dtype, jnp.floating)]
    ok = jax.device_get(_finite([x for _, x in floats]))
    return [n for (n, _), good in zip(floats, ok) if not good]


def _crc32(path: str) -> int:
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            crc = zlib.crc32(chunk, crc)
    return crc


def _files(root: str) -> dict:
    """{path under root: [size, crc32]} for every file under root."""
    out = {}
    for d, _, files in os.walk(root):
        for name in files:
            path = os.path.join(d, name)
            out[os.path.relpath(path, root)] = [os.path.getsize(path), _crc32(path)]
    return out


def _remove(path: str) -> None:
    """Delete a checkpoint folder: rename it out of the checkpoints' names first, then remove it."""
    m = _STEP_DIR.match(os.path.basename(path))
    gone = path + ".deleting" if m else path
    if m:
        os.rename(path, gone)
    shutil.rmtree(gone)


def save(directory: str, step: int, tree, metadata: dict, *, keep: int = 3, ocdbt: bool = False) -> str:
    """Write `tree` (a pytree of jax.Arrays) and `metadata` as checkpoint `step`; return its path.

    Raises CheckpointError, writing nothing, if a floating-point leaf is not finite; and,
    removing what it wrote, if the storage fails (the earlier checkpoints are untouched)."""
    if ocdbt and jax.process_count() > 1:
        raise CheckpointError("ocdbt=True is single-process only here; use the default zarr3 layout for multi-process")
    names = leaf_names(tree)
    leaves = jax.tree.leaves(tree)
    bad = _nonfinite(names, leaves)
    if bad:
        raise CheckpointError(f"not saving step {step}: non-finite values in {len(bad)} leaves, e.g. {bad[:3]}; "
                              f"the last checkpoint in {directory} is {latest_name(directory)}")
    final = os.path.join(directory, f"step_{step:08d}")
    tmp = final + ".tmp"
    try:
        if jax.process_index() == 0:
            os.makedirs(directory, exist_ok=True)
            for d in os.listdir(directory):  # left by a save or a deletion that was killed
                if _LEFTOVER.match(d):
                    shutil.rmtree(os.path.join(directory, d))
            os.makedirs(os.path.join(tmp, "arrays"))
        _sync(f"ckpt-mkdir-{step}")

        pending = []
        for name, x in zip(names, leaves):
            chunk = x.sharding.shard_shape(x.shape) if x.ndim else ()
            arr = ts.open(_spec(tmp, name, ocdbt), create=True, open=True, dtype=ts.dtype(np.dtype(x.dtype).name),
                          shape=x.shape, chunk_layout=ts.ChunkLayout(chunk_shape=chunk) if x.ndim else None).result()
            for shard in x.addressable_shards:
                if shard.replica_id == 0:
                    pending.append(arr[shard.index].write(np.asarray(shard.data)))
        for p in pending:
            p.result()
        _sync(f"ckpt-written-{step}")

        if jax.process_index() == 0:
            meta = dict(metadata, step=step, leaves={n: {"shape": list(x.shape), "dtype": np.dtype(x.dtype).name}
                                                     for n, x in zip(names, leaves)}, ocdbt=ocdbt,
                        files=_files(os.path.join(tmp, "arrays")))
            with open(os.path.join(tmp, "metadata.json"), "w") as f:
                json.dump(meta, f, indent=1)
                f.flush()
                os.fsync(f.fileno())
            if os.path.exists(final):
                _remove(final)  # an older save of the same step
            os.rename(tmp, final)
    except Exception as e:
        if jax.process_index() == 0 and os.path.exists(tmp):
            shutil.rmtree(tmp, ignore_errors=True)
        raise CheckpointError(f"saving step {step} to {final} failed: {type(e).__name__}: {e}. Its partial files "
                              f"were removed; the last checkpoint is {latest_name(directory)}") from e
    if jax.process_index() == 0:
        for old in all_checkpoints(directory)[:-keep] if keep > 0 else []:
            _remove(old)
    _sync(f"ckpt-done-{step}")
    return final


def verify(path: str, checksums: bool = False) -> list[str]:
    """What is wrong with checkpoint `path` (empty if nothing): unreadable metadata, a recorded
    file missing or of another size, with `checksums` a CRC32 that differs. A checkpoint from
    before files were recorded is checked for its metadata only."""
    try:
        meta = read_metadata(path)
    except (OSError, ValueError) as e:
        return [f"metadata.json unreadable ({type(e).__name__}: {e})"]
    problems = []
    for rel, (size, crc) in meta.get("files", {}).items():
        f = os.path.join(path, "arrays", rel)
        if not os.path.isfile(f):
            problems.append(f"arrays/{rel} is missing")
        elif os.path.getsize(f) != size:
            problems.append(f"arrays/{rel} is {os.path.getsize(f)} bytes, {size} were written")
        elif checksums and _crc32(f) != crc:
            problems.append(f"arrays/{rel} has another CRC32 than was written")
    return problems


def _step_dirs(directory: str) -> list[str]:
    """Folders named like a checkpoint (step_XXXXXXXX), oldest first, whatever their state."""
    if not os.path.isdir(directory):
        return []
    return [os.path.join(directory, d) for d in sorted(os.listdir(directory)) if _STEP_DIR.match(d)]


def all_checkpoints(directory: str) -> list[str]:
    """Complete checkpoints in `directory`, oldest first: metadata readable, every recorded file
    there at its size (unfinished saves and deletions excluded)."""
    return [d for d in _step_dirs(directory) if not verify(d)]


def latest_name(directory: str) -> str:
    good = all_checkpoints(directory)
    return good[-1] if good else "none"


def latest(directory: str) -> str | None:
    """The newest checkpoint, or None if there is none. Raises CheckpointError if the newest
    folder named like a checkpoint is damaged: it is never skipped in silence."""
    dirs = _step_dirs(directory)
    if not dirs:
        return None
    problems = verify(dirs[-1])
    if problems:
        good = all_checkpoints(directory)
        raise CheckpointError(
            f"checkpoint {dirs[-1]} is damaged: {'; '.join(problems[:5])}"
            + (f" (and {len(problems) - 5} more)" if len(problems) > 5 else "")
            + f". Complete checkpoints: {[os.path.basename(g) for g in good] or 'none'}. To resume from the newest "
            f"of them, move the damaged folder away (e.g. mv {dirs[-1]} {dirs[-1]}.damaged)")
    return dirs[-1]


def find(directory: str, which: str) -> str:
    """The checkpoint `which` names: a step number (of `directory`) or a checkpoint folder's path.
    Raises CheckpointError if it does not exist or is damaged, listing the complete ones."""
    path = os.path.join(directory, f"step_{int(which):08d}") if which.isdigit() else which.rstrip("/")
    good = [os.path.basename(g) for g in all_checkpoints(os.path.dirname(path) or ".")]
    if not os.path.isdir(path):
        raise CheckpointError(f"no checkpoint {path}; complete checkpoints there: {good or 'none'}")
    problems = verify(path)
    if problems:
        raise CheckpointError(f"checkpoint {path} is damaged: {'; '.join(problems[:5])}. "
                              f"Complete checkpoints there: {good or 'none'}")
    return path


def read_metadata(path: str) -> dict:
    with open(os.path.join(path, "metadata.json")) as f:
        meta = json.load(f)
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
        good = [os.path.basename(g) for g in all_checkpoints(os.path.dirname(path)) if g != path]
        raise CheckpointError(f"checkpoint {path} is damaged: {'; '.join(problems[:5])}. "
                              f"Complete checkpoints beside it: {good or 'none'}")
    meta = read_metadata(path)
    names = leaf_names(target)
    leaves, treedef = jax.tree.flatten(target)
    missing = [n for n in names if n not in meta["leaves"]]
    if missing:
        raise CheckpointError(f"{path} lacks {len(missing)} leaves the run expects, e.g. {missing[:3]}")
    out = []
    for name, t in zip(names, leaves):
        saved = meta["leaves"][name]
        if tuple(saved["shape"]) != tuple(t.shape) or saved["dtype"] != np.dtype(t.dtype).name:
            raise CheckpointError(f"{path}: leaf {name} is {saved['dtype']}{saved['shape']} on disk "
                                  f"but the run expects {np.dtype(t.dtype).name}{list(t.shape)}")
        try:
            arr = ts.open(_spec(path, name, meta.get("ocdbt", False)), open=True).result()
            sharding = _concrete_sharding(t, name)
            out.append(jax.make_array_from_callback(tuple(t.shape), sharding,
                                                    lambda idx, a=arr: a[idx].read().result()))
        except (ValueError, RuntimeError, OSError) as e:
            if isinstance(e, CheckpointError):
                raise
            raise CheckpointError(f"checkpoint {path}: leaf {name} cannot be read: {type(e).__name__}: {e}") from e
    return jax.tree.unflatten(treedef, out), meta


def open_leaf(path: str, name: str):
    """Open leaf `name` of checkpoint `path` for reading by slices (a tensorstore array:
    `a[i].read().result()`), for tools that stream a checkpoint leaf by leaf (shared/hf.py)
    instead of restoring it whole. Check the checkpoint first with `verify(path, checksums=True)`."""
    meta = read_metadata(path)
    if name not in meta["leaves"]:
        raise CheckpointError(f"checkpoint {path} has no leaf {name}; it has {sorted(meta['leaves'])[:8]} ...")
    try:
        return ts.open(_spec(path, name, meta.get("ocdbt", False)), open=True).result()
    except (ValueError, RuntimeError, OSError) as e:
        raise CheckpointError(f"checkpoint {path}: leaf {name} cannot be read: {type(e).__name__}: {e}") from e
