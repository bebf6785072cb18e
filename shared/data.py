"""Data: a text corpus -> byte-level BPE tokens -> packed rows of seq_len+1 tokens.

The default corpus is the running interpreter's standard library (.py files), so nothing
is ever downloaded. The tokenizer and the token array are cached under a content hash
(the document bytes, vocab size and FORMAT_VERSION), so a second load is fast.

Packing: the token stream of a split is cut into rows of T+1 tokens; row r is tokens
[r*(T+1), (r+1)*(T+1)). Every document ends with eos. loss_mask is 0 where the target
lies in a different document than the input token, so nothing predicts across documents.
Rows are visited in a permutation that depends only on (seed, epoch).
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import sys
import sysconfig
import uuid
from dataclasses import dataclass

import numpy as np
from tqdm import tqdm

FORMAT_VERSION = 1
EOS = "<|eos|>"
TEXT_EXTS = (".txt", ".md", ".py", ".jsonl")
TRAIN_BYTES = 8_000_000  # the BPE is trained on an evenly strided subset of about this size
EOS_CANDIDATES = (EOS, "<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>")


class DataError(ValueError):
    """Bad data input: the message names the cause."""


@dataclass(frozen=True)
class DataConfig:
    source: str = "stdlib"       # "stdlib", path/glob (comma-separated) of text files, or one .npy
    text_field: str = "text"     # field read from each JSONL line
    tokenizer: str = ""          # "" = train a byte-level BPE on the corpus; or a tokenizer.json
    val_fraction: float = 0.02   # fraction of documents held out (at least 1 document)
    max_bytes: int = 0           # cap on corpus text bytes read (0 = no cap)
    cache_dir: str = ""          # "" = $STENCIL_CACHE or ~/.cache/stencil
    seed: int = 0                # data order seed


@dataclass
class Split:
    """A flat token array and the exclusive end offset of each document in it."""
    tokens: np.ndarray    # 1-D uint16/uint32
    doc_ends: np.ndarray  # 1-D int64, increasing, last == len(tokens)

    @property
    def n_docs(self) -> int:
        return len(self.doc_ends)

    def n_rows(self, seq_len: int) -> int:
        return len(self.tokens) // (seq_len + 1)


@dataclass
class Corpus:
    tokenizer: object | None  # tokenizers.Tokenizer; None for pre-tokenized input without one
    vocab_size: int
    eos_id: int
    train: Split
    val: Split
    digest: str = ""  # sha256 of the documents (text) or of the token array (.npy): what the data is
    tokenizer_digest: str = ""  # sha256 of the tokenizer's json file ("" without one)

    def encode(self, text: str) -> list[int]:
        return self._tok().encode(text, add_special_tokens=False).ids

    def decode(self, ids) -> str:
        return self._tok().decode([int(i) for i in ids], skip_special_tokens=False)

    def _tok(self):
        if self.tokenizer is None:
            raise DataError("this corpus is pre-tokenized and has no tokenizer; set DataConfig.tokenizer")
        return self.tokenizer


# ---------------------------------------------------------------- reading documents

def stdlib_files() -> list[str]:
    """The standard library's .py files, without site-packages/dist-packages, sorted."""
    root = sysconfig.get_paths()["stdlib"]
    out = []
    for d, subdirs, files in os.walk(root):
        subdirs[:] = [s for s in subdirs if s not in ("site-packages", "dist-packages", "__pycache__")]
        out += [os.path.join(d, f) for f in files if f.endswith(".py")]
    if not out:
        raise DataError(f"no .py files found in the standard library at {root}")
    return sorted(out)


def source_files(source: str) -> list[str]:
    """Files named by a comma-separated list of paths, directories or globs, sorted."""
    if source == "stdlib":
        return stdlib_files()
    files = set()
    for pat in (p.strip() for p in source.split(",")):
        if not pat:
            continue
        pat = os.path.expanduser(pat)
        if os.path.isdir(pat):
            found = [f for f in glob.glob(os.path.join(pat, "**", "*"), recursive=True)
                     if f.endswith(TEXT_EXTS) and os.path.isfile(f)]
        else:
            found = [f for f in glob.glob(pat, recursive=True) if os.path.isfile(f)]
        if not found:
            raise DataError(f"data source pattern {pat!r} matches no files")
        for f in found:
            if not f.endswith(TEXT_EXTS + (".npy",)):
                raise DataError(f"unsupported file type {f!r}; expected one of {TEXT_EXTS + ('.npy',)}")
        files.update(found)
    if not files:
        raise DataError(f"data source {source!r} names no files")
    return sorted(files)


