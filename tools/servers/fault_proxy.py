"""An HTTP proxy on 127.0.0.1 that makes an object store misbehave the way real buckets do: a share of
the requests answered 503 SlowDown (throttling), cut with a TCP reset, or held back before they go on.
It stands between a run and the local S3 server (tools/servers/local_objstore.py): point AWS_ENDPOINT_URL_S3 at
the proxy instead of the server.

    with local_objstore.s3_server() as s3, fault_proxy(s3.endpoint, fail=0.1, seed=0) as proxy:
        os.environ["AWS_ENDPOINT_URL_S3"] = proxy.url   # while open: the run talks to the proxy
        ...
        proxy.fail = 1.0; proxy.only = "step_00000004"  # from now on every request of that checkpoint fails
        proxy.counts                                    # {"requests": n, "503": n, "reset": n, "delay": n}

    python tools/servers/fault_proxy.py --upstream http://127.0.0.1:9000 --fail 0.3   # prints its URL, runs until ^C

`fail` is the share of requests faulted, each with one of `kinds` drawn in equal parts: a 503 or a reset
fails the request, a delay only holds it back (to fail every request, leave "delay" out of `kinds`).
A faulted request never reaches the server (the server's state is what the client believes it is, as
with a 503 or a connection refused before the body is read); a delayed one reaches it `delay_s` later.
Which requests are faulted is drawn from `seed` (the draw order follows the requests' arrival order,
so a multi-threaded client sees different requests faulted from run to run). No JAX here.
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import http.server
import random
import re
import socket
import struct
import sys
import threading
import time
import urllib.parse

KINDS = ("503", "reset", "delay")
SLOW_DOWN = (
    b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>SlowDown</Code>'
    b"<Message>Please reduce your request rate.</Message></Error>"
)
_HOP = {"connection", "keep-alive", "proxy-connection", "transfer-encoding", "te", "trailer", "upgrade"}


class FaultProxy:
    """The proxy's settings and counts; change `fail`, `kinds`, `delay_s` or `only` at any time."""

    def __init__(
        self,
        upstream: str,
        *,
        fail: float = 0.0,
        kinds=KINDS,
        delay_s: float = 0.5,
        only: str = "",
        seed: int = 0,
        port: int = 0,
    ):
        u = urllib.parse.urlsplit(upstream)
        if u.scheme != "http" or not u.hostname:
            raise ValueError(f"--upstream {upstream!r}: expected http://HOST:PORT")
        self.upstream = (u.hostname, u.port or 80)
        self.fail, self.kinds, self.delay_s, self.only = fail, tuple(kinds), delay_s, only
        bad = [k for k in self.kinds if k not in KINDS]
        if bad or not self.kinds or not 0.0 <= fail <= 1.0 or delay_s < 0:
            raise ValueError(
                f"fail must be in [0, 1] (got {fail}), kinds a non-empty subset of {KINDS} (got "
                f"{self.kinds}), delay_s >= 0 (got {delay_s})"
            )
        self.counts = {"requests": 0, **{k: 0 for k in KINDS}}
        self._rng, self._lock = random.Random(seed), threading.Lock()
        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", port), _handler(self))
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self._thread = threading.Thread(target=self.server.serve_forever, name="fault-proxy", daemon=True)

    def start(self) -> FaultProxy:
        self._thread.start()
        return self

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def draw(self, path: str) -> str | None:
        """The fault for one request (None: forward it as it is)."""
        with self._lock:
            self.counts["requests"] += 1
            if self.only and not re.search(self.only, path):
                return None
            if self._rng.random() >= self.fail:
                return None
            kind = self._rng.choice(self.kinds)
            self.counts[kind] += 1
            return kind


def _handler(proxy: FaultProxy):
    class Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args):  # quiet: the counts say what happened
            pass

        def _body(self) -> bytes:
            if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
                out = b""
                while True:
                    size = int(self.rfile.readline().split(b";")[0], 16)
                    if size == 0:
                        while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                            pass
                        return out
                    out += self.rfile.read(size)
                    self.rfile.readline()
            return self.rfile.read(int(self.headers.get("Content-Length") or 0))

        def _any(self):
            body = self._body()
            fault = proxy.draw(self.path)
            if fault == "reset":  # RST instead of an answer (SO_LINGER 0), as a dropped connection does
                self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                self.close_connection = True
                self.connection.close()
                return
            if fault == "503":
                self.send_response(503, "Slow Down")
                self.send_header("Content-Type", "application/xml")
                self.send_header("Content-Length", str(len(SLOW_DOWN)))
                self.end_headers()
                self.wfile.write(SLOW_DOWN)
                return
            if fault == "delay":
                time.sleep(proxy.delay_s)
            conn = http.client.HTTPConnection(*proxy.upstream, timeout=120)
            try:
                headers = {k: v for k, v in self.headers.items() if k.lower() not in _HOP}
                if body or self.command in ("PUT", "POST"):
                    headers["Content-Length"] = str(len(body))
                conn.request(self.command, self.path, body=body or None, headers=headers)
                r = conn.getresponse()
                data = r.read()
            finally:
                conn.close()
            self.send_response(r.status, r.reason)
            for k, v in r.getheaders():
                if k.lower() not in _HOP and k.lower() != "content-length":
                    self.send_header(k, v)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(data)

        do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _any

    return Handler


@contextlib.contextmanager
def fault_proxy(upstream: str, **kw):
    """A started FaultProxy in front of `upstream` (http://HOST:PORT), stopped on exit."""
    p = FaultProxy(upstream, **kw).start()
    try:
        yield p
    finally:
        p.stop()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--upstream", required=True, help="the server to forward to: http://HOST:PORT")
    ap.add_argument("--port", type=int, default=0, help="port on 127.0.0.1 (0 = a free one)")
    ap.add_argument(
        "--fail",
        type=float,
        default=0.1,
        help="share of requests faulted, in [0, 1] (default 0.1); a delayed one still succeeds",
    )
    ap.add_argument("--kinds", default=",".join(KINDS), help=f"comma-separated faults to draw from: {', '.join(KINDS)}")
    ap.add_argument("--delay-s", type=float, default=0.5, help="how long a delayed request is held back (s)")
    ap.add_argument("--only", default="", help="fault only requests whose path matches this regular expression")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    try:
        p = FaultProxy(
            args.upstream,
            fail=args.fail,
            kinds=args.kinds.split(","),
            delay_s=args.delay_s,
            only=args.only,
            seed=args.seed,
            port=args.port,
        ).start()
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"fault proxy {p.url} -> {args.upstream}: {args.fail:.0%} of requests faulted ({args.kinds})", flush=True)
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        print(f"counts: {p.counts}")
        p.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
