"""Tool-call parsing: every syntax streamed character by character and token by token (through
the real tokenizer and the incremental detokenizer), malformed outputs that must stay text, finish
reasons, and properties: never raises, the same result however the text is cut into deltas."""

from __future__ import annotations

import itertools
import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine.chat.format import make_chat_format
from engine.core.detokenizer import IncrementalDetokenizer
from engine.chat.tool_parser import (
    ContentOnlyParser,
    ParsedOutput,
    ToolCallParser,
    _CallRun,
    make_output_parser,
    parse_output,
)
from engine.types import ChatMessage, ToolCall, ToolDefinition
from tests.engine.tokenizer_fixtures import real_llama3, real_llama4

FAST = settings(max_examples=150, derandomize=True, deadline=None, suppress_health_check=[HealthCheck.too_slow])

TOOLS = [
    ToolDefinition("get_weather", "weather", {"type": "object"}),
    ToolDefinition("search_docs"),
    ToolDefinition("brave_search"),
    ToolDefinition("code_interpreter"),
]


def ids():
    counter = itertools.count()
    return lambda: f"call_{next(counter)}"


def stream(text: str, pieces: list[int] | None = None, *, tools=TOOLS, stop_token_id: int | None = 128009):
    """Feed `text` in pieces (cycled sizes; default one character at a time) and assemble what a
    client would see. Returns (streamed content, streamed calls, final ParsedOutput)."""
    parser = ToolCallParser(tools, new_call_id=ids())
    sizes = itertools.cycle(pieces or [1])
    content, calls, at = "", {}, 0
    while at < len(text):
        size = next(sizes)
        delta = parser.push(text[at : at + size])
        at += size
        content += delta.content
        for d in delta.tool_calls:
            entry = calls.setdefault(d.index, {"id": None, "name": None, "arguments": ""})
            entry["id"] = entry["id"] or d.call_id
            entry["name"] = entry["name"] or d.name
            entry["arguments"] += d.arguments
    final = parser.finish(stop_token_id)
    return content, [ToolCall(c["id"], c["name"], c["arguments"]) for _, c in sorted(calls.items())], final


def calls_of(out: ParsedOutput) -> list[tuple[str, dict]]:
    return [(c.name, json.loads(c.arguments)) for c in out.tool_calls]


# --------------------------------------------------------------------------- each syntax
CASES = [
    # (model output, expected calls, expected content)
    ('[get_weather(city="Paris")]', [("get_weather", {"city": "Paris"})], None),
    (
        '[get_weather(city="San Francisco", metric="celsius"), get_weather(city=\'Seattle\', days=3)]',
        [("get_weather", {"city": "San Francisco", "metric": "celsius"}), ("get_weather", {"city": "Seattle", "days": 3})],
        None,
    ),
    ('<|python_tag|>[search_docs(q="a, b]", n=-2.5, tags=["x", "y"], opts={"deep": True}, none=None)]',
     [("search_docs", {"q": "a, b]", "n": -2.5, "tags": ["x", "y"], "opts": {"deep": True}, "none": None})], None),
    ('<|python_start|>[get_weather(city="Oslo")]<|python_end|>', [("get_weather", {"city": "Oslo"})], None),
    ('[get_weather(ok=true, missing=null), search_docs()]', [("get_weather", {"ok": True, "missing": None}), ("search_docs", {})], None),
    ('{"name": "get_weather", "parameters": {"city": "Lima"}}', [("get_weather", {"city": "Lima"})], None),
    ('<|python_tag|>{"type": "function", "name": "get_weather", "parameters": {"city": "SF"}}',
     [("get_weather", {"city": "SF"})], None),
    ('<|python_tag|>{\n    "type": "function",\n    "name": "search_docs",\n    "arguments": {"q": "tiktoken"}\n}',
     [("search_docs", {"q": "tiktoken"})], None),
    ('{"name": "get_weather", "arguments": {"city": "A"}}; {"name": "search_docs", "parameters": {}}',
     [("get_weather", {"city": "A"}), ("search_docs", {})], None),
    ('[{"name": "get_weather", "parameters": {"city": "A"}}, {"name": "search_docs", "parameters": {"q": "{}"}}]',
     [("get_weather", {"city": "A"}), ("search_docs", {"q": "{}"})], None),
    ('{"type": "function", "function": {"name": "get_weather", "arguments": "{\\"city\\": \\"B\\"}"}}',
     [("get_weather", {"city": "B"})], None),
    ('<function=get_weather>{"city": "Kyiv"}</function>', [("get_weather", {"city": "Kyiv"})], None),
    ('Sure. <function=search_docs>{"q": "x"}</function><function=get_weather>{}</function>',
     [("search_docs", {"q": "x"}), ("get_weather", {})], "Sure. "),
    ('[brave_search(query="llama 4")]', [("brave_search", {"query": "llama 4"})], None),  # Llama 4 style
    ('<|python_tag|>brave_search.call(query="latest price of 1oz gold")',
     [("brave_search", {"query": "latest price of 1oz gold"})], None),
    ('<|python_tag|>def is_prime(n):\n    return n > 1\n\nprint(is_prime(7))',
     [("code_interpreter", {"code": "def is_prime(n):\n    return n > 1\n\nprint(is_prime(7))"})], None),
    ('  \n[get_weather(city="X")]\n', [("get_weather", {"city": "X"})], None),
    ('[get_weather(city="东京 🦙")] Done.', [("get_weather", {"city": "东京 🦙"})], "Done."),
]


