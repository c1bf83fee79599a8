"""Multi-LoRA: PEFT adapters on the tiny random Llama, checked against peft's merged model in transformers.

Adapters target q/k/v/o/gate/up/down (mapped onto petrel's fused qkv_proj and gate_up_proj slices) with random
non-zero lora_B, so each adapter changes the outputs."""

from __future__ import annotations

import copy
import json

import pytest
import torch

from petrel import LLM, LoRARequest, SamplingParams

peft = pytest.importorskip("peft")

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
ATOL = 1e-4


def make_adapter(hf, path, seed: int, rank: int = 8, alpha: int = 16, **config):
    """Save a PEFT LoRA adapter of `hf` (random A and B) to path; return the merged transformers model."""
    model = peft.get_peft_model(
        copy.deepcopy(hf), peft.LoraConfig(r=rank, lora_alpha=alpha, target_modules=TARGETS, lora_dropout=0.0, **config)
    )
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_A" in name or "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.5 / p.shape[-1] ** 0.5)
    model.save_pretrained(path)
    return model.merge_and_unload().eval()


@pytest.fixture(scope="module")
def setup(tiny, tokenizer_dir, tmp_path_factory):
    t = tiny(2, False)
    root = tmp_path_factory.mktemp("loras")
    merged1 = make_adapter(t.hf, root / "a1", seed=1)
    merged2 = make_adapter(t.hf, root / "a2", seed=2, rank=4, alpha=8, use_rslora=True)
    lora1 = LoRARequest("a1", 1, str(root / "a1"))
    lora2 = LoRARequest("a2", 2, str(root / "a2"))
    return t, tokenizer_dir, {None: t.hf, 1: merged1, 2: merged2}, lora1, lora2, root


def _llm(setup, **options):
    t, tok = setup[0], setup[1]
    return LLM(t.path, tokenizer=tok, kv_cache_memory=1 << 20, enable_lora=True, **options)


def prompt(seed: int, n: int = 21) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 256, (n,), generator=g).tolist()


def hf_greedy(model, ids: list[int], n: int = 8) -> list[int]:
    """Greedy continuation by transformers (argmax each step; eos is an ordinary token, as with ignore_eos)."""
    tokens = list(ids)
    with torch.no_grad():
        for _ in range(n):
            tokens.append(int(model(torch.tensor([tokens])).logits[0, -1].argmax()))
    return tokens[len(ids) :]


def test_logits_match_merged_peft_model(setup):
    """Prefill (context logits) and paged decode (generation logits) equal peft's merged model within 1e-4."""
    _, _, refs, lora1, lora2, _ = setup
    with _llm(setup) as llm:
        params = SamplingParams(
            temperature=0, max_tokens=6, ignore_eos=True, return_context_logits=True, return_generation_logits=True
        )
        ids = prompt(0)
        for lora, key in ((lora1, 1), (lora2, 2), (None, None)):
            out = llm.generate(ids, params, use_tqdm=False, lora_request=lora)
            tokens = out.outputs[0].token_ids
            with torch.no_grad():
                ref = refs[key](torch.tensor([ids + tokens])).logits[0].float()
            torch.testing.assert_close(out.context_logits, ref[: len(ids)], atol=ATOL, rtol=ATOL)
            torch.testing.assert_close(
                out.outputs[0].generation_logits, ref[len(ids) - 1 : len(ids) + len(tokens) - 1], atol=ATOL, rtol=ATOL
            )
        base = refs[None](torch.tensor([ids])).logits[0]
        assert (refs[1](torch.tensor([ids])).logits[0] - base).abs().max() > 1e-2  # the adapters do change outputs


def test_mixed_batch_matches_solo_and_hf(setup):
    """Adapter 1, adapter 2 and the base model in the same steps: each request's greedy tokens equal running it alone
    and transformers' generate on the merged model."""
    _, _, refs, lora1, lora2, _ = setup
    prompts = [prompt(10 + i, 9 + 5 * i) for i in range(6)]
    loras = [lora1, lora2, None, lora2, None, lora1]
    keys = [None if lr is None else lr.lora_int_id for lr in loras]
    with _llm(setup) as llm:
        manager = llm.engine.core.lora_manager
        seen: list[set] = []
        set_mapping = manager.mapping.set
        manager.mapping.set = lambda slots, device: seen.append(set(slots)) or set_mapping(slots, device)
        together = llm.generate(prompts, GREEDY, use_tqdm=False, lora_request=loras)
        assert {-1, 0, 1} in seen  # one forward held adapter 1, adapter 2 and base-model tokens
        mixed = llm.engine.call(lambda core: core.lora_manager.num_loads)
        solo = [llm.generate(p, GREEDY, use_tqdm=False, lora_request=lr) for p, lr in zip(prompts, loras)]
        # decode steps while another prompt prefills, in one forward: staggered async requests
        futures = [llm.generate_async(p, GREEDY, lora_request=lr) for p, lr in zip(prompts, loras)]
        staggered = [f.result(timeout=60) for f in futures]
    assert mixed == 2
    for i, (p, key) in enumerate(zip(prompts, keys)):
        expected = hf_greedy(refs[key], p)
        assert together[i].outputs[0].token_ids == expected, i
        assert solo[i].outputs[0].token_ids == expected, i
        assert staggered[i].outputs[0].token_ids == expected, i
    assert len({tuple(together[i].outputs[0].token_ids) for i in (0, 1)}) == 2


