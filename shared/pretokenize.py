"""Tokenize text into a token store (shared/storage/tokenstore.py) that train.py reads with --data.source.

    python -m shared.pretokenize 'corpus/*.jsonl.zst' --out /data/web --tokenizer tokenizer.json --workers 8
    python -m shared.pretokenize corpus/ --out /data/web --vocab_size 32768       # train a BPE first (one host)
    python -m shared.pretokenize 'corpus/*.parquet' --out gs://bucket/web --tokenizer tok.json --shard 3/16
    python variants/dense/train.py --data.source /data/web

Inputs: plain text, Markdown and Python source (one document per file), JSONL (one per line, `--text_field`),
JSONL compressed with gzip (.jsonl.gz) or zstd (.jsonl.zst), Parquet (a text column). Each input
file becomes one shard, numbered by its place in the sorted list of inputs (split very large files
beforehand: a shard is tokenized in one worker's memory).

Resumable: a shard is complete once its marker (shards/NNNNN.json) is written, after its data; a
killed run rerun with the same command redoes only the shards without a marker, so no document is
lost or written twice. `--shard i/n` takes the inputs whose index is i modulo n, so n hosts (a SLURM
array, a Kubernetes indexed job: docs/launching.md) tokenize one corpus together; whichever finishes
the last shard writes manifest.json (rerun any one of them to write it if they all stopped early).
The output may be a local folder or a `file://`, `gs://` or `s3://` URL (tensorstore kvstore;
object stores UNVERIFIED: tested on file:// only).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import sys
import time

import numpy as np
from tqdm import tqdm

from shared.data import sources
from shared.storage import objstore, tokenstore
from shared.storage.tokenstore import DataError

_worker: dict = {}


def parse_shard(s: str) -> tuple[int, int]:
    try:
        i, n = (int(x) for x in s.split("/"))
    except ValueError:
        raise DataError(f"--shard: {s!r} is not i/n (e.g. 0/4)") from None
    if not (n >= 1 and 0 <= i < n):
        raise DataError(f"--shard: {s!r} needs n >= 1 and 0 <= i < n")
    return i, n


def encode_file(tok, eos: int, vocab_size: int, path: str, text_field: str):
    """(tokens, docs [n, 2]) of one input file; empty documents are skipped."""
    dtype = tokenstore.token_dtype(vocab_size)
    parts, lengths, nbytes, batch = [], [], [], []

    def flush():
        for enc in tok.encode_batch_fast(batch, add_special_tokens=False):
            parts.append(np.asarray(enc.ids + [eos], dtype=dtype))
            lengths.append(len(enc.ids) + 1)
        batch.clear()

    for doc in sources.file_docs(path, text_field):
        if doc:
            batch.append(doc)
            nbytes.append(len(doc.encode()))
            if len(batch) == 256:
                flush()
    flush()
    tokens = np.concatenate(parts) if parts else np.zeros(0, dtype)
    return tokens, tokenstore.build_docs(np.array(lengths, np.int64), np.array(nbytes, np.int64))


def _init_worker(out: str, text_field: str) -> None:
    folder = objstore.Folder(out, DataError)
    tok, _ = sources.load_tokenizer(folder.name("tokenizer.json"))
    _worker.update(folder=folder, tok=tok, eos=sources.eos_id_of(tok), vocab=tok.get_vocab_size(), field=text_field)


def _do_unit(unit: tuple[int, str]) -> tuple[int, dict, int]:
    i, path = unit
    w = _worker
    tokens, docs = encode_file(w["tok"], w["eos"], w["vocab"], path, w["field"])
    return i, tokenstore.write_shard(w["folder"], i, tokens, docs, path), os.path.getsize(path)


def _train(files: list[str], vocab_size: int, text_field: str):
    """A byte-level BPE trained on documents of evenly strided input files (about sources.TRAIN_BYTES of text)."""
    sizes = [os.path.getsize(f) for f in files]
    stride = max(1, int(sum(sizes) // (4 * sources.TRAIN_BYTES)))
    docs, used = [], 0
    for f in files[::stride]:
        for d in sources.file_docs(f, text_field):
            docs.append(d)
            used += len(d)
        if used >= 4 * sources.TRAIN_BYTES:
            break
    if not docs:
        raise DataError("no documents in the inputs to train a tokenizer on")
    return sources.train_tokenizer(docs, vocab_size)


def run(
    inputs: list[str],
    out: str,
    *,
    tokenizer: str = "",
    vocab_size: int = 0,
    text_field: str = "text",
    workers: int = 1,
    shard: str = "0/1",
    progress: bool = True,
) -> dict | None:
    """Tokenize this host's part of the inputs into `out`; returns the manifest once the store is complete."""
    index, count = parse_shard(shard)
    if workers < 1:
        raise DataError(f"--workers must be >= 1, got {workers}")
    files = sources.source_files(",".join(inputs))
    if any(f.endswith(".npy") for f in files):
        raise DataError("a .npy file is already token ids: pass it to train.py --data.source directly")
    folder = objstore.Folder(out, DataError)
    if folder.exists("manifest.json"):
        manifest = json.loads(folder.read("manifest.json"))
        if [s["input"] for s in manifest["shards"]] == files:
            print(f"{out}: already complete ({manifest['n_docs']} documents, {manifest['n_tokens']} tokens)")
            return manifest
        raise DataError(f"{folder.name('manifest.json')}: holds a finished store of other inputs; choose another --out")

    # The tokenizer: given (copied into the store), already in the store (a resumed run), or trained here.
    if tokenizer:
        raw = open(tokenizer, "rb").read() if os.path.isfile(tokenizer) else None
        if raw is None:
            raise DataError(f"--tokenizer {tokenizer!r} does not exist")
        have = folder.read("tokenizer.json")
        if have is not None and have != raw:
            raise DataError(
                f"{folder.name('tokenizer.json')}: differs from --tokenizer {tokenizer}; this store was "
                "started with another tokenizer (choose another --out)"
            )
        if have is None:
            sources.load_tokenizer(tokenizer)  # a clear error for a bad file, before anything is written
            folder.write("tokenizer.json", raw)
    elif not folder.exists("tokenizer.json"):
        if not vocab_size:
            raise DataError("give --tokenizer tokenizer.json, or --vocab_size N to train a byte-level BPE")
        if count > 1:
            raise DataError(
                "--shard i/n with n > 1 needs --tokenizer: train it once first (python -m "
                "shared.pretokenize SAMPLE --out DIR --vocab_size N), then pass DIR/tokenizer.json"
            )
        if progress:
            print(f"training a {vocab_size}-token BPE tokenizer on the inputs", file=sys.stderr)
        folder.write("tokenizer.json", _train(files, vocab_size, text_field).to_str().encode())
    tok, tok_sha = sources.load_tokenizer(folder.name("tokenizer.json"))
    eos = sources.eos_id_of(tok)

    plan = {"inputs": [[f, os.path.getsize(f)] for f in files], "text_field": text_field, "tokenizer_sha256": tok_sha}
    was = folder.read("plan.json")
    if was is None:
        folder.write("plan.json", json.dumps(plan).encode())
    elif json.loads(was) != plan:
        raise DataError(
            f"{folder.name('plan.json')}: this store was started with other inputs (or sizes), text_field "
            "or tokenizer; rerun with the same ones, or choose another --out"
        )

    folder.remove_stale("shards/")
    mine = [(i, f) for i, f in enumerate(files) if i % count == index]
    todo = [(i, f) for i, f in mine if tokenstore.read_marker(folder, i) is None]
    total = sum(os.path.getsize(f) for _, f in todo)
    if progress:
        print(
            f"{out}: {len(mine)} of {len(files)} inputs are this host's ({shard}); {len(mine) - len(todo)} done, "
            f"{len(todo)} to tokenize ({total / 1e6:.1f} MB) on {workers} worker(s)",
            file=sys.stderr,
        )
    t0 = time.perf_counter()
    bar = tqdm(total=total, unit="B", unit_scale=True, desc="tokenizing", disable=not progress)
    if workers == 1 or len(todo) <= 1:
        _init_worker(out, text_field)
        for u in todo:
            bar.update(_do_unit(u)[2])
    elif todo:
        ctx = multiprocessing.get_context("spawn")  # tokenizers' thread pool does not survive fork
        with ctx.Pool(workers, initializer=_init_worker, initargs=(out, text_field)) as pool:
            for _, _, size in pool.imap_unordered(_do_unit, todo):
                bar.update(size)
    bar.close()
    if progress and todo:
        dt = time.perf_counter() - t0
        print(f"tokenized {total / 1e6:.1f} MB in {dt:.1f} s ({total / 1e6 / dt:.2f} MB/s)", file=sys.stderr)

    markers = [tokenstore.read_marker(folder, i) for i in range(len(files))]
    missing = [i for i, m in enumerate(markers) if m is None]
    if missing:
        if progress:
            print(
                f"{len(missing)} of {len(files)} shards are still missing (other hosts' part); the run that "
                "completes the last one writes manifest.json",
                file=sys.stderr,
            )
        return None
    if sum(m["docs"] for m in markers) == 0:
        raise DataError(f"the {len(files)} input file(s) hold no documents (all empty)")
    manifest = tokenstore.write_manifest(
        folder, markers, tokenizer_sha256=tok_sha, vocab_size=tok.get_vocab_size(), eos_id=eos
    )
    if progress:
        print(
            f"{out}: complete: {manifest['n_docs']} documents, {manifest['n_tokens']} tokens in {len(files)} shards",
            file=sys.stderr,
        )
    return manifest


