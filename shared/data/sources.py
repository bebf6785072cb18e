"""Sources -> token stores: the offline part of the data (shared/data/ reads what this builds).

Reading documents (the standard library, text / JSONL / Parquet files, compressed or not), training
or loading a tokenizer, and tokenizing a source once into a token store in the cache (keyed by a
hash of the documents, the vocab size, the tokenizer and FORMAT_VERSION), so a second load is fast.
`python -m shared.pretokenize` builds stores of large corpora with several workers from the same
pieces; train.py calls `text_store` / `npy_store` through `data.load_corpus` for small ones.

Every error names the file and the cause (`DataError`).
"""

from __future__ import annotations

import glob
import gzip
import hashlib
import io
import json
import os
import shutil
import sys
import sysconfig
import uuid
import zlib

import numpy as np
from tqdm import tqdm

from shared.storage import objstore, tokenstore
from shared.data.config import DataConfig
from shared.storage.tokenstore import DataError, TokenStore


FORMAT_VERSION = 2


EOS = "<|eos|>"


TEXT_EXTS = (".txt", ".md", ".py", ".jsonl", ".jsonl.gz", ".jsonl.zst", ".parquet")


TRAIN_BYTES = 8_000_000  # the BPE is trained on an evenly strided subset of about this size


EOS_CANDIDATES = (EOS, "<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>")


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
            found = [
                f
                for f in glob.glob(os.path.join(pat, "**", "*"), recursive=True)
                if f.endswith(TEXT_EXTS) and os.path.isfile(f)
            ]
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


def _open_text(path: str) -> bytes:
    raw = open(path, "rb").read()
    try:
        if path.endswith(".gz"):
            return gzip.decompress(raw)
        if path.endswith(".zst"):
            try:
                import zstandard
            except ImportError:
                raise DataError(f"{path}: reading .zst needs zstandard (pip install -e '.[data]')") from None
            return zstandard.ZstdDecompressor().stream_reader(io.BytesIO(raw)).read()
    except (OSError, EOFError, zlib.error) as e:
        raise DataError(f"{path}: cannot decompress ({e})") from e
    except Exception as e:  # zstandard.ZstdError
        if type(e).__module__.startswith("zstandard"):
            raise DataError(f"{path}: cannot decompress ({e})") from e
        raise
    return raw


def _parquet_docs(path: str, text_field: str):
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise DataError(f"{path}: reading Parquet needs pyarrow (pip install -e '.[data]')") from None
    try:
        f = pq.ParquetFile(path)
    except Exception as e:
        raise DataError(f"{path}: not a readable Parquet file ({e})") from e
    if text_field not in f.schema_arrow.names:
        raise DataError(f"{path}: no column {text_field!r} (columns: {f.schema_arrow.names}); set --data.text_field")
    for batch in f.iter_batches(columns=[text_field], batch_size=1024):
        for v in batch.column(0).to_pylist():
            if not isinstance(v, str):
                raise DataError(f"{path}: column {text_field!r} holds {type(v).__name__}, not text")
            yield v


def file_docs(path: str, text_field: str, lenient: bool = False):
    """The documents of one file: the whole text, one per JSONL line, or one per Parquet row."""
    if path.endswith(".parquet"):
        yield from _parquet_docs(path, text_field)
        return
    raw = _open_text(path)
    try:
        text = raw.decode("utf-8", errors="replace" if lenient else "strict")
    except UnicodeDecodeError as e:
        raise DataError(f"{path} is not valid UTF-8 ({e})") from e
    if ".jsonl" not in os.path.basename(path):
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


def read_documents(cfg: DataConfig, source: str | None = None) -> list[str]:
    """Non-empty documents of a text source (default cfg.source), in sorted file order, capped at cfg.max_bytes."""
    source = cfg.source if source is None else source
    files = source_files(source)
    if any(f.endswith(".npy") for f in files):
        raise DataError(f"a .npy source must be a single file on its own, got {len(files)} files")
    docs, used = [], 0
    for f in files:
        for d in file_docs(f, cfg.text_field, lenient=source == "stdlib"):
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
        raise DataError(f"all {len(files)} file(s) of data source {source!r} are empty")
    return docs


def docs_digest(docs: list[str]) -> str:
    h = hashlib.sha256(b"docs-v1")
    for d in docs:
        b = d.encode()
        h.update(len(b).to_bytes(8, "little"))
        h.update(b)
    return h.hexdigest()


