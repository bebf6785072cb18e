"""shared/checkpoint: atomic saves, keep-last-N, restore onto other meshes, clear mismatches."""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from shared import checkpoint


def mesh(n, shape=None):
    shape = shape or (n, 1)
    return jax.make_mesh(shape, ("data", "model"), axis_types=(AxisType.Explicit,) * 2, devices=jax.devices()[:n])


def tree(m):
    with jax.set_mesh(m):
        return {"w": jax.device_put(jnp.arange(64 * 16, dtype=jnp.float32).reshape(64, 16), P("data", "model")),
                "b": jax.device_put(jnp.arange(16, dtype=jnp.bfloat16), P(None)),
                "step": jnp.asarray(7, jnp.int32)}


def test_save_restore_onto_other_mesh(tmp_path):
    src = tree(mesh(8, (4, 2)))
    path = checkpoint.save(str(tmp_path), 7, src, {"loader": {"seed": 0, "position": 56}})
    assert os.path.basename(path) == "step_00000007"
    for n, shape in ((8, (8, 1)), (2, (2, 1)), (1, (1, 1))):
        m = mesh(n, shape)
        target = {"w": jax.ShapeDtypeStruct((64, 16), jnp.float32, sharding=NamedSharding(m, P("data", None))),
                  "b": jax.ShapeDtypeStruct((16,), jnp.bfloat16, sharding=NamedSharding(m, P(None))),
                  "step": jax.ShapeDtypeStruct((), jnp.int32, sharding=NamedSharding(m, P()))}
        got, meta = checkpoint.restore(path, target)
        assert meta["step"] == 7 and meta["loader"] == {"seed": 0, "position": 56}
        assert got["w"].sharding.mesh.size == n
        for k in src:
            np.testing.assert_array_equal(np.asarray(got[k]), np.asarray(src[k]))


def test_ocdbt_layout(tmp_path):
    src = tree(mesh(8, (4, 2)))
    path = checkpoint.save(str(tmp_path), 1, src, {}, ocdbt=True)
    got, _ = checkpoint.restore(path, src)
    np.testing.assert_array_equal(np.asarray(got["w"]), np.asarray(src["w"]))


def test_killed_save_never_hides_or_damages_the_last_good_one(tmp_path):
    src = tree(mesh(8, (4, 2)))
    good = checkpoint.save(str(tmp_path), 5, src, {})
    # A save of step 10 that died half-way: arrays partly there, no metadata, still named .tmp
    os.makedirs(tmp_path / "step_00000010.tmp" / "arrays" / "w")
    (tmp_path / "step_00000010.tmp" / "arrays" / "w" / "zarr.json").write_text("{garbage")
    assert checkpoint.latest(str(tmp_path)) == good
    got, _ = checkpoint.restore(good, src)
    np.testing.assert_array_equal(np.asarray(got["w"]), np.asarray(src["w"]))
    checkpoint.save(str(tmp_path), 10, src, {})  # the retry clears the leftovers
    assert not (tmp_path / "step_00000010.tmp").exists()
    assert checkpoint.latest(str(tmp_path)).endswith("step_00000010")


def test_keeps_last_n(tmp_path):
    src = tree(mesh(1))
    for s in range(1, 6):
        checkpoint.save(str(tmp_path), s, src, {}, keep=2)
    assert [os.path.basename(p) for p in checkpoint.all_checkpoints(str(tmp_path))] == ["step_00000004", "step_00000005"]


def test_mismatch_names_the_leaf(tmp_path):
    src = tree(mesh(1))
    path = checkpoint.save(str(tmp_path), 1, src, {})
    bad = dict(src, w=jax.ShapeDtypeStruct((64, 8), jnp.float32, sharding=src["w"].sharding))
    with pytest.raises(checkpoint.CheckpointError, match=r"leaf w .*\[64, 16\].*\[64, 8\]"):
        checkpoint.restore(path, bad)
    with pytest.raises(checkpoint.CheckpointError, match="lacks 1 leaves"):
        checkpoint.restore(path, dict(src, extra=src["b"]))
