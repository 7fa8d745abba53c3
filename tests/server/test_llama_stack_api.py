"""Llama Stack's native inference API over the real Llama 3.2 and Llama 4 tokenizers, chat formats and
tool-call parser (no weights): a scripted engine emits token ids, and records the prompts it was given,
so a conversation sent natively and through the OpenAI API can be compared token for token."""

from __future__ import annotations

import json

import pytest

from compat import llama_stack as ls
from engine.chat.common import tool_definitions_json
from engine.types import ToolDefinition
from tests.engine.tokenizer_fixtures import real_llama3, real_llama4
from tests.server.test_api import sse_events
from tests.server.test_api_real_formats import ScriptedTokenEngine, start

pytest.importorskip("llama_models")

# One tool, as each API spells it: the native definition becomes exactly this JSON schema.
NATIVE_TOOLS = [{"tool_name": "get_weather", "description": "Current weather",
                 "parameters": {"city": {"param_type": "string", "description": "City name", "required": True}}}]
OPENAI_TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Current weather",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "description": "City name"}},
                   "required": ["city"]}}}]
GREEDY = {"strategy": {"type": "greedy"}, "max_tokens": 32}


def engine_for(family: str, script) -> ScriptedTokenEngine:
    from engine.chat.llama3 import Llama3ChatFormat
    from engine.chat.llama4 import Llama4ChatFormat

    tokenizer = real_llama4() if family == "llama4" else real_llama3()
    engine = ScriptedTokenEngine(tokenizer, script)
    engine.chat_format = Llama4ChatFormat(tokenizer) if family == "llama4" else Llama3ChatFormat(tokenizer, version="3.2")
    return engine


def call_script(tokenizer, end_token: str):
    """The model answers `[get_weather(city="Paris")]` and ends with `end_token`."""
    ids = tokenizer.encode('[get_weather(city="Paris")]')
    return lambda: ([[t] for t in ids], tokenizer.special_token_id(end_token))


def text_script(tokenizer, end_token: str, words=("It", " is", " sunny", ".")):
    return lambda: ([tokenizer.encode(w) for w in words], tokenizer.special_token_id(end_token))


# --------------------------------------------------------------------------- multi-turn tool calls
END_OF_CALL = {"llama3_2": ("<|eot_id|>", "end_of_turn"), "llama4": ("<|eom|>", "end_of_message")}


