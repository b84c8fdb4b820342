"""Bring-up: the calibration ramp and the canaries against a fake engine in virtual time
(docs/pylon-data-path.md, "Calibration and canaries").

The fake engine answers each request after a latency of its own choosing (by default one second
per thousand prompt characters, i.e. an engine of 1000 input tokens/s), and records what it was
sent, when, and how many requests it had in flight.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

import pytest
import trio
from trio.testing import MockClock

from stargate.http_headers import Headers
from stargate.protocol.stargate_pb2 import INFERENCE_SERVER_STATUS_ACTIVE as ACTIVE
from stargate.pylon.bringup import (
    CalibrationConfig,
    CalibrationStep,
    calibrate,
    calibration_steps,
    run_canary,
)
from stargate.pylon.config import BringupConfig, PylonConfig
from stargate.pylon.sidecar import Pylon
from stargate.pylon.stats.aggregator import StatsAggregator, StatsConfig
from stargate.upstream import ConnectError, ConnectionPool

MODEL = "model-a"
ENGINE = "http://engine:8000"
OK = b'{"choices":[{"message":{"content":"1"}}],"usage":{"completion_tokens":1}}'

Answer = tuple[float, int, bytes]
"""What the fake engine does with a request: (latency in seconds, status, body)."""


def at_1000_tps(units: int) -> Answer:
    return units / 1000, 200, OK


@dataclass(frozen=True)
class Call:
    url: str
    headers: dict[bytes, bytes]
    body: dict[str, Any]
    at: float

    @property
    def units(self) -> int:
        return len(self.body["messages"][0]["content"])


class FakeResponse:
    def __init__(self, status: int, body: bytes) -> None:
        self.status = status
        self._body = body

    async def read(self) -> bytes:
        await trio.lowlevel.checkpoint()
        return self._body

    async def __aenter__(self) -> FakeResponse:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await trio.lowlevel.checkpoint()


class FakeEngine:
    """A `ConnectionPool` stand-in: `answer(prompt characters)` decides each answer (or raises)."""

    def __init__(self, answer: Callable[[int], Answer] = at_1000_tps) -> None:
        self._answer = answer
        self.calls: list[Call] = []
        self._in_flight: dict[int, int] = {}
        self.concurrency: dict[int, int] = {}
        """prompt size -> the most requests of that size in flight at once."""

    @property
    def pool(self) -> ConnectionPool:
        return cast(ConnectionPool, self)

    async def request(
        self, method: str, url: str, headers: Headers, body: bytes = b""
    ) -> FakeResponse:
        assert method == "POST"
        call = Call(url, dict(headers), json.loads(body), trio.current_time())
        self.calls.append(call)
        units = call.units
        self._in_flight[units] = self._in_flight.get(units, 0) + 1
        self.concurrency[units] = max(self.concurrency.get(units, 0), self._in_flight[units])
        try:
            latency, status, answer = self._answer(units)
            await trio.sleep(latency)
        finally:
            self._in_flight[units] -= 1
        return FakeResponse(status, answer)

    def units(self) -> list[int]:
        return [call.units for call in self.calls]


def make_stats(**config: Any) -> StatsAggregator:
    stats = StatsAggregator(StatsConfig(**config), lambda: 0)
    stats.set_models([MODEL])
    return stats


# ---- the step plan -----------------------------------------------------------------------------


def test_the_ramp_doubles_prompts_and_requests_and_adds_one_to_the_concurrency() -> None:
    """Step k: `requests` x 2^k requests of 256 x 2^k units (capped at `prompt_units`) at
    concurrency k + 1 (capped at `max_concurrency`), for `max_steps` steps."""
    config = CalibrationConfig(requests=5, prompt_units=2048, max_concurrency=3, max_steps=6)
    assert list(calibration_steps(config)) == [
        CalibrationStep(0, 256, 5, 1),
        CalibrationStep(1, 512, 10, 2),
        CalibrationStep(2, 1024, 20, 3),
        CalibrationStep(3, 2048, 40, 3),
        CalibrationStep(4, 2048, 80, 3),
        CalibrationStep(5, 2048, 160, 3),
    ]


def test_the_default_ramp_has_eight_steps_up_to_4096_units_at_concurrency_4() -> None:
    """The defaults: 5 requests, 4096 units, concurrency 4, 8 steps."""
    steps = list(calibration_steps(CalibrationConfig()))
    assert [s.prompt_units for s in steps] == [256, 512, 1024, 2048, 4096, 4096, 4096, 4096]
    assert [s.requests for s in steps] == [5 << k for k in range(8)]
    assert [s.concurrency for s in steps] == [1, 2, 3, 4, 4, 4, 4, 4]


def test_a_prompt_cap_lowers_the_prompts() -> None:
    """A prompt found too long caps the later prompts."""
    steps = calibration_steps(CalibrationConfig(max_steps=4), prompt_cap=600)
    assert [s.prompt_units for s in steps] == [256, 512, 600, 600]


# ---- calibrate ---------------------------------------------------------------------------------


async def test_the_ramp_stops_at_the_first_step_slower_than_the_timeout(
    autojump_clock: MockClock,
) -> None:
    """At 1000 tokens/s the steps take 1.28 s, 2.56 s, 7.17 s and then more than the 10 s
    timeout: that step is cut and no larger prompt is ever sent; the samples give 1000 TPS."""
    engine = FakeEngine()
    stats = make_stats()
    config = CalibrationConfig(requests=5, prompt_units=4096, max_concurrency=4, step_timeout=10.0)
    start = trio.current_time()
    assert await calibrate(engine.pool, ENGINE, stats, MODEL, config)
    assert trio.current_time() - start == pytest.approx(1.28 + 2.56 + 7.168 + 10.0)
    units = engine.units()
    assert sorted(set(units)) == [256, 512, 1024, 2048]
    assert (units.count(256), units.count(512), units.count(1024)) == (5, 10, 20)
    assert engine.concurrency == {256: 1, 512: 2, 1024: 3, 2048: 4}
    assert stats.input_tps(MODEL) == pytest.approx(1000.0)


async def test_the_ramp_stops_after_max_steps(autojump_clock: MockClock) -> None:
    """Beyond Rust: a fast engine is not ramped forever (`--calibration-max-steps`)."""
    engine = FakeEngine(lambda units: (0.1, 200, OK))
    config = CalibrationConfig(requests=5, max_steps=3)
    assert await calibrate(engine.pool, ENGINE, make_stats(), MODEL, config)
    assert sorted(set(engine.units())) == [256, 512, 1024]
    assert len(engine.calls) == 5 + 10 + 20


@pytest.mark.parametrize(("requests", "calibrated"), [(5, True), (4, False)])
async def test_calibration_needs_five_samples(
    autojump_clock: MockClock, requests: int, calibrated: bool
) -> None:
    """It succeeds once five samples exist (a valid input TPS), in engine-stream mode too
    (calibration requests always sample); with four it fails."""
    stats = make_stats(fallback_from_start=False)
    config = CalibrationConfig(requests=requests, max_steps=1)
    assert await calibrate(FakeEngine().pool, ENGINE, stats, MODEL, config) is calibrated
    assert (stats.input_tps(MODEL) is not None) is calibrated


async def test_calibration_fails_when_the_engine_fails(autojump_clock: MockClock) -> None:
    """No successful request, no sample: False (the model stays unadvertised)."""
    engine = FakeEngine(lambda units: (0.1, 500, b'{"error": "boom"}'))
    stats = make_stats()
    assert not await calibrate(engine.pool, ENGINE, stats, MODEL, CalibrationConfig(max_steps=2))
    assert len(engine.calls) == 15 and stats.input_tps(MODEL) is None


@pytest.mark.parametrize(
    "message",
    [
        "the Maximum Context is 1000 tokens",
        "prompt too long",
        "input exceeds the context length",
    ],
)
async def test_a_prompt_too_long_caps_the_prompt_at_the_last_size_that_completed(
    autojump_clock: MockClock, message: str
) -> None:
    """An engine's 400 "prompt too long" ("context length", "maximum context") at 1024 units caps
    the later steps at 512, the last size that completed; the ramp goes on and succeeds."""

    def answer(units: int) -> Answer:
        if units > 1000:
            return 0.01, 400, json.dumps({"error": {"message": message}}).encode()
        return at_1000_tps(units)

    engine = FakeEngine(answer)
    config = CalibrationConfig(requests=5, max_steps=5, step_timeout=1000.0)
    assert await calibrate(engine.pool, ENGINE, make_stats(), MODEL, config)
    units = engine.units()
    assert units == [256] * 5 + [512] * 10 + [1024] * 20 + [512] * (40 + 80)


async def test_a_prompt_too_long_at_256_units_fails(autojump_clock: MockClock) -> None:
    """Even the smallest prompt is too long: calibration fails at once (no smaller step)."""
    engine = FakeEngine(lambda units: (0.01, 400, b'{"message": "prompt too long"}'))
    assert not await calibrate(engine.pool, ENGINE, make_stats(), MODEL, CalibrationConfig())
    assert engine.units() == [256] * 5


async def test_each_calibration_request_is_a_one_token_non_streamed_chat(
    autojump_clock: MockClock,
) -> None:
    """Each request: POST chat, `x-request-id` calibration-…, unique; `x-input-tokens` its
    prompt size; a prompt of "1" x units; `max_tokens` 1; not streamed."""
    engine = FakeEngine()
    config = CalibrationConfig(requests=2, max_steps=2)
    await calibrate(engine.pool, ENGINE, make_stats(), MODEL, config)
    assert len(engine.calls) == 2 + 4
    ids = [call.headers[b"x-request-id"] for call in engine.calls]
    assert all(i.startswith(b"calibration-") for i in ids) and len(set(ids)) == len(ids)
    for call in engine.calls:
        assert call.url == ENGINE + "/v1/chat/completions"
        assert call.headers[b"x-model"] == MODEL.encode()
        assert call.headers[b"x-input-tokens"] == str(call.units).encode()
        assert call.body["messages"][0]["content"] == "1" * call.units
        assert call.body["model"] == MODEL
        assert call.body["max_tokens"] == 1
        assert call.body["stream"] is False


# ---- canaries ----------------------------------------------------------------------------------


def canary_engine(latency: float, status: int, body: dict[str, Any]) -> FakeEngine:
    return FakeEngine(lambda units: (latency, status, json.dumps(body).encode()))


def usage(tokens: int) -> dict[str, Any]:
    return {"choices": [{"message": {"content": "2"}}], "usage": {"completion_tokens": tokens}}


async def test_a_canary_that_answers_passes(autojump_clock: MockClock) -> None:
    """`1+1=` with `max_tokens` 237, not streamed, straight to the engine: a 2xx passes."""
    engine = canary_engine(1.0, 200, usage(1))
    assert await run_canary(engine.pool, ENGINE, MODEL, 5.0) is None
    (call,) = engine.calls
    assert call.url == ENGINE + "/v1/chat/completions"
    assert call.headers[b"x-request-id"].startswith(b"canary-")
    assert call.body["messages"] == [{"role": "user", "content": "1+1="}]
    assert call.body["max_tokens"] == 237 and call.body["stream"] is False


@pytest.mark.parametrize(
    ("tokens", "reason"), [(236, None), (237, "the answer ran to max_tokens (237)")]
)
async def test_a_canary_of_exactly_237_tokens_fails(
    autojump_clock: MockClock, tokens: int, reason: str | None
) -> None:
    """A model that runs to the limit is producing garbage; one token less is an answer."""
    engine = canary_engine(1.0, 200, usage(tokens))
    assert await run_canary(engine.pool, ENGINE, MODEL, 5.0) == reason


@pytest.mark.parametrize("status", [400, 500, 503])
async def test_a_canary_answered_with_an_error_fails(
    autojump_clock: MockClock, status: int
) -> None:
    """A non-2xx answer fails the canary."""
    engine = canary_engine(1.0, status, usage(1))
    assert await run_canary(engine.pool, ENGINE, MODEL, 5.0) == f"status {status}"


async def test_a_canary_without_an_answer_in_time_fails(autojump_clock: MockClock) -> None:
    """`--bringup-canary-timeout-ms`: the canary is given up at the timeout."""
    engine = canary_engine(60.0, 200, usage(1))
    start = trio.current_time()
    assert await run_canary(engine.pool, ENGINE, MODEL, 5.0) == "no answer within 5 s"
    assert trio.current_time() - start == pytest.approx(5.0)


async def test_a_canary_the_engine_refuses_fails() -> None:
    """A failure to reach the engine is the canary's failure, with its reason."""

    def refuse(units: int) -> Answer:
        raise ConnectError("connection refused")

    reason = await run_canary(FakeEngine(refuse).pool, ENGINE, MODEL, 5.0)
    assert reason == "connection refused"


