"""Data at run time: token stores -> packed rows of seq_len+1 tokens, one source or a weighted mixture.

Every input goes through a token store (shared/storage/tokenstore.py: shards of token ids, document
boundaries and a manifest). A store made by `python -m shared.pretokenize` is read as it is; the
built-in default (`stdlib`: the running interpreter's standard library, so nothing is ever
downloaded), text files and a `.npy` of token ids are tokenized once into a store in the cache by
shared/data/sources.py (the offline part: reading documents, tokenizers, building stores), so a second
load is fast. Rows are read from the store on demand: nothing loads a whole store. This module holds
the run-time part (the data config and its parsing are shared/data/config.py): opening a corpus, packing rows, the loaders, evaluation sets and
bits per byte.

`--data.source` names one source (`stdlib`; comma-separated paths/globs of text files; one .npy;
one token store, a folder or a URL) or a mixture of named sources with weights:
`web=gs://bucket/web@0.7,code=/data/code@0.3` (a YAML preset may give `weights: {web: 0.7, code:
0.3}` instead of the @ suffixes). Each source holds out `val_fraction` of its documents (evenly
spaced, independent of the seed); the held-out rows, mixed by weight, are the default evaluation
set (`eval/loss`, `eval/bpb`). `--data.eval name=path,...` adds named sets (a token store or a text source).

Packing: the token stream of a split is cut into rows of T+1 tokens; row r is tokens
[r*(T+1), (r+1)*(T+1)). Every document ends with eos. loss_mask is 0 where the target lies in a
different document than the input token, so nothing predicts across documents. A source's rows
are visited in a keyed permutation of (seed, source, epoch) that needs no table in memory; a
mixture picks each row's source by (seed, step), and a source that runs out starts its next
epoch on its own. The global batch at step s is the same for any number of processes, and each
process reads only its own rows.

Bits per byte (`eval/<name>/bpb`): the evaluation's summed loss in bits divided by the UTF-8 bytes
of the text its predicted tokens stand for; each predicted token carries bytes(doc) / (tokens(doc)
- 1) of its document (the first token of a document is never predicted), so a set evaluated row
by row in full gives exactly bits / bytes of its whole documents.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import zlib
from dataclasses import dataclass, field

import numpy as np

from shared.data import sources
from shared.data.config import DataConfig, parse_eval, parse_sources  # noqa: F401  (data.DataConfig)
from shared.storage.tokenstore import DataError, TokenStore  # noqa: F401  (DataError is data.DataError)


@dataclass
class Split:
    """An in-memory token array and the exclusive end offset of each document in it (and its bytes)."""

    tokens: np.ndarray  # 1-D uint16/uint32
    doc_ends: np.ndarray  # 1-D int64, increasing, last == len(tokens)
    doc_bytes: np.ndarray | None = None  # UTF-8 bytes of each document's text (None: unknown)
    name: str = "split"

    @property
    def n_tokens(self) -> int:
        return len(self.tokens)

    @property
    def n_docs(self) -> int:
        return len(self.doc_ends)

    def n_rows(self, seq_len: int) -> int:
        return self.n_tokens // (seq_len + 1)

    def read(self, start: int, stop: int) -> np.ndarray:
        return self.tokens[start:stop]

    def doc_ids(self, pos: np.ndarray) -> np.ndarray:
        return np.searchsorted(self.doc_ends, pos, side="right")

    def doc_stats(self, ids: np.ndarray):
        lengths = np.diff(self.doc_ends, prepend=0)[ids]
        return lengths, None if self.doc_bytes is None else self.doc_bytes[ids]


class Stream:
    """A view of a token store: runs of whole documents [starts[i], ends[i]) (store positions), in order."""

    def __init__(self, store: TokenStore, starts, ends, name: str):
        self.store, self.name = store, name
        self.starts, self.ends = np.asarray(starts, np.int64), np.asarray(ends, np.int64)
        self.cum = np.r_[0, np.cumsum(self.ends - self.starts)]
        self.n_tokens = int(self.cum[-1])

    def n_rows(self, seq_len: int) -> int:
        return self.n_tokens // (seq_len + 1)

    def _to_store(self, pos: np.ndarray) -> np.ndarray:
        r = np.searchsorted(self.cum, pos, side="right") - 1
        return self.starts[r] + pos - self.cum[r]

    def read(self, start: int, stop: int) -> np.ndarray:
        out = []
        r = int(np.searchsorted(self.cum, start, side="right")) - 1
        while start < stop:
            hi = min(stop, int(self.cum[r + 1]))
            base = int(self.starts[r] - self.cum[r])
            out.append(self.store.read(base + start, base + hi))
            start, r = hi, r + 1
        return out[0] if len(out) == 1 else np.concatenate(out)

    def doc_ids(self, pos: np.ndarray) -> np.ndarray:
        return self.store.doc_index(self._to_store(np.asarray(pos, np.int64)))

    def doc_stats(self, ids: np.ndarray):
        s, e, nbytes = self.store.doc_spans(ids)
        return e - s, None if self.store.n_bytes is None else nbytes

    # Whole-view conveniences for small data and tests (they materialize the view).
    @property
    def tokens(self) -> np.ndarray:
        return self.read(0, self.n_tokens)

    @property
    def doc_ends(self) -> np.ndarray:
        ids = self.doc_ids(np.arange(self.n_tokens))
        return np.r_[np.flatnonzero(np.diff(ids)) + 1, self.n_tokens].astype(np.int64)

    @property
    def n_docs(self) -> int:
        first = self.store.doc_index(self.starts)
        last = self.store.doc_index(self.ends - 1)
        return int(np.sum(last - first + 1))


@dataclass
class Source:
    name: str  # "" for a single unnamed source
    weight: float
    train: object  # Stream (or Split)
    val: object
    digest: str  # what the data is: sha256 of the documents (text), the ids (.npy) or the manifest (store)


@dataclass
class Corpus:
    tokenizer: object | None  # tokenizers.Tokenizer; None for pre-tokenized input without one
    vocab_size: int
    eos_id: int
    train: object | None  # the single source's train view (None for a mixture: see sources)
    val: object | None
    digest: str = ""  # what the data is (and, for a mixture, its names and weights)
    tokenizer_digest: str = ""  # sha256 of the tokenizer's json file ("" without one)
    sources: list = field(default_factory=list)  # [Source]
    evals: dict = field(default_factory=dict)  # name -> Stream of the named evaluation sets

    def encode(self, text: str) -> list[int]:
        return self._tok().encode(text, add_special_tokens=False).ids

    def decode(self, ids) -> str:
        return self._tok().decode([int(i) for i in ids], skip_special_tokens=False)

    def _tok(self):
        if self.tokenizer is None:
            raise DataError("this corpus is pre-tokenized and has no tokenizer; set DataConfig.tokenizer")
        return self.tokenizer


# ---------------------------------------------------------------- splits


def holdout(n_docs: int, val_fraction: float, what: str) -> np.ndarray:
    """Indices of the held-out documents: evenly spaced, independent of the seed."""
    if not 0.0 < val_fraction < 1.0:
        raise DataError(f"val_fraction must be in (0, 1), got {val_fraction}")
    if n_docs < 2:
        raise DataError(f"{what}: need at least 2 documents for a train/val split, got {n_docs}")
    n_val = min(n_docs - 1, max(1, round(val_fraction * n_docs)))
    return ((np.arange(n_val) + 0.5) * n_docs / n_val).astype(np.int64)


def split_documents(tokens: np.ndarray, doc_ends: np.ndarray, val_fraction: float) -> tuple[Split, Split]:
    """(train, val) in memory: val is the `holdout` subset of documents."""
    n_docs = len(doc_ends)
    is_val = np.zeros(n_docs, bool)
    is_val[holdout(n_docs, val_fraction, "the corpus")] = True
    lengths = np.diff(doc_ends, prepend=0)
    tok_val = np.repeat(is_val, lengths)

    def make(sel, tok_sel):
        return Split(tokens[tok_sel], np.cumsum(lengths[sel]).astype(np.int64))

    return make(~is_val, ~tok_val), make(is_val, tok_val)


def store_splits(store: TokenStore, val_fraction: float, name: str) -> tuple[Stream, Stream]:
    """(train, val) views of a store: the same documents as split_documents, without reading tokens."""
    val = holdout(store.n_docs, val_fraction, store.root)
    vs, ve, _ = store.doc_spans(val)
    ts_ = np.r_[0, ve]
    te = np.r_[vs, store.n_tokens]
    keep = te > ts_
    return (
        Stream(store, ts_[keep], te[keep], f"{name or 'train'} (train split of {store.root})"),
        Stream(store, vs, ve, f"{name or 'train'} (held-out split of {store.root})"),
    )


def whole(store: TokenStore, name: str) -> Stream:
    return Stream(store, [0], [store.n_tokens], name)


# ---------------------------------------------------------------- opening sources


def load_corpus(cfg: DataConfig, vocab_size: int, *, progress: bool = True) -> Corpus:
    """Open (or tokenize once into the cache) every source of cfg, split each, and open the eval sets."""
    if vocab_size <= 0 or vocab_size > 2**32:
        raise DataError(f"vocab_size must be in [1, 2**32], got {vocab_size}")
    entries = parse_sources(cfg.source, cfg.weights)
    kinds = ["store" if sources.is_store(s) else "npy" if s.endswith(".npy") else "text" for _, s, _ in entries]

    # The tokenizer: the given one, else the first store's, else a BPE trained on the first text source.
    tok, tok_digest, first_docs, first_digest = None, None, None, ""
    if cfg.tokenizer:
        tok, tok_digest = sources.load_tokenizer(cfg.tokenizer)
    elif "store" in kinds:
        first = sources.open_store(entries[kinds.index("store")][1], vocab_size, None, "")
        tok, tok_digest = sources.store_tokenizer(first)
        tok_digest = first.tokenizer_sha256 if tok is None else tok_digest
    elif "text" in kinds:
        first_docs = sources.read_documents(cfg, entries[kinds.index("text")][1])
        first_digest = sources.docs_digest(first_docs)
        tok, tok_digest = sources.get_tokenizer(cfg, first_docs, first_digest, vocab_size, progress)
    if tok is not None and tok.get_vocab_size() > vocab_size:
        raise DataError(f"tokenizer has {tok.get_vocab_size()} tokens but vocab_size is {vocab_size}")
    what = f"the tokenizer {cfg.tokenizer}" if cfg.tokenizer else "the corpus tokenizer"

    def open_entry(cfg, spec, label, docs=None, docs_digest=""):
        """(store, digest) of one entry of data.source or data.eval: a token store, a .npy of ids, or text."""
        if sources.is_store(spec):
            store = sources.open_store(spec, vocab_size, tok_digest, what)
            return store, store.digest
        if spec.endswith(".npy"):
            return sources.npy_store(cfg, spec, tok, tok_digest or "", vocab_size)
        if tok is None:
            raise DataError(f"{label} needs a tokenizer (set data.tokenizer)")
        return sources.text_store(cfg, spec, tok, tok_digest, vocab_size, progress, docs, docs_digest)

    opened = []
    for name, spec, w in entries:
        reuse = first_docs is not None and spec == entries[kinds.index("text")][1]  # the tokenizer's documents
        store, digest = open_entry(
            cfg, spec, f"data.source: text source {spec!r}", first_docs if reuse else None, first_digest
        )
        train, val = store_splits(store, cfg.val_fraction, name)
        opened.append(Source(name, w, train, val, digest))

    evals = {}
    for name, spec in parse_eval(cfg.eval):  # a whole text set, whatever max_bytes caps the training text at
        store, _ = open_entry(dataclasses.replace(cfg, max_bytes=0), spec, f"data.eval: text set {name}={spec}")
        evals[name] = whole(store, f"eval set {name} ({store.root})")

    eos = sources.eos_id_of(tok) if tok is not None else opened[0].train.store.eos_id
    if len(opened) == 1:
        digest = opened[0].digest
    else:
        digest = hashlib.sha256(json.dumps([[s.name, s.digest, s.weight] for s in opened]).encode()).hexdigest()
    one = len(opened) == 1
    return Corpus(
        tok,
        vocab_size,
        eos,
        opened[0].train if one else None,
        opened[0].val if one else None,
        digest,
        tok_digest or "",
        opened,
        evals,
    )


# ---------------------------------------------------------------- packing and order


def pack_rows(split, rows: np.ndarray, seq_len: int) -> dict[str, np.ndarray]:
    """The batch for the given row indices of the split (see module docstring)."""
    T = seq_len
    rows = np.asarray(rows, np.int64)
    pos = rows[:, None] * (T + 1) + np.arange(T + 1)
    if isinstance(split, Split):
        row = split.tokens[pos].astype(np.int32)
    else:
        row = np.stack([split.read(int(s), int(s) + T + 1) for s in rows * (T + 1)]).astype(np.int32)
    doc = split.doc_ids(pos)
    new = np.concatenate([np.zeros((len(rows), 1), np.int64), (doc[:, 1:T] != doc[:, : T - 1])], axis=1)
    return {
        "tokens": row[:, :-1],
        "targets": row[:, 1:],
        "segment_ids": (np.cumsum(new, axis=1) + 1).astype(np.int32),
        "loss_mask": (doc[:, :-1] == doc[:, 1:]).astype(np.float32),
    }


def row_bytes(split, rows: np.ndarray, seq_len: int) -> float | None:
    """UTF-8 text bytes the predicted targets of these rows stand for (None: the text is unknown)."""
    T = seq_len
    pos = np.asarray(rows, np.int64)[:, None] * (T + 1) + np.arange(T + 1)
    doc = split.doc_ids(pos)
    predicted = doc[:, :-1] == doc[:, 1:]
    ids = doc[:, 1:][predicted]
    uniq, inv = np.unique(ids, return_inverse=True)
    lengths, nbytes = split.doc_stats(uniq)
    if nbytes is None:
        return None
    per_token = nbytes / np.maximum(lengths - 1, 1)
    return float(np.sum(per_token[inv]))


def _check_rows(split, seq_len: int, what: str) -> int:
    n = split.n_rows(seq_len)
    if n < 1:
        name = getattr(split, "name", "")
        raise DataError(
            f"the {what} split{' ' + name if name and name != 'split' else ''} has {split.n_tokens} "
            f"tokens but seq_len={seq_len} needs at least {seq_len + 1} for one row"
        )
    return n


def _process_slice(batch: int, process_index: int, process_count: int) -> int:
    if batch <= 0 or process_count <= 0 or batch % process_count:
        raise DataError(f"batch {batch} is not divisible by process_count {process_count}")
    if not 0 <= process_index < process_count:
        raise DataError(f"process_index {process_index} not in [0, {process_count})")
    return batch // process_count


_M1, _M2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)


def _mix(z: np.ndarray) -> np.ndarray:
    """splitmix64's finalizer, elementwise on uint64."""
    with np.errstate(over="ignore"):
        z = (z ^ (z >> np.uint64(30))) * _M1
        z = (z ^ (z >> np.uint64(27))) * _M2
    return z ^ (z >> np.uint64(31))


