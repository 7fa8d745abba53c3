"""Llama 4 chat: `<|begin_of_text|>` then, per message,
`<|header_start|>{role}<|header_end|>\\n\\n{content}<|eot|>`, and an open assistant header.

Tool calling as Llama 4 is served end to end: with tools, the system prompt is the (typo'd, as
tuned) TOOLS_SYSTEM_PROMPT, then the tool definitions as JSON, then the caller's system prompt.
Calls are pythonic, `[f(a=1), g(b="x")]`, with NO <|python_start|>/<|python_end|> around them;
an assistant message that makes calls and each tool result (role `ipython`) end with <|eom|>.
"""

from __future__ import annotations

from typing import Sequence

from engine.chat.common import Dialog, HeaderTurns, PromptBuilder, pythonic_call, tool_definitions_json
from engine.tokenizers.tokenizer import Tokenizer
from engine.chat.tool_parser import OutputParser, make_output_parser
from engine.types import ChatMessage, PreparedImage, ToolDefinition

TOOLS_SYSTEM_PROMPT = (
    "You are a helpful assisant who can can answer general questions or invoke tools when necessary.\n"
    "In addition to tool calls, you should also augment your responses by using the tool outputs."
)
TOOLS_LIST_INTRO = "Here is a list of functions in JSON format that you can invoke.\n\n"


class Llama4ChatFormat(HeaderTurns):
    header_start = "<|header_start|>"
    header_end = "<|header_end|>"
    end_of_turn = "<|eot|>"
    family_display_name = "Llama 4"
    pythonic_tool_calls = True

    family = "llama4"
    supports_tools = True
    parser_needs_special_tokens = True  # the model may still write <|python_start|>

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer

    def _system_text(self, system: str | None, tools: Sequence[ToolDefinition]) -> str | None:
        return system_text(system, tools)

    def _encode_message(self, prompt: PromptBuilder, message: ChatMessage, dialog: Dialog, index: int) -> None:
        if message.role == "tool":
            self._message(prompt, "ipython", message.content, "<|eom|>")
        elif message.role == "assistant" and message.tool_calls:
            param = f"messages[{index}].tool_calls"
            calls = ", ".join(pythonic_call(call.name, dialog.arguments[id(call)], param) for call in message.tool_calls)
            self._message(prompt, "assistant", f"{message.content}[{calls}]", "<|eom|>")
        else:
            self._message(prompt, message.role, message.parts or message.content, "<|eot|>")

    def output_parser(self, tools: Sequence[ToolDefinition]) -> OutputParser:
        return make_output_parser(tools)

    def _image_tokens(self, image: PreparedImage) -> list[int]:
        return image_tokens(self.tokenizer, image)


def image_tokens(tokenizer: Tokenizer, image: PreparedImage) -> list[int]:
    """llama-models' llama4 ChatFormat._encode_image: <|image_start|>, then for several tiles each
    row's tiles of <|patch|>es split by <|tile_x_separator|> and ended by <|tile_y_separator|>, then
    <|image|> and the global view's (or the single tile's) patches, then <|image_end|>."""
    special = tokenizer.special_token_id
    patches = [special("<|patch|>")] * image.tokens_per_chunk
    ids = [special("<|image_start|>")]
    if image.num_chunks > 1:
        rows, cols = image.aspect_ratio
        for _ in range(rows):
            for col in range(cols):
                ids += patches
                if col < cols - 1:
                    ids.append(special("<|tile_x_separator|>"))
            ids.append(special("<|tile_y_separator|>"))
    return ids + [special("<|image|>"), *patches, special("<|image_end|>")]


def system_text(system: str | None, tools: Sequence[ToolDefinition]) -> str | None:
    if not tools:
        return system
    parts = [TOOLS_SYSTEM_PROMPT, TOOLS_LIST_INTRO + tool_definitions_json(tools)]
    if system is not None:
        parts.append(system)
    return "\n\n".join(parts)
