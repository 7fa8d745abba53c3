"""Property-based fuzzing (issue 16), on the fake engine over a real socket: every route of our own
/openapi.json through schemathesis, and hypothesis strategies for chat messages and tools. Any
input gets a 2xx or a 4xx in OpenAI's error shape; never a 5xx, never a traceback. Bounded: a fixed
number of examples per route, derandomized, so CI time stays around a minute."""

from __future__ import annotations

import asyncio
import json
import threading
from pathlib import Path
from typing import Iterator

import pytest
from aiohttp import web
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from server.app import STATE_KEY, create_app
from server.openapi import build_document
from tests.server.fake_engine import FakeEngineFactory
from tests.server.test_api import make_config

schemathesis = pytest.importorskip("schemathesis")

EXAMPLES_PER_ROUTE = 40
FUZZ_SETTINGS = settings(max_examples=EXAMPLES_PER_ROUTE, deadline=None, derandomize=True, database=None,
                         suppress_health_check=list(HealthCheck))


class LiveApp:
    """The app on 127.0.0.1:<free port>, served by its own event loop on a thread."""

    def __init__(self, tmp_path: Path) -> None:
        self.app = create_app(make_config(tmp_path, max_body_bytes=1 << 20), FakeEngineFactory())
        self.loop = asyncio.new_event_loop()
        self.runner = web.AppRunner(self.app, handler_cancellation=True)
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)

    def __enter__(self) -> "LiveApp":
        self.thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self.loop).result(30)
        return self

    async def _start(self) -> None:
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]
        await self.app[STATE_KEY].startup_task

    def __exit__(self, *exc: object) -> None:
        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(30)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


@pytest.fixture(scope="module")
def live(tmp_path_factory) -> Iterator[LiveApp]:
    with LiveApp(tmp_path_factory.mktemp("fuzz")) as app:
        yield app


def check_response(status: int, content_type: str, body: bytes, what: str) -> None:
    assert status < 500, f"{what}: {status} {body[:500]!r}"
    if status >= 400 and status != 405 and what.startswith("POST /v1/messages"):  # Anthropic's routes: its shape
        error = json.loads(body)
        assert error["type"] == "error" and set(error["error"]) == {"type", "message"}, f"{what}: {body[:500]!r}"
    elif status >= 400 and status != 405:  # aiohttp's 405 for HEAD etc. still has our error body
        error = json.loads(body)["error"]
        assert set(error) == {"message", "type", "param", "code"}, f"{what}: {body[:500]!r}"
    if status >= 400:
        assert b"Traceback" not in body, what


def test_openapi_document_lists_every_route_with_its_request_type(live):
    import requests

    document = requests.get(live.base_url + "/openapi.json", timeout=30).json()
    assert document["openapi"].startswith("3.1")
    for route in live.app.router.routes():
        if route.method == "HEAD":
            continue
        from server.openapi import openapi_path

        path, _ = openapi_path(route.resource.canonical)
        operation = document["paths"].get(path, {}).get(route.method.lower())
        assert operation is not None, f"{route.method} {path} is missing from /openapi.json"
        if route.method == "POST":
            assert "requestBody" in operation, f"POST {path} has no request schema (server/openapi.py REQUEST_TYPES)"
    ref = document["paths"]["/v1/chat/completions"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    schema = document["components"]["schemas"][ref["$ref"].rsplit("/", 1)[1]]
    assert schema["properties"]["stop_token_ids"]["anyOf"][0]["maxItems"] > 0  # the bounds come from msgspec Meta


def operations(document: dict) -> list[tuple[str, str]]:
    return [(method.upper(), path) for path, item in document["paths"].items() for method in item]


_DOCUMENT = None


def _document() -> dict:
    global _DOCUMENT
    if _DOCUMENT is None:
        from server.config import ServerConfig

        _DOCUMENT = build_document(create_app(ServerConfig(), FakeEngineFactory()))
    return _DOCUMENT


@pytest.mark.timeout(300)
@pytest.mark.parametrize("method,path", operations(_document()))
def test_schemathesis_fuzzes_every_route(live, method, path):
    schema = schemathesis.openapi.from_dict(_document())
    operation = schema[path][method].ok() if hasattr(schema[path][method], "ok") else schema[path][method]

    @FUZZ_SETTINGS
    @given(case=operation.as_strategy())
    def check(case):
        if isinstance(case.body, dict) and "model" in case.body:
            case.body["model"] = "fake"  # past the model lookup, into the request's own checks
        if case.path_parameters and "model_id" in case.path_parameters and method == "GET":
            case.path_parameters["model_id"] = "fake"
        response = case.call(base_url=live.base_url, timeout=30)
        check_response(response.status_code, response.headers.get("content-type", ""), response.content,
                       f"{method} {path} {case.body!r:.300}")

    check()


# --------------------------------------------------------------------------- hypothesis: messages and tools
json_leaf = st.none() | st.booleans() | st.integers(-10**20, 10**20) | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=20)
json_value = st.recursive(json_leaf, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
                          max_leaves=30)
