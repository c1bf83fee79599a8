"""Incremental detokenization that never has to take text back.

Text is released only when it is final: an incomplete UTF-8 sequence (decoded as U+FFFD) waits for
the next token, and a tail that could still grow into a stop string is held until it cannot. So the
streamed pieces always concatenate to the non-streamed text. Stop strings are found by a StopStringScanner
(petrel/engine/stop_strings.py), in time linear in the text.
"""

from __future__ import annotations

from typing import Any

from petrel.engine.stop_strings import StopStringScanner

_CONTEXT_TOKENS = 6  # tokens of context decoded before the new ones, so word-initial spaces come out right


class IncrementalDetokenizer:
    def __init__(
        self,
        tokenizer: Any,  # a transformers tokenizer: decode(ids, skip_special_tokens=...) -> str
        prompt_token_ids: list[int],
        skip_special_tokens: bool = True,
        stop: list[str] | None = None,
        include_stop_str_in_output: bool = False,
    ) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.stop = stop or []
        self._stops = StopStringScanner(self.stop) if self.stop else None
        self.include_stop = include_stop_str_in_output
        self.tokens = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        self.prefix_offset = 0
        self.read_offset = len(self.tokens)
        self.text = ""  # all decoded output text (stop-truncated once a stop string matched)
        self.released = 0  # how much of self.text has been handed out
        self.stopped_by: str | None = None
        self.num_tokens_added = 0  # of the last add_tokens call: how many were taken (fewer when a stop matched)

    def _decode(self, ids: list[int]) -> str:
        text: str = self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)
        return text

    def add_tokens(self, token_ids: list[int]) -> str | None:
        """Append new tokens; returns the stop string if one now matches (the text is then cut, and the
        tokens after the one that completed it are not taken)."""
        self.num_tokens_added = 0
        for tok in token_ids:
            self.tokens.append(tok)
            self.num_tokens_added += 1
            prefix = self._decode(self.tokens[self.prefix_offset : self.read_offset])
            full = self._decode(self.tokens[self.prefix_offset :])
            if full.endswith("\ufffd") or len(full) <= len(prefix):
                continue  # an incomplete character, or nothing visible yet
            piece = full[len(prefix) :]
            self.text += piece
            self.prefix_offset, self.read_offset = self.read_offset, len(self.tokens)
            if self._stops is not None and (match := self._stops.feed(piece)) is not None:
                at, s = match
                self.text = self.text[: at + len(s)] if self.include_stop else self.text[:at]
                self.stopped_by = s
                return s
        return None

    def release(self, finished: bool) -> str:
        """Text that is now final and not yet handed out."""
        end = len(self.text)
        if not finished and self._stops is not None and self.stopped_by is None:
            end -= self._stops.held()
        end = max(end, self.released)
        piece = self.text[self.released : end]
        self.released = end
        return piece
