"""The live page's HTTP server: ``/`` (the page), ``/api/federation`` (the snapshot as JSON).

Read-only (GET only), a background thread of the coordinator's process
(``fedge.launcher.http_service``, as ``/metrics``). On a loopback address it answers anyone on this
machine, as ``/metrics`` does; on any other address it needs TLS (the daemon's certificate and key)
and a token (``?token=`` on the page's address, which the page passes on as a bearer token), and
refuses to start without them. Idle, it waits in ``select``: nothing is read or computed until a
request comes.
"""

from __future__ import annotations

import hmac
import logging
from collections.abc import Callable, Iterable
from importlib import resources
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs

from fedge.launcher.addresses import is_loopback
from fedge.launcher.http_service import HTTPService
from fedge.server.live.snapshot import Snapshots

__all__ = ["LivePage", "LivePageError"]

log = logging.getLogger(__name__)


class LivePageError(ValueError):
    """The page cannot be served as configured (a non-loopback address without TLS or a token)."""


class LivePage:
    """Serve the page of the run in ``run_dir`` on ``host:port`` (port 0: any free one)."""

    def __init__(self, run_dir: Path, host: str = "127.0.0.1", port: int = 0, *, token: str | None = None,
                 tls: tuple[Path, Path] | None = None,
                 online: Callable[[], list[dict[str, Any]] | None] | None = None) -> None:
        if not is_loopback(host) and (tls is None or not token):
            raise LivePageError(f"the live page on {host} (not a loopback address) needs TLS (a certificate and "
                                "key) and a token: anyone who can reach it would see the federation's devices")
        self.token = token or None
        self.snapshots = Snapshots(run_dir, online)
        self._page = resources.files("fedge.server.live").joinpath("page.html").read_bytes()
        self._service = HTTPService(self._app, host, port, name="fedge-live-page", tls=tls)
        self.scheme, self.host, self.port = self._service.scheme, host, self._service.port

    @property
    def url(self) -> str:
        return f"{self.scheme}://{self.host}:{self.port}/" + (f"?token={self.token}" if self.token else "")

    def start(self) -> LivePage:
        self._service.start()
        return self

    def stop(self) -> None:
        self._service.stop()

    def __enter__(self) -> LivePage:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- requests ------------------------------------------------------------------------------
    def _allowed(self, environ: dict[str, Any]) -> bool:
        if self.token is None:
            return True
        given = parse_qs(environ.get("QUERY_STRING", "")).get("token", [""])[0]
        header = environ.get("HTTP_AUTHORIZATION", "")
        if header.startswith("Bearer "):
            given = header[len("Bearer "):]
        return hmac.compare_digest(given.encode(), self.token.encode())

    def _app(self, environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        path, method = environ.get("PATH_INFO", ""), environ.get("REQUEST_METHOD", "GET")
        if method not in ("GET", "HEAD"):
            return _send(start_response, "405 Method Not Allowed", b"read-only\n", "text/plain", [("Allow", "GET")])
        if not self._allowed(environ):
            return _send(start_response, "401 Unauthorized", b"a token is needed: ?token=...\n", "text/plain")
        if path in ("/", "/index.html"):
            return _send(start_response, "200 OK", self._page, "text/html; charset=utf-8")
        if path == "/api/federation":
            body, etag = self.snapshots.body()
            if environ.get("HTTP_IF_NONE_MATCH") == etag:
                return _send(start_response, "304 Not Modified", b"", None, [("ETag", etag)])
            return _send(start_response, "200 OK", body, "application/json", [("ETag", etag)])
        return _send(start_response, "404 Not Found", b"not found: / or /api/federation\n", "text/plain")


def _send(start_response: Callable[..., Any], status: str, body: bytes, kind: str | None,
          headers: list[tuple[str, str]] | None = None) -> list[bytes]:
    out = [("Cache-Control", "no-store"), ("X-Content-Type-Options", "nosniff"),
           ("Content-Security-Policy", "default-src 'self'; script-src 'unsafe-inline'; style-src 'unsafe-inline'"),
           *(headers or [])]
    if kind is not None:
        out += [("Content-Type", kind), ("Content-Length", str(len(body)))]
    start_response(status, out)
    return [body]
