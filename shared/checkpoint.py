"""Checkpoints: one tensorstore (zarr3) array per pytree leaf, plus JSON metadata.

Layout of a run's checkpoint directory:

    step_00000100/
        metadata.json        step, config, data-loader state, leaf names/shapes/dtypes
        arrays/<leaf name>/  one zarr3 array per leaf (or one OCDBT store, `ocdbt=True`)

Saving is atomic: everything is written under `step_XXXXXXXX.tmp/`, and only when every
array and the metadata are on disk is the folder renamed to its final name. A process
killed mid-save leaves a `.tmp` folder that `latest()` ignores and the next save of that
step removes, so the newest good checkpoint is never damaged. After a save, all but the
newest `keep` checkpoints are deleted.

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

import jax
import numpy as np
import tensorstore as ts

_STEP_DIR = re.compile(r"^step_(\d{8})$")


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
    if ocdbt:
        kv = {"driver": "ocdbt", "base": {"driver": "file", "path": os.path.join(root, "arrays")}, "path": name}
    else:
        kv = {"driver": "file", "path": os.path.join(root, "arrays", name)}
    return {"driver": "zarr3", "kvstore": kv}


def save(directory: str, step: int, tree, metadata: dict, *, keep: int = 3, ocdbt: bool = False) -> str:
    """Write `tree` (a pytree of jax.Arrays) and `metadata` as checkpoint `step`; return its path."""
    if ocdbt and jax.process_count() > 1:
        raise CheckpointError("ocdbt=True is single-process only here; use the default zarr3 layout for multi-process")
    final = os.path.join(directory, f"step_{step:08d}")
    tmp = final + ".tmp"
    if jax.process_index() == 0:
        os.makedirs(directory, exist_ok=True)
        if os.path.exists(tmp):
            shutil.rmtree(tmp)  # left by a save that was killed
        os.makedirs(os.path.join(tmp, "arrays"))
    _sync(f"ckpt-mkdir-{step}")

    names = leaf_names(tree)
    leaves = jax.tree.leaves(tree)
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
                                                 for n, x in zip(names, leaves)}, ocdbt=ocdbt)
        with open(os.path.join(tmp, "metadata.json"), "w") as f:
            json.dump(meta, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        if os.path.exists(final):
            shutil.rmtree(final)  # an older save of the same step
        os.rename(tmp, final)
        for old in all_checkpoints(directory)[:-keep] if keep > 0 else []:
            shutil.rmtree(old)
    _sync(f"ckpt-done-{step}")
    return final


def all_checkpoints(directory: str) -> list[str]:
    """Complete checkpoints in `directory`, oldest first (unfinished `.tmp` saves excluded)."""
    if not os.path.isdir(directory):
        return []
    found = [d for d in os.listdir(directory)
             if _STEP_DIR.match(d) and os.path.exists(os.path.join(directory, d, "metadata.json"))]
    return [os.path.join(directory, d) for d in sorted(found)]


def latest(directory: str) -> str | None:
    found = all_checkpoints(directory)
    return found[-1] if found else None


def read_metadata(path: str) -> dict:
    with open(os.path.join(path, "metadata.json")) as f:
        return json.load(f)


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
        arr = ts.open(_spec(path, name, meta.get("ocdbt", False)), open=True).result()
        sharding = _concrete_sharding(t, name)
        out.append(jax.make_array_from_callback(tuple(t.shape), sharding,
                                                lambda idx, a=arr: a[idx].read().result()))
    return jax.tree.unflatten(treedef, out), meta
