"""shared/storage/checkpoint: atomic saves, keep-last-N, restore onto other meshes, clear mismatches, no
non-finite state saved, integrity (missing, truncated, altered files), safe deletion, a failing disk."""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from shared.storage import checkpoint

from helpers import ckpt_tree, mesh  # noqa: E402  (tests/helpers.py)


def test_save_restore_onto_other_mesh(tmp_path):
    src = ckpt_tree(mesh(8, (4, 2)))
    path = checkpoint.save(str(tmp_path), 7, src, {"loader": {"seed": 0, "position": 56}})
    assert os.path.basename(path) == "step_00000007"
    for n, shape in ((8, (8, 1)), (2, (2, 1)), (1, (1, 1))):
        m = mesh(n, shape)
        target = {
            "w": jax.ShapeDtypeStruct((64, 16), jnp.float32, sharding=NamedSharding(m, P("data", None))),
            "b": jax.ShapeDtypeStruct((16,), jnp.bfloat16, sharding=NamedSharding(m, P(None))),
            "step": jax.ShapeDtypeStruct((), jnp.int32, sharding=NamedSharding(m, P())),
        }
        got, meta = checkpoint.restore(path, target)
        assert meta["step"] == 7 and meta["loader"] == {"seed": 0, "position": 56}
        assert got["w"].sharding.mesh.size == n
        for k in src:
            np.testing.assert_array_equal(np.asarray(got[k]), np.asarray(src[k]))


def test_async_saves_in_a_row_each_write_their_own_step(tmp_path):
    """One Saver, a save every step while the steps donate the saved buffers: each checkpoint holds
    its own step's state (the Saver's reused host buffers are never overwritten under a write)."""
    m = mesh(8, (4, 2))
    step = jax.jit(lambda t: {"w": t["w"] * 0.5 + 1.0, "b": t["b"] + 1, "step": t["step"] + 1}, donate_argnums=0)
    state, expected, saver = ckpt_tree(m), {}, checkpoint.Saver()
    with jax.set_mesh(m):
        for s in range(1, 5):
            expected[s] = {k: np.array(v) for k, v in state.items()}
            saver.save(str(tmp_path), s, state, {}, keep=4)
            state = step(state)
            saver.check()
        saver.wait()
        for s, want in expected.items():
            got, _ = checkpoint.restore(str(tmp_path / f"step_{s:08d}"), jax.eval_shape(lambda: state))
            for k in want:
                np.testing.assert_array_equal(np.asarray(got[k]), want[k], err_msg=f"step {s} leaf {k}")


def test_ocdbt_layout(tmp_path):
    src = ckpt_tree(mesh(8, (4, 2)))
    path = checkpoint.save(str(tmp_path), 1, src, {}, ocdbt=True)
    got, _ = checkpoint.restore(path, src)
    np.testing.assert_array_equal(np.asarray(got["w"]), np.asarray(src["w"]))


def test_killed_save_never_hides_or_damages_the_last_good_one(tmp_path):
    src = ckpt_tree(mesh(8, (4, 2)))
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
    src = ckpt_tree(mesh(1))
    for s in range(1, 6):
        checkpoint.save(str(tmp_path), s, src, {}, keep=2)
    assert [os.path.basename(p) for p in checkpoint.all_checkpoints(str(tmp_path))] == [
        "step_00000004",
        "step_00000005",
    ]


def test_keep_counts_complete_checkpoints_and_deletes_older_ones_unread(tmp_path):
    """A damaged checkpoint among the newest is kept and passed over, so `keep` complete ones remain; what is
    older than them goes, damaged or not (a save verifies only the checkpoints it keeps)."""
    src = ckpt_tree(mesh(1))
    for s in range(1, 4):
        checkpoint.save(str(tmp_path), s, src, {}, keep=2)  # 2 and 3 kept
    next(p for p in (tmp_path / "step_00000003" / "arrays").rglob("*") if p.is_file() and "c" in p.parts).unlink()
    checkpoint.save(str(tmp_path), 4, src, {}, keep=2)
    names = lambda: sorted(p.name for p in tmp_path.iterdir())  # noqa: E731
    assert names() == ["step_00000002", "step_00000003", "step_00000004"]  # 2 kept: 3 does not count
    assert [os.path.basename(p) for p in checkpoint.all_checkpoints(str(tmp_path))] == [
        "step_00000002",
        "step_00000004",
    ]
    checkpoint.save(str(tmp_path), 5, src, {}, keep=2)
    assert names() == ["step_00000004", "step_00000005"]  # the damaged 3 older than both: deleted


