"""The mock engine's KV events (stargate/mock/kv_events.py): the prefix cache keyed by the
router's chain, what it publishes (read back with a real ZMQ SUB socket on 127.0.0.1), the
drops, the flags, and the server binding and closing the publisher."""

from __future__ import annotations

import json
import socket
from typing import Any

import pytest
import trio
import zmq

from stargate.mock import cli
from stargate.mock.app import MockBackend, MockBackendConfig
from stargate.mock.kv_events import KvEventPublisher, KvEventsConfig
from stargate.mock.prefix_cache import BlockKey, PrefixCache, StoredRun
from stargate.prefix_key import derive_prefix
from stargate.protocol.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    decode_batch,
    decode_seq,
)
from stargate.serving import StartupError
from tests.unit.mock.asgi_client import Client
from tests.unit.mock.cli_runner import invoke

PATH = "/v1/chat/completions"


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


def chat(system: str, user: str) -> dict[str, Any]:
    return {
        "model": "mock-model",
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": user}],
    }


class Recorder:
    """A `CacheListener` that keeps what it hears."""

    def __init__(self) -> None:
        self.changes: list[tuple[list[StoredRun], list[BlockKey]]] = []
        self.clears = 0

    def blocks_changed(self, stored: Any, removed: Any) -> None:
        self.changes.append((list(stored), list(removed)))

    def blocks_cleared(self) -> None:
        self.clears += 1


# ---- the cache and its listener ---------------------------------------------------------------


def test_the_listener_hears_stored_runs_with_parents_then_evictions() -> None:
    heard = Recorder()
    cache = PrefixCache(4, 256, heard)
    first = cache.lookup_and_insert_chain((1, 2, 3), 800)
    assert (first.hit_blocks, first.hit_chars, first.prompt_chars) == (0, 0, 800)
    assert heard.changes == [([StoredRun((1, 2, 3), None)], [])]
    again = cache.lookup_and_insert_chain((1, 2, 5, 6), 1100)
    assert (again.hit_blocks, again.hit_chars) == (2, 512)  # hit chars = blocks x block bytes
    # 5 and 6 are new (parent 2); the cache holds 4: the least recently used (3) goes.
    assert heard.changes[-1] == ([StoredRun((5, 6), 2)], [3])
    assert again.evicted_blocks == 1
    # A chain whose middle was evicted is stored as separate runs, each with its parent.
    cache.configure(10, 256)
    cache.lookup_and_insert_chain((1, 2, 3, 5, 9), 1300)
    assert heard.changes[-1] == ([StoredRun((3,), 2), StoredRun((9,), 5)], [])
    # The hit never exceeds the prompt (a chain counts UTF-8 bytes, the prompt characters).
    assert cache.lookup_and_insert_chain((1, 2), 300).hit_chars == 300


def test_lower_capacity_and_clear_are_heard() -> None:
    heard = Recorder()
    cache = PrefixCache(10, 256, heard)
    cache.lookup_and_insert_chain((1, 2, 3), 768)
    assert cache.configure(1, 256) == 2
    assert heard.changes[-1] == ([], [3, 2])  # the tail first: the head is most recent
    cache.lookup_and_insert_chain((1,), 256)  # a refresh: nothing changes, nothing heard
    assert len(heard.changes) == 2
    cache.clear()
    assert heard.clears == 1
    cache.configure(10, 64)  # a new block size empties the cache: a clear
    assert heard.clears == 2


def test_a_cache_that_is_off_stores_and_publishes_nothing() -> None:
    heard = Recorder()
    cache = PrefixCache(0, 256, heard)
    assert cache.lookup_and_insert_chain((1, 2), 600).hit_blocks == 0
    assert len(cache) == 0 and heard.changes == []


# ---- the publisher ----------------------------------------------------------------------------


