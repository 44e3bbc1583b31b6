"""API keys: loading them from the CLI, the environment and a file; checking what clients send."""
from __future__ import annotations

from pathlib import Path

import pytest

from router.auth import ENV_VAR, as_key_set, bearer_token, key_allowed, load_api_keys


def test_no_source_means_no_keys() -> None:
    assert load_api_keys(None, None, {}) == frozenset()
    assert load_api_keys([], None, {ENV_VAR: ""}) == frozenset()
    assert load_api_keys(None, None, {ENV_VAR: "  "}) == frozenset()


def test_all_sources_merge(tmp_path: Path) -> None:
    key_file = tmp_path / "keys"
    key_file.write_text("# team keys\n\nfile-1\n  file-2  \nsk-shared\n")
    keys = load_api_keys(["cli-1", "sk-shared"], str(key_file), {ENV_VAR: "env-1, env-2", "OTHER": "x"})
    assert keys == {"cli-1", "sk-shared", "env-1", "env-2", "file-1", "file-2"}


@pytest.mark.parametrize(("cli", "env", "source"), [
    (["ok", ""], "", "--api-key #2"),
    (["has space"], "", "--api-key #1"),
    (["tab\tkey"], "", "--api-key #1"),
    (["caf\u00e9"], "", "--api-key #1"),
    (None, "a,,b", f"{ENV_VAR} item 2"),
    (None, "a,b,", f"{ENV_VAR} item 3"),
    (None, "good,bad key", f"{ENV_VAR} item 2"),
])
def test_malformed_keys_name_their_source_without_echoing(cli: list[str] | None, env: str, source: str) -> None:
    with pytest.raises(ValueError) as info:
        load_api_keys(cli, None, {ENV_VAR: env})
    message = str(info.value)
    assert message.startswith(source + ":"), message
    for secret in (*(cli or ()), *env.split(",")):
        assert len(secret) < 2 or secret not in message, message


def test_key_file_errors(tmp_path: Path) -> None:
    missing = tmp_path / "nope"
    with pytest.raises(ValueError, match=f"--api-key-file {missing}: cannot read it"):
        load_api_keys(None, str(missing), {})
    empty = tmp_path / "empty"
    empty.write_text("# only a comment\n\n")
    with pytest.raises(ValueError, match="contains no keys"):
        load_api_keys(None, str(empty), {})
    bad = tmp_path / "bad"
    bad.write_text("fine\nnot fine\n")
    with pytest.raises(ValueError, match=f"--api-key-file {bad} line 2:") as info:
        load_api_keys(None, str(bad), {})
    assert "not fine" not in str(info.value)
    binary = tmp_path / "binary"
    binary.write_bytes(b"\xff\xfe\x00")
    with pytest.raises(ValueError, match="cannot read it"):
        load_api_keys(None, str(binary), {})


def test_key_allowed() -> None:
    keys = frozenset({"sk-one", "sk-two"})
    assert key_allowed("sk-one", keys) and key_allowed("sk-two", keys)
    for wrong in (None, "", "sk-on", "sk-one ", "SK-ONE", "sk-one\x00", "caf\u00e9", "\ud800"):
        assert not key_allowed(wrong, keys), wrong
    assert not key_allowed("sk-one", frozenset())


@pytest.mark.parametrize(("header", "token"), [
    ("Bearer sk-1", "sk-1"), ("bearer sk-1", "sk-1"), ("BEARER  sk-1 ", "sk-1"),
    (None, None), ("", None), ("Bearer ", None), ("Basic c2stMQ==", None), ("sk-1", None), ("Bearersk-1", None),
])
def test_bearer_token(header: str | None, token: str | None) -> None:
    assert bearer_token(header) == token


def test_as_key_set() -> None:
    assert as_key_set(["a", "b", "a"]) == {"a", "b"}
    assert as_key_set(frozenset()) == frozenset()
    with pytest.raises(TypeError, match="not a single string"):
        as_key_set("secret")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="item 1"):
        as_key_set([b"bytes"])  # type: ignore[list-item]
    with pytest.raises(ValueError, match="api_keys item 2"):
        as_key_set(["ok", "not ok"])
