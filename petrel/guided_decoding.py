"""GuidedDecodingParams: constrain a request's output to a JSON schema, any JSON, a regex, an EBNF grammar,
a list of choices, or an xgrammar structural tag. Exactly one of them per request.
GuidedDecodingLimits: how large a constraint the grammar compiler takes."""

from __future__ import annotations

import json
import re
import re._constants as sre_constants
import re._parser as sre_parse
from dataclasses import dataclass
from typing import Any

KINDS = ("json", "json_object", "regex", "grammar", "choice", "structural_tag")


@dataclass(frozen=True)
class GuidedDecodingParams:
    json: dict | str | None = None  # a JSON schema (dict or JSON text), or a pydantic model class
    json_object: bool = False  # any JSON object
    regex: str | None = None
    grammar: str | None = None  # EBNF (GBNF-style, root rule `root`)
    choice: list[str] | None = None  # the output is exactly one of these strings
    structural_tag: dict | str | None = None  # xgrammar structural tag (dict or JSON text)
    # JSON: allow any whitespace between tokens. Off by default, as in the server's response_format: a small model
    # sampled with free whitespace can pad with newlines until max_tokens and never close the object
    any_whitespace: bool = False
    json_prefix: str = ""  # JSON: literal text the output has before the JSON ...
    json_suffix: str = ""  # ... and after it (e.g. a tool call's closing tag)

    def __post_init__(self):
        given = [k for k in KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise ValueError(f"guided_decoding needs exactly one of {list(KINDS)}, got {given or 'none'}")
        if self.choice is not None and (not self.choice or not all(isinstance(c, str) and c for c in self.choice)):
            raise ValueError("guided_decoding.choice must be a non-empty list of non-empty strings")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"guided_decoding.{name} must be a non-empty string")
        for name in ("json_prefix", "json_suffix"):
            value = getattr(self, name)
            if not isinstance(value, str) or (value and self.json is None):
                raise ValueError(f"guided_decoding.{name} must be a string, and goes with json only")

    @property
    def kind(self) -> str:
        return next(k for k in KINDS if getattr(self, k) not in (None, False))

    @property
    def spec(self) -> str:
        """The constraint as canonical text: with `kind`, the key under which its compiled grammar is cached."""
        kind = self.kind
        if kind == "json":
            affixes = json.dumps([self.json_prefix, self.json_suffix]) if self.json_prefix or self.json_suffix else ""
            return _schema_text(self.json) + (" any_ws" if self.any_whitespace else "") + affixes
        if kind == "json_object":
            return " any_ws" if self.any_whitespace else ""
        if kind == "choice":
            return json.dumps(self.choice, ensure_ascii=False)
        if kind == "structural_tag":
            value = self.structural_tag
            # key order kept: a JSON schema inside generates its properties in the order they are written
            return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)
        return getattr(self, kind)

    def schema_text(self) -> str:
        return _schema_text(self.json)


def _schema_text(schema: Any) -> str:
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as exc:
            raise ValueError(f"guided_decoding.json is not valid JSON: {exc}") from None
        except RecursionError:
            raise ValueError("guided_decoding.json is nested too deeply to parse") from None
    elif hasattr(schema, "model_json_schema"):  # a pydantic model class
        schema = schema.model_json_schema()
    if not isinstance(schema, dict):
        raise ValueError(f"guided_decoding.json must be a JSON schema object, got {type(schema).__name__}")
    try:
        return json.dumps(schema)  # key order kept: properties are generated in the schema's order
    except RecursionError:
        raise ValueError("guided_decoding.json is nested too deeply to serialize") from None


KIB = 1024


