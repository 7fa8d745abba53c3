"""Structured outputs and tool choice through the real clients, on tiny random-weight checkpoints.

Random weights sample garbage at temperature 1, so every valid answer here is the token mask's
doing. Each tokenizer kind is served: the Llama 3 tiktoken model (tiny e2e checkpoint), a
sentencepiece Llama 2 checkpoint (tiny trained tokenizer) and the demo's tokenizer.json (when the
demo checkpoint is cached or can be fetched)."""

from __future__ import annotations

import json
import re
from enum import Enum
from pathlib import Path
from typing import Annotated, Optional

import httpx
import jsonschema
import pytest
from pydantic import BaseModel, Field

from tests.e2e.conftest import BASE_DESCRIPTOR, E2E_PARAMS, ready_server

pytestmark = pytest.mark.timeout(900)

LLAMA2_DESCRIPTOR = "Llama-2-7b-chat"
NUM_SAMPLES = 50
ASK = [{"role": "user", "content": "Describe a person."}]


class Role(str, Enum):
    admin = "admin"
    user = "user"
    guest = "guest"


class Address(BaseModel):
    city: str = Field(max_length=12)
    zip: str = Field(pattern=r"^[0-9]{5}$")


class Person(BaseModel):
    name: str = Field(max_length=16)
    age: int = Field(ge=0, le=120)
    role: Role
    tags: list[Annotated[str, Field(max_length=8)]] = Field(max_length=3)
    address: Optional[Address]
    nickname: Optional[str] = Field(max_length=8)


class GetWeather(BaseModel):
    city: str = Field(max_length=12)
    unit: Optional[Role]  # any enum will do


WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 7}},
           "required": ["city", "days"], "additionalProperties": False}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time", "description": "Time", "parameters": {
        "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"], "additionalProperties": False}}},
]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}


# --------------------------------------------------------------------------- servers, one per tokenizer kind
@pytest.fixture(scope="module")
def llama3(checkpoints, base_checkpoint):
    # Llama 3.2's tool prompt alone is ~350 tokens
    with ready_server(BASE_DESCRIPTOR, base_checkpoint, checkpoints.root, max_seq_len=2048) as live:
        yield live


@pytest.fixture(scope="module")
def llama2(checkpoints):
    import torch

    from engine.loading.checkpoint import write_random_checkpoint
    from engine.models.args import ModelArgs
    from tests.engine.tokenizer_fixtures import tiny_llama2_path

    out = checkpoints.root / LLAMA2_DESCRIPTOR
    if not out.exists():
        args = ModelArgs(**{**E2E_PARAMS, "vocab_size": 400, "use_scaled_rope": False, "rope_theta": 10000.0})
        write_random_checkpoint(out, args, seed=3, tokenizer_path=tiny_llama2_path(), dtype=torch.float32)
    # the generic tool format's prompt is ~1,000 of this byte-level tokenizer's tokens
    with ready_server(LLAMA2_DESCRIPTOR, out, checkpoints.root, max_seq_len=2048) as live:
        yield live


@pytest.fixture(scope="module")
def demo():
    from engine.loading.demo import DEMO_MODEL_ID, DemoUnavailable, ensure_demo_checkpoint

    try:
        directory: Path = ensure_demo_checkpoint(progress=False).checkpoint_dir
    except DemoUnavailable as exc:
        pytest.skip(f"demo model unavailable: {exc}")
    with ready_server(DEMO_MODEL_ID, directory, directory.parent, dtype="float32", cpu_kv_cache_bytes=64 << 20,
                      max_seq_len=1024) as live:
        yield live


def model_of(live) -> str:
    return live.config.models[0].model_id


