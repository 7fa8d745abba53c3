"""compat/ as pure functions: decoding and params, request -> EngineRequests, outputs -> OpenAI JSON."""

from __future__ import annotations

import msgspec
import pytest

from compat import protocol as p
from compat import to_engine
from compat.from_engine import ChatAssembler, CompletionAssembler, GenerationFailed, token_text
from engine.types import ContextLengthExceeded, InvalidRequest, RequestOutput, TokenLogprob, ToolCall, check_context_length
from tests.server.fake_engine import BOS, EOT, FakeEngine, FakeTokenizer, ParsedDelta, ParsedOutput


def chat(**fields) -> p.ChatCompletionRequest:
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], **fields}
    return p.decode(p.CHAT_DECODER, msgspec.json.encode(body))


def decode_error(decoder, body: dict) -> InvalidRequest:
    with pytest.raises(InvalidRequest) as info:
        p.decode(decoder, msgspec.json.encode(body))
    return info.value


# --------------------------------------------------------------------------- protocol
@pytest.mark.parametrize("message,expected", [
    ("Expected `int`, got `str` - at `$.n`", ("Expected `int`, got `str` - at `$.n`", "n")),
    ("Object contains unknown field `foo`", ("Unrecognized request argument supplied: foo", "foo")),
    ("Object contains unknown field `x` - at `$.messages[1]`",
     ("Unrecognized request argument supplied: messages[1].x", "messages[1].x")),
    ("Object missing required field `model`", ("Missing required parameter: 'model'", "model")),
    ("Expected `object`, got `array`", ("Expected `object`, got `array`", None)),
])
def test_validation_param(message, expected):
    assert p.validation_param(message) == expected


def test_decoders_bound_and_tag():
    assert decode_error(p.CHAT_DECODER, {"model": "m", "messages": [{"role": "user", "content": "x"}],
                                         "top_logprobs": 21}).param == "top_logprobs"
    assert decode_error(p.CHAT_DECODER, {"model": "m", "messages": [
        {"role": "user", "content": [{"type": "video", "video": 1}]}]}).param == "messages[0].content[0].type"
    assert decode_error(p.COMPLETION_DECODER, {"model": "m", "prompt": []}).param == "prompt"
    assert decode_error(p.COMPLETION_DECODER, {"model": "m", "prompt": [-1]}).param == "prompt[0]"
    assert decode_error(p.CHAT_DECODER, {"model": 1}).code == "invalid_value"
    with pytest.raises(InvalidRequest, match="not valid JSON") as info:
        p.decode(p.CHAT_DECODER, b'{"model": ')
    assert info.value.code == "invalid_json"


def test_presence_tool_fields_and_null_content():
    req = chat(messages=[{"role": "assistant", "content": None, "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c", "content": [{"type": "text", "text": "r"}]}])
    dialog = to_engine.chat_messages(req.messages)
    assert dialog[0].content == "" and dialog[0].tool_calls == [ToolCall("c", "f", "{}")]
    assert dialog[1].role == "tool" and dialog[1].content == "r"


def test_response_encoding_matches_openai():
    chunk = p.ChatCompletionChunk(id="x", created=1, model="m", system_fingerprint="fp",
                                  choices=[p.ChatChunkChoice(index=0, delta=p.ChatDelta(content="a"))])
    assert msgspec.json.decode(p.ENCODER.encode(chunk)) == {
        "id": "x", "object": "chat.completion.chunk", "created": 1, "model": "m", "system_fingerprint": "fp",
        "choices": [{"index": 0, "delta": {"content": "a"}, "logprobs": None, "finish_reason": None}]}


# --------------------------------------------------------------------------- to_engine
def test_fan_out_ids_and_seeds():
    engine = FakeEngine(max_seq_len=64)
    plan = to_engine.chat_plan(chat(n=3, seed=5, max_tokens=4), chat().messages, engine, "chatcmpl-1")
    assert [r.request_id for r in plan.requests] == ["chatcmpl-1-0", "chatcmpl-1-1", "chatcmpl-1-2"]
    assert [r.params.seed for r in plan.requests] == [5, 6, 7]
    assert all(r.prompt_token_ids == plan.prompt_token_ids for r in plan.requests)
    unseeded = to_engine.chat_plan(chat(n=2), chat().messages, engine, "c")
    assert [r.params.seed for r in unseeded.requests] == [None, None]


def test_priority_is_set_when_the_request_is_planned():
    engine = FakeEngine()
    assert {r.priority for r in to_engine.chat_plan(chat(n=2), chat().messages, engine, "c").requests} == {0}
    batch = to_engine.chat_plan(chat(n=2), chat().messages, engine, "c", priority=1)
    req = p.decode(p.COMPLETION_DECODER, msgspec.json.encode({"model": "m", "prompt": ["a", "b"], "n": 2}))
    completions = to_engine.completion_plan(req, req.prompt, engine, "cmpl", priority=1)
    assert [r.priority for r in batch.requests + completions.requests] == [1] * 6


