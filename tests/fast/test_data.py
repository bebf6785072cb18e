"""Tests for shared/data/ on small synthetic corpora (cache in tmp_path)."""

import json
import re

import numpy as np
import pytest

from shared import data
from shared.data import sources
from shared.data import DataConfig, DataError, Loader, eval_batches, load_corpus, pack_rows

from helpers import VOCAB, toy_split, write_corpus  # noqa: E402  (tests/helpers.py)


@pytest.fixture
def corpus(tmp_path):
    src = write_corpus(tmp_path)
    return load_corpus(
        DataConfig(source=str(src / "*.txt"), cache_dir=str(tmp_path / "c"), val_fraction=0.1), VOCAB, progress=False
    )


def test_packing_targets_segments_mask():
    split = toy_split([5, 3, 9, 4, 7])  # 28 tokens; seq_len 6 -> 4 rows of 7
    T = 6
    b = pack_rows(split, np.arange(4), T)
    assert b["tokens"].dtype == np.int32 and b["loss_mask"].dtype == np.float32
    assert b["tokens"].shape == (4, T)
    flat = split.tokens.astype(np.int32)
    for r in range(4):
        row = flat[r * (T + 1) : (r + 1) * (T + 1)]
        np.testing.assert_array_equal(b["tokens"][r], row[:-1])
        np.testing.assert_array_equal(b["targets"][r], row[1:])
    # doc index of every token, then expected segments and mask
    doc = np.repeat(np.arange(5), [5, 3, 9, 4, 7])[:28].reshape(4, T + 1)
    np.testing.assert_array_equal(b["segment_ids"], doc[:, :-1] - doc[:, :1] + 1)
    np.testing.assert_array_equal(b["loss_mask"], (doc[:, :-1] == doc[:, 1:]).astype(np.float32))
    # row 0 = [1 2 3 4 eos | 1 2]: the eos input predicting the next doc is masked, last token -> eos is not
    np.testing.assert_array_equal(b["segment_ids"][0], [1, 1, 1, 1, 1, 2])
    np.testing.assert_array_equal(b["loss_mask"][0], [1, 1, 1, 1, 0, 1])
    assert b["targets"][0, 3] == 0  # last real token predicts eos
    # mask is zero exactly where the input token is an eos (every doc ends with one)
    np.testing.assert_array_equal(b["loss_mask"] == 0, b["tokens"] == 0)


def test_resume_is_exact():
    split = toy_split([13, 7, 30, 11, 25, 9, 17] * 3)
    ref = Loader(split, 8, 6, seed=3)
    want = [ref.next() for _ in range(12)]  # several epochs (n_rows = 25)
    a = Loader(split, 8, 6, seed=3)
    got = [a.next() for _ in range(5)]
    st = json.loads(json.dumps(a.state()))
    assert st == {"seed": 3, "position": 30}
    b = Loader(split, 8, 6, seed=3)
    b.restore(st)
    got += [b.next() for _ in range(7)]
    for w, g in zip(want, got):
        for k in w:
            np.testing.assert_array_equal(w[k], g[k])
    with pytest.raises(DataError, match="seed"):
        Loader(split, 8, 6, seed=4).restore(st)


def test_determinism_and_seed_changes_order():
    split = toy_split(list(range(5, 60)))

    def rows(seed):
        ld = Loader(split, 16, 4, seed=seed)
        return np.concatenate([ld.next()["tokens"] for _ in range(10)])

    np.testing.assert_array_equal(rows(0), rows(0))
    assert not np.array_equal(rows(0), rows(1))


def test_epoch_visits_every_row_once():
    split = toy_split(list(range(5, 40)))
    ld = Loader(split, 10, 1, seed=0)
    seen = [int(ld.rows(p)[0]) for p in range(ld.n_rows)]
    assert sorted(seen) == list(range(ld.n_rows))


