"""The page server: 127.0.0.1 on a random port, one page, one job at a time.

Routes: GET /page.html, /page.js, /wire.js (the backend's page), /check.html, /check.js
(the harness that runs an exported module), GET /x/<file> (files of an optional
directory, e.g. an exported module under test), and, guarded by the random token in the
page's URL: POST /hello (adapter caps, JSON), GET /job (long poll: the next binary job,
204 when none came within a while, 410 once the server is closing), POST /result (the
binary reply), POST /event (device lost, uncaught errors, JSON).
"""

from __future__ import annotations

import json
import mimetypes
import os
import threading
from collections.abc import Mapping
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from importlib import resources
from typing import Any
from urllib.parse import parse_qs, urlsplit

POLL_S = 10.0          # a long poll answers 204 after this long without a job
PAGE_FILES = ("page.html", "page.js", "wire.js", "check.html", "check.js")

_TYPES = {".js": "text/javascript", ".mjs": "text/javascript", ".html": "text/html",
          ".wgsl": "text/plain", ".json": "application/json", ".md": "text/plain"}


def page_files() -> dict[str, bytes]:
    """The page's own files, from package data."""
    base = resources.files(__package__ or "backends.browser")
    return {name: base.joinpath(name).read_bytes() for name in PAGE_FILES}


class PageServer:
    """The HTTP side of one browser instance; the host drives it."""

    def __init__(self, token: str, static_dir: str | None = None,
                 extra: Mapping[str, bytes] | None = None) -> None:
        self.token = token
        self.static_dir = os.path.realpath(static_dir) if static_dir else None
        self.files = {**page_files(), **(extra or {})}
        self.cv = threading.Condition()
        self.hello: dict[str, Any] | None = None
        self.events: list[dict[str, Any]] = []
        self._job: bytes | None = None
        self._result: bytes | None = None
        self.closing = False
        self.httpd = _Httpd(("127.0.0.1", 0), _Handler)
        self.httpd.owner = self
        self.port = self.httpd.server_address[1]
        self._thread = threading.Thread(target=self.httpd.serve_forever, name="attnreg-page",
                                        kwargs={"poll_interval": 0.05}, daemon=True)
        self._thread.start()

    def url(self, page: str = "page.html", **query: str) -> str:
        q = "&".join(f"{k}={v}" for k, v in {"t": self.token, **query}.items())
        return f"http://127.0.0.1:{self.port}/{page}?{q}"

    # -- the host's side -----------------------------------------------------------------
    def submit(self, job: bytes) -> None:
        with self.cv:
            self._job, self._result = job, None
            self.cv.notify_all()

    def take_result(self) -> bytes | None:
        with self.cv:
            got, self._result = self._result, None
            return got

    def close(self) -> None:
        with self.cv:
            if self.closing:
                return
            self.closing = True
            self.cv.notify_all()
        self.httpd.shutdown()
        self.httpd.server_close()
        self._thread.join(5)

    # -- the page's side -----------------------------------------------------------------
    def next_job(self) -> bytes | None:
        with self.cv:
            self.cv.wait_for(lambda: self._job is not None or self.closing, POLL_S)
            job, self._job = self._job, None
            return job

    def put(self, kind: str, body: bytes) -> None:
        with self.cv:
            if kind == "result":
                self._result = body
            elif kind == "hello":
                self.hello = json.loads(body)
            else:
                self.events.append(json.loads(body))
            self.cv.notify_all()


class _Httpd(ThreadingHTTPServer):
    daemon_threads = True
    block_on_close = False
    owner: PageServer

    def handle_error(self, request: Any, client_address: Any) -> None:
        # A page torn down mid-request (the browser was ended) is expected; say nothing.
        pass


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"      # keep-alive: one connection serves many jobs
    server: _Httpd

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def _send(self, status: int, body: bytes = b"", ctype: str = "application/octet-stream") -> None:
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Cache-Control", "no-store")
        self.end_headers()
        if body:
            self.wfile.write(body)

    def _authorised(self) -> bool:
        q = parse_qs(urlsplit(self.path).query)
        return q.get("t", [""])[0] == self.server.owner.token

    def do_GET(self) -> None:
        srv = self.server.owner
        path = urlsplit(self.path).path.lstrip("/")
        if path == "job":
            if not self._authorised():
                return self._send(HTTPStatus.FORBIDDEN)
            job = srv.next_job()
            if srv.closing:
                return self._send(HTTPStatus.GONE)
            return self._send(HTTPStatus.OK, job) if job is not None else \
                self._send(HTTPStatus.NO_CONTENT)
        if path in srv.files:
            return self._send(HTTPStatus.OK, srv.files[path], _ctype(path))
        if path.startswith("x/") and srv.static_dir:
            full = os.path.realpath(os.path.join(srv.static_dir, path[2:]))
            if full.startswith(srv.static_dir + os.sep) and os.path.isfile(full):
                with open(full, "rb") as fh:
                    return self._send(HTTPStatus.OK, fh.read(), _ctype(full))
        return self._send(HTTPStatus.NOT_FOUND)

    def do_POST(self) -> None:
        srv = self.server.owner
        path = urlsplit(self.path).path.lstrip("/")
        n = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(n) if n else b""
        if path not in ("hello", "result", "event"):
            return self._send(HTTPStatus.NOT_FOUND)
        if not self._authorised():
            return self._send(HTTPStatus.FORBIDDEN)
        try:
            srv.put(path, body)
        except ValueError:
            return self._send(HTTPStatus.BAD_REQUEST)
        return self._send(HTTPStatus.OK)


def _ctype(path: str) -> str:
    ext = os.path.splitext(path)[1]
    return _TYPES.get(ext) or mimetypes.guess_type(path)[0] or "application/octet-stream"
