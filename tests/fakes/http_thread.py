"""A loopback HTTP server in a thread of its own, for the test doubles that speak plain HTTP
(tests/fakes/pylon.py's backend, tests/fakes/gateway.py's token endpoint)."""

from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


class QuietHandler(BaseHTTPRequestHandler):
    """A request handler that keeps the test output clean."""

    def log_message(self, format: str, *args: Any) -> None:
        pass


class ThreadedHttpServer:
    """Serve `handler` on 127.0.0.1 (a free port) until `close()`."""

    def __init__(self, handler: type[BaseHTTPRequestHandler]) -> None:
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