def test_a_full_channel_drops_and_skips_the_seq() -> None:
    publisher = KvEventPublisher(KvEventsConfig("tcp://127.0.0.1:1"), buffered=1)
    publisher.blocks_changed([StoredRun((1,), None)], [])
    publisher.blocks_cleared()  # nobody drains the channel: dropped
    assert publisher.dropped == 1
    assert publisher.block_size == 64  # 256 bytes: the mock's four characters a token
    assert KvEventPublisher(KvEventsConfig("tcp://127.0.0.1:1", block_bytes=2)).block_size == 1


def test_the_config_checks_its_bounds() -> None:
    with pytest.raises(ValueError):
        KvEventsConfig(block_bytes=0)
    with pytest.raises(ValueError):
        KvEventsConfig(depth=0)
    with pytest.raises(ValueError):
        KvEventPublisher(KvEventsConfig())  # no endpoint


class Subscriber:
    """A SUB socket reading the mock's events, from trio (short polls)."""

    def __init__(self, endpoint: str) -> None:
        self.context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self.socket = self.context.socket(zmq.SUB)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.setsockopt(zmq.SUBSCRIBE, b"")
        self.socket.connect(endpoint)

    async def receive(self) -> tuple[int, EventBatch]:
        with trio.fail_after(5):
            while not self.socket.poll(0):  # noqa: ASYNC110 (a socket, not an event)
                await trio.sleep(0.005)
        topic, seq, payload = self.socket.recv_multipart()
        assert topic == b""
        return decode_seq(seq), decode_batch(payload)

    def close(self) -> None:
        self.socket.close(linger=0)
        self.context.term()


async def request(app: MockBackend, body: dict[str, Any], path: str = PATH) -> dict[str, str]:
    client = await Client(app, "POST", path, body).run()
    head = client.messages[0][1]
    return {bytes(k).decode(): bytes(v).decode() for k, v in head["headers"]}


async def test_the_mock_publishes_its_cache_by_the_routers_chain() -> None:
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    config = MockBackendConfig(
        port=0, prefix_cache_blocks=4, kv_events=KvEventsConfig(endpoint, block_bytes=64, depth=8)
    )
    app = MockBackend(config)
    assert app.kv_events is not None
    app.kv_events.bind()
    subscriber = Subscriber(endpoint)
    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(app.kv_events.run)
            # A subscriber misses what is published before it is connected (ZMQ's slow joiner):
            # resets until one arrives.
            with trio.fail_after(10):
                while not subscriber.socket.poll(0):
                    await Client(app, "POST", "/test-control", {"reset": True}).run()
                    await trio.sleep(0.02)
            while subscriber.socket.poll(50):
                subscriber.socket.recv_multipart()
            base = app.kv_events.sent

            body = chat("s" * 100, "u" * 100)  # 214 bytes of prompt stream: 3 blocks of 64
            chain = derive_prefix(PATH, json.dumps(body).encode(), 64, 8)
            assert chain is not None and len(chain.chain) == 3
            headers = await request(app, body)
            assert headers["x-mock-prefix-cache-hit-chars"] == "0"
            seq, batch = await subscriber.receive()
            assert seq == base
            assert batch.events == (BlockStored(chain.chain, None, (), 16),)

            headers = await request(app, body)  # all three blocks hit: 3 x 64 bytes
            assert headers["x-mock-prefix-cache-hit-chars"] == "192"
            longer = chat("s" * 100, "u" * 100 + "v" * 130)  # 5 blocks: 2 new, 1 evicted (of 4)
            longer_chain = derive_prefix(PATH, json.dumps(longer).encode(), 64, 8)
            assert longer_chain is not None and longer_chain.chain[:3] == chain.chain
            await request(app, longer)
            seq, batch = await subscriber.receive()
            assert seq == base + 1  # a request that changed nothing published nothing
            stored, removed = batch.events
            assert stored == BlockStored(longer_chain.chain[3:], chain.chain[2], (), 16)
            # The LRU's tail: the prompt's last block (a chain's tail goes before its head).
            assert removed == BlockRemoved((longer_chain.chain[4],))
            snapshot = (await Client(app, "GET", "/test-control").run()).messages[1][1]["body"]
            counters = json.loads(snapshot)["counters"]["prefix_cache"]
            assert counters["cached_blocks"] == 4 and counters["hit_chars"] == 2 * 192

            # The knob of the text cache's block size changes nothing: the router's block rules.
            await Client(app, "POST", "/test-control", {"prefix_cache_block_chars": 32}).run()
            assert app.prefix_cache.block_chars == 64 and len(app.prefix_cache) == 4

            await Client(app, "POST", "/test-control", {"reset": True}).run()
            seq, batch = await subscriber.receive()
            assert (seq, batch.events) == (base + 2, (AllBlocksCleared(),))
            assert app.kv_events.dropped == 0
            nursery.cancel_scope.cancel()
    finally:
        subscriber.close()
        app.kv_events.close()