@pytest.mark.parametrize(("text", "expected_calls", "expected_content"), CASES)
@pytest.mark.parametrize("pieces", [[1], [2, 5, 1], [10**6]])
def test_each_syntax_streamed(text, expected_calls, expected_content, pieces):
    content, streamed_calls, final = stream(text, pieces)
    assert calls_of(final) == expected_calls
    assert final.content == expected_content
    assert final.finish_reason == "tool_calls"
    # what was streamed is what the final output says: calls whole, content a prefix
    assert [(c.call_id, c.name, c.arguments) for c in streamed_calls] == [
        (c.call_id, c.name, c.arguments) for c in final.tool_calls
    ][: len(streamed_calls)]
    assert (final.content or "").startswith(content)
    assert [c.call_id for c in final.tool_calls] == [f"call_{i}" for i in range(len(expected_calls))]


def test_arguments_are_canonical_json_text():
    out = parse_output('[get_weather(city="Zürich", n=1.0, l=(1, 2))]', TOOLS, new_call_id=ids())
    assert out.tool_calls == [ToolCall("call_0", "get_weather", '{"city": "Zürich", "n": 1.0, "l": [1, 2]}')]


def test_a_call_is_streamed_as_soon_as_it_is_complete_name_first():
    parser = ToolCallParser(TOOLS, new_call_id=ids())
    assert parser.push('[get_weather(city="Paris")').tool_calls == []
    delta = parser.push(", ")
    assert [(d.index, d.call_id, d.name, d.arguments) for d in delta.tool_calls] == [
        (0, "call_0", "get_weather", ""),
        (0, None, None, '{"city": "Paris"}'),
    ]
    assert parser.push('get_weather(city="Rome")]').tool_calls[0].name == "get_weather"
    assert parser.finish(128008).finish_reason == "tool_calls"  # <|eom_id|>


def test_plain_content_streams_without_delay():
    parser = ToolCallParser(TOOLS)
    assert parser.push("The weather").content == "The weather"
    assert parser.push(" is fine [").content == " is fine ["  # not at the start: not a call
    assert parser.push("get_weather()]").content == "get_weather()]"
    assert parser.finish(128009) == ParsedOutput("The weather is fine [get_weather()]", [], "stop")


def test_text_is_held_only_while_it_could_start_a_call():
    parser = ToolCallParser(TOOLS)
    assert parser.push("[").content == ""
    assert parser.push("get_w").content == ""
    assert parser.push("x").content == "[get_wx"  # no offered tool starts with get_wx
    parser = ToolCallParser(TOOLS)
    assert parser.push("Hi <|py").content == "Hi "
    assert parser.push("thonic").content == "<|pythonic"
    parser = ToolCallParser(TOOLS)
    assert parser.push('{"answer').content == '{"answer'  # JSON, but not a call


