"""The admin app (stargate/admin_app.py) through a minimal in-memory ASGI client: probes, model
listing, debug views and the edges of the request target."""

from __future__ import annotations

import json
import urllib.parse
from typing import Any

from stargate.admin_app import AdminApp, create_admin_app, replica_admin_app
from stargate.config import DiscoveryConfig, ListenAddress, ProxyConfig, ServeConfig, WarmupConfig
from stargate.readiness import Readiness
from stargate.routing import BackendRoute, ModelStats, RegistrationIdentity, RoutingState
from stargate.serving import BoundAddresses


class _Answer:
    def __init__(self, status: int, headers: dict[str, str], body: bytes) -> None:
        self.status_code = status
        self.headers = headers
        self.body = body
        self.mimetype = headers.get("content-type", "").split(";")[0]

    async def get_json(self) -> Any:
        assert self.mimetype == "application/json", self.headers
        return json.loads(self.body)

    async def get_data(self) -> bytes:
        return self.body


class _Client:
    """One request at a time through the app, as Hypercorn would hand it over (the path
    percent-decoded, the query as sent)."""

    def __init__(self, app: AdminApp) -> None:
        self._app = app

    async def request(self, method: str, target: str) -> _Answer:
        raw_path, _, query = target.partition("?")
        scope = {
            "type": "http",
            "method": method,
            "path": urllib.parse.unquote(raw_path),
            "raw_path": raw_path.encode(),
            "query_string": query.encode(),
            "headers": [(b"host", b"replica")],
        }
        sent: list[dict[str, Any]] = []

        async def receive() -> dict[str, Any]:
            return {"type": "http.request", "body": b"", "more_body": False}

        async def send(message: dict[str, Any]) -> None:
            sent.append(message)

        await self._app(scope, receive, send)  # type: ignore[arg-type]
        headers = {k.decode(): v.decode() for k, v in sent[0]["headers"]}
        body = b"".join(m.get("body", b"") for m in sent[1:])
        return _Answer(sent[0]["status"], headers, body)

    async def get(self, target: str) -> _Answer:
        return await self.request("GET", target)

    async def options(self, target: str) -> _Answer:
        return await self.request("OPTIONS", target)


async def test_healthz_is_always_200_even_while_warming_and_draining() -> None:
    readiness = Readiness(WarmupConfig(warmup_ms=60_000))
    app = create_admin_app(readiness, RoutingState(), stargate_id="r1")
    client = _Client(app)
    assert (await client.get("/healthz")).status_code == 200
    readiness.lifecycle.begin_draining()
    assert (await client.get("/healthz")).status_code == 200


async def test_readyz_is_503_while_warming_and_explains_why() -> None:
    app = create_admin_app(
        Readiness(WarmupConfig(warmup_ms=60_000)), RoutingState(), stargate_id="r1"
    )
    response = await _Client(app).get("/readyz")
    assert response.status_code == 503
    body = await response.get_json()
    assert body["phase"] == "warming"
    assert body["ready"] is False
    assert body["stargate_id"] == "r1"


async def test_readyz_is_200_when_warm_and_503_once_draining() -> None:
    readiness = Readiness(WarmupConfig(warmup_ms=0))
    client = _Client(create_admin_app(readiness, RoutingState(), stargate_id="r1"))
    response = await client.get("/readyz")
    assert response.status_code == 200
    assert (await response.get_json())["promotion_reason"] == "disabled"
    readiness.lifecycle.begin_draining()
    response = await client.get("/readyz")
    assert response.status_code == 503
    assert (await response.get_json())["phase"] == "draining"


def _routing_with(models: dict[str | None, list[str]]) -> RoutingState:
    routing = RoutingState()
    for index, (routing_key, model_ids) in enumerate(models.items()):
        identity = RegistrationIdentity(
            f"pylon-{index}", f"pylon-{index}", "http://h:1", routing_key
        )
        registration = routing.begin(identity)
        routing.apply(registration, {m: BackendRoute(ModelStats(), 1, 0.0) for m in model_ids})
    return routing


async def test_v1_models_lists_unkeyed_active_models_sorted() -> None:
    routing = _routing_with({None: ["b", "a"], "tenant": ["secret"]})
    client = _Client(create_admin_app(Readiness(WarmupConfig(0)), routing, stargate_id="r"))
    response = await client.get("/v1/models")
    assert response.status_code == 200
    assert await response.get_json() == {"model_ids": ["a", "b"]}
    response = await client.get("/v1/models?model_ids=b&model_ids=%20b%20&model_ids=zz")
    assert await response.get_json() == {"model_ids": ["b"]}