def permute(idx: np.ndarray, n: int, key: tuple) -> np.ndarray:
    """A keyed pseudo-random bijection of [0, n) applied to idx: a 4-round Feistel network on the
    next even power of two, cycle-walked back into range. No table: memory does not grow with n."""
    bits = max(2, int(n - 1).bit_length())
    bits += bits & 1
    half, mask = np.uint64(bits // 2), np.uint64((1 << (bits // 2)) - 1)
    keys = np.random.default_rng([int(k) for k in key]).integers(0, 2**63, 4, dtype=np.uint64)

    def rounds(x):
        left, right = x >> half, x & mask
        for k in keys:
            left, right = right, left ^ (_mix(right ^ k) & mask)
        return (left << half) | right

    out = rounds(np.asarray(idx, np.uint64))
    bad = out >= n
    while bad.any():
        out[bad] = rounds(out[bad])
        bad = out >= n
    return out.astype(np.int64)


class Loader:
    """Deterministic, resumable loader of one split; each process reads only its slice of a global batch."""

    def __init__(
        self, split, seq_len: int, global_batch: int, seed: int, *, process_index: int = 0, process_count: int = 1
    ):
        self.split, self.seq_len, self.global_batch, self.seed = split, seq_len, global_batch, int(seed)
        self.b = _process_slice(global_batch, process_index, process_count)
        self.offset = process_index * self.b
        self.n_rows = _check_rows(split, seq_len, "loader's")
        self.position = 0

    def rows(self, position: int) -> np.ndarray:
        """This process's row indices for the global batch starting at position."""
        p = position + self.offset + np.arange(self.b)
        return epoch_rows(p, self.n_rows, (self.seed,))

    def next(self) -> dict[str, np.ndarray]:
        batch = pack_rows(self.split, self.rows(self.position), self.seq_len)
        self.position += self.global_batch
        return batch

    def state(self) -> dict:
        return {"seed": self.seed, "position": self.position}

    def restore(self, state: dict) -> None:
        if set(state) != {"seed", "position"}:
            raise DataError(f"loader state must have keys seed and position, got {sorted(state)}")
        if int(state["seed"]) != self.seed:
            raise DataError(f"loader state has seed {state['seed']} but this loader has seed {self.seed}")
        self.position = int(state["position"])


def epoch_rows(p: np.ndarray, n_rows: int, key: tuple) -> np.ndarray:
    """Row index of the p-th row read from a split of n_rows: epoch p // n_rows, permuted by (key, epoch)."""
    epochs, idx = p // n_rows, p % n_rows
    out = np.empty(len(p), np.int64)
    for e in np.unique(epochs):
        out[epochs == e] = permute(idx[epochs == e], n_rows, (*key, int(e)))
    return out


def _salt(name: str) -> int:
    return zlib.crc32(name.encode())


class MixtureLoader:
    """Rows of several splits mixed by weight. Step s's sources come from (seed, step) alone: systematic
    sampling (each source gets floor or ceil of weight x batch rows), slots shuffled; each source reads its
    own rows in its own epochs. The state (step, rows each source has consumed) resumes it bit-exactly."""

    def __init__(
        self,
        splits: dict,
        weights: dict,
        seq_len: int,
        global_batch: int,
        seed: int,
        *,
        process_index: int = 0,
        process_count: int = 1,
    ):
        self.names = list(splits)
        self.splits = [splits[n] for n in self.names]
        w = np.array([float(weights[n]) for n in self.names])
        self.weights = {n: float(weights[n]) for n in self.names}
        self.cum = np.cumsum(w / w.sum())
        self.seq_len, self.global_batch, self.seed = seq_len, global_batch, int(seed)
        self.b = _process_slice(global_batch, process_index, process_count)
        self.offset = process_index * self.b
        self.n_rows = [
            _check_rows(s, seq_len, f"loader's ({n})") if self.weights[n] > 0 else 0
            for n, s in zip(self.names, self.splits)
        ]
        self.step = 0
        self.consumed = np.zeros(len(self.names), np.int64)

    def sources(self, step: int) -> np.ndarray:
        """The source index of every slot of the global batch at step."""
        rng = np.random.default_rng([self.seed, 0x6D6978, step])
        u = (np.arange(self.global_batch) + rng.random()) / self.global_batch
        src = np.minimum(np.searchsorted(self.cum, u, side="right"), len(self.names) - 1)
        return src[rng.permutation(self.global_batch)]

    def next(self) -> dict[str, np.ndarray]:
        src = self.sources(self.step)
        rank = np.empty(len(src), np.int64)  # how many earlier slots of this step read the same source
        for k in np.unique(src):
            rank[src == k] = np.arange(np.sum(src == k))
        mine = slice(self.offset, self.offset + self.b)
        s, r = src[mine], rank[mine]
        out = {}
        for k in np.unique(s):
            sel = s == k
            rows = epoch_rows(self.consumed[k] + r[sel], self.n_rows[k], (self.seed, _salt(self.names[k])))
            part = pack_rows(self.splits[k], rows, self.seq_len)
            for key, v in part.items():
                out.setdefault(key, np.empty((self.b, *v.shape[1:]), v.dtype))[sel] = v
        self.consumed += np.bincount(src, minlength=len(self.names))
        self.step += 1
        return out

    def state(self) -> dict:
        return {
            "seed": self.seed,
            "step": self.step,
            "weights": self.weights,
            "consumed": {n: int(c) for n, c in zip(self.names, self.consumed)},
        }

    def restore(self, state: dict) -> None:
        if set(state) != {"seed", "step", "weights", "consumed"}:
            raise DataError(f"mixture loader state must have keys seed, step, weights, consumed; got {sorted(state)}")
        if int(state["seed"]) != self.seed:
            raise DataError(f"loader state has seed {state['seed']} but this loader has seed {self.seed}")
        if {n: float(w) for n, w in state["weights"].items()} != self.weights:
            raise DataError(f"loader state has mixture weights {state['weights']} but this run has {self.weights}")
        self.step = int(state["step"])
        self.consumed = np.array([int(state["consumed"][n]) for n in self.names], np.int64)


def make_loader(
    corpus: Corpus, seq_len: int, global_batch: int, seed: int, *, process_index: int = 0, process_count: int = 1
):
    """The corpus's training loader: a Loader for one source, a MixtureLoader for several."""
    kw = dict(process_index=process_index, process_count=process_count)
    if len(corpus.sources) == 1:
        return Loader(corpus.sources[0].train, seq_len, global_batch, seed, **kw)
    return MixtureLoader(
        {s.name: s.train for s in corpus.sources},
        {s.name: s.weight for s in corpus.sources},
        seq_len,
        global_batch,
        seed,
        **kw,
    )


# ---------------------------------------------------------------- evaluation sets


@dataclass
class EvalSet:
    batches: list  # this process's rows of each fixed batch
    tokens: float  # predicted tokens (loss_mask) over the global batches
    bytes: float | None  # text bytes they stand for (None: unknown, no bits per byte)

    def bpb(self, loss: float) -> float | None:
        """Bits per byte from the mean loss (nats per predicted token) over these batches."""
        return None if not self.bytes else loss * self.tokens / self.bytes / math.log(2)


def eval_set(
    parts: list, seq_len: int, batch: int, n_batches: int, *, process_index: int = 0, process_count: int = 1
) -> EvalSet:
    """n_batches fixed batches from [(split, weight)]: each split's share of the rows (largest remainder
    of the weights) evenly spaced over it, repeating only if the split is too small."""
    b = _process_slice(batch, process_index, process_count)
    total = n_batches * batch
    w = np.array([p[1] for p in parts], float)
    quota = w / w.sum() * total
    count = np.floor(quota).astype(np.int64)
    count[np.argsort(-(quota - count), kind="stable")[: total - count.sum()]] += 1
    rows = []
    for (split, _), c in zip(parts, count):
        if c:
            n_rows = _check_rows(split, seq_len, "validation")
            rows += [(split, r) for r in (np.arange(c) * n_rows) // c]
    batches, tokens, nbytes = [], 0.0, 0.0
    for k in range(n_batches):  # every process packs the whole (small) global batch: tokens and bytes are global
        glob_rows, packed = rows[k * batch : (k + 1) * batch], []
        for split, _ in parts:
            mine = np.array([r for s, r in glob_rows if s is split], np.int64)
            if len(mine):
                packed.append(pack_rows(split, mine, seq_len))
                nb = row_bytes(split, mine, seq_len)
                nbytes = None if nb is None or nbytes is None else nbytes + nb
        full = {key: np.concatenate([p[key] for p in packed]) for key in packed[0]}
        tokens += float(full["loss_mask"].sum())
        batches.append({key: v[process_index * b : (process_index + 1) * b] for key, v in full.items()})
    return EvalSet(batches, tokens, nbytes)


def eval_batches(
    split, seq_len: int, batch: int, n_batches: int, *, process_index: int = 0, process_count: int = 1
) -> list[dict]:
    """n_batches fixed batches of evenly spaced rows (repeating only if the split is too small)."""
    return eval_set(
        [(split, 1.0)], seq_len, batch, n_batches, process_index=process_index, process_count=process_count
    ).batches


def eval_sets(
    corpus: Corpus, seq_len: int, batch: int, n_batches: int, *, process_index: int = 0, process_count: int = 1
) -> dict[str, EvalSet]:
    """The evaluation sets: "" = the held-out split of the training sources (mixed by weight); for a mixture,
    each source's held-out split on its own, by its name (eval/<source>/loss, as Levanter logs it); then
    every named set of data.eval."""
    kw = dict(process_index=process_index, process_count=process_count)
    out = {"": eval_set([(s.val, s.weight) for s in corpus.sources if s.weight > 0], seq_len, batch, n_batches, **kw)}
    if len(corpus.sources) > 1:
        for s in corpus.sources:
            out[s.name] = eval_set([(s.val, 1.0)], seq_len, batch, n_batches, **kw)
    for name, stream in corpus.evals.items():
        out[name] = eval_set([(stream, 1.0)], seq_len, batch, n_batches, **kw)
    return out