async def test_embeddings_and_bad_requests_publish_nothing() -> None:
    config = MockBackendConfig(
        port=0, prefix_cache_blocks=5, kv_events=KvEventsConfig("tcp://127.0.0.1:1")
    )
    app = MockBackend(config)
    assert app.kv_events is not None
    await request(app, {"model": "mock-model", "input": "x" * 1000}, "/v1/embeddings")
    await request(app, {"model": "other", "messages": []})
    await request(app, chat("a", "b"))  # shorter than one block: no chain, nothing cached
    assert len(app.prefix_cache) == 0
    assert app.kv_events._receive.statistics().current_buffer_used == 0


async def test_the_server_binds_publishes_and_closes_the_publisher() -> None:
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    config = MockBackendConfig(port=0, kv_events=KvEventsConfig(endpoint))
    stop = trio.Event()
    async with trio.open_nursery() as nursery:
        app = MockBackend(config)
        await nursery.start(
            lambda task_status: cli.run_mock_backend(
                config, app=app, shutdown_trigger=stop.wait, task_status=task_status
            )
        )
        # A second server on the same endpoint cannot bind: a start-up error naming the flag.
        with pytest.raises(StartupError, match="--kv-events-endpoint"):
            await cli.run_mock_backend(config)
        stop.set()  # the graceful stop ends the publisher too: the nursery can exit
    assert app.kv_events is not None and app.kv_events._socket is None


# ---- the flags --------------------------------------------------------------------------------


def test_the_flags(served: list[MockBackendConfig]) -> None:
    assert invoke().exit_code == 0
    assert invoke("--kv-events-endpoint", "tcp://*:5557", "--kv-events-depth", "4").exit_code == 0
    env = {
        "STARGATE_MOCK_KV_EVENTS_ENDPOINT": "tcp://127.0.0.1:5558",
        "STARGATE_MOCK_KV_EVENTS_BLOCK_BYTES": "16",
    }
    assert invoke(env=env).exit_code == 0
    off, flags, environment = (config.kv_events for config in served)
    assert off == KvEventsConfig() and not off.enabled
    assert flags == KvEventsConfig("tcp://*:5557", 256, 4)
    assert environment == KvEventsConfig("tcp://127.0.0.1:5558", 16, 64)


@pytest.mark.parametrize(
    ("flag", "value"),
    [
        ("--kv-events-endpoint", "127.0.0.1:5557"),
        ("--kv-events-endpoint", "tcp://engine:5557"),
        ("--kv-events-endpoint", "tcp://127.0.0.1:0"),
        ("--kv-events-block-bytes", "0"),
        ("--kv-events-depth", "0"),
    ],
)
def test_bad_values_are_usage_errors_naming_the_flag(
    served: list[MockBackendConfig], flag: str, value: str
) -> None:
    result = invoke(flag, value)
    assert result.exit_code == 2
    assert flag in result.output
    assert served == []