@dataclass(frozen=True)
class GuidedDecodingLimits:
    """The largest constraint a GrammarCompiler takes: a bigger one is a ValueError naming its field, before any
    compile. Compile time grows faster than linearly with size; each default admits every realistic request and
    keeps a compile at its limit within a few seconds on a shared 2-core CPU (the compile timeout bounds the rest,
    e.g. a short schema pattern with a huge repeat count). Measured with SmolLM2's 49k-token vocabulary and
    xgrammar 0.2.9, compiling in-process:
      choice   4096 strings / 64 KiB: 0.6 s (16k strings / 272 KiB: 2.3 s; 100k strings: minutes and ~1 GB)
      json     64 KiB of properties: ~0.9 s (148 KiB: 5.6 s); 100 levels of nested objects: 0.36 s
      regex    16 KiB of `[a-z]+N` alternatives: ~0.9 s (26 KiB: 1.5 s)
      grammar  128 KiB of chained rules: ~3 s (242 KiB: 8.9 s); a forced call over 50 tools is ~100 KiB, 0.1 s
    """

    max_choices: int = 4096  # strings in a choice list
    max_choice_bytes: int = 64 * KIB  # their UTF-8 bytes together
    max_schema_bytes: int = 64 * KIB  # a JSON schema (or structural tag) as compact JSON text
    max_schema_depth: int = 128  # objects and arrays nested inside each other in it
    max_regex_bytes: int = 16 * KIB
    max_regex_repeats: int = 100_000  # a regex's pieces once repeat counts are multiplied out (see regex_size)
    max_grammar_bytes: int = 128 * KIB  # EBNF text (a forced tool call's grammar counts too)

    def __post_init__(self):
        for name, value in vars(self).items():
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"GuidedDecodingLimits.{name} must be a positive integer, got {value!r}")

    def check(self, params: GuidedDecodingParams) -> None:
        """ValueError naming guided_decoding.<kind> if the constraint is over a limit."""
        kind = params.kind
        if kind == "choice":
            self._at_most(kind, "strings", len(params.choice), self.max_choices)
            self._at_most(kind, "bytes", sum(len(c.encode()) for c in params.choice), self.max_choice_bytes)
        elif kind in ("regex", "grammar"):
            limit = self.max_regex_bytes if kind == "regex" else self.max_grammar_bytes
            self._at_most(kind, "bytes", len(getattr(params, kind).encode()), limit)
            if kind == "regex":
                self._at_most(
                    kind,
                    "pieces with its repeat counts multiplied out",
                    regex_size(params.regex),
                    self.max_regex_repeats,
                )
        elif kind in ("json", "structural_tag"):
            given = getattr(params, kind)
            if isinstance(given, str):  # scanned before it is parsed: a parse could recurse too deeply
                self._at_most(kind, "levels of nesting", json_depth(given), self.max_schema_depth)
            text = params.schema_text() if kind == "json" else params.spec
            self._at_most(kind, "bytes", len(text.encode()), self.max_schema_bytes)
            self._at_most(kind, "levels of nesting", json_depth(text), self.max_schema_depth)

    @staticmethod
    def _at_most(kind: str, unit: str, value: int, limit: int) -> None:
        if value > limit:
            raise ValueError(
                f"guided_decoding.{kind} has {value} {unit}; at most {limit} are accepted "
                "(compile time grows faster than a constraint's size)"
            )


def regex_size(pattern: str) -> int:
    """How many pieces a regex has once its bounded repeats are written out: `((a|b){1,1000}){1,1000}` is 58 bytes
    and 1,000,000 pieces (it compiled for seconds, and its grammar took ~100 MB to hand over); `[a-z]{20000}` is
    20,000. Python's own regex parser reads the pattern; one it cannot read counts as its length (the compile
    timeout still bounds it)."""
    try:
        parsed = sre_parse.parse(pattern)
    except Exception:  # noqa: BLE001 - a dialect Python does not read (xgrammar's is ECMAScript-like)
        return len(pattern)
    return _pieces(parsed, 0)


_REPEATS = {"MAX_REPEAT", "MIN_REPEAT", "POSSESSIVE_REPEAT"}


def _pieces(items, depth: int) -> int:
    """Pieces of a parsed (sub)pattern, repeats multiplied out (an unbounded repeat compiles to a loop: its minimum)."""
    if depth > 100:  # nested this deeply: count it as too large
        return 1 << 62
    total = 0
    for op, arg in items:
        name = str(op)
        if name in _REPEATS:
            low, high, sub = arg
            total += max(low if high == sre_constants.MAXREPEAT else high, 1) * _pieces(sub, depth + 1)
        elif name == "SUBPATTERN":
            total += _pieces(arg[-1], depth + 1)
        elif name == "ATOMIC_GROUP":
            total += _pieces(arg, depth + 1)
        elif name == "BRANCH":  # (None, [alternatives])
            total += sum(_pieces(branch, depth + 1) for branch in arg[1])
        elif name == "GROUPREF_EXISTS":  # (group, yes, no or None)
            total += sum(_pieces(branch, depth + 1) for branch in arg[1:] if branch is not None)
        elif name in ("ASSERT", "ASSERT_NOT"):
            total += _pieces(arg[1], depth + 1)
        else:
            total += 1
    return total


def json_depth(text: str) -> int:
    """How deeply objects and arrays nest in JSON text (a scan, not a parse: no recursion however deep it goes)."""
    depth = deepest = 0
    for bracket in _BRACKETS.findall(_STRINGS.sub("", text)):
        depth += 1 if bracket in "[{" else -1
        deepest = max(deepest, depth)
    return deepest


_STRINGS = re.compile(r'"(?:[^"\\]|\\.)*"')  # JSON string literals (their brackets are text, not nesting)
_BRACKETS = re.compile(r"[\[\]{}]")
