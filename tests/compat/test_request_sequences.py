"""Issue 29 (4): one request's sequences (n x prompts) count against a per-request cap well below the
engine's waiting queue, so one request cannot fill the queue and lock everyone else out."""

from __future__ import annotations

import msgspec
import pytest

from compat import protocol as p
from compat import to_engine
from engine.config import EngineConfig
from engine.types import InvalidRequest
from tests.server.fake_engine import FakeEngine

CAP = 4


def engine_with_cap(cap: int = CAP) -> FakeEngine:
    engine = FakeEngine()
    engine.max_sequences_per_request = cap
    return engine


def chat(n: int) -> p.ChatCompletionRequest:
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "n": n}
    return p.decode(p.CHAT_DECODER, msgspec.json.encode(body))


def completion(prompt: object, n: int) -> p.CompletionRequest:
    return p.decode(p.COMPLETION_DECODER, msgspec.json.encode({"model": "m", "prompt": prompt, "n": n}))


def refusal(plan, *args) -> InvalidRequest:
    with pytest.raises(InvalidRequest) as info:
        plan(*args)
    return info.value


def test_the_default_cap_is_well_below_the_waiting_queue():
    config = EngineConfig()
    assert config.max_sequences_per_request * 4 <= config.max_waiting_requests
    assert FakeEngine().max_sequences_per_request == config.max_sequences_per_request


def test_chat_n_past_the_cap_is_a_400_naming_n():
    engine = engine_with_cap()
    assert len(to_engine.chat_plan(chat(CAP), chat(1).messages, engine, "c").requests) == CAP
    error = refusal(to_engine.chat_plan, chat(CAP + 1), chat(1).messages, engine, "c")
    assert (error.param, error.code) == ("n", "too_many_sequences")
    assert f"n={CAP + 1}" in str(error) and f"limit is {CAP} sequences per request" in str(error)


def test_prompts_times_n_past_the_cap_names_the_larger_factor():
    engine = engine_with_cap()
    assert len(to_engine.completion_plan(completion(["a", "b"], 2), ["a", "b"], engine, "c").requests) == CAP
    many_n = refusal(to_engine.completion_plan, completion(["a", "b"], 3), ["a", "b"], engine, "c")
    assert (many_n.param, many_n.code) == ("n", "too_many_sequences")
    assert "6 sequences (2 prompts x n=3)" in str(many_n)
    prompts = [[1]] * (CAP + 1)
    many_prompts = refusal(to_engine.completion_plan, completion(prompts, 1), prompts, engine, "c")
    assert (many_prompts.param, many_prompts.code) == ("prompt", "too_many_sequences")


def test_one_online_request_of_8_prompts_x_128_is_refused_by_default():
    engine = FakeEngine()
    prompts = ["p"] * 8
    error = refusal(to_engine.completion_plan, completion(prompts, 128), prompts, engine, "c")
    assert error.param == "n" and "1024 sequences" in str(error)
    assert engine.requests == []
