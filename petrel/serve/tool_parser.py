"""Tool calls out of model text, incrementally: Hermes-style <tool_call>{json}</tool_call> blocks and bare JSON.

`feed(piece)` and `finish()` return what became final: content text and completed calls. Every decision
depends only on the text seen so far, and text that could still turn into a tool call is held back, so
feeding the output in any pieces gives the same content and calls as feeding it whole (tests check every
split point). A call is handed out once its JSON is complete; its arguments are the JSON text of the
"arguments" (or "parameters") object.

Recognised:
  <tool_call>{"name": "f", "arguments": {...}}</tool_call>   any number, with text around them
  {"name": "f", "arguments": {...}}                          the whole output is one JSON object ...
  [{"name": "f", "arguments": {...}}, ...]                   ... or a list of them
A block whose JSON does not parse as a call stays in the content, as written.

A call block written `{"name": ..., "arguments": {...}}` keeps its arguments as the model wrote them (the
other forms are re-serialized). With incremental=True the parser also reports each call as fragments, the way
OpenAI streams tool calls: first the name with "" arguments, as soon as the block's `"arguments":` is followed
by its `{`, then the arguments text as it grows; a call in another form comes as one fragment once complete. The
fragments of a call join to its arguments. A block whose name was already streamed stays a call.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

START, END = "<tool_call>", "</tool_call>"
_HEADER = re.compile(r'\s*\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"arguments"\s*:\s*(?=\{)')


@dataclass
class ParsedToolCall:
    name: str
    arguments: str  # JSON text


@dataclass
class CallFragment:
    index: int  # which call of the output (0, 1, ...)
    name: str | None  # set on a call's first fragment only
    arguments: str  # more of the arguments' JSON text


@dataclass
class ParserOutput:
    content: str = ""
    calls: list[ParsedToolCall] = field(default_factory=list)
    fragments: list[CallFragment] = field(default_factory=list)  # incremental=True only

    def __iadd__(self, other: ParserOutput) -> ParserOutput:
        self.content += other.content
        self.calls.extend(other.calls)
        self.fragments.extend(other.fragments)
        return self


def _object_end(text: str) -> int | None:
    """Where the JSON object text starts with ends (the index after its closing brace), or None if not yet."""
    depth, in_string, escaped = 0, False, False
    for i, ch in enumerate(text):
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in "{[":
            depth += 1
        elif ch in "}]":
            depth -= 1
            if depth == 0:
                return i + 1
    return None


def _header(inner: str) -> tuple[str, int] | None:
    """(name, where the arguments object starts) of a block's text that opens `{"name": ..., "arguments": {`."""
    m = _HEADER.match(inner)
    if m is None:
        return None
    try:
        name = json.loads(m.group(1))
    except json.JSONDecodeError:
        return None
    return name, m.end()


def raw_arguments(inner: str) -> tuple[str, str] | None:
    """(name, arguments text as written) of a whole block `{"name": "f", "arguments": {...}}`; else None."""
    head = _header(inner)
    if head is None:
        return None
    rest = inner[head[1] :]
    end = _object_end(rest)
    if end is None or rest[end:].strip() != "}":
        return None
    try:
        if not isinstance(json.loads(rest[:end]), dict):
            return None
    except json.JSONDecodeError:
        return None
    return head[0], rest[:end]


def _block_calls(inner: str) -> list[ParsedToolCall] | None:
    calls = parse_calls(inner)
    raw = raw_arguments(inner) if calls and len(calls) == 1 else None
    if raw is not None and raw[0] == calls[0].name:
        calls[0].arguments = raw[1]
    return calls


def _as_call(obj) -> ParsedToolCall | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    if set(obj) - {"name", "arguments", "parameters"}:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return None
    if not isinstance(args, dict):
        return None
    return ParsedToolCall(obj["name"], json.dumps(args, ensure_ascii=False))


def parse_calls(text: str) -> list[ParsedToolCall] | None:
    """One JSON object or list of objects that are all calls, with nothing but whitespace after; else None."""
    text = text.strip()
    try:
        obj, end = json.JSONDecoder().raw_decode(text)
    except json.JSONDecodeError:
        return None
    if text[end:].strip():
        return None
    objs = obj if isinstance(obj, list) else [obj]
    calls = [_as_call(o) for o in objs]
    if not calls or any(c is None for c in calls):
        return None
    return calls


def _held_prefix(text: str, tag: str) -> int:
    """Length of the longest suffix of text that is a proper prefix of tag (it may still become the tag)."""
    for n in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