# ---- the canary loop (stargate/pylon/sidecar.py, `Pylon._canary_loop`) --------------------------


def canary_pylon(stats_models: tuple[str, ...] = (MODEL,)) -> Pylon:
    pylon = Pylon(
        PylonConfig(
            upstream_url=ENGINE,
            model_names=stats_models,
            bringup=BringupConfig(canary_interval_ms=5000, canary_timeout_ms=5000),
        )
    )
    pylon.stats.set_models(stats_models)
    pylon.admitted.update(stats_models)
    return pylon


def canaries(engine: FakeEngine) -> list[float]:
    return [call.at for call in engine.calls if call.body["max_tokens"] == 237]


async def test_an_idle_model_gets_a_canary_every_interval(autojump_clock: MockClock) -> None:
    engine = FakeEngine(lambda units: (0.1, 200, OK))
    pylon = canary_pylon()
    with trio.move_on_after(21):
        await pylon._canary_loop(engine.pool)
    assert canaries(engine) == pytest.approx([0.0, 5.1, 10.2, 15.3, 20.4])
    assert not pylon.canary_failing


async def test_a_model_producing_output_is_not_sent_canaries(autojump_clock: MockClock) -> None:
    """Its requests prove it works, and a canary would queue behind them: on a busy engine it
    timed out and made a healthy model INACTIVE (the routing benchmark)."""
    engine = FakeEngine(lambda units: (0.1, 200, OK))
    pylon = canary_pylon()

    async def traffic() -> None:
        from stargate.pylon.stats.observer import Endpoint

        while True:
            tracker = pylon.stats.track(
                model=MODEL,
                request_id="r",
                endpoint=Endpoint.CHAT,
                streaming=True,
                input_tokens=10,
                priority=0,
                now=trio.current_time(),
            )
            tracker.headers(trio.current_time())
            await trio.sleep(0.5)
            tracker.output(1, False, trio.current_time())
            await trio.sleep(0.5)
            tracker.finish(True, trio.current_time())

    async with trio.open_nursery() as nursery:
        nursery.start_soon(traffic)
        with trio.move_on_after(21):
            await pylon._canary_loop(engine.pool)
        nursery.cancel_scope.cancel()
    assert canaries(engine) == [0.0]  # the first round only: nothing was known of the model yet