# --------------------------------------------------------------------------- token by token, real tokenizers
@pytest.mark.parametrize(
    ("family", "tokenizer", "generated", "stop", "expected"),
    [
        ("llama3_1", real_llama3, '<|python_tag|>{"name": "get_weather", "parameters": {"city": "SF"}}', "<|eom_id|>",
         [("get_weather", {"city": "SF"})]),
        ("llama3_1", real_llama3, '<|python_tag|>brave_search.call(query="gold")', "<|eom_id|>",
         [("brave_search", {"query": "gold"})]),
        ("llama3_2", real_llama3, '[get_weather(city="SF"), get_weather(city="Seattle")]', "<|eot_id|>",
         [("get_weather", {"city": "SF"}), ("get_weather", {"city": "Seattle"})]),
        ("llama4", real_llama4, '[get_weather(city="SF"), search_docs(q="é🦙")]', "<|eom|>",
         [("get_weather", {"city": "SF"}), ("search_docs", {"q": "é🦙"})]),
        ("llama4", real_llama4, '<|python_start|>[get_weather(city="X")]<|python_end|>', "<|eot|>",
         [("get_weather", {"city": "X"})]),
    ],
)
def test_token_by_token_through_the_detokenizer(family, tokenizer, generated, stop, expected):
    tok = tokenizer()
    token_ids = _encode_with_specials(tok, generated)
    detok = IncrementalDetokenizer(tok, skip_special_tokens=False)  # as compat asks when tools are offered
    parser = make_chat_format(family, tok).output_parser(TOOLS)
    content = ""
    for token_id in token_ids:
        content += parser.push(detok.push([token_id])).content
    content += parser.push(detok.finish()).content
    out = parser.finish(tok.special_token_id(stop))
    assert calls_of(out) == expected and out.content is None and content == ""
    assert out.finish_reason == "tool_calls"


def _encode_with_specials(tok, text: str) -> list[int]:
    """Model output as ids: tag spellings become their special tokens, the rest is text."""
    token_ids: list[int] = []
    for part in __import__("re").split(r"(<\|[a-z_]+\|>)", text):
        if part.startswith("<|"):
            token_ids.append(tok.special_token_id(part))
        elif part:
            token_ids.extend(tok.encode(part))
    return token_ids


# --------------------------------------------------------------------------- malformed outputs stay text
MALFORMED = [
    "Hello [1, 2] world",
    "[1, 2, 3]",
    "[Click here](https://example.com)",
    '{"name": "Bob", "age": 3}',
    '{"answer": 42}',
    "{}",
    "[]",
    "[get_weather]",
    "[get_weather(]",
    '[get_weather(city="Par',  # cut off
    '[unknown_tool(x=1)]',
    '[get_weather("positional")]',
    '[get_weather(**kw)]',
    '[get_weather(city=open("/etc/passwd").read())]',  # never evaluated
    '[get_weather(city=__import__("os").system("x"))]',
    '[get_weather(city=1+2)]',
    '[get_weather(city=float("nan"))]',
    '[os.system(cmd="rm")]',
    '{"name": "get_weather", "parameters": [1]}',
    '{"name": "get_weather", "parameters": {"city": "SF"}, "extra": 1}',
    '{"name": "get_weather", "parameters": {"city": ',
    '{"name": "unknown", "parameters": {}}',
    '<function=get_weather>{"city": </function>',
    "<function=unknown>{}</function>",
    "<function=get_weather>not json</function>",
    "<function=get_weather>{}",
    "<function=",
    "brave_search.call(query='x')",
    "get_weather(city='x')",
    "[[get_weather()]]",
    '[get_weather(city="a"]',
    "[get_weather(city='a')",
    "```python\n[get_weather(city='x')]\n```",
    "<|python_ta",
    "<|py",
    "",
    "   ",
    "\\",
    '"',
    "[get_weather(city='unterminated)]",
]


@pytest.mark.parametrize("text", MALFORMED)
@pytest.mark.parametrize("pieces", [[1], [3], [10**6]])
def test_malformed_outputs_stay_text(text, pieces):
    content, streamed_calls, final = stream(text, pieces)
    assert final.tool_calls == [] and streamed_calls == []
    assert final.content == text
    assert final.finish_reason == "stop"
    assert text.startswith(content)


def test_a_tag_before_text_that_is_no_call_is_dropped_from_content():
    tools = [ToolDefinition("get_weather")]  # no code_interpreter: code is not a call
    out = parse_output("<|python_tag|>print(1)", tools)
    assert out == ParsedOutput("print(1)", [], None)


def test_calls_then_garbage_keep_the_calls_and_the_rest_is_text():
    content, streamed, final = stream('[get_weather(city="A"), bogus!]')
    assert calls_of(final) == [("get_weather", {"city": "A"})]
    assert final.content == "bogus!]"