async def test_v1_models_blank_filter_is_400_with_empty_body() -> None:
    client = _Client(create_admin_app(Readiness(WarmupConfig(0)), RoutingState(), stargate_id="r"))
    response = await client.get("/v1/models?model_ids=a&model_ids=%20")
    assert response.status_code == 400
    assert await response.get_data() == b""


async def test_debug_state_shows_config_and_models_across_routing_keys() -> None:
    routing = _routing_with({None: ["b"], "tenant": ["a"]})
    app = create_admin_app(
        Readiness(WarmupConfig(0)),
        routing,
        stargate_id="r",
        debug_config=lambda: {"stargate_id": "r", "grpc_listen_addr": "127.0.0.1:1"},
    )
    body = await (await _Client(app).get("/debug/state")).get_json()
    assert body == {
        "config": {"stargate_id": "r", "grpc_listen_addr": "127.0.0.1:1"},
        "active_model_ids": ["a", "b"],
    }


async def test_debug_state_is_404_like_any_unknown_path_without_debug_endpoints() -> None:
    """`--no-debug-endpoints`: the route does not exist (an empty 404, as for any unknown path);
    the probes and the model listing are unaffected."""
    app = create_admin_app(
        Readiness(WarmupConfig(0)),
        _routing_with({None: ["b"]}),
        stargate_id="r",
        debug_config=lambda: {"stargate_id": "r"},
        debug_endpoints=False,
    )
    client = _Client(app)
    for path in ("/debug/state", "/no-such-path"):
        response = await client.get(path)
        assert response.status_code == 404
        assert await response.get_data() == b""
        assert response.mimetype == "text/plain"
    assert (await client.get("/healthz")).status_code == 200
    assert await (await client.get("/v1/models")).get_json() == {"model_ids": ["b"]}


async def test_paths_are_matched_as_sent_never_redirected() -> None:
    """Werkzeug neither merges doubled slashes (a 308 with HTML, to another path) nor adds or
    strips a trailing slash; a model id is everything after `/v1/models/`
    (stargate/admin_app.py)."""
    app = create_admin_app(
        Readiness(WarmupConfig(0)),
        _routing_with({None: ["org/m", "/lead"]}),
        stargate_id="r",
        accept_openai_requests=True,
    )
    client = _Client(app)
    for path in ("/v1//models", "/healthz/", "/v1/models/"):
        response = await client.get(path)
        assert (response.status_code, await response.get_data()) == (404, b""), path
        assert response.mimetype == "text/plain"
    for model in ("org/m", "/lead"):
        response = await client.get("/v1/models/" + model.replace("/", "%2F"))
        assert response.status_code == 200
        assert (await response.get_json())["id"] == model
    response = await client.get("/v1/models/%2Fm")
    assert response.status_code == 404
    assert (await response.get_json())["error"]["code"] == "model_not_found"


async def test_options_is_an_empty_text_plain_200_with_allow() -> None:
    client = _Client(create_admin_app(Readiness(WarmupConfig(0)), RoutingState(), stargate_id="r"))
    response = await client.options("/healthz")
    assert (response.status_code, await response.get_data()) == (200, b"")
    assert response.mimetype == "text/plain"
    assert set(response.headers["allow"].split(", ")) == {"GET", "HEAD", "OPTIONS"}


async def test_a_replicas_debug_state_reads_its_addresses_at_each_request() -> None:
    """`replica_admin_app`: the listeners bind and the publisher is built after the app, so
    `/debug/state` asks for them each time; the other settings come from the replica's config."""
    config = ServeConfig(
        stargate_id="r9",
        discovery=DiscoveryConfig(dns_name="stargates.example"),
        proxy=ProxyConfig(accept_openai_requests=True),
        debug_endpoints=True,
    )
    bound: BoundAddresses | None = None
    advertised: str | None = None
    app = replica_admin_app(
        config,
        Readiness(WarmupConfig(warmup_ms=0)),
        RoutingState(),
        bound=lambda: bound,
        advertise_addr=lambda: advertised,
    )
    client = _Client(app)
    before = (await (await client.get("/debug/state")).get_json())["config"]
    assert (before["stargate_id"], before["stargate_discovery_dns_name"]) == (
        "r9",
        "stargates.example",
    )
    assert before["http_listen_addr"] is None and before["advertise_addr"] is None
    address = ListenAddress("127.0.0.1", 1234)
    bound = BoundAddresses(address, address, address, address)
    advertised = "10.0.0.1:50051"
    after = (await (await client.get("/debug/state")).get_json())["config"]
    assert (after["http_listen_addr"], after["advertise_addr"]) == ("127.0.0.1:1234", advertised)