def _file_docs(path: str, text_field: str, lenient: bool):
    raw = open(path, "rb").read()
    try:
        text = raw.decode("utf-8", errors="replace" if lenient else "strict")
    except UnicodeDecodeError as e:
        raise DataError(f"{path} is not valid UTF-8 ({e})") from e
    if not path.endswith(".jsonl"):
        yield text
        return
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise DataError(f"{path}:{n}: invalid JSON ({e})") from e
        if not isinstance(obj, dict) or not isinstance(obj.get(text_field), str):
            raise DataError(f"{path}:{n}: no string field {text_field!r} in this JSONL line")
        yield obj[text_field]


def read_documents(cfg: DataConfig) -> list[str]:
    """Non-empty documents of the source, in sorted file order, capped at cfg.max_bytes."""
    files = source_files(cfg.source)
    if any(f.endswith(".npy") for f in files):
        raise DataError(f"a .npy source must be a single file on its own, got {len(files)} files")
    docs, used = [], 0
    for f in files:
        for d in _file_docs(f, cfg.text_field, lenient=cfg.source == "stdlib"):
            if cfg.max_bytes:
                b = d.encode()
                if used + len(b) > cfg.max_bytes:
                    d = b[: cfg.max_bytes - used].decode("utf-8", errors="ignore")
                used += len(d.encode())
            if d:
                docs.append(d)
            if cfg.max_bytes and used >= cfg.max_bytes:
                return docs
    if not docs:
        raise DataError(f"all {len(files)} file(s) of data source {cfg.source!r} are empty")
    return docs


# ---------------------------------------------------------------- tokenizer and cache

def _cache_dir(cfg: DataConfig) -> str:
    d = cfg.cache_dir or os.environ.get("STENCIL_CACHE") or os.path.expanduser("~/.cache/stencil")
    d = os.path.join(d, "data")
    os.makedirs(d, exist_ok=True)
    return d