# ---------------------------------------------------------------- tokenizer and cache


def cache_dir(cfg: DataConfig) -> str:
    d = cfg.cache_dir or os.environ.get("STENCIL_CACHE") or os.path.expanduser("~/.cache/stencil")
    d = os.path.join(os.path.expanduser(d), "data")
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
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS],
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(docs[::stride], trainer)
    return tok


def load_tokenizer(path: str):
    """(tokenizer, its digest) from a tokenizer.json path or URL. The digest is the sha256 of the file
    `Tokenizer.save` writes (for such a file, of its bytes), so a copy saved by a run matches the original."""
    from tokenizers import Tokenizer

    if objstore.is_url(path):
        head, _, key = path.rpartition("/")
        raw = objstore.Folder(head, DataError).read(key)
    else:
        raw = open(path, "rb").read() if os.path.isfile(path) else None
    if raw is None:
        raise DataError(f"tokenizer file {path!r} does not exist")
    try:
        tok = Tokenizer.from_str(raw.decode())
    except Exception as e:
        raise DataError(f"cannot load tokenizer {path!r}: {e}") from e
    return tok, hashlib.sha256(tok.to_str(pretty=True).encode()).hexdigest()


def get_tokenizer(cfg: DataConfig, docs: list[str], digest: str, vocab_size: int, progress: bool):
    """(tokenizer, sha256 of its json file): loaded from cfg.tokenizer, the cache, or trained."""
    path = cfg.tokenizer
    if not path:
        key = hashlib.sha256(f"bpe-v1-{vocab_size}-{digest}".encode()).hexdigest()
        path = os.path.join(cache_dir(cfg), f"tok-{key[:32]}.json")
        if not os.path.exists(path):
            if vocab_size < 257:
                raise DataError(f"vocab_size {vocab_size} is too small for a byte-level BPE (need >= 257)")
            if progress:
                print(f"training a {vocab_size}-token BPE tokenizer (cached in {path})", file=sys.stderr)
            tok = train_tokenizer(docs, vocab_size)
            _atomic(path, lambda tmp: tok.save(tmp))
    return load_tokenizer(path)


def eos_id_of(tok) -> int:
    for name in EOS_CANDIDATES:
        i = tok.token_to_id(name)
        if i is not None:
            return i
    raise DataError(f"tokenizer has none of the end-of-document tokens {EOS_CANDIDATES}")


def encode_documents(tok, docs: list[str], eos_id: int, vocab_size: int, progress: bool = True):
    """(flat tokens, document end offsets); each document gets eos appended."""
    dtype = tokenstore.token_dtype(vocab_size)
    parts = []
    with tqdm(total=len(docs), desc="tokenizing", unit="doc", disable=not progress) as bar:
        for i in range(0, len(docs), 64):  # 64 documents a call; the bar counts documents
            for enc in tok.encode_batch_fast(docs[i : i + 64], add_special_tokens=False):  # no offsets: 2x faster
                parts.append(np.asarray(enc.ids + [eos_id], dtype=dtype))
            bar.update(len(docs[i : i + 64]))
    return np.concatenate(parts), np.cumsum([len(p) for p in parts], dtype=np.int64)


# ---------------------------------------------------------------- token stores from sources (built once, in the cache)


def build_store(path: str, write) -> TokenStore:
    """Build a cache store with write(folder) into a temporary folder, then rename it into place."""
    if not os.path.exists(os.path.join(path, "manifest.json")):
        tmp = f"{path}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        try:
            write(objstore.Folder(tmp, DataError))
            try:
                os.rename(tmp, path)
            except OSError:  # built meanwhile by another process
                pass
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return TokenStore(path)


def is_store(spec: str) -> bool:
    return objstore.is_url(spec) or os.path.isfile(os.path.join(os.path.expanduser(spec), "manifest.json"))


