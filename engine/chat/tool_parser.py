"""Generated text -> content + tool calls, incrementally, for every Llama tool-call syntax.

Syntaxes (any of them, wherever the Llama formats put them):
- JSON: `{"name": "f", "parameters": {...}}` (also "arguments", an optional "type": "function", or
  OpenAI's nesting under "function"), one object, a list of objects, or objects separated by `;`;
  at the start of the output or after `<|python_tag|>`.
- pythonic: `[f(a=1, b="x"), g()]` (Llama 3.2/3.3/4), optionally after `<|python_tag|>` or inside
  `<|python_start|>...<|python_end|>`. Parsed with `ast`, literals only: nothing is evaluated.
- function tags: `<function=f>{"a": 1}</function>`, anywhere in the text.
- built-in tools (Llama 3.1): `<|python_tag|>brave_search.call(query="...")`, and
  `<|python_tag|>` + code for code_interpreter.

Only tools the request offered are recognised, so `[1, 2]`, `{"name": "Bob"}` or a markdown link
stay text. Garbage and half-formed calls stay text, and a parser never raises on model output.

Streaming: text that could still become a tool call is held back only while it could; a call is
sent as soon as it is complete (a delta with its id and name, then one with its arguments), so
a call that turns out malformed was never streamed. Arguments are canonical JSON text
(`json.dumps`, non-ASCII kept), the same in the stream and in the final `ParsedOutput`.
"""

from __future__ import annotations

import ast
import json
import math
import re
import secrets
from dataclasses import dataclass, field
from typing import Any, Callable, Literal, Protocol, Sequence

from engine.types import ToolCall, ToolDefinition

PYTHON_TAG = "<|python_tag|>"  # Llama 3.1+: what follows is a tool call or code
PYTHON_START = "<|python_start|>"  # Llama 4's tags; tolerated in output, never prompted
PYTHON_END = "<|python_end|>"
FUNCTION_TAG = "<function="
FUNCTION_END = "</function>"
BUILTIN_QUERY_TOOLS = frozenset({"brave_search", "wolfram_alpha", "photogen"})  # name.call(query=...)
CODE_INTERPRETER = "code_interpreter"

_MARKERS = (PYTHON_TAG, PYTHON_START, FUNCTION_TAG)
_EARLY_CHECK_CHARS = 1024
_JSON_CALL_KEYS = ("name", "parameters", "arguments", "type", "function")


# --------------------------------------------------------------------------- result types
@dataclass(slots=True)
class ToolCallDelta:
    index: int  # position of the call in this output
    call_id: str | None  # set on the call's first delta
    name: str | None  # set on the call's first delta
    arguments: str  # a fragment of the arguments' JSON text


@dataclass(slots=True)
class ParsedDelta:
    content: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)


@dataclass(slots=True)
class ParsedOutput:
    content: str | None  # None when the output was only tool calls
    tool_calls: list[ToolCall]
    # "tool_calls": ended on a stop token (<|eot_id|>, <|eom_id|>, <|eom|>...) after tool calls,
    # the model awaits their results; "stop": ended on a stop token without calls; None: ended
    # another way (length, stop string), the caller knows why.
    finish_reason: Literal["stop", "tool_calls"] | None


class OutputParser(Protocol):
    def push(self, text_delta: str) -> ParsedDelta: ...

    def finish(self, stop_token_id: int | None) -> ParsedOutput: ...


def new_call_id() -> str:
    return "call_" + secrets.token_hex(12)


# --------------------------------------------------------------------------- one call -> (name, arguments)
class _NotACall(Exception):
    """The text is not a well-formed call to an offered tool."""


