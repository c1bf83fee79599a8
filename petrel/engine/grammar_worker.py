"""The grammar compile worker: a child process that compiles guided decoding constraints with xgrammar, one at a
time, and sends each compiled grammar back serialized (CompiledGrammar.serialize_json).

Why a process: xgrammar's compile is C++ with no way to cancel it, and a small constraint can run for minutes (a
JSON schema pattern `a{N}` grows with N squared). A thread running it could only be abandoned, still burning a core
and holding its memory; this process is killed instead (GrammarCompiler does that at its compile timeout).

Run as a script (`python -P grammar_worker.py <threads>`), not as a petrel module: it imports xgrammar and the
standard library only. Messages both ways are framed as an 8-byte big-endian length, then the bytes:
  parent -> worker: first the vocabulary (TokenizerInfo.serialize_json()), then one request per compile
                    {"method": "json_schema" | "regex" | "grammar" | "structural_tag", "text": ...,
                     "any_whitespace": bool, "before": str, "after": str}   (the last three: json_schema only;
                    before / after: literal text around the JSON)
  worker -> parent: b"R" once ready, then per request b"K" + the serialized grammar, or b"E" + the error message.
The worker exits when its stdin closes (the parent ended or closed it).
"""

from __future__ import annotations

import json
import os
import struct
import sys

HEADER = struct.Struct(">Q")  # a message's length, before its bytes


def read_message(fd: int) -> bytes | None:
    """One framed message from fd (blocking), or None at end of input."""
    header = _read_exact(fd, HEADER.size)
    if header is None:
        return None
    return _read_exact(fd, HEADER.unpack(header)[0])


def _read_exact(fd: int, size: int) -> bytes | None:
    buffer = bytearray()
    while len(buffer) < size:
        chunk = os.read(fd, min(size - len(buffer), 1 << 20))
        if not chunk:
            return None
        buffer += chunk
    return bytes(buffer)


def write_message(fd: int, payload: bytes) -> None:
    view = memoryview(HEADER.pack(len(payload)) + payload)
    while view:
        view = view[os.write(fd, view) :]


def compile_request(compiler, request: dict):
    """The compiled grammar for one request (xgrammar's exceptions propagate)."""
    method, text = request["method"], request["text"]
    if method == "json_schema":
        any_whitespace = request.get("any_whitespace", True)
        before, after = request.get("before", ""), request.get("after", "")
        if not before and not after:
            return compiler.compile_json_schema(text, any_whitespace=any_whitespace)
        import xgrammar

        parts = [xgrammar.Grammar.from_ebnf(f"root ::= {json.dumps(before, ensure_ascii=False)}")] if before else []
        parts.append(xgrammar.Grammar.from_json_schema(text, any_whitespace=any_whitespace))
        if after:
            parts.append(xgrammar.Grammar.from_ebnf(f"root ::= {json.dumps(after, ensure_ascii=False)}"))
        return compiler.compile_grammar(xgrammar.Grammar.concat(*parts))
    if method == "regex":
        return compiler.compile_regex(text)
    if method == "grammar":
        return compiler.compile_grammar(text)
    if method == "structural_tag":
        return compiler.compile_structural_tag(text)
    raise ValueError(f"unknown compile method {method!r}")


def main() -> None:
    # the protocol gets its own copy of stdout; fd 1 then points at stderr, so that anything printed (by Python or
    # by xgrammar's C++) cannot corrupt a message
    reply_fd = os.dup(1)
    os.dup2(2, 1)
    vocabulary = read_message(0)  # read before the slow import, so that the parent's write of it returns at once
    if vocabulary is None:
        return
    import xgrammar

    info = xgrammar.TokenizerInfo.deserialize_json(vocabulary.decode())
    compiler = xgrammar.GrammarCompiler(info, max_threads=int(sys.argv[1]), cache_enabled=False)
    write_message(reply_fd, b"R")
    while (message := read_message(0)) is not None:
        try:
            compiled = compile_request(compiler, json.loads(message))
            reply = b"K" + compiled.serialize_json().encode()
        except Exception as exc:  # noqa: BLE001 - every failure is the constraint's: reported, the worker goes on
            reply = b"E" + (str(exc) or type(exc).__name__).encode(errors="replace")
        write_message(reply_fd, reply)


if __name__ == "__main__":
    sys.exit(main())
