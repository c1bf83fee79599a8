"""Attention windows and sinks on any model (KvCacheConfig.max_attention_window / sink_token_length through the
Executor; petrel/engine/attention_windows.py), on the tiny random Llama with blocks of 4.

Oracles: transformers' Mistral (its own sliding-window attention) with the tiny Llama's weights for a uniform window;
for per-layer windows with attention sinks, the same transformers model with an attention function that applies
an explicit mask (key j seen from query i iff j <= i and (j < S or j > i - (W - S)) on a windowed layer). Blocks
behind a window are given back (the sink blocks kept), through prefill chunks, decodes and prefix-cache hits."""

from __future__ import annotations

import copy
import itertools

import pytest
import torch

from petrel.config import EngineConfig
from petrel.engine.attention_windows import attention_windows
from petrel.engine.block_manager import FREED, BlockManager, held_blocks
from petrel.engine.sequence import EngineRequest, Sequence
from petrel.executor import Executor, ExecutorConfig, KvCacheConfig, OutputConfig, Request
from petrel.sampling_params import SamplingParams

BS = 4
EOS = 2
FULL = 256  # the tiny model's context: a window this long is no window
_ids = itertools.count()


def prompt(seed: int, n: int = 30) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 256, (n,), generator=g).tolist()


def hf_greedy(model, ids: list[int], n: int) -> list[int]:
    """Greedy continuation by transformers, whole sequence each step, EOS banned (the requests ban it too)."""
    tokens = list(ids)
    with torch.no_grad():
        for _ in range(n):
            logits = model(torch.tensor([tokens])).logits[0, -1]
            logits[EOS] = float("-inf")
            tokens.append(int(logits.argmax()))
    return tokens[len(ids) :]


