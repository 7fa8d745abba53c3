"""A checkpoint's small JSON files (tokenizer_config.json, generation_config.json, ...) read into
a dict once, at the edge: a file that is there but unreadable, not JSON or not an object is a
CheckpointError naming it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from engine.types import CheckpointError


def read_json_object(path: Path) -> dict[str, Any] | None:
    """The JSON object in `path`; None when there is no such file."""
    if not path.exists():
        return None
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{path}: not readable JSON: {exc}") from None
    if not isinstance(value, dict):
        raise CheckpointError(f"{path}: expected a JSON object")
    return value