def test_mismatch_names_the_leaf(tmp_path):
    src = ckpt_tree(mesh(1))
    path = checkpoint.save(str(tmp_path), 1, src, {})
    bad = dict(src, w=jax.ShapeDtypeStruct((64, 8), jnp.float32, sharding=src["w"].sharding))
    with pytest.raises(checkpoint.CheckpointError, match=r"leaf w .*\[64, 16\].*\[64, 8\]"):
        checkpoint.restore(path, bad)
    with pytest.raises(checkpoint.CheckpointError, match="lacks 1 leaves"):
        checkpoint.restore(path, dict(src, extra=src["b"]))


# ---------------------------------------------------------------- never a bad state, integrity


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_nonfinite_state_is_never_saved(tmp_path, mode):
    """Synchronous: save() raises. Asynchronous: the background check of the host copy refuses it
    before writing, and the loop gets the error from the Saver (here wait(); check() at the next step)."""
    m = mesh(8, (4, 2))
    src = ckpt_tree(m)
    good = checkpoint.save(str(tmp_path), 1, src, {})
    with jax.set_mesh(m):
        bad = dict(src, w=src["w"].at[3, 5].set(jnp.nan, out_sharding=P("data", "model")))
    with pytest.raises(
        checkpoint.CheckpointError,
        match=r"not saving step 2: non-finite values in 1 leaves.*\['w'\]"
        r".*step_00000001",
    ):
        if mode == "sync":
            checkpoint.save(str(tmp_path), 2, bad, {})
        else:
            saver = checkpoint.Saver()
            saver.save(str(tmp_path), 2, bad, {})
            saver.wait()
    assert sorted(os.listdir(tmp_path)) == ["step_00000001"]
    assert checkpoint.latest(str(tmp_path)) == good


def _two_checkpoints(tmp_path):
    src = ckpt_tree(mesh(8, (4, 2)))
    first = checkpoint.save(str(tmp_path), 1, src, {})
    second = checkpoint.save(str(tmp_path), 2, src, {})
    chunks = sorted(
        p for p in (tmp_path / "step_00000002" / "arrays" / "w").rglob("*") if p.is_file() and p.name != "zarr.json"
    )
    assert len(chunks) == 8  # one chunk per shard of the 4 x 2 mesh
    return src, first, second, chunks


