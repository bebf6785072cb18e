"""Storage locations and the bytes under them: local folders and object stores, through tensorstore.

One module for every place stencil reads or writes keys: checkpoints (shared/storage/checkpoint.py), token
stores (shared/storage/tokenstore.py) and run locks (shared/runtime/guard.py). No JAX here.

A location is a local path, `file://PATH`, `gs://BUCKET[/PREFIX]` or `s3://BUCKET[/PREFIX]` (and, to
read only, `http(s)://...`, which tensorstore's http driver opens). Every operation goes through
tensorstore's kvstore drivers (file, gcs, s3), so nothing needs a rename or a directory and no cloud
SDK is installed. Credentials are the drivers' own: for gs://, Application Default Credentials (and
`TENSORSTORE_GCS_HTTP_URL` for another endpoint, such as an emulator); for s3://, the usual `AWS_*`
variables, `~/.aws` files or instance roles, and for an S3-compatible store (R2, MinIO, a local
server) `AWS_ENDPOINT_URL_S3` or `AWS_ENDPOINT_URL` with `AWS_REGION`.

    is_url(loc), kvstore_spec(loc), location_error(loc), join / parent / basename
    request_retries()              the retry budget of every object-store request (STENCIL_STORE_RETRIES)
    store(loc)                     the opened kvstore (cached per spec)
    scan(loc)                      {top-level name: {keys under it}}
    delete(loc, first=KEY)         everything under loc, KEY first (a checkpoint's commit record)
    read_key / write_key(..., if_generation=G)   one key; a write only if the key is unchanged (or absent)
    Folder(loc)                    keys under a local directory (atomic local writes) or a kvstore URL
"""

from __future__ import annotations

import functools
import json
import os
import uuid

import tensorstore as ts

from shared.errors import StencilError

WRITABLE = ("file", "gs", "s3")  # the schemes a checkpoint, a lock or a new token store can be written to
READABLE = WRITABLE + ("http", "https")

# Request retries on object stores. Real buckets throttle (HTTP 503 SlowDown), reset connections and stall:
# every request to gs://, s3:// and http(s):// (reads, writes, listings, deletions, of checkpoints, token
# stores and locks) is retried by tensorstore's driver with exponential backoff, within a bounded budget:
# STENCIL_STORE_RETRIES="RETRIES,FIRST_DELAY_S,MAX_DELAY_S" (default below: about 1 minute of retries per
# request before its error is raised; the drivers' own default is 32 retries up to 32 s apart, a quarter of an
# hour). A request still failing past the budget raises, and the operation's error names what it was doing.
# REQUEST_RETRIES, when set, overrides the variable (`python -m shared.checkpoint list` answers within ~15 s).
DEFAULT_RETRIES = "10,0.2,10"
REQUEST_RETRIES: dict | None = None


class StoreSettingError(StencilError, ValueError):
    """STENCIL_STORE_RETRIES that cannot be used: the message says what it must be."""


def request_retries() -> dict:
    """The retry budget of one object-store request, as tensorstore's `*_request_retries` context resource."""
    if REQUEST_RETRIES is not None:
        return REQUEST_RETRIES
    raw = os.environ.get("STENCIL_STORE_RETRIES") or DEFAULT_RETRIES
    try:
        n, first, most = raw.split(",")
        n, first, most = int(n), float(first), float(most)
        ok = 0 <= n <= 1000 and 0 < first <= most <= 3600
    except ValueError:
        ok = False
    if not ok:
        raise StoreSettingError(
            f"STENCIL_STORE_RETRIES={raw!r}: expected RETRIES,FIRST_DELAY_S,MAX_DELAY_S with "
            f"0 <= RETRIES <= 1000 and 0 < FIRST_DELAY_S <= MAX_DELAY_S <= 3600 (default "
            f"{DEFAULT_RETRIES})"
        )
    return {"max_retries": n, "initial_delay": f"{first}s", "max_delay": f"{most}s"}


class LocationError(StencilError, ValueError):
    """A location that cannot be used: the message names it and says what a location may be."""


