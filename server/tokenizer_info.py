"""What eval harnesses ask of a vLLM-style server beside completions: `GET /tokenizer_info`, and
`/tokenize` / `/detokenize` without a `model` (vLLM serves one model, so clients leave it out).

lm-eval's `tokenizer_backend=remote` reads `/tokenizer_info` for the eos/bos/pad spellings (it
finds their ids by tokenizing the spellings) and the chat template; vLLM's body is the tokenizer's
settings plus `tokenizer_class` and `chat_template`, and we add the ids so no round trip is needed.
"""

from __future__ import annotations

from typing import Any

from aiohttp import web

from engine.types import EngineClient
from server.errors import ApiError
from server.registry import REGISTRY_KEY


def model_or_only(request: web.Request, model: str | None) -> str:
    """`model` as given, or the one registered model when it is left out; with several, a 400."""
    if model is not None:
        return model
    ids = [info.id for info in request.app[REGISTRY_KEY].list()]
    if len(ids) == 1:
        return ids[0]
    raise ApiError(
        400, f"'model' is required: {len(ids)} models are registered ({', '.join(ids) or 'none'})",
        param="model", code="missing_required_parameter",
    )


def tokenizer_info_body(engine: EngineClient) -> dict[str, Any]:
    """vLLM's /tokenizer_info shape for one loaded model."""
    tokenizer = engine.tokenizer
    bos_id, eos_id = tokenizer.bos_id, tokenizer.eos_id
    body: dict[str, Any] = {
        "tokenizer_class": type(tokenizer).__name__,
        "bos_token": _spelling(tokenizer, bos_id),
        "eos_token": _spelling(tokenizer, eos_id),
        "pad_token": None,  # none of our tokenizers pads: requests are never padded
        "bos_token_id": bos_id,
        "eos_token_id": eos_id,
        "pad_token_id": None,
        "add_bos_token": bos_id is not None,
        "model_max_length": engine.max_seq_len,
        "vocab_size": tokenizer.vocab_size,
    }
    # Only checkpoints with a Jinja template have one to give; the Llama formats are built in code.
    template = getattr(engine.chat_format, "template_text", None)
    if template:
        body["chat_template"] = template
    return body


def _spelling(tokenizer: Any, token_id: int | None) -> str | None:
    return None if token_id is None else tokenizer.token_bytes(token_id).decode("utf-8", errors="replace")
