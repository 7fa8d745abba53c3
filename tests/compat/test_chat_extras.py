"""vLLM's chat extras: add_generation_prompt, continue_final_message, chat_template_kwargs, echo,
bad_words and allowed_token_ids, each as it changes the prompt or the sampling parameters."""

from __future__ import annotations

from types import SimpleNamespace

import msgspec
import pytest

from compat import protocol as p
from compat import to_engine
from engine.types import InvalidRequest
from tests.engine.test_jinja_chat import checkpoint, format_with, tokenizer  # noqa: F401 - fixtures
from tests.server.fake_engine import FakeEngine

CONTINUED = [{"role": "user", "content": "Count to three."}, {"role": "assistant", "content": "One, two,"}]


def chat(**fields) -> p.ChatCompletionRequest:
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], **fields}
    return p.decode(p.CHAT_DECODER, msgspec.json.encode(body))


def plan(engine: FakeEngine, **fields) -> to_engine.ChatPlan:
    req = chat(**fields)
    return to_engine.chat_plan(req, req.messages, engine, "c")


def refusal(engine, **fields) -> InvalidRequest:
    with pytest.raises(InvalidRequest) as info:
        plan(engine, **fields)
    return info.value


def text(engine: FakeEngine, ids: list[int]) -> str:
    return engine.tokenizer.decode(ids[1:])  # after BOS


def test_add_generation_prompt_false_ends_after_the_last_message():
    engine = FakeEngine()
    assert text(engine, plan(engine).prompt_token_ids) == "<|user|>hi\n<|assistant|>"
    assert text(engine, plan(engine, add_generation_prompt=False).prompt_token_ids) == "<|user|>hi\n"


def test_continue_final_message_leaves_the_last_assistant_message_open():
    engine = FakeEngine()
    continued = plan(engine, messages=CONTINUED, add_generation_prompt=False, continue_final_message=True)
    assert text(engine, continued.prompt_token_ids) == "<|user|>Count to three.\n<|assistant|>One, two,"
    closed = plan(engine, messages=CONTINUED, add_generation_prompt=False)
    assert text(engine, closed.prompt_token_ids) == "<|user|>Count to three.\n<|assistant|>One, two,\n"
    assert refusal(engine, messages=CONTINUED, continue_final_message=True).param == "continue_final_message"  # both
    assert refusal(engine, add_generation_prompt=False, continue_final_message=True).param == "continue_final_message"


def test_echo_repeats_the_last_assistant_message_only():
    engine = FakeEngine()
    assert plan(engine, messages=CONTINUED, add_generation_prompt=False, continue_final_message=True,
                echo=True).echo_text == "One, two,"
    assert plan(engine, echo=True).echo_text == ""  # the last message is the user's
    assert plan(engine, messages=CONTINUED, add_generation_prompt=False, continue_final_message=True).echo_text == ""


TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n{% if enable_thinking %}<think>{% endif %}{% endif %}")


def test_chat_template_kwargs_reach_a_jinja_template_and_may_not_replace_its_names(tokenizer):
    engine = SimpleNamespace(chat_format=format_with(TEMPLATE, tokenizer), tokenizer=tokenizer)
    dialog = to_engine.chat_messages(chat().messages)

    def rendered(**kwargs) -> str:
        return tokenizer.decode(to_engine.render_chat(engine, dialog, (), generic_tools=False, **kwargs))

    assert rendered() == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert rendered(template_kwargs={"enable_thinking": True}).endswith("assistant\n<think>")
    for name in ("messages", "add_generation_prompt", "bos_token", "tools"):
        with pytest.raises(InvalidRequest) as info:
            rendered(template_kwargs={name: 1})
        assert info.value.param == f"chat_template_kwargs.{name}"
    fake = FakeEngine()  # a built-in format has no template: the kwargs change nothing there
    assert plan(fake, chat_template_kwargs={"enable_thinking": True}).prompt_token_ids == plan(fake).prompt_token_ids


def test_bad_words_and_allowed_token_ids_become_sampling_parameters():
    engine = FakeEngine()
    [request] = plan(engine, bad_words=["ab", " cd"], allowed_token_ids=[5, 6, 7]).requests
    encode = engine.tokenizer.encode
    assert set(request.params.bad_words_token_ids) == {tuple(encode("ab")), tuple(encode(" ab")), tuple(encode(" cd"))}
    assert request.params.allowed_token_ids == frozenset({5, 6, 7})
    assert refusal(engine, allowed_token_ids=[engine.tokenizer.vocab_size]).param == "allowed_token_ids"
    req = p.decode(p.COMPLETION_DECODER, msgspec.json.encode({"model": "m", "prompt": "x", "bad_words": ["ab"]}))
    [completion] = to_engine.completion_plan(req, req.prompt, engine, "cmpl").requests
    assert tuple(encode("ab")) in completion.params.bad_words_token_ids


def test_tokenize_renders_as_chat_does():
    engine = FakeEngine()
    body = {"messages": CONTINUED, "add_generation_prompt": False, "continue_final_message": True}
    req = p.decode(p.TOKENIZE_DECODER, msgspec.json.encode(body))
    assert to_engine.tokenize(req, engine) == plan(engine, **body).prompt_token_ids


TOOLS = [{"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}]


def test_a_format_without_tools_gets_them_in_the_generic_prompt_for_chat_and_tokenize():
    engine = FakeEngine(max_seq_len=2048)  # the tool prompt takes ~430 of its byte tokens
    engine.chat_format.supports_tools = False
    chat_plan = plan(engine, tools=TOOLS)
    assert chat_plan.generic_tools and chat_plan.tools[0].name == "get_time"
    messages, tools = engine.chat_format.dialogs[-1]
    assert tools == () and messages[0].role == "system" and '"name": "get_time"' in messages[0].content
    req = p.decode(p.TOKENIZE_DECODER, msgspec.json.encode({"messages": [{"role": "user", "content": "hi"}], "tools": TOOLS}))
    assert to_engine.tokenize(req, engine) == chat_plan.prompt_token_ids
    error = refusal(engine, tools=TOOLS, response_format={"type": "json_object"})
    assert error.param == "response_format" and "generic tool format" in str(error)
    assert not plan(engine, tools=TOOLS, tool_choice="none").generic_tools  # none: no tools shown, free text
