"""Shared fixtures: one engine on the real default model for the end-to-end tests (loading takes seconds)."""
from __future__ import annotations

import os

import pytest
import torch


@pytest.fixture(scope="session")
def llm():
    from petrel import LLM
    engine = LLM()
    yield engine
    engine.shutdown()


@pytest.fixture(scope="session")
def hf_model():
    """The transformers oracle: the same GGUF, dequantized by transformers' own loader."""
    from transformers import AutoModelForCausalLM
    from petrel.model.loader import default_model_path
    path = default_model_path()
    model = AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                                 dtype=torch.float32)
    return model.eval()


def free_blocks(llm) -> int:
    return llm.engine.call(lambda core: core.block_manager.num_free_blocks)


@pytest.fixture(scope="session")
def tiny(tmp_path_factory):
    """tiny(kv_heads=4, tied=False, rope_scaling=None, seed=0, head_dim=None) -> Tiny (transformers + petrel models)."""
    pytest.importorskip("transformers")
    from tiny_llama import tiny_factory
    return tiny_factory(tmp_path_factory)