def is_url(location: str) -> bool:
    """A location with a scheme (file://, gs://, s3://, http(s)://); anything else is a local path."""
    return "://" in location


def kvstore_spec(location: str, *, read_only: bool = False) -> dict:
    """The tensorstore kvstore spec of a folder: a local path, file://, gs://bucket/prefix, s3://bucket/prefix
    (and http(s):// when `read_only`)."""
    loc = location[len("file://") :] if location.startswith("file://") else location
    if "\0" in loc:
        raise LocationError(f"{location!r}: contains a NUL byte")
    if not is_url(loc):
        if not loc:
            raise LocationError("an empty path is not a folder")
        if os.path.isfile(os.path.expanduser(loc)):
            raise LocationError(f"{location!r} is a file, not a directory")
        return {"driver": "file", "path": os.path.abspath(os.path.expanduser(loc)) + "/"}  # abspath: no ".."
    scheme, rest = loc.split("://", 1)
    allowed = READABLE if read_only else WRITABLE
    if scheme in ("http", "https") and read_only:
        return {
            "driver": "http",
            "base_url": loc.rstrip("/") + "/",
            "context": {"http_request_retries": request_retries()},
        }
    bucket, _, prefix = rest.partition("/")
    if scheme not in allowed or not bucket:
        raise LocationError(
            f"{location!r}: a location is a local path, file://PATH, gs://BUCKET[/PREFIX] or "
            f"s3://BUCKET[/PREFIX]" + (" (or, to read, http(s)://...)" if read_only else "")
        )
    if ".." in prefix.split("/"):
        raise LocationError(f"{location!r}: '..' is not allowed in an object-store prefix")
    path = prefix.strip("/") + "/" if prefix.strip("/") else ""
    retries = {"context": {f"{'gcs' if scheme == 'gs' else 's3'}_request_retries": request_retries()}}
    if scheme == "gs":
        return {"driver": "gcs", "bucket": bucket, "path": path, **retries}
    spec = {"driver": "s3", "bucket": bucket, "path": path, **retries}
    endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
    if endpoint:  # an S3-compatible store (R2, MinIO, a local server): the region must be named
        spec["endpoint"] = endpoint
        spec["aws_region"] = os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION") or "us-east-1"
    return spec


def location_error(location: str) -> str | None:
    """Why `location` cannot be written to as a folder (None if it can)."""
    try:
        kvstore_spec(location)
    except LocationError as e:
        return str(e)
    return None


def join(location: str, name: str) -> str:
    return location.rstrip("/") + "/" + name if is_url(location) else os.path.join(location, name)


def parent(path: str) -> str:
    return path.rstrip("/").rsplit("/", 1)[0] if is_url(path) else (os.path.dirname(path) or ".")


def basename(path: str) -> str:
    return path.rstrip("/").rsplit("/", 1)[-1]


@functools.lru_cache(maxsize=64)
def _open(spec_json: str):
    return ts.KvStore.open(json.loads(spec_json)).result()


def store(location: str, *, read_only: bool = False):
    """The kvstore of `location` (opened once per spec in this process)."""
    return _open(json.dumps(kvstore_spec(location, read_only=read_only), sort_keys=True))


def scan(location: str) -> dict[str, set[str]]:
    """{top-level name: {keys under it}} of everything stored under `location`."""
    out: dict[str, set[str]] = {}
    for key in store(location).list().result():
        top, _, rest = key.decode().partition("/")
        out.setdefault(top, set()).add(rest)
    return out


def delete(location: str, first: str | None = None) -> None:
    """Delete everything stored under `location`, the key `first` before the rest (so a deletion killed
    half-way never leaves that key beside a partial rest)."""
    kv = store(location)
    if first is not None:
        kv.write(first, None).result()
    kv.delete_range(ts.KvStore.KeyRange()).result()
    if not is_url(location) and os.path.isdir(location):  # the file driver leaves empty directories: tidy them
        for d, _, _ in sorted(os.walk(location), key=lambda w: -len(w[0])):
            try:
                os.rmdir(d)
            except OSError:
                pass  # not empty: something was written there meanwhile


