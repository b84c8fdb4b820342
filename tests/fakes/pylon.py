"""Test doubles for the control-plane tests: a backend with a switchable `/health`, and a
Pylon-like registration stream driven through the real grpcio client."""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterator, Sequence
from typing import Any

import grpc

from stargate.protocol import stargate_pb2 as pb
from stargate.protocol import stargate_pb2_grpc as pb_grpc
from tests.fakes.http_thread import QuietHandler, ThreadedHttpServer

ACTIVE = pb.INFERENCE_SERVER_STATUS_ACTIVE
INACTIVE = pb.INFERENCE_SERVER_STATUS_INACTIVE


class FakeBackend(ThreadedHttpServer):
    """An HTTP server on loopback whose `GET /health` answers 200 or 503 as the test says."""

    def __init__(self) -> None:
        self.healthy = True
        backend = self

        class Handler(QuietHandler):
            def do_GET(self) -> None:
                status = 200 if self.path == "/health" and backend.healthy else 503
                if self.path not in ("/health", "/v1/health/ready"):
                    status = 404
                body = b"ok" if status == 200 else b"unhealthy"
                self.send_response(status)
                self.send_header("content-length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        super().__init__(Handler)


def registration(
    server_id: str,
    url: str,
    models: dict[str, int] | Sequence[str],
    *,
    cluster_id: str = "",
    with_stats: bool = True,
    **stats: Any,
) -> pb.InferenceServerRegistration:
    """A registration message; `models` maps model id to status (a list means all ACTIVE)."""
    statuses = models if isinstance(models, dict) else dict.fromkeys(models, ACTIVE)
    return pb.InferenceServerRegistration(
        inference_server_id=server_id,
        inference_server_url=url,
        cluster_id=cluster_id,
        models={
            model_id: pb.InferenceServerModelRegistration(
                stats=pb.ModelStats(**stats) if with_stats else None, status=status
            )
            for model_id, status in statuses.items()
        },
    )


class PylonStream:
    """One `RegisterInferenceServer` call: send messages, read acks with a timeout, close."""

    def __init__(
        self,
        channel: grpc.Channel,
        *,
        heartbeat_ms: int | None = 1000,
        token: str | None = None,
    ) -> None:
        self._outbox: queue.Queue[pb.InferenceServerRegistration | None] = queue.Queue()
        self._acks: queue.Queue[pb.InferenceServerAck | grpc.RpcError | None] = queue.Queue()
        metadata = []
        if heartbeat_ms is not None:
            metadata.append(("x-stargate-registration-heartbeat-ms", str(heartbeat_ms)))
        if token is not None:
            metadata.append(("authorization", f"Bearer {token}"))
        stub = pb_grpc.StargateControlPlaneStub(channel)
        self.call = stub.RegisterInferenceServer(self._requests(), metadata=metadata)
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _requests(self) -> Iterator[pb.InferenceServerRegistration]:
        while (message := self._outbox.get()) is not None:
            yield message

    def _read(self) -> None:
        try:
            for ack in self.call:
                self._acks.put(ack)
        except grpc.RpcError as error:
            self._acks.put(error)
            return
        self._acks.put(None)

    def send(self, message: pb.InferenceServerRegistration) -> None:
        self._outbox.put(message)

    def exchange(self, message: pb.InferenceServerRegistration, timeout: float = 5) -> None:
        """Send one message and wait for its ack (fails on an error or the end of the stream)."""
        self.send(message)
        ack = self._acks.get(timeout=timeout)
        if not isinstance(ack, pb.InferenceServerAck):
            raise AssertionError(f"expected an ack, got {ack!r}")

    def next_event(self, timeout: float = 5) -> pb.InferenceServerAck | grpc.RpcError | None:
        """The next ack, the error that ended the stream, or None if it ended with OK."""
        return self._acks.get(timeout=timeout)

    def finish(self, timeout: float = 5) -> grpc.StatusCode:
        """Wait for the server to end the stream; return its status code."""
        deadline_event = self._acks.get(timeout=timeout)
        while isinstance(deadline_event, pb.InferenceServerAck):
            deadline_event = self._acks.get(timeout=timeout)
        return self.call.code()  # type: ignore[no-any-return]

    def close(self) -> None:
        """Half-close: the client has nothing more to send."""
        self._outbox.put(None)

    def cancel(self) -> None:
        self.call.cancel()
