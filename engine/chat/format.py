"""Chat formats: OpenAI-shaped messages -> the exact token sequence a Llama family was trained on,
and the parser that turns the generated text back into content and tool calls.

A prompt is built as a token list: message text is encoded as text (a user who types
`<|eot_id|>` gets those characters, not the control token) and control tokens are appended by
id. One module per family lives in engine/chat/.

For the server (compat):
- `encode_dialog` raises engine.types.InvalidRequest, with `param`, for what the family cannot
  express: tools on Llama 2 / 3.0, a tool message that answers no call, a tool_call_id that
  matches no call, a system message after the start on Llama 2, ...
- `parser_needs_special_tokens`: when True and the request offers tools, generate with
  SamplingParams.skip_special_tokens=False, so that the output parser sees the tags tool calls
  come with (`<|python_tag|>`, `<|python_start|>`); the parser keeps them out of the content.
- `output_parser(tools)` returns a fresh engine.chat.tool_parser.OutputParser per choice.
- A format with `accepts_template_kwargs = True` (Jinja templates) takes `template_kwargs` in
  `encode_dialog`: extra template variables (vLLM's chat_template_kwargs).
- A format that cannot show tools (`supports_tools = False`) gets them through the generic tool
  format (engine/chat/generic_tools.py), which compat applies around `encode_dialog`.
- OpenAI `name` fields have no place in Llama prompts and are not rendered (as in Meta's and
  HF's formats); the `developer` role arrives here as `system`.
"""

from __future__ import annotations

import datetime as dt
from typing import Callable, Protocol, Sequence

from engine.tokenizers.tokenizer import Tokenizer
from engine.chat.tool_parser import ContentOnlyParser, OutputParser
from engine.types import CheckpointError, ChatMessage, Family, ToolDefinition


class ChatFormat(Protocol):
    family: str
    tokenizer: Tokenizer
    supports_tools: bool
    parser_needs_special_tokens: bool

    def encode_dialog(
        self, messages: Sequence[ChatMessage], *, tools: Sequence[ToolDefinition] = (), add_generation_prompt: bool = True
    ) -> list[int]: ...

    def output_parser(self, tools: Sequence[ToolDefinition]) -> OutputParser: ...


def make_chat_format(
    family: Family, tokenizer: Tokenizer, *, today: Callable[[], dt.date] | None = None
) -> ChatFormat:
    """The chat format of a Llama family; `today` dates Llama 3.1's system prompt (tests pin it)."""
    from engine.chat.llama2 import Llama2ChatFormat
    from engine.chat.llama3 import Llama3ChatFormat, utc_today
    from engine.chat.llama4 import Llama4ChatFormat

    versions = {"llama3": "3", "llama3_1": "3.1", "llama3_2": "3.2", "llama3_3": "3.3"}
    if family in versions:
        return Llama3ChatFormat(tokenizer, version=versions[family], today=today or utc_today)  # type: ignore[arg-type]
    if family == "llama4":
        return Llama4ChatFormat(tokenizer)
    if family == "llama2":
        return Llama2ChatFormat(tokenizer)
    raise CheckpointError(f"no built-in chat format for model family {family!r} (hf checkpoints bring their own)")


def content_only_parser() -> OutputParser:
    """A parser for outputs without tools: all text is content."""
    return ContentOnlyParser()
