"""Bring-up: calibrating a model's input throughput before it is advertised, and canaries.

docs/pylon-data-path.md, "Calibration and canaries". The Rust Pylon's rules:

* **Calibration** (`--do-calibration`) measures `last_mean_input_tps` locally before the model is
  advertised. Step k sends `requests x 2^k` requests whose prompt is the character `1` repeated
  `256 x 2^k` times (capped at `--calibration-prompt-units`), at concurrency k + 1 (capped at
  `--calibration-max-concurrency`), each `max_tokens` 1, not streamed, straight to the engine,
  and observed like forwarded traffic: each yields one input sample (prompt length / latency).
  The ramp stops at the first step that takes longer than `--bringup-calibration-timeout-ms` (the
  engine is saturated). Beyond Rust, whose ramp is unbounded, it also stops after
  `--calibration-max-steps` steps: against a fast engine the doubling would otherwise run for
  hours. It succeeds when the model then publishes a valid input TPS (five samples). A 4xx whose
  message says the prompt is too long clamps the prompt size to the last size that completed.
* **Canaries**: `1+1=` with `max_tokens` 237, not streamed. A failure, a timeout, or exactly 237
  output tokens (the model ran to the limit: it is producing garbage) marks the model INACTIVE
  until a canary passes again.

The step plan is pure (`calibration_steps`); the rest sends requests through the Pylon's own
connection pool.
"""

from __future__ import annotations

import json
import logging
import uuid
from collections.abc import Iterator
from dataclasses import dataclass

import trio

from stargate.pylon.stats.aggregator import StatsAggregator
from stargate.pylon.stats.observer import Endpoint
from stargate.pylon.stats.tokens import OutputTokenParser
from stargate.upstream import ConnectionPool, UpstreamError

__all__ = [
    "CANARY_MAX_TOKENS",
    "MIN_PROMPT_UNITS",
    "CalibrationConfig",
    "CalibrationStep",
    "calibrate",
    "calibration_steps",
    "run_canary",
]

log = logging.getLogger("stargate.pylon")

MIN_PROMPT_UNITS = 256
CANARY_MAX_TOKENS = 237
CANARY_PROMPT = "1+1="
_TOO_LONG = ("prompt too long", "context length", "maximum context")


@dataclass(frozen=True, slots=True)
class CalibrationConfig:
    """The calibration ramp's flags (`stargate pylon --calibration-*`)."""

    requests: int = 5
    prompt_units: int = 4096
    max_concurrency: int = 4
    step_timeout: float = 30.0
    max_steps: int = 8

    def __post_init__(self) -> None:
        if self.requests < 1:
            raise ValueError("calibration requests must be > 0")
        if self.max_concurrency < 1:
            raise ValueError("calibration max concurrency must be > 0")
        if self.max_steps < 1:
            raise ValueError("calibration max steps must be > 0")
        if not self.step_timeout > 0:
            raise ValueError("the calibration step timeout must be > 0")


@dataclass(frozen=True, slots=True)
class CalibrationStep:
    index: int
    prompt_units: int
    requests: int
    concurrency: int


def calibration_steps(
    config: CalibrationConfig, *, prompt_cap: int | None = None
) -> Iterator[CalibrationStep]:
    """The ramp (module docstring): prompts double from 256 up to the cap, request counts double,
    concurrency grows by one up to its cap; at most `max_steps` steps. `prompt_cap` lowers the cap
    (a prompt that was too long for the engine)."""
    cap = max(MIN_PROMPT_UNITS, config.prompt_units)
    if prompt_cap is not None:
        cap = min(cap, prompt_cap)
    for index in range(config.max_steps):
        yield CalibrationStep(
            index=index,
            prompt_units=min(MIN_PROMPT_UNITS << index, cap),
            requests=config.requests << index,
            concurrency=min(index + 1, config.max_concurrency),
        )


class PromptTooLong(Exception):
    """The engine refused a calibration prompt as too long."""


