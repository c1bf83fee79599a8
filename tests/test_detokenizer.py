"""The incremental detokenizer without a model: a byte-level tokenizer (one token per UTF-8 byte) makes every
multi-byte character arrive split across tokens."""

from __future__ import annotations

import random
import time

import pytest

from petrel.engine.detokenizer import IncrementalDetokenizer
from petrel.engine.stop_strings import StopStringScanner


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


def _first_stop(text: str, stops: list[str], new_from: int) -> tuple[int, str] | None:
    """The match a stream stops at once text[new_from:] has arrived (the earliest start; the first listed on a tie),
    searched for by brute force."""
    best = None
    for s in stops:
        at = text.find(s, max(0, new_from - len(s) + 1))
        if at != -1 and (best is None or at < best[0]):
            best = (at, s)
    return best


def _held(text: str, stops: list[str]) -> int:
    return max(
        (n for s in stops for n in range(1, min(len(text), len(s) - 1) + 1) if s.startswith(text[-n:])), default=0
    )


def test_the_scanner_finds_what_a_brute_force_search_finds():
    rng = random.Random(0)
    for _ in range(2000):
        stops = ["".join(rng.choice("ab") for _ in range(rng.randint(1, 6))) for _ in range(rng.randint(1, 4))]
        text = "".join(rng.choice("abc") for _ in range(rng.randint(0, 30)))
        scanner, fed, expected_match = StopStringScanner(stops), 0, None
        while fed < len(text):
            piece = text[fed : fed + rng.randint(1, 4)]
            match = scanner.feed(piece)
            expected_match = _first_stop(text[: fed + len(piece)], stops, fed)
            fed += len(piece)
            assert match == expected_match, (stops, text, fed)
            if match is not None:
                break
            assert scanner.held() == _held(text[:fed], stops), (stops, text, fed)


def test_a_stop_string_longer_than_the_text_costs_linear_time():
    """64 stop strings of a million characters and 3,000 tokens that never start them: each token's search and
    hold-back check took time growing with the text (the square of it in all: ~22 s here, 2-core EPYC, on the
    caller's thread, which is a server's event loop); now each costs its own characters."""
    tok = ByteTokenizer()
    detok = IncrementalDetokenizer(tok, [], stop=["a" * 1_000_000 + "b"] * 64)
    start = time.perf_counter()
    for _ in range(3000):
        assert detok.add_tokens([ord("b")]) is None
        assert detok.release(finished=False) == "b"
    assert time.perf_counter() - start < 3.0
