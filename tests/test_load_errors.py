"""Corrupt or truncated model files give a clear ValueError naming the file, never a crash."""

from __future__ import annotations

import json
import os

import pytest
import torch

from petrel.model.loader import default_model_path, load_model, resolve_model


def _load(path):
    return load_model(resolve_model(str(path)), torch.float32, "cpu")


def test_truncated_and_garbage_gguf(tmp_path):
    data = open(default_model_path(), "rb").read(8 * 1024 * 1024)  # the header and a few tensors, cut short
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(data)
    garbage = tmp_path / "garbage.gguf"
    garbage.write_bytes(b"this is not a gguf file" * 50)
    for path in (truncated, garbage):
        with pytest.raises(ValueError, match=f"could not read the model at {path}"):
            _load(path)


def test_corrupt_safetensors(tmp_path):
    (tmp_path / "config.json").write_text(
        json.dumps(
            {
                "architectures": ["LlamaForCausalLM"],
                "vocab_size": 32,
                "hidden_size": 16,
                "intermediate_size": 32,
                "num_hidden_layers": 1,
                "num_attention_heads": 2,
            }
        )
    )
    (tmp_path / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{broken json header}")
    with pytest.raises(ValueError, match="could not read the model at .*corrupt"):
        _load(tmp_path)


def test_missing_model_names_the_path(tmp_path):
    with pytest.raises(ValueError, match=str(tmp_path / "nope")):
        resolve_model(str(tmp_path / "nope"))
    assert os.path.exists(default_model_path())