def job_command(args, shard: str) -> str:
    """The command line one host of a multi-host job runs (shard: an i/n with a shell variable for i)."""
    import shlex

    parts = [
        "python",
        "-m",
        "shared.pretokenize",
        *args.sources,
        "--out",
        args.out,
        "--workers",
        str(args.workers),
        "--text_field",
        args.text_field,
    ]
    if args.tokenizer:
        parts += ["--tokenizer", args.tokenizer]
    return " ".join(shlex.quote(p) for p in parts) + f" --shard {shard}"


def emit(args) -> str:
    """A SLURM array script or a Kubernetes indexed Job in which host i of --hosts runs --shard i/n."""
    n = args.hosts
    if args.emit == "slurm":
        return f"""#!/bin/bash
# Generated by: python -m shared.pretokenize ... --emit slurm --hosts {n}
# Task i tokenizes the inputs whose index is i modulo {n}; a requeued or rerun task resumes its shards;
# the task that completes the last shard writes manifest.json (rerun any task to write it otherwise).
#SBATCH --job-name=stencil-tokenize
#SBATCH --array=0-{n - 1}
#SBATCH --nodes=1
#SBATCH --ntasks=1
#SBATCH --cpus-per-task={args.workers}
#SBATCH --requeue
#SBATCH --output=tokenize-%A_%a.out
set -euo pipefail
cd {shlex_quote(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))}
{job_command(args, f"${{SLURM_ARRAY_TASK_ID}}/{n}")}
"""
    command = json.dumps(job_command(args, f"${{JOB_COMPLETION_INDEX}}/{n}"))
    return f"""# Generated by: python -m shared.pretokenize ... --emit k8s --hosts {n}
# Pod i (JOB_COMPLETION_INDEX) tokenizes the inputs whose index is i modulo {n}; a restarted pod resumes
# its shards; the pod that completes the last shard writes manifest.json.
apiVersion: batch/v1
kind: Job
metadata:
  name: stencil-tokenize
spec:
  completionMode: Indexed
  completions: {n}
  parallelism: {n}
  backoffLimitPerIndex: 3
  template:
    spec:
      restartPolicy: Never
      containers:
      - name: tokenize
        image: {args.image}
        command: ["sh", "-c", {command}]
        resources:
          requests:
            cpu: "{args.workers}"
"""


