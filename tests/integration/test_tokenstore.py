"""The integration tier of tests/fast/test_tokenstore.py (Token stores, the tokenize command, mixtures, process
slicing, evaluation sets and bits per byte (shared/storage/tokenstore.py, shared/pretokenize.py,
shared/data/). Stores live on a local path and on file:// (the object-store URL path through tensorstore's
kvstore)): the checks that start real processes or servers, or run long. What they share with the fast half is
imported from it."""

import json
import os
import signal
import subprocess
import sys
import time
import pytest
from shared import data, pretokenize
from shared.data import DataConfig, load_corpus
from shared.variant import ROOT
from helpers import VOCAB, write_corpus
from fast.test_tokenstore import (
    assert_batches_equal,
    make_docs,
    rows_of,
    write_jsonl,
)  # (tests/fast/test_tokenstore.py)


def store_files(root):
    out = {}
    for d, _, files in os.walk(root):
        for f in files:
            p = os.path.join(d, f)
            out[os.path.relpath(p, root)] = open(p, "rb").read()
    return out


@pytest.mark.integration  # a kill -9 of the tokenize command and its workers
def test_tokenize_killed_midway_then_rerun_equals_one_go(tmp_path, tok_file):
    inputs = tmp_path / "in"
    inputs.mkdir()
    for i in range(24):
        write_jsonl(inputs / f"part{i:03d}.jsonl", make_docs(200, seed=i))
    cmd = [
        sys.executable,
        "-m",
        "shared.pretokenize",
        str(inputs / "*.jsonl"),
        "--tokenizer",
        tok_file,
        "--workers",
        "2",
        "--out",
        str(tmp_path / "killed"),
    ]
    env = {**os.environ, "PYTHONPATH": ROOT}
    proc = subprocess.Popen(
        cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True
    )
    shards = tmp_path / "killed" / "shards"
    t0 = time.time()
    while time.time() - t0 < 120:
        done = len([f for f in os.listdir(shards) if f.endswith(".json")]) if shards.is_dir() else 0
        if done >= 3 or proc.poll() is not None:
            break
        time.sleep(0.01)
    os.killpg(proc.pid, signal.SIGKILL)  # the command and its workers, mid-write
    proc.wait()
    assert proc.returncode == -signal.SIGKILL, proc.stderr.read()[-2000:]
    assert not (tmp_path / "killed" / "manifest.json").exists(), "not killed midway: the run had finished"
    done = len([f for f in os.listdir(shards) if f.endswith(".json")])
    assert 3 <= done < 24
    r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert f"{done} done, {24 - done} to tokenize" in r.stderr
    # one go, in this process, one worker: the same bytes, file for file
    pretokenize.run([str(inputs / "*.jsonl")], str(tmp_path / "one"), tokenizer=tok_file, workers=1, progress=False)
    killed, one = store_files(tmp_path / "killed"), store_files(tmp_path / "one")
    assert sorted(killed) == sorted(one) and len(one) == 3 * 24 + 3
    for name in one:
        if name != "plan.json" and name != "manifest.json":
            assert killed[name] == one[name], name
    mk, mo = (json.loads(x["manifest.json"]) for x in (killed, one))
    assert mk == mo and mk["n_docs"] == 24 * 200


@pytest.mark.integration  # the S3 server on 127.0.0.1
def test_a_store_written_to_the_s3_server_reads_as_the_local_one(tmp_path, tok_file, s3):
    """The tokenize command writes a store to s3:// (the S3-compatible server on 127.0.0.1, as
    AWS_ENDPOINT_URL_S3 points a real deployment at R2 or MinIO), and the loader's rows from it
    equal the rows from the same store on a local path."""
    src = write_corpus(tmp_path, n_docs=30)
    url = s3.bucket("tokens") + "/web"
    for out in (str(tmp_path / "local"), url):
        pretokenize.run([str(src / "*.txt")], out, tokenizer=tok_file, workers=1, progress=False)
    local, remote = (
        load_corpus(DataConfig(source=s, tokenizer=tok_file, val_fraction=0.1, cache_dir=str(tmp_path / "c")), VOCAB)
        for s in (str(tmp_path / "local"), url)
    )
    assert local.digest == remote.digest
    assert_batches_equal(
        rows_of(data.make_loader(remote, 16, 6, seed=2), 8), rows_of(data.make_loader(local, 16, 6, seed=2), 8)
    )
