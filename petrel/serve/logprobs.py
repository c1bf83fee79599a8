"""petrel's per-token logprob dicts -> OpenAI's two logprob shapes (legacy completions, chat)."""

from __future__ import annotations

from functools import lru_cache

from petrel.outputs import Logprob
from petrel.serve.protocol import CompletionLogprobs, TokenLogprob, TopLogprob


def _byte_alphabet() -> dict[str, int]:
    """Byte-level BPE writes each byte as a printable character; this maps those characters back to bytes."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    chars = {b: b for b in printable}
    shift = 0
    for b in range(256):
        if b not in chars:
            chars[b] = 256 + shift
            shift += 1
    return {chr(c): b for b, c in chars.items()}


_BYTES_OF_CHAR = _byte_alphabet()


class TokenText:
    """Text and raw bytes of single tokens (a token may be part of a multi-byte character)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        try:  # byte-level BPE (GPT-2 style) writes " a" as "Ġa"
            pieces = tokenizer.convert_ids_to_tokens(tokenizer(" a", add_special_tokens=False)["input_ids"])
            self.byte_level = any(p.startswith("\u0120") for p in pieces)
        except Exception:  # noqa: BLE001 - any other tokenizer: bytes from the decoded text
            self.byte_level = False
        self.text = lru_cache(maxsize=65536)(self._text)
        self.bytes = lru_cache(maxsize=65536)(self._bytes)

    def _text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])

    def _bytes(self, token_id: int) -> list[int]:
        if self.byte_level:
            piece = self.tokenizer.convert_ids_to_tokens(token_id)
            if isinstance(piece, str) and piece and all(ch in _BYTES_OF_CHAR for ch in piece):
                return [_BYTES_OF_CHAR[ch] for ch in piece]
        return list(self._text(token_id).encode("utf-8"))


def _top(entry: dict[int, Logprob], k: int) -> list[tuple[int, Logprob]]:
    """The k most likely alternatives, by rank (the sampled token's entry is there even when outside top k)."""
    return sorted(((t, lp) for t, lp in entry.items() if lp.rank is not None and lp.rank <= k), key=lambda x: x[1].rank)


def completion_logprobs(
    token_ids: list[int], entries: list[dict[int, Logprob] | None], k: int, texts: TokenText, offset: int = 0
) -> CompletionLogprobs:
    """Legacy shape; `entries[i]` is None where there is no logprob (the first prompt token)."""
    out = CompletionLogprobs()
    for tok, entry in zip(token_ids, entries):
        text = texts.text(tok)
        out.tokens.append(text)
        out.text_offset.append(offset)
        offset += len(text)
        if entry is None:
            out.token_logprobs.append(None)
            out.top_logprobs.append(None)
            continue
        out.token_logprobs.append(entry[tok].logprob)
        top: dict[str, float] = {}
        for t, lp in _top(entry, k):
            top.setdefault(texts.text(t), lp.logprob)
        out.top_logprobs.append(top)
    return out


def chat_logprobs(
    token_ids: list[int], entries: list[dict[int, Logprob]], k: int, texts: TokenText
) -> list[TokenLogprob]:
    content = []
    for tok, entry in zip(token_ids, entries):
        top = [TopLogprob(token=texts.text(t), logprob=lp.logprob, bytes=texts.bytes(t)) for t, lp in _top(entry, k)]
        content.append(
            TokenLogprob(token=texts.text(tok), logprob=entry[tok].logprob, bytes=texts.bytes(tok), top_logprobs=top)
        )
    return content