# --------------------------------------------------------------------------- response formats
@pytest.mark.parametrize("server", ["llama3", "llama2", "demo"])
def test_parse_nested_pydantic_always_validates(server, request):
    live = request.getfixturevalue(server)
    client = live.openai()
    people = []
    for seed in range(NUM_SAMPLES // 10):
        completion = client.chat.completions.parse(model=model_of(live), messages=ASK, response_format=Person, n=10,
                                                   seed=10 * seed, temperature=1.0, max_completion_tokens=300)
        for choice in completion.choices:
            assert choice.finish_reason == "stop", choice
            assert isinstance(choice.message.parsed, Person), choice.message.content
            people.append(choice.message.parsed)
    assert len(people) == NUM_SAMPLES
    assert len({p.model_dump_json() for p in people}) > NUM_SAMPLES // 2  # sampled, not one answer repeated


@pytest.mark.parametrize("server", ["llama3", "llama2"])
def test_json_object_regex_and_choice(server, request):
    live = request.getfixturevalue(server)
    client, model = live.openai(), model_of(live)
    # Any object: random weights may write one long string to the end of the budget, so only the
    # answers that ended ("stop") must parse; every answer opens an object.
    objects = client.chat.completions.create(model=model, messages=ASK, seed=0, n=8, max_completion_tokens=300,
                                             response_format={"type": "json_object"}).choices
    assert all(c.message.content.startswith("{") for c in objects)
    ended = [c.message.content for c in objects if c.finish_reason == "stop"]
    assert ended and all(isinstance(json.loads(text), dict) for text in ended), objects
    for seed in range(5):
        pattern = r"[A-Z][a-z]{2,5}-[0-9]{3}"
        text = client.chat.completions.create(model=model, messages=ASK, seed=seed, max_completion_tokens=50,
                                              extra_body={"guided_regex": pattern}).choices[0].message.content
        assert re.fullmatch(pattern, text), text
        choice = client.chat.completions.create(model=model, messages=ASK, seed=seed, max_completion_tokens=20,
                                                extra_body={"structured_outputs": {"choice": ["yes", "no", "maybe"]}})
        assert choice.choices[0].message.content in ("yes", "no", "maybe")
        completion = client.completions.create(model=model, prompt="Answer:", seed=seed, max_tokens=20,
                                               extra_body={"guided_choice": ["left", "right"]})
        assert completion.choices[0].text in ("left", "right")


def test_out_of_tokens_is_length_with_the_partial_text(llama3):
    response = llama3.openai().chat.completions.create(
        model=model_of(llama3), messages=ASK, seed=1, max_completion_tokens=4,
        response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": Person.model_json_schema()}})
    choice = response.choices[0]
    assert choice.finish_reason == "length" and choice.message.content.startswith('{"')
    assert response.usage.completion_tokens == 4


@pytest.mark.parametrize("body,param,words", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strin"}}}},
     "response_format.json_schema.schema", "strin"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "if": {"type": "string"}, "then": {"maxLength": 3}}}}}, "response_format.json_schema.schema", '"if"'),
    ({"guided_regex": "(a"}, "guided_regex", "unclosed"),
    ({"guided_json": "{not json"}, "guided_json", "not valid JSON"),
])
def test_bad_schemas_are_400_naming_the_field(llama3, body, param, words):
    with llama3.http() as http:
        response = http.post("/v1/chat/completions", json={"model": model_of(llama3), "messages": ASK, **body})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and words in error["message"], error


# --------------------------------------------------------------------------- tools
def check_call(call) -> dict:
    arguments = json.loads(call.function.arguments)
    jsonschema.validate(arguments, SCHEMAS[call.function.name])
    return arguments


def test_tool_choice_required_and_named_give_valid_calls(llama3):
    client, model = llama3.openai(), model_of(llama3)
    for seed in range(10):
        response = client.chat.completions.create(model=model, messages=ASK, tools=TOOLS, tool_choice="required",
                                                  seed=seed, n=3, max_completion_tokens=300)
        for choice in response.choices:
            assert choice.finish_reason == "tool_calls" and choice.message.tool_calls, choice
            for call in choice.message.tool_calls:
                check_call(call)
        named = client.chat.completions.create(model=model, messages=ASK, tools=TOOLS, seed=seed, max_completion_tokens=200,
                                               tool_choice={"type": "function", "function": {"name": "get_time"}},
                                               parallel_tool_calls=False)
        [call] = named.choices[0].message.tool_calls
        assert call.function.name == "get_time" and check_call(call)["zone"] in ("UTC", "CET")
        single = client.chat.completions.create(model=model, messages=ASK, tools=TOOLS, tool_choice="required",
                                                parallel_tool_calls=False, seed=seed, max_completion_tokens=200)
        assert len(single.choices[0].message.tool_calls) == 1


