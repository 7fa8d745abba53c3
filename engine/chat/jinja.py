"""Chat formats defined by a checkpoint's Jinja `chat_template` (HF conventions), or by a
`--chat-template FILE` override.

A template is untrusted input: it is rendered in jinja2's ImmutableSandboxedEnvironment, refused at
load when it names private attributes (`__class__`, `__globals__`, ...), and any such access that
is built at run time raises instead of rendering as empty text. The context is HF's: `messages`
(dicts), `tools` (OpenAI function schemas or None), `add_generation_prompt`, `bos_token`,
`eos_token`, `raise_exception`, `strftime_now`, and a `tojson` that does not HTML-escape; a
request's `chat_template_kwargs` add variables of their own (compat refuses the names above).

Rendered text becomes tokens the way HF tokenizes it (split at special tokens, the text between
them encoded on its own), with one difference: a special-token spelling that came from the user
(message content, tool definitions) stays text. User strings are escaped before rendering, a
private-use character in front of each special spelling, so the template still sees the text and
the tokenizer can tell the template's control tokens from the user's look-alikes.
"""

from __future__ import annotations

import json
import re
import sys
import time
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable, Mapping, Sequence

from engine.types import ChatMessage, CheckpointError, InvalidRequest, ToolCall, ToolDefinition

if TYPE_CHECKING:
    from engine.tokenizers.tokenizer import Tokenizer
    from engine.chat.tool_parser import OutputParser, ParsedDelta, ParsedOutput

CHAT_TEMPLATE_FILES = ("chat_template.jinja", "chat_template.json")
MAX_RENDERED_CHARS = 8_000_000  # a template that loops into megabytes of text is stopped there
MAX_RANGE_ITEMS_PER_RENDER = 1_000_000  # all `range()` loops of one render together (nested loops multiply)
MAX_RENDER_S = 5.0  # checked as the template yields text
MAX_REPEAT_ITEMS = 1_000_000  # `"x" * n` and `[..] * n` in a template; `a ** b` exponents likewise bounded


class _RangeBudget:
    """`range` for one render: every range() call draws its length from a shared budget, so nested
    loops that produce no text still end."""

    def __init__(self) -> None:
        self.left = MAX_RANGE_ITEMS_PER_RENDER

    def __call__(self, *args: int) -> range:
        items = range(*args)
        self.left -= len(items)
        if self.left < 0:
            raise _TemplateLimit(f"the chat template looped over more than {MAX_RANGE_ITEMS_PER_RENDER} items")
        return items


class _TemplateLimit(Exception):
    """A template exceeded a render bound (time, text, loop items, repetition)."""


def _deadline_tracer(deadline_s: float) -> Any:
    """A trace function that stops template code (compiled from "<template>") past the deadline,
    even in loops that yield no text; other code runs untraced."""

    def in_template(frame: Any, event: str, arg: Any) -> Any:
        if time.monotonic() > deadline_s:
            raise _TemplateLimit(f"the chat template rendered for more than {MAX_RENDER_S:g} s")
        return in_template

    def on_call(frame: Any, event: str, arg: Any) -> Any:
        return in_template if frame.f_code.co_filename == "<template>" else None

    return on_call
_ESCAPE = "\ue000"  # private use: marks a special-token spelling (or itself) that came from the user
# Special-token look-alikes, for tokenizers that cannot list their special tokens.
_CANDIDATES = r"<\|[^<>|\s]{0,64}\|>|<[^<>\s]{1,64}>|\[/?[A-Z_]{1,32}\]"


# --------------------------------------------------------------------------- the sandbox
class _TemplateRaised(Exception):
    """raise_exception() inside a template: the template refuses this conversation."""


def _raise_exception(message: str) -> None:
    raise _TemplateRaised(str(message))


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, separators=None, sort_keys: bool = False) -> str:
    # HF's tojson: plain JSON. Jinja's own escapes <, >, & and ' for HTML, which templates do not expect.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


