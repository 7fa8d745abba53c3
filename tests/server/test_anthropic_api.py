"""Anthropic's Messages API (/v1/messages, /v1/messages/count_tokens) through the official anthropic
SDK against a live app over the FakeEngine: create, stream (Anthropic's events), count_tokens, a
tool_use round trip, stop reasons, x-api-key, and errors in Anthropic's shape."""

from __future__ import annotations

import json

import anthropic
import httpx
import pytest
from aiohttp.test_utils import TestServer

from engine.types import EngineRequest
from server.app import STATE_KEY, create_app
from server.config import ServerConfig
from server.registry import REGISTRY_KEY
from tests.server.fake_engine import FakeEngineFactory, FakeTokenizer, fake_spec

WEATHER = {"name": "get_weather", "description": "The weather in a city",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
USER = [{"role": "user", "content": "hi"}]


def script(request: EngineRequest) -> list[str]:
    prompt = FakeTokenizer().decode(request.prompt_token_ids)
    if "<|tools|>" in prompt and "<|tool|>" not in prompt:
        return ["Checking. ", '<tool>get_weather|{"city": "Paris"}</tool>']
    return ["Hello", " world", "!"]


@pytest.fixture
async def live(tmp_path):
    factory = FakeEngineFactory(script=script)
    app = create_app(ServerConfig(models=[fake_spec("fake", tmp_path)], checkpoint_roots=[tmp_path],
                                  api_key="sk-test"), factory)
    server = TestServer(app, host="127.0.0.1")
    await server.start_server()
    await app[STATE_KEY].startup_task
    async with app[REGISTRY_KEY].lease("fake"):
        pass
    yield server, factory
    await server.close()


@pytest.fixture
async def client(live):
    server, _ = live
    client = anthropic.AsyncAnthropic(base_url=str(server.make_url("")), api_key="sk-test", max_retries=0)
    yield client
    await client.close()


def engine(live):
    return live[1].engines["fake"]


async def test_create(live, client):
    message = await client.messages.create(model="fake", max_tokens=100, system="Be brief.", messages=USER,
                                           extra_body={"temperature": 0.5, "top_k": 5, "top_p": 0.9})
    assert [block.text for block in message.content] == ["Hello world!"]
    assert (message.role, message.stop_reason, message.stop_sequence, message.type) == ("assistant", "end_turn", None,
                                                                                          "message")
    assert message.id.startswith("msg_") and message.usage.output_tokens == 12
    request = engine(live).requests[-1]
    assert message.usage.input_tokens == len(request.prompt_token_ids)
    params = request.params
    assert (params.temperature, params.top_k, params.top_p, params.max_tokens) == (0.5, 5, 0.9, 100)
    dialog, _ = engine(live).chat_format.dialogs[-1]
    assert [(m.role, m.content) for m in dialog] == [("system", "Be brief."), ("user", "hi")]


async def test_max_tokens_and_stop_sequence(live, client):
    cut = await client.messages.create(model="fake", max_tokens=3, messages=USER)
    assert (cut.stop_reason, cut.content[0].text) == ("max_tokens", "Hel")
    await client.messages.create(model="fake", max_tokens=50, messages=USER, stop_sequences=["wor"])
    assert engine(live).requests[-1].params.stop == ("wor",)


async def test_stream_events(live, client):
    server, _ = live
    async with httpx.AsyncClient() as http:
        response = await http.post(str(server.make_url("/v1/messages")), headers={"x-api-key": "sk-test",
                                   "anthropic-version": "2023-06-01"},
                                   json={"model": "fake", "max_tokens": 100, "messages": USER, "stream": True})
    names = [line[len("event: "):] for line in response.text.splitlines() if line.startswith("event: ")]
    assert names == ["message_start", "ping", "content_block_start", "content_block_delta", "content_block_delta",
                     "content_block_delta", "content_block_stop", "message_delta", "message_stop"]
    async with client.messages.stream(model="fake", max_tokens=100, messages=USER) as stream:
        text = "".join([piece async for piece in stream.text_stream])
        final = await stream.get_final_message()
    assert text == "Hello world!" and final.stop_reason == "end_turn" and final.usage.output_tokens == 12


async def test_tool_use_round_trip(live, client):
    first = await client.messages.create(model="fake", max_tokens=80, tools=[WEATHER],
                                         messages=[{"role": "user", "content": "Weather in Paris?"}])
    assert [block.type for block in first.content] == ["text", "tool_use"] and first.stop_reason == "tool_use"
    call = first.content[1]
    assert (call.name, call.input) == ("get_weather", {"city": "Paris"}) and call.id.startswith("toolu_")
    second = await client.messages.create(model="fake", max_tokens=80, tools=[WEATHER], messages=[
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": [block.model_dump(exclude_none=True) for block in first.content]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id, "content": "sunny"},
                                     {"type": "text", "text": "Thanks."}]},
    ])
    assert second.content[0].text == "Hello world!" and second.stop_reason == "end_turn"
    dialog, tools = engine(live).chat_format.dialogs[-1]
    assert [(m.role, m.content) for m in dialog] == [("user", "Weather in Paris?"), ("assistant", "Checking. "),
                                                     ("tool", "sunny"), ("user", "Thanks.")]
    assert dialog[1].tool_calls[0].call_id == call.id and dialog[2].tool_call_id == call.id
    assert [t.name for t in tools] == ["get_weather"]
    # streamed: the call's arguments arrive as input_json_delta
    async with client.messages.stream(model="fake", max_tokens=80, tools=[WEATHER],
                                      messages=[{"role": "user", "content": "Weather?"}]) as stream:
        final = await stream.get_final_message()
    assert final.content[1].input == {"city": "Paris"} and final.stop_reason == "tool_use"