def test_deprecated_functions_map_onto_tools(llama3):
    response = llama3.openai().chat.completions.create(
        model=model_of(llama3), messages=ASK, seed=0, max_completion_tokens=200,
        functions=[t["function"] for t in TOOLS], function_call={"name": "get_weather"})
    [call] = response.choices[0].message.tool_calls
    assert call.function.name == "get_weather" and check_call(call)


def test_stream_helper_reassembles_the_non_streamed_answer(llama3):
    import openai

    client, model = llama3.openai(), model_of(llama3)
    tools = [openai.pydantic_function_tool(GetWeather)]
    for seed in range(4):
        kwargs = dict(model=model, messages=ASK, tools=tools, tool_choice="required", seed=seed, max_completion_tokens=200)
        plain = client.chat.completions.parse(**kwargs)
        with client.chat.completions.stream(**kwargs) as stream:
            chunks = [event for event in stream if event.type == "chunk"]
            streamed = stream.get_final_completion()
        first_deltas = [c.chunk.choices[0].delta.tool_calls[0] for c in chunks
                        if c.chunk.choices and c.chunk.choices[0].delta.tool_calls]
        assert first_deltas[0].id and first_deltas[0].type == "function" and first_deltas[0].function.name == "GetWeather"
        assert sum(1 for d in first_deltas if d.index == 0 and d.function.arguments) > 1  # arguments stream in pieces
        assert chunks[-1].chunk.choices[0].finish_reason == "tool_calls"
        got = [(c.function.name, c.function.arguments, c.function.parsed_arguments) for c in streamed.choices[0].message.tool_calls]
        want = [(c.function.name, c.function.arguments, c.function.parsed_arguments) for c in plain.choices[0].message.tool_calls]
        assert got == want and isinstance(got[0][2], GetWeather)
        assert streamed.choices[0].finish_reason == plain.choices[0].finish_reason == "tool_calls"
    with client.chat.completions.stream(model=model, messages=ASK, response_format=Person, seed=7,
                                        max_completion_tokens=300) as stream:
        streamed_person = stream.get_final_completion().choices[0].message.parsed
    plain_person = client.chat.completions.parse(model=model, messages=ASK, response_format=Person, seed=7,
                                                 max_completion_tokens=300).choices[0].message.parsed
    assert streamed_person == plain_person


@pytest.mark.parametrize("server", ["llama2", "demo"])
def test_formats_without_tools_get_the_generic_tool_format(server, request):
    """Llama 2 and the demo's Jinja template cannot show tools: the generic format does, and its
    grammar makes every answer a reply or valid calls, streamed or not; /tokenize renders that prompt."""
    live = request.getfixturevalue(server)
    client, model = live.openai(), model_of(live)
    ask = [{"role": "user", "content": "What is the weather in Paris for the next 3 days?"}]
    for seed in range(3):
        kwargs = dict(model=model, messages=ask, tools=TOOLS, seed=seed, max_completion_tokens=200)
        required = client.chat.completions.create(**kwargs, tool_choice="required", temperature=1.0)
        assert required.choices[0].finish_reason == "tool_calls", required
        for call in required.choices[0].message.tool_calls:
            check_call(call)
        named = client.chat.completions.create(**kwargs, tool_choice={"type": "function", "function": {"name": "get_time"}})
        [call] = named.choices[0].message.tool_calls
        assert call.function.name == "get_time" and check_call(call)["zone"] in ("UTC", "CET")
        auto = client.chat.completions.create(**kwargs, temperature=0)
        message = auto.choices[0].message
        assert (message.content is not None) != bool(message.tool_calls), message  # a reply or calls, never both
        for call in message.tool_calls or ():
            check_call(call)
        with client.chat.completions.stream(**kwargs, tool_choice="required", temperature=1.0) as stream:
            streamed = stream.get_final_completion().choices[0].message
        assert [(c.function.name, c.function.arguments) for c in streamed.tool_calls] == \
               [(c.function.name, c.function.arguments) for c in required.choices[0].message.tool_calls]
        chunks = list(client.chat.completions.create(**kwargs, temperature=0, stream=True))
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == (message.content or "")
    with live.http() as http:
        tokens = http.post("/tokenize", json={"model": model, "messages": ask, "tools": TOOLS}).json()
        assert tokens["count"] == auto.usage.prompt_tokens  # the prompt chat sent, tools included
        plain = http.post("/tokenize", json={"model": model, "messages": ask}).json()
        assert plain["count"] < tokens["count"]
        none = http.post("/v1/chat/completions", json={"model": model, "messages": ask, "tools": TOOLS, "max_tokens": 2,
                                                       "tool_choice": "none"})
        assert none.status_code == 200 and none.json()["usage"]["prompt_tokens"] == plain["count"], none.text


