"""Guided decoding with xgrammar: compile a request's constraint once (cached by kind and spec), give each
sequence a matcher, and mask a step's guided rows with one bitmask.

Compilation runs in the caller's thread (LLMEngine.add_request), never in the engine loop, so a slow
compile holds up only its own request; a bad schema or grammar is a ValueError for that request alone.
"""
from __future__ import annotations

import json
import threading
from collections import OrderedDict

import torch

from petrel.guided_decoding import GuidedDecodingParams


def _xgrammar():
    try:
        import xgrammar
    except ImportError as exc:   # pragma: no cover - depends on the installation
        raise ValueError("guided decoding needs xgrammar: pip install xgrammar "
                         "(on CPU-only machines `pip install --no-deps xgrammar apache-tvm-ffi` is enough)") from exc
    return xgrammar


class GrammarCompiler:
    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: list[int], cache_size: int = 256):
        xgr = _xgrammar()
        self.vocab_size = vocab_size
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=list(stop_token_ids))
        self._compiler = xgr.GrammarCompiler(info, max_threads=2, cache_enabled=False)
        self._cache: OrderedDict[tuple[str, str], object] = OrderedDict()   # least recently used first
        self._cache_size = cache_size
        self._lock = threading.Lock()
        self.num_compiled = 0        # compilations so far (a repeated constraint is served from the cache)

    def compile(self, params: GuidedDecodingParams):
        key = (params.kind, params.spec)
        with self._lock:
            if key in self._cache:
                self._cache.move_to_end(key)
                return self._cache[key]
        compiled = self._compile(params)
        with self._lock:
            self.num_compiled += 1
            self._cache[key] = compiled
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
            return compiled

    def _compile(self, params: GuidedDecodingParams):
        kind, c = params.kind, self._compiler
        try:
            if kind == "json":
                return c.compile_json_schema(params.schema_text(), any_whitespace=params.any_whitespace)
            if kind == "json_object":      # any JSON object (the builtin JSON grammar would allow any value)
                return c.compile_json_schema('{"type": "object"}', any_whitespace=params.any_whitespace)
            if kind == "regex":
                return c.compile_regex(params.regex)
            if kind == "grammar":
                return c.compile_grammar(params.grammar)
            if kind == "choice":
                return c.compile_grammar("root ::= " + " | ".join(json.dumps(x, ensure_ascii=False) for x in params.choice))
            return c.compile_structural_tag(params.spec)
        except ValueError:
            raise
        except Exception as exc:  # xgrammar raises RuntimeError / its own errors for bad input
            raise ValueError(f"guided_decoding.{kind} could not be compiled: {exc}") from None

    @staticmethod
    def matcher(compiled):
        return _xgrammar().GrammarMatcher(compiled)


def apply_grammar_masks(logits: torch.Tensor, matchers: dict[int, object]) -> None:
    """Mask every row that has a matcher to the tokens its grammar allows next (one bitmask, one apply)."""
    xgr = _xgrammar()
    rows = sorted(matchers)
    bitmask = xgr.allocate_token_bitmask(logits.shape[0], logits.shape[1])
    for row in rows:
        matchers[row].fill_next_token_bitmask(bitmask, row)
    xgr.apply_token_bitmask_inplace(logits, bitmask.to(logits.device), indices=rows)