async def test_tool_choice(live, client):
    await client.messages.create(model="fake", max_tokens=100, tools=[WEATHER], messages=USER,
                                 tool_choice={"type": "tool", "name": "get_weather"})
    assert engine(live).requests[-1].params.grammar.kind == "json"
    await client.messages.create(model="fake", max_tokens=100, tools=[WEATHER], messages=USER,
                                 tool_choice={"type": "none"})
    assert engine(live).chat_format.dialogs[-1][1] == ()


async def test_count_tokens(live, client):
    count = await client.messages.count_tokens(model="fake", system="Be brief.", messages=USER)
    await client.messages.create(model="fake", max_tokens=10, system="Be brief.", messages=USER)
    assert count.input_tokens == len(engine(live).requests[-1].prompt_token_ids)
    with_tools = await client.messages.count_tokens(model="fake", messages=USER, tools=[WEATHER])
    assert with_tools.input_tokens > count.input_tokens - len("<|system|>Be brief.\n")


async def test_errors_in_anthropic_shape(live, client):
    with pytest.raises(anthropic.NotFoundError) as info:
        await client.messages.create(model="nope", max_tokens=10, messages=USER)
    assert info.value.body == {"type": "error", "error": {"type": "not_found_error",
                                                          "message": "The model 'nope' does not exist"}}
    with pytest.raises(anthropic.BadRequestError) as bad:
        await client.messages.create(model="fake", max_tokens=10, messages=[{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}}]}])
    assert bad.value.body["error"]["type"] == "invalid_request_error"
    assert "'image'" in bad.value.body["error"]["message"]
    wrong_key = anthropic.AsyncAnthropic(base_url=str(client.base_url), api_key="wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as auth:
        await wrong_key.messages.create(model="fake", max_tokens=10, messages=USER)
    assert auth.value.body["error"]["type"] == "authentication_error"
    await wrong_key.close()


@pytest.mark.parametrize(("body", "status"), [
    ({"messages": USER}, 400),  # max_tokens is required
    ({"max_tokens": 0, "messages": USER}, 400),
    ({"max_tokens": 10, "messages": []}, 400),
    ({"max_tokens": 10, "messages": USER, "temperature": 1.5}, 400),
    ({"max_tokens": 10, "messages": USER, "thinking": {"type": "enabled", "budget_tokens": 1024}}, 400),
    ({"max_tokens": 10, "messages": [{"role": "system", "content": "x"}]}, 400),
    ({"max_tokens": 10, "messages": [{"role": "user", "content": [{"type": "document", "source": {}}]}]}, 400),
    ({"max_tokens": 10, "messages": USER, "tool_choice": {"type": "tool"}, "tools": [WEATHER]}, 400),
    ({"max_tokens": 10, "messages": USER, "tool_choice": {"type": "any"}}, 400),
    ({"max_tokens": 10, "messages": USER, "stop_sequences": ["x"] * 17}, 400),
    ({"max_tokens": 10**6, "messages": USER}, 400),
    ({"max_tokens": 10, "messages": USER, "unknown_field": 1}, 400),
    ({"max_tokens": 10, "messages": [*USER, {"role": "assistant", "content": "The answer is"}]}, 400),  # prefill
])
async def test_bad_inputs(live, body, status):
    server, _ = live
    async with httpx.AsyncClient() as http:
        response = await http.post(str(server.make_url("/v1/messages")), json={"model": "fake", **body},
                                   headers={"x-api-key": "sk-test"})
    assert response.status_code == status, response.text
    error = response.json()
    assert error["type"] == "error" and set(error["error"]) == {"type", "message"}
    assert error["error"]["type"] == "invalid_request_error"


async def test_failure_mid_stream_is_an_anthropic_error_event(live):
    server, _ = live
    engine(live).fail_after = 2
    async with httpx.AsyncClient() as http:
        response = await http.post(str(server.make_url("/v1/messages")), headers={"x-api-key": "sk-test"},
                                   json={"model": "fake", "max_tokens": 100, "messages": USER, "stream": True})
    last = [frame for frame in response.text.split("\n\n") if frame][-1].splitlines()
    assert last[0] == "event: error"
    error = json.loads(last[1][len("data: "):])
    assert error["type"] == "error" and error["error"]["type"] == "api_error"