async def _calibration_request(
    pool: ConnectionPool,
    upstream_url: str,
    stats: StatsAggregator,
    model: str,
    prompt_units: int,
    request_id: str,
) -> None:
    body = json.dumps(
        {
            "model": model,
            "messages": [{"role": "user", "content": "1" * prompt_units}],
            "max_tokens": 1,
            "stream": False,
            "seed": 33,
            "temperature": 0.7,
            "top_p": 1.0,
        }
    ).encode()
    headers = [
        (b"content-type", b"application/json"),
        (b"x-request-id", request_id.encode()),
        (b"x-model", model.encode()),
        (b"x-input-tokens", str(prompt_units).encode()),
    ]
    tracker = stats.track(
        model=model,
        request_id=request_id,
        endpoint=Endpoint.CHAT,
        streaming=False,
        input_tokens=prompt_units,
        priority=0,
        now=trio.current_time(),
        calibration=True,
    )
    try:
        response = await pool.request("POST", upstream_url + "/v1/chat/completions", headers, body)
        async with response:
            tracker.headers(trio.current_time())
            answer = await response.read()
            ok = 200 <= response.status < 300
            if ok:
                tracker.output(OutputTokenParser().observe_body(answer), False, trio.current_time())
            tracker.finish(ok, trio.current_time())
            if 400 <= response.status < 500:
                text = answer.decode("utf-8", "replace").lower()
                if any(marker in text for marker in _TOO_LONG):
                    raise PromptTooLong(text[:200])
            if not ok:
                raise UpstreamError(f"status {response.status}", request_sent=True)
    finally:
        if not tracker.done:
            tracker.cancel(trio.current_time())


async def calibrate(
    pool: ConnectionPool,
    upstream_url: str,
    stats: StatsAggregator,
    model: str,
    config: CalibrationConfig,
    *,
    generation: int = 0,
) -> bool:
    """Run the ramp for `model`; True when the model then has a valid input TPS."""
    run = uuid.uuid4().hex[:12]
    prompt_cap: int | None = None
    completed_units = 0
    numbered = 0
    steps = calibration_steps(config)
    for step in steps:
        units = step.prompt_units if prompt_cap is None else min(step.prompt_units, prompt_cap)
        limiter = trio.CapacityLimiter(step.concurrency)
        too_long = False

        async def one(
            number: int, units: int = units, limiter: trio.CapacityLimiter = limiter
        ) -> None:
            nonlocal too_long
            async with limiter:
                try:
                    await _calibration_request(
                        pool,
                        upstream_url,
                        stats,
                        model,
                        units,
                        f"calibration-{run}-g{generation}-{number}",
                    )
                except PromptTooLong:
                    too_long = True
                except UpstreamError as error:
                    log.debug("calibration request for %s failed: %s", model, error)

        started = trio.current_time()
        with trio.move_on_after(config.step_timeout) as timer:
            async with trio.open_nursery() as nursery:
                for _ in range(step.requests):
                    numbered += 1
                    nursery.start_soon(one, numbered)
        elapsed = trio.current_time() - started
        if too_long:
            if completed_units < MIN_PROMPT_UNITS:
                log.warning("calibration of %s: even a %d-unit prompt is too long", model, units)
                return False
            prompt_cap = completed_units
            log.info("calibration of %s: prompts capped at %d units", model, prompt_cap)
            continue
        log.info(
            "calibration of %s: step %d (%d requests of %d units at concurrency %d) took %.2f s",
            model,
            step.index,
            step.requests,
            units,
            step.concurrency,
            elapsed,
        )
        if timer.cancelled_caught:
            log.info("calibration of %s: the engine is saturated", model)
            break
        completed_units = max(completed_units, units)
    tps = stats.input_tps(model)
    if tps is None:
        log.warning("calibration of %s: too few samples for an input TPS", model)
        return False
    log.info("calibration of %s: input TPS %.1f", model, tps)
    return True


async def run_canary(
    pool: ConnectionPool, upstream_url: str, model: str, seconds: float
) -> str | None:
    """Send one canary (bounded by `seconds`); None when it passed, else why it failed."""
    body = json.dumps(
        {
            "model": model,
            "messages": [{"role": "user", "content": CANARY_PROMPT}],
            "max_tokens": CANARY_MAX_TOKENS,
            "stream": False,
        }
    ).encode()
    headers = [
        (b"content-type", b"application/json"),
        (b"x-request-id", f"canary-{uuid.uuid4().hex}".encode()),
        (b"x-model", model.encode()),
        (b"x-input-tokens", b"4"),
    ]
    try:
        with trio.fail_after(seconds):
            response = await pool.request(
                "POST", upstream_url + "/v1/chat/completions", headers, body
            )
            async with response:
                answer = await response.read()
    except trio.TooSlowError:
        return f"no answer within {seconds:g} s"
    except UpstreamError as error:
        return str(error)
    if not 200 <= response.status < 300:
        return f"status {response.status}"
    tokens = OutputTokenParser().observe_body(answer)
    if tokens == CANARY_MAX_TOKENS:
        return f"the answer ran to max_tokens ({CANARY_MAX_TOKENS})"
    return None
