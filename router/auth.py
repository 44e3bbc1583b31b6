"""Optional API keys for the HTTP and gRPC servers: loading them, and checking what a client sent.

Keys come from up to three sources, all merged: `--api-key KEY` (repeatable), the environment
variable `PDSERVE_API_KEYS` (comma-separated) and `--api-key-file PATH` (one key per line; blank
lines and lines starting with `#` are skipped). No key anywhere: the servers require none.

A key must be printable ASCII without whitespace (it travels in an HTTP header and in gRPC
metadata). Errors name the source (and the item or line) but never echo a key; keys are never
logged. Clients send `Authorization: Bearer <key>` (HTTP and gRPC) or `x-api-key: <key>` (gRPC).
"""
from __future__ import annotations

import hmac
from collections.abc import Iterable, Mapping
from pathlib import Path

ENV_VAR = "PDSERVE_API_KEYS"
_BEARER = "bearer "


def load_api_keys(cli_keys: list[str] | None, key_file: str | None, env: Mapping[str, str]) -> frozenset[str]:
    """Merge the API keys of every source.

    Args:
        cli_keys: the `--api-key` values (None or [] when not given).
        key_file: the `--api-key-file` path, or None.
        env: the environment (`os.environ`); `PDSERVE_API_KEYS` is read from it, empty means unset.
    Returns:
        every key given; empty when no source gave any (the servers then require none).
    Raises:
        ValueError naming the source of an empty or malformed key, an unreadable file, or a file
        without keys.
    """
    keys: set[str] = set()
    for i, key in enumerate(cli_keys or (), start=1):
        keys.add(_valid(key, f"--api-key #{i}"))
    raw_env = env.get(ENV_VAR, "")
    if raw_env.strip():
        for i, item in enumerate(raw_env.split(","), start=1):
            keys.add(_valid(item.strip(), f"{ENV_VAR} item {i}"))
    if key_file is not None:
        keys |= _read_key_file(key_file)
    return frozenset(keys)


def _read_key_file(path: str) -> set[str]:
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"--api-key-file {path}: cannot read it: {type(exc).__name__}: "
                         f"{getattr(exc, 'strerror', None) or 'not UTF-8 text'}") from None
    keys = set()
    for n, line in enumerate(text.splitlines(), start=1):
        line = line.strip()
        if line and not line.startswith("#"):
            keys.add(_valid(line, f"--api-key-file {path} line {n}"))
    if not keys:
        raise ValueError(f"--api-key-file {path}: contains no keys (one key per line; '#' starts a comment "
                         "line); leave the option out to serve without keys")
    return keys


def _valid(key: str, source: str) -> str:
    if not key:
        raise ValueError(f"{source}: the API key is empty")
    if not all("!" <= c <= "~" for c in key):  # printable ASCII without space: header- and metadata-safe
        raise ValueError(f"{source}: an API key must be printable ASCII without whitespace "
                         f"(letters, digits, punctuation); this one is not (not shown)")
    return key


def key_allowed(presented: str | None, keys: Iterable[str]) -> bool:
    """True when `presented` equals one of `keys`. Constant-time per key (hmac.compare_digest), and
    every key is compared, so the timing tells nothing about which key or how much of it matched."""
    if presented is None:
        return False
    given = presented.encode("utf-8", "surrogatepass")
    found = False
    for key in keys:
        found |= hmac.compare_digest(given, key.encode())
    return found


def bearer_token(authorization: str | None) -> str | None:
    """The token of an `Authorization: Bearer <token>` value (scheme case-insensitive), else None."""
    if authorization is None or authorization[:len(_BEARER)].lower() != _BEARER:
        return None
    return authorization[len(_BEARER):].strip() or None


def as_key_set(keys: Iterable[str]) -> frozenset[str]:
    """The servers' `api_keys` argument, checked: a collection of valid keys (a bare string is refused:
    it would otherwise become a set of one-character keys). Raises: TypeError, ValueError."""
    if isinstance(keys, (str, bytes)):
        raise TypeError("api_keys must be a collection of keys, not a single string")
    checked = set()
    for i, key in enumerate(keys, start=1):
        if not isinstance(key, str):
            raise TypeError(f"api_keys item {i}: an API key must be a str, got {type(key).__name__}")
        checked.add(_valid(key, f"api_keys item {i}"))
    return frozenset(checked)