async def test_a_failing_canary_makes_the_model_inactive_until_one_passes(
    autojump_clock: MockClock,
) -> None:
    """While failing the model gets a canary every round, busy or not."""
    answers = iter([(0.1, 500, b"{}"), (6.0, 200, OK), (0.1, 200, OK)])
    engine = FakeEngine(lambda units: next(answers))
    pylon = canary_pylon()
    active: dict[float, bool] = {}

    async def watch() -> None:
        await trio.sleep(0.5)
        while True:
            active[trio.current_time()] = pylon.registration().models[MODEL].status == ACTIVE
            await trio.sleep(1)

    pylon.healthy = True
    async with trio.open_nursery() as nursery:
        nursery.start_soon(watch)
        with trio.move_on_after(16):
            await pylon._canary_loop(engine.pool)
        nursery.cancel_scope.cancel()
    # 0 s: 500 -> INACTIVE; 5.1 s: no answer within 5 s -> still INACTIVE; 15.1 s: passes.
    assert canaries(engine) == pytest.approx([0.0, 5.1, 15.1])
    assert not pylon.canary_failing
    assert [at for at, is_active in active.items() if is_active] == [15.5]
    assert len(active) == 16  # INACTIVE from 0.5 s to 14.5 s
    assert pylon.registration().models[MODEL].status == ACTIVE