def test_one_slot_two_adapters_alternating(setup):
    """max_loras=1: adapters alternate in the one slot (evicted and reloaded), outputs stay right; a batch of both
    runs them one adapter at a time."""
    _, _, refs, lora1, lora2, _ = setup
    with _llm(setup, max_loras=1) as llm:
        p = prompt(30)
        expected = {1: hf_greedy(refs[1], p), 2: hf_greedy(refs[2], p), None: hf_greedy(refs[None], p)}
        for lora in (lora1, lora2, lora1, None, lora2):
            out = llm.generate(p, GREEDY, use_tqdm=False, lora_request=lora)
            assert out.outputs[0].token_ids == expected[lora.lora_int_id if lora else None]
        loras = [lora1, lora2, None, lora1, lora2]
        outs = llm.generate([p] * 5, GREEDY, use_tqdm=False, lora_request=loras)
        for out, lora in zip(outs, loras):
            assert out.outputs[0].token_ids == expected[lora.lora_int_id if lora else None]
        loads = llm.engine.call(lambda core: core.lora_manager.num_loads)
        assert loads >= 5


def test_prefix_cache_never_shared_across_adapters(setup):
    _, _, _, lora1, lora2, _ = setup
    with _llm(setup) as llm:
        p = prompt(40, 50)
        first = llm.generate(p, GREEDY, use_tqdm=False, lora_request=lora1)
        assert first.num_cached_tokens == 0
        assert llm.generate(p, GREEDY, use_tqdm=False, lora_request=lora2).num_cached_tokens == 0
        assert llm.generate(p, GREEDY, use_tqdm=False).num_cached_tokens == 0
        again = llm.generate(p, GREEDY, use_tqdm=False, lora_request=lora1)
        assert again.num_cached_tokens > 0
        assert again.outputs[0].token_ids == first.outputs[0].token_ids
        assert llm.generate(p, GREEDY, use_tqdm=False, lora_request=lora2).num_cached_tokens > 0


def test_bad_adapters_are_clear_value_errors(setup, tmp_path):
    t, tok, _, lora1, _, root = setup
    with _llm(setup, max_lora_rank=8) as llm:
        p = prompt(50)
        with pytest.raises(ValueError, match="adapter_config.json"):
            llm.generate(p, GREEDY, use_tqdm=False, lora_request=LoRARequest("x", 9, str(tmp_path / "missing")))
        config = json.loads((root / "a1" / "adapter_config.json").read_text())
        cases = {
            "fan_in_fan_out": dict(fan_in_fan_out=True),
            "use_dora": dict(use_dora=True),
            "lm_head": dict(target_modules=TARGETS + ["lm_head"]),
            "max_lora_rank": dict(r=32),
            "bias": dict(bias="all"),
        }
        for i, (match, change) in enumerate(cases.items()):
            bad = tmp_path / f"bad{i}"
            bad.mkdir()
            (bad / "adapter_config.json").write_text(json.dumps({**config, **change}))
            (bad / "adapter_model.safetensors").write_bytes((root / "a1" / "adapter_model.safetensors").read_bytes())
            with pytest.raises(ValueError, match=match):
                llm.generate(p, GREEDY, use_tqdm=False, lora_request=LoRARequest("bad", 10 + i, str(bad)))
        with pytest.raises(ValueError, match="already used"):
            llm.generate(p, GREEDY, use_tqdm=False, lora_request=lora1)  # loads it
            llm.generate(p, GREEDY, use_tqdm=False, lora_request=LoRARequest("other", 1, str(tmp_path / "bad0")))
        with pytest.raises(ValueError, match="lora_int_id"):
            LoRARequest("x", 0, str(root / "a1"))
        # the engine still serves after the refusals
        assert len(llm.generate(p, GREEDY, use_tqdm=False, lora_request=lora1).outputs[0].token_ids) == 8


def test_lora_request_without_enable_lora(setup):
    t, tok, _, lora1, _, _ = setup
    with LLM(t.path, tokenizer=tok, kv_cache_memory=1 << 20) as llm:
        with pytest.raises(ValueError, match="lora_request"):
            llm.generate(prompt(60), GREEDY, use_tqdm=False, lora_request=lora1)
        with pytest.raises(ValueError, match="lora_request"):
            llm.generate_async(prompt(60), GREEDY, lora_request=lora1)


def test_engine_options_validated():
    from petrel import EngineConfig

    for name in ("max_loras", "max_lora_rank"):
        with pytest.raises(ValueError, match=name):
            EngineConfig(**{name: 0})
    assert EngineConfig().enable_lora is False