# --------------------------------------------------------------------------- finish reasons
def test_finish_reasons():
    assert parse_output('[get_weather(city="A")]', TOOLS, stop_token_id=128008).finish_reason == "tool_calls"  # eom
    assert parse_output('[get_weather(city="A")]', TOOLS, stop_token_id=200008).finish_reason == "tool_calls"  # eot
    assert parse_output('[get_weather(city="A")]', TOOLS, stop_token_id=None).finish_reason is None  # length
    assert parse_output("Just text.", TOOLS, stop_token_id=128008).finish_reason == "stop"
    assert parse_output("Just text.", TOOLS).finish_reason is None


def test_content_only_parser_and_factory():
    assert isinstance(make_output_parser(()), ContentOnlyParser)
    parser = make_output_parser(())
    assert parser.push("[get_weather()]").content == "[get_weather()]"
    assert parser.finish(None) == ParsedOutput("[get_weather()]", [], None)


def test_default_call_ids_are_random_hex():
    out = parse_output('[get_weather(), get_weather()]', TOOLS)
    first, second = (c.call_id for c in out.tool_calls)
    assert first.startswith("call_") and len(first) == 29 and first != second
    int(first[5:], 16)


# --------------------------------------------------------------------------- round trip with the chat formats
@pytest.mark.parametrize("family", ["llama3_1", "llama3_2", "llama4"])
def test_calls_rendered_in_a_prompt_parse_back(family):
    tok = real_llama4() if family == "llama4" else real_llama3()
    chat = make_chat_format(family, tok)
    calls = [
        ToolCall("a", "get_weather", json.dumps({"city": "Zürich \"old\" town", "days": [1, 2], "deep": {"x": None}})),
        ToolCall("b", "search_docs", json.dumps({"q": "a\nb", "n": -3, "f": 0.5, "t": True})),
    ]
    messages = [ChatMessage("user", "Hi"), ChatMessage("assistant", "", tool_calls=calls)]
    ids_ = chat.encode_dialog(messages, tools=TOOLS, add_generation_prompt=False)
    header_end = max(i for i, t in enumerate(ids_) if tok.decode([t]) in ("<|end_header_id|>", "<|header_end|>"))
    rendered = tok.decode(ids_[header_end + 2 : -1])  # after "\n\n", before <|eom_id|>/<|eom|>/<|eot_id|>
    out = parse_output(rendered, TOOLS, stop_token_id=1)
    assert [(c.name, json.loads(c.arguments)) for c in out.tool_calls] == [
        (c.name, json.loads(c.arguments)) for c in calls
    ]


# --------------------------------------------------------------------------- properties
_FRAGMENTS = st.sampled_from(
    ["[", "]", "(", ")", "{", "}", ",", ";", "=", '"', "'", "\\", " ", "\n", "get_weather", "search_docs", "x", "1",
     '"name"', ":", '"parameters"', "<|python_tag|>", "<|python_start|>", "<|python_end|>", "<function=", ">",
     "</function>", "brave_search", ".call", "query", "é", "🦙", "true", "None"]
)  # fmt: skip


@given(
    fragments=st.lists(_FRAGMENTS, max_size=30),
    pieces=st.lists(st.integers(1, 7), min_size=1, max_size=5),
    tools=st.sampled_from([TOOLS, TOOLS[:2]]),
)
@FAST
def test_never_raises_and_chunking_does_not_change_the_result(fragments, pieces, tools):
    text = "".join(fragments)
    one_shot = parse_output(text, tools, stop_token_id=7, new_call_id=ids())
    content, streamed, final = stream(text, pieces, tools=tools, stop_token_id=7)
    assert (final.content, [(c.name, c.arguments) for c in final.tool_calls]) == (
        one_shot.content,
        [(c.name, c.arguments) for c in one_shot.tool_calls],
    )
    assert (final.content or "").startswith(content)
    assert [(c.name, c.arguments) for c in streamed] == [(c.name, c.arguments) for c in final.tool_calls][: len(streamed)]
    if not final.tool_calls:
        plain = text
        for tag in ("<|python_tag|>", "<|python_start|>", "<|python_end|>"):
            plain = plain.replace(tag, "")
        assert (final.content or "").replace("<|python_tag|>", "") == plain or final.content == text


@given(st.text(max_size=80))
@FAST
def test_arbitrary_text_never_raises(text):
    out = parse_output(text, TOOLS)
    assert isinstance(out, ParsedOutput)


def test_an_internal_error_degrades_to_content(monkeypatch):
    def broken(self, text):
        raise RuntimeError("bug")

    monkeypatch.setattr(_CallRun, "feed", broken)
    content, streamed, final = stream('[get_weather(city="A")] and more', [4])
    assert final.tool_calls == [] and final.content == '[get_weather(city="A")] and more'
