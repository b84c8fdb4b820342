"""Fixtures of the mock engine's unit tests."""

from __future__ import annotations

import pytest

from stargate.mock import cli
from stargate.mock.app import MockBackendConfig


@pytest.fixture
def served(monkeypatch: pytest.MonkeyPatch) -> list[MockBackendConfig]:
    """The configs `stargate mock-backend` would serve; nothing binds and logging is left alone."""
    configs: list[MockBackendConfig] = []

    async def serve(config: MockBackendConfig) -> int:
        configs.append(config)
        return 0

    monkeypatch.setattr(cli, "_serve_until_signalled", serve)
    monkeypatch.setattr(cli, "configure_logging", lambda *args: None)
    return configs
