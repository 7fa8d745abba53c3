"""The weights a model is built from, once prepared by its backend (Backend.prepare)."""

from __future__ import annotations

from collections.abc import Mapping

from engine.types import CheckpointError


class PreparedWeights:
    """The prepared weights by state-dict name, each taken by the module that owns it as the model
    is built; a missing one, or one left over once it is built, is a CheckpointError."""

    def __init__(self, weights: Mapping[str, object], source: str) -> None:
        self._weights, self._source = dict(weights), source

    def take(self, name: str):
        if name not in self._weights:
            raise CheckpointError(f"{self._source}: missing weight {name!r}")
        return self._weights.pop(name)

    def take_prefixed(self, prefix: str) -> dict[str, object]:
        """Every weight whose name starts with `prefix` (a sub-model whose sizes its weights give)."""
        return {name: self._weights.pop(name) for name in [n for n in self._weights if n.startswith(prefix)]}

    def check_all_taken(self) -> None:
        if self._weights:
            raise CheckpointError(f"{self._source}: unexpected weights {sorted(self._weights)[:5]}")
