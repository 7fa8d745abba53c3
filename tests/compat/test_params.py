"""compat/params.py: the one table of OpenAI parameters, the Structs it must match, the openai SDK
it must cover, the README it renders, and the behaviour of each class."""

from __future__ import annotations

import typing
from pathlib import Path

import msgspec
import pytest

from compat import params as policy
from compat import protocol as p
from compat import to_engine
from engine.types import InvalidRequest, SamplingDefaults
from tests.server.fake_engine import BOS, EOT, FakeEngine

README = Path(__file__).resolve().parents[2] / "README.md"
# Honoured rows whose Struct fields (and decoding) come with constrained decoding and tools
# (issue 14 sections 1 and 2, another branch): until that merges, these names are not fields yet.
AWAITING_CONSTRAINED_DECODING = frozenset(
    {"functions", "function_call", "structured_outputs", "guided_json", "guided_regex", "guided_choice", "guided_grammar"}
)
REQUESTS: dict[policy.Endpoint, type] = {"chat": p.ChatCompletionRequest, "completions": p.CompletionRequest}


def struct_fields(struct_type: type, prefix: str = "") -> set[str]:
    """Field names; stream_options' own fields dotted (the table classifies each of them)."""
    names = set()
    for field in msgspec.structs.fields(struct_type):
        nested = [t for t in typing.get_args(field.type) if isinstance(t, type) and issubclass(t, msgspec.Struct)]
        if field.name == "stream_options":
            names |= struct_fields(nested[0], f"{prefix}{field.name}.")
        else:
            names.add(prefix + field.name)
    return names


def sdk_fields(endpoint: policy.Endpoint) -> set[str]:
    import openai.types.chat.completion_create_params as chat
    import openai.types.completion_create_params as completions
    from openai.types.chat.chat_completion_stream_options_param import ChatCompletionStreamOptionsParam

    module = chat if endpoint == "chat" else completions
    names = set(typing.get_type_hints(module.CompletionCreateParamsBase, include_extras=False))
    names |= set(module.CompletionCreateParamsStreaming.__annotations__)  # `stream`
    names.discard("stream_options")
    return names | {f"stream_options.{name}" for name in ChatCompletionStreamOptionsParam.__annotations__}


# --------------------------------------------------------------------------- the table against the code
@pytest.mark.parametrize("endpoint", ["chat", "completions"])
def test_every_struct_field_is_classified(endpoint):
    rows = {row.name for row in policy.rows(endpoint)}
    assert struct_fields(REQUESTS[endpoint]) - rows == set()


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
def test_every_row_is_a_struct_field(endpoint):
    rows = {row.name for row in policy.rows(endpoint)}
    assert rows - struct_fields(REQUESTS[endpoint]) <= AWAITING_CONSTRAINED_DECODING


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
def test_table_covers_every_field_of_the_installed_openai_sdk(endpoint):
    rows = {row.name: row for row in policy.rows(endpoint)}
    missing = sdk_fields(endpoint) - set(rows)
    assert missing == set(), f"OpenAI fields the table does not classify: {sorted(missing)}"
    assert all(rows[name].origin == "OpenAI" for name in sdk_fields(endpoint))


def test_rows_are_unique_and_only_refused_rows_have_no_ops():
    keys = [(row.name, endpoint) for row in policy.PARAMETERS for endpoint in row.endpoints]
    assert len(keys) == len(set(keys))
    assert all(not row.no_op or row.support is policy.Support.REFUSED for row in policy.PARAMETERS)


def test_readme_table_is_generated_from_the_code():
    text = README.read_text()
    start, end = text.index(policy.TABLE_START), text.index(policy.TABLE_END) + len(policy.TABLE_END)
    assert text[start:end] == policy.markdown_table(), "regenerate it: python -m compat.params"


# --------------------------------------------------------------------------- behaviour of each class
CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
COMPLETION = {"model": "m", "prompt": "hi", "max_tokens": 4}


def chat_plan(body: dict, engine: FakeEngine | None = None):
    req = p.decode(p.CHAT_DECODER, msgspec.json.encode(body))
    return to_engine.chat_plan(req, req.messages, engine or FakeEngine(), "r")


def completion_plan(body: dict, engine: FakeEngine | None = None):
    req = p.decode(p.COMPLETION_DECODER, msgspec.json.encode(body))
    return to_engine.completion_plan(req, req.prompt, engine or FakeEngine(), "r")


NO_EFFECT_CHAT = {
    "store": True, "metadata": {"team": "evals"}, "service_tier": "flex", "user": "u-1", "safety_identifier": "h-1",
    "prompt_cache_key": "k", "prompt_cache_options": {"mode": "explicit"}, "prompt_cache_retention": "24h",
    "stream_options": {"include_obfuscation": False},
}


def test_no_effect_fields_are_accepted_and_change_nothing():
    assert {name.split(".")[0] for name in NO_EFFECT_CHAT} == {
        row.name.split(".")[0] for row in policy.rows("chat") if row.support is policy.Support.NO_EFFECT}
    plain = chat_plan(CHAT)
    assert chat_plan({**CHAT, **NO_EFFECT_CHAT}).requests[0].params == plain.requests[0].params
    assert completion_plan({**COMPLETION, "user": "u-1"}).requests[0].params == completion_plan(COMPLETION).requests[0].params