def test_client_priority_field_reaches_every_engine_request():
    engine = FakeEngine()
    plan = to_engine.chat_plan(chat(n=2, priority=-3), chat().messages, engine, "c")
    req = p.decode(p.COMPLETION_DECODER, msgspec.json.encode({"model": "m", "prompt": ["a", "b"], "priority": 7}))
    completions = to_engine.completion_plan(req, req.prompt, engine, "cmpl", priority=1)
    assert [(r.priority, r.client_priority) for r in plan.requests] == [(0, -3)] * 2
    assert [(r.priority, r.client_priority) for r in completions.requests] == [(1, 7)] * 2
    assert decode_error(p.CHAT_DECODER, {"model": "m", "messages": [{"role": "user", "content": "x"}],
                                         "priority": 2**40}).param == "priority"


def test_completion_plan_indexes_prompt_major():
    engine = FakeEngine()
    req = p.decode(p.COMPLETION_DECODER, msgspec.json.encode({"model": "m", "prompt": ["a", "b"], "n": 2}))
    plan = to_engine.completion_plan(req, req.prompt, engine, "cmpl-9")
    assert [r.request_id for r in plan.requests] == [f"cmpl-9-{i}" for i in range(4)]
    assert [r.prompt_token_ids for r in plan.requests] == [[BOS, 97], [BOS, 97], [BOS, 98], [BOS, 98]]


def test_length_checks():
    assert check_context_length(10, None, 64, param="max_tokens", prompt_param="prompt") == 54
    with pytest.raises(ContextLengthExceeded) as info:
        check_context_length(64, None, 64, param="max_tokens", prompt_param="messages")
    assert info.value.param == "messages" and info.value.code == "context_length_exceeded"
    with pytest.raises(ContextLengthExceeded, match=r"you requested 70 tokens \(10 in the prompt, 60"):
        check_context_length(10, 60, 64, param="max_tokens", prompt_param="prompt")


def test_logit_bias_keys_must_be_token_ids():
    engine = FakeEngine()
    with pytest.raises(InvalidRequest) as info:
        to_engine.chat_plan(chat(logit_bias={"abc": 1}), chat().messages, engine, "c")
    assert info.value.param == "logit_bias"


@pytest.mark.parametrize("fields,param,message", [
    ({"logit_bias": {"999999": 1}}, "logit_bias", "logit_bias token id 999999 is outside the vocabulary"),
    ({"stop_token_ids": [999999]}, "stop_token_ids", "stop token id 999999 is outside the vocabulary"),
])
def test_token_ids_outside_the_vocabulary_name_their_parameter(fields, param, message):
    with pytest.raises(InvalidRequest, match=message) as info:
        to_engine.chat_plan(chat(**fields), chat().messages, FakeEngine(), "c")
    assert info.value.param == param


# --------------------------------------------------------------------------- from_engine
def out(text: str, *, finish=None, n_out=0, logprobs=None, stop_reason=None, cached=0) -> RequestOutput:
    return RequestOutput("r", list(text.encode()), text, logprobs=logprobs, finish_reason=finish,
                         stop_reason=stop_reason, num_prompt_tokens=5, num_output_tokens=n_out, num_cached_tokens=cached)


def test_token_text_partial_utf8():
    tokenizer = FakeTokenizer()
    assert token_text(tokenizer, ord("a")) == ("a", [97])
    assert token_text(tokenizer, 0xE2) == ("bytes:\\xe2", [0xE2])
    assert token_text(tokenizer, EOT) == ("<|eot_id|>", list(b"<|eot_id|>"))


class FinishOnlyParser:
    """A parser that holds everything and reports the tool call only at finish (like a JSON call)."""

    def __init__(self) -> None:
        self.seen: list = []

    def push(self, text: str) -> ParsedDelta:
        return ParsedDelta("")

    def finish(self, stop_token_id):
        self.seen.append(stop_token_id)
        return ParsedOutput("thinking", [ToolCall("call_1", "f", '{"a": 1}')], "tool_calls")


class FinishOnlyFormat:
    def __init__(self) -> None:
        self.parsers: list = []

    def output_parser(self, tools):
        self.parsers.append(FinishOnlyParser())
        return self.parsers[-1]


def assembler(n=1, **kwargs) -> ChatAssembler:
    defaults = dict(response_id="chatcmpl-1", model="m", tokenizer=FakeTokenizer(), chat_format=FinishOnlyFormat(),
                    tools=(), n=n, num_prompt_tokens=5, want_logprobs=False)
    return ChatAssembler(**{**defaults, **kwargs})


