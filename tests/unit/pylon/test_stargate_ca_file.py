"""`stargate pylon --stargate-ca-file` (docs/tls.md, "The Pylon"): checked at start-up, and with
it every channel to a replica is TLS, whatever its address says."""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest
import trustme
from click.testing import CliRunner

from stargate.pylon import sidecar
from stargate.pylon.cli import pylon_command
from stargate.pylon.config import DialTarget


def _invoke(*args: str, env: dict[str, str] | None = None) -> tuple[int, str]:
    result = CliRunner().invoke(
        pylon_command, ["--upstream", "http://127.0.0.1:9", *args], env=env or {}
    )
    return result.exit_code, result.output


@pytest.mark.parametrize(
    ("content", "problem"), [(None, "No such file"), (b"not pem", "no PEM CA certificate")]
)
def test_an_unusable_ca_file_is_a_usage_error_naming_the_flag(
    tmp_path: Path, content: bytes | None, problem: str
) -> None:
    path = tmp_path / "ca.pem"
    if content is not None:
        path.write_bytes(content)
    code, output = _invoke(f"--stargate-ca-file={path}")
    assert code == 2
    assert "--stargate-ca-file" in output and problem in output
    code, output = _invoke(env={"STARGATE_PYLON_STARGATE_CA_FILE": str(path)})
    assert code == 2 and "--stargate-ca-file" in output


def test_with_the_ca_file_every_replica_is_dialled_over_tls(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "ca.pem"
    trustme.CA().cert_pem.write_to_path(str(path))
    dialled: list[tuple[str, str]] = []

    def secure_channel(target: str, credentials: object, options: object) -> str:
        dialled.append(("tls", target))
        return "channel"

    def insecure_channel(target: str, options: object) -> str:
        dialled.append(("plain", target))
        return "channel"

    monkeypatch.setattr(grpc, "secure_channel", secure_channel)
    monkeypatch.setattr(grpc, "insecure_channel", insecure_channel)
    credentials = sidecar.stargate_credentials(path)
    assert credentials is not None
    sidecar._channel(DialTarget("10.0.0.1:50071"), "10.0.0.1:50071", credentials)
    sidecar._channel(DialTarget("10.0.0.2:50071"))  # without the flag: plaintext, as before
    assert dialled == [("tls", "10.0.0.1:50071"), ("plain", "10.0.0.2:50071")]
    assert sidecar.stargate_credentials(None) is None
