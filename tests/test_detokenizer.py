"""The incremental detokenizer without a model: a byte-level tokenizer (one token per UTF-8 byte) makes every
multi-byte character arrive split across tokens."""

from __future__ import annotations

import pytest

from petrel.engine.detokenizer import IncrementalDetokenizer


class ByteTokenizer:
    """Token id = one byte of UTF-8; decode as a tokenizer does (invalid bytes become U+FFFD)."""

    @staticmethod
    def encode(text: str) -> list[int]:
        return list(text.encode("utf-8"))

    @staticmethod
    def decode(ids, skip_special_tokens: bool = True) -> str:
        return bytes(ids).decode("utf-8", errors="replace")


TEXT = "Petrels 🐦 fly far — über the sea, 海鳥."


def stream(detok: IncrementalDetokenizer, ids: list[int], step: int = 1) -> tuple[list[str], str | None]:
    pieces, matched = [], None
    for i in range(0, len(ids), step):
        matched = detok.add_tokens(ids[i : i + step])
        pieces.append(detok.release(finished=matched is not None or i + step >= len(ids)))
        if matched is not None:
            break
    return pieces, matched


@pytest.mark.parametrize("step", [1, 2, 5])
def test_streamed_pieces_concatenate_to_the_text_and_never_hold_a_broken_character(step):
    tok = ByteTokenizer()
    detok = IncrementalDetokenizer(tok, tok.encode("Prompt: "))
    pieces, matched = stream(detok, tok.encode(TEXT), step)
    assert matched is None
    assert "".join(pieces) == TEXT
    assert all("\ufffd" not in p for p in pieces)
    assert any(p == "" for p in pieces) or step > 1  # a split emoji is held back for a token or more


@pytest.mark.parametrize("include", [False, True])
def test_stop_string_cuts_the_text_and_its_prefix_is_held_back(include):
    tok = ByteTokenizer()
    detok = IncrementalDetokenizer(tok, [], stop=["the sea"], include_stop_str_in_output=include)
    pieces, matched = stream(detok, tok.encode(TEXT))
    assert matched == "the sea"
    expected = TEXT[: TEXT.index("the sea")] + ("the sea" if include else "")
    assert "".join(pieces) == expected
    # "the se" could still become the stop string: nothing of it was released before the match
    assert not any(p.endswith("the") or p.endswith("the ") for p in pieces[:-1])


def test_tokens_after_the_stop_string_in_one_call_are_not_taken():
    tok = ByteTokenizer()
    detok = IncrementalDetokenizer(tok, [], stop=["far"])
    ids = tok.encode(TEXT)
    matched = detok.add_tokens(ids)  # several tokens at once, as speculative decoding hands them over
    assert matched == "far"
    assert detok.num_tokens_added == len(tok.encode(TEXT[: TEXT.index("far") + 3]))
    assert detok.release(finished=True) == TEXT[: TEXT.index("far")]


def test_no_stop_means_every_token_is_taken():
    tok = ByteTokenizer()
    detok = IncrementalDetokenizer(tok, [])
    assert detok.add_tokens(tok.encode("abc")) is None
    assert detok.num_tokens_added == 3
