"""What the server knows about a model before it is loaded: where it lives and how to run it."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Awaitable, Protocol

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


class EngineFactory(Protocol):
    """Builds engines for the registry; the real one loads weights, tests pass fakes."""

    def estimate_memory_bytes(self, spec: ModelSpec) -> int:
        """Bytes the model will hold once loaded (weights + KV cache), known before loading."""
        ...

    def load(self, spec: ModelSpec) -> Awaitable[EngineClient]:
        """Load off the event loop; raise engine.types.CheckpointError (or InvalidRequest) on bad input."""
        ...
