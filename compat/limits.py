"""Bounds on what one request may ask for, checked at the edge before any work is done.

msgspec decodes `Any`-typed fields (tool parameters, JSON schemas, metadata) to whatever depth the
body has; past ~1,000 levels it raises RecursionError, and nesting short of that still reaches
Jinja templates and JSON encoders. `check_nesting` refuses it early, walking without recursion.
"""

from __future__ import annotations

from typing import Any

import msgspec

from engine.types import InvalidRequest

MAX_JSON_DEPTH = 64  # JSON schemas and tool arguments are rarely deeper than 10
MAX_STOP_CHARS = 1024  # one stop string
MAX_STOP_TOKEN_IDS = 1024
MAX_BAD_WORDS = 128  # vLLM bad_words per request (each at most MAX_STOP_CHARS)
MAX_TOKEN_ID_DIGITS = 10  # logit_bias keys: vocabularies are far below 10**10
CHARS_PER_TOKEN_LIMIT = 64  # text longer than this many chars per context token cannot fit


def too_deep(message: str = "") -> InvalidRequest:
    return InvalidRequest(f"JSON is nested too deeply (the limit is {MAX_JSON_DEPTH} levels){message}",
                          code="invalid_json")


# Values that nest nothing: a list or dict holding only these needs no walk of its items, which
# keeps 100,000-token prompts cheap (one C-level pass over their types).
_SCALAR_TYPES = frozenset({int, float, str, bool, type(None)})


def check_nesting(obj: Any, *, limit: int = MAX_JSON_DEPTH) -> None:
    """Raise InvalidRequest when dicts and lists inside `obj` nest deeper than `limit`. Every item
    is looked at: a leading scalar (`[0, [[[...]]]]`) hides nothing."""
    pending: list[tuple[Any, int]] = [(obj, 0)]
    while pending:
        node, depth = pending.pop()
        if isinstance(node, msgspec.Struct):
            pending.extend((getattr(node, name), depth) for name in node.__struct_fields__)
            continue
        if isinstance(node, dict):
            items = node.values()
        elif isinstance(node, (list, tuple)):
            items = node
        else:
            continue
        if depth >= limit:
            raise too_deep()
        if not _SCALAR_TYPES.issuperset(map(type, items)):
            pending.extend((item, depth + 1) for item in items)


def decode_json_bounded(text: str | bytes) -> Any:
    """msgspec.json.decode for client JSON inside a field (tool-call arguments): too deep is an
    InvalidRequest, as is invalid JSON (msgspec.DecodeError passes through for the caller)."""
    try:
        value = msgspec.json.decode(text)
    except RecursionError:
        raise too_deep() from None
    check_nesting(value)
    return value


def token_id_key(key: str) -> int | None:
    """A logit_bias key as a token id: ASCII digits only, at most MAX_TOKEN_ID_DIGITS of them."""
    if key.isascii() and key.isdigit() and len(key) <= MAX_TOKEN_ID_DIGITS:
        return int(key)
    return None