def _atomic(path: str, write) -> None:
    """write(tmp) then rename onto path; tmp keeps path's extension (np.save would add one)."""
    tmp = f"{path}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}{os.path.splitext(path)[1]}"
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def train_tokenizer(docs: list[str], vocab_size: int):
    """Byte-level BPE with one special token, trained on an evenly strided subset of docs."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    total = sum(len(d) for d in docs)
    stride = max(1, -(-total // TRAIN_BYTES))
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(docs[::stride], trainer)
    return tok


def _get_tokenizer(cfg: DataConfig, docs: list[str], digest: str, vocab_size: int, progress: bool):
    """(tokenizer, sha256 of its json file): loaded from cfg.tokenizer, the cache, or trained."""
    from tokenizers import Tokenizer
    path = cfg.tokenizer
    if not path:
        key = hashlib.sha256(f"bpe-v{FORMAT_VERSION}-{vocab_size}-{digest}".encode()).hexdigest()
        path = os.path.join(_cache_dir(cfg), f"tok-{key[:32]}.json")
        if not os.path.exists(path):
            if vocab_size < 257:
                raise DataError(f"vocab_size {vocab_size} is too small for a byte-level BPE (need >= 257)")
            if progress:
                print(f"training a {vocab_size}-token BPE tokenizer (cached in {path})", file=sys.stderr)
            tok = train_tokenizer(docs, vocab_size)
            _atomic(path, lambda tmp: tok.save(tmp))
    if not os.path.isfile(path):
        raise DataError(f"tokenizer file {path!r} does not exist")
    raw = open(path, "rb").read()
    try:
        tok = Tokenizer.from_str(raw.decode())
    except Exception as e:
        raise DataError(f"cannot load tokenizer {path!r}: {e}") from e
    return tok, hashlib.sha256(raw).hexdigest()


def _eos_id(tok) -> int:
    for name in EOS_CANDIDATES:
        i = tok.token_to_id(name)
        if i is not None:
            return i
    raise DataError(f"tokenizer has none of the end-of-document tokens {EOS_CANDIDATES}")


def encode_documents(tok, docs: list[str], eos_id: int, vocab_size: int, progress: bool = True):
    """(flat tokens, document end offsets); each document gets eos appended."""
    dtype = np.uint16 if vocab_size <= 65536 else np.uint32
    parts = []
    for i in tqdm(range(0, len(docs), 64), desc="tokenizing", unit="64 docs", disable=not progress):
        for enc in tok.encode_batch_fast(docs[i:i + 64], add_special_tokens=False):  # no offsets: 2x faster
            parts.append(np.asarray(enc.ids + [eos_id], dtype=dtype))
    return np.concatenate(parts), np.cumsum([len(p) for p in parts], dtype=np.int64)


# ---------------------------------------------------------------- splits and loading

def split_documents(tokens: np.ndarray, doc_ends: np.ndarray, val_fraction: float) -> tuple[Split, Split]:
    """(train, val): val is an evenly spaced, seed-independent subset of documents."""
    if not 0.0 < val_fraction < 1.0:
        raise DataError(f"val_fraction must be in (0, 1), got {val_fraction}")
    n_docs = len(doc_ends)
    if n_docs < 2:
        raise DataError(f"need at least 2 documents for a train/val split, got {n_docs}")
    n_val = min(n_docs - 1, max(1, round(val_fraction * n_docs)))
    is_val = np.zeros(n_docs, bool)
    is_val[((np.arange(n_val) + 0.5) * n_docs / n_val).astype(np.int64)] = True
    lengths = np.diff(doc_ends, prepend=0)
    tok_val = np.repeat(is_val, lengths)

    def make(sel, tok_sel):
        return Split(tokens[tok_sel], np.cumsum(lengths[sel]).astype(np.int64))
    return make(~is_val, ~tok_val), make(is_val, tok_val)


def _pretokenized(cfg: DataConfig, vocab_size: int) -> tuple[np.ndarray, np.ndarray, int, object]:
    path = os.path.expanduser(cfg.source)
    if not os.path.isfile(path):
        raise DataError(f"pre-tokenized file {path!r} does not exist")
    arr = np.load(path)
    if arr.ndim != 1 or not np.issubdtype(arr.dtype, np.integer) or arr.size == 0:
        raise DataError(f"{path}: expected a non-empty 1-D integer array, got {arr.dtype} {arr.shape}")
    lo, hi = int(arr.min()), int(arr.max())
    if lo < 0 or hi >= vocab_size:
        raise DataError(f"{path}: token ids span [{lo}, {hi}] but vocab_size is {vocab_size}")
    tok = None
    if cfg.tokenizer:
        tok, _ = _get_tokenizer(cfg, [], "", vocab_size, False)
    eos_id = _eos_id(tok) if tok is not None else 0
    if arr[-1] != eos_id:
        arr = np.append(arr, eos_id)
    arr = arr.astype(np.uint16 if vocab_size <= 65536 else np.uint32)
    ends = (np.flatnonzero(arr == eos_id) + 1).astype(np.int64)
    return arr, ends, eos_id, tok


def load_corpus(cfg: DataConfig, vocab_size: int, *, progress: bool = True) -> Corpus:
    """Read, tokenize (cached) and split the corpus named by cfg."""
    if vocab_size <= 0 or vocab_size > 2**32:
        raise DataError(f"vocab_size must be in [1, 2**32], got {vocab_size}")
    if cfg.source.strip().endswith(".npy"):
        tokens, ends, eos_id, tok = _pretokenized(cfg, vocab_size)
        digest = hashlib.sha256(np.ascontiguousarray(tokens).tobytes()).hexdigest()
        tok_digest = hashlib.sha256(open(cfg.tokenizer, "rb").read()).hexdigest() if cfg.tokenizer else ""
    else:
        docs = read_documents(cfg)
        h = hashlib.sha256(f"docs-v{FORMAT_VERSION}".encode())
        for d in docs:
            b = d.encode()
            h.update(len(b).to_bytes(8, "little"))
            h.update(b)
        digest = h.hexdigest()
        tok, tok_digest = _get_tokenizer(cfg, docs, digest, vocab_size, progress)
        if tok.get_vocab_size() > vocab_size:
            raise DataError(f"tokenizer has {tok.get_vocab_size()} tokens but vocab_size is {vocab_size}")
        eos_id = _eos_id(tok)
        key = hashlib.sha256(f"ids-v{FORMAT_VERSION}-{vocab_size}-{digest}-{tok_digest}".encode()).hexdigest()
        base = os.path.join(_cache_dir(cfg), f"ids-{key[:32]}")
        if os.path.exists(base + ".tokens.npy") and os.path.exists(base + ".ends.npy"):
            tokens, ends = np.load(base + ".tokens.npy"), np.load(base + ".ends.npy")
        else:
            tokens, ends = encode_documents(tok, docs, eos_id, vocab_size, progress)
            _atomic(base + ".tokens.npy", lambda tmp: np.save(tmp, tokens))
            _atomic(base + ".ends.npy", lambda tmp: np.save(tmp, ends))
    train, val = split_documents(tokens, ends, cfg.val_fraction)
    return Corpus(tok, vocab_size, eos_id, train, val, digest, tok_digest)


# ---------------------------------------------------------------- packing and order

def pack_rows(split: Split, rows: np.ndarray, seq_len: int) -> dict[str, np.ndarray]:
    """The batch for the given row indices of the split (see module docstring)."""
    T = seq_len
    pos = np.asarray(rows, np.int64)[:, None] * (T + 1) + np.arange(T + 1)
    row = split.tokens[pos].astype(np.int32)
    doc = np.searchsorted(split.doc_ends, pos, side="right")
    return {
        "tokens": row[:, :-1],
        "targets": row[:, 1:],
        "segment_ids": (doc[:, :-1] - doc[:, :1] + 1).astype(np.int32),
        "loss_mask": (doc[:, :-1] == doc[:, 1:]).astype(np.float32),
    }


def _check_rows(split: Split, seq_len: int, what: str) -> int:
    n = split.n_rows(seq_len)
    if n < 1:
        raise DataError(f"the {what} split has {len(split.tokens)} tokens but seq_len={seq_len} "
                        f"needs at least {seq_len + 1} for one row")
    return n


def _process_slice(batch: int, process_index: int, process_count: int) -> int:
    if batch <= 0 or process_count <= 0 or batch % process_count:
        raise DataError(f"batch {batch} is not divisible by process_count {process_count}")
    if not 0 <= process_index < process_count:
        raise DataError(f"process_index {process_index} not in [0, {process_count})")
    return batch // process_count


class Loader:
    """Deterministic, resumable loader; each process reads only its slice of a global batch."""

    def __init__(self, split: Split, seq_len: int, global_batch: int, seed: int, *,
                 process_index: int = 0, process_count: int = 1):
        self.split, self.seq_len, self.global_batch, self.seed = split, seq_len, global_batch, int(seed)
        self.b = _process_slice(global_batch, process_index, process_count)
        self.offset = process_index * self.b
        self.n_rows = _check_rows(split, seq_len, "loader's")
        self.position = 0
        self._perms: dict[int, np.ndarray] = {}

    def _perm(self, epoch: int) -> np.ndarray:
        if epoch not in self._perms:
            if len(self._perms) > 2:
                self._perms.pop(min(self._perms))
            self._perms[epoch] = np.random.default_rng([self.seed, epoch]).permutation(self.n_rows)
        return self._perms[epoch]

    def rows(self, position: int) -> np.ndarray:
        """This process's row indices for the global batch starting at position."""
        p = position + self.offset + np.arange(self.b)
        epochs, idx = p // self.n_rows, p % self.n_rows
        out = np.empty(self.b, np.int64)
        for e in np.unique(epochs):
            out[epochs == e] = self._perm(int(e))[idx[epochs == e]]
        return out

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


def eval_batches(split: Split, seq_len: int, batch: int, n_batches: int, *,
                 process_index: int = 0, process_count: int = 1) -> list[dict]:
    """n_batches fixed batches of evenly spaced rows (repeating only if the split is too small)."""
    b = _process_slice(batch, process_index, process_count)
    n_rows = _check_rows(split, seq_len, "validation")
    rows = (np.arange(n_batches * batch) * n_rows) // (n_batches * batch)
    return [pack_rows(split, rows[k * batch + process_index * b:][:b], seq_len) for k in range(n_batches)]
