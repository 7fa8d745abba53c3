"""The OpenAI API over a FakeEngine: response shapes, streaming order, errors, auth, batch, tokenizer."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from engine.types import EngineDead, QueueFull
from server.app import STATE_KEY, create_app
from server.config import ServerConfig
from server.registry import REGISTRY_KEY
from tests.server.fake_engine import BOS, EOT, FakeEngine, FakeEngineFactory, Hold, fake_spec

CHAT = {"model": "fake", "messages": [{"role": "user", "content": "hi"}]}


def make_config(tmp_path: Path, **overrides) -> ServerConfig:
    overrides.setdefault("models", [fake_spec("fake", tmp_path)])
    return ServerConfig(checkpoint_roots=[tmp_path], **overrides)


async def start(aiohttp_client, factory: FakeEngineFactory, config: ServerConfig):
    app = create_app(config, factory)
    client = await aiohttp_client(app)
    await app[STATE_KEY].startup_task
    for spec in config.models:
        async with app[REGISTRY_KEY].lease(spec.model_id):  # waits for the start-time load
            pass
    return client


@pytest.fixture
def factory() -> FakeEngineFactory:
    return FakeEngineFactory()


@pytest.fixture
async def client(aiohttp_client, factory, tmp_path):
    return await start(aiohttp_client, factory, make_config(tmp_path))


def engine_of(factory: FakeEngineFactory) -> FakeEngine:
    return factory.engines["fake"]


def sse_events(text: str) -> list:
    events = []
    for block in text.split("\n\n"):
        if not block:
            continue
        assert block.startswith("data: "), block
        payload = block[len("data: "):]
        events.append(payload if payload == "[DONE]" else json.loads(payload))
    return events


async def error_of(response, status: int) -> dict:
    assert response.status == status, await response.text()
    body = await response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    return body["error"]


# --------------------------------------------------------------------------- chat
async def test_chat_response_shape(client, factory):
    response = await client.post("/v1/chat/completions", json={**CHAT, "temperature": 0, "max_tokens": 50})
    assert response.status == 200
    body = await response.json()
    assert set(body) == {"id", "object", "created", "model", "system_fingerprint", "choices", "usage"}
    assert body["object"] == "chat.completion" and body["model"] == "fake" and body["id"].startswith("chatcmpl-")
    assert body["choices"] == [{
        "index": 0,
        "message": {"role": "assistant", "content": "Hello world!", "refusal": None},
        "logprobs": None,
        "finish_reason": "stop",
    }]
    request = engine_of(factory).requests[0]
    assert body["usage"] == {
        "prompt_tokens": len(request.prompt_token_ids), "completion_tokens": 12,
        "total_tokens": len(request.prompt_token_ids) + 12, "prompt_tokens_details": {"cached_tokens": 0},
    }
    assert request.prompt_token_ids[0] == BOS and request.params.temperature == 0 and request.params.max_tokens == 50


async def test_chat_sampling_params_mapping(client, factory):
    body = {**CHAT, "messages": [{"role": "developer", "content": [{"type": "text", "text": "be brief"}]},
                                 {"role": "user", "content": "hi", "name": "bob"}],
            "top_p": 0.5, "top_k": -1, "min_p": 0.1, "presence_penalty": 0.5, "frequency_penalty": -0.5,
            "repetition_penalty": 1.2, "logit_bias": {"65": 5}, "seed": 7, "stop": "x", "stop_token_ids": [EOT],
            "ignore_eos": True, "min_tokens": 2, "max_completion_tokens": 20, "user": "u1"}
    response = await client.post("/v1/chat/completions", json=body)
    assert response.status == 200, await response.text()
    params = engine_of(factory).requests[0].params
    assert (params.top_p, params.top_k, params.min_p, params.presence_penalty, params.frequency_penalty) == (0.5, 0, 0.1, 0.5, -0.5)
    assert params.repetition_penalty == 1.2 and params.logit_bias == ((65, 5.0),) and params.seed == 7
    assert params.stop == ("x",) and params.stop_token_ids == frozenset({EOT}) and params.ignore_eos and params.min_tokens == 2
    assert params.max_tokens == 20 and params.logprobs is None and params.skip_special_tokens
    dialog, tools = engine_of(factory).chat_format.dialogs[0]
    assert [(m.role, m.content, m.name) for m in dialog] == [("system", "be brief", None), ("user", "hi", "bob")]


async def test_chat_max_tokens_defaults_to_the_rest_of_the_context(client, factory):
    await client.post("/v1/chat/completions", json=CHAT)
    request = engine_of(factory).requests[0]
    assert request.params.max_tokens == 256 - len(request.prompt_token_ids)


async def test_chat_length_finish_reason(client):
    body = await (await client.post("/v1/chat/completions", json={**CHAT, "max_tokens": 7})).json()
    assert body["choices"][0]["message"]["content"] == "Hello w" and body["choices"][0]["finish_reason"] == "length"
    assert body["usage"]["completion_tokens"] == 7


async def test_chat_n_fans_out_with_seeds(client, factory):
    body = await (await client.post("/v1/chat/completions", json={**CHAT, "n": 3, "seed": 10})).json()
    assert [c["index"] for c in body["choices"]] == [0, 1, 2]
    requests = engine_of(factory).requests
    assert sorted(r.request_id[-2:] for r in requests) == ["-0", "-1", "-2"]
    assert sorted(r.params.seed for r in requests) == [10, 11, 12]
    assert body["usage"]["completion_tokens"] == 36 and body["usage"]["prompt_tokens"] == len(requests[0].prompt_token_ids)


async def test_chat_stream_order(client):
    response = await client.post("/v1/chat/completions", json={**CHAT, "stream": True})
    assert response.status == 200 and response.headers["Content-Type"].startswith("text/event-stream")
    events = sse_events(await response.text())
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert all(c["object"] == "chat.completion.chunk" and "usage" not in c for c in chunks)
    assert len({c["id"] for c in chunks}) == 1
    assert chunks[0]["choices"] == [{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                     "finish_reason": None}]
    assert [c["choices"][0]["delta"].get("content") for c in chunks[1:]] == ["Hello", " world", "!"]
    assert [c["choices"][0]["finish_reason"] for c in chunks[1:]] == [None, None, "stop"]


async def test_chat_stream_usage_chunk(client):
    body = {**CHAT, "stream": True, "stream_options": {"include_usage": True}}
    events = sse_events(await (await client.post("/v1/chat/completions", json=body)).text())
    chunks = events[:-1]
    assert all(c["usage"] is None for c in chunks[:-1])
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 12


async def test_chat_stream_n2_each_choice_finishes(client):
    events = sse_events(await (await client.post("/v1/chat/completions", json={**CHAT, "n": 2, "stream": True})).text())
    chunks = events[:-1]
    for index in (0, 1):
        mine = [c["choices"][0] for c in chunks if c["choices"][0]["index"] == index]
        assert mine[0]["delta"] == {"role": "assistant", "content": ""}
        assert "".join(m["delta"].get("content", "") for m in mine) == "Hello world!"
        assert [m["finish_reason"] for m in mine][-1] == "stop" and mine[-1]["finish_reason"] == "stop"


async def test_chat_logprobs_shape(client, factory):
    body = await (await client.post("/v1/chat/completions", json={**CHAT, "logprobs": True, "top_logprobs": 2})).json()
    logprobs = body["choices"][0]["logprobs"]
    assert set(logprobs) == {"content", "refusal"} and len(logprobs["content"]) == 12
    first = logprobs["content"][0]
    assert first == {"token": "H", "logprob": -0.25, "bytes": [72], "top_logprobs": [
        {"token": "H", "logprob": -0.25, "bytes": [72]}, {"token": "?", "logprob": -2.0, "bytes": [63]}]}
    assert engine_of(factory).requests[0].params.logprobs == 2


async def test_chat_logprobs_partial_utf8_token(client):
    body = await (await client.post("/v1/chat/completions", json={**CHAT, "logprobs": True, "top_logprobs": 3})).json()
    top = body["choices"][0]["logprobs"]["content"][0]["top_logprobs"][2]
    assert top == {"token": "bytes:\\xe2", "logprob": -3.0, "bytes": [0xE2]}


async def test_chat_stream_logprobs(client):
    events = sse_events(await (await client.post(
        "/v1/chat/completions", json={**CHAT, "logprobs": True, "stream": True})).text())
    tokens = [lp["token"] for c in events[1:-1] for lp in c["choices"][0]["logprobs"]["content"]]
    assert "".join(tokens) == "Hello world!"


# --------------------------------------------------------------------------- tools
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "weather",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]


def tool_script(request):
    return ["<tool>get_weather|", '{"city": ', '"Paris"}</tool>']


@pytest.fixture
async def tool_client(aiohttp_client, tmp_path):
    factory = FakeEngineFactory(script=tool_script)
    return await start(aiohttp_client, factory, make_config(tmp_path)), factory


async def test_chat_tool_call_response(tool_client):
    client, factory = tool_client
    body = await (await client.post("/v1/chat/completions", json={**CHAT, "tools": TOOLS})).json()
    choice = body["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"] == {"role": "assistant", "content": None, "refusal": None, "tool_calls": [
        {"id": "call_fake0", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]}
    request = engine_of(factory).requests[0]
    assert request.params.skip_special_tokens is False
    assert [t.name for t in engine_of(factory).chat_format.dialogs[0][1]] == ["get_weather"]


async def test_chat_tool_call_stream_deltas(tool_client):
    client, _ = tool_client
    events = sse_events(await (await client.post(
        "/v1/chat/completions", json={**CHAT, "tools": TOOLS, "stream": True})).text())
    deltas = [c["choices"][0] for c in events[1:-1]]
    assert deltas[0]["delta"] == {"tool_calls": [{"index": 0, "id": "call_fake0", "type": "function",
                                                  "function": {"name": "get_weather", "arguments": ""}}]}
    arguments = "".join(tc["function"]["arguments"] for d in deltas for tc in d["delta"].get("tool_calls", []))
    assert arguments == '{"city": "Paris"}'
    assert all("id" not in tc for d in deltas[1:] for tc in d["delta"].get("tool_calls", []))
    assert deltas[-1]["finish_reason"] == "tool_calls"


async def test_tool_choice_none_renders_without_tools(tool_client):
    client, factory = tool_client
    body = await (await client.post("/v1/chat/completions", json={**CHAT, "tools": TOOLS, "tool_choice": "none"})).json()
    assert body["choices"][0]["message"]["content"].startswith("<tool>")
    assert engine_of(factory).chat_format.dialogs[0][1] == ()


async def test_assistant_tool_calls_and_tool_messages_reach_the_chat_format(client, factory):
    messages = [
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
    ]
    assert (await client.post("/v1/chat/completions", json={"model": "fake", "messages": messages})).status == 200
    dialog = engine_of(factory).chat_format.dialogs[0][0]
    assert dialog[1].tool_calls[0].name == "get_weather" and dialog[2].tool_call_id == "c1"


# --------------------------------------------------------------------------- completions
async def test_completion_response_shape(client, factory):
    response = await client.post("/v1/completions", json={"model": "fake", "prompt": "Say", "max_tokens": 20})
    body = await response.json()
    assert set(body) == {"id", "object", "created", "model", "system_fingerprint", "choices", "usage"}
    assert body["object"] == "text_completion"
    assert body["choices"] == [{"text": "Hello world!", "index": 0, "logprobs": None, "finish_reason": "stop"}]
    assert engine_of(factory).requests[0].prompt_token_ids == [BOS, *b"Say"]
    assert body["usage"]["prompt_tokens"] == 4


async def test_completion_default_max_tokens_is_16(client, factory):
    await client.post("/v1/completions", json={"model": "fake", "prompt": "Say"})
    assert engine_of(factory).requests[0].params.max_tokens == 16


@pytest.mark.parametrize("prompt,expected", [
    (["a", "bc"], [[BOS, 97], [BOS, 98, 99]]),
    ([5, 6, 7], [[5, 6, 7]]),
    ([[5], [6, 7]], [[5], [6, 7]]),
])
async def test_completion_prompt_forms(client, factory, prompt, expected):
    body = await (await client.post("/v1/completions", json={"model": "fake", "prompt": prompt, "n": 2})).json()
    assert [c["index"] for c in body["choices"]] == list(range(2 * len(expected)))
    by_id = {r.request_id.rsplit("-", 1)[1]: r.prompt_token_ids for r in engine_of(factory).requests}
    assert [by_id[str(2 * k)] for k in range(len(expected))] == expected
    assert body["usage"]["prompt_tokens"] == sum(map(len, expected))


async def test_completion_echo(client):
    body = await (await client.post("/v1/completions", json={"model": "fake", "prompt": "Say", "echo": True})).json()
    assert body["choices"][0]["text"] == "SayHello world!"


async def test_completion_logprobs_shape(client):
    body = await (await client.post("/v1/completions", json={"model": "fake", "prompt": "Say", "logprobs": 1,
                                                             "max_tokens": 3})).json()
    assert body["choices"][0]["logprobs"] == {
        "tokens": ["H", "e", "l"], "token_logprobs": [-0.25, -0.25, -0.25],
        "top_logprobs": [{"H": -0.25}, {"e": -0.25}, {"l": -0.25}], "text_offset": [0, 1, 2]}


async def test_completion_stream(client):
    body = {"model": "fake", "prompt": "Say", "stream": True, "echo": True, "stream_options": {"include_usage": True}}
    events = sse_events(await (await client.post("/v1/completions", json=body)).text())
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert all(c["object"] == "text_completion" for c in chunks)
    assert "".join(c["choices"][0]["text"] for c in chunks[:-1]) == "SayHello world!"
    assert chunks[-2]["choices"][0]["finish_reason"] == "stop" and chunks[-1]["usage"]["completion_tokens"] == 12


# --------------------------------------------------------------------------- errors
async def test_invalid_json(client):
    response = await client.post("/v1/chat/completions", data=b"{nope", headers={"Content-Type": "application/json"})
    error = await error_of(response, 400)
    assert error["type"] == "invalid_request_error" and "JSON" in error["message"]


@pytest.mark.parametrize("patch,param", [
    ({"temperature": 5}, "temperature"),
    ({"n": 0}, "n"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role"),
    ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
    ({"messages": []}, "messages"),
    ({"frobnicate": True}, "frobnicate"),
    ({"messages": [{"role": "user", "content": "x", "extra": 1}]}, "messages[0].extra"),
    ({"model": None}, "model"),
])
async def test_schema_errors_name_the_param(client, patch, param):
    error = await error_of(await client.post("/v1/chat/completions", json={**CHAT, **patch}), 400)
    assert error["param"] == param, error
    assert "Traceback" not in error["message"]


async def test_missing_field_names_it(client):
    error = await error_of(await client.post("/v1/chat/completions", json={"model": "fake"}), 400)
    assert error["param"] == "messages"


@pytest.mark.parametrize("url,patch,param", [
    ("/v1/chat/completions", {"tool_choice": "required"}, "tool_choice"),
    ("/v1/chat/completions", {"tool_choice": {"type": "function", "function": {"name": "f"}}}, "tool_choice"),
    ("/v1/chat/completions", {"response_format": {"type": "xml"}}, "response_format.type"),
    ("/v1/chat/completions", {"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
    ("/v1/chat/completions", {"guided_regex": "a+", "guided_choice": ["a"]}, "guided_choice"),
    ("/v1/chat/completions", {"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
    ("/v1/chat/completions", {"top_logprobs": 2}, "top_logprobs"),
    ("/v1/chat/completions", {"tools": [{"type": "function", "function": {"name": "f"}}],
                              "tool_choice": {"type": "function", "function": {"name": "g"}}}, "tool_choice"),
    ("/v1/chat/completions", {"tools": [{"type": "function", "function": {"name": "f"}}],
                              "functions": [{"name": "f"}]}, "functions"),
    ("/v1/chat/completions", {"stream_options": {"continuous_usage_stats": True}},
     "stream_options.continuous_usage_stats"),
    ("/v1/chat/completions", {"logit_bias": {"999999": 1}}, "logit_bias"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]}, "messages[0].content[0]"),
    ("/v1/chat/completions", {"min_tokens": 100, "max_tokens": 10}, "min_tokens"),
    ("/v1/completions", {"suffix": "x"}, "suffix"),
    ("/v1/completions", {"best_of": 2}, "best_of"),
    ("/v1/completions", {"max_tokens": 0}, "max_tokens"),  # without echo or prompt_logprobs: nothing to return
    ("/v1/completions", {"prompt": ["a", 1]}, "prompt"),
    ("/v1/completions", {"prompt": [100000]}, "prompt"),
])
async def test_unsupported_params_are_refused(client, url, patch, param):
    base = CHAT if "chat" in url else {"model": "fake", "prompt": "x"}
    error = await error_of(await client.post(url, json={**base, **patch}), 400)
    assert error["param"] == param, error


async def test_context_length_exceeded(client):
    long = {"model": "fake", "messages": [{"role": "user", "content": "x" * 300}]}
    error = await error_of(await client.post("/v1/chat/completions", json=long), 400)
    assert error["code"] == "context_length_exceeded" and "256" in error["message"]
    error = await error_of(await client.post("/v1/chat/completions", json={**CHAT, "max_tokens": 250}), 400)
    assert error["code"] == "context_length_exceeded" and error["param"] == "max_tokens"


async def test_unknown_model_is_404(client):
    error = await error_of(await client.post("/v1/chat/completions", json={**CHAT, "model": "nope"}), 404)
    assert error["code"] == "model_not_found"


async def test_unknown_route_and_method(client):
    error = await error_of(await client.get("/v1/nothing"), 404)
    assert "GET /v1/nothing" in error["message"]
    response = await client.get("/v1/chat/completions")
    await error_of(response, 405)
    assert "POST" in response.headers["Allow"]


async def test_body_too_large(aiohttp_client, factory, tmp_path):
    client = await start(aiohttp_client, factory, make_config(tmp_path, max_body_bytes=2048))
    response = await client.post("/v1/chat/completions", data=b"x" * 4096, headers={"Content-Type": "application/json"})
    error = await error_of(response, 413)
    assert "2048" in error["message"]


async def test_queue_full_is_429_with_retry_after(client, factory):
    engine_of(factory).raise_on_generate = QueueFull("too many requests waiting", retry_after_s=2.5)
    for stream in (False, True):
        response = await client.post("/v1/chat/completions", json={**CHAT, "stream": stream})
        error = await error_of(response, 429)
        assert response.headers["Retry-After"] == "3" and error["type"] == "rate_limit_error"


async def test_engine_dead_is_503(client, factory):
    engine_of(factory).raise_on_generate = EngineDead("worker 1 exited")
    response = await client.post("/v1/completions", json={"model": "fake", "prompt": "x"})
    error = await error_of(response, 503)
    assert "worker 1 exited" not in error["message"] and "request id" in error["message"]  # the reason is logged


async def test_dead_engine_is_reloaded_on_the_next_request(client, factory):
    dead = engine_of(factory)
    dead.raise_on_generate = EngineDead("worker 1 exited")
    await error_of(await client.post("/v1/chat/completions", json=CHAT), 503)
    response = await client.post("/v1/chat/completions", json=CHAT)
    assert response.status == 200 and engine_of(factory) is not dead


async def test_unexpected_exception_is_500_without_traceback(client, factory):
    engine_of(factory).raise_on_generate = RuntimeError("secret internals")
    error = await error_of(await client.post("/v1/chat/completions", json=CHAT), 500)
    assert "secret" not in error["message"] and "request id" in error["message"]


async def test_engine_failure_mid_stream_is_an_in_band_error(client, factory):
    engine_of(factory).fail_after = 2
    events = sse_events(await (await client.post("/v1/chat/completions", json={**CHAT, "stream": True})).text())
    assert events[-1] == "[DONE]"
    assert "fake engine failure" not in events[-2]["error"]["message"] and events[-2]["error"]["code"] == "engine_error"


async def test_engine_failure_without_stream_is_500(client, factory):
    engine_of(factory).fail_after = 1
    error = await error_of(await client.post("/v1/chat/completions", json=CHAT), 500)
    assert error["code"] == "engine_error"


# --------------------------------------------------------------------------- disconnect
async def test_disconnect_mid_stream_aborts(client, factory):
    engine = engine_of(factory)
    engine.hold = Hold(after=1)
    response = await client.post("/v1/chat/completions", json={**CHAT, "stream": True})
    assert response.status == 200
    first = await response.content.readuntil(b"\n\n")
    assert b'"role":"assistant"' in first
    await asyncio.wait_for(engine.hold.reached.wait(), 5)
    response.close()  # the client goes away while the engine is still generating
    await asyncio.wait_for(engine.abort_seen.wait(), 5)
    assert engine.aborted == [engine.requests[0].request_id]


async def test_disconnect_non_stream_aborts(client, factory):
    engine = engine_of(factory)
    engine.hold = Hold(after=1)
    task = asyncio.create_task(client.post("/v1/chat/completions", json=CHAT))
    await asyncio.wait_for(engine.hold.reached.wait(), 5)
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    await asyncio.wait_for(engine.abort_seen.wait(), 5)
    assert engine.aborted == [engine.requests[0].request_id]


# --------------------------------------------------------------------------- auth
async def test_api_key(aiohttp_client, factory, tmp_path):
    client = await start(aiohttp_client, factory, make_config(tmp_path, api_key="sk-1", admin_api_key="admin"))
    assert (await client.get("/health")).status == 200
    error = await error_of(await client.post("/v1/chat/completions", json=CHAT), 401)
    assert error["code"] == "invalid_api_key" and error["type"] == "authentication_error"
    await error_of(await client.post("/v1/chat/completions", json=CHAT, headers={"Authorization": "Bearer nope"}), 401)
    ok = await client.post("/v1/chat/completions", json=CHAT, headers={"Authorization": "Bearer sk-1"})
    assert ok.status == 200
    await error_of(await client.get("/metrics"), 401)
    assert (await client.get("/v1/models", headers={"Authorization": "Bearer sk-1"})).status == 200
    delete = await client.delete("/v1/models/fake", headers={"Authorization": "Bearer sk-1"})
    await error_of(delete, 403)
    delete = await client.delete("/v1/models/fake", headers={"Authorization": "Bearer admin"})
    assert delete.status == 200, await delete.text()


# --------------------------------------------------------------------------- batch
async def test_batch_chat_with_a_per_item_error(client, factory):
    body = {"model": "fake", "max_tokens": 5, "messages_batch": [
        [{"role": "user", "content": "a"}], [{"role": "user", "content": "x" * 300}], [{"role": "user", "content": "c"}]]}
    response = await client.post("/v1/batch/chat/completions", json=body)
    assert response.status == 200, await response.text()
    result = await response.json()
    assert result["object"] == "batch.chat.completion"
    data = result["data"]
    assert [item["index"] for item in data] == [0, 1, 2]
    assert data[0]["error"] is None and data[0]["response"]["choices"][0]["message"]["content"] == "Hello"
    assert data[1]["response"] is None and data[1]["error"]["code"] == "context_length_exceeded"
    assert data[2]["response"]["object"] == "chat.completion"
    assert result["usage"]["completion_tokens"] == 10
    assert len(engine_of(factory).requests) == 2


async def test_batch_completions_in_order(client, factory):
    engine_of(factory).script = lambda request: [f"#{request.prompt_token_ids[-1] - 48}"]
    body = {"model": "fake", "prompts": ["0", "1", [50]], "temperature": 0}
    result = await (await client.post("/v1/batch/completions", json=body)).json()
    assert [item["response"]["choices"][0]["text"] for item in result["data"]] == ["#0", "#1", "#2"]


async def test_batch_size_limit(aiohttp_client, factory, tmp_path):
    client = await start(aiohttp_client, factory, make_config(tmp_path, max_batch_request_items=2))
    error = await error_of(await client.post("/v1/batch/completions", json={"model": "fake", "prompts": ["a"] * 3}), 400)
    assert error["param"] == "prompts"


# --------------------------------------------------------------------------- tokenizer endpoints
async def test_tokenize_prompt_and_detokenize(client):
    body = await (await client.post("/tokenize", json={"model": "fake", "prompt": "hi", "return_token_strs": True})).json()
    assert body == {"count": 3, "max_model_len": 256, "tokens": [BOS, 104, 105],
                    "token_strs": ["<|begin_of_text|>", "h", "i"]}
    body = await (await client.post("/detokenize", json={"model": "fake", "tokens": [104, 105]})).json()
    assert body == {"prompt": "hi"}


async def test_tokenize_messages_with_tools(client, factory):
    body = {"model": "fake", "messages": [{"role": "user", "content": "hi"}], "tools": TOOLS,
            "add_generation_prompt": False}
    result = await (await client.post("/tokenize", json=body)).json()
    expected = engine_of(factory).chat_format.encode_dialog(
        *engine_of(factory).chat_format.dialogs[0][:1], tools=engine_of(factory).chat_format.dialogs[0][1],
        add_generation_prompt=False)
    assert result["tokens"] == expected and result["count"] == len(expected)
    assert not bytes(t for t in result["tokens"] if t < 256).decode().endswith("<|assistant|>")


async def test_tokenize_needs_prompt_or_messages(client):
    await error_of(await client.post("/tokenize", json={"model": "fake"}), 400)


# --------------------------------------------------------------------------- ops
async def test_health_ready_and_request_id(client):
    response = await client.get("/health")
    assert response.status == 200 and len(response.headers["X-Request-Id"]) == 32
    response = await client.get("/ready", headers={"X-Request-Id": "trace-123"})
    assert response.status == 200 and (await response.json())["status"] == "ready"
    assert response.headers["X-Request-Id"] == "trace-123"
    stream = await client.post("/v1/chat/completions", json={**CHAT, "stream": True}, headers={"X-Request-Id": "s-1"})
    assert stream.headers["X-Request-Id"] == "s-1"
    error = await client.post("/v1/chat/completions", data=b"{",
                              headers={"X-Request-Id": "bad id!", "Content-Type": "application/json"})
    assert error.status == 400 and error.headers["X-Request-Id"] != "bad id!"


async def test_ready_waits_for_configured_models(aiohttp_client, tmp_path):
    factory = FakeEngineFactory()
    gate = asyncio.Event()
    original = factory.load

    async def slow_load(spec):
        await gate.wait()
        return await original(spec)

    factory.load = slow_load
    app = create_app(make_config(tmp_path), factory)
    client = await aiohttp_client(app)
    await app[STATE_KEY].startup_task
    assert (await client.get("/ready")).status == 503
    gate.set()
    async with app[REGISTRY_KEY].lease("fake"):
        pass
    assert (await client.get("/ready")).status == 200


async def test_metrics(client, factory):
    await client.post("/v1/chat/completions", json=CHAT)
    text = await (await client.get("/metrics")).text()
    for name in ("llamaserve:num_requests_running{", "llamaserve:num_requests_waiting{", "llamaserve:kv_cache_usage_perc{",
                 "llamaserve:prefix_cache_hits_total{", "llamaserve:prefix_cache_queries_total{",
                 "llamaserve:prompt_tokens_total{", "llamaserve:generation_tokens_total{model_name=\"fake\"} 12.0",
                 "llamaserve:time_to_first_token_seconds_count{model_name=\"fake\"} 1.0",
                 "llamaserve:e2e_request_latency_seconds_bucket", "llamaserve:time_per_output_token_seconds",
                 'llamaserve:request_success_total{finished_reason="stop",model_name="fake"} 1.0',
                 "llamaserve:model_loads_total", "llamaserve:models_loaded 1.0", "llamaserve:http_requests_total{"):
        assert name in text, name
    again = await (await client.get("/metrics")).text()  # drained observations stay counted
    assert "llamaserve:time_to_first_token_seconds_count{model_name=\"fake\"} 1.0" in again


async def test_metrics_count_preemptions_by_priority(client, factory):
    await client.post("/v1/chat/completions", json=CHAT)
    factory.engines["fake"]._stats.num_preempted_by_priority = {1: 3}  # batch items preempted by online ones
    text = await (await client.get("/metrics")).text()
    assert 'llamaserve:num_preemptions_total{model_name="fake",priority="0"} 0.0' in text
    assert 'llamaserve:num_preemptions_total{model_name="fake",priority="1"} 3.0' in text


VLLM_HISTOGRAMS = ("time_to_first_token_seconds", "inter_token_latency_seconds", "time_per_output_token_seconds",
                   "request_time_per_output_token_seconds", "e2e_request_latency_seconds", "request_queue_time_seconds",
                   "request_prefill_time_seconds", "request_decode_time_seconds")


async def test_metrics_under_vllm_names_read_as_the_endpoint_picker_reads_them(client, factory):
    """The Gateway API Inference Extension's endpoint picker parses /metrics with a Prometheus text parser
    and reads vllm:num_requests_waiting, vllm:num_requests_running and vllm:kv_cache_usage_perc by model_name."""
    from prometheus_client.parser import text_string_to_metric_families

    await client.post("/v1/chat/completions", json=CHAT)
    stats = factory.engines["fake"]._stats
    stats.num_running, stats.num_waiting, stats.kv_blocks_used, stats.kv_blocks_total = 2, 3, 5, 8
    for attribute in ("observations_itl_s", "observations_tpot_s", "observations_queue_s", "observations_prefill_s",
                      "observations_decode_s"):
        setattr(stats, attribute, [0.02])
    families = {family.name: family for family in text_string_to_metric_families(
        await (await client.get("/metrics")).text())}

    def value(name: str, **labels: str) -> float:
        samples = [s for s in families[name].samples if s.name in (name, f"{name}_total") and s.labels == labels]
        assert len(samples) == 1, (name, labels, families[name].samples)
        return samples[0].value

    assert value("vllm:num_requests_waiting", model_name="fake") == 3
    assert value("vllm:num_requests_running", model_name="fake") == 2
    for name in ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"):
        assert families[name].type == "gauge" and 0.0 <= value(name, model_name="fake") == 5 / 8 <= 1.0
    assert families["vllm:prompt_tokens"].type == "counter" and value("vllm:prompt_tokens", model_name="fake") > 0
    assert value("vllm:generation_tokens", model_name="fake") == 12
    assert value("vllm:request_success", model_name="fake", finished_reason="stop") == 1
    for name in VLLM_HISTOGRAMS:
        family = families[f"vllm:{name}"]
        assert family.type == "histogram", name
        counts = [s for s in family.samples if s.name.endswith("_count")]
        assert [s.labels for s in counts] == [{"model_name": "fake"}] and counts[0].value == 1, name
        assert any(s.labels.get("le") == "+Inf" for s in family.samples), name
    assert value("llamaserve:num_requests_waiting", model_name="fake") == 3  # our own names stay


async def test_chat_echo_starts_the_reply_with_the_continued_message(client):
    """vLLM's echo with continue_final_message: the answer repeats the open assistant message first."""
    body = {**CHAT, "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Well,"}],
            "add_generation_prompt": False, "continue_final_message": True, "echo": True}
    reply = await (await client.post("/v1/chat/completions", json=body)).json()
    assert reply["choices"][0]["message"]["content"] == "Well,Hello world!"
    events = sse_events(await (await client.post("/v1/chat/completions", json={**body, "stream": True})).text())
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": "Well,"}
    assert "".join(e["choices"][0]["delta"].get("content", "") for e in events[:-1] if e["choices"]) == "Well,Hello world!"
    refused = await client.post("/v1/chat/completions", json={**body, "add_generation_prompt": True})
    assert refused.status == 400 and (await refused.json())["error"]["param"] == "continue_final_message"


async def test_idle_model_unloads_to_registered_and_the_next_request_reloads_it(aiohttp_client, factory, tmp_path):
    """--keep-alive 0: idle means unloaded at the next sweep (the app sweeps every second; here the test
    sweeps itself), and a request after that loads the model again, as a first request does."""
    client = await start(aiohttp_client, factory, make_config(tmp_path, keep_alive=0.0))
    registry = client.app[REGISTRY_KEY]
    first = engine_of(factory)
    assert (await client.post("/v1/chat/completions", json=CHAT)).status == 200
    assert registry.sweep_idle() == ["fake"]
    model = await (await client.get("/v1/models/fake")).json()
    assert model["status"] == "registered" and model["keep_alive_s"] == 0.0
    reply = await client.post("/v1/chat/completions", json=CHAT)
    assert reply.status == 200 and engine_of(factory) is not first and first.is_shut_down
    assert "llamaserve:model_idle_unloads_total 1.0" in await (await client.get("/metrics")).text()
