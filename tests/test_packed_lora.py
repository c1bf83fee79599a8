"""Packed LoRA through the Executor (LoraConfig(task_id, weights, config) in TensorRT-LLM's layout;
petrel/executor/packed_lora.py) on the tiny random Llama: a PEFT adapter packed here the way TensorRT-LLM's
converter packs it (rows of flattened lora_A then lora_B * alpha / r, padded; config rows of module id, layer,
adapter size) gives the greedy tokens of the PEFT adapter itself (transformers' merged model, and the Executor
given its directory); it is cached by task_id; the fused qkv and gate_up module ids equal their split forms; bad
packings are refused naming the field."""

from __future__ import annotations

import json

import pytest
import torch

from petrel.config import EngineConfig
from petrel.executor import Executor, LoraConfig, OutputConfig, Request

peft = pytest.importorskip("peft")

# PEFT module -> TensorRT-LLM module id (attn_q, attn_k, attn_v, attn_dense, mlp_h_to_4h, mlp_gate, mlp_4h_to_h)
MODULE_IDS = {"q_proj": 1, "k_proj": 2, "v_proj": 3, "o_proj": 4, "gate_proj": 5, "up_proj": 7, "down_proj": 6}
PROMPT = [5, 17, 33, 61, 99, 120, 7, 42, 8, 200]


def pack(adapter_dir) -> tuple[dict, torch.Tensor, torch.Tensor]:
    """(the per-module (A, scaled B) pairs, weights, config) of a PEFT adapter directory, as TensorRT-LLM packs it."""
    from safetensors.torch import load_file

    cfg = json.loads((adapter_dir / "adapter_config.json").read_text())
    scale = cfg["lora_alpha"] / (cfg["r"] ** 0.5 if cfg.get("use_rslora") else cfg["r"])
    tensors = load_file(str(adapter_dir / "adapter_model.safetensors"))
    modules = {}
    for key, a in tensors.items():
        if ".lora_A." not in key:
            continue
        layer = int(key.split(".layers.")[1].split(".")[0])
        name = key.split(".lora_A.")[0].rsplit(".", 1)[1]
        modules[(layer, name)] = (a.float(), tensors[key.replace("lora_A", "lora_B")].float() * scale)
    rows, config = [], []
    for (layer, name), (a, b) in sorted(modules.items()):
        rows.append(torch.cat([a.flatten(), b.flatten()]))
        config.append([MODULE_IDS[name], layer, a.shape[0]])
    width = max(len(r) for r in rows)
    weights = torch.stack([torch.nn.functional.pad(r, (0, width - len(r))) for r in rows])
    return modules, weights, torch.tensor(config, dtype=torch.int32)


@pytest.fixture(scope="module")
def setup(tiny, tokenizer_dir, tmp_path_factory):
    from test_lora import hf_greedy, make_adapter

    t = tiny(2, False)
    root = tmp_path_factory.mktemp("packed")
    merged = make_adapter(t.hf, root / "a1", seed=1)
    want = hf_greedy(merged, PROMPT, 8)
    assert want != hf_greedy(t.hf, PROMPT, 8)  # the adapter changes these tokens
    config = EngineConfig.from_kwargs(
        model=t.path, tokenizer=tokenizer_dir, kv_cache_memory=1 << 20, enable_lora=True, max_lora_rank=16
    )
    with Executor(config) as ex:
        yield ex, root / "a1", want


def run(ex: Executor, lora: LoraConfig | None):
    oc = OutputConfig(exclude_input_from_output=True)
    rid = ex.enqueue_request(Request(list(PROMPT), 8, end_id=255, output_config=oc, lora_config=lora))
    return ex.await_responses(rid, timeout=60)[-1]


def tokens(ex: Executor, lora: LoraConfig | None) -> list[int]:
    r = run(ex, lora)
    assert not r.has_error(), r.error_msg
    return r.result.output_token_ids[0]


