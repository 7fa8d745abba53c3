"""The Responses and Anthropic Messages APIs end to end on a tiny real Llama 3 checkpoint (random
weights, the real tokenizer and chat format): each says what chat says for the same request (one
path to the engine), streamed or not, and a function tool is called through Llama 3's tool format
under a constraining tool_choice (random weights call a tool only when made to)."""

from __future__ import annotations

import json

from typing import Literal

import anthropic
import pytest
from pydantic import BaseModel

from tests.e2e.conftest import BASE_DESCRIPTOR, ready_server

pytestmark = pytest.mark.timeout(900)

MODEL = BASE_DESCRIPTOR
MESSAGES = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a colour."}]
TIME_TOOL = {"type": "function", "name": "get_time", "description": "The time in a zone", "parameters": {
    "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"],
    "additionalProperties": False}}


@pytest.fixture(scope="module")
def server(checkpoints, base_checkpoint):
    # Llama 3.2's tool prompt alone is ~350 tokens
    with ready_server(MODEL, base_checkpoint, checkpoints.root, max_seq_len=2048) as live:
        yield live


@pytest.fixture(scope="module")
def client(server):
    with server.openai() as sdk:
        yield sdk


def test_responses_say_what_chat_says(client):
    chat = client.chat.completions.create(model=MODEL, messages=MESSAGES, temperature=0, max_tokens=12)
    response = client.responses.create(model=MODEL, instructions=MESSAGES[0]["content"], input=MESSAGES[1]["content"],
                                       temperature=0, max_output_tokens=12)
    assert response.output_text == chat.choices[0].message.content
    assert (response.usage.input_tokens, response.usage.output_tokens) == (chat.usage.prompt_tokens,
                                                                           chat.usage.completion_tokens)
    assert response.status == ("incomplete" if chat.choices[0].finish_reason == "length" else "completed")
    with client.responses.stream(model=MODEL, instructions=MESSAGES[0]["content"], input=MESSAGES[1]["content"],
                                 temperature=0, max_output_tokens=12) as stream:
        events = list(stream)
    # a response cut at max_output_tokens ends with response.incomplete, as OpenAI's do
    assert events[-1].type == f"response.{response.status}"
    deltas = [event.delta for event in events if event.type == "response.output_text.delta"]
    assert "".join(deltas) == events[-1].response.output_text == response.output_text


def test_function_tool_through_llama3_format(server, client):
    first = client.responses.create(model=MODEL, input="What time is it in Paris?", tools=[TIME_TOOL], temperature=0,
                                    max_output_tokens=200, tool_choice={"type": "function", "name": "get_time"})
    calls = [item for item in first.output if item.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "get_time", first.output
    assert json.loads(calls[0].arguments)["zone"] in ("UTC", "CET")
    second = client.responses.create(model=MODEL, previous_response_id=first.id, tools=[TIME_TOOL], temperature=0,
                                     max_output_tokens=8, tool_choice="none",
                                     input=[{"type": "function_call_output", "call_id": calls[0].call_id,
                                             "output": "12:00"}])
    alone = client.responses.create(model=MODEL, input="What time is it in Paris?", tools=[TIME_TOOL], temperature=0,
                                    max_output_tokens=8, tool_choice="none")
    assert second.status in ("completed", "incomplete") and not second.error
    assert second.usage.input_tokens > alone.usage.input_tokens  # the call and its output are in the prompt


def test_anthropic_messages_say_what_chat_says(server, client):
    chat = client.chat.completions.create(model=MODEL, messages=MESSAGES, temperature=0, max_tokens=12)
    with anthropic.Anthropic(base_url=server.url, api_key="none", max_retries=0) as claude:
        message = claude.messages.create(model=MODEL, system=MESSAGES[0]["content"], max_tokens=12,
                                         messages=[MESSAGES[1]], extra_body={"temperature": 0})
        with claude.messages.stream(model=MODEL, system=MESSAGES[0]["content"], max_tokens=12,
                                    messages=[MESSAGES[1]], extra_body={"temperature": 0}) as stream:
            streamed = "".join(stream.text_stream)
        count = claude.messages.count_tokens(model=MODEL, system=MESSAGES[0]["content"], messages=[MESSAGES[1]])
    text = "".join(block.text for block in message.content)
    assert text == streamed == chat.choices[0].message.content
    assert message.stop_reason == ("max_tokens" if chat.choices[0].finish_reason == "length" else "end_turn")
    assert count.input_tokens == message.usage.input_tokens == chat.usage.prompt_tokens


def test_anthropic_stop_sequence_is_named(server, client):
    chat = client.chat.completions.create(model=MODEL, messages=MESSAGES, temperature=0, max_tokens=12)
    text = chat.choices[0].message.content
    stop = next((text[i:i + 2] for i in range(1, len(text) - 1) if text[i:i + 2].strip()), None)
    if stop is None:
        pytest.skip(f"the greedy answer {text!r} has no stop string to cut at")
    with anthropic.Anthropic(base_url=server.url, api_key="none", max_retries=0) as claude:
        message = claude.messages.create(model=MODEL, system=MESSAGES[0]["content"], max_tokens=12,
                                         messages=[MESSAGES[1]], stop_sequences=[stop], extra_body={"temperature": 0})
    assert (message.stop_reason, message.stop_sequence) == ("stop_sequence", stop)
    assert "".join(block.text for block in message.content) == text[:text.index(stop)]


class Pick(BaseModel):
    colour: Literal["red", "green", "blue"]
    sure: bool


def test_parse_follows_the_schema_on_a_real_model(client):
    """text.format json_schema reaches chat's grammar: even random weights answer in the schema."""
    for seed_text in ("Pick a colour.", "Another colour?"):
        parsed = client.responses.parse(model=MODEL, input=seed_text, text_format=Pick, temperature=0,
                                        max_output_tokens=60)
        assert parsed.status == "completed" and parsed.output_parsed.colour in ("red", "green", "blue")
