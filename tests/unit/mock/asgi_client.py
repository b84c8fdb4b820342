"""A client that calls the mock backend's ASGI app directly (no sockets), for tests in virtual
time: it records every message the app sends with its time, can be watched while the answer is
still coming, can leave (an `http.disconnect`) and can stop reading (a stuck client)."""

from __future__ import annotations

import json
from typing import Any

import trio
from trio.testing import wait_all_tasks_blocked

from stargate.mock import DroppedConnection, MockBackend, MockBackendConfig


def backend(**settings: Any) -> MockBackend:
    return MockBackend(MockBackendConfig(port=0, **settings))


class Client:
    """One request; `await client.run()` (usually in a nursery) answers it."""

    def __init__(
        self,
        app: MockBackend,
        method: str,
        path: str,
        body: Any = None,
        headers: dict[str, str] | None = None,
        *,
        stuck_after: int | None = None,
    ) -> None:
        self.app = app
        self.method, self.path = method, path
        self.payload = b"" if body is None else json.dumps(body).encode()
        self.headers = [(k.encode(), v.encode()) for k, v in (headers or {}).items()]
        self.stuck_after = stuck_after  # body messages read before it stops reading
        self.messages: list[tuple[float, dict[str, Any]]] = []
        self.started = 0.0
        self.done = False
        self.aborted = False  # the app raised DroppedConnection
        self.head_sent = trio.Event()
        self._leave = trio.Event()
        self._delivered = False

    async def run(self) -> Client:
        self.started = trio.current_time()
        scope = {"type": "http", "method": self.method, "path": self.path, "headers": self.headers}
        try:
            await self.app(scope, self._receive, self._send)
        except DroppedConnection:
            self.aborted = True
        self.done = True
        return self

    def leave(self) -> None:
        """The client disconnects."""
        self._leave.set()

    async def _receive(self) -> dict[str, Any]:
        if not self._delivered:
            self._delivered = True
            return {"type": "http.request", "body": self.payload, "more_body": False}
        await self._leave.wait()
        return {"type": "http.disconnect"}

    async def _send(self, message: Any) -> None:
        if self.stuck_after is not None and len(self.messages) > self.stuck_after:
            await trio.sleep_forever()
        self.messages.append((trio.current_time() - self.started, dict(message)))
        if message["type"] == "http.response.start":
            self.head_sent.set()

    # ---------------------------------------------------------------- what it got

    @property
    def status(self) -> int:
        return int(self.messages[0][1]["status"])

    @property
    def response_headers(self) -> dict[str, str]:
        return {bytes(k).decode(): bytes(v).decode() for k, v in self.messages[0][1]["headers"]}

    @property
    def head_at(self) -> float:
        return self.messages[0][0]

    @property
    def body(self) -> bytes:
        return b"".join(message.get("body", b"") for _, message in self.messages[1:])

    def json(self) -> Any:
        return json.loads(self.body)

    def events(self) -> list[tuple[float, str]]:
        """The SSE `data:` payloads with the time each arrived."""
        found = []
        for at, message in self.messages[1:]:
            for line in message.get("body", b"").decode().splitlines():
                if line.startswith("data: "):
                    found.append((at, line.removeprefix("data: ")))
        return found

    def lines(self) -> list[Any]:
        """An NDJSON body's objects."""
        return [json.loads(line) for line in self.body.decode().splitlines()]

    def first_data_at(self) -> float:
        return self.events()[0][0]


async def start(nursery: trio.Nursery, client: Client) -> Client:
    """Start `client` and let it get as far as it can now (so requests arrive in order)."""
    nursery.start_soon(client.run)
    await wait_all_tasks_blocked()
    return client


async def call(app: MockBackend, method: str, path: str, body: Any = None, **kw: Any) -> Client:
    """One request, answered in full."""
    return await Client(app, method, path, body, **kw).run()