def shlex_quote(s: str) -> str:
    import shlex

    return shlex.quote(s)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(
        prog="python -m shared.pretokenize", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "sources", nargs="+", help="input files, folders or globs (.txt .md .py .jsonl .jsonl.gz .jsonl.zst .parquet)"
    )
    ap.add_argument("--out", required=True, help="the token store: a folder, or a file:// gs:// s3:// URL")
    ap.add_argument("--tokenizer", default="", help="a tokenizers tokenizer.json (copied into the store)")
    ap.add_argument(
        "--vocab_size", type=int, default=0, help="without --tokenizer: train a byte-level BPE of this size"
    )
    ap.add_argument("--text_field", default="text", help="JSONL field / Parquet column holding the text")
    ap.add_argument(
        "--workers",
        type=int,
        default=max(1, (os.cpu_count() or 1)),
        help="worker processes (default: one per CPU; each tokenizes on one thread)",
    )
    ap.add_argument("--shard", default="0/1", help="i/n: tokenize the inputs whose index is i modulo n (one host of n)")
    ap.add_argument(
        "--emit",
        choices=("slurm", "k8s"),
        help="print a SLURM array script or a Kubernetes indexed Job "
        "that runs this command on --hosts hosts (host i: --shard i/n) and exit",
    )
    ap.add_argument("--hosts", type=int, default=1, help="with --emit: the number of hosts (array tasks, pods)")
    ap.add_argument("--image", default="REGISTRY/stencil:TAG", help="with --emit k8s: the container image")
    args = ap.parse_args(argv)
    if args.emit:
        if args.hosts < 1 or not args.tokenizer:
            sys.exit("error: --emit needs --hosts >= 1 and --tokenizer (hosts must share one tokenizer)")
        print(emit(args), end="")
        return
    os.environ.setdefault("RAYON_NUM_THREADS", "1")  # one thread per worker process: --workers is the parallelism
    try:
        run(
            args.sources,
            args.out,
            tokenizer=args.tokenizer,
            vocab_size=args.vocab_size,
            text_field=args.text_field,
            workers=args.workers,
            shard=args.shard,
        )
    except DataError as e:
        sys.exit(f"error: {e}")


if __name__ == "__main__":
    main()
