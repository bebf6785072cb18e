"""Token stores: shards of flat token ids plus document boundaries, and a manifest.

A token store is a folder (a local path, or a `file://`, `gs://` or `s3://` URL read and written
through tensorstore's kvstore) holding

    manifest.json          what the store is (below); written last, when every shard is complete
    tokenizer.json         the tokenizer the ids come from (absent for stores made from a bare .npy)
    shards/NNNNN.tokens    the shard's token ids, little-endian uint16 (vocab <= 65536) or uint32
    shards/NNNNN.docs      int64 [docs, 2]: each document's exclusive end offset in the shard's
                           tokens (every document ends with eos) and the UTF-8 bytes of its text
    shards/NNNNN.json      the shard's counts: written after its two data files, so it marks the
                           shard complete (a killed tokenize run redoes shards without one)

manifest.json: {"format", "version", "tokenizer_sha256", "vocab_size", "eos_id", "dtype",
"n_tokens", "n_docs", "n_bytes", "shards": [{"name", "tokens", "docs", "bytes", "max_id",
"sha256", "input"}, ...]}. `n_bytes` is null when the text is unknown (a .npy source): such a
store has no bits-per-byte.

Reading never loads a whole store: the document index of a local shard is memory-mapped and its
tokens are read with pread (a memory-mapped token file would count every page it touched in the
process's resident memory); a URL's shards are read with ranged kvstore reads. Opening checks
the manifest against every shard's size (a missing or truncated shard is an error naming it);
`check_ids` checks the largest token id recorded for each shard against the vocabulary.

The URL path is tested on `file://` and on a local S3-compatible server (tests/fast/test_tokenstore.py);
gs:// goes through the same kvstore calls; neither has been run against a real bucket (UNVERIFIED).
"""

from __future__ import annotations

import hashlib
import json

import numpy as np

from shared.storage import objstore
from shared.errors import StencilError

FORMAT = "stencil-token-store"
VERSION = 1


class DataError(StencilError, ValueError):
    """Bad data input: the message names the file and the cause."""


def token_dtype(vocab_size: int):
    return np.dtype("<u2") if vocab_size <= 65536 else np.dtype("<u4")


