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


def test_dtype_auto_is_bfloat16_on_cuda_and_float32_on_cpu():
    assert EngineConfig().dtype == "float32"
    assert EngineConfig(device="cuda").dtype == "bfloat16"
    assert EngineConfig(device="cuda:1", dtype="float32").dtype == "float32"
    with pytest.raises(ValueError, match="'auto'"):
        EngineConfig(dtype="float8")


def test_kv_cache_dtype_auto_follows_dtype_and_the_cpu_takes_a_bfloat16_cache():
    """'auto' is the dtype asked for (dtype 'bfloat16' on the CPU: float32 arithmetic beside a bfloat16 cache); on the
    CPU a bfloat16 cache may sit beside float32 arithmetic by name; anything else that differs, and vLLM's fp8
    caches, are refused naming the field."""
    assert EngineConfig().kv_cache_dtype == "float32"
    assert EngineConfig(device="cuda").kv_cache_dtype == "bfloat16"
    assert EngineConfig(kv_cache_dtype="bfloat16").kv_cache_dtype == "bfloat16"
    cpu_bf16 = EngineConfig(dtype="bfloat16")
    assert (cpu_bf16.dtype, cpu_bf16.kv_cache_dtype) == ("float32", "bfloat16")
    assert EngineConfig(dtype="bfloat16", kv_cache_dtype="float32").kv_cache_dtype == "float32"
    for kwargs in (
        {"kv_cache_dtype": "fp8"},
        {"kv_cache_dtype": "float16"},  # beside float32 on the CPU: no kernel reads it
        {"device": "cuda", "kv_cache_dtype": "float32"},  # beside bfloat16 on CUDA
    ):
        with pytest.raises(ValueError, match="kv_cache_dtype"):
            EngineConfig(**kwargs)


def test_kv_cache_memory_defaults_to_a_fraction_of_free_cuda_memory(monkeypatch):
    """None: 2 GiB on CPU (and per rank with tensor parallelism); on one CUDA device 0.9 of the memory free when
    the budget is read (after the weights); a given size is kept."""
    import torch

    from petrel.config import CPU_KV_CACHE_MEMORY, kv_cache_budget

    asked = []
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: asked.append(device) or (10 * 2**30, 80 * 2**30))
    assert kv_cache_budget(EngineConfig()) == CPU_KV_CACHE_MEMORY == 2 * 2**30
    assert kv_cache_budget(EngineConfig(device="cuda", tensor_parallel_size=2)) == CPU_KV_CACHE_MEMORY
    assert kv_cache_budget(EngineConfig(device="cuda", kv_cache_memory=123_456)) == 123_456
    assert asked == []
    assert EngineConfig(device="cuda:1").kv_cache_memory is None
    assert kv_cache_budget(EngineConfig(device="cuda:1")) == int(0.9 * 10 * 2**30)
    assert asked == [torch.device("cuda:1")]
    with pytest.raises(ValueError, match="kv_cache_memory"):
        EngineConfig(kv_cache_memory=0)