def test_process_slices_concatenate_to_global_batch():
    split = toy_split(list(range(5, 60)))
    full = Loader(split, 12, 8, seed=5)
    parts = [Loader(split, 12, 8, seed=5, process_index=i, process_count=2) for i in range(2)]
    for _ in range(30):  # crosses epochs (n_rows = 101)
        g = full.next()
        p = [ld.next() for ld in parts]
        assert p[0]["tokens"].shape == (4, 12)
        for k in g:
            np.testing.assert_array_equal(np.concatenate([p[0][k], p[1][k]]), g[k])
    ev = eval_batches(split, 12, 8, 3)
    evp = [eval_batches(split, 12, 8, 3, process_index=i, process_count=2) for i in range(2)]
    for k in ev[0]:
        np.testing.assert_array_equal(np.concatenate([evp[0][1][k], evp[1][1][k]]), ev[1][k])


def test_eval_batches_fixed(corpus):
    a = eval_batches(corpus.val, 16, 4, 2)
    b = eval_batches(corpus.val, 16, 4, 2)
    assert len(a) == 2 and a[0]["tokens"].shape == (4, 16)
    for x, y in zip(a, b):
        for k in x:
            np.testing.assert_array_equal(x[k], y[k])


def test_val_docs_disjoint_from_train(corpus, tmp_path):
    def docs(split):
        return {corpus.decode(split.tokens[s:e]) for s, e in zip(np.r_[0, split.doc_ends[:-1]], split.doc_ends)}

    train, val = docs(corpus.train), docs(corpus.val)
    assert len(val) == 4 and len(train) == 36 and not train & val
    assert all(d.endswith(sources.EOS) for d in train | val)
    # the split does not depend on the seed
    again = load_corpus(
        DataConfig(source=str(tmp_path / "docs"), cache_dir=str(tmp_path / "c"), val_fraction=0.1, seed=9),
        VOCAB,
        progress=False,
    )
    np.testing.assert_array_equal(again.val.tokens, corpus.val.tokens)


def test_encode_decode_roundtrip(corpus):
    for s in ["document 3: word1 word2\n", "  def f(x):\n\treturn x  # ünïcode ✓\n", ""]:
        ids = corpus.encode(s)
        assert all(0 <= i < VOCAB for i in ids)
        assert corpus.decode(ids) == s
    assert corpus.decode([corpus.eos_id]) == sources.EOS
    assert corpus.train.tokens.dtype == np.uint16 and corpus.train.tokens.max() < VOCAB


def test_cache_hit_skips_training_and_encoding(tmp_path, monkeypatch):
    src = write_corpus(tmp_path)
    cfg = DataConfig(source=str(src / "*.txt"), cache_dir=str(tmp_path / "c"))
    first = load_corpus(cfg, VOCAB, progress=False)

    def boom(*a, **k):
        raise AssertionError("cache miss")

    monkeypatch.setattr(sources, "train_tokenizer", boom)
    monkeypatch.setattr(sources, "encode_documents", boom)
    second = load_corpus(cfg, VOCAB, progress=False)
    np.testing.assert_array_equal(first.train.tokens, second.train.tokens)
    # a different vocab size or corpus is a different key
    with pytest.raises(AssertionError, match="cache miss"):
        load_corpus(cfg, VOCAB + 10, progress=False)
    (src / "doc000.txt").write_text("changed")
    with pytest.raises(AssertionError, match="cache miss"):
        load_corpus(cfg, VOCAB, progress=False)


def test_tokenizer_path_and_jsonl(corpus, tmp_path):
    tok_path = tmp_path / "tok.json"
    corpus.tokenizer.save(str(tok_path))
    f = tmp_path / "d.jsonl"
    f.write_text("\n".join(json.dumps({"body": f"line {i} word{i}"}) for i in range(10)) + "\n")
    c = load_corpus(
        DataConfig(source=str(f), text_field="body", tokenizer=str(tok_path), cache_dir=str(tmp_path / "c2")),
        VOCAB,
        progress=False,
    )
    assert c.train.n_docs + c.val.n_docs == 10 and c.eos_id == corpus.eos_id
    assert c.decode(c.val.tokens) == "line 5 word5" + sources.EOS
    with pytest.raises(DataError, match="tokenizer has .* tokens but vocab_size is 100"):
        load_corpus(
            DataConfig(source=str(f), text_field="body", tokenizer=str(tok_path), cache_dir=str(tmp_path / "c2")),
            100,
            progress=False,
        )