def masked_oracle(hf, windows: list[int], sinks: int):
    """A copy of the transformers model whose attention applies the windows (cycled over the layers) and sinks as
    an explicit mask (full forward passes only: query i at position i)."""
    from transformers import AttentionInterface

    def attend(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
        n = query.shape[2]
        window = windows[module.layer_idx % len(windows)]
        i, j = torch.arange(n).unsqueeze(1), torch.arange(n).unsqueeze(0)
        visible = j <= i
        if window < FULL:
            visible &= (j < sinks) | (j > i - (window - sinks))
        groups = query.shape[1] // key.shape[1]
        k, v = key.repeat_interleave(groups, 1), value.repeat_interleave(groups, 1)
        weights = ((query @ k.transpose(2, 3)) * scaling).masked_fill(~visible, float("-inf")).softmax(-1)
        return (weights @ v).transpose(1, 2).contiguous(), weights

    name = f"petrel_test_window_{'_'.join(map(str, windows))}_sinks_{sinks}"
    AttentionInterface.register(name, attend)
    model = copy.deepcopy(hf)
    model.config._attn_implementation = name
    return model


def mistral_oracle(hf, window: int):
    """transformers' Mistral (every layer sliding, its own mask) holding the tiny Llama's weights."""
    from transformers import MistralConfig, MistralForCausalLM

    c = hf.config
    config = MistralConfig(
        vocab_size=c.vocab_size,
        hidden_size=c.hidden_size,
        intermediate_size=c.intermediate_size,
        num_hidden_layers=c.num_hidden_layers,
        num_attention_heads=c.num_attention_heads,
        num_key_value_heads=c.num_key_value_heads,
        max_position_embeddings=c.max_position_embeddings,
        rms_norm_eps=c.rms_norm_eps,
        sliding_window=window,
        tie_word_embeddings=False,
        head_dim=c.hidden_size // c.num_attention_heads,
    )
    config._attn_implementation = "eager"
    model = MistralForCausalLM(config).float().eval()
    model.load_state_dict(hf.state_dict())
    return model


def executor(tiny, tokenizer_dir, **kv) -> Executor:
    config = EngineConfig.from_kwargs(
        model=tiny(2, False).path,
        tokenizer=tokenizer_dir,
        kv_cache_memory=1 << 20,
        block_size=BS,
        max_num_batched_tokens=16,  # a 30-token prompt runs in chunks
    )
    return Executor(config, ExecutorConfig(kv_cache_config=KvCacheConfig(**kv), request_stats_max_iterations=10_000))


def generate(ex: Executor, ids: list[int], n: int):
    rid = ex.enqueue_request(
        Request(list(ids), n, bad_words=[[EOS]], output_config=OutputConfig(exclude_input_from_output=True))
    )
    responses = ex.await_responses(rid, timeout=60)
    assert responses and not responses[-1].has_error(), responses
    return responses[-1].result.output_token_ids[0], rid


def most_blocks_held(ex: Executor, rid: int) -> int:
    return max(s.allocated_blocks for it in ex.get_latest_request_stats() for s in it.request_stats if s.id == rid)


def test_uniform_window_equals_transformers_mistral(tiny, tokenizer_dir):
    window = 12
    t = tiny(2, False)
    want = hf_greedy(mistral_oracle(t.hf, window), prompt(1), 24)
    assert want != hf_greedy(t.hf, prompt(1), 24)  # the window matters for these tokens
    with executor(tiny, tokenizer_dir, max_attention_window=[window]) as ex:
        for _ in range(2):  # cold, then through the prefix cache
            got, rid = generate(ex, prompt(1), 24)
            assert got == want
            assert most_blocks_held(ex, rid) <= window // BS + 2  # the blocks behind the window went back
        assert ex.engine.call(lambda core: core.block_manager.windows) == [window]


def test_per_layer_windows_with_sinks_equal_an_explicit_mask(tiny, tokenizer_dir):
    windows, sinks = [12, FULL], 4  # layer 0: its first 4 positions and last 8; layer 1: every position
    t = tiny(2, False)
    want = hf_greedy(masked_oracle(t.hf, windows, sinks), prompt(2), 24)
    assert want != hf_greedy(masked_oracle(t.hf, windows, 0), prompt(2), 24)  # the sinks matter
    with executor(tiny, tokenizer_dir, max_attention_window=windows, sink_token_length=sinks) as ex:
        bm_windows = ex.engine.call(lambda core: core.block_manager.windows)
        assert sorted(bm_windows, key=str) == [8, None]  # a global group and a sliding one of window 12 - 4
        for _ in range(2):  # cold, then through the prefix cache (the sink blocks part of the hit)
            got, rid = generate(ex, prompt(2), 24)
            assert got == want
            # the global group holds the whole sequence (54 tokens: 14 blocks), the sliding one its sink block and
            # about its window
            assert most_blocks_held(ex, rid) <= 14 + 1 + 8 // BS + 2


def test_sinks_on_every_layer_and_a_mistral_style_window(tiny, tokenizer_dir):
    """One window on every layer with sinks: one KV group whose table keeps its sink block and frees after it."""
    window, sinks = 10, 3
    t = tiny(2, False)
    want = hf_greedy(masked_oracle(t.hf, [window], sinks), prompt(3), 20)
    with executor(tiny, tokenizer_dir, max_attention_window=[window], sink_token_length=sinks) as ex:
        got, rid = generate(ex, prompt(3), 20)
        assert got == want
        assert most_blocks_held(ex, rid) <= 1 + (window - sinks) // BS + 2


def make_seq(tokens) -> Sequence:
    req = EngineRequest(f"s-{next(_ids)}", list(tokens), SamplingParams(max_tokens=64))
    seq = Sequence(req, 0, req.prompt_token_ids, len(req.prompt_token_ids))
    req.seqs.append(seq)
    return seq


def test_block_manager_keeps_sink_blocks_and_frees_after_them():
    bm = BlockManager(64, BS, sliding_window=8, sink_tokens=5)  # sinks take blocks 0 and 1
    seq = make_seq(range(40))
    for n in (10, 17, 13):
        assert bm.allocate_slots(seq, n)
        seq.num_computed_tokens += n
        bm.cache_computed_blocks(seq)
        bm.free_behind_window(seq)
    table = seq.block_table
    assert table[:2] != [FREED, FREED] and FREED not in table[:2]
    assert table[2:8] == [FREED] * 6 and FREED not in table[8:]  # blocks ending by 40 - 8 went back
    assert held_blocks(table) == table[:2] + table[8:]
    other = make_seq(range(40))
    bm.match_prefix(other)  # the hit needs the sink blocks and the window's, not those between
    assert other.num_computed_tokens == 36
    assert other.block_table[:2] == table[:2] and other.block_table[2:7] == [FREED] * 5
    bm.free(seq)
    bm.free(other)
    bm.check_integrity()
    assert not any(bm.ref_counts)


def test_windows_cycle_over_the_layers_and_bad_values_are_refused(tiny, tokenizer_dir):
    cfg = copy.copy(tiny(2, False).cfg)
    cfg.num_hidden_layers = 5
    assert attention_windows(cfg, [64, 8], None, None).windows == [64, 8, 64, 8, 64]
    assert attention_windows(cfg, [300], None, None).windows == [None] * 5  # at least the context: no limit
    assert attention_windows(cfg, [16, 300], 4, None).windows == [12, None, 12, None, 12]
    for kv, name in (
        ({"max_attention_window": [0]}, "max_attention_window"),
        ({"max_attention_window": []}, "max_attention_window"),
        ({"max_attention_window": [8], "sink_token_length": -1}, "sink_token_length"),
        ({"max_attention_window": [8], "sink_token_length": 8}, "sink_token_length"),
        ({"sink_token_length": 4}, "sink_token_length"),  # no window: every key is seen anyway
    ):
        with pytest.raises(ValueError, match=name):
            executor(tiny, tokenizer_dir, **kv).shutdown()
