"""Stop strings found in text that arrives a piece at a time, in time linear in the text whatever the stop strings'
lengths.

For each stop string the scanner keeps how long a prefix of it the text so far ends with (the state of a
Knuth-Morris-Pratt matcher, its failure table built only as far as the text has needed). So a piece costs its own
length times the number of stop strings, where searching the text again for each piece (and testing each of its
suffixes against each stop string's prefixes, to know how much to hold back) cost the square of the text's length
for a stop string longer than the text: a client could send one of a million characters.
"""

from __future__ import annotations


class _Matcher:
    """One stop string: `matched` is the length of the longest prefix of it that the text fed so far ends with."""

    __slots__ = ("stop", "failure", "matched")

    def __init__(self, stop: str):
        self.stop = stop
        self.failure: list[int] = []  # failure[i]: longest proper prefix of stop[: i + 1] that is also its suffix
        self.matched = 0

    def _failure_upto(self, n: int) -> None:
        """Extend the failure table to cover stop[:n]."""
        s, failure = self.stop, self.failure
        while len(failure) < n:
            i = len(failure)
            j = failure[i - 1] if i else 0
            while j and s[i] != s[j]:
                j = failure[j - 1]
            failure.append(j + 1 if i and s[i] == s[j] else 0)

    def feed(self, text: str) -> int:
        """Feed `text`; the offset in it just past the first whole match of the stop string, or -1 (none)."""
        s, k, last = self.stop, self.matched, len(self.stop)
        for offset, char in enumerate(text):
            while k and s[k] != char:
                self._failure_upto(k)
                k = self.failure[k - 1]
            if s[k] == char:
                k += 1
            if k == last:
                self.matched = k
                return offset + 1
        self.matched = k
        return -1


class StopStringScanner:
    """`feed(piece)` -> (start, stop) of the match to stop at, or None; `held()` -> how much of the text's end could
    still grow into a stop string (a stream holds that much back)."""

    def __init__(self, stops: list[str]):
        self._matchers = [_Matcher(s) for s in stops if s]
        self._fed = 0  # characters fed so far

    def feed(self, piece: str) -> tuple[int, str] | None:
        """Feed the text's next piece. Where stop strings end in it: the one that starts first (the first listed
        among those that start at the same place), as (its start in the whole text, the stop string)."""
        best = None
        for matcher in self._matchers:
            end = matcher.feed(piece)
            if end != -1:
                start = self._fed + end - len(matcher.stop)
                if best is None or start < best[0]:
                    best = (start, matcher.stop)
        self._fed += len(piece)
        return best

    def held(self) -> int:
        """The length of the longest end of the text fed so far that is a proper prefix of a stop string."""
        return max((m.matched for m in self._matchers if m.matched < len(m.stop)), default=0)
