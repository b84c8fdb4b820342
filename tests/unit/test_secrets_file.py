"""The secrets file (stargate/secrets_file.py): key paths, errors that never show a value, and
re-reading a file Kubernetes rotates by swapping a symlink, keeping the last good value when a
rotation is caught half-written."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import pytest

from stargate.secrets_file import SecretsFile, SecretsFileError, tracing_access_token
from tests.fakes.logs import captured_logs

SECRET = "sk-live-8c1f0e6b2a9d4e77"


def _write(path: Path, document: object) -> Path:
    path.write_text(json.dumps(document))
    return path


def _rotate(mount: Path, name: str, content: str) -> None:
    """What the kubelet does: write a new timestamped directory, then swap the `..data` symlink
    the file's own symlink goes through."""
    version = mount / f"..{name}"
    version.mkdir()
    (version / "secrets.json").write_text(content)
    link = mount / "..data_tmp"
    link.symlink_to(version.name)
    os.replace(link, mount / "..data")


def _mount(tmp_path: Path, content: str) -> Path:
    """A Secret volume as the kubelet lays it out; returns the path the replica is given."""
    mount = tmp_path / "secrets"
    mount.mkdir()
    _rotate(mount, "v1", content)
    (mount / "secrets.json").symlink_to("..data/secrets.json")
    return mount / "secrets.json"


def test_a_nested_key_path_is_read_and_trimmed(tmp_path: Path) -> None:
    path = _write(tmp_path / "s.json", {"nvcf": {"apiToken": f"  {SECRET}\n"}, "authToken": "x"})
    secrets = SecretsFile(path)
    assert secrets.string(("nvcf", "apiToken")) == SECRET
    assert secrets.string(("authToken",)) == "x"


@pytest.mark.parametrize(
    ("content", "keys", "expected"),
    [
        ("{not json", ("authToken",), "is not valid JSON: Expecting property name"),
        (f'["{SECRET}"]', ("authToken",), "must hold a JSON object, not an array"),
        (json.dumps({"other": SECRET}), ("authToken",), "has no key authToken"),
        (json.dumps({"nvcf": {"other": SECRET}}), ("nvcf", "apiToken"), "no key nvcf.apiToken"),
        (json.dumps({"nvcf": SECRET}), ("nvcf", "apiToken"), "nvcf must be a JSON object"),
        (
            json.dumps({"authToken": 735190426}),
            ("authToken",),
            "authToken must be a string, not a n",
        ),
        (json.dumps({"authToken": [SECRET]}), ("authToken",), "must be a string, not an array"),
        (json.dumps({"authToken": "   "}), ("authToken",), "authToken is empty"),
        (b"\xff\xfe" + SECRET.encode(), ("authToken",), "is not UTF-8 text"),
    ],
)
def test_errors_name_the_file_and_the_key_never_the_value(
    tmp_path: Path, content: str | bytes, keys: tuple[str, ...], expected: str
) -> None:
    path = tmp_path / "secrets.json"
    if isinstance(content, bytes):
        path.write_bytes(content)
    else:
        path.write_text(content)
    with pytest.raises(SecretsFileError) as caught:
        SecretsFile(path).string(keys)
    message = str(caught.value)
    assert expected in message
    assert str(path) in message
    assert SECRET not in message
    assert "735190426" not in message


def test_a_missing_file_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(SecretsFileError, match=r"cannot read secrets file .*gone\.json"):
        SecretsFile(tmp_path / "gone.json").string(("authToken",))


def test_a_rotation_by_symlink_swap_is_seen_on_the_next_use(tmp_path: Path) -> None:
    path = _mount(tmp_path, json.dumps({"authToken": "first"}))
    secrets = SecretsFile(path)
    assert secrets.string(("authToken",)) == "first"
    _rotate(path.parent, "v2", json.dumps({"authToken": "second"}))
    assert secrets.string(("authToken",)) == "second"


def test_an_in_place_rewrite_of_a_plain_file_is_seen(tmp_path: Path) -> None:
    path = _write(tmp_path / "s.json", {"authToken": "first"})
    secrets = SecretsFile(path)
    assert secrets.string(("authToken",)) == "first"
    _write(path, {"authToken": "second-longer"})
    assert secrets.string(("authToken",)) == "second-longer"


def test_an_unchanged_file_is_not_read_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = _write(tmp_path / "s.json", {"authToken": "first"})
    secrets = SecretsFile(path)
    assert secrets.string(("authToken",)) == "first"
    reads: list[Path] = []
    original = Path.read_bytes

    def counting(self: Path) -> bytes:
        reads.append(self)
        return original(self)

    monkeypatch.setattr(Path, "read_bytes", counting)
    for _ in range(3):
        assert secrets.string(("authToken",)) == "first"
    assert reads == []


def test_a_half_written_rotation_keeps_the_last_good_value_and_warns_once(
    tmp_path: Path,
) -> None:
    path = _mount(tmp_path, json.dumps({"authToken": "good"}))
    secrets = SecretsFile(path)
    assert secrets.string(("authToken",)) == "good"
    with captured_logs("debug") as logs:
        _rotate(path.parent, "v2", '{"authToken": "' + SECRET[:9])  # cut short
        assert secrets.string(("authToken",)) == "good"
        assert secrets.string(("authToken",)) == "good"
        _rotate(path.parent, "v3", json.dumps({"renamed": SECRET}))  # the key went missing
        assert secrets.string(("authToken",)) == "good"
    output = logs.getvalue()
    assert output.count("WARNING") == 2, output  # once per bad version, not once per use
    assert "keeping the last good value" in output
    assert "is not valid JSON" in output and "has no key authToken" in output
    assert SECRET[:9] not in output
    assert SECRET not in output
    _rotate(path.parent, "v4", json.dumps({"authToken": "fixed"}))
    assert secrets.string(("authToken",)) == "fixed"


def test_without_a_good_value_before_a_bad_file_is_an_error(tmp_path: Path) -> None:
    path = _write(tmp_path / "s.json", {"authToken": "good"})
    secrets = SecretsFile(path)
    path.write_text("{")
    with pytest.raises(SecretsFileError):
        secrets.string(("authToken",))  # the first read of this key: nothing to fall back on


def test_tracing_access_token_is_optional_trimmed_and_typed(tmp_path: Path) -> None:
    path = tmp_path / "s.json"
    _write(path, {"tracingAccessToken": f" {SECRET} "})
    assert tracing_access_token(path) == SECRET
    _write(path, {"authToken": "x"})
    assert tracing_access_token(path) is None
    _write(path, {"tracingAccessToken": "  "})
    assert tracing_access_token(SecretsFile(path)) is None
    _write(path, {"tracingAccessToken": 7})
    with pytest.raises(SecretsFileError, match="tracingAccessToken must be a string"):
        tracing_access_token(path)
    path.write_text("nope")
    with pytest.raises(SecretsFileError, match="not valid JSON"):
        tracing_access_token(path)


def test_nothing_from_the_file_is_logged_at_debug(tmp_path: Path) -> None:
    path = _mount(tmp_path, json.dumps({"authToken": SECRET, "tracingAccessToken": SECRET}))
    with captured_logs("debug") as logs:
        logging.getLogger("stargate").debug("debug logging is on")
        secrets = SecretsFile(path)
        secrets.string(("authToken",))
        tracing_access_token(secrets)
        _rotate(path.parent, "v2", "{" + SECRET)
        secrets.string(("authToken",))
        repr(secrets)
    output = logs.getvalue()
    assert "debug logging is on" in output
    assert SECRET not in output