def test_list_command_names_committed_checkpoints_and_their_damage(tmp_path, capsys):
    """`python -m shared.checkpoint list DIR` (the launchers' resume check): exit 0 and one line per
    committed checkpoint, a damaged one marked; 1 when there is none; 2 for a location it cannot use."""
    from shared import checkpoint as command  # the command; its library is shared/storage/checkpoint.py

    src, first, second, chunks = _two_checkpoints(tmp_path)
    chunks[0].unlink()
    capsys.readouterr()
    assert command.main(["list", str(tmp_path)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == first and out[1].startswith(second + "  DAMAGED: arrays/w/") and len(out) == 2, out
    assert command.main(["list", "--quiet", str(tmp_path)]) == 0 and capsys.readouterr().out == ""
    assert command.main(["list", str(tmp_path / "empty")]) == 1
    assert command.main(["list", "ftp://host/x"]) == 2 and "gs://BUCKET" in capsys.readouterr().err


def test_a_missing_chunk_is_an_error_never_zeros(tmp_path):
    src, first, second, chunks = _two_checkpoints(tmp_path)
    chunks[3].unlink()
    rel = os.path.relpath(chunks[3], tmp_path / "step_00000002")
    with pytest.raises(
        checkpoint.CheckpointError,
        match=rf"{second} is damaged: {rel} is missing.*"
        r"Complete checkpoints: \['step_00000001'\]",
    ):
        checkpoint.latest(str(tmp_path))
    assert checkpoint.all_checkpoints(str(tmp_path)) == [first]
    with pytest.raises(checkpoint.CheckpointError, match="is missing"):
        checkpoint.restore(second, src)
    got, _ = checkpoint.restore(first, src)  # the older one is intact
    np.testing.assert_array_equal(np.asarray(got["w"]), np.asarray(src["w"]))


def test_a_truncated_or_altered_chunk_is_named(tmp_path):
    src, _, second, chunks = _two_checkpoints(tmp_path)
    data = chunks[0].read_bytes()
    chunks[0].write_bytes(data[: len(data) // 2])
    with pytest.raises(checkpoint.CheckpointError, match=rf"{len(data) // 2} bytes, {len(data)} were written"):
        checkpoint.latest(str(tmp_path))
    chunks[0].write_bytes(bytes([data[0] ^ 1]) + data[1:])  # same size, one bit flipped
    assert checkpoint.latest(str(tmp_path)) == second  # listing checks sizes only
    with pytest.raises(checkpoint.CheckpointError, match="another CRC32 than was written"):
        checkpoint.restore(second, src)


def test_unreadable_metadata_is_named(tmp_path):
    _, _, second, _ = _two_checkpoints(tmp_path)
    with open(os.path.join(second, "metadata.json"), "w") as f:
        f.write('{"step": 2, "lea')
    with pytest.raises(
        checkpoint.CheckpointError,
        match=r"step_00000002 is damaged: metadata.json unreadable"
        r".*Complete checkpoints: \['step_00000001'\]",
    ):
        checkpoint.latest(str(tmp_path))


def test_deleting_renames_first_so_a_killed_deletion_leaves_no_checkpoint(tmp_path):
    src = ckpt_tree(mesh(1))
    for s in (1, 2):
        checkpoint.save(str(tmp_path), s, src, {}, keep=2)
    # a deletion killed half-way leaves the renamed folder, metadata.json and all: never listed
    os.rename(tmp_path / "step_00000001", tmp_path / "step_00000001.deleting")
    assert [os.path.basename(p) for p in checkpoint.all_checkpoints(str(tmp_path))] == ["step_00000002"]
    checkpoint.save(str(tmp_path), 3, src, {}, keep=2)  # the next save clears the leftover
    assert sorted(os.listdir(tmp_path)) == ["step_00000002", "step_00000003"]
    # an old-style half-deletion (files gone, metadata left under the checkpoint's name) is damaged
    for p in sorted((tmp_path / "step_00000003" / "arrays").rglob("*"), reverse=True):
        if p.is_file():
            p.unlink()
    with pytest.raises(checkpoint.CheckpointError, match="step_00000003 is damaged"):
        checkpoint.latest(str(tmp_path))


FULL_DISK = r"""
import os, resource, signal, sys
import jax, jax.numpy as jnp, numpy as np
from shared.storage import checkpoint
d = sys.argv[1]
small = {"w": jnp.ones((8, 8), jnp.float32)}
first = checkpoint.save(d, 1, small, {})
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG, as on a full disk
resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096))
try:
    checkpoint.save(d, 2, {"w": jnp.ones((1024, 1024), jnp.float32)}, {})
except checkpoint.CheckpointError as e:
    print("ERROR", e)
print("LEFT", sorted(os.listdir(d)))
got, _ = checkpoint.restore(first, small)
print("RESTORED", float(np.asarray(got["w"]).sum()))
"""


def test_a_failing_disk_leaves_no_partial_save_and_the_last_checkpoint_intact(tmp_path):
    import subprocess
    import sys

    from conftest import ROOT

    out = subprocess.run(
        [sys.executable, "-c", FULL_DISK, str(tmp_path / "ck")],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": ROOT},
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "ERROR saving step 2 to" in out.stdout and "partial files were removed" in out.stdout, out.stdout
    assert "the last checkpoint is " + str(tmp_path / "ck" / "step_00000001") in out.stdout, out.stdout
    assert "LEFT ['step_00000001']" in out.stdout, out.stdout
    assert "RESTORED 64.0" in out.stdout, out.stdout


def test_a_path_with_dotdot_is_normalised(tmp_path):
    src = ckpt_tree(mesh(1))
    (tmp_path / "a").mkdir()
    path = checkpoint.save(str(tmp_path / "a" / ".." / "ck"), 1, src, {})
    got, _ = checkpoint.restore(path, src)
    np.testing.assert_array_equal(np.asarray(got["w"]), np.asarray(src["w"]))
    assert checkpoint.latest(str(tmp_path / "ck")).endswith("step_00000001")
