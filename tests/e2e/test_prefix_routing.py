"""prefix-aware routing through real processes (docs/prefix-routing.md).

Two replicas with `--derive-affinity-key` and `prefix-aware` as the model's algorithm; three
`stargate mock-backend` engines with a prefix cache, each behind a `stargate pylon` that
registers with both replicas (so both see the same stats). Clients are the `openai` SDK (plain
OpenAI requests: no x-* header), streaming, each conversation's turns alternating between the
replicas as a Kubernetes Service would send them. What must hold:

* every turn of a conversation lands on one engine, whichever replica routed it, and the
  engine's prefix cache serves the history (the mock's hit headers);
* the two replicas choose the same engine for the same request;
* conversations spread over the engines;
* bad prompts (empty, huge, non-text content parts, not a list) get an answer, never a 500.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.e2e.fleet import FAST, MODEL, Fleet, wait_routable
from tests.e2e.processes import Replica

LB_CONFIG = {"models": {MODEL: {"algorithm": "prefix-aware", "seed": "e2e"}}}
ENGINE = (*FAST, "--inter-token-ms", "1", "--tokens", "4", "--prefix-cache-blocks", "256")
SYSTEMS = [f"You are assistant {i}. " + "Answer in one short sentence. " * 20 for i in range(3)]


def _fleet(fleet: Fleet, tmp_path: Path) -> tuple[Replica, Replica]:
    config = tmp_path / "lb.json"
    config.write_text(json.dumps(LB_CONFIG))
    flags = ("--derive-affinity-key", "--lb-config-path", str(config))
    first, second = fleet.replica(*flags), fleet.replica(*flags)
    for _ in range(3):
        engine = fleet.engine(*ENGINE)
        fleet.pylon(engine.url, first, "--stargate", second.grpc_addr)
    wait_routable(first, 3)
    wait_routable(second, 3)
    return first, second


def _sdk(replica: Replica) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=f"http://127.0.0.1:{replica.ports.http}/v1", api_key="unused", max_retries=0
    )


def _turn(sdk: openai.OpenAI, messages: list[dict[str, Any]]) -> tuple[str, int, str]:
    """(engine, cached prompt characters, answer) of one streamed turn."""
    with sdk.chat.completions.with_streaming_response.create(
        model=MODEL,
        messages=messages,  # type: ignore[arg-type]
        stream=True,
    ) as response:
        engine = response.headers["x-inference-server-id"]
        hit = int(response.headers.get("x-mock-prefix-cache-hit-chars", "0"))
        text = "".join(
            chunk.choices[0].delta.content or "" for chunk in response.parse() if chunk.choices
        )
    return engine, hit, text


def test_turns_stick_to_one_engine_across_two_replicas(fleet: Fleet, tmp_path: Path) -> None:
    first, second = _fleet(fleet, tmp_path)
    sdks = [_sdk(first), _sdk(second)]
    homes = []
    for conversation in range(12):
        messages: list[dict[str, Any]] = [
            {"role": "system", "content": SYSTEMS[conversation % 3]},
            {"role": "user", "content": f"Conversation {conversation}: what is a cache?"},
        ]
        engines, hits = [], []
        for turn in range(4):
            engine, hit, answer = _turn(sdks[(conversation + turn) % 2], messages)
            engines.append(engine)
            hits.append(hit)
            messages += [
                {"role": "assistant", "content": answer},
                {"role": "user", "content": f"and then {turn}?"},
            ]
        assert len(set(engines)) == 1, f"conversation {conversation} moved: {engines}"
        assert all(hit > 0 for hit in hits[1:]), hits  # the history was in that engine's cache
        homes.append(engines[0])
    assert len(set(homes)) >= 2, homes  # conversations spread over the engines


def test_both_replicas_choose_the_same_engine(fleet: Fleet, tmp_path: Path) -> None:
    first, second = _fleet(fleet, tmp_path)
    sdks = [_sdk(first), _sdk(second)]
    agreed = 0
    for index in range(20):
        messages = [
            {"role": "system", "content": SYSTEMS[index % 3]},
            {"role": "user", "content": f"Request {index}"},
        ]
        one, _, _ = _turn(sdks[0], messages)
        other, _, _ = _turn(sdks[1], messages)
        agreed += one == other
    assert agreed == 20


@pytest.mark.parametrize(
    "messages",
    [
        [],
        [{"role": "user", "content": ""}],
        [{"role": "user", "content": "x" * 2_000_000}],
        [
            {
                "role": "user",
                "content": [
                    {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
                    {"type": "text", "text": "what is this?"},
                ],
            }
        ],
        [{"role": "user", "content": None}],
        [{"role": "user"}],
        "not a list",
    ],
    ids=["empty", "empty-text", "huge", "image-part", "null-content", "no-content", "string"],
)
def test_bad_prompts_never_get_a_500(fleet: Fleet, tmp_path: Path, messages: object) -> None:
    first, _ = _fleet(fleet, tmp_path)
    response = httpx.post(
        f"http://127.0.0.1:{first.ports.http}/v1/chat/completions",
        json={"model": MODEL, "messages": messages, "stream": True},
        timeout=30,
    )
    assert response.status_code < 500, response.text


def test_prefix_aware_without_derived_keys_is_warned_at_start(fleet: Fleet, tmp_path: Path) -> None:
    config = tmp_path / "lb.json"
    config.write_text(json.dumps(LB_CONFIG))
    replica = fleet.replica("--lb-config-path", str(config))
    assert "prefix-aware but --derive-affinity-key is off" in replica.process.log
    with_keys = fleet.replica("--lb-config-path", str(config), "--derive-affinity-key")
    assert "prefix-aware but" not in with_keys.process.log