def _environment():
    from jinja2 import nodes
    from jinja2.ext import Extension, loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment, SecurityError

    class GenerationTag(Extension):
        """HF's `{% generation %}...{% endgeneration %}` (marks assistant text for training masks):
        rendered as its body."""

        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.Scope(body, lineno=lineno)

    class ChatTemplateEnvironment(ImmutableSandboxedEnvironment):
        intercepted_binops = frozenset({"*", "**"})

        def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
            """`"x" * 10**9` and `9 ** 9 ** 9` would allocate or compute before any size check."""
            if operator == "*" and any(isinstance(v, (str, list, tuple)) for v in (left, right)):
                count = right if isinstance(left, (str, list, tuple)) else left
                size = len(left if isinstance(left, (str, list, tuple)) else right)
                if isinstance(count, int) and count * max(size, 1) > MAX_REPEAT_ITEMS:
                    raise _TemplateLimit(f"the chat template repeats a value more than {MAX_REPEAT_ITEMS} times")
            if operator == "**" and isinstance(right, int) and abs(right) > 1024:
                raise _TemplateLimit("the chat template raises a number to a power above 1024")
            return super().call_binop(context, operator, left, right)

        def is_safe_attribute(self, obj: Any, attr: str, value: Any) -> bool:
            return not attr.startswith("_") and super().is_safe_attribute(obj, attr, value)

        def unsafe_undefined(self, obj: Any, attribute: str):
            # The stock sandbox returns an Undefined that renders as "", hiding the attempt.
            raise SecurityError(f"access to attribute {attribute!r} of a {type(obj).__name__} is not allowed in a chat template")

    env = ChatTemplateEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols, GenerationTag])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


# Filters that look attributes up by a name given as an argument (`map(attribute="...")`).
_ATTRIBUTE_FILTERS = frozenset({"attr", "map", "selectattr", "rejectattr", "sort", "groupby", "sum", "unique", "min", "max"})


def _private_names(tree: Any) -> Iterable[str]:
    """Attribute names starting with "_" that the template spells out: `x.__class__`,
    `x["__globals__"]`, `x|attr("__init__")`, `xs|map(attribute="__class__")`."""
    from jinja2 import nodes

    for node in tree.find_all((nodes.Getattr, nodes.Getitem, nodes.Filter)):
        if isinstance(node, nodes.Getattr) and node.attr.startswith("_"):
            yield node.attr
        elif isinstance(node, nodes.Getitem) and isinstance(node.arg, nodes.Const) and str(node.arg.value).startswith("_"):
            yield str(node.arg.value)
        elif isinstance(node, nodes.Filter) and node.name in _ATTRIBUTE_FILTERS:
            for arg in [*node.args, *(kw.value for kw in node.kwargs)]:
                if isinstance(arg, nodes.Const) and str(arg.value).startswith("_"):
                    yield str(arg.value)


def _template_variables(source_text: str) -> set[str]:
    """Names the template reads from its context (e.g. whether it renders `tools` at all)."""
    from jinja2 import meta

    return set(meta.find_undeclared_variables(_environment().parse(source_text)))


def compile_chat_template(source_text: str, *, source: str):
    """A compiled template, or CheckpointError for a syntax error or a hostile template."""
    from jinja2 import TemplateSyntaxError

    env = _environment()
    try:
        tree = env.parse(source_text)
    except TemplateSyntaxError as exc:
        raise CheckpointError(f"{source}: syntax error at line {exc.lineno}: {exc.message}") from None
    private = sorted(set(_private_names(tree)))
    if private:
        raise CheckpointError(f"{source}: refused: it accesses private attribute(s) {', '.join(private)}")
    return env.from_string(source_text)


# --------------------------------------------------------------------------- special tokens in rendered text
class _SpecialTokens:
    """Finds the tokenizer's special-token spellings in text, and escapes or decodes them."""

    def __init__(self, tokenizer: "Tokenizer") -> None:
        table = getattr(tokenizer, "special_tokens", None)
        self._tokenizer = tokenizer
        self._table: dict[str, int] | None = dict(table) if isinstance(table, dict) and table else None
        if self._table is not None:
            pattern = "|".join(re.escape(s) for s in sorted(self._table, key=len, reverse=True))
        else:  # look-alikes, each confirmed through special_token_id
            pattern = _CANDIDATES
        self._find = re.compile(pattern)
        esc = re.escape(_ESCAPE)
        self._scan = re.compile(f"{esc}{esc}|{esc}(?:{pattern})|(?:{pattern})")

    def id_of(self, spelling: str) -> int | None:
        if self._table is not None:
            return self._table.get(spelling)
        try:
            return self._tokenizer.special_token_id(spelling)
        except KeyError:
            return None

    def escape(self, text: str) -> str:
        """User text with every special spelling (and the escape character itself) marked."""
        if _ESCAPE not in text and not self._find.search(text):
            return text
        text = text.replace(_ESCAPE, _ESCAPE * 2)
        return self._find.sub(lambda m: _ESCAPE + m.group(0) if self.id_of(m.group(0)) is not None else m.group(0), text)

    def encode(self, rendered: str) -> list[int]:
        """Control tokens by id where the template put them; everything else as text."""
        ids: list[int] = []
        text: list[str] = []
        last = 0
        for match in self._scan.finditer(rendered):
            token = match.group(0)
            text.append(rendered[last : match.start()])
            last = match.end()
            if token.startswith(_ESCAPE):
                text.append(token[1:] if token[1:] == _ESCAPE or self.id_of(token[1:]) is not None else token)
                continue
            token_id = self.id_of(token)
            if token_id is None:
                text.append(token)
                continue
            ids.extend(self._tokenizer.encode("".join(text)))
            text.clear()
            ids.append(token_id)
        text.append(rendered[last:])
        tail = "".join(text)
        if tail:
            ids.extend(self._tokenizer.encode(tail))
        return ids


