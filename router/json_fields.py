"""Checks on the JSON values of request fields, shared by the OpenAI parsers (`router.openai_protocol`,
`router.tool_calls`): a value's JSON type name for error messages, and text that must be valid Unicode.

Used while a request body is parsed, before anything else sees it; a failed check is an
`InvalidRequestError` naming the field. Pure, no I/O.
"""
from __future__ import annotations

from typing import Any

from engine.errors import InvalidRequestError

_JSON_TYPES = {bool: "boolean", int: "integer", float: "number", str: "string", list: "array", dict: "object"}


def json_type(v: Any) -> str:
    """The JSON type name of a decoded value ("null", "boolean", "integer", ..., "object")."""
    return "null" if v is None else _JSON_TYPES.get(type(v), type(v).__name__)


def valid_unicode(field: str, text: str) -> str:
    """`text` if it is valid Unicode; JSON's \\uXXXX escapes can smuggle in unpaired surrogates, which no
    tokenizer or encoder takes. Raises InvalidRequestError naming `field`."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise InvalidRequestError(field, f"contains an unpaired surrogate (\\u{ord(text[exc.start]):04x}) at "
                                         f"character {exc.start}; send valid Unicode text") from None
    return text
