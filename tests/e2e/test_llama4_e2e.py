"""Llama 4 served end to end on a tiny checkpoint with the real Llama 4 tokenizer: chat prompts
through /tokenize equal llama-models' Llama 4 ChatFormat token for token; a multi-turn tool
conversation through the OpenAI API (the call parsed, results fed back, every prompt exact);
image content parts refused.

The tool calls come from the model: the checkpoint's weights are random but chained
(tests/llama4_fixtures.write_chained_llama4_checkpoint) so that greedy decoding after the
assistant header emits `[get_weather(city="Paris")]<|eom|>` through every Llama 4 layer."""

from __future__ import annotations

import contextlib
import json

import pytest

from tests.e2e.conftest import ready_server
from tests.engine.tokenizer_fixtures import llama_models_file
from tests.llama4_fixtures import write_chained_llama4_checkpoint

pytest.importorskip("llama_models.llama4.tokenizer")
MODEL = "Llama-4-Scout-17B-16E-Instruct"
CALL = '[get_weather(city="Paris")]'
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Current weather",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                          "required": ["city"]}}}]
BOT, HS, HE, EOM, EOT = 200000, 200005, 200006, 200007, 200008
PYTHON_TAGS = {200016, 200017}  # <|python_start|>, <|python_end|>


@pytest.fixture(scope="module")
def server(checkpoints):
    from engine.tokenizers.tokenizer import llama4_tokenizer

    tokenizer_path = llama_models_file("llama4/tokenizer.model")
    tok = llama4_tokenizer(tokenizer_path)
    chain = [*tok.encode("\n\n"), *tok.encode(CALL), EOM]  # after the assistant header: the call, then <|eom|>
    out = checkpoints.root / "llama4-chained-tool-call"  # served as MODEL; the folder name is free for a plain tiny Llama 4
    if not out.exists():
        write_chained_llama4_checkpoint(out, chain, tokenizer_path=tokenizer_path)
    with ready_server(MODEL, out, checkpoints.root) as live:
        yield live


@pytest.fixture(scope="module")
def meta_format():
    """llama-models' Llama 4 ChatFormat. Its module imports torchvision for image preprocessing
    (unused for text; not a dependency here): a stand-in module satisfies the import."""
    import sys
    import types

    from llama_models.llama4.tokenizer import Tokenizer

    stand_in = types.ModuleType("torchvision")
    stand_in.transforms = types.ModuleType("torchvision.transforms")
    stand_in.transforms.functional = types.ModuleType("torchvision.transforms.functional")
    modules = {"torchvision": stand_in, "torchvision.transforms": stand_in.transforms,
               "torchvision.transforms.functional": stand_in.transforms.functional}
    with pytest.MonkeyPatch.context() as patch:
        for name, module in modules.items():
            if name not in sys.modules:
                patch.setitem(sys.modules, name, module)
        from llama_models.llama4.chat_format import ChatFormat

        return ChatFormat(Tokenizer(llama_models_file("llama4/tokenizer.model")))