def read_key(location: str, key: str):
    """tensorstore's ReadResult of one key (`.state` "value" or "missing", `.value`, `.stamp.generation`)."""
    return store(location).read(key).result()


def write_key(location: str, key: str, value: bytes | str | None, *, if_generation=None):
    """Write (or with None delete) one key. With `if_generation` (a generation read before; b"" = absent) the
    write happens only if the key is still at it: the result's `.generation` is empty when it was not."""
    kv = store(location)
    if if_generation is None:
        return kv.write(key, value).result()
    return kv.write(key, value, if_equal=if_generation).result()


class Folder:
    """Keys under a local directory or a kvstore URL, with the errors a data reader wants (`error`: the
    exception class raised, naming the key). Local writes are atomic (a temporary file, then a rename)."""

    def __init__(self, root: str, error: type = LocationError):
        self.url = is_url(root)
        self.root = root.rstrip("/") + "/" if self.url else os.path.expanduser(root)
        self.error = error
        self._kv = None

    def kv(self):
        if self._kv is None:
            try:
                self._kv = (
                    store(self.root, read_only=True)
                    if self.root.startswith(("http://", "https://"))
                    else store(self.root)
                )
            except Exception as e:  # an unknown scheme, missing credentials: name the folder
                raise self.error(f"{self.root}: cannot open this location with tensorstore ({e})") from e
        return self._kv

    def name(self, key: str) -> str:
        return self.root + key if self.url else os.path.join(self.root, key)

    def exists(self, key: str) -> bool:
        if self.url:
            return self.result(key, self.read_async(key, 0, 0)) is not None
        return os.path.isfile(self.name(key))

    def read(self, key: str, start: int | None = None, stop: int | None = None) -> bytes | None:
        """The bytes of key (or of [start, stop)); None if the key is missing."""
        if self.url:
            return self.result(key, self.read_async(key, start, stop))
        path = self.name(key)
        if not os.path.isfile(path):
            return None
        with open(path, "rb") as f:
            if start is None:
                return f.read()
            return os.pread(f.fileno(), stop - start, start)

    def read_async(self, key: str, start: int | None = None, stop: int | None = None):
        """A URL's read as a future (many in flight at once); `result` waits for it."""
        return self.kv().read(key, byte_range=None if start is None else slice(start, stop))

    def result(self, key: str, future) -> bytes | None:
        try:
            r = future.result()
        except ValueError as e:
            if "OUT_OF_RANGE" in str(e):  # a range past the end of the value: what is there of it is nothing
                return b""
            raise self.error(f"{self.name(key)}: cannot read ({e})") from e
        return r.value if r.state == "value" else None

    def size(self, key: str) -> int | None:
        if self.url:
            raw = self.read(key)
            return None if raw is None else len(raw)
        path = self.name(key)
        return os.path.getsize(path) if os.path.isfile(path) else None

    def write(self, key: str, data: bytes) -> None:
        if self.url:
            self.kv().write(key, data).result()
            return
        path = self.name(key)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = f"{path}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        try:
            with open(tmp, "wb") as f:
                f.write(data)
            os.replace(tmp, path)
        finally:
            if os.path.exists(tmp):
                os.remove(tmp)

    def list(self, prefix: str) -> list[str]:
        if self.url:
            keys = self.kv().list(ts.KvStore.KeyRange(prefix, prefix + "\xff")).result()
            return sorted(k.decode() if isinstance(k, bytes) else k for k in keys)
        d = os.path.dirname(self.name(prefix))
        if not os.path.isdir(d):
            return []
        return sorted(os.path.join(os.path.dirname(prefix), f) for f in os.listdir(d))

    def remove_stale(self, prefix: str) -> None:
        """Leftovers of killed local writes (*.tmp-*) under prefix."""
        if not self.url:
            for k in self.list(prefix):
                if ".tmp-" in k:
                    os.remove(self.name(k))