def test_stream_late_tool_calls_and_held_content():
    fmt = FinishOnlyFormat()
    asm = assembler(chat_format=fmt, tools=("f",))
    assert asm.chunk(0, out('{"name"', n_out=7)) is None  # held back: nothing to send yet
    chunk = asm.chunk(0, out("}", finish="stop", n_out=8, stop_reason=EOT))
    choice = msgspec.json.decode(p.ENCODER.encode(chunk))["choices"][0]
    assert choice["delta"] == {"content": "thinking", "tool_calls": [
        {"index": 0, "id": "call_1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}]}
    assert choice["finish_reason"] == "tool_calls" and fmt.parsers[0].seen == [EOT]


def test_length_wins_over_tool_calls_and_usage_counts_choices():
    asm = assembler(n=2, tools=("f",))
    asm.add(0, out("x", finish="length", n_out=3, cached=4))
    asm.add(1, out("y", finish="stop", n_out=2, cached=4))
    body = msgspec.json.decode(p.ENCODER.encode(asm.response()))
    assert [c["finish_reason"] for c in body["choices"]] == ["length", "tool_calls"]
    assert body["usage"] == {"prompt_tokens": 5, "completion_tokens": 5, "total_tokens": 10,
                             "prompt_tokens_details": {"cached_tokens": 4}}


def test_engine_error_and_abort_raise():
    asm = assembler()
    with pytest.raises(GenerationFailed, match="boom"):
        asm.add(0, RequestOutput("r", [], "", finish_reason="error", error="boom"))
    with pytest.raises(GenerationFailed, match="aborted"):
        assembler().chunk(0, RequestOutput("r", [], "", finish_reason="abort"))


def test_completion_stream_echo_and_offsets():
    asm = CompletionAssembler(response_id="c", model="m", tokenizer=FakeTokenizer(), prompt_token_counts=[2, 3],
                              echo_texts=["ab", "cde"], n=1, logprobs=None)
    first = asm.chunk(1, out("X", n_out=1))
    assert first.choices[0].text == "cdeX" and first.choices[0].index == 1
    assert asm.chunk(1, out("", n_out=1)) is None
    lp = [TokenLogprob(89, -1.0, [(89, -1.0)])]
    asm2 = CompletionAssembler(response_id="c", model="m", tokenizer=FakeTokenizer(), prompt_token_counts=[2],
                               echo_texts=None, n=1, logprobs=0)
    asm2.chunk(0, out("XY", n_out=2, logprobs=[TokenLogprob(88, -0.5, []), *lp]))
    chunk = asm2.chunk(0, out("Y", finish="stop", n_out=3, logprobs=lp))
    assert chunk.choices[0].logprobs.text_offset == [2] and chunk.choices[0].logprobs.top_logprobs == [None]
    assert asm2.usage().completion_tokens == 3


# --------------------------------------------------------------------------- no 500 on client input
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

_json = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4),
    max_leaves=12,
)
_CHAT_KEYS = ["messages", "n", "stop", "seed", "max_tokens", "max_completion_tokens", "temperature", "top_p", "tools",
              "tool_choice", "logit_bias", "logprobs", "top_logprobs", "min_tokens", "top_k", "stop_token_ids"]
_MESSAGE = st.fixed_dictionaries({"role": st.sampled_from(["system", "developer", "user", "assistant", "tool", "x"]),
                                  "content": _json}, optional={"tool_calls": _json, "tool_call_id": _json, "name": _json})


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(patch=st.dictionaries(st.sampled_from(_CHAT_KEYS), _json, max_size=4),
       messages=st.lists(_MESSAGE, min_size=1, max_size=3))
def test_chat_input_fuzz_only_invalid_request(patch, messages):
    body = msgspec.json.encode({"model": "m", "messages": messages, **patch})
    engine = FakeEngine(max_seq_len=64)
    try:
        req = p.decode(p.CHAT_DECODER, body)
        to_engine.chat_plan(req, req.messages, engine, "c")
    except InvalidRequest:
        pass


@settings(max_examples=80, deadline=None)
@given(patch=st.dictionaries(st.sampled_from(["prompt", "n", "echo", "logprobs", "suffix", "best_of", "max_tokens",
                                              "stop", "logit_bias"]), _json, max_size=4))
def test_completion_input_fuzz_only_invalid_request(patch):
    body = msgspec.json.encode({"model": "m", "prompt": "x", **patch})
    engine = FakeEngine(max_seq_len=64)
    try:
        req = p.decode(p.COMPLETION_DECODER, body)
        to_engine.completion_plan(req, req.prompt, engine, "c")
    except InvalidRequest:
        pass