def sha256_file(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


# ---------------------------------------------------------------- writing


def shard_key(index: int, ext: str) -> str:
    return f"shards/{index:05d}.{ext}"


def write_shard(folder: objstore.Folder, index: int, tokens: np.ndarray, docs: np.ndarray, input_name: str) -> dict:
    """Write one shard (tokens, docs [n, 2] = (end, bytes)) and then its marker; returns the marker."""
    tokens = np.ascontiguousarray(tokens)
    docs = np.ascontiguousarray(docs, dtype="<i8")
    tb, db = tokens.tobytes(), docs.tobytes()
    folder.write(shard_key(index, "tokens"), tb)
    folder.write(shard_key(index, "docs"), db)
    marker = {
        "name": f"{index:05d}",
        "tokens": int(tokens.size),
        "docs": int(len(docs)),
        "bytes": int(docs[:, 1].sum()) if len(docs) else 0,
        "max_id": int(tokens.max()) if tokens.size else -1,
        "sha256": hashlib.sha256(tb + db).hexdigest(),
        "input": input_name,
    }
    folder.write(shard_key(index, "json"), json.dumps(marker).encode())
    return marker


def read_marker(folder: objstore.Folder, index: int) -> dict | None:
    raw = folder.read(shard_key(index, "json"))
    if raw is None:
        return None
    try:
        return json.loads(raw)
    except json.JSONDecodeError:
        return None  # a marker cut short: redo the shard


def write_manifest(
    folder: objstore.Folder,
    markers: list[dict],
    *,
    tokenizer_sha256: str,
    vocab_size: int,
    eos_id: int,
    has_text: bool = True,
) -> dict:
    manifest = {
        "format": FORMAT,
        "version": VERSION,
        "tokenizer_sha256": tokenizer_sha256,
        "vocab_size": int(vocab_size),
        "eos_id": int(eos_id),
        "dtype": token_dtype(vocab_size).name,
        "n_tokens": sum(m["tokens"] for m in markers),
        "n_docs": sum(m["docs"] for m in markers),
        "n_bytes": sum(m["bytes"] for m in markers) if has_text else None,
        "shards": markers,
    }
    folder.write("manifest.json", json.dumps(manifest, indent=1).encode())
    return manifest


def build_docs(lengths: np.ndarray, n_bytes: np.ndarray | None) -> np.ndarray:
    """The [n, 2] docs array from document lengths (tokens, eos included) and their text bytes."""
    docs = np.zeros((len(lengths), 2), np.int64)
    docs[:, 0] = np.cumsum(lengths)
    if n_bytes is not None:
        docs[:, 1] = n_bytes
    return docs


# ---------------------------------------------------------------- reading


class TokenStore:
    """An opened token store: global token positions [0, n_tokens) over its shards in order."""

    def __init__(self, root: str):
        self.folder = objstore.Folder(root, DataError)
        self.root = self.folder.root
        raw = self.folder.read("manifest.json")
        if raw is None:
            raise DataError(
                f"{self.folder.name('manifest.json')}: missing (not a token store, or its tokenize run "
                "has not finished: rerun the same command to complete it)"
            )
        try:
            m = json.loads(raw)
            if m.get("format") != FORMAT:
                raise ValueError(f"format is {m.get('format')!r}, not {FORMAT!r}")
            self.shards = m["shards"]
            self.vocab_size, self.eos_id, self.dtype = int(m["vocab_size"]), int(m["eos_id"]), np.dtype(m["dtype"])
            self.tokenizer_sha256, self.n_bytes = m["tokenizer_sha256"], m["n_bytes"]
        except (ValueError, KeyError, TypeError) as e:
            raise DataError(f"{self.folder.name('manifest.json')}: not a valid token store manifest ({e})") from e
        self.manifest = m
        self.digest = hashlib.sha256(json.dumps(m, sort_keys=True).encode()).hexdigest()
        self.tok_counts = np.array([s["tokens"] for s in self.shards], np.int64)
        self.doc_counts = np.array([s["docs"] for s in self.shards], np.int64)
        self.tok_starts = np.r_[0, np.cumsum(self.tok_counts)]
        self.doc_starts = np.r_[0, np.cumsum(self.doc_counts)]
        self.n_tokens, self.n_docs = int(self.tok_starts[-1]), int(self.doc_starts[-1])
        if self.n_docs == 0 or self.n_tokens == 0:
            raise DataError(f"{self.folder.name('manifest.json')}: the store is empty (0 documents)")
        self._docs: dict[int, np.ndarray] = {}
        self._check_sizes()

    def check_ids(self, vocab_size: int) -> None:
        """Every shard's largest token id (recorded when it was written) is below vocab_size."""
        for i, s in enumerate(self.shards):
            if s["max_id"] >= vocab_size:
                raise DataError(
                    f"{self.folder.name(shard_key(i, 'tokens'))}: token ids out of range: the largest is "
                    f"{s['max_id']} but vocab_size is {vocab_size}"
                )

    def _check_sizes(self) -> None:
        item = self.dtype.itemsize
        files = [
            (shard_key(i, ext), want)
            for i, s in enumerate(self.shards)
            for ext, want in (("tokens", s["tokens"] * item), ("docs", s["docs"] * 16))
        ]
        if self.folder.url:  # ranged reads, all in flight at once: the last byte exists and nothing lies past it
            f = self.folder
            pending = [
                (key, want, f.read_async(key, max(want - 1, 0), want), f.read_async(key, want, want + 1))
                for key, want in files
            ]
            for key, want, last, past in pending:
                last, past = f.result(key, last), f.result(key, past)
                if last is None:
                    raise DataError(f"{f.name(key)}: missing shard file")
                if len(last) != min(want, 1) or past:
                    raise DataError(f"{f.name(key)}: truncated or altered shard (the manifest says {want} bytes)")
            return
        for key, want in files:
            got = self.folder.size(key)
            if got is None:
                raise DataError(f"{self.folder.name(key)}: missing shard file")
            if got != want:
                raise DataError(
                    f"{self.folder.name(key)}: truncated or altered shard: {got} bytes, the manifest says {want}"
                )

    def docs(self, shard: int) -> np.ndarray:
        """Shard's [docs, 2] (end, bytes) array: memory-mapped (local) or read once (URL)."""
        if shard not in self._docs:
            key = shard_key(shard, "docs")
            n = int(self.doc_counts[shard])
            if self.folder.url:
                arr = np.frombuffer(self.folder.read(key), "<i8").reshape(n, 2)
            else:
                arr = np.memmap(self.folder.name(key), "<i8", "r", shape=(n, 2))
            self._docs[shard] = arr
        return self._docs[shard]

    def read(self, start: int, stop: int) -> np.ndarray:
        """Tokens [start, stop) of the store, across shards."""
        out, item = [], self.dtype.itemsize
        k = int(np.searchsorted(self.tok_starts, start, side="right")) - 1
        while start < stop:
            lo, hi = start - self.tok_starts[k], min(stop, self.tok_starts[k + 1]) - self.tok_starts[k]
            raw = self.folder.read(shard_key(k, "tokens"), int(lo) * item, int(hi) * item)
            if raw is None or len(raw) != (hi - lo) * item:
                raise DataError(
                    f"{self.folder.name(shard_key(k, 'tokens'))}: short read (the shard changed "
                    "since the store was opened?)"
                )
            out.append(np.frombuffer(raw, self.dtype))
            start = int(self.tok_starts[k + 1])
            k += 1
        return out[0] if len(out) == 1 else np.concatenate(out)

    def doc_index(self, pos: np.ndarray) -> np.ndarray:
        """The global document index of each token position."""
        pos = np.asarray(pos, np.int64)
        shard = np.searchsorted(self.tok_starts, pos, side="right") - 1
        out = np.empty(pos.shape, np.int64)
        for k in np.unique(shard):
            sel = shard == k
            ends = self.docs(int(k))[:, 0]
            out[sel] = np.searchsorted(ends, pos[sel] - self.tok_starts[k], side="right") + self.doc_starts[k]
        return out

    def doc_spans(self, doc: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(start, end, text bytes) of each global document index."""
        doc = np.asarray(doc, np.int64)
        shard = np.searchsorted(self.doc_starts, doc, side="right") - 1
        start, end, nbytes = (np.empty(doc.shape, np.int64) for _ in range(3))
        for k in np.unique(shard):
            sel = shard == k
            d = self.docs(int(k))
            j = doc[sel] - self.doc_starts[k]
            end[sel] = d[j, 0] + self.tok_starts[k]
            start[sel] = np.where(j > 0, d[np.maximum(j - 1, 0), 0], 0) + self.tok_starts[k]
            nbytes[sel] = d[j, 1]
        return start, end, nbytes
