"""The speculative-decoding settings as vLLM spells them (`--speculative-config`), parsed once at
the edge: a JSON text or a mapping in, a frozen SpeculativeConfig out, or InvalidRequest naming the
field. Plain Python (the server imports it and never imports torch)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal, Mapping

from engine.types import InvalidRequest

SpecMethod = Literal["ngram", "draft_model"]
MAX_SPECULATIVE_TOKENS = 16  # each speculating sequence adds 1 + k query rows to a step
_FIELDS = ("method", "model", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min")


@dataclass(frozen=True, slots=True)
class SpeculativeConfig:
    method: SpecMethod
    num_speculative_tokens: int  # k: draft tokens proposed per sequence and step
    prompt_lookup_max: int = 4  # ngram: the longest suffix looked up in the sequence's own tokens
    prompt_lookup_min: int = 1  # ngram: the shortest
    model: str | None = None  # draft_model: the registered id of the draft (same tokenizer)

    def as_dict(self) -> dict[str, Any]:
        if self.method == "ngram":
            return {"method": "ngram", "num_speculative_tokens": self.num_speculative_tokens,
                    "prompt_lookup_max": self.prompt_lookup_max, "prompt_lookup_min": self.prompt_lookup_min}
        return {"method": "draft_model", "model": self.model, "num_speculative_tokens": self.num_speculative_tokens}


def _positive_int(raw: Mapping[str, Any], name: str, where: str, default: int | None = None, *,
                  upper: int | None = None) -> int:
    value = raw.get(name, default)
    if value is None:
        raise InvalidRequest(f"{where}.{name} is required", param=f"{where}.{name}")
    if isinstance(value, bool) or not isinstance(value, int) or value < 1 or (upper is not None and value > upper):
        bound = f"an integer in [1, {upper}]" if upper is not None else "an integer >= 1"
        raise InvalidRequest(f"{where}.{name} must be {bound}, got {value!r}", param=f"{where}.{name}")
    return value


def parse_speculative_config(value: str | Mapping[str, Any] | None, *,
                             where: str = "speculative_config") -> SpeculativeConfig | None:
    """vLLM's spelling: {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": M,
    "prompt_lookup_min": m} or {"model": "<registered id>", "num_speculative_tokens": k} (method
    "draft_model" implied, as vLLM infers it from `model`). None, "" and {} mean off. Raises
    InvalidRequest whose param names the field (`where` prefixes it: the flag or run.yaml key)."""
    if value is None or value == "":
        return None
    raw: Any = value
    if isinstance(value, str):
        try:
            raw = json.loads(value)
        except json.JSONDecodeError as exc:
            raise InvalidRequest(f"{where} is not valid JSON: {exc.msg} at character {exc.pos}", param=where) from None
    if not isinstance(raw, Mapping):
        raise InvalidRequest(f"{where} must be a JSON object, got {type(raw).__name__}", param=where)
    if not raw:
        return None
    unknown = sorted(set(raw) - set(_FIELDS))
    if unknown:
        raise InvalidRequest(f"{where} has unknown field(s) {unknown}; known: {list(_FIELDS)}", param=f"{where}.{unknown[0]}")
    method = raw.get("method", "draft_model" if raw.get("model") is not None else None)
    if method in ("draft_model", "draft") or (method is None and "model" in raw):
        model = raw.get("model")
        if not isinstance(model, str) or not model:
            raise InvalidRequest(f"{where}.model must name a registered model for draft-model speculation",
                                 param=f"{where}.model")
        k = _positive_int(raw, "num_speculative_tokens", where, upper=MAX_SPECULATIVE_TOKENS)
        return SpeculativeConfig("draft_model", k, model=model)
    if method in ("ngram", "prompt_lookup"):
        if raw.get("model") is not None:
            raise InvalidRequest(f"{where}.model has no meaning with method 'ngram'", param=f"{where}.model")
        k = _positive_int(raw, "num_speculative_tokens", where, upper=MAX_SPECULATIVE_TOKENS)
        lookup_max = _positive_int(raw, "prompt_lookup_max", where, 4, upper=64)
        lookup_min = _positive_int(raw, "prompt_lookup_min", where, 1, upper=64)
        if lookup_min > lookup_max:
            raise InvalidRequest(f"{where}.prompt_lookup_min ({lookup_min}) is above prompt_lookup_max ({lookup_max})",
                                 param=f"{where}.prompt_lookup_min")
        return SpeculativeConfig("ngram", k, prompt_lookup_max=lookup_max, prompt_lookup_min=lookup_min)
    if method is None:
        raise InvalidRequest(f"{where} needs a method ('ngram') or a draft model ('model')", param=f"{where}.method")
    raise InvalidRequest(f"{where}.method {method!r} is not supported; use 'ngram' or a draft 'model'",
                         param=f"{where}.method")
