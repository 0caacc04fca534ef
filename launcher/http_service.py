"""A small HTTP service of a coordinator process: a WSGI app on ``host:port`` in a background thread.

The daemon's ``/metrics`` and the live page are both one of these: a threaded server (one thread
per connection, none outliving the process), requests logged at debug level only, a silent
connection dropped after :data:`IDLE_SECONDS`, and, with a certificate, TLS whose handshake runs in
the connection's own thread (a client that connects and says nothing never holds the accept loop).
"""

from __future__ import annotations

import logging
import ssl
import threading
from collections.abc import Callable, Iterable
from pathlib import Path
from socketserver import ThreadingMixIn
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

__all__ = ["IDLE_SECONDS", "HTTPService"]

log = logging.getLogger(__name__)

#: seconds a connection may sit silent before it is dropped
IDLE_SECONDS = 30

WSGIApp = Callable[[dict[str, Any], Callable[..., Any]], Iterable[bytes]]


class _Server(ThreadingMixIn, WSGIServer):
    daemon_threads = True


class _Quiet(WSGIRequestHandler):
    timeout = IDLE_SECONDS  # socketserver sets it on each connection's socket

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base class's name
        log.debug(format, *args)


class HTTPService:
    """``app`` on ``host:port`` (port 0: any free one); ``tls`` = (certificate, key) serves HTTPS."""

    def __init__(self, app: WSGIApp, host: str, port: int, *, name: str,
                 tls: tuple[Path, Path] | None = None) -> None:
        self._server = make_server(host, port, app, server_class=_Server, handler_class=_Quiet)
        if tls is not None:
            context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
            context.load_cert_chain(str(tls[0]), str(tls[1]))
            self._server.socket = context.wrap_socket(self._server.socket, server_side=True,
                                                      do_handshake_on_connect=False)
        self.scheme = "https" if tls is not None else "http"
        self.host, self.port = host, int(self._server.server_port)
        self._thread = threading.Thread(target=self._server.serve_forever, name=name, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