def text_store(
    cfg: DataConfig,
    spec: str,
    tok,
    tok_digest: str,
    vocab_size: int,
    progress: bool,
    docs: list[str] | None = None,
    digest: str = "",
) -> tuple[TokenStore, str]:
    """A text source tokenized once into a store in the cache: (store, digest of its documents)."""
    if docs is None:
        docs = read_documents(cfg, spec)
        digest = docs_digest(docs)
    key = hashlib.sha256(f"store-v{FORMAT_VERSION}-{vocab_size}-{digest}-{tok_digest}".encode()).hexdigest()

    def write(folder):
        eos = eos_id_of(tok)
        tokens, ends = encode_documents(tok, docs, eos, vocab_size, progress)
        nbytes = np.array([len(d.encode()) for d in docs], np.int64)
        m = tokenstore.write_shard(folder, 0, tokens, tokenstore.build_docs(np.diff(ends, prepend=0), nbytes), spec)
        folder.write("tokenizer.json", tok.to_str().encode())
        tokenstore.write_manifest(folder, [m], tokenizer_sha256=tok_digest, vocab_size=vocab_size, eos_id=eos)

    return build_store(os.path.join(cache_dir(cfg), f"store-{key[:32]}"), write), digest


def npy_store(cfg: DataConfig, spec: str, tok, tok_digest: str, vocab_size: int) -> tuple[TokenStore, str]:
    """A .npy of token ids as a store in the cache (documents end at eos; a missing last eos is added; a file
    without any eos is refused: it would be a single document)."""
    path = os.path.expanduser(spec)
    if not os.path.isfile(path):
        raise DataError(f"pre-tokenized file {path!r} does not exist")
    try:
        arr = np.load(path, mmap_mode="r")
    except Exception as e:
        raise DataError(f"{path}: not a readable .npy file ({e})") from e
    if arr.ndim != 1 or not np.issubdtype(arr.dtype, np.integer) or arr.size == 0:
        raise DataError(f"{path}: expected a non-empty 1-D integer array, got {arr.dtype} {arr.shape}")
    lo, hi = int(arr.min()), int(arr.max())
    if lo < 0 or hi >= vocab_size:
        raise DataError(f"{path}: token ids span [{lo}, {hi}] but vocab_size is {vocab_size} (ids out of range)")
    eos = eos_id_of(tok) if tok is not None else 0
    arr = np.asarray(arr).astype(tokenstore.token_dtype(vocab_size))
    if not (arr == eos).any():  # one document of all the ids: almost surely another end-of-document id
        raise DataError(
            f"{path}: no end-of-document id ({eos}, "
            + (
                f"the eos of {cfg.tokenizer or 'the tokenizer'}"
                if tok is not None
                else "the id a .npy without a tokenizer ends its documents with"
            )
            + f") among its {arr.size} token ids, so it holds no document boundary. End every "
            f"document with id {eos}"
            + ("" if tok is not None else " (or set --data.tokenizer to the tokenizer whose eos it uses)")
        )
    if arr[-1] != eos:
        arr = np.append(arr, np.asarray(eos, arr.dtype))
    digest = hashlib.sha256(np.ascontiguousarray(arr).tobytes()).hexdigest()
    key = hashlib.sha256(f"npy-v{FORMAT_VERSION}-{vocab_size}-{digest}-{tok_digest}".encode()).hexdigest()

    def write(folder):
        ends = np.flatnonzero(arr == eos) + 1
        m = tokenstore.write_shard(folder, 0, arr, tokenstore.build_docs(np.diff(ends, prepend=0), None), path)
        if tok is not None:
            folder.write("tokenizer.json", tok.to_str().encode())
        tokenstore.write_manifest(
            folder, [m], tokenizer_sha256=tok_digest, vocab_size=vocab_size, eos_id=eos, has_text=False
        )

    return build_store(os.path.join(cache_dir(cfg), f"store-{key[:32]}"), write), digest


def open_store(spec: str, vocab_size: int, tok_digest: str | None, what: str) -> TokenStore:
    store = TokenStore(spec)
    where = store.folder.name("manifest.json")
    if store.vocab_size > vocab_size:
        raise DataError(
            f"{where}: the store's vocabulary has {store.vocab_size} tokens but the model's vocab_size is {vocab_size}"
        )
    if tok_digest is not None and store.tokenizer_sha256 != tok_digest:
        raise DataError(
            f"{where}: tokenizer hash {store.tokenizer_sha256[:12] or '(none)'} does not match {what} "
            f"({tok_digest[:12] or '(none)'}): its token ids mean other text"
        )
    store.check_ids(vocab_size)
    return store


def store_tokenizer(store: TokenStore):
    return load_tokenizer(store.folder.name("tokenizer.json")) if store.folder.exists("tokenizer.json") else (None, "")
