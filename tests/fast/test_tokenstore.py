"""Token stores, the tokenize command, mixtures, process slicing, evaluation sets and bits per byte
(shared/storage/tokenstore.py, shared/pretokenize.py, shared/data/). Stores live on a local path and on
file:// (the object-store URL path through tensorstore's kvstore)."""

import gzip
import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest

from shared import data, pretokenize
from shared.data import sources
from shared.storage import tokenstore
from shared.data import DataConfig, DataError, Loader, MixtureLoader, eval_set, load_corpus
from shared.variant import ROOT

from helpers import VOCAB, arrays, toy_split, write_corpus  # noqa: E402  (tests/helpers.py)


def write_jsonl(path, docs, field="text"):
    path.write_text("".join(json.dumps({field: d}) + "\n" for d in docs))
    return path


def make_docs(n, seed=0, words=60):
    rng = np.random.default_rng(seed)
    vocab = [f"w{i}" for i in range(50)] + ["def", "return", "(", ")", ":", "\n"]
    return [f"doc {i}: " + " ".join(rng.choice(vocab, words + i % 17)) for i in range(n)]


@pytest.fixture(scope="module")
def tok_file(tmp_path_factory):
    """A 320-token BPE (the one data.py trains), saved as tokenizer.json."""
    d = tmp_path_factory.mktemp("tok")
    tok = sources.train_tokenizer(make_docs(200), VOCAB)
    tok.save(str(d / "tokenizer.json"))
    return str(d / "tokenizer.json")


def rows_of(loader, steps):
    return [loader.next() for _ in range(steps)]