LITELLM_TOOLS = """
import json, sys
import litellm
url, model, tools = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
response = litellm.completion(model=f"openai/{model}", api_base=url + "/v1", api_key="none", tools=tools, seed=0,
                              messages=[{"role": "user", "content": "What time is it in Berlin?"}], max_tokens=100,
                              tool_choice="required")
calls = response.choices[0].message.tool_calls
print(json.dumps([{"name": c.function.name, "arguments": json.loads(c.function.arguments)} for c in calls]))
"""


@pytest.mark.parametrize("server", ["llama2", "demo"])
def test_langchain_bind_tools_and_litellm_on_the_generic_tool_format(server, request):
    from langchain_openai import ChatOpenAI

    from tests.e2e.test_eval_clients_e2e import run_client

    live = request.getfixturevalue(server)
    llm = ChatOpenAI(model=model_of(live), base_url=live.url + "/v1", api_key="none", max_retries=0, seed=3,
                     max_completion_tokens=200, timeout=120)
    for choice, name in (("any", None), ("get_time", "get_time")):
        message = llm.bind_tools(TOOLS, tool_choice=choice).invoke("What time is it?")
        assert message.tool_calls, message
        for call in message.tool_calls:
            assert name in (None, call["name"])
            jsonschema.validate(call["args"], SCHEMAS[call["name"]])
    weather = llm.with_structured_output(GetWeather, method="function_calling").invoke("Weather in Oslo?")
    assert isinstance(weather, GetWeather)
    pytest.importorskip("litellm")
    calls = run_client(LITELLM_TOOLS, live.url, model_of(live), json.dumps(TOOLS))
    assert calls and all(jsonschema.validate(c["arguments"], SCHEMAS[c["name"]]) is None for c in calls)


# --------------------------------------------------------------------------- langchain
def test_langchain_structured_output_and_bind_tools(llama3):
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(model=model_of(llama3), base_url=llama3.url + "/v1", api_key="none", max_retries=0,
                     seed=3, max_completion_tokens=800, timeout=120)  # a character may take 4 byte tokens
    for method in ("json_schema", "function_calling"):  # strict: no extra properties, or random weights add them forever
        person = llm.with_structured_output(Person, method=method, strict=True).invoke("Describe a person.")
        assert isinstance(person, Person), method
    loose = llm.with_structured_output(WEATHER, method="json_mode").invoke("Describe the weather as JSON.")
    assert isinstance(loose, dict)
    for choice, name in (("any", None), ("get_time", "get_time")):
        message = llm.bind_tools(TOOLS, tool_choice=choice).invoke("What time is it?")
        assert message.tool_calls, message
        for call in message.tool_calls:
            assert name in (None, call["name"])
            jsonschema.validate(call["args"], SCHEMAS[call["name"]])


def test_http_client_sees_plain_json(llama3):
    """Not the SDK: the raw body of a constrained completion is OpenAI's shape."""
    body = {"model": model_of(llama3), "messages": ASK, "seed": 0, "max_tokens": 100,
            "response_format": {"type": "json_schema", "json_schema": {"name": "w", "strict": True, "schema": WEATHER}}}
    response = httpx.post(llama3.url + "/v1/chat/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    jsonschema.validate(json.loads(response.json()["choices"][0]["message"]["content"]), WEATHER)
