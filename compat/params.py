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

Endpoint = Literal["chat", "completions", "responses", "messages"]
CHAT: frozenset[Endpoint] = frozenset({"chat"})
COMPLETIONS: frozenset[Endpoint] = frozenset({"completions"})
BOTH: frozenset[Endpoint] = CHAT | COMPLETIONS
RESPONSES: frozenset[Endpoint] = frozenset({"responses"})  # OpenAI's Responses API (compat/responses.py)
MESSAGES: frozenset[Endpoint] = frozenset({"messages"})  # Anthropic's Messages API (compat/anthropic.py)


class Support(enum.Enum):
    HONOURED = "honoured"
    NO_EFFECT = "accepted, no effect"
    REFUSED = "refused"


@dataclass(frozen=True, slots=True)
class Param:
    name: str  # a request field; nested ones dotted ("stream_options.include_usage")
    endpoints: frozenset[Endpoint]
    support: Support
    origin: Literal["OpenAI", "vLLM", "llamaserve", "Anthropic"]
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


# The Responses and Messages APIs run on chat's path (their requests become chat requests), so
# what they honour is chat's; each has its own table, in README beside chat's.
RESPONSES_PARAMETERS: tuple[Param, ...] = (
    Param("model", RESPONSES, H, "OpenAI", "a registered model id"),
    Param("input", RESPONSES, H, "OpenAI", "text, or message (input_text, output_text), function_call and "
          "function_call_output items; input_image and input_file parts are refused by name"),
    Param("instructions", RESPONSES, H, "OpenAI", "a system message before the input (not carried to the next turn)"),
    Param("tools", RESPONSES, H, "OpenAI", "function tools (strict by default, as OpenAI); hosted tools are refused by name"),
    Param("tool_choice", RESPONSES, H, "OpenAI", "none, auto, required or a named function"),
    Param("parallel_tool_calls", RESPONSES, H, "OpenAI"),
    Param("text.format", RESPONSES, H, "OpenAI", "text, json_object, json_schema (structured outputs)"),
    Param("text.verbosity", RESPONSES, R, "OpenAI", "no verbosity control", no_op=("medium",)),
    Param("temperature", RESPONSES, H, "OpenAI", "default: generation_config.json, else 1"),
    Param("top_p", RESPONSES, H, "OpenAI", "default: generation_config.json, else 1"),
    Param("max_output_tokens", RESPONSES, H, "OpenAI", "default: the rest of the context"),
    Param("metadata", RESPONSES, H, "OpenAI", "stored and returned with the response"),
    Param("stream", RESPONSES, H, "OpenAI", "OpenAI's events, each with its sequence_number"),
    Param("stream_options.include_obfuscation", RESPONSES, N, "OpenAI", "no obfuscation field is sent"),
    Param("store", RESPONSES, H, "OpenAI", "default true: kept (per API key) for GET, input_items and "
          "previous_response_id"),
    Param("previous_response_id", RESPONSES, H, "OpenAI", "the stored conversation, then this input"),
    Param("background", RESPONSES, H, "OpenAI", "runs after the reply; poll GET, stop with cancel; not with stream"),
    Param("priority", RESPONSES, H, "vLLM", "as on chat: lower is sooner among online requests"),
    Param("include", RESPONSES, N, "OpenAI", "the outputs it names never occur here (no reasoning, images or "
          "hosted tools); message.output_text.logprobs is refused"),
    Param("user", RESPONSES, N, "OpenAI", "no per-user accounting"),
    Param("service_tier", RESPONSES, N, "OpenAI", "one tier"),
    Param("safety_identifier", RESPONSES, N, "OpenAI", "no usage-policy monitoring"),
    Param("prompt_cache_key", RESPONSES, N, "OpenAI", "the prefix cache is automatic and shared"),
    Param("prompt_cache_options", RESPONSES, N, "OpenAI", "the prefix cache is automatic and shared"),
    Param("prompt_cache_retention", RESPONSES, N, "OpenAI", "the prefix cache keeps blocks until memory is needed"),
    Param("truncation", RESPONSES, R, "OpenAI", "input is never cut: too long is a 400", no_op=("disabled",)),
    Param("reasoning", RESPONSES, R, "OpenAI", "the model does not reason", no_op=({},)),
    Param("top_logprobs", RESPONSES, R, "OpenAI", "no logprobs in Responses output", no_op=(0,)),
    Param("max_tool_calls", RESPONSES, R, "OpenAI", "no hosted tools; parallel_tool_calls false allows one call"),
    Param("conversation", RESPONSES, R, "OpenAI", "no Conversations API; use previous_response_id"),
    Param("prompt", RESPONSES, R, "OpenAI", "no stored prompt templates"),
    Param("context_management", RESPONSES, R, "OpenAI", "no server-side compaction"),
    Param("moderation", RESPONSES, R, "OpenAI", "no moderation model"),
    Param("image", RESPONSES, R, "OpenAI", "no image output"),
    Param("access_programs", RESPONSES, R, "OpenAI", "no access programs"),
    Param("background_options", RESPONSES, R, "OpenAI", "background responses take no options here"),
)
MESSAGES_PARAMETERS: tuple[Param, ...] = (
    Param("model", MESSAGES, H, "Anthropic", "a registered model id"),
    Param("messages", MESSAGES, H, "Anthropic", "text, tool_use and tool_result blocks; image and document blocks "
          "are refused by name, and so is a final assistant message (prefill)"),
    Param("system", MESSAGES, H, "Anthropic", "a string or text blocks"),
    Param("max_tokens", MESSAGES, H, "Anthropic", "required"),
    Param("temperature", MESSAGES, H, "Anthropic", "0 to 1; default: generation_config.json, else 1"),
    Param("top_p", MESSAGES, H, "Anthropic"),
    Param("top_k", MESSAGES, H, "Anthropic"),
    Param("stop_sequences", MESSAGES, H, "Anthropic", "at most 16; stop_reason stop_sequence names the one met"),
    Param("stream", MESSAGES, H, "Anthropic", "Anthropic's events, with ping"),
    Param("tools", MESSAGES, H, "Anthropic", "custom tools (name, description, input_schema)"),
    Param("tool_choice", MESSAGES, H, "Anthropic", "auto, any, tool, none; disable_parallel_tool_use"),
    Param("metadata", MESSAGES, N, "Anthropic", "no per-user accounting"),
    Param("service_tier", MESSAGES, N, "Anthropic", "one tier"),
    Param("cache_control", MESSAGES, N, "Anthropic", "the prefix cache is automatic and shared"),
    Param("inference_geo", MESSAGES, N, "Anthropic", "one place"),
    Param("speed", MESSAGES, N, "Anthropic", "one speed"),
    Param("diagnostics", MESSAGES, N, "Anthropic", "no diagnostics are returned"),
    Param("user_profile_id", MESSAGES, N, "Anthropic", "no per-user accounting"),
    Param("workspace_id", MESSAGES, N, "Anthropic", "no workspaces"),
    Param("thinking", MESSAGES, R, "Anthropic", "the model does not reason", no_op=({"type": "disabled"},)),
    Param("output_config", MESSAGES, R, "Anthropic", "no effort control or output formats", no_op=({},)),
    Param("container", MESSAGES, R, "Anthropic", "no code-execution containers"),
    Param("mcp_servers", MESSAGES, R, "Anthropic", "no MCP connector", no_op=([],)),
    Param("context_management", MESSAGES, R, "Anthropic", "no server-side context editing"),
)
_ALL: tuple[Param, ...] = PARAMETERS + RESPONSES_PARAMETERS + MESSAGES_PARAMETERS