def _canonical_arguments(arguments: Any) -> str:
    if isinstance(arguments, str):  # some models double-encode the arguments object
        try:
            arguments = json.loads(arguments)
        except ValueError:
            raise _NotACall("arguments are a string, not an object") from None
    if not isinstance(arguments, dict):
        raise _NotACall("arguments are not an object")
    try:
        return json.dumps(arguments, ensure_ascii=False, allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise _NotACall(str(exc)) from None


def _literal(node: ast.AST) -> Any:
    """A Python literal (JSON's true/false/null accepted too) as a JSON-compatible value."""
    if isinstance(node, ast.Constant) and (node.value is None or isinstance(node.value, (str, bool, int, float))):
        if isinstance(node.value, float) and not math.isfinite(node.value):
            raise _NotACall("non-finite number")
        return node.value
    if isinstance(node, (ast.List, ast.Tuple)):
        return [_literal(e) for e in node.elts]
    if isinstance(node, ast.Dict):
        if any(k is None for k in node.keys):
            raise _NotACall("** in a dict")
        keys = [_literal(k) for k in node.keys]  # type: ignore[arg-type]
        if not all(isinstance(k, str) for k in keys):
            raise _NotACall("dict keys must be strings")
        return dict(zip(keys, (_literal(v) for v in node.values)))
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        value = _literal(node.operand)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise _NotACall("sign on a non-number")
        return -value if isinstance(node.op, ast.USub) else value
    if isinstance(node, ast.Name) and node.id in ("true", "false", "null"):
        return {"true": True, "false": False, "null": None}[node.id]
    raise _NotACall(f"not a literal: {type(node).__name__}")


def _pythonic_call(text: str, names: frozenset[str]) -> tuple[str, str]:
    """`f(a=1)` for an offered f, or `brave_search.call(query="...")` for an offered built-in."""
    try:
        node = ast.parse(text.strip(), mode="eval").body
    except (SyntaxError, ValueError, MemoryError, RecursionError):
        raise _NotACall("not Python") from None
    if not isinstance(node, ast.Call) or node.args:
        raise _NotACall("not a call with keyword arguments")
    func = node.func
    if isinstance(func, ast.Name):
        name = func.id
    elif isinstance(func, ast.Attribute) and func.attr == "call" and isinstance(func.value, ast.Name):
        name = func.value.id
        if name not in BUILTIN_QUERY_TOOLS:
            raise _NotACall("not a built-in tool")
    else:
        raise _NotACall("not a plain function name")
    if name not in names:
        raise _NotACall(f"{name} was not offered")
    arguments: dict[str, Any] = {}
    for keyword in node.keywords:
        if keyword.arg is None or keyword.arg in arguments:
            raise _NotACall("**kwargs or a repeated argument")
        arguments[keyword.arg] = _literal(keyword.value)
    return name, _canonical_arguments(arguments)


def _json_call(text: str, names: frozenset[str]) -> tuple[str, str]:
    try:
        obj = json.loads(text)
    except (ValueError, RecursionError):
        raise _NotACall("not JSON") from None
    if not isinstance(obj, dict):
        raise _NotACall("not an object")
    if isinstance(obj.get("function"), dict) and "name" not in obj:  # OpenAI's nesting
        obj = obj["function"]
    if set(obj) - set(_JSON_CALL_KEYS) or obj.get("type", "function") != "function":
        raise _NotACall("unexpected keys")
    name = obj.get("name")
    if not isinstance(name, str) or name not in names:
        raise _NotACall("no offered tool name")
    arguments = obj["parameters"] if "parameters" in obj else obj.get("arguments", {})
    return name, _canonical_arguments(arguments)


def _element_call(text: str, names: frozenset[str]) -> tuple[str, str]:
    stripped = text.strip()
    return _json_call(stripped, names) if stripped.startswith("{") else _pythonic_call(stripped, names)


# --------------------------------------------------------------------------- "could this still be a call?"
_IDENT_START = re.compile(r"[A-Za-z_]\w*")
_JSON_FIRST_KEY = re.compile(r'\{\s*(?:"((?:[^"\\]|\\.)*)("?))?')
# the call's name: the first key, or after "type": "function" and/or OpenAI's "function": {
_JSON_NAME = re.compile(
    r'\{\s*(?:"type"\s*:\s*"function"\s*,\s*)?(?:"function"\s*:\s*\{\s*)?"name"\s*:\s*"((?:[^"\\]|\\.)*)("?)'
)


def _could_start_call(partial: str, names: frozenset[str]) -> bool:
    """Whether an incomplete element can still become a call to an offered tool."""
    text = partial.lstrip()
    if not text:
        return True
    if text.startswith("{"):
        return _could_start_json_call(text, names)
    match = _IDENT_START.match(text)
    if match is None:
        return False
    name, rest = match.group(), text[match.end() :]
    if not rest:
        return any(n.startswith(name) for n in names)
    if rest.startswith("("):
        return name in names
    if rest.startswith("."):
        return name in names and name in BUILTIN_QUERY_TOOLS and (rest.startswith(".call(") or ".call(".startswith(rest))
    return False


def _could_start_json_call(text: str, names: frozenset[str]) -> bool:
    key = _JSON_FIRST_KEY.match(text)
    if key is not None and key.group(1) is not None:
        first_key, closed = key.group(1), key.group(2)
        if closed and first_key not in _JSON_CALL_KEYS:
            return False
        if not closed and not any(k.startswith(first_key) for k in _JSON_CALL_KEYS):
            return False
    elif key is not None and len(text) > key.end() and text[key.end()] != '"':
        return False  # "{ 1" or "{}": no string key
    name = _JSON_NAME.match(text)
    if name is not None:
        value, closed = name.group(1), name.group(2)
        return value in names if closed else any(n.startswith(value) for n in names)
    return True


def _partial_marker_len(text: str, markers: Sequence[str]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of a marker."""
    longest = max(len(m) for m in markers)
    for length in range(min(len(text), longest - 1), 0, -1):
        tail = text[-length:]
        if any(m.startswith(tail) for m in markers):
            return length
    return 0


# --------------------------------------------------------------------------- a run of calls
class _CallRun:
    """Scans `[call, call]`, or `call; call` without brackets, fed in pieces.

    Tracks bracket depth and string literals so that an element ends exactly at its top-level
    `,`/`]` (bracketed) or where its brackets close (unbracketed); each complete element is parsed
    on its own. Work per feed is proportional to the new text."""

    def __init__(self, names: frozenset[str]) -> None:
        self.names = names
        self.text = ""
        self.calls: list[tuple[str, str]] = []
        self.bracketed: bool | None = None  # decided by the first non-space character
        self.done = False  # the run ended; `rest` is the text after it
        self.failed = False
        self.rest = ""
        self._pos = 0
        self._depth = 0
        self._quote: str | None = None
        self._escape = False
        self._elem_start = 0
        self._elem_open = False  # an unbracketed element has started (non-space seen)

    def feed(self, text: str) -> list[tuple[str, str]]:
        """Scan more text (appended to `text` here or by the caller); return the calls it completed."""
        self.text += text
        new_calls: list[tuple[str, str]] = []
        while self._pos < len(self.text) and not (self.done or self.failed):
            self._step(self.text[self._pos], new_calls)
            self._pos += 1
        if not (self.done or self.failed):
            between = self.bracketed is False and not self._elem_open  # only separators so far
            partial = "" if between else self.text[self._elem_start :]
            # the name is decided within the first characters; later ones need no re-check
            if len(partial) <= _EARLY_CHECK_CHARS and not _could_start_call(partial, self.names):
                self._fail()
        return new_calls

    def close(self) -> None:
        """The text ended: an unbracketed run is complete if no element is half-way."""
        if self.done or self.failed:
            return
        if self.bracketed is False and self.calls and not self.text[self._elem_start :].strip(" \t\r\n;,"):
            self.done = True
        else:
            self._fail()

    def _fail(self) -> None:
        self.failed = True

    def _end_element(self, end: int, new_calls: list[tuple[str, str]]) -> None:
        try:
            call = _element_call(self.text[self._elem_start : end], self.names)
        except _NotACall:
            self._fail()
            return
        self.calls.append(call)
        new_calls.append(call)

    def _step(self, ch: str, new_calls: list[tuple[str, str]]) -> None:
        i = self._pos
        if self._quote is not None:
            if self._escape:
                self._escape = False
            elif ch == "\\":
                self._escape = True
            elif ch == self._quote:
                self._quote = None
            return
        if self.bracketed is None:
            if ch.isspace():
                return
            self.bracketed = ch == "["
            if self.bracketed:
                self._depth, self._elem_start = 1, i + 1
                return
            self._elem_start = i
        if not self.bracketed and self._depth == 0:
            self._between_elements(ch, i)
            if self.done or self.failed or ch in ";," or ch.isspace():
                return
        if ch in "\"'":
            self._quote = ch
        elif ch in "([{":
            self._depth += 1
        elif ch in ")]}":
            self._depth -= 1
            if self._depth < 0:
                self._fail()
            elif self.bracketed and self._depth == 0:  # the list's "]"
                if self.text[self._elem_start : i].strip():
                    self._end_element(i, new_calls)
                elif not self.calls:
                    self._fail()  # "[]" calls nothing
                if not self.failed:
                    self.done, self.rest = True, self.text[i + 1 :]
            elif not self.bracketed and self._depth == 0:
                self._end_element(i + 1, new_calls)
                self._elem_start, self._elem_open = i + 1, False
        elif ch == "," and self.bracketed and self._depth == 1:
            self._end_element(i, new_calls)
            self._elem_start = i + 1

    def _between_elements(self, ch: str, i: int) -> None:
        """Unbracketed, at depth 0: separators, the start of the next element, or the end."""
        if self._elem_open:
            return
        if ch.isspace():
            return
        if ch in ";,":
            if self.calls and not self.text[self._elem_start : i].strip():
                self._elem_start = i + 1
                return
            self._fail()
            return
        if self.calls and self.text[self._elem_start : i].strip() == "" and not (ch == "{" or ch.isalpha() or ch == "_"):
            self.done, self.rest = True, self.text[i:]  # something else follows the calls
            return
        self._elem_open = True
        self._elem_start = i if not self.text[self._elem_start : i].strip() else self._elem_start


# --------------------------------------------------------------------------- the streaming parser
class ToolCallParser:
    """The incremental OutputParser for every Llama tool-call syntax (see the module docstring)."""

    def __init__(self, tools: Sequence[ToolDefinition], *, new_call_id: Callable[[], str] = new_call_id) -> None:
        self._names = frozenset(t.name for t in tools)
        self._new_call_id = new_call_id
        self._mode: Literal["start", "content", "run", "tagged", "code", "function"] = "start"
        self._held = ""  # text not yet emitted nor handed to a call scanner
        self._content: list[str] = []
        self._leading_space = ""  # whitespace before any visible content: dropped if calls come
        self._after_call = False  # whitespace right after a call is dropped
        self._calls: list[ToolCall] = []
        self._run: _CallRun | None = None
        self._run_prefix = ""  # the text that opened the run (leading space, tags), for fallback
        self._code = ""
        self._broken = False  # an internal error: everything after it is plain content

    # ---- public
    def push(self, text_delta: str) -> ParsedDelta:
        out = ParsedDelta()
        if self._broken:
            self._emit_content(out, text_delta)
            return out
        try:
            self._held += text_delta
            self._advance(out, final=False)
        except Exception:  # a parser never raises on model output
            self._break(out)
        return out

    def finish(self, stop_token_id: int | None) -> ParsedOutput:
        out = ParsedDelta()
        try:
            if not self._broken:
                self._advance(out, final=True)
                self._finish_mode(out)
        except Exception:
            self._break(out)
        self._emit_content(out, self._held)  # whatever is still held is plain text
        self._held = ""
        if self._leading_space and not self._calls:  # a whitespace-only answer is still an answer
            self._content.append(self._leading_space)
        content = "".join(self._content)
        if self._calls and not content.strip():
            content_or_none: str | None = None
        else:
            content_or_none = content
        if stop_token_id is None:
            reason: Literal["stop", "tool_calls"] | None = None
        else:
            reason = "tool_calls" if self._calls else "stop"
        return ParsedOutput(content_or_none, list(self._calls), reason)

    # ---- states
    def _advance(self, out: ParsedDelta, *, final: bool) -> None:
        progressed = True
        while progressed and self._held:
            progressed = getattr(self, f"_in_{self._mode}")(out, final)

    def _in_start(self, out: ParsedDelta, final: bool) -> bool:
        text = self._held.lstrip()
        if not text:
            return False  # only whitespace so far: it may precede a call
        for marker, mode in ((PYTHON_TAG, "tagged"), (PYTHON_START, "tagged"), (FUNCTION_TAG, "function")):
            if text.startswith(marker):
                self._open(mode, len(self._held) - len(text) + (len(marker) if mode == "tagged" else 0))
                return True
        if text[0] in "[{" and self._names:
            self._open("run", len(self._held) - len(text))
            return True
        if any(m.startswith(text) for m in _MARKERS) and not final:
            return False
        self._mode = "content"
        return True

    def _in_content(self, out: ParsedDelta, final: bool) -> bool:
        text = self._held
        at = min((i for i in (text.find(PYTHON_TAG), text.find(PYTHON_START), text.find(FUNCTION_TAG)) if i >= 0), default=-1)
        if at >= 0:
            self._emit_content(out, text[:at].replace(PYTHON_END, ""))
            self._held = text[at:]
            self._mode = "start"
            return True
        keep = 0 if final else _partial_marker_len(text, _MARKERS + (PYTHON_END,))
        self._emit_content(out, text[: len(text) - keep].replace(PYTHON_END, ""))
        self._held = text[len(text) - keep :]
        return False

    def _open(self, mode: str, consumed: int) -> None:
        """Enter a call mode; the first `consumed` held characters (spaces, a tag) are its prefix."""
        self._run_prefix, self._held = self._held[:consumed], self._held[consumed:]
        self._mode = mode  # type: ignore[assignment]
        if mode in ("run", "tagged"):
            self._run = _CallRun(self._names)

    def _in_run(self, out: ParsedDelta, final: bool) -> bool:
        run = self._run
        assert run is not None
        run.text += self._held  # handed over before scanning, so an internal error loses nothing
        self._held = ""
        for name, arguments in run.feed(""):
            self._emit_call(out, name, arguments)
        if final:
            run.close()
        if run.done:
            self._run = None
            self._held = _drop_prefix(run.rest.lstrip(), PYTHON_END) if run.rest.strip() else ""
            self._mode = "content"
            return bool(self._held)
        if run.failed:
            return self._run_failed(out)
        return False

    def _in_tagged(self, out: ParsedDelta, final: bool) -> bool:
        """After <|python_tag|>/<|python_start|>: calls, else code for code_interpreter."""
        return self._in_run(out, final)

    def _run_failed(self, out: ParsedDelta) -> bool:
        run = self._run
        assert run is not None
        self._run = None
        emitted = len(run.calls)
        if emitted:  # calls already streamed stay calls; the rest is text
            self._held = run.text[run._elem_start :].lstrip(" \t\r\n,;")
            self._mode = "content"
            return True
        tagged = self._mode == "tagged"
        if tagged and CODE_INTERPRETER in self._names:
            self._code, self._held = "", run.text
            self._mode = "code"
            return True
        # not a call: its text is content (a tag the model wrote is not shown)
        self._held = run.text
        self._emit_content(out, _without_tags(self._run_prefix))
        self._mode = "content"
        return True

    def _in_code(self, out: ParsedDelta, final: bool) -> bool:
        self._code += self._held
        self._held = ""
        end = self._code.find(PYTHON_END)
        if end >= 0:
            self._held = self._code[end + len(PYTHON_END) :]
            self._code = self._code[:end]
            self._emit_code(out)
            self._mode = "content"
            return True
        return False

    def _in_function(self, out: ParsedDelta, final: bool) -> bool:
        text = self._held
        end = text.find(FUNCTION_END)
        if end < 0:
            if not final and _could_be_function_tag(text, self._names):
                return False
            self._function_is_text(out, text)
            return True
        match = re.fullmatch(r"<function=([A-Za-z_][\w.-]*)>(.*)", text[:end], re.DOTALL)
        try:
            if match is None or match.group(1) not in self._names:
                raise _NotACall("not an offered function")
            name, arguments = match.group(1), _canonical_arguments(json.loads(match.group(2)))
        except (_NotACall, ValueError, RecursionError):
            self._function_is_text(out, text)
            return True
        self._emit_call(out, name, arguments)
        self._held = text[end + len(FUNCTION_END) :]
        self._mode = "content"
        return True

    def _function_is_text(self, out: ParsedDelta, text: str) -> None:
        """Not a function call after all: emit it as content, past the "<function=" that
        would otherwise be found again."""
        self._emit_content(out, self._run_prefix + text[: len(FUNCTION_TAG)])
        self._run_prefix = ""
        self._held = text[len(FUNCTION_TAG) :]
        self._mode = "content"

    def _finish_mode(self, out: ParsedDelta) -> None:
        """The text ended: close open runs and code; each pass leaves a call mode for good."""
        while True:
            if self._mode in ("run", "tagged"):
                self._in_run(out, True)
            elif self._mode == "code" and not self._in_code(out, True):  # no <|python_end|>: code to the end
                self._emit_code(out)
                self._mode = "content"
            self._advance(out, final=True)
            if self._mode not in ("run", "tagged", "code"):
                return

    # ---- output
    def _emit_content(self, out: ParsedDelta, text: str) -> None:
        if self._after_call:
            text = text.lstrip()
            self._after_call = not text
        if not text:
            return
        if not self._content:  # whitespace alone is held: it may only separate tool calls
            if not text.strip():
                self._leading_space += text
                return
            text, self._leading_space = self._leading_space + text, ""
        out.content += text
        self._content.append(text)

    def _emit_call(self, out: ParsedDelta, name: str, arguments: str) -> None:
        index = len(self._calls)
        self._leading_space, self._after_call = "", True
        call = ToolCall(self._new_call_id(), name, arguments)
        self._calls.append(call)
        out.tool_calls.append(ToolCallDelta(index, call.call_id, name, ""))
        out.tool_calls.append(ToolCallDelta(index, None, None, arguments))

    def _emit_code(self, out: ParsedDelta) -> None:
        code, self._code = self._code, ""
        if code.strip():
            self._emit_call(out, CODE_INTERPRETER, json.dumps({"code": code.strip("\n")}, ensure_ascii=False))
        else:  # a tag with nothing after it: no call, the text around it stays
            self._emit_content(out, _without_tags(self._run_prefix) + code)

    def _break(self, out: ParsedDelta) -> None:
        """Unexpected trouble: stop parsing; everything not yet emitted becomes content."""
        self._broken = True
        pending = _without_tags(self._run_prefix) if self._mode != "content" else ""
        if self._run is not None:
            pending += self._run.text[self._run._elem_start :] if self._run.calls else self._run.text
        pending += self._code + self._held
        self._run, self._code, self._held, self._run_prefix = None, "", "", ""
        self._emit_content(out, pending)


def _without_tags(text: str) -> str:
    for tag in (PYTHON_TAG, PYTHON_START):
        text = text.replace(tag, "")
    return text


def _drop_prefix(text: str, prefix: str) -> str:
    return text[len(prefix) :] if text.startswith(prefix) else text


def _could_be_function_tag(text: str, names: frozenset[str]) -> bool:
    """`<function=name>{...` still on its way to `</function>`."""
    head = text[len(FUNCTION_TAG) :]
    close = head.find(">")
    name = head if close < 0 else head[:close]
    if close < 0:
        return re.fullmatch(r"[\w.-]*", name) is not None and any(n.startswith(name) for n in names)
    return name in names and head[close + 1 :].lstrip()[:1] in ("", "{")


class ContentOnlyParser:
    """No tools offered: everything is content."""

    def __init__(self) -> None:
        self._content: list[str] = []

    def push(self, text_delta: str) -> ParsedDelta:
        self._content.append(text_delta)
        return ParsedDelta(text_delta)

    def finish(self, stop_token_id: int | None) -> ParsedOutput:
        return ParsedOutput("".join(self._content), [], None if stop_token_id is None else "stop")


def make_output_parser(
    tools: Sequence[ToolDefinition], *, new_call_id: Callable[[], str] = new_call_id
) -> OutputParser:
    return ToolCallParser(tools, new_call_id=new_call_id) if tools else ContentOnlyParser()


def parse_output(
    text: str, tools: Sequence[ToolDefinition], *, stop_token_id: int | None = None, new_call_id: Callable[[], str] = new_call_id
) -> ParsedOutput:
    """One-shot parse of a whole output (the same parser, fed at once)."""
    parser = make_output_parser(tools, new_call_id=new_call_id)
    parser.push(text)
    return parser.finish(stop_token_id)


_FORCED_CALL_HEAD = re.compile(r'\{"name": ("(?:[^"\\]|\\.)*"), "arguments": ')  # the layout compat/structured.py fixes


class JsonCallStreamParser:
    """Output constrained to JSON calls (tool_choice required or named: compat/structured.py's
    grammar): `{"name": "f", "arguments": {...}}`, or a list of them. The grammar guarantees the
    shape, so arguments stream as they are generated: a call's first delta carries its id and name,
    later ones pieces of its arguments' text, which is the generated JSON itself (the same text in
    the stream and in the final ParsedOutput). An answer cut short keeps its partial last call."""

    def __init__(self, *, new_call_id: Callable[[], str] = new_call_id) -> None:
        self._new_call_id = new_call_id
        self._text = ""
        self._pos = 0  # next character to scan
        self._calls: list[ToolCall] = []
        self._in_arguments = False
        self._depth = 0
        self._quote = False
        self._escape = False

    def push(self, text_delta: str) -> ParsedDelta:
        out = ParsedDelta()
        self._text += text_delta
        while self._pos < len(self._text):
            if self._in_arguments:
                self._scan_arguments(out)
            elif not self._open_call(out):
                break
        return out

    def finish(self, stop_token_id: int | None) -> ParsedOutput:
        reason: Literal["stop", "tool_calls"] | None = None
        if stop_token_id is not None:
            reason = "tool_calls" if self._calls else "stop"
        return ParsedOutput(None if self._calls else self._text, list(self._calls), reason)

    def _open_call(self, out: ParsedDelta) -> bool:
        """Find the next call's name and the start of its arguments; False until they are in."""
        match = _FORCED_CALL_HEAD.search(self._text, self._pos)
        if match is None:
            return False
        call = ToolCall(self._new_call_id(), json.loads(match.group(1)), "")
        self._calls.append(call)
        out.tool_calls.append(ToolCallDelta(len(self._calls) - 1, call.call_id, call.name, ""))
        self._pos, self._in_arguments, self._depth = match.end(), True, 0
        return True

    def _scan_arguments(self, out: ParsedDelta) -> None:
        start = self._pos
        while self._pos < len(self._text) and self._in_arguments:
            ch = self._text[self._pos]
            self._pos += 1
            if self._quote:
                if self._escape:
                    self._escape = False
                elif ch == "\\":
                    self._escape = True
                elif ch == '"':
                    self._quote = False
            elif ch == '"':
                self._quote = True
            elif ch in "{[":
                self._depth += 1
            elif ch in "}]":
                self._depth -= 1
                self._in_arguments = self._depth > 0
        piece = self._text[start : self._pos]
        if piece:
            call = self._calls[-1]
            call.arguments += piece
            out.tool_calls.append(ToolCallDelta(len(self._calls) - 1, None, None, piece))
