"""Data-path benchmark: tokenize throughput, loader speed against the CPU default's train step, and
resident memory while reading a token store of several GB.

    python tools/bench/bench_data.py                      # all three (about 5 minutes on 2 CPU cores)
    python tools/bench/bench_data.py --store_gb 2 --skip_step

1. Tokenize: the standard library's text as JSONL shards, `shared.pretokenize` with 1 worker and then
   2 workers (each one tokenizer thread), MB of UTF-8 text per second of wall time (median of --rounds).
2. Loader: rows/s of `Loader.next()` (one source) and `MixtureLoader.next()` (two sources 0.7/0.3) on the
   stdlib store at the CPU default (seq_len 128, 32 rows a step), against the rows/s the CPU default's
   jitted train step (variants/dense, one device) consumes, timed in this process.
3. Memory: a synthetic store of --store_gb GB (uint16 ids, documents of 200-4000 tokens, 8 shards) is
   written, then read by a fresh process (random rows across the whole store, --mem_steps batches of 32)
   that reports its resident set (VmRSS, which counts mapped file pages it touched) after opening the store
   and its maximum while reading. The store is deleted afterwards.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time

os.environ.setdefault("RAYON_NUM_THREADS", "1")  # one tokenizer thread per worker process
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

import numpy as np  # noqa: E402

from shared import data, pretokenize  # noqa: E402
from shared.data import sources
from shared.storage import objstore, tokenstore
from shared.storage.tokenstore import DataError  # noqa: E402


def rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def corpus_jsonl(work: str, mb: float, n_files: int) -> tuple[list[str], int]:
    """About `mb` MB of standard-library text as n_files JSONL files; (paths, text bytes)."""
    docs = sources.read_documents(data.DataConfig(max_bytes=int(mb * 1e6)))
    os.makedirs(os.path.join(work, "text"), exist_ok=True)
    paths = []
    for i in range(n_files):
        p = os.path.join(work, "text", f"part{i:03d}.jsonl")
        with open(p, "w") as f:
            for d in docs[i::n_files]:
                f.write(json.dumps({"text": d}) + "\n")
        paths.append(p)
    return paths, sum(len(d.encode()) for d in docs)


def bench_tokenize(work: str, mb: float, rounds: int, tok_path: str) -> dict:
    paths, nbytes = corpus_jsonl(work, mb, 16)
    out = {}
    for workers in (1, 2):
        times = []
        for r in range(rounds):
            dest = os.path.join(work, f"tok-{workers}-{r}")
            t = time.perf_counter()
            pretokenize.run(paths, dest, tokenizer=tok_path, workers=workers, progress=False)
            times.append(time.perf_counter() - t)
            shutil.rmtree(dest)
        out[workers] = nbytes / 1e6 / statistics.median(times)
    print(
        f"tokenize: {nbytes / 1e6:.1f} MB of text, median of {rounds}: 1 worker {out[1]:.2f} MB/s; "
        f"2 workers {out[2]:.2f} MB/s ({out[2] / 2:.2f} MB/s per worker)"
    )
    return {"text_mb": nbytes / 1e6, "mb_s_1_worker": out[1], "mb_s_2_workers": out[2]}


def loader_rows_s(loader, steps: int) -> float:
    loader.next()
    t = time.perf_counter()
    for _ in range(steps):
        loader.next()
    return steps * loader.global_batch / (time.perf_counter() - t)


def bench_loader(corpus, steps: int) -> dict:
    one = loader_rows_s(data.make_loader(corpus, 128, 32, 0), steps)
    s = corpus.sources[0]
    mix = data.MixtureLoader({"a": s.train, "b": s.val}, {"a": 0.7, "b": 0.3}, 128, 32, 0)
    mixed = loader_rows_s(mix, steps)
    print(f"loader: {one:,.0f} rows/s (one source), {mixed:,.0f} rows/s (mixture of two), seq_len 128, 32 rows a step")
    return {"rows_s": one, "rows_s_mixture": mixed}


def step_rows_s(corpus, steps: int) -> float:
    """Rows/s the CPU default's train step consumes (variants/dense at its defaults, one device)."""
    import jax
    from shared.variant import load

    train = load(os.path.join(ROOT, "variants", "dense", "train.py"))
    cfg = train.TrainConfig()
    devices = jax.devices()[:1]
    mesh = train.make_mesh(cfg, devices)
    opt, schedule = train.make_optimizer(cfg)
    loader = data.make_loader(corpus, cfg.seq_len, cfg.batch_size, 0)
    with jax.set_mesh(mesh):
        state = jax.jit(lambda k: train.init_state(cfg, opt, k))(jax.random.key(0))
        step = train.make_train_step(cfg, opt, schedule)
        times = []
        for i in range(steps + 1):
            b = train.to_device(loader.next(), mesh, (1,))
            t = time.perf_counter()
            state, m = step(state, b)
            jax.block_until_ready(m)
            if i:
                times.append(time.perf_counter() - t)
    rows = cfg.batch_size / statistics.median(times)
    print(f"train step (CPU default, 1 device): median {statistics.median(times) * 1e3:.0f} ms -> {rows:.1f} rows/s")
    return rows