def test_pretokenized_npy(tmp_path):
    arr = np.array([5, 6, 7, 0, 8, 9, 0, 1, 2, 3, 4, 0, 11, 12], np.int64)  # last doc lacks eos
    p = tmp_path / "t.npy"
    np.save(p, arr)
    c = load_corpus(DataConfig(source=str(p), val_fraction=0.25, cache_dir=str(tmp_path)), 16)
    assert c.tokenizer is None and c.eos_id == 0
    assert c.train.n_docs + c.val.n_docs == 4
    np.testing.assert_array_equal(c.val.tokens, [1, 2, 3, 4, 0])  # the middle document
    np.testing.assert_array_equal(c.train.tokens, [5, 6, 7, 0, 8, 9, 0, 11, 12, 0])
    with pytest.raises(DataError, match="no tokenizer"):
        c.decode([1])
    with pytest.raises(DataError, match=r"token ids span \[0, 12\] but vocab_size is 12"):
        load_corpus(DataConfig(source=str(p), cache_dir=str(tmp_path)), 12)


def test_npy_without_any_eos_is_refused_naming_the_file(tmp_path):
    """No id 0 anywhere: one document, not a train/validation problem of the cache's store."""
    p = tmp_path / "no_eos.npy"
    np.save(p, np.arange(1, 200) % 15 + 1)
    with pytest.raises(
        DataError,
        match=rf"^{re.escape(str(p))}: no end-of-document id \(0, .*among its 199 token "
        r"ids.*End every document with id 0",
    ) as e:
        load_corpus(DataConfig(source=str(p), val_fraction=0.1, cache_dir=str(tmp_path / "c")), 16, progress=False)
    assert "train/val" not in str(e.value) and not (tmp_path / "c").exists()  # nothing cached for it


def test_max_bytes_caps_corpus(tmp_path):
    src = write_corpus(tmp_path)
    docs = sources.read_documents(DataConfig(source=str(src), max_bytes=500))
    assert sum(len(d.encode()) for d in docs) == 500
    assert docs[0].startswith("document 0:")


def test_stdlib_corpus_found():
    files = sources.stdlib_files()
    assert len(files) > 500 and files == sorted(files)
    assert any(f.endswith("/argparse.py") for f in files)
    assert not any("site-packages" in f or "dist-packages" in f for f in files)
    docs = sources.read_documents(DataConfig(max_bytes=20_000))
    assert docs and sum(len(d.encode()) for d in docs) == 20_000


def test_errors(tmp_path):
    cache = str(tmp_path / "c")
    with pytest.raises(DataError, match="nope_.*matches no files"):
        load_corpus(DataConfig(source=str(tmp_path / "nope_*.txt"), cache_dir=cache), VOCAB)
    (tmp_path / "e").mkdir()
    for i in range(3):
        (tmp_path / "e" / f"{i}.txt").write_text("")
    with pytest.raises(DataError, match="all 3 file.* are empty"):
        load_corpus(DataConfig(source=str(tmp_path / "e" / "*.txt"), cache_dir=cache), VOCAB)
    (tmp_path / "bad.jsonl").write_text('{"text": "a"}\n{"other": "b"}\n')
    with pytest.raises(DataError, match=r"bad.jsonl:2: no string field 'text'"):
        load_corpus(DataConfig(source=str(tmp_path / "bad.jsonl"), cache_dir=cache), VOCAB)
    for f in (0.0, 1.0, -0.1):
        with pytest.raises(DataError, match="val_fraction"):
            data.split_documents(np.zeros(4, np.uint16), np.array([2, 4]), f)
    split = toy_split([4, 5])
    with pytest.raises(DataError, match="has 9 tokens but seq_len=16 needs at least 17"):
        Loader(split, 16, 2, seed=0)
    with pytest.raises(DataError, match="the validation split has 9 tokens"):
        eval_batches(split, 16, 2, 1)
    with pytest.raises(DataError, match="batch 6 is not divisible by process_count 4"):
        Loader(split, 2, 6, seed=0, process_index=0, process_count=4)