# --------------------------------------------------------------------------- the chat format
def _arguments(arguments: str) -> Any:
    """Templates expect a tool call's arguments as a mapping (`| tojson` renders them)."""
    try:
        return json.loads(arguments)
    except (TypeError, ValueError):
        return arguments


class JinjaChatFormat:
    """The ChatFormat protocol over a Jinja chat template."""

    accepts_template_kwargs = True  # encode_dialog takes `template_kwargs`: extra variables for the template

    def __init__(
        self,
        template: str,
        tokenizer: "Tokenizer",
        *,
        bos_token: str | None,
        eos_token: str | None,
        source: str = "chat template",
        special_tokens: dict[str, str] | None = None,
    ) -> None:
        self.template_text = template
        self._template = compile_chat_template(template, source=source)
        self.family = "hf"
        self.tokenizer = tokenizer
        self._specials = _SpecialTokens(tokenizer)
        self._source = source
        self.supports_tools = "tools" in _template_variables(template)
        # Tool-call tags that are special tokens vanish from text decoded with skip_special_tokens;
        # the parser must see them.
        self.parser_needs_special_tokens = any(
            tag in template and self._specials.id_of(tag) is not None for tag in (TOOL_CALL_OPEN, "<|python_tag|>", "<|python_start|>")
        )
        # bos/eos (and unk/pad, ...) go into the context as HF passes them: plain strings, "" if none.
        self._token_context = {**(special_tokens or {}), "bos_token": bos_token or "", "eos_token": eos_token or ""}

    def _escape_value(self, value: Any) -> Any:
        if isinstance(value, str):
            return self._specials.escape(value)
        if isinstance(value, dict):
            return {k: self._escape_value(v) for k, v in value.items()}
        if isinstance(value, list):
            return [self._escape_value(v) for v in value]
        return value

    def _message(self, message: ChatMessage) -> dict[str, Any]:
        out: dict[str, Any] = {"role": message.role, "content": message.content}
        if message.tool_calls:
            out["tool_calls"] = [
                {"id": c.call_id, "type": "function", "function": {"name": c.name, "arguments": _arguments(c.arguments)}}
                for c in message.tool_calls
            ]
        if message.tool_call_id is not None:
            out["tool_call_id"] = message.tool_call_id
        if message.name is not None:
            out["name"] = message.name
        return self._escape_value(out)

    def _tool(self, tool: ToolDefinition) -> dict[str, Any]:
        function = {"name": tool.name, "description": tool.description, "parameters": tool.parameters or {"type": "object", "properties": {}}}
        return self._escape_value({"type": "function", "function": function})

    def render(self, messages: Sequence[ChatMessage], *, tools: Sequence[ToolDefinition] = (), add_generation_prompt: bool = True,
               template_kwargs: Mapping[str, Any] | None = None) -> str:
        """The template's text, with user-supplied special spellings still escaped. `template_kwargs`
        (vLLM's chat_template_kwargs, e.g. enable_thinking) are user text too; the names below win."""
        from jinja2 import TemplateError

        context = {
            **{name: self._escape_value(value) for name, value in (template_kwargs or {}).items()},
            **self._token_context,
            "messages": [self._message(m) for m in messages],
            "tools": [self._tool(t) for t in tools] or None,
            "documents": None,
            "add_generation_prompt": add_generation_prompt,
            "range": _RangeBudget(),  # shadows the sandbox's range for this render only
        }
        parts: list[str] = []
        size = 0
        deadline_s = time.monotonic() + MAX_RENDER_S
        previous_tracer = sys.gettrace()
        if previous_tracer is None:  # (under a debugger or coverage, only the text-yield check applies)
            sys.settrace(_deadline_tracer(deadline_s))
        try:
            for part in self._template.generate(**context):
                size += len(part)
                if size > MAX_RENDERED_CHARS:
                    raise InvalidRequest(f"the chat template produced more than {MAX_RENDERED_CHARS} characters", param="messages")
                if time.monotonic() > deadline_s:
                    raise _TemplateLimit(f"the chat template rendered for more than {MAX_RENDER_S:g} s")
                parts.append(part)
        except _TemplateLimit as exc:
            raise InvalidRequest(str(exc), param="messages") from None
        except _TemplateRaised as exc:
            raise InvalidRequest(f"the chat template refused these messages: {exc}", param="messages") from None
        except (TemplateError, TypeError, ValueError, LookupError, AttributeError, ArithmeticError, RecursionError) as exc:
            raise InvalidRequest(f"the chat template ({self._source}) failed on these messages: {type(exc).__name__}: {exc}", param="messages") from None
        finally:
            if previous_tracer is None:
                sys.settrace(None)
        return "".join(parts)

    def encode_dialog(
        self, messages: Sequence[ChatMessage], *, tools: Sequence[ToolDefinition] = (), add_generation_prompt: bool = True,
        template_kwargs: Mapping[str, Any] | None = None,
    ) -> list[int]:
        return self._specials.encode(self.render(messages, tools=tools, add_generation_prompt=add_generation_prompt,
                                                 template_kwargs=template_kwargs))

    def output_parser(self, tools: Sequence[ToolDefinition]) -> "OutputParser":
        """Content only without tools. With tools: `<tool_call>{json}</tool_call>` blocks when the
        template teaches them (Hermes, Qwen, SmolLM3), else the JSON / pythonic / <function=...>
        parser. Either way a call is recognised only for an offered tool."""
        from engine.chat.tool_parser import make_output_parser

        if tools and TOOL_CALL_OPEN in self.template_text:
            return TaggedToolCallParser(tools)
        return make_output_parser(tools)