def rows(endpoint: Endpoint) -> tuple[Param, ...]:
    return tuple(row for row in _ALL if endpoint in row.endpoints)


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
RESPONSES_TABLE = ("<!-- responses-compat-table:start -->", "<!-- responses-compat-table:end -->")
MESSAGES_TABLE = ("<!-- messages-compat-table:start -->", "<!-- messages-compat-table:end -->")
_ENDPOINT_NAMES = {BOTH: "both", CHAT: "chat", COMPLETIONS: "completions", RESPONSES: "responses",
                   MESSAGES: "messages"}


def markdown_table(table: tuple[Param, ...] = PARAMETERS, markers: tuple[str, str] = (TABLE_START, TABLE_END)) -> str:
    """A README compatibility table, between its markers (a test checks README holds exactly this)."""
    lines = [
        markers[0],
        "| parameter | endpoint | from | class | note |",
        "|---|---|---|---|---|",
        *(f"| `{row.name}` | {_ENDPOINT_NAMES[row.endpoints]} | {row.origin} | {row.support.value} | {row.note} |"
          for row in table),
        markers[1],
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    print(markdown_table())
    print()
    print(markdown_table(RESPONSES_PARAMETERS, RESPONSES_TABLE))
    print()
    print(markdown_table(MESSAGES_PARAMETERS, MESSAGES_TABLE))
