"""Llama 2 chat: `<s>[INST] <<SYS>>\\n{system}\\n<</SYS>>\\n\\n{user} [/INST] {answer} </s>`.

Exactly as Meta's reference `chat_completion` builds it: each user/answer pair is encoded on its
own with BOS and EOS, contents stripped; the system prompt goes inside the first [INST]. Llama 2
has no tool calling, no tool role and no system message after the start: such requests are
refused. Consecutive messages of one role are joined with a blank line, since the format has
room for one message per side of a turn.
"""

from __future__ import annotations

from typing import Sequence

from engine.chat.common import check_dialog, check_tools
from engine.tokenizers.tokenizer import Tokenizer
from engine.chat.tool_parser import ContentOnlyParser, OutputParser
from engine.types import ChatMessage, InvalidRequest, ToolDefinition

B_INST, E_INST = "[INST]", "[/INST]"
B_SYS, E_SYS = "<<SYS>>\n", "\n<</SYS>>\n\n"


class Llama2ChatFormat:
    family = "llama2"
    supports_tools = False
    parser_needs_special_tokens = False

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer

    def encode_dialog(
        self, messages: Sequence[ChatMessage], *, tools: Sequence[ToolDefinition] = (), add_generation_prompt: bool = True
    ) -> list[int]:
        check_tools(tools, family_name="Llama 2", supports_tools=False, pythonic=False)
        dialog = check_dialog(messages, family_name="Llama 2", supports_tools=False, system_anywhere=False)
        turns = _merge_runs(dialog.messages)
        if not turns or turns[0].role != "user":
            raise InvalidRequest("Llama 2 conversations start with a user message (after the system prompt)", param="messages")
        if dialog.system is not None:
            turns[0] = ChatMessage("user", B_SYS + dialog.system + E_SYS + turns[0].content)
        ends_with_user = turns[-1].role == "user"
        if add_generation_prompt and not ends_with_user:
            raise InvalidRequest("Llama 2 conversations must end with a user message", param="messages")
        ids: list[int] = []
        for k in range(0, len(turns) - 1, 2):
            prompt, answer = turns[k].content.strip(), turns[k + 1].content.strip()
            ids += self.tokenizer.encode(f"{B_INST} {prompt} {E_INST} {answer} ", bos=True, eos=True)
        if ends_with_user:
            ids += self.tokenizer.encode(f"{B_INST} {turns[-1].content.strip()} {E_INST}", bos=True)
        return ids

    def output_parser(self, tools: Sequence[ToolDefinition]) -> OutputParser:
        return ContentOnlyParser()


def _merge_runs(messages: Sequence[ChatMessage]) -> list[ChatMessage]:
    """user/assistant alternation, with consecutive messages of one role joined."""
    turns: list[ChatMessage] = []
    for message in messages:
        if turns and turns[-1].role == message.role:
            turns[-1] = ChatMessage(message.role, turns[-1].content + "\n\n" + message.content)
        else:
            turns.append(ChatMessage(message.role, message.content))
    return turns
