"""What the server knows about a model before it is loaded: where it lives and how to run it."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Awaitable, Protocol

from engine.spec.config import SpeculativeConfig
from engine.types import EngineClient


@dataclass(frozen=True, slots=True)
class ModelSpec:
    model_id: str  # the name clients send as `model`
    checkpoint_dir: Path
    llama_model: str | None = None  # descriptor of the base architecture; None: model_id is one
    metadata: dict[str, Any] = field(default_factory=dict, hash=False, compare=False)
    model_parallel_size: int | None = None  # None: the server's default
    max_seq_len: int | None = None
    quantization: str | None = None
    trusted: bool = False  # named by the server's own config/env, so outside the checkpoint roots is fine
    # untrusted dirs: the roots every file must still resolve into when the loader opens it
    allowed_roots: tuple[Path, ...] = field(default=(), compare=False)
    # seconds an idle loaded model stays loaded (math.inf: always); None: the server's --keep-alive.
    # Not part of the model's identity: changing it never reloads weights.
    keep_alive_s: float | None = field(default=None, compare=False)
    # speculative decoding (engine/spec/config.py); None: the server's --speculative-config
    speculative_config: SpeculativeConfig | None = None
    # the draft model's own spec, filled in by the registry from speculative_config.model at load time
    draft: ModelSpec | None = field(default=None, compare=False)


_DURATION_PART = re.compile(r"(\d+(?:\.\d+)?)(ms|h|m|s)")
NEVER = ("never", "forever", "inf", "infinite")


def parse_keep_alive(value: str | int | float) -> float:
    """How long an idle model stays loaded, in seconds, from seconds (300), Ollama's durations ("5m",
    "1h30m", "90s") or "never" / a negative number (never unloaded); 0 unloads as soon as it is idle.
    ValueError for anything else."""
    if isinstance(value, bool):
        raise ValueError(f"expected seconds, a duration like 5m or 'never', got {value!r}")
    if isinstance(value, (int, float)):
        if math.isnan(value):
            raise ValueError("keep_alive must be a number of seconds, not NaN")
        return math.inf if value < 0 else float(value)
    text = value.strip().lower()
    if text in NEVER:
        return math.inf
    try:
        return parse_keep_alive(float(text))
    except ValueError:
        pass
    parts = _DURATION_PART.findall(text)
    if not parts or "".join(number + unit for number, unit in parts) != text:
        raise ValueError(f"expected seconds, a duration like 5m or 1h30m, or 'never', got {value!r}")
    scale = {"h": 3600.0, "m": 60.0, "s": 1.0, "ms": 0.001}
    return sum(float(number) * scale[unit] for number, unit in parts)


class EngineFactory(Protocol):
    """Builds engines for the registry; the real one loads weights, tests pass fakes."""

    def estimate_memory_bytes(self, spec: ModelSpec) -> int:
        """Bytes the model will hold once loaded (weights + KV cache), known before loading."""
        ...

    def load(self, spec: ModelSpec) -> Awaitable[EngineClient]:
        """Load off the event loop; raise engine.types.CheckpointError (or InvalidRequest) on bad input."""
        ...