def assert_batches_equal(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert x.keys() == y.keys()
        for k in x:
            np.testing.assert_array_equal(x[k], y[k], err_msg=k)


# ---------------------------------------------------------------- the tokenize command


def test_input_formats_give_the_same_tokens(tmp_path, tok_file):
    import pyarrow as pa
    import pyarrow.parquet as pq
    import zstandard

    docs = make_docs(30)
    d = tmp_path / "in"
    d.mkdir()
    write_jsonl(d / "a.jsonl", docs)
    raw = (d / "a.jsonl").read_bytes()
    (d / "b.jsonl.gz").write_bytes(gzip.compress(raw))
    (d / "c.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(raw))
    pq.write_table(pa.table({"text": docs, "id": list(range(30))}), d / "d.parquet")
    m = pretokenize.run([str(d)], str(tmp_path / "s"), tokenizer=tok_file, workers=1, progress=False)
    assert [s["docs"] for s in m["shards"]] == [30] * 4 and m["n_bytes"] == 4 * sum(len(x.encode()) for x in docs)
    shards = [(tmp_path / "s" / "shards" / f"{i:05d}.tokens").read_bytes() for i in range(4)]
    assert shards[0] == shards[1] == shards[2] == shards[3]
    (d / "notes.md").write_text("# a title\n\nsome text\n")
    store = pretokenize.run([str(d / "notes.md")], str(tmp_path / "md"), tokenizer=tok_file, workers=1, progress=False)
    assert store["n_docs"] == 1


def test_the_tokenizing_bar_counts_documents(tmp_path, tok_file, capsys):
    """The bar train.py shows while its text is tokenized: one bar, its total the number of documents, unit doc."""
    src = write_corpus(tmp_path, n_docs=70)  # more than one batch of 64
    load_corpus(
        DataConfig(source=str(src / "*.txt"), tokenizer=tok_file, cache_dir=str(tmp_path / "c")), VOCAB, progress=True
    )
    renders = [r.strip() for r in capsys.readouterr().err.replace("\r", "\n").splitlines() if "tokenizing" in r]
    assert renders and all(re.search(r"\| \d+/70 \[[^\]]*(\?|\d)doc/s\]$", r) for r in renders), renders
    assert renders[-1].startswith("tokenizing: 100%") and " 70/70 [" in renders[-1]


# ---------------------------------------------------------------- the loader over stores


def in_memory(cfg, tok_path):
    """Today's in-memory path: documents -> encode -> split_documents."""
    tok, _ = sources.load_tokenizer(tok_path)
    docs = sources.read_documents(cfg)
    tokens, ends = sources.encode_documents(tok, docs, sources.eos_id_of(tok), VOCAB, progress=False)
    return data.split_documents(tokens, ends, cfg.val_fraction)


def test_store_rows_equal_the_in_memory_rows(tmp_path, tok_file):
    src = write_corpus(tmp_path, n_docs=60)
    cfg = DataConfig(source=str(src / "*.txt"), tokenizer=tok_file, cache_dir=str(tmp_path / "c"), val_fraction=0.1)
    train_mem, val_mem = in_memory(cfg, tok_file)
    pretokenize.run([str(src / "*.txt")], str(tmp_path / "store"), tokenizer=tok_file, workers=1, progress=False)
    cached = load_corpus(cfg, VOCAB, progress=False)  # the text source's store in the cache
    for source in (str(tmp_path / "store"), "file://" + str(tmp_path / "store"), None):
        corpus = (
            cached
            if source is None
            else load_corpus(
                DataConfig(source=source, tokenizer=tok_file, val_fraction=0.1, cache_dir=str(tmp_path / "c")), VOCAB
            )
        )
        assert isinstance(corpus.train, data.Stream)
        want = rows_of(Loader(train_mem, 16, 6, seed=2), 25)  # > 2 epochs
        assert_batches_equal(rows_of(data.make_loader(corpus, 16, 6, seed=2), 25), want)
        assert_batches_equal(data.eval_batches(corpus.val, 16, 4, 3), data.eval_batches(val_mem, 16, 4, 3))
        np.testing.assert_array_equal(corpus.val.doc_ends, val_mem.doc_ends)


def test_mixture_proportions_and_per_source_epochs():
    """Weights 0.5 / 0.3 / 0.2 over 600 steps of 32 rows: each share within 0.003 of its weight (systematic
    sampling gives each source floor or ceil of weight x 32 rows a step, so the share's error is a random walk
    of steps within one row: sd about 0.0006 here; i.i.d. draws would have sd 0.003); the small source runs
    many epochs, each visiting every one of its rows exactly once."""
    splits = {name: toy_split([9] * n, eos=0) for name, n in (("a", 400), ("b", 300), ("c", 12))}
    for i, s in enumerate(splits.values()):
        s.tokens[s.tokens != 0] += 10 * (i + 1)  # source c's tokens are 31..38: tell the rows apart
    ld = MixtureLoader(splits, {"a": 0.5, "b": 0.3, "c": 0.2}, 8, 32, seed=1)
    src = []
    for _ in range(600):
        b = ld.next()
        first = b["tokens"][:, 1]  # never an eos: rows of 9 tokens, docs of 9 tokens
        src.append(first // 10)
    src = np.concatenate(src)
    share = np.bincount(src, minlength=4)[1:] / len(src)
    np.testing.assert_allclose(share, [0.5, 0.3, 0.2], atol=0.003)
    n_c = ld.n_rows[2]
    consumed = ld.state()["consumed"]
    assert consumed["c"] == int(np.sum(src == 3)) and consumed["c"] > 300 * n_c
    for e in range(40):  # every epoch of source c is a permutation of its rows
        rows = data.epoch_rows(np.arange(e * n_c, (e + 1) * n_c), n_c, (1, data._salt("c")))
        assert sorted(rows) == list(range(n_c))


def test_mixture_resume_mid_epoch_is_bit_exact():
    splits = {"x": toy_split([13, 7, 30, 11, 25] * 6), "y": toy_split([5, 40, 9] * 5)}
    w = {"x": 0.7, "y": 0.3}
    want = rows_of(MixtureLoader(splits, w, 8, 6, seed=3), 30)  # several epochs of y
    a = MixtureLoader(splits, w, 8, 6, seed=3)
    got = rows_of(a, 11)
    st = json.loads(json.dumps(a.state()))
    assert 0 < st["consumed"]["y"] % a.n_rows[1]  # mid-epoch
    b = MixtureLoader(splits, w, 8, 6, seed=3)
    b.restore(st)
    assert_batches_equal(got + rows_of(b, 19), want)
    with pytest.raises(DataError, match="mixture weights"):
        MixtureLoader(splits, {"x": 0.5, "y": 0.5}, 8, 6, seed=3).restore(st)


@pytest.mark.parametrize("mixture", [False, True])
def test_same_global_batch_with_1_2_4_processes(tmp_path, tok_file, mixture):
    src = write_corpus(tmp_path, n_docs=50)
    pretokenize.run([str(src / "*.txt")], str(tmp_path / "s"), tokenizer=tok_file, workers=1, progress=False)
    source = f"p={tmp_path / 's'}@0.6,q={src / '*.txt'}@0.4" if mixture else str(tmp_path / "s")
    corpus = load_corpus(DataConfig(source=source, tokenizer=tok_file, cache_dir=str(tmp_path / "c")), VOCAB)
    one = rows_of(data.make_loader(corpus, 12, 8, seed=5), 20)
    for n in (2, 4):
        parts = [
            rows_of(data.make_loader(corpus, 12, 8, seed=5, process_index=i, process_count=n), 20) for i in range(n)
        ]
        assert parts[0][0]["tokens"].shape == (8 // n, 12)
        joined = [{k: np.concatenate([p[s][k] for p in parts]) for k in one[0]} for s in range(20)]
        assert_batches_equal(joined, one)
        ev = data.eval_sets(corpus, 12, 8, 2)[""]
        evp = [data.eval_sets(corpus, 12, 8, 2, process_index=i, process_count=n)[""] for i in range(n)]
        assert all(e.tokens == ev.tokens and e.bytes == ev.bytes for e in evp)
        assert_batches_equal(
            [{k: np.concatenate([e.batches[j][k] for e in evp]) for k in ev.batches[0]} for j in range(2)], ev.batches
        )


def test_a_mixture_evaluates_each_source_on_its_own(tmp_path, tok_file):
    """A mixture's evaluation sets: the mixed held-out rows (eval/loss), then each source's held-out rows alone
    under its name (eval/<source>/...), then the named --data.eval sets; a --data.eval name that is a source's
    is refused."""
    src, other = write_corpus(tmp_path, n_docs=50), write_corpus(tmp_path, n_docs=30, name="other")
    pretokenize.run([str(src / "*.txt")], str(tmp_path / "s"), tokenizer=tok_file, workers=1, progress=False)
    corpus = load_corpus(
        DataConfig(
            source=f"p={tmp_path / 's'}@0.6,q={other / '*.txt'}@0.4",
            tokenizer=tok_file,
            eval=f"extra={src / 'doc00*.txt'}",
            cache_dir=str(tmp_path / "c"),
        ),
        VOCAB,
    )
    sets = data.eval_sets(corpus, 12, 8, 2)
    assert list(sets) == ["", "p", "q", "extra"]
    for s in corpus.sources:  # each source's own held-out rows, all of the batch
        alone = eval_set([(s.val, 1.0)], 12, 8, 2)
        assert_batches_equal(sets[s.name].batches, alone.batches)
        assert sets[s.name].tokens == alone.tokens > 0 and sets[s.name].bytes == alone.bytes > 0
    assert not np.array_equal(sets["p"].batches[0]["tokens"], sets["q"].batches[0]["tokens"])
    single = data.eval_sets(load_corpus(DataConfig(source=str(tmp_path / "s"), tokenizer=tok_file), VOCAB), 12, 8, 2)
    assert list(single) == [""]  # one source: its held-out rows are eval/loss itself
    with pytest.raises(DataError, match=r"data.eval: \['q'\] also name sources"):
        DataConfig(source="p=a.txt,q=b.txt", eval="q=c.txt")


def test_bits_per_byte_of_a_known_case():
    """Docs of 5, 3, 9, 4, 7 tokens (28) with 10, 4, 16, 6, 12 bytes of text; rows of 7 tokens start at 0, 7,
    14, 21. Predicted targets: every token but a document's first (4+2+8+3+6 = 23), less the two row starts
    inside a document (positions 7 and 14: docs 1 and 2) = 21. Each carries bytes/(length-1) of its document:
    doc0 4 x 10/4 + doc1 1 x 4/2 + doc2 7 x 16/8 + doc3 3 x 6/3 + doc4 6 x 12/6 = 10 + 2 + 14 + 6 + 12 = 44."""
    split = toy_split([5, 3, 9, 4, 7])
    split.doc_bytes = np.array([10, 4, 16, 6, 12])
    ev = eval_set([(split, 1.0)], 6, 4, 1)
    assert ev.tokens == 21 and ev.bytes == 44.0
    loss = np.log(VOCAB)  # a uniform model: ln V nats per token
    assert ev.bpb(loss) == pytest.approx(np.log2(VOCAB) * 21 / 44, rel=1e-12)
    split.doc_bytes = None
    assert eval_set([(split, 1.0)], 6, 4, 1).bpb(loss) is None  # no text (a .npy): no bits per byte


def test_eval_sets_bpb_equals_bits_over_text_bytes(tmp_path, tok_file):
    """A store evaluated on every row: the bytes its rows stand for add up to its documents' bytes, less
    what the row cuts leave out (at most one token per row, and the tail)."""
    docs = make_docs(40)
    write_jsonl(tmp_path / "e.jsonl", docs)
    pretokenize.run([str(tmp_path / "e.jsonl")], str(tmp_path / "e"), tokenizer=tok_file, workers=1, progress=False)
    store = tokenstore.TokenStore(str(tmp_path / "e"))
    view = data.whole(store, "e")
    n_rows = view.n_rows(16)
    ev = eval_set([(view, 1.0)], 16, n_rows, 1)
    total = sum(len(d.encode()) for d in docs)
    assert store.n_bytes == total and 0.9 * total < ev.bytes <= total


# ---------------------------------------------------------------- bad input: one line, naming the file and cause


def test_bad_stores_and_mixtures_are_named(tmp_path, tok_file):
    src = write_corpus(tmp_path, n_docs=12)
    good = tmp_path / "store"
    pretokenize.run([str(src / "*.txt")], str(good), tokenizer=tok_file, workers=1, progress=False)
    cache = str(tmp_path / "c")

    def load(source, vocab=VOCAB, **kw):
        return load_corpus(DataConfig(source=source, cache_dir=cache, **kw), vocab, progress=False)

    def copy(name):
        import shutil

        shutil.copytree(good, tmp_path / name)
        return tmp_path / name

    # a tokenizer other than the store's
    other = tmp_path / "other.json"
    sources.train_tokenizer(make_docs(50, seed=9), VOCAB).save(str(other))
    with pytest.raises(DataError, match=r"store/manifest.json: tokenizer hash \w+ does not match the tokenizer"):
        load(str(good), tokenizer=str(other))
    # a vocabulary larger than the model's
    with pytest.raises(
        DataError,
        match=r"store/manifest.json: the store's vocabulary has 320 tokens but the model's "
        r"vocab_size is 300",
    ):
        load(str(good), vocab=300)
    # a missing and a truncated shard
    missing = copy("missing")
    os.remove(missing / "shards" / "00003.tokens")
    with pytest.raises(DataError, match=r"missing/shards/00003.tokens: missing shard file"):
        load(str(missing))
    short = copy("short")
    with open(short / "shards" / "00002.tokens", "r+b") as f:
        f.truncate(10)
    with pytest.raises(DataError, match=r"short/shards/00002.tokens: truncated or altered shard: 10 bytes"):
        load(str(short))
    with pytest.raises(DataError, match=r"short/shards/00002.tokens: truncated or altered shard"):
        load("file://" + str(short))
    # token ids out of range (a shard's largest id beyond the model's vocabulary)
    big = copy("big")
    m = json.loads((big / "manifest.json").read_text())
    m["vocab_size"] = 256
    for i, shard in enumerate(m["shards"]):
        shard["max_id"] = 300 if i == 1 else 255
    (big / "manifest.json").write_text(json.dumps(m))
    os.remove(big / "tokenizer.json")  # ids without a tokenizer, as from a .npy
    with pytest.raises(
        DataError,
        match=r"big/shards/00001.tokens: token ids out of range: the largest is 300 but "
        r"vocab_size is 299",
    ):
        load(str(big), vocab=299)
    # an empty source
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "a.jsonl").write_text("")
    with pytest.raises(DataError, match="hold no documents"):
        pretokenize.run([str(tmp_path / "empty" / "a.jsonl")], str(tmp_path / "es"), tokenizer=tok_file, progress=False)
    # mixture weights: negative, zero in total, an unknown name
    with pytest.raises(DataError, match=r"data.weights: source 'b' has weight -1.0"):
        DataConfig(source=f"a={good}@1,b={good}@-1")
    with pytest.raises(DataError, match="data.weights: the weights of .* sum to zero"):
        DataConfig(source=f"a={good}@0,b={good}@0")
    with pytest.raises(DataError, match=r"data.weights: unknown source\(s\) \['web'\]"):
        DataConfig(source=f"a={good},b={good}", weights={"web": 1.0})
    # a Parquet file without the named column
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"body": ["x y z"]}), tmp_path / "t.parquet")
    with pytest.raises(DataError, match=r"t.parquet: no column 'text' \(columns: \['body'\]\)"):
        pretokenize.run([str(tmp_path / "t.parquet")], str(tmp_path / "pq"), tokenizer=tok_file, progress=False)
    with pytest.raises(DataError, match=r"t.parquet: no column 'text'"):
        load(str(tmp_path / "t.parquet"), tokenizer=tok_file)
    # a rerun into a store started with other inputs
    assert (
        pretokenize.run(
            [str(src / "doc00*.txt")], str(tmp_path / "part"), tokenizer=tok_file, progress=False, shard="0/2"
        )
        is None
    )  # half of the shards: no manifest yet
    with pytest.raises(DataError, match="part/plan.json: this store was started with other inputs"):
        pretokenize.run([str(src / "*.txt")], str(tmp_path / "part"), tokenizer=tok_file, progress=False)