content = st.text(max_size=200) | st.lists(
    st.fixed_dictionaries({"type": st.sampled_from(["text", "image_url", "bogus"]), "text": st.text(max_size=50)}),
    max_size=3) | json_value
tool_call = st.fixed_dictionaries({
    "id": st.text(max_size=10), "type": st.just("function"),
    "function": st.fixed_dictionaries({"name": st.text(max_size=10),
                                       "arguments": st.one_of(st.text(max_size=40), json_value.map(json.dumps))}),
})
message = st.one_of(
    st.fixed_dictionaries({"role": st.sampled_from(["system", "developer", "user", "bogus"]), "content": content}),
    st.fixed_dictionaries({"role": st.just("assistant")},
                          optional={"content": content | st.none(), "tool_calls": st.lists(tool_call, max_size=2)}),
    st.fixed_dictionaries({"role": st.just("tool"), "content": content, "tool_call_id": st.text(max_size=10)}),
    json_value,
)
tool = st.fixed_dictionaries({"type": st.sampled_from(["function", "other"]), "function": st.fixed_dictionaries(
    {"name": st.text(max_size=70)}, optional={"description": st.text(max_size=30), "parameters": json_value,
                                              "strict": st.booleans()})})
chat_body = st.fixed_dictionaries(
    {"model": st.sampled_from(["fake", "nope"]), "messages": st.lists(message, max_size=4)},
    optional={"tools": st.lists(tool, max_size=3), "tool_choice": st.sampled_from(["auto", "none", "required"]) | json_value,
              "stream": st.booleans(), "n": st.integers(-1, 200), "max_tokens": st.integers(-1, 10**6),
              "stop": st.text(max_size=5) | st.lists(st.text(max_size=5), max_size=20),
              "logit_bias": st.dictionaries(st.text(max_size=6), st.floats(-200, 200), max_size=3),
              "stop_token_ids": st.lists(st.integers(-5, 10**6), max_size=5)},
)


@pytest.mark.timeout(300)
def test_hypothesis_chat_messages_and_tools_never_5xx(live):
    import requests

    session = requests.Session()

    @settings(max_examples=150, deadline=None, derandomize=True, database=None, suppress_health_check=list(HealthCheck))
    @given(body=chat_body)
    def check(body):
        response = session.post(live.base_url + "/v1/chat/completions", json=body, timeout=30)
        check_response(response.status_code, response.headers.get("content-type", ""), response.content, repr(body)[:300])

    check()


# --------------------------------------------------------------------------- hypothesis: Responses items, Anthropic blocks
part = st.fixed_dictionaries({"type": st.sampled_from(["input_text", "output_text", "input_image", "refusal", "bogus"])},
                             optional={"text": st.text(max_size=30), "image_url": st.text(max_size=10),
                                       "refusal": st.text(max_size=10), "annotations": json_value})