# --------------------------------------------------------------------------- <tool_call> blocks
TOOL_CALL_OPEN, TOOL_CALL_CLOSE = "<tool_call>", "</tool_call>"


class TaggedToolCallParser:
    """Tool calls as `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks, streamed:
    text that could open a block is held back only while it could, a block is sent as a call once
    it closes, and a block that is not a call of an offered tool stays text. Never raises."""

    def __init__(self, tools: Sequence[ToolDefinition]) -> None:
        self._tools = tuple(tools)
        self._held = ""  # a possible block opening, or an open block's text
        self._content: list[str] = []
        self._calls: list[ToolCall] = []

    def push(self, text_delta: str) -> "ParsedDelta":
        from engine.chat.tool_parser import ParsedDelta

        out = ParsedDelta()
        self._held += text_delta
        while self._held:
            start = self._held.find(TOOL_CALL_OPEN)
            if start < 0:  # emit all but a tail that may still become "<tool_call>"
                keep = _partial_suffix(self._held, TOOL_CALL_OPEN)
                self._emit_text(out, self._held[: len(self._held) - keep])
                self._held = self._held[len(self._held) - keep :]
                return out
            self._emit_text(out, self._held[:start])
            self._held = self._held[start:]
            end = self._held.find(TOOL_CALL_CLOSE)
            if end < 0:
                return out  # inside a block: wait for its end
            self._close_block(out, self._held[: end + len(TOOL_CALL_CLOSE)])
            self._held = self._held[end + len(TOOL_CALL_CLOSE) :]
        return out

    def finish(self, stop_token_id: int | None) -> "ParsedOutput":
        from engine.chat.tool_parser import ParsedDelta, ParsedOutput

        if self._held.startswith(TOOL_CALL_OPEN):  # a block the model never closed
            self._close_block(ParsedDelta(), self._held)
        else:
            self._content.append(self._held)
        self._held = ""
        content = "".join(self._content)  # exactly what was streamed, so stream and final agree
        reason = None if stop_token_id is None else "tool_calls" if self._calls else "stop"
        return ParsedOutput(None if self._calls and not content.strip() else content, list(self._calls), reason)

    def _emit_text(self, out: "ParsedDelta", text: str) -> None:
        if text:
            out.content += text
            self._content.append(text)

    def _close_block(self, out: "ParsedDelta", block: str) -> None:
        from engine.chat.tool_parser import ToolCallDelta, parse_output

        inner = block[len(TOOL_CALL_OPEN) :].removesuffix(TOOL_CALL_CLOSE).strip()
        try:
            calls = parse_output(inner, self._tools).tool_calls if inner.startswith("{") else []
        except Exception:  # a parser never raises on model output
            calls = []
        if not calls:
            self._emit_text(out, block)
            return
        for call in calls:
            index = len(self._calls)
            self._calls.append(call)
            out.tool_calls.append(ToolCallDelta(index, call.call_id, call.name, ""))
            out.tool_calls.append(ToolCallDelta(index, None, None, call.arguments))


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `marker`."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:n]):
            return n
    return 0


