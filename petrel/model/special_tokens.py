"""Special tokens written inside user-supplied text stay text.

A chat template writes the control tokens (`<|im_start|>`, `<|im_end|>`, ...) around each message; the rendered
text is then tokenized with those strings recognised as control tokens. If a message's content contains the
same strings, a user could close their turn and open a forged `system` turn. So before rendering, every
special-token string inside user-supplied values (message contents, names, tool calls and tool definitions,
template arguments) is replaced by a marker; after rendering, the text between markers is tokenized as usual
and each marker becomes the special-token string tokenized as plain text (split into ordinary tokens).
Values without special-token strings are untouched, so the usual prompt tokenizes exactly as before.
"""

from __future__ import annotations

import re
import secrets
from dataclasses import dataclass, field

_OPEN, _CLOSE = "\ue000", "\ue001"  # private-use characters: no tokenizer's special token contains them


@dataclass
class Escapes:
    """What escape() replaced: originals[k] is marker k's special-token string."""

    nonce: str
    originals: list[str] = field(default_factory=list)

    def marker(self, k: int) -> str:
        return f"{_OPEN}{self.nonce}.{k}{_CLOSE}"

    @property
    def pattern(self) -> re.Pattern:
        return re.compile(f"{_OPEN}{self.nonce}\\.(\\d+){_CLOSE}")


class SpecialTokenText:
    """escape() user-supplied values, render them, then encode() the rendered text (or restore() it)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        decoder = getattr(tokenizer, "added_tokens_decoder", None) or {}
        specials = sorted(
            {t.content for t in decoder.values() if getattr(t, "special", False) and t.content}, key=len, reverse=True
        )
        self._specials = re.compile("|".join(map(re.escape, specials))) if specials else None

    def escape(self, value) -> tuple[object, Escapes]:
        """A copy of value (strings, lists, tuples, dicts at any depth) with each special-token string in its
        strings replaced by a marker. ValueError for a value nested too deeply to walk."""
        escapes = Escapes(secrets.token_hex(4))
        if self._specials is None:
            return value, escapes
        index: dict[str, int] = {}

        def replace(match: re.Match) -> str:
            text = match.group(0)
            if text not in index:
                index[text] = len(escapes.originals)
                escapes.originals.append(text)
            return escapes.marker(index[text])

        def walk(v):
            if isinstance(v, str):
                return self._specials.sub(replace, v) if self._specials.search(v) else v
            if isinstance(v, dict):
                return {walk(k): walk(x) for k, x in v.items()}
            if isinstance(v, (list, tuple)):
                return type(v)(walk(x) for x in v)
            return v

        try:
            return walk(value), escapes
        except RecursionError:
            raise ValueError("messages: the request's values are nested too deeply") from None

    def encode(self, text: str, escapes: Escapes) -> list[int]:
        """Token ids of the rendered text: special tokens the template wrote are control tokens; the escaped
        strings are tokenized as text."""
        tok = self.tokenizer
        if not escapes.originals:
            return tok(text, add_special_tokens=False)["input_ids"]
        parts = escapes.pattern.split(text)
        ids: list[int] = []
        for i, part in enumerate(parts):
            if i % 2:
                ids += tok(escapes.originals[int(part)], add_special_tokens=False, split_special_tokens=True)[
                    "input_ids"
                ]
                continue
            if escapes.nonce in part:
                raise ValueError(
                    "messages: the chat template altered text that holds special-token strings, so "
                    "petrel cannot keep them as text"
                )
            if part:
                ids += tok(part, add_special_tokens=False)["input_ids"]
        return ids

    def restore(self, text: str, escapes: Escapes) -> str:
        """The rendered text with each marker back to the string it replaced."""
        if not escapes.originals:
            return text
        return escapes.pattern.sub(lambda m: escapes.originals[int(m.group(1))], text)