def test_packed_adapter_gives_the_peft_adapters_tokens_and_is_cached_by_task_id(setup):
    ex, adapter_dir, want = setup
    _, weights, config = pack(adapter_dir)
    assert tokens(ex, LoraConfig(11, weights=weights, config=config)) == want
    assert tokens(ex, LoraConfig(11)) == want  # cached by task_id
    assert tokens(ex, LoraConfig(11, weights=weights, config=config)) == want  # the same packing again
    assert tokens(ex, LoraConfig(12, weights=weights.unsqueeze(0).half(), config=config.unsqueeze(0))) != []
    assert tokens(ex, LoraConfig(13, path=str(adapter_dir))) == want  # the PEFT directory, same store
    assert ex.engine.call(lambda core: sorted(core.lora_manager._cpu)) == [11, 12, 13]


def test_fused_module_ids_equal_their_split_forms(setup):
    """attn_qkv (0) with one A and B over q, k, v equals attn_q / attn_k / attn_v rows sharing that A; mlp_gate_up
    (18) likewise gate (5) and up (7)."""
    ex, adapter_dir, _ = setup
    modules, _, _ = pack(adapter_dir)
    fused_rows, split_rows, fused_cfg, split_cfg = [], [], [], []
    for layer in range(2):
        for fused_id, parts in ((0, ("q_proj", "k_proj", "v_proj")), (18, ("gate_proj", "up_proj"))):
            a = modules[(layer, parts[0])][0]  # one A for the fused module
            bs = [modules[(layer, p)][1] for p in parts]
            fused_rows.append(torch.cat([a.flatten(), torch.cat(bs).flatten()]))
            fused_cfg.append([fused_id, layer, a.shape[0]])
            for p, b in zip(parts, bs):
                split_rows.append(torch.cat([a.flatten(), b.flatten()]))
                split_cfg.append([MODULE_IDS[p], layer, a.shape[0]])

    def packed(rows):
        width = max(len(r) for r in rows)
        return torch.stack([torch.nn.functional.pad(r, (0, width - len(r))) for r in rows])

    fused = tokens(ex, LoraConfig(21, weights=packed(fused_rows), config=torch.tensor(fused_cfg)))
    split = tokens(ex, LoraConfig(22, weights=packed(split_rows), config=torch.tensor(split_cfg)))
    assert fused == split and fused != tokens(ex, None)


@pytest.mark.parametrize(
    "change, words",
    [
        (lambda w, c: (w, c[:, :2]), "config"),
        (lambda w, c: (w[:, :10], c), "weights[0]"),
        (lambda w, c: (w[:-1], c), "rows"),
        (lambda w, c: (w, torch.cat([c[:, :1] * 0 + 9, c[:, 1:]], 1)), "decoder-only"),
        (lambda w, c: (w, torch.cat([c[:, :1] * 0 + 14, c[:, 1:]], 1)), "mixture-of-experts"),
        (lambda w, c: (w, torch.cat([c[:, :1], c[:, 1:2] + 5, c[:, 2:]], 1)), "layer"),
        (lambda w, c: (w, torch.cat([c[:, :2], c[:, 2:] * 0 + 32], 1)), "max_lora_rank"),
        (lambda w, c: (w, torch.cat([c, torch.ones(len(c), 1, dtype=c.dtype)], 1)), "DoRA"),
        (lambda w, c: (w, None), "config"),
    ],
)
def test_bad_packings_are_refused_naming_the_field(setup, change, words):
    ex, adapter_dir, _ = setup
    _, weights, config = pack(adapter_dir)
    w, c = change(weights, config)
    r = run(ex, LoraConfig(31, weights=w, config=c))
    assert r.has_error() and "lora_config" in r.error_msg and words in r.error_msg, r.error_msg


def test_a_cached_task_id_keeps_its_adapter(setup):
    ex, adapter_dir, _ = setup
    _, weights, config = pack(adapter_dir)
    assert tokens(ex, LoraConfig(41, weights=weights, config=config))
    r = run(ex, LoraConfig(41, weights=weights * 2, config=config))
    assert r.has_error() and "cached with another adapter" in r.error_msg
    r = run(ex, LoraConfig(41, path=str(adapter_dir)))
    assert r.has_error() and "cached with another adapter" in r.error_msg
