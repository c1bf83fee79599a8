"""Reasoning output: the `<think>...</think>` part a reasoning model (Qwen3, DeepSeek-R1 distills) writes before its
answer, split out as `reasoning_content`.

On for a model whose chat template writes `<think>` (`uses_think_tags`), off otherwise. The output is reasoning when
it opens with `<think>` (leading whitespace allowed), or from its start when the prompt already ends with `<think>`
(templates that open the block themselves, as DeepSeek-R1's do); the reasoning ends at `</think>`, and the rest,
leading whitespace dropped, is content. An output with no `<think>` is all content (Qwen3 with
`chat_template_kwargs: {"enable_thinking": false}`: its template closes an empty block in the prompt).

`feed(piece)` / `finish()` return the (reasoning, content) text that became final; a piece that may be the start of
a tag is held back, so any split of the output gives the same result as the whole.
"""

from __future__ import annotations

START, END = "<think>", "</think>"


def uses_think_tags(template_source: str | None) -> bool:
    return template_source is not None and START in template_source and END in template_source


def prompt_opens_reasoning(prompt_text: str) -> bool:
    """The prompt ends inside a think block the template opened: the output starts as reasoning."""
    text = prompt_text.rstrip()
    return text.endswith(START)


def _held(text: str, tag: str) -> int:
    """Length of the longest suffix of text that is a proper prefix of tag."""
    for n in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


class ReasoningParser:
    def __init__(self, in_reasoning: bool = False):
        self.state = "reasoning" if in_reasoning else "start"  # start -> reasoning -> content, or start -> content
        self.buffer = ""

    def feed(self, piece: str) -> tuple[str, str]:
        self.buffer += piece
        return self._advance(final=False)

    def finish(self) -> tuple[str, str]:
        return self._advance(final=True)

    def _advance(self, final: bool) -> tuple[str, str]:
        reasoning = content = ""
        while True:
            if self.state == "start":
                body = self.buffer.lstrip()
                if body.startswith(START):
                    self.buffer, self.state = body[len(START) :], "reasoning"
                    continue
                if not final and START.startswith(body):
                    return reasoning, content  # still may open a block
                self.state = "content"
                continue
            if self.state == "reasoning":
                at = self.buffer.find(END)
                if at >= 0:
                    reasoning += self.buffer[:at]
                    self.buffer, self.state = self.buffer[at + len(END) :].lstrip(), "after"
                    continue
                keep = 0 if final else _held(self.buffer, END)
                reasoning += self.buffer[: len(self.buffer) - keep]
                self.buffer = self.buffer[len(self.buffer) - keep :]
                return reasoning, content
            if self.state == "after":  # whitespace after </think> is dropped until the content starts
                self.buffer = self.buffer.lstrip()
                if self.buffer:
                    self.state = "content"
                    continue
                return reasoning, content
            content += self.buffer
            self.buffer = ""
            return reasoning, content


def split_reasoning(text: str, in_reasoning: bool = False) -> tuple[str | None, str]:
    """(reasoning or None when there was no think block, content) of a whole output."""
    parser = ReasoningParser(in_reasoning)
    r1, c1 = parser.feed(text)
    r2, c2 = parser.finish()
    opened = in_reasoning or text.lstrip().startswith(START)
    return (r1 + r2 if opened else None), c1 + c2
