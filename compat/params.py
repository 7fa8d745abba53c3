"""Which request parameters this server honours, accepts without effect, or refuses: one table.

Every field of OpenAI's Chat Completions and Completions requests (and of the vLLM extensions we
serve) is one row of `PARAMETERS`, in one of three classes:
- honoured: it changes what the server does, as OpenAI (or vLLM) documents;
- accepted, no effect: a self-hosted server has nothing for it to act on (`store`: nothing is
  stored; `service_tier`: there is one tier), so it is accepted and ignored, as a client expects;
- refused: we cannot do what it asks (audio output, predicted outputs, web search, reasoning), so
  any value but null (and the row's `no_op` values, which ask for nothing) is a 400 naming it.
Names that are in no row are not fields of the protocol Structs, so msgspec refuses them by name.

The same table renders README's compatibility table (`markdown_table`, `python -m compat.params`);
tests check that it matches the Structs and covers every field of the installed openai SDK.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any, Literal

from msgspec import UNSET

from engine.types import InvalidRequest

Endpoint = Literal["chat", "completions"]
CHAT: frozenset[Endpoint] = frozenset({"chat"})
COMPLETIONS: frozenset[Endpoint] = frozenset({"completions"})
BOTH: frozenset[Endpoint] = CHAT | COMPLETIONS


class Support(enum.Enum):
    HONOURED = "honoured"
    NO_EFFECT = "accepted, no effect"
    REFUSED = "refused"


@dataclass(frozen=True, slots=True)
class Param:
    name: str  # a request field; nested ones dotted ("stream_options.include_usage")
    endpoints: frozenset[Endpoint]
    support: Support
    origin: Literal["OpenAI", "vLLM", "llamaserve"]
    note: str = ""
    no_op: tuple[Any, ...] = ()  # REFUSED only: values that ask for nothing we lack, accepted


H, N, R = Support.HONOURED, Support.NO_EFFECT, Support.REFUSED

PARAMETERS: tuple[Param, ...] = (
    # ---- the request itself
    Param("model", BOTH, H, "OpenAI", "a registered model id"),
    Param("messages", CHAT, H, "OpenAI", "text, and image_url parts in user messages for models that take images (see Images); audio and file parts are refused by name"),
    Param("prompt", COMPLETIONS, H, "OpenAI", "text, texts, token ids or lists of token ids; special-token "
          "spellings in text are parsed as the model's special tokens"),
    Param("stream", BOTH, H, "OpenAI"),
    Param("stream_options.include_usage", BOTH, H, "OpenAI"),
    Param("stream_options.include_obfuscation", BOTH, N, "OpenAI", "no obfuscation field is sent"),
    # ---- sampling
    Param("temperature", BOTH, H, "OpenAI", "default: generation_config.json, else 1"),
    Param("top_p", BOTH, H, "OpenAI", "default: generation_config.json, else 1"),
    Param("n", BOTH, H, "OpenAI"),
    Param("seed", BOTH, H, "OpenAI", "same seed, same tokens, whatever else is batched"),
    Param("stop", BOTH, H, "OpenAI"),
    Param("max_tokens", BOTH, H, "OpenAI", "chat: default the rest of the context; completions: 16"),
    Param("max_completion_tokens", CHAT, H, "OpenAI"),
    Param("presence_penalty", BOTH, H, "OpenAI"),
    Param("frequency_penalty", BOTH, H, "OpenAI"),
    Param("logit_bias", BOTH, H, "OpenAI", "keys are token ids"),
    Param("logprobs", BOTH, H, "OpenAI", "completions: up to k+1 alternatives, the sampled token included"),
    Param("top_logprobs", CHAT, H, "OpenAI"),
    Param("echo", COMPLETIONS, H, "OpenAI", "with logprobs and max_tokens 0: scores the prompt"),
    # ---- tools and constrained decoding
    Param("tools", CHAT, H, "OpenAI"),
    Param("tool_choice", CHAT, H, "OpenAI"),
    Param("parallel_tool_calls", CHAT, H, "OpenAI"),
    Param("functions", CHAT, H, "OpenAI", "deprecated; mapped onto tools"),
    Param("function_call", CHAT, H, "OpenAI", "deprecated; mapped onto tool_choice"),
    Param("response_format", CHAT, H, "OpenAI"),
    # ---- accepted without effect: nothing on a self-hosted server for them to act on
    Param("user", BOTH, N, "OpenAI", "no per-user accounting"),
    Param("store", CHAT, N, "OpenAI", "nothing is stored"),
    Param("metadata", CHAT, N, "OpenAI", "nothing is stored"),
    Param("service_tier", CHAT, N, "OpenAI", "one tier; the response does not echo it"),
    Param("safety_identifier", CHAT, N, "OpenAI", "no usage-policy monitoring"),
    Param("prompt_cache_key", CHAT, N, "OpenAI", "the prefix cache is automatic and shared"),
    Param("prompt_cache_options", CHAT, N, "OpenAI", "the prefix cache is automatic and shared"),
    Param("prompt_cache_retention", CHAT, N, "OpenAI", "the prefix cache keeps blocks until memory is needed"),
    # ---- refused: things we cannot do
    Param("modalities", CHAT, R, "OpenAI", "text output only", no_op=(["text"],)),
    Param("audio", CHAT, R, "OpenAI", "no audio output"),
    Param("prediction", CHAT, R, "OpenAI", "no predicted outputs"),
    Param("web_search_options", CHAT, R, "OpenAI", "no web search"),
    Param("reasoning_effort", CHAT, R, "OpenAI", "the model does not reason", no_op=("none",)),
    Param("verbosity", CHAT, R, "OpenAI", "no verbosity control"),
    Param("moderation", CHAT, R, "OpenAI", "no moderation model"),
    Param("suffix", COMPLETIONS, R, "OpenAI", "no fill-in-the-middle", no_op=("",)),
    Param("best_of", COMPLETIONS, R, "OpenAI", "only 1", no_op=(1,)),
    # ---- vLLM extensions
    Param("top_k", BOTH, H, "vLLM", "-1 or 0 disable; default: generation_config.json"),
    Param("min_p", BOTH, H, "vLLM", "default: generation_config.json, else 0"),
    Param("repetition_penalty", BOTH, H, "vLLM", "default: generation_config.json, else 1"),
    Param("ignore_eos", BOTH, H, "vLLM"),
    Param("stop_token_ids", BOTH, H, "vLLM"),
    Param("min_tokens", BOTH, H, "vLLM"),
    Param("skip_special_tokens", BOTH, H, "vLLM"),
    Param("priority", BOTH, H, "vLLM", "lower is sooner, among online requests (Batch API items: among them)"),
    Param("bad_words", BOTH, H, "vLLM", "never generated, each as tokenized with and without a leading space"),
    Param("allowed_token_ids", BOTH, H, "vLLM", "only these tokens are sampled"),
    Param("add_generation_prompt", CHAT, H, "vLLM", "false: the prompt ends after the last message"),
    Param("continue_final_message", CHAT, H, "vLLM", "the last (assistant) message is continued, left open; "
          "needs add_generation_prompt false"),
    Param("chat_template_kwargs", CHAT, H, "vLLM", "extra variables for a Jinja chat template; no effect on the "
          "built-in Llama formats"),
    Param("echo", CHAT, H, "vLLM", "the reply starts with the last message's content when it is the assistant's"),
    Param("prompt_logprobs", COMPLETIONS, H, "vLLM"),
    Param("structured_outputs", BOTH, H, "vLLM", "json, regex, choice, grammar"),
    Param("guided_json", BOTH, H, "vLLM", "older spelling of structured_outputs.json"),
    Param("guided_regex", BOTH, H, "vLLM", "older spelling of structured_outputs.regex"),
    Param("guided_choice", BOTH, H, "vLLM", "older spelling of structured_outputs.choice"),
    Param("guided_grammar", BOTH, H, "vLLM", "older spelling of structured_outputs.grammar"),
)


def rows(endpoint: Endpoint) -> tuple[Param, ...]:
    return tuple(row for row in PARAMETERS if endpoint in row.endpoints)


def check_request(request: object, endpoint: Endpoint) -> None:
    """400 for a refused parameter set to anything but null or a no-op value, naming it."""
    for row in rows(endpoint):
        if row.support is not Support.REFUSED:
            continue
        value = _field(request, row.name)
        if value is None or value is UNSET or value in row.no_op:
            continue
        raise InvalidRequest(
            f"Unsupported parameter: '{row.name}' is not supported by this server ({row.note})",
            param=row.name, code="unsupported_parameter",
        )


def _field(request: object, dotted: str) -> object:
    value = request
    for part in dotted.split("."):
        value = getattr(value, part, UNSET)
        if value is None or value is UNSET:
            return value
    return value


# --------------------------------------------------------------------------- README
TABLE_START = "<!-- openai-compat-table:start -->"
TABLE_END = "<!-- openai-compat-table:end -->"
_ENDPOINT_NAMES = {BOTH: "both", CHAT: "chat", COMPLETIONS: "completions"}


def markdown_table() -> str:
    """README's compatibility table, between its markers (a test checks README holds exactly this)."""
    lines = [
        TABLE_START,
        "| parameter | endpoint | from | class | note |",
        "|---|---|---|---|---|",
        *(f"| `{row.name}` | {_ENDPOINT_NAMES[row.endpoints]} | {row.origin} | {row.support.value} | {row.note} |"
          for row in PARAMETERS),
        TABLE_END,
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    print(markdown_table())
