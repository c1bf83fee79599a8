"""EngineConfig checks every option when it is made: wrong types and unknown devices are refused by name."""

from __future__ import annotations

import pytest

from petrel.config import EngineConfig


@pytest.mark.parametrize(
    "option,value,error",
    [
        ("device", "tpu", ValueError),
        ("device", "cuda:x", ValueError),
        ("seed", "abc", TypeError),
        ("enable_prefix_caching", "no", TypeError),
        ("max_num_seqs", True, TypeError),
        ("dtype", 32, TypeError),
        ("kv_cache_memory", 1.5e9, TypeError),
        ("kv_transfer_peers", [8001], TypeError),
        ("max_model_len", "4096", TypeError),
        ("enable_lora", 1, TypeError),
        ("kv_transfer_timeout", "60", TypeError),
    ],
)
def test_a_wrong_value_is_refused_naming_the_option(option, value, error):
    with pytest.raises(error, match=option):
        EngineConfig(**{option: value})


def test_right_values_of_every_kind_are_taken():
    config = EngineConfig(
        device="cuda:1",
        seed=7,
        enable_prefix_caching=False,
        kv_transfer_timeout=5,
        max_model_len=None,
        speculative_config={"method": "ngram"},
        kv_transfer_peers=("a:1",),
    )
    assert config.device == "cuda:1" and config.kv_transfer_timeout == 5 and config.speculative_config.method == "ngram"


def test_unknown_options_are_refused():
    with pytest.raises(TypeError, match="unknown engine option"):
        EngineConfig.from_kwargs(enable_magic=True)