def test_every_data_field_rejects_a_bad_value():
    for kw, name in (
        (dict(source=" "), "data.source"),
        (dict(eval="nonsense"), "data.eval"),
        (dict(text_field=""), "data.text_field"),
        (dict(tokenizer="tok.txt"), "data.tokenizer"),
        (dict(val_fraction=1.0), "data.val_fraction"),
        (dict(max_bytes=-1), "data.max_bytes"),
        (dict(cache_dir=__file__), "data.cache_dir"),
        (dict(seed=-1), "data.seed"),
        (dict(source="a=x,b=y", weights={"a": float("nan")}), "data.weights"),
    ):
        with pytest.raises(DataError, match=name):
            DataConfig(**kw)


def test_train_cli_names_a_bad_store_before_any_step(tmp_path, tok_file):
    src = write_corpus(tmp_path, n_docs=12)
    pretokenize.run([str(src / "*.txt")], str(tmp_path / "s"), tokenizer=tok_file, workers=1, progress=False)
    os.remove(tmp_path / "s" / "shards" / "00005.docs")
    r = subprocess.run(
        [
            sys.executable,
            os.path.join(ROOT, "variants", "dense", "train.py"),
            "--data.source",
            str(tmp_path / "s"),
            "--model.vocab_size",
            "512",
            "--run_dir",
            str(tmp_path / "run"),
            "--wandb",
            "disabled",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": ROOT},
    )
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr[-2000:]
    assert r.stderr.strip().splitlines()[-1] == f"error: {tmp_path}/s/shards/00005.docs: missing shard file"
    assert not os.path.exists(tmp_path / "run" / "metrics.jsonl")


def test_emitted_multi_host_jobs_run_one_shard_each(tmp_path, capsys):
    import yaml

    base = ["corpus/*.jsonl.zst", "--out", "gs://b/web", "--tokenizer", "tok.json", "--workers", "4", "--hosts", "8"]
    pretokenize.main([*base, "--emit", "slurm"])
    script = capsys.readouterr().out
    assert "#SBATCH --array=0-7" in script and "--shard ${SLURM_ARRAY_TASK_ID}/8" in script
    (tmp_path / "t.sbatch").write_text(script)
    assert subprocess.run(["bash", "-n", str(tmp_path / "t.sbatch")]).returncode == 0
    pretokenize.main([*base, "--emit", "k8s", "--image", "reg/stencil:1"])
    job = yaml.safe_load(capsys.readouterr().out)
    assert job["spec"]["completionMode"] == "Indexed" and job["spec"]["completions"] == 8
    cmd = job["spec"]["template"]["spec"]["containers"][0]["command"]
    assert cmd[:2] == ["sh", "-c"] and cmd[2].endswith("--shard ${JOB_COMPLETION_INDEX}/8")
    assert "'corpus/*.jsonl.zst'" in cmd[2]  # quoted: the glob is expanded by the command, not the shell


def test_a_resaved_tokenizer_matches_its_store(tmp_path, tok_file):
    """A run saves its tokenizer with Tokenizer.save; resuming with that copy must match a store made with
    the original file, however that file was formatted."""
    from tokenizers import Tokenizer

    compact = tmp_path / "compact.json"
    compact.write_text(Tokenizer.from_file(tok_file).to_str())  # not pretty-printed: other bytes, same tokenizer
    src = write_corpus(tmp_path, n_docs=12)
    pretokenize.run([str(src / "*.txt")], str(tmp_path / "s"), tokenizer=str(compact), workers=1, progress=False)
    first = load_corpus(DataConfig(source=str(tmp_path / "s")), VOCAB, progress=False)
    first.tokenizer.save(str(tmp_path / "run_tokenizer.json"))
    again = load_corpus(DataConfig(source=str(tmp_path / "s"), tokenizer=str(tmp_path / "run_tokenizer.json")), VOCAB)
    assert again.tokenizer_digest == first.tokenizer_digest and again.digest == first.digest


def test_train_resumes_a_mixture_bit_exactly_and_logs_named_eval_sets(small_corpus, tiny_dense, tmp_path, tok_file):
    """train.main on a mixture of a store and a text source with a named eval set: stopped at step 2 and
    resumed equals a straight run (losses, weights, loader state), and eval/<name>/loss and bpb are logged."""
    from tokenizers import Tokenizer

    tok = tmp_path / "tok512.json"
    Tokenizer.from_file(tok_file).save(str(tok))  # 320 tokens: fits the tiny model's vocab_size 512
    src = write_corpus(tmp_path, n_docs=30)
    pretokenize.run([str(src / "*.txt")], str(tmp_path / "s"), tokenizer=str(tok), workers=1, progress=False)
    cfg = dict(
        data=DataConfig(
            source=f"s={tmp_path / 's'}@0.25,py={small_corpus}@0.75",
            tokenizer=str(tok),
            eval=f"held={src / 'doc00*.txt'}",
            val_fraction=0.1,
        ),
        steps=4,
        save_every=0,
        eval_every=2,
        eval_batches=1,
    )
    straight = tiny_dense.train.main(tiny_dense.config(tmp_path / "a", **cfg))
    tiny_dense.train.main(tiny_dense.config(tmp_path / "b", stop_at=2, **cfg))
    resumed = tiny_dense.train.main(tiny_dense.config(tmp_path / "b", resume=True, **cfg))
    assert resumed["losses"] == {k: v for k, v in straight["losses"].items() if k > 2}
    for a, b in zip(arrays(straight["state"]), arrays(resumed["state"])):
        np.testing.assert_array_equal(a, b)
    rows = [json.loads(line) for line in open(tmp_path / "a" / "metrics.jsonl")]
    last = rows[-1]
    assert {"eval/loss", "eval/bpb", "eval/held/loss", "eval/held/bpb"} <= set(last)
    assert {"eval/s/loss", "eval/s/bpb", "eval/py/loss", "eval/py/bpb"} <= set(last)  # each source, by default
    assert 0 < last["eval/held/bpb"] < 20 and 0 < last["eval/s/bpb"] < 20 and 0 < last["eval/py/bpb"] < 20
    from shared.storage import checkpoint

    meta = checkpoint.read_metadata(checkpoint.latest(str(tmp_path / "b" / "checkpoints")))
    assert meta["loader"]["weights"] == {"s": 0.25, "py": 0.75} and meta["loader"]["step"] == 4
