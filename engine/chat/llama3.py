"""Llama 3.x chat: `<|begin_of_text|>` then, per message,
`<|start_header_id|>{role}<|end_header_id|>\\n\\n{content}<|eot_id|>`, and an open assistant
header at the end. Tool results use the `ipython` role.

Tool calling, as Meta serves each version (llama-models' prompt_format docs, llama-stack):
- Llama 3.0: no tools.
- Llama 3.1: the system message starts with `Environment: ipython` when tools are offered, then
  `Tools: brave_search, wolfram_alpha` for the offered built-ins (code_interpreter is implied by
  the environment line), then `Cutting Knowledge Date: December 2023` / `Today Date: DD Month
  YYYY`, then the caller's system prompt. Custom tools are described in a user message of their
  own, as JSON, before the conversation. The model calls with `<|python_tag|>` + JSON (or
  `name.call(query=...)` for built-ins, or code) and ends with `<|eom_id|>`.
- Llama 3.2 / 3.3: custom tools in the system message with the pythonic-call instructions; the
  model answers `[f(a=1), g(b="x")]`. History encodes those calls as `<|python_tag|>[...]<|eot_id|>`
  as the 3.2 docs show.
"""

from __future__ import annotations

import datetime as dt
import json
from typing import Callable, Literal, Sequence

from engine.chat.common import (
    Dialog,
    HeaderTurns,
    PromptBuilder,
    python_literal,
    pythonic_call,
    tool_definitions_json,
)
from engine.tokenizers.tokenizer import Tokenizer
from engine.chat.tool_parser import CODE_INTERPRETER, ContentOnlyParser, OutputParser, make_output_parser
from engine.types import ChatMessage, InvalidRequest, PreparedImage, ToolDefinition

Version = Literal["3", "3.1", "3.2", "3.3"]

# built-in tools Llama 3.1 was trained to call as `name.call(query="...")`, listed on `Tools:`
BUILTIN_SEARCH_TOOLS = ("brave_search", "wolfram_alpha")
BUILTIN_TOOLS = frozenset(BUILTIN_SEARCH_TOOLS + (CODE_INTERPRETER,))

KNOWLEDGE_CUTOFF = "Cutting Knowledge Date: December 2023"

JSON_TOOLS_INTRO = (
    "Answer the user's question by making use of the following functions if needed.\n"
    "If none of the function can be used, please say so.\n"
    "Here is a list of functions in JSON format:\n"
)
JSON_TOOLS_OUTRO = "\n\nReturn function calls in JSON format."

PYTHONIC_TOOLS_PROMPT = (
    "You are an expert in composing functions. You are given a question and a set of possible functions.\n"
    "Based on the question, you will need to make one or more function/tool calls to achieve the purpose.\n"
    "If none of the function can be used, point it out. If the given question lacks the parameters required by the function,\n"
    "also point it out. You should only return the function call in tools call sections.\n"
    "\n"
    "If you decide to invoke any of the function(s), you MUST put it in the format of "
    "[func_name1(params_name1=params_value1, params_name2=params_value2...), func_name2(params)]\n"
    "You SHOULD NOT include any other text in the response.\n"
    "\n"
    "Here is a list of functions in JSON format that you can invoke.\n"
    "\n"
)


def utc_today() -> dt.date:
    return dt.datetime.now(dt.timezone.utc).date()