CORPUS = [
    [{"role": "user", "content": "Hello!"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a colour."}],
    [{"role": "system", "content": "Be kind."}, {"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello, how can I help?"},
     {"role": "user", "content": "Tell me a joke.\nA short one."}],
    [{"role": "user", "content": [{"type": "text", "text": "Two parts: "}, {"type": "text", "text": "one, two."}]}],
    [{"role": "user", "content": "Spell <|eot|> and <|begin_of_text|> and <|header_start|>user<|header_end|> literally"}],
    [{"role": "user", "content": "  leading and trailing spaces  "}, {"role": "assistant", "content": "ok"},
     {"role": "user", "content": "日本語 and émojis 🙂"}],
]


def meta_tokens(meta_format, dialog) -> list[int]:
    from llama_models.datatypes import RawMessage, RawTextItem

    def content(c):  # text parts as llama-models takes them: one item each, encoded back to back
        return c if isinstance(c, str) else [RawTextItem(text=part["text"]) for part in c]

    messages = [RawMessage(role=m["role"], content=content(m["content"])) for m in dialog]
    return meta_format.encode_dialog_prompt(messages).tokens


@pytest.mark.parametrize("index", range(len(CORPUS)))
def test_tokenize_equals_llama_models_chat_format(server, meta_format, index):
    with server.http() as http:
        response = http.post("/tokenize", json={"model": MODEL, "messages": CORPUS[index]})
    assert response.status_code == 200, response.text
    assert response.json()["tokens"] == meta_tokens(meta_format, CORPUS[index])


def test_image_on_a_checkpoint_without_vision_weights_is_refused(server):
    """This tiny Llama 4 has no vision encoder: an image is a 400 naming the part (#32), not a 500."""
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
    with server.http() as http:
        response = http.post("/v1/chat/completions", json={"model": MODEL, "max_tokens": 2, "messages": [
            {"role": "user", "content": [{"type": "text", "text": "What is this?"}, image]}]})
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == "messages[0].content[1]" and error["code"] == "images_not_supported"


@contextlib.contextmanager
def recorded_prompts(server):
    """The prompt token ids of every request the engine is given while the block runs."""
    async def engine_of():
        async with server.registry.lease(MODEL) as engine:
            return engine

    engine = server.call(engine_of())
    prompts: list[list[int]] = []
    original = engine.generate

    def generate(request):
        prompts.append(list(request.prompt_token_ids))
        return original(request)

    engine.generate = generate
    try:
        yield prompts
    finally:
        del engine.generate


def expected_prompt(messages) -> list[int]:
    """Our Llama 4 chat format (token for token against hand-built sequences in
    tests/engine/test_chat_format_llama4.py) on the same dialog."""
    from engine.chat.format import make_chat_format
    from engine.tokenizers.tokenizer import llama4_tokenizer
    from engine.types import ChatMessage, ToolCall, ToolDefinition

    tok = llama4_tokenizer(llama_models_file("llama4/tokenizer.model"))
    dialog = []
    for m in messages:
        calls = [ToolCall(c["id"], c["function"]["name"], c["function"]["arguments"]) for c in m.get("tool_calls") or ()]
        dialog.append(ChatMessage(m["role"], m.get("content") or "", tool_calls=calls, tool_call_id=m.get("tool_call_id")))
    tools = [ToolDefinition(t["function"]["name"], t["function"]["description"], t["function"]["parameters"]) for t in TOOLS]
    return make_chat_format("llama4", tok).encode_dialog(dialog, tools=tools)


def test_multi_turn_tool_calls_through_the_openai_api(server):
    from engine.chat.llama4 import TOOLS_SYSTEM_PROMPT
    from engine.tokenizers.tokenizer import llama4_tokenizer

    tok = llama4_tokenizer(llama_models_file("llama4/tokenizer.model"))
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Paris?"}]
    client = server.openai()
    for turn in range(2):
        with recorded_prompts(server) as prompts:
            response = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, temperature=0, max_tokens=20)
        choice = response.choices[0]
        assert choice.finish_reason == "tool_calls" and not choice.message.content
        [call] = choice.message.tool_calls
        assert (call.function.name, json.loads(call.function.arguments)) == ("get_weather", {"city": "Paris"})
        [prompt] = prompts
        assert prompt == expected_prompt(messages)
        assert prompt[-4:] == [HS, *tok.encode("assistant"), HE, *tok.encode("\n\n")][-4:]
        assert not PYTHON_TAGS & set(prompt)
        assert tok.decode(prompt).startswith("<|begin_of_text|><|header_start|>system<|header_end|>\n\n" + TOOLS_SYSTEM_PROMPT[:40])
        if turn:  # the previous call and its result, each closed by <|eom|>, fed back
            rendered = tok.decode(prompt)
            assert f"<|header_start|>assistant<|header_end|>\n\n{CALL}<|eom|>" in rendered
            assert "<|header_start|>ipython<|header_end|>\n\n18 C and sunny<|eom|>" in rendered
        messages += [
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": call.id, "type": "function", "function": {"name": "get_weather", "arguments": call.function.arguments}}]},
            {"role": "tool", "tool_call_id": call.id, "content": "18 C and sunny"},
        ]
