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
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

START, END = "<tool_call>", "</tool_call>"


@dataclass
class ParsedToolCall:
    name: str
    arguments: str  # JSON text


@dataclass
class ParserOutput:
    content: str = ""
    calls: list[ParsedToolCall] = field(default_factory=list)

    def __iadd__(self, other: ParserOutput) -> ParserOutput:
        self.content += other.content
        self.calls.extend(other.calls)
        return self


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
    def __init__(self, allow_bare_json: bool = True):
        self.allow_bare_json = allow_bare_json
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
        self.num_calls += len(calls)

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
                        return out
                    block, rest = self.buffer, ""  # an unclosed block at the end of the output
                else:
                    block, rest = self.buffer[: end + len(END)], self.buffer[end + len(END) :]
                inner = block[len(START) :]
                if inner.endswith(END):
                    inner = inner[: -len(END)]
                calls = parse_calls(inner)
                if calls:
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