item = st.one_of(
    st.fixed_dictionaries({"role": st.sampled_from(["user", "assistant", "system", "developer", "bogus"]),
                           "content": st.text(max_size=50) | st.lists(part, max_size=3) | json_value},
                          optional={"type": st.sampled_from(["message", "reasoning"]), "id": st.text(max_size=8)}),
    st.fixed_dictionaries({"type": st.just("function_call"), "call_id": st.text(max_size=8), "name": st.text(max_size=8),
                           "arguments": st.text(max_size=30) | json_value.map(json.dumps)}),
    st.fixed_dictionaries({"type": st.just("function_call_output"), "call_id": st.text(max_size=8),
                           "output": st.text(max_size=30) | st.lists(part, max_size=2) | json_value}),
    json_value,
)
responses_body = st.fixed_dictionaries(
    {"model": st.sampled_from(["fake", "nope"]), "input": st.text(max_size=50) | st.lists(item, max_size=4) | json_value},
    optional={"tools": st.lists(st.fixed_dictionaries({"type": st.sampled_from(["function", "web_search"]),
                                                       "name": st.text(max_size=70)},
                                                      optional={"parameters": json_value, "strict": st.booleans()}),
                                max_size=2),
              "tool_choice": st.sampled_from(["auto", "none", "required"]) | json_value,
              "text": st.fixed_dictionaries({"format": st.fixed_dictionaries(
                  {"type": st.sampled_from(["text", "json_object", "json_schema", "bogus"])},
                  optional={"schema": json_value, "name": st.text(max_size=8)})}),
              "stream": st.booleans(), "background": st.booleans(), "store": st.booleans(),
              "previous_response_id": st.text(max_size=10), "max_output_tokens": st.integers(-1, 10**6),
              "instructions": st.text(max_size=20) | json_value, "include": st.lists(st.text(max_size=30), max_size=2)},
)
block = st.fixed_dictionaries({"type": st.sampled_from(["text", "image", "tool_use", "tool_result", "thinking", "bogus"])},
                              optional={"text": st.text(max_size=30), "id": st.text(max_size=8), "name": st.text(max_size=8),
                                        "input": json_value, "tool_use_id": st.text(max_size=8),
                                        "content": st.text(max_size=20) | json_value, "source": json_value,
                                        "thinking": st.text(max_size=5), "is_error": st.booleans()})
messages_body = st.fixed_dictionaries(
    {"model": st.sampled_from(["fake", "nope"]), "max_tokens": st.integers(-1, 10**6),
     "messages": st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "assistant", "system"]),
                                                 "content": st.text(max_size=30) | st.lists(block, max_size=3)}),
                          max_size=4)},
    optional={"system": st.text(max_size=20) | json_value, "stream": st.booleans(),
              "tools": st.lists(st.fixed_dictionaries({"name": st.text(max_size=70), "input_schema": json_value}), max_size=2),
              "tool_choice": st.fixed_dictionaries({"type": st.sampled_from(["auto", "any", "tool", "none", "x"])},
                                                   optional={"name": st.text(max_size=8)}) | json_value,
              "stop_sequences": st.lists(st.text(max_size=5), max_size=20), "top_k": st.integers(-2, 100)},
)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("path", ["/v1/responses", "/v1/messages", "/v1/messages/count_tokens"])
def test_hypothesis_responses_items_and_anthropic_blocks_never_5xx(live, path):
    import requests

    session = requests.Session()
    strategy = responses_body if path == "/v1/responses" else messages_body

    @settings(max_examples=100, deadline=None, derandomize=True, database=None, suppress_health_check=list(HealthCheck))
    @given(body=strategy)
    def check(body):
        response = session.post(live.base_url + path, json=body, timeout=30)
        check_response(response.status_code, response.headers.get("content-type", ""), response.content,
                       f"POST {path} {body!r:.300}")

    check()
