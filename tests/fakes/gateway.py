"""Test doubles for worker auth (docs/worker-auth.md): an `llm_gateway.LlmGateway` gRPC server
that requires the replica's own bearer, and an OAuth2 token endpoint, both in the test process
(threads), on loopback."""

from __future__ import annotations

import base64
import itertools
import json
import threading
from concurrent import futures
from typing import Any
from urllib.parse import parse_qs, unquote_plus

import grpc

from stargate.protocol import llm_gateway_pb2, llm_gateway_pb2_grpc
from tests.fakes.http_thread import QuietHandler, ThreadedHttpServer


class FakeGateway:
    """`AuthLlmWorker` as a production gateway does it: the caller (the replica) must present
    `authorization: Bearer <b>` with `b` in `bearers` (else UNAUTHENTICATED), and the worker token
    maps to a routing key through `keys` (else PERMISSION_DENIED). `seen` holds the authorization
    of every call, in order. With `tls=(key_pem, chain_pem)` it serves TLS only."""

    def __init__(
        self,
        bearers: set[str],
        keys: dict[str, str],
        *,
        tls: tuple[bytes, bytes] | None = None,
        port: int = 0,
    ) -> None:
        self.bearers = bearers
        self.keys = keys
        self.seen: list[str | None] = []
        self._lock = threading.Lock()
        gateway = self

        class Servicer(llm_gateway_pb2_grpc.LlmGatewayServicer):
            def AuthLlmWorker(self, request: Any, context: grpc.ServicerContext) -> Any:
                authorization = dict(context.invocation_metadata()).get("authorization")
                with gateway._lock:
                    gateway.seen.append(authorization)  # type: ignore[arg-type]
                    accepted = {f"Bearer {bearer}" for bearer in gateway.bearers}
                    key = gateway.keys.get(request.workerToken)
                if authorization not in accepted:
                    context.abort(grpc.StatusCode.UNAUTHENTICATED, "caller not authenticated")
                if key is None:
                    context.abort(grpc.StatusCode.PERMISSION_DENIED, "unknown worker")
                return llm_gateway_pb2.AuthLlmWorkerResponse(routingKey=key)

        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        llm_gateway_pb2_grpc.add_LlmGatewayServicer_to_server(Servicer(), self.server)  # type: ignore[no-untyped-call]
        address = f"127.0.0.1:{port}"
        if tls is None:
            self.port = self.server.add_insecure_port(address)
        else:
            credentials = grpc.ssl_server_credentials([tls])
            self.port = self.server.add_secure_port(address, credentials)
        self.server.start()

    def close(self) -> None:
        self.server.stop(None)


class FakeTokenEndpoint(ThreadedHttpServer):
    """`POST /token` of an OAuth2 provider (client-credentials grant) on a loopback HTTP server.

    It checks HTTP Basic client authentication (RFC 6749 §2.3.1: id and secret form-encoded) and
    the form body, answers `access_token` + `expires_in`, and adds every token it mints to
    `gateway.bearers` when given a gateway, as a real provider and gateway share a trust root.
    `requests` counts token requests; `forms` holds their decoded form bodies."""

    def __init__(
        self,
        client_id: str,
        client_secret: str,
        *,
        gateway: FakeGateway | None = None,
        expires_in: int = 3600,
    ) -> None:
        self.requests = 0
        self.forms: list[dict[str, list[str]]] = []
        self.tokens: list[str] = []
        counter = itertools.count(1)
        endpoint = self

        class Handler(QuietHandler):
            def do_POST(self) -> None:
                endpoint.requests += 1
                length = int(self.headers.get("content-length", "0"))
                form = parse_qs(self.rfile.read(length).decode())
                endpoint.forms.append(form)
                scheme, _, encoded = (self.headers.get("authorization") or "").partition(" ")
                pair = base64.b64decode(encoded or "").decode() if scheme == "Basic" else ""
                user, _, password = pair.partition(":")
                if self.path != "/token":
                    self._answer(404, {"error": "not_found"})
                elif (unquote_plus(user), unquote_plus(password)) != (client_id, client_secret):
                    self._answer(401, {"error": "invalid_client"})
                elif form.get("grant_type") != ["client_credentials"]:
                    self._answer(400, {"error": "unsupported_grant_type"})
                else:
                    token = f"oauth2-minted-{next(counter)}-c4d1e9"
                    endpoint.tokens.append(token)
                    if gateway is not None:
                        gateway.bearers.add(token)
                    body = {"access_token": token, "token_type": "Bearer"}
                    self._answer(200, {**body, "expires_in": expires_in})

            def _answer(self, status: int, body: dict[str, object]) -> None:
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        super().__init__(Handler)