class Llama3ChatFormat(HeaderTurns):
    header_start = "<|start_header_id|>"
    header_end = "<|end_header_id|>"
    end_of_turn = "<|eot_id|>"

    def __init__(self, tokenizer: Tokenizer, *, version: Version = "3.1", today: Callable[[], dt.date] = utc_today) -> None:
        self.tokenizer = tokenizer
        self.version = version
        self.family = {"3": "llama3", "3.1": "llama3_1", "3.2": "llama3_2", "3.3": "llama3_3"}[version]
        self.supports_tools = version != "3"
        # Tool calls arrive as <|python_tag|>...: with tools, decode with skip_special_tokens=False.
        self.parser_needs_special_tokens = self.supports_tools
        self.pythonic_tool_calls = version in ("3.2", "3.3")
        self._today = today
        self.family_display_name = f"Llama {version}"

    def _image_tokens(self, image: PreparedImage) -> list[int]:
        """Llama 3.2 Vision: one <|image|> per image where it sits among the text parts (llama-models'
        Llama 3 ChatFormat); the model reads it as its image-token row and attends to the image from
        there (engine/executor/cross_attention.py). Text models never get here: compat refuses images
        for an engine without an image preprocessor."""
        return [self.tokenizer.special_token_id("<|image|>")]

    # ---- prompt (HeaderTurns.encode_dialog walks the dialog)
    def _before_turns(self, prompt: PromptBuilder, tools: Sequence[ToolDefinition]) -> None:
        custom = [t for t in tools if t.name not in BUILTIN_TOOLS]
        if self.version == "3.1" and custom:
            self._message(prompt, "user", _json_tools_message(custom), "<|eot_id|>")

    def _encode_message(self, prompt: PromptBuilder, message: ChatMessage, dialog: Dialog, index: int) -> None:
        if message.role == "tool":
            self._message(prompt, "ipython", message.content, "<|eot_id|>")
        elif message.role == "assistant" and message.tool_calls:
            self._header(prompt, "assistant")
            prompt.text(message.content)
            calls = [(call.name, dialog.arguments[id(call)]) for call in message.tool_calls]
            param = f"messages[{index}].tool_calls"
            if self.pythonic_tool_calls and not any(name in BUILTIN_TOOLS for name, _ in calls):
                listed = ", ".join(pythonic_call(name, args, param) for name, args in calls)
                prompt.special("<|python_tag|>").text(f"[{listed}]").special("<|eot_id|>")
            else:  # Llama 3.1 calls, and built-in calls on 3.2+: end of message, awaiting results
                prompt.special("<|python_tag|>").text("; ".join(_llama31_call(n, a, param) for n, a in calls))
                prompt.special("<|eom_id|>")
        else:
            self._message(prompt, message.role, message.parts or message.content, "<|eot_id|>")

    def _system_text(self, system: str | None, tools: Sequence[ToolDefinition]) -> str | None:
        if self.version == "3":
            return system
        if self.version == "3.1":
            return self._system_text_31(system, tools)
        return self._system_text_32(system, tools)

    def _system_text_31(self, system: str | None, tools: Sequence[ToolDefinition]) -> str:
        # The layout of llama-models' prompt_format.md examples: a blank line after the
        # environment unless a Tools: line follows it; the caller's prompt after a blank line.
        text = ""
        if tools:
            text += "Environment: ipython\n"
            search = [t.name for t in tools if t.name in BUILTIN_SEARCH_TOOLS]
            text += f"Tools: {', '.join(search)}\n" if search else "\n"
        text += f"{KNOWLEDGE_CUTOFF}\nToday Date: {self._today().strftime('%d %B %Y')}\n"
        if system is not None:
            text += f"\n{system}\n"
        return text

    def _system_text_32(self, system: str | None, tools: Sequence[ToolDefinition]) -> str | None:
        # llama-stack's 3.2/3.3 layout: built-in environment, pythonic tool prompt, caller's prompt
        text = ""
        builtin = [t.name for t in tools if t.name in BUILTIN_TOOLS]
        if builtin:
            search = [name for name in builtin if name in BUILTIN_SEARCH_TOOLS]
            text += "Environment: ipython\n" + (f"Tools: {', '.join(search)}\n" if search else "\n")
        custom = [t for t in tools if t.name not in BUILTIN_TOOLS]
        if custom:
            text += PYTHONIC_TOOLS_PROMPT + tool_definitions_json(custom) + "\n"
        if system is not None:
            text += system
        text = text.strip("\n") if tools else text
        return text if tools or system is not None else None

    # ---- output
    def output_parser(self, tools: Sequence[ToolDefinition]) -> OutputParser:
        return make_output_parser(tools) if self.supports_tools else ContentOnlyParser()


def _json_tools_message(tools: Sequence[ToolDefinition]) -> str:
    described = [
        json.dumps(
            {"type": "function", "function": {"name": t.name, "description": t.description, "parameters": t.parameters}},
            indent=4,
            ensure_ascii=False,
        )
        for t in tools
    ]
    return JSON_TOOLS_INTRO + "\n".join(described) + JSON_TOOLS_OUTRO


def _llama31_call(name: str, arguments: dict, param: str) -> str:
    """One call as Llama 3.1 writes it after <|python_tag|> (llama-models' encode_tool_call)."""
    if name == CODE_INTERPRETER:
        code = arguments.get("code")
        if not isinstance(code, str):
            raise InvalidRequest("a code_interpreter call needs a string argument 'code'", param=param)
        return code
    if name in BUILTIN_SEARCH_TOOLS:
        return f"{name}.call(" + ", ".join(f"{k}={python_literal(v)}" for k, v in arguments.items()) + ")"
    return json.dumps({"type": "function", "name": name, "parameters": arguments}, ensure_ascii=False)