def test_serve_lora_modules(setup):
    """The OpenAI `model` field picks an adapter; /v1/models lists the base model and the adapters."""
    from fastapi.testclient import TestClient

    from petrel.serve.app import build_app

    t, _, _, lora1, lora2, _ = setup
    with _llm(setup) as llm:
        with pytest.raises(ValueError, match="adapter_config.json"):
            build_app(llm, "base", lora_modules={"nope": "/nonexistent/adapter"})
        app = build_app(llm, "base", lora_modules={"a1": lora1.lora_path, "a2": lora2.lora_path})
        p = prompt(70)
        expected = {
            name: llm.generate(p, GREEDY, use_tqdm=False, lora_request=lr).outputs[0].text
            for name, lr in (("base", None), ("a1", lora1), ("a2", lora2))
        }
        assert len(set(expected.values())) == 3
        with TestClient(app) as client:
            models = client.get("/v1/models").json()["data"]
            assert [m["id"] for m in models] == ["base", "a1", "a2"]
            assert models[1]["parent"] == "base" and models[1]["root"] == lora1.lora_path
            assert client.get("/v1/models/a1").json() == models[1]  # retrieve: an adapter by its name
            assert client.get("/v1/models/a9").status_code == 404
            for name in ("base", "a1", "a2"):
                body = {"model": name, "prompt": p, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
                r = client.post("/v1/completions", json=body)
                assert r.status_code == 200, r.text
                assert r.json()["model"] == name
                assert r.json()["choices"][0]["text"] == expected[name]
            chat = client.post(
                "/v1/chat/completions",
                json={"model": "a3", "max_tokens": 4, "messages": [{"role": "user", "content": "x"}]},
            )
            assert chat.status_code == 404, chat.text
        # a chat template whose ids fit the tiny model's 256-token vocabulary: chat picks the adapter too
        chat_app = build_app(
            llm,
            "base",
            chat_template="{% for m in messages %}{{ m['content'] }}{% endfor %}",
            lora_modules={"a1": lora1.lora_path},
        )
        ids = llm.tokenizer("a,b,x", add_special_tokens=False)["input_ids"]
        assert max(ids) < 256
        with TestClient(chat_app) as client:
            for name, lr in (("a1", lora1), ("base", None)):
                want = llm.generate(ids, GREEDY, use_tqdm=False, lora_request=lr).outputs[0].text
                chat = client.post(
                    "/v1/chat/completions",
                    json={
                        "model": name,
                        "max_tokens": 8,
                        "temperature": 0,
                        "ignore_eos": True,
                        "messages": [{"role": "user", "content": "a,b,x"}],
                    },
                )
                assert chat.status_code == 200, chat.text
                assert chat.json()["model"] == name
                assert chat.json()["choices"][0]["message"]["content"] == want
            r = client.post("/v1/completions", json={"model": "a3", "prompt": p, "max_tokens": 2})
            assert r.status_code == 404 and "`a1`" in r.json()["error"]["message"]


def test_serve_lora_arguments():
    import argparse

    from petrel.serve.server import add_arguments, engine_options, lora_modules

    parse = add_arguments(argparse.ArgumentParser()).parse_args
    args = parse(["--enable-lora", "--max-loras", "2", "--lora-modules", "a=/x", "b=/y"])
    assert lora_modules(args) == {"a": "/x", "b": "/y"}
    assert engine_options(args)["enable_lora"] is True and engine_options(args)["max_loras"] == 2
    with pytest.raises(ValueError, match="needs --enable-lora"):
        lora_modules(parse(["--lora-modules", "a=/x"]))
    with pytest.raises(ValueError, match="NAME=PATH"):
        lora_modules(parse(["--enable-lora", "--lora-modules", "a"]))


@pytest.mark.parametrize(
    "spec", [{"method": "ngram"}, {"method": "self", "draft_num_layers": 1}], ids=["ngram", "self"]
)
def test_speculative_decoding_with_adapters(setup, spec):
    """Drafts verified in the adapter's forward: greedy tokens unchanged (the 'self' draft runs the base model's
    first layers, which only lowers acceptance)."""
    _, _, refs, lora1, lora2, _ = setup
    with _llm(setup, speculative_config=spec) as llm:
        prompts = [prompt(80 + i, 12) * 2 for i in range(3)]  # repeats: the n-gram proposer finds drafts
        loras = [lora1, None, lora2]
        outs = llm.generate(prompts, GREEDY, use_tqdm=False, lora_request=loras)
        for p, lr, out in zip(prompts, loras, outs):
            assert out.outputs[0].token_ids == hf_greedy(refs[lr.lora_int_id if lr else None], p)


def test_parallel_sampling_keeps_the_adapter(setup):
    """n > 1 forks the prompt's sequence: every sample runs with the request's adapter."""
    _, _, refs, lora1, _, _ = setup
    with _llm(setup) as llm:
        p = prompt(90)
        out = llm.generate(
            p, SamplingParams(n=3, temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False, lora_request=lora1
        )
        expected = hf_greedy(refs[1], p)
        assert [co.token_ids for co in out.outputs] == [expected] * 3