REFUSED = [
    ("chat", "audio", {"voice": "alloy", "format": "wav"}),
    ("chat", "modalities", ["text", "audio"]),
    ("chat", "prediction", {"type": "content", "content": "x"}),
    ("chat", "web_search_options", {}),
    ("chat", "reasoning_effort", "high"),
    ("chat", "verbosity", "low"),
    ("chat", "moderation", {"model": "omni-moderation-latest"}),
    ("completions", "suffix", "tail"),
    ("completions", "best_of", 3),
]


def test_refused_cases_cover_every_refused_row():
    assert {(e, name) for e, name, _ in REFUSED} == {
        (e, row.name) for e in REQUESTS for row in policy.rows(e) if row.support is policy.Support.REFUSED}


@pytest.mark.parametrize("endpoint,name,value", REFUSED)
def test_refused_fields_are_a_400_naming_them_unless_null(endpoint, name, value):
    plan, base = (chat_plan, CHAT) if endpoint == "chat" else (completion_plan, COMPLETION)
    with pytest.raises(InvalidRequest) as info:
        plan({**base, name: value})
    assert info.value.param == name and info.value.code == "unsupported_parameter" and name in str(info.value)
    plan({**base, name: None})  # null: the default, which asks for nothing


@pytest.mark.parametrize("name,value", [("modalities", ["text"]), ("reasoning_effort", "none")])
def test_refused_fields_accept_the_values_that_ask_for_nothing(name, value):
    chat_plan({**CHAT, name: value})


@pytest.mark.parametrize("body", [{**CHAT, "audio_output": True}, {**COMPLETION, "store": True}])
def test_names_that_are_no_field_of_the_endpoint_are_refused_by_name(body):
    decoder = p.CHAT_DECODER if "messages" in body else p.COMPLETION_DECODER
    with pytest.raises(InvalidRequest) as info:
        p.decode(decoder, msgspec.json.encode(body))
    name = "audio_output" if "messages" in body else "store"
    assert info.value.param == name and "Unrecognized request argument" in str(info.value)


def test_null_means_the_default():
    nulls = {"n": None, "stream": None, "logprobs": None, "ignore_eos": None, "min_tokens": None, "top_logprobs": None,
             "skip_special_tokens": None, "stream_options": {"include_usage": None}, "temperature": None}
    req = p.decode(p.CHAT_DECODER, msgspec.json.encode({**CHAT, **nulls}))
    assert (req.n, req.stream, req.logprobs, req.ignore_eos, req.min_tokens, req.skip_special_tokens) == (1, False, False, False, 0, True)
    assert req.stream_options.include_usage is False
    completion = p.decode(p.COMPLETION_DECODER, msgspec.json.encode({**COMPLETION, "max_tokens": None, "echo": None}))
    assert completion.max_tokens == 16 and completion.echo is False  # OpenAI's completions default
    assert chat_plan({**CHAT, **nulls}).requests[0].params == chat_plan(CHAT).requests[0].params


# --------------------------------------------------------------------------- sampling defaults
def test_sampling_defaults_fill_what_the_request_leaves_out():
    engine = FakeEngine()
    engine.sampling_defaults = SamplingDefaults(temperature=0.2, top_p=0.9, top_k=40, min_p=0.05, repetition_penalty=1.1)
    params = chat_plan(CHAT, engine).requests[0].params
    assert (params.temperature, params.top_p, params.top_k, params.min_p, params.repetition_penalty) == (0.2, 0.9, 40, 0.05, 1.1)
    nulls = {"temperature": None, "top_p": None, "top_k": None, "min_p": None, "repetition_penalty": None}
    assert completion_plan({**COMPLETION, **nulls}, engine).requests[0].params.temperature == 0.2
    explicit = {"temperature": 0, "top_p": 1, "top_k": -1, "min_p": 0, "repetition_penalty": 1}
    params = chat_plan({**CHAT, **explicit}, engine).requests[0].params
    assert (params.temperature, params.top_p, params.top_k, params.min_p, params.repetition_penalty) == (0, 1, 0, 0, 1)


def test_without_generation_config_the_defaults_are_openais():
    params = chat_plan(CHAT).requests[0].params
    assert (params.temperature, params.top_p, params.top_k, params.min_p, params.repetition_penalty) == (1, 1, 0, 0, 1)


# --------------------------------------------------------------------------- prompts
def test_text_parts_are_concatenated_as_they_are():
    parts = [{"type": "text", "text": "Hello"}, {"type": "text", "text": " world"}]
    split = chat_plan({**CHAT, "messages": [{"role": "user", "content": parts}]}).prompt_token_ids
    assert split == chat_plan({**CHAT, "messages": [{"role": "user", "content": "Hello world"}]}).prompt_token_ids


def test_completions_text_prompts_parse_special_tokens_chat_content_does_not():
    ids = completion_plan({**COMPLETION, "prompt": "a<|eot_id|>b"}).prompt_token_ids[0]
    assert ids == [BOS, ord("a"), EOT, ord("b")]
    chat = chat_plan({**CHAT, "messages": [{"role": "user", "content": "<|eot_id|>"}]}).prompt_token_ids
    assert EOT not in chat and b"<|eot_id|>" in bytes(i for i in chat if i < 256)


def test_a_text_prompt_that_starts_with_bos_gets_no_second_one():
    ids = completion_plan({**COMPLETION, "prompt": "<|begin_of_text|>a"}).prompt_token_ids[0]
    assert ids == [BOS, ord("a")]