@pytest.mark.parametrize("family", ["llama3_2", "llama4"])
async def test_multi_turn_tool_calls_render_the_same_tokens_as_openai(aiohttp_client, tmp_path, family):
    end_token, stop_reason = END_OF_CALL[family]
    tokenizer = real_llama4() if family == "llama4" else real_llama3()
    engine = engine_for(family, call_script(tokenizer, end_token))
    client = await start(aiohttp_client, tmp_path, engine)

    native = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Paris?"}]
    openai = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Paris?"}]

    async def both_render_alike() -> dict:
        engine.requests.clear()
        answer = await client.post("/v1/inference/chat-completion",
                                   json={"model_id": "llama", "messages": native, "tools": NATIVE_TOOLS,
                                         "sampling_params": GREEDY})
        assert answer.status == 200, await answer.text()
        reference = await client.post("/v1/chat/completions", json={"model": "llama", "messages": openai,
                                                                   "tools": OPENAI_TOOLS, "temperature": 0,
                                                                   "max_tokens": 32})
        assert reference.status == 200, await reference.text()
        native_request, openai_request = engine.requests
        assert native_request.prompt_token_ids == openai_request.prompt_token_ids
        assert native_request.params == openai_request.params
        return await answer.json()

    # Turn 1: the model calls the tool.
    body = await both_render_alike()
    message = body["completion_message"]
    assert message["stop_reason"] == stop_reason and message["content"] == ""
    [call] = message["tool_calls"]
    assert call["tool_name"] == "get_weather" and call["arguments"] == {"city": "Paris"}
    assert json.loads(call["arguments_json"]) == {"city": "Paris"}
    metrics = {m["metric"]: m["value"] for m in body["metrics"]}
    assert metrics["prompt_tokens"] == len(engine.requests[0].prompt_token_ids)

    # Turn 2: the call and its result go back, natively as the client returned them.
    native += [message, {"role": "tool", "call_id": call["call_id"], "content": "18 C and sunny"}]
    openai += [{"role": "assistant", "content": None, "tool_calls": [
        {"id": call["call_id"], "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": call["call_id"], "content": "18 C and sunny"}]
    engine.script = text_script(tokenizer, "<|eot|>" if family == "llama4" else "<|eot_id|>")
    body = await both_render_alike()
    assert body["completion_message"] == {"role": "assistant", "content": "It is sunny.", "stop_reason": "end_of_turn",
                                          "tool_calls": []}

    # Turn 3: the answer and a follow-up.
    native += [body["completion_message"], {"role": "user", "content": [{"type": "text", "text": "And tomorrow?"}]}]
    openai += [{"role": "assistant", "content": "It is sunny."}, {"role": "user", "content": "And tomorrow?"}]
    await both_render_alike()


async def test_streamed_tool_call_events(aiohttp_client, tmp_path):
    tokenizer = real_llama3()
    engine = engine_for("llama3_2", call_script(tokenizer, "<|eot_id|>"))
    client = await start(aiohttp_client, tmp_path, engine)
    response = await client.post("/v1/inference/chat-completion", json={
        "model_id": "llama", "messages": [{"role": "user", "content": "Weather in Paris?"}], "tools": NATIVE_TOOLS,
        "stream": True})
    events = [e["event"] for e in sse_events(await response.text())]  # no [DONE]: every event is JSON
    assert [e["event_type"] for e in events] == ["start", "progress", "complete"]
    call = events[1]["delta"]
    assert call["type"] == "tool_call" and call["parse_status"] == "succeeded"
    assert call["tool_call"]["tool_name"] == "get_weather" and call["tool_call"]["arguments"] == {"city": "Paris"}
    assert events[-1]["stop_reason"] == "end_of_turn"


async def test_system_message_behavior_replace(aiohttp_client, tmp_path):
    tokenizer = real_llama3()
    engine = engine_for("llama3_2", call_script(tokenizer, "<|eot_id|>"))
    client = await start(aiohttp_client, tmp_path, engine)
    system = "Tools you may call:\n{{function_definitions}}\nCall them in a Python list."
    response = await client.post("/v1/inference/chat-completion", json={
        "model_id": "llama", "tools": NATIVE_TOOLS, "tool_config": {"system_message_behavior": "replace"},
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": "Weather in Paris?"}]})
    body = await response.json()
    assert body["completion_message"]["tool_calls"][0]["arguments"] == {"city": "Paris"}  # still parsed
    definitions = tool_definitions_json([ToolDefinition("get_weather", "Current weather", ls.tool_schema(
        ls.ToolDefinitionIn(tool_name="get_weather", description="Current weather",
                            parameters={"city": ls.ToolParamDefinition(param_type="string", description="City name")})))])
    expected = engine.chat_format.encode_dialog(
        [_message("system", system.replace("{{function_definitions}}", definitions)), _message("user", "Weather in Paris?")])
    assert engine.requests[0].prompt_token_ids == expected
    assert engine.requests[0].params.skip_special_tokens is False


def _message(role: str, content: str):
    from engine.types import ChatMessage

    return ChatMessage(role, content)  # type: ignore[arg-type]


# --------------------------------------------------------------------------- plain chat, completion, batch
async def test_plain_chat_completion_and_batches(aiohttp_client, tmp_path):
    tokenizer = real_llama3()
    engine = engine_for("llama3_2", text_script(tokenizer, "<|eot_id|>"))
    client = await start(aiohttp_client, tmp_path, engine)
    chat = {"model_id": "llama", "messages": [{"role": "user", "content": "hi"}]}
    body = await (await client.post("/v1/inference/chat-completion", json=chat)).json()
    assert body["completion_message"]["content"] == "It is sunny."
    assert engine.requests[-1].params.temperature == 0.0  # Llama Stack's default strategy is greedy

    events = sse_events(await (await client.post("/v1/inference/chat-completion", json={**chat, "stream": True})).text())
    assert "".join(e["event"]["delta"]["text"] for e in events if e["event"]["event_type"] == "progress") == "It is sunny."
    assert events[-1]["event"]["event_type"] == "complete" and events[-1]["metrics"][0]["metric"] == "prompt_tokens"

    body = await (await client.post("/v1/inference/completion", json={"model_id": "llama", "content": "Once"})).json()
    assert body["content"] == "It is sunny." and body["stop_reason"] == "end_of_turn"
    assert engine.requests[-1].prompt_token_ids == tokenizer.encode("Once", bos=True)

    batch = await (await client.post("/v1/inference/batch-completion",
                                     json={"model_id": "llama", "content_batch": ["a", "b"]})).json()
    assert [item["content"] for item in batch["batch"]] == ["It is sunny."] * 2
    batch = await (await client.post("/v1/inference/batch-chat-completion",
                                     json={"model_id": "llama", "messages_batch": [chat["messages"]] * 3})).json()
    assert [item["completion_message"]["content"] for item in batch["batch"]] == ["It is sunny."] * 3


def test_sampling_strategies_map_onto_openai_sampling():
    def fields(sampling):
        req = ls.CHAT_DECODER.decode(json.dumps({"model_id": "m", "messages": [{"role": "user", "content": "x"}],
                                                 "sampling_params": sampling}).encode())
        chat, _ = ls.chat_request(req, req.messages, "llama3_2")
        return chat.temperature, chat.top_p, chat.top_k, chat.max_tokens, chat.repetition_penalty, chat.stop

    assert fields({"strategy": {"type": "greedy"}}) == (0.0, None, None, None, None, None)
    assert fields({"strategy": {"type": "top_p", "temperature": 0.7, "top_p": 0.9}, "max_tokens": 5,
                   "repetition_penalty": 1.2, "stop": ["\n"]}) == (0.7, 0.9, None, 5, 1.2, ["\n"])
    assert fields({"strategy": {"type": "top_p"}, "max_tokens": 0, "repetition_penalty": 0}) == (1.0, 0.95, None, None, None, None)
    assert fields({"strategy": {"type": "top_k", "top_k": 40}})[:3] == (1.0, None, 40)


@pytest.mark.parametrize("body,status,param", [
    ({"messages": [{"role": "user", "content": [{"type": "image", "image": {"url": {"uri": "http://x"}}}]}]}, 400,
     "messages[0].content[0]"),
    ({"tools": NATIVE_TOOLS, "tool_config": {"tool_prompt_format": "json"}}, 400, "tool_config.tool_prompt_format"),
    ({"tool_prompt_format": "function_tag", "tools": NATIVE_TOOLS}, 400, "tool_config.tool_prompt_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {}}}, 400, "response_format"),
    ({"sampling_params": {"strategy": {"type": "beam"}}}, 400, "sampling_params.strategy.type"),
    ({"bogus": 1}, 400, "bogus"),
])
async def test_refusals_name_the_field(aiohttp_client, tmp_path, body, status, param):
    engine = engine_for("llama3_2", text_script(real_llama3(), "<|eot_id|>"))
    client = await start(aiohttp_client, tmp_path, engine)
    request = {"model_id": "llama", "messages": [{"role": "user", "content": "hi"}], **body}
    response = await client.post("/v1/inference/chat-completion", json=request)
    assert response.status == status, await response.text()
    error = (await response.json())["error"]
    assert error["param"] == param and error["message"]


async def test_unknown_model_is_404(aiohttp_client, tmp_path):
    client = await start(aiohttp_client, tmp_path, engine_for("llama3_2", text_script(real_llama3(), "<|eot_id|>")))
    for path, body in [("chat-completion", {"messages": [{"role": "user", "content": "hi"}]}),
                       ("completion", {"content": "hi"}), ("batch-completion", {"content_batch": ["hi"]})]:
        response = await client.post(f"/v1/inference/{path}", json={"model_id": "nope", **body})
        assert response.status == 404, await response.text()
        assert "nope" in (await response.json())["error"]["message"]


async def test_python_list_is_accepted_where_the_format_speaks_it(aiohttp_client, tmp_path):
    tokenizer = real_llama3()
    engine = engine_for("llama3_2", call_script(tokenizer, "<|eot_id|>"))
    client = await start(aiohttp_client, tmp_path, engine)
    response = await client.post("/v1/inference/chat-completion", json={
        "model_id": "llama", "messages": [{"role": "user", "content": "Weather?"}], "tools": NATIVE_TOOLS,
        "tool_config": {"tool_prompt_format": "python_list", "tool_choice": "auto"}})
    assert response.status == 200, await response.text()


async def test_batch_completions_take_meta_reference_content_batch(aiohttp_client, tmp_path):
    engine = engine_for("llama3_2", text_script(real_llama3(), "<|eot_id|>"))
    client = await start(aiohttp_client, tmp_path, engine)
    body = {"model": "llama", "max_tokens": 4}
    named = await (await client.post("/v1/batch/completions", json={**body, "content_batch": ["a", "b"]})).json()
    assert [item["response"]["choices"][0]["text"] for item in named["data"]] == ["It is sunny."] * 2
    for wrong in ({"content_batch": ["a"], "prompts": ["a"]}, {}):
        response = await client.post("/v1/batch/completions", json={**body, **wrong})
        assert response.status == 400 and (await response.json())["error"]["param"] == "prompts"


async def test_completion_logprobs(aiohttp_client, tmp_path):
    engine = engine_for("llama3_2", text_script(real_llama3(), "<|eot_id|>"))
    client = await start(aiohttp_client, tmp_path, engine)
    body = {"model_id": "llama", "content": "Once", "logprobs": {"top_k": 0}}
    ok = await client.post("/v1/inference/completion", json=body)
    assert ok.status == 200, await ok.text()
    assert engine.requests[-1].params.logprobs == 0  # the sampled token's logprob only
    too_many = await client.post("/v1/inference/completion", json={**body, "logprobs": {"top_k": 6}})
    assert too_many.status == 400 and (await too_many.json())["error"]["param"] == "logprobs.top_k"