def write_synthetic(path: str, gb: float, vocab: int = 32768, n_shards: int = 8) -> None:
    rng = np.random.default_rng(0)
    folder = objstore.Folder(path, DataError)
    per = int(gb * 1e9 / 2 / n_shards)
    markers = []
    for k in range(n_shards):
        lengths = rng.integers(200, 4000, per // 200 + 10)
        lengths = lengths[: np.searchsorted(np.cumsum(lengths), per) + 1]
        lengths[-1] -= lengths.sum() - per
        lengths = lengths[lengths > 0]
        tokens = rng.integers(1, vocab, per, dtype=np.uint16)
        ends = np.cumsum(lengths)
        tokens[ends - 1] = 0
        markers.append(
            tokenstore.write_shard(folder, k, tokens, tokenstore.build_docs(lengths, lengths * 4), "synthetic")
        )
        del tokens
    tokenstore.write_manifest(folder, markers, tokenizer_sha256="", vocab_size=vocab, eos_id=0)


def read_store_child(path: str, steps: int) -> None:
    """In a fresh process: open the store, read `steps` random batches, print RSS figures as JSON."""
    base = rss_mb()
    corpus = data.load_corpus(data.DataConfig(source=path), 32768, progress=False)
    loader = data.make_loader(corpus, 128, 32, 0)
    opened, peak = rss_mb(), 0.0
    t = time.perf_counter()
    for _ in range(steps):
        loader.next()
        peak = max(peak, rss_mb())
    dt = time.perf_counter() - t
    print(json.dumps({"baseline_mb": base, "opened_mb": opened, "peak_mb": peak, "rows_s": steps * 32 / dt}))


def bench_memory(work: str, gb: float, steps: int) -> dict:
    path = os.path.join(work, "synthetic-store")
    try:
        t = time.perf_counter()
        write_synthetic(path, gb)
        size = sum(os.path.getsize(os.path.join(path, "shards", f)) for f in os.listdir(os.path.join(path, "shards")))
        print(f"synthetic store: {size / 1e9:.2f} GB written in {time.perf_counter() - t:.0f} s")
        r = subprocess.run(
            [sys.executable, __file__, "--_read_child", path, "--mem_steps", str(steps)],
            capture_output=True,
            text=True,
            env={**os.environ, "STENCIL_CACHE": work},
        )
        if r.returncode:
            raise RuntimeError(r.stderr[-3000:])
        m = json.loads(r.stdout.strip().splitlines()[-1])
    finally:
        shutil.rmtree(path, ignore_errors=True)
    m["store_gb"] = size / 1e9
    print(
        f"memory: store {m['store_gb']:.2f} GB; RSS {m['baseline_mb']:.0f} MB after imports, {m['opened_mb']:.0f} MB "
        f"with the store open, peak {m['peak_mb']:.0f} MB over {steps} random batches "
        f"(+{m['peak_mb'] - m['baseline_mb']:.0f} MB above the baseline); {m['rows_s']:,.0f} rows/s"
    )
    return m


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work", default="/tmp/stencil-bench-data", help="scratch folder (removed at the end)")
    ap.add_argument("--tokenize_mb", type=float, default=8.0)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--loader_steps", type=int, default=200)
    ap.add_argument("--step_steps", type=int, default=3)
    ap.add_argument("--skip_step", action="store_true", help="do not time the train step")
    ap.add_argument("--store_gb", type=float, default=2.0)
    ap.add_argument("--mem_steps", type=int, default=3000)
    ap.add_argument("--_read_child", default="", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args._read_child:
        read_store_child(args._read_child, args.mem_steps)
        return
    os.makedirs(args.work, exist_ok=True)
    try:
        corpus = data.load_corpus(data.DataConfig(), 2048, progress=True)  # the default's store (cached)
        tok_path = os.path.join(args.work, "tokenizer.json")
        corpus.tokenizer.save(tok_path)
        res = {
            "tokenize": bench_tokenize(args.work, args.tokenize_mb, args.rounds, tok_path),
            "loader": bench_loader(corpus, args.loader_steps),
        }
        if not args.skip_step:
            res["step_rows_s"] = step_rows_s(corpus, args.step_steps)
            print(
                f"loader / train step: {res['loader']['rows_s'] / res['step_rows_s']:,.0f}x (one source), "
                f"{res['loader']['rows_s_mixture'] / res['step_rows_s']:,.0f}x (mixture)"
            )
        res["memory"] = bench_memory(args.work, args.store_gb, args.mem_steps)
        print(json.dumps(res))
    finally:
        if args.work == "/tmp/stencil-bench-data" or os.path.basename(args.work).startswith("stencil-bench"):
            shutil.rmtree(args.work, ignore_errors=True)


if __name__ == "__main__":
    main()
