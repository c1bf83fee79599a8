"""Tokenizer loading: a Hugging Face directory as is, a GGUF file's vocabulary converted once and cached."""

from __future__ import annotations

import functools
import os

from petrel.model.cache import cache_key, petrel_cache_dir
from petrel.model.loader import ModelSource
from petrel.model.special_tokens import SpecialTokenText


def chat_prompt(
    tokenizer, messages: list[dict], add_generation_prompt: bool = True, chat_template_kwargs: dict | None = None
) -> dict:
    """The chat template applied to messages: {"prompt": text, "prompt_token_ids": ids} (the template
    writes the special tokens itself, so none are added when encoding). Special-token strings inside the
    messages or arguments are text, not control tokens (petrel/model/special_tokens.py): a message cannot
    close its turn and open another. A caller that wants control tokens renders and tokenizes the prompt itself
    and passes the token ids."""
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("this model's tokenizer has no chat template")
    guard = special_token_text(tokenizer)
    (messages, kwargs), escapes = guard.escape((messages, dict(chat_template_kwargs or {})))
    text = tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=add_generation_prompt, **kwargs
    )
    return {"prompt": guard.restore(text, escapes), "prompt_token_ids": guard.encode(text, escapes)}


def longest_token_chars(tokenizer) -> int:
    """The most characters one token stands for (its vocabulary string's length bounds its text's): a text
    longer than this many characters per token cannot fit a context of that many tokens."""
    return max(map(len, tokenizer.get_vocab()), default=1)


@functools.lru_cache(maxsize=8)
def special_token_text(tokenizer) -> SpecialTokenText:
    """The tokenizer's SpecialTokenText, built once."""
    return SpecialTokenText(tokenizer)


def load_tokenizer(source: ModelSource, tokenizer: str | None = None):
    from transformers import AutoTokenizer

    if tokenizer is not None:
        return AutoTokenizer.from_pretrained(tokenizer)
    if source.kind == "hf":
        return _with_processor_template(AutoTokenizer.from_pretrained(source.path), source.path)
    cached = os.path.join(petrel_cache_dir("tokenizers"), cache_key(source.path))
    if os.path.isfile(os.path.join(cached, "tokenizer_config.json")):
        try:
            return AutoTokenizer.from_pretrained(cached)
        except Exception:
            pass  # a damaged cache entry: convert again
    folder, name = os.path.dirname(source.path), os.path.basename(source.path)
    try:
        tok = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    except ValueError as exc:
        # transformers reads a GGUF's config to pick the tokenizer's class, and knows fewer architectures than petrel
        # (deepseek2); the vocabulary does not depend on the architecture: the generic fast tokenizer reads it
        if "architecture" not in str(exc):
            raise
        from transformers import PreTrainedTokenizerFast

        tok = PreTrainedTokenizerFast.from_pretrained(folder, gguf_file=name)
    try:
        tmp = f"{cached}.tmp{os.getpid()}"
        tok.save_pretrained(tmp)
        os.replace(tmp, cached)
    except OSError:
        pass  # a read-only home: convert each time
    return tok


def _with_processor_template(tok, path: str):
    """The tokenizer, given the directory's processor-level chat template when it has none of its own: published
    vision-language models ship theirs as chat_template.json (newer saves: chat_template.jinja)."""
    if getattr(tok, "chat_template", None):
        return tok
    import json

    jinja, legacy = os.path.join(path, "chat_template.jinja"), os.path.join(path, "chat_template.json")
    if os.path.isfile(jinja):
        with open(jinja) as f:
            tok.chat_template = f.read()
    elif os.path.isfile(legacy):
        with open(legacy) as f:
            tok.chat_template = json.load(f).get("chat_template")
    return tok