# --------------------------------------------------------------------------- loading
def _template_from_config(value: Any, source: str) -> str | None:
    """tokenizer_config.json's chat_template: a string, or HF's list of named templates."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, list):
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
        if isinstance(named.get("default"), str):
            return named["default"]
    raise CheckpointError(f"{source}: chat_template must be a string or a list of named templates with a 'default'")


def read_template_file(path: Path) -> str:
    """A template from a .jinja file, or from a JSON file holding {"chat_template": ...}."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{path}: cannot read the chat template: {exc}") from None
    if Path(path).suffix == ".json":
        try:
            value = json.loads(text)
        except json.JSONDecodeError as exc:
            raise CheckpointError(f"{path}: not JSON: {exc}") from None
        template = _template_from_config(value.get("chat_template") if isinstance(value, dict) else None, str(path))
        if not template:
            raise CheckpointError(f"{path}: no chat_template in this JSON file")
        return template
    return text


class NoChatTemplate:
    """The chat format of a checkpoint without a template: every chat request is refused, clearly."""

    family = "hf"
    supports_tools = False
    parser_needs_special_tokens = False

    def __init__(self, message: str, tokenizer: "Tokenizer") -> None:
        self.message = message
        self.tokenizer = tokenizer

    def encode_dialog(self, messages: Sequence[ChatMessage], *, tools: Sequence[ToolDefinition] = (), add_generation_prompt: bool = True) -> list[int]:
        raise InvalidRequest(self.message, param="messages")

    def output_parser(self, tools: Sequence[ToolDefinition]) -> "OutputParser":
        from engine.chat.tool_parser import make_output_parser

        return make_output_parser(tools)


def load_chat_format(
    checkpoint_dir: Path, tokenizer: "Tokenizer", override_template_path: Path | None = None
) -> JinjaChatFormat | NoChatTemplate:
    """The checkpoint's chat format: `override_template_path` (the server's --chat-template) first,
    then chat_template.jinja / chat_template.json, then tokenizer_config.json's chat_template."""
    from engine.tokenizers.hf import read_tokenizer_config

    checkpoint_dir = Path(checkpoint_dir)
    config = read_tokenizer_config(checkpoint_dir) if checkpoint_dir.is_dir() else {}
    template: str | None = None
    source = ""
    if override_template_path is not None:
        template, source = read_template_file(override_template_path), str(override_template_path)
    else:
        for name in CHAT_TEMPLATE_FILES:
            if (checkpoint_dir / name).is_file():
                template, source = read_template_file(checkpoint_dir / name), str(checkpoint_dir / name)
                break
        else:
            source = str(checkpoint_dir / "tokenizer_config.json")
            template = _template_from_config(config.get("chat_template"), source)
    if not template:  # a base model: completions work, chat requests get a clear 400
        return NoChatTemplate(f"{checkpoint_dir} has no chat template (tokenizer_config.json chat_template); start the server with --chat-template FILE", tokenizer)
    specials = {k: s for k in ("unk_token", "pad_token") if isinstance(s := _spelling(config.get(k)), str)}
    return JinjaChatFormat(
        template,
        tokenizer,
        bos_token=getattr(tokenizer, "bos_token", None) or _spelling(config.get("bos_token")) or _name_of(tokenizer, tokenizer.bos_id),
        eos_token=getattr(tokenizer, "eos_token", None) or _spelling(config.get("eos_token")) or _name_of(tokenizer, tokenizer.eos_id),
        source=source,
        special_tokens=specials,
    )


def _name_of(tokenizer: "Tokenizer", token_id: int | None) -> str | None:
    """A Llama tokenizer's bos/eos spelling, for a --chat-template override on a Llama checkpoint."""
    name_of = getattr(tokenizer, "special_token_name", None)
    return name_of(token_id) if name_of is not None and token_id is not None else None


def _spelling(value: Any) -> str | None:
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


__all__ = ["JinjaChatFormat", "NoChatTemplate", "TaggedToolCallParser", "compile_chat_template", "load_chat_format", "read_template_file"]
