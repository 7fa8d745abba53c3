"""Completions with echo + logprobs (prompt logprobs first, the first one null), max_tokens=0
score-only requests, and vLLM's prompt_logprobs field: request mapping and golden JSON."""

from __future__ import annotations

import msgspec
import pytest

from compat import protocol as p
from compat import to_engine
from compat.from_engine import CompletionAssembler
from engine.types import InvalidRequest, RequestOutput, TokenLogprob
from tests.server.fake_engine import BOS, FakeEngine, FakeTokenizer


def completion(**fields) -> p.CompletionRequest:
    return p.decode(p.COMPLETION_DECODER, msgspec.json.encode({"model": "m", "prompt": "ab", **fields}))


def plan(**fields) -> to_engine.CompletionPlan:
    req = completion(**fields)
    return to_engine.completion_plan(req, req.prompt, FakeEngine(max_seq_len=64), "c")


# --------------------------------------------------------------------------- request -> engine
@pytest.mark.parametrize("fields,expected", [
    ({"echo": True, "logprobs": 2}, 2),  # echo with logprobs needs the prompt's
    ({"echo": False, "logprobs": 2}, None),
    ({"echo": True}, None),
    ({"prompt_logprobs": 4}, 4),  # vLLM's field alone
    ({"echo": True, "logprobs": 1, "prompt_logprobs": 3}, 3),  # the engine computes the larger k
])
def test_engine_prompt_logprobs(fields, expected):
    (request,) = plan(**fields).requests
    assert request.params.prompt_logprobs == expected


def test_max_tokens_zero_scores_only_with_echo_or_prompt_logprobs():
    (request,) = plan(echo=True, logprobs=1, max_tokens=0).requests
    assert request.params.max_tokens == 0 and request.params.prompt_logprobs == 1
    assert plan(prompt_logprobs=0, max_tokens=0).requests[0].params.max_tokens == 0
    with pytest.raises(InvalidRequest) as info:
        plan(max_tokens=0)
    assert info.value.param == "max_tokens"


def test_prompt_logprobs_field_is_bounded():
    with pytest.raises(InvalidRequest) as info:
        completion(prompt_logprobs=21)
    assert info.value.param == "prompt_logprobs"


# --------------------------------------------------------------------------- engine -> response
PROMPT_IDS = [BOS, ord("a"), ord("b")]  # "ab" as the server encodes it: BOS first
PROMPT_LOGPROBS = [
    None,
    TokenLogprob(ord("a"), -1.5, [(ord("x"), -0.25), (ord("a"), -1.5)]),
    TokenLogprob(ord("b"), -0.5, [(ord("b"), -0.5), (ord("y"), -2.0)]),
]
GENERATED = TokenLogprob(ord("c"), -0.125, [(ord("c"), -0.125), (ord("d"), -3.0)])


def assembler(*, echo: bool = True, logprobs: int | None = 1, prompt_logprobs: int | None = None) -> CompletionAssembler:
    return CompletionAssembler(response_id="c", model="m", tokenizer=FakeTokenizer(), prompt_token_counts=[3],
                               echo_texts=["ab"] if echo else None, n=1, logprobs=logprobs,
                               prompt_logprobs=prompt_logprobs, prompt_token_ids=[PROMPT_IDS])


def outputs(max_tokens: int) -> list[RequestOutput]:
    if max_tokens == 0:
        return [RequestOutput("c-0", [], "", finish_reason="length", num_prompt_tokens=3,
                              prompt_logprobs=PROMPT_LOGPROBS)]
    return [RequestOutput("c-0", [ord("c")], "c", logprobs=[GENERATED], finish_reason="length", num_prompt_tokens=3,
                          num_output_tokens=1, prompt_logprobs=PROMPT_LOGPROBS)]


def body(asm: CompletionAssembler, outs: list[RequestOutput]) -> dict:
    for out in outs:
        asm.add(0, out)
    return msgspec.json.decode(p.ENCODER.encode(asm.response()))


ECHO_LOGPROBS = {
    "tokens": ["<|begin_of_text|>", "a", "b"],
    "token_logprobs": [None, -1.5, -0.5],
    # k=1: the best alternative, then the token itself when it is not the best (up to k+1, as OpenAI)
    "top_logprobs": [None, {"x": -0.25, "a": -1.5}, {"b": -0.5}],
    "text_offset": [0, 0, 1],  # the BOS the server added is not in the echoed text
}


def test_echo_logprobs_score_only_golden():
    choice = body(assembler(), outputs(max_tokens=0))["choices"][0]
    assert choice == {"text": "ab", "index": 0, "logprobs": ECHO_LOGPROBS, "finish_reason": "length"}


def test_echo_logprobs_then_generated_golden():
    choice = body(assembler(), outputs(max_tokens=1))["choices"][0]
    assert choice["text"] == "abc"
    assert choice["logprobs"] == {
        "tokens": [*ECHO_LOGPROBS["tokens"], "c"],
        "token_logprobs": [*ECHO_LOGPROBS["token_logprobs"], -0.125],
        "top_logprobs": [*ECHO_LOGPROBS["top_logprobs"], {"c": -0.125}],
        "text_offset": [*ECHO_LOGPROBS["text_offset"], 2],  # continues after the echoed prompt
    }


def test_stream_chunks_carry_the_same_logprobs():
    chunk = assembler().chunk(0, outputs(max_tokens=1)[0])
    streamed = msgspec.json.decode(p.ENCODER.encode(chunk))["choices"][0]
    whole = body(assembler(), outputs(max_tokens=1))["choices"][0]
    assert streamed["text"] == whole["text"] and streamed["logprobs"] == whole["logprobs"]


def test_token_id_prompt_echo_offsets_include_the_spelled_bos():
    asm = CompletionAssembler(response_id="c", model="m", tokenizer=FakeTokenizer(), prompt_token_counts=[3],
                              echo_texts=["<|begin_of_text|>ab"], n=1, logprobs=0, prompt_token_ids=[PROMPT_IDS])
    choice = body(asm, outputs(max_tokens=0))["choices"][0]
    assert choice["logprobs"]["text_offset"] == [0, 17, 18]
    assert choice["logprobs"]["top_logprobs"] == [None, None, None]


def test_without_echo_the_logprobs_are_the_generated_ones_only():
    choice = body(assembler(echo=False), outputs(max_tokens=1))["choices"][0]
    assert choice["text"] == "c" and choice["logprobs"]["tokens"] == ["c"] and choice["logprobs"]["text_offset"] == [0]


def test_vllm_prompt_logprobs_field_golden():
    choice = body(assembler(echo=False, logprobs=None, prompt_logprobs=1), outputs(max_tokens=1))["choices"][0]
    assert choice["logprobs"] is None
    assert choice["prompt_logprobs"] == [
        None,
        {"97": {"logprob": -1.5, "rank": None, "decoded_token": "a"},  # not among the top 1
         "120": {"logprob": -0.25, "rank": 1, "decoded_token": "x"}},
        {"98": {"logprob": -0.5, "rank": 1, "decoded_token": "b"}},
    ]


def test_no_prompt_logprobs_field_unless_asked():
    choice = body(assembler(), outputs(max_tokens=1))["choices"][0]
    assert "prompt_logprobs" not in choice
