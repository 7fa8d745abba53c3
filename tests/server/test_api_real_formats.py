"""The API over the real Llama 3.1 tokenizer, chat format and tool-call parser (no weights):
a scripted engine emits token ids, so tool calls go through H4's parser exactly as in production."""

from __future__ import annotations

import json
from pathlib import Path
from typing import AsyncIterator, Callable

import pytest

from compat.structured import tool_plan
from compat import protocol as p
from compat import to_engine
from engine.types import EngineRequest, EngineStats, RequestOutput, SamplingDefaults
from server.app import STATE_KEY, create_app
from server.config import ServerConfig
from server.registry import REGISTRY_KEY
from tests.server.fake_engine import fake_spec
from tests.server.test_api import sse_events

llama_models = pytest.importorskip("llama_models")
TOKENIZER_PATH = Path(llama_models.__file__).parent / "llama3" / "tokenizer.model"

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Current weather",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                          "required": ["city"]}}}]
ASK = {"model": "llama", "messages": [{"role": "user", "content": "Weather in Paris?"}]}


@pytest.fixture(scope="module")
def tokenizer():
    from engine.tokenizers.tokenizer import llama3_tokenizer

    return llama3_tokenizer(TOKENIZER_PATH)


class ScriptedTokenEngine:
    """EngineClient whose outputs are scripted token ids, decoded as the real engine decodes them."""

    def __init__(self, tokenizer, script: Callable[[], tuple[list[list[int]], int]]) -> None:
        from engine.chat.llama3 import Llama3ChatFormat

        self.model_id = "llama"
        self.max_seq_len = 4096
        self.tokenizer = tokenizer
        self.chat_format = Llama3ChatFormat(tokenizer, version="3.1")
        self.sampling_defaults = SamplingDefaults()
        self.max_sequences_per_request = 256
        self.script = script
        self.requests: list[EngineRequest] = []

    async def generate(self, request: EngineRequest) -> AsyncIterator[RequestOutput]:
        self.requests.append(request)
        pieces, stop_id = self.script()
        produced = 0
        for i, ids in enumerate(pieces):
            produced += len(ids)
            last = i == len(pieces) - 1
            text = self.tokenizer.decode(ids, skip_special_tokens=request.params.skip_special_tokens)
            yield RequestOutput(request.request_id, ids, text, finish_reason="stop" if last else None,
                                stop_reason=stop_id if last else None,
                                num_prompt_tokens=len(request.prompt_token_ids), num_output_tokens=produced + last)

    async def abort(self, request_id: str) -> None:
        pass

    is_dead = False

    def stats(self) -> EngineStats:
        return EngineStats()

    async def shutdown(self) -> None:
        pass


class Factory:
    def __init__(self, engine: ScriptedTokenEngine) -> None:
        self.engine = engine

    def estimate_memory_bytes(self, spec) -> int:
        return 1

    async def load(self, spec) -> ScriptedTokenEngine:
        return self.engine


async def start(aiohttp_client, tmp_path, engine):
    app = create_app(ServerConfig(models=[fake_spec("llama", tmp_path)], checkpoint_roots=[tmp_path]), Factory(engine))
    client = await aiohttp_client(app)
    await app[STATE_KEY].startup_task
    async with app[REGISTRY_KEY].lease("llama"):
        pass
    return client


def tool_call_script(tokenizer):
    python_tag = tokenizer.special_token_id("<|python_tag|>")
    eom = tokenizer.special_token_id("<|eom_id|>")
    body = tokenizer.encode('{"name": "get_weather", "parameters": {"city": "Paris"}}')
    return lambda: ([[python_tag], *[[t] for t in body]], eom)


async def test_tool_call_through_the_real_parser(aiohttp_client, tmp_path, tokenizer):
    engine = ScriptedTokenEngine(tokenizer, tool_call_script(tokenizer))
    client = await start(aiohttp_client, tmp_path, engine)
    body = await (await client.post("/v1/chat/completions", json={**ASK, "tools": TOOLS})).json()
    choice = body["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    [call] = choice["message"]["tool_calls"]
    assert call["type"] == "function" and call["id"].startswith("call_")
    assert call["function"]["name"] == "get_weather" and json.loads(call["function"]["arguments"]) == {"city": "Paris"}
    request = engine.requests[0]
    assert request.params.skip_special_tokens is False
    req = p.CHAT_DECODER.decode(json.dumps({**ASK, "tools": TOOLS}).encode())
    expected = engine.chat_format.encode_dialog(to_engine.chat_messages(req.messages), tools=tool_plan(req, supports_tools=True).tools)
    assert request.prompt_token_ids == expected


async def test_streamed_tool_call_through_the_real_parser(aiohttp_client, tmp_path, tokenizer):
    engine = ScriptedTokenEngine(tokenizer, tool_call_script(tokenizer))
    client = await start(aiohttp_client, tmp_path, engine)
    events = sse_events(await (await client.post("/v1/chat/completions",
                                                 json={**ASK, "tools": TOOLS, "stream": True})).text())
    assert events[-1] == "[DONE]"
    choices = [c["choices"][0] for c in events[1:-1]]
    calls = [tc for c in choices for tc in c["delta"].get("tool_calls", [])]
    assert calls[0]["id"].startswith("call_") and calls[0]["function"]["name"] == "get_weather"
    assert json.loads("".join(tc["function"].get("arguments", "") for tc in calls)) == {"city": "Paris"}
    assert not any(c["delta"].get("content") for c in choices)  # the tag and JSON never leak as text
    assert choices[-1]["finish_reason"] == "tool_calls"


async def test_plain_answer_with_tools_offered(aiohttp_client, tmp_path, tokenizer):
    eot = tokenizer.special_token_id("<|eot_id|>")
    words = [tokenizer.encode(w) for w in ["It", " is", " sunny", "."]]
    engine = ScriptedTokenEngine(tokenizer, lambda: (words, eot))
    client = await start(aiohttp_client, tmp_path, engine)
    body = await (await client.post("/v1/chat/completions", json={**ASK, "tools": TOOLS})).json()
    assert body["choices"][0]["message"]["content"] == "It is sunny." and body["choices"][0]["finish_reason"] == "stop"
    events = sse_events(await (await client.post("/v1/chat/completions",
                                                 json={**ASK, "tools": TOOLS, "stream": True})).text())
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in events[:-1]) == "It is sunny."


async def test_tokenize_renders_the_llama3_prompt(aiohttp_client, tmp_path, tokenizer):
    engine = ScriptedTokenEngine(tokenizer, lambda: ([[1]], 0))
    client = await start(aiohttp_client, tmp_path, engine)
    body = await (await client.post("/tokenize", json={**ASK, "return_token_strs": True})).json()
    text = "".join(body["token_strs"])
    assert text.startswith("<|begin_of_text|><|start_header_id|>system<|end_header_id|>")
    assert text.endswith("Weather in Paris?<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n")
    detok = await (await client.post("/detokenize", json={"model": "llama", "tokens": body["tokens"]})).json()
    assert detok["prompt"] == text
