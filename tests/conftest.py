"""Shared fixtures: one engine on the real default model for the end-to-end tests (loading takes seconds)."""

from __future__ import annotations

import os

# Triton reads this when it is first imported (torch._dynamo, which transformers pulls in, imports it): set before any
# test module, the Triton kernels' tests run in its interpreter whatever the files collected ahead of them import.
os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory):
    """The default model's tokenizer saved to a folder: tiny random-weight models borrow it."""
    from petrel.model.loader import resolve_model
    from petrel.model.tokenizer import load_tokenizer

    path = tmp_path_factory.mktemp("tokenizer")
    load_tokenizer(resolve_model(None)).save_pretrained(path)
    return str(path)


@pytest.fixture(scope="session")
def llm():
    from petrel import LLM

    engine = LLM()
    yield engine
    engine.shutdown()


def load_hf_gguf(path: str, tokenizer: bool = False):
    """(model, tokenizer or None): transformers' own loading of a GGUF file, float32, with the metadata parsed once.

    transformers builds a fresh gguf.GGUFReader for the config, the tokenizer and the weights, and each one walks
    the whole vocabulary in Python (~10 s for Gemma 3's 262k tokens). The reader is read-only, so one instance
    serves all three; the loading itself (field conversion, dequantization, renames) is still transformers'."""
    import functools

    import gguf
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = os.path.dirname(path), os.path.basename(path)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(gguf, "GGUFReader", functools.lru_cache(maxsize=1)(gguf.GGUFReader))
        tok = AutoTokenizer.from_pretrained(folder, gguf_file=name) if tokenizer else None
        model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    return model.eval(), tok


@pytest.fixture(scope="session")
def hf_model():
    """The transformers oracle: the same GGUF, dequantized by transformers' own loader."""
    from petrel.model.loader import default_model_path

    return load_hf_gguf(default_model_path())[0]


def free_blocks(llm) -> int:
    return llm.engine.call(lambda core: core.block_manager.num_free_blocks)


@pytest.fixture(scope="session")
def tiny(tmp_path_factory):
    """tiny(kv_heads=4, tied=False, rope_scaling=None, seed=0, head_dim=None) -> Tiny (transformers + petrel models)."""
    pytest.importorskip("transformers")
    from tiny_llama import tiny_factory

    return tiny_factory(tmp_path_factory)