class ToolCallParser:
    def __init__(self, allow_bare_json: bool = True, incremental: bool = False):
        self.allow_bare_json = allow_bare_json
        self.incremental = incremental
        self.streamed: tuple[int, int] | None = None  # the open block's call being streamed: (args start, sent)
        self.state = "start"  # start -> text | call | bare
        self.buffer = ""  # text not decided yet
        self.pending_ws = ""  # whitespace held until non-whitespace content follows it
        self.num_calls = 0
        self.finished = False

    # ------------------------------------------------------------------ public
    def feed(self, piece: str) -> ParserOutput:
        if self.finished:
            raise RuntimeError("feed() after finish()")
        self.buffer += piece
        return self._advance(final=False)

    def finish(self) -> ParserOutput:
        if self.finished:
            return ParserOutput()
        out = self._advance(final=True)
        self.finished = True
        if self.num_calls == 0 and self.pending_ws:  # plain text keeps its trailing whitespace
            out.content += self.pending_ws
        self.pending_ws = ""
        return out

    # ------------------------------------------------------------------ internals
    def _content(self, out: ParserOutput, text: str) -> None:
        """Emit content, holding a whitespace-only run until something non-blank follows it."""
        if not text:
            return
        text = self.pending_ws + text
        stripped = text.rstrip()
        if not stripped:
            self.pending_ws = text
            return
        self.pending_ws = text[len(stripped) :]
        out.content += stripped

    def _calls(self, out: ParserOutput, calls: list[ParsedToolCall]) -> None:
        self.pending_ws = ""  # whitespace between calls is layout, not content
        out.calls.extend(calls)
        if self.incremental:
            for i, c in enumerate(calls, start=self.num_calls):
                out.fragments += [CallFragment(i, c.name, ""), CallFragment(i, None, c.arguments)]
        self.num_calls += len(calls)

    def _stream_open_block(self, out: ParserOutput) -> None:
        """Incremental: the name, then the arguments so far, of the call block being written."""
        inner = self.buffer[len(START) :]
        if self.streamed is None:
            head = _header(inner)
            if head is None:
                return
            self.pending_ws = ""
            out.fragments.append(CallFragment(self.num_calls, head[0], ""))
            self.streamed = (head[1], 0)
        start, sent = self.streamed
        args = inner[start:]
        end = _object_end(args)
        args = args if end is None else args[:end]
        if len(args) > sent:
            out.fragments.append(CallFragment(self.num_calls, None, args[sent:]))
            self.streamed = (start, len(args))

    def _close_streamed_block(self, out: ParserOutput, inner: str) -> None:
        """The block whose name was streamed ended: the rest of its arguments, and it counts as a call."""
        start, sent = self.streamed
        raw = raw_arguments(inner)
        rest = raw[1][sent:] if raw is not None else ""
        if rest:
            out.fragments.append(CallFragment(self.num_calls, None, rest))
        out.calls.append(ParsedToolCall(_header(inner)[0], raw[1] if raw is not None else inner[start:][:sent]))
        self.num_calls += 1
        self.streamed = None

    def _advance(self, final: bool) -> ParserOutput:
        out = ParserOutput()
        while True:
            if self.state == "start":
                body = self.buffer.lstrip()
                if not body:
                    if final:
                        self._content(out, self.buffer)
                        self.buffer = ""
                    return out
                if self.allow_bare_json and body[0] in "{[":
                    self.state = "bare"
                    continue
                if START.startswith(body) and not final:
                    return out  # may still be the start tag
                self.state = "text"
                continue
            if self.state == "bare":
                if not final:
                    return out  # a bare call is known only when the output ends
                calls = parse_calls(self.buffer)
                if calls:
                    self._calls(out, calls)
                else:
                    self._content(out, self.buffer)
                self.buffer = ""
                return out
            if self.state == "text":
                at = self.buffer.find(START)
                if at < 0:
                    keep = 0 if final else _held_prefix(self.buffer, START)
                    self._content(out, self.buffer[: len(self.buffer) - keep])
                    self.buffer = self.buffer[len(self.buffer) - keep :]
                    return out
                self._content(out, self.buffer[:at])
                self.buffer = self.buffer[at:]
                self.state = "call"
                continue
            if self.state == "call":
                end = self.buffer.find(END)
                if end < 0:
                    if not final:
                        if self.incremental:
                            self._stream_open_block(out)
                        return out
                    block, rest = self.buffer, ""  # an unclosed block at the end of the output
                else:
                    block, rest = self.buffer[: end + len(END)], self.buffer[end + len(END) :]
                inner = block[len(START) :]
                if inner.endswith(END):
                    inner = inner[: -len(END)]
                calls = None if self.streamed is not None else _block_calls(inner)
                if self.streamed is not None:
                    self.pending_ws = ""
                    self._close_streamed_block(out, inner)
                elif calls:
                    self._calls(out, calls)
                else:
                    self._content(out, block)
                self.buffer = rest
                self.state = "text"
                if not rest and not final:
                    return out
                if not rest and final:
                    return out
                continue
            raise AssertionError(self.state)


def parse_all(text: str, allow_bare_json: bool = True, prefix: str = "") -> ParserOutput:
    """The whole output at once (what a non-streamed response uses); `prefix` is text the server prefilled."""
    parser = ToolCallParser(allow_bare_json)
    out = parser.feed(prefix + text)
    out += parser.finish()
    return out
