"""GuidedDecodingParams: constrain a request's output to a JSON schema, any JSON, a regex, an EBNF grammar,
a list of choices, or an xgrammar structural tag. Exactly one of them per request."""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

KINDS = ("json", "json_object", "regex", "grammar", "choice", "structural_tag")


@dataclass(frozen=True)
class GuidedDecodingParams:
    json: dict | str | None = None            # a JSON schema (dict or JSON text), or a pydantic model class
    json_object: bool = False                 # any JSON object
    regex: str | None = None
    grammar: str | None = None                # EBNF (GBNF-style, root rule `root`)
    choice: list[str] | None = None           # the output is exactly one of these strings
    structural_tag: dict | str | None = None  # xgrammar structural tag (dict or JSON text)
    any_whitespace: bool = True               # JSON: allow any whitespace between tokens

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

    @property
    def kind(self) -> str:
        return next(k for k in KINDS if getattr(self, k) not in (None, False))

    @property
    def spec(self) -> str:
        """The constraint as canonical text: with `kind`, the key under which its compiled grammar is cached."""
        kind = self.kind
        if kind == "json":
            return _schema_text(self.json) + (" any_ws" if self.any_whitespace else "")
        if kind == "json_object":
            return ""
        if kind == "choice":
            return json.dumps(self.choice, ensure_ascii=False)
        if kind == "structural_tag":
            value = self.structural_tag
            return value if isinstance(value, str) else json.dumps(value, sort_keys=True)
        return getattr(self, kind)

    def schema_text(self) -> str:
        return _schema_text(self.json)


def _schema_text(schema: Any) -> str:
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as exc:
            raise ValueError(f"guided_decoding.json is not valid JSON: {exc}") from None
    elif hasattr(schema, "model_json_schema"):     # a pydantic model class
        schema = schema.model_json_schema()
    if not isinstance(schema, dict):
        raise ValueError(f"guided_decoding.json must be a JSON schema object, got {type(schema).__name__}")
    return json.dumps(schema)     # key order kept: properties are generated in the schema's order
