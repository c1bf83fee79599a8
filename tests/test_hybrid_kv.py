"""Models mixing sliding-window and global layers keep one block table per KV group (petrel/engine/kv_groups.py): the
sliding groups give back the blocks behind their window, the global group keeps them all.

First without a model: how layers are grouped, and the block manager with groups (the sliding tables stay bounded,
copy-on-write in every group, a prefix hit only as far as every group holds what it reads, no leak). Then a tiny
random-weight Gemma 3 of 6 layers (sliding, sliding, global, sliding, sliding, global: one global group and two
sliding groups of 2 layers; window 12, blocks of 4) through the whole engine: chunked prefill, n=2, beam search,
preemption, self-speculation, prefix-cache hits and a disaggregated split (KV exported and imported per group) give
transformers' tokens and the same engine's with freeing off, while each sliding table holds at most
ceil(W / block) + 2 blocks; every block comes back when requests end or are aborted.
"""

from __future__ import annotations

import pytest
import torch
from test_window_blocks import compute, decode, make_seq  # block-manager step helpers, shared

from petrel.engine.block_manager import FREED, BlockManager, held_blocks, num_freed_blocks
from petrel.engine.kv_groups import split_by_window
from petrel.engine.sequence import EngineRequest, Sequence
from petrel.sampling_params import SamplingParams

BS, W = 4, 8
WINDOWS = [None, W, W]  # a global group and two sliding ones
MAX_HELD = -(-W // BS) + 2


def test_layers_are_grouped_by_window():
    g270m = split_by_window(([512] * 5 + [None]) * 3, 18)  # Gemma 3 270M: 3 global, 15 local layers
    assert g270m.windows == (None,) + (512,) * 5 and g270m.layers_per_block == 3
    assert g270m.layers[0] == (5, 11, 17) and g270m.layers[1:3] == ((0, 1, 2), (3, 4, 6))
    assert g270m.group_of(6) == 2 and g270m.slot_of(6) == 2 and g270m.slot_of(11) == 1
    g1b = split_by_window([None if (i + 1) % 6 == 0 else 512 for i in range(26)], 26)  # 4 global, 22 local
    assert g1b.num_groups == 7 and g1b.layers_per_block == 4 and g1b.layers[-1] == (24, 25)  # last one padded
    assert sorted(sum(g1b.layers, ())) == list(range(26))
    for windows, n in (([8, 8], 2), ([], 2), ([None, None], 2)):  # one window everywhere: one group, as before
        one = split_by_window(windows, n)
        assert one.num_groups == 1 and one.layers_per_block == n and one.windows == (windows[0] if windows else None,)
    qwen = split_by_window([None, 6], 2)  # Qwen2 with max_window_layers
    assert qwen.windows == (None, 6) and qwen.layers == ((0,), (1,))


def check(bm: BlockManager, *seqs: Sequence) -> None:
    """Integrity; ref counts = held entries over every table of every sequence; the tables share one layout; a
    global table holds everything, a sliding one at least the next query's window."""
    bm.check_integrity()
    counts = [0] * bm.num_blocks
    for s in seqs:
        assert len(s.block_tables) == bm.num_groups and len({len(t) for t in s.block_tables}) == 1
        for window, table in zip(bm.windows, s.block_tables):
            for b in held_blocks(table):
                counts[b] += 1
            c = s.num_computed_tokens
            first = 0 if window is None else max(0, c - window + 1)
            assert all(table[p // BS] != FREED for p in range(first, c))
    assert counts == bm.ref_counts


def test_sliding_tables_stay_bounded_and_all_blocks_come_back():
    bm = BlockManager(64, BS, group_windows=WINDOWS)
    seq = make_seq(range(20))
    for n in (5, 12, 3):  # chunked prefill
        compute(bm, seq, n)
        check(bm, seq)
    for _ in range(30):
        decode(bm, seq, 1)
        c = seq.num_computed_tokens
        glob, *sliding = seq.block_tables
        assert FREED not in glob and len(glob) == -(-c // BS)
        assert all(num_freed_blocks(t) == (c - W) // BS and len(held_blocks(t)) <= MAX_HELD for t in sliding)
        assert bm.num_free_blocks == bm.num_blocks - sum(len(held_blocks(t)) for t in seq.block_tables)
        check(bm, seq)
    bm.free(seq)
    check(bm)
    assert bm.num_free_blocks == bm.num_blocks and not any(bm.ref_counts)


def test_fork_copies_each_groups_partial_block_on_write():
    bm = BlockManager(64, BS, group_windows=WINDOWS)
    parent = make_seq(range(14))
    compute(bm, parent, 14)
    decode(bm, parent, 7)  # 21 computed: a partial last block in every group
    child = make_seq(range(14))
    child.token_ids = list(parent.token_ids)
    bm.fork(parent, child)
    check(bm, parent, child)
    decode(bm, parent, 1, first_token=2000)
    assert len(bm.take_pending_copies()) == 3  # one copy-on-write per group
    decode(bm, child, 12, first_token=3000)
    decode(bm, parent, 11, first_token=4000)
    check(bm, parent, child)
    bm.free(parent)
    bm.free(child)
    check(bm)
    assert bm.num_free_blocks == bm.num_blocks and not any(bm.ref_counts)


def test_prefix_hit_counts_only_as_far_as_every_group_holds_it():
    bm = BlockManager(64, BS, group_windows=WINDOWS)
    first = make_seq(range(30))
    compute(bm, first, 30)
    bm.free(first)  # everything cached, sliding blocks 0..4 included
    second = make_seq(range(30))
    bm.match_prefix(second)
    assert second.num_computed_tokens == 28  # 7 blocks; the sliding tables take the last 2 only
    assert second.block_tables[0] == [b for b in second.block_tables[0] if b != FREED] and len(second.block_table) == 7
    assert all(t[:5] == [FREED] * 5 and FREED not in t[5:] for t in second.block_tables[1:])
    check(bm, second)
    bm.free(second)
    # group 2 loses its copy of block 6 (as if evicted): the hit stops where both windows are whole again
    hashes = second.block_hashes
    bm.hash_to_block.pop((2, hashes[6]))
    third = make_seq(range(30))
    bm.match_prefix(third)
    assert third.num_computed_tokens == 24 and all(num_freed_blocks(t) == 4 for t in third.block_tables[1:])
    check(bm, third)
    # a context-only prompt is exported whole: its hit holds every block in every group
    ctx = make_seq(range(30), context_only=True)
    bm.match_prefix(ctx)
    assert ctx.num_computed_tokens == 24 and not any(FREED in t for t in ctx.block_tables)
    check(bm, third, ctx)
    bm.free(ctx)
    # the global group lacks block 2: no sliding copy can make up for it
    bm.free(third)
    bm.hash_to_block.pop(hashes[2])
    fourth = make_seq(range(30))
    bm.match_prefix(fourth)
    assert fourth.num_computed_tokens == 8 and not any(FREED in t for t in fourth.block_tables)
    check(bm, fourth)
    bm.free(fourth)
    assert bm.num_free_blocks == bm.num_blocks and not any(bm.ref_counts)


# ---------------------------------------------------------------------------- the whole engine, a tiny Gemma 3

transformers = pytest.importorskip("transformers")

from test_model_families import COMMON, GEMMA3  # noqa: E402
from test_model_tiny import greedy, hf_greedy  # noqa: E402
from tiny_llama import Tiny, _tokens, redraw_weights  # noqa: E402

from petrel.config import EngineConfig  # noqa: E402
from petrel.disagg.kv_transfer import _export  # noqa: E402
from petrel.engine.engine_core import EngineCore  # noqa: E402
from petrel.engine.model_runner import kv_bytes_per_block  # noqa: E402
from petrel.model.loader import load_model, resolve_model  # noqa: E402

GW, GBS = 12, 4  # the model's window, the engine's block size
GEMMA_MAX_HELD = -(-GW // GBS) + 2


@pytest.fixture(scope="module")
def gemma(tmp_path_factory) -> Tiny:
    config = transformers.Gemma3TextConfig(
        **{
            **COMMON,
            **GEMMA3,
            "num_hidden_layers": 6,
            "sliding_window": GW,
            "tie_word_embeddings": False,
            "layer_types": ["sliding_attention", "sliding_attention", "full_attention"] * 2,
        }
    )
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    hf = transformers.Gemma3ForCausalLM(config)
    redraw_weights(hf, 0)
    with torch.no_grad():  # Gemma multiplies embeddings by sqrt(hidden): scaled back, the layers (and so the
        hf.model.embed_tokens.weight.mul_(COMMON["hidden_size"] ** -0.5)  # window) decide the next token
    hf = hf.float().eval()
    path = tmp_path_factory.mktemp("gemma3-w12")
    hf.save_pretrained(path, safe_serialization=True)
    model, cfg = load_model(resolve_model(str(path)), torch.float32, "cpu")
    assert cfg.sliding_windows == [GW, GW, None] * 2
    return Tiny(hf, model, cfg, str(path))


def make_core(t: Tiny, num_blocks: int = 160, **engine_kwargs) -> EngineCore:
    per_block = kv_bytes_per_block(t.cfg, GBS, torch.float32, layers_per_block=2)
    config = EngineConfig(
        dtype="float32", device="cpu", block_size=GBS, kv_cache_memory=num_blocks * per_block, **engine_kwargs
    )
    return EngineCore(config, t.model, t.cfg)


def run_engine(t: Tiny, requests: dict, free: bool = True, num_blocks: int = 160, **engine_kwargs):
    """Run requests {id: (prompt, params)} (a list of such dicts: each one after the previous has finished) to the
    end. Returns ({(id, index): tokens}, core, most blocks one sequence held after a step: [global, sliding]).
    free=False: the same engine, same groups, with nothing given back."""
    core = make_core(t, num_blocks, **engine_kwargs)
    bm = core.block_manager
    assert bm.num_blocks == num_blocks and bm.windows == [None, GW, GW]
    assert core.runner.kv_groups.layers == ((2, 5), (0, 1), (3, 4)) and len(core.runner.cache_tensors) == 2
    if not free:
        bm.windows = [None] * bm.num_groups  # nothing is given back; the tables stay per group
    results, max_held = {}, [0, 0]
    for wave in requests if isinstance(requests, list) else [requests]:
        for rid, (prompt, params) in wave.items():
            core.add_request(EngineRequest(rid, list(prompt), params, eos_token_ids=tuple(t.cfg.eos_token_ids)))
        for _ in range(1000):
            if not core.has_work:
                break
            for out in core.step():
                results.setdefault((out.request_id, out.index), []).extend(out.new_token_ids)
            bm.check_integrity()
            for s in core.scheduler.running:
                held = [len(held_blocks(table)) for table in s.block_tables]
                max_held = [max(max_held[0], held[0]), max(max_held[1], *held[1:])]
        assert not core.has_work
        assert bm.num_free_blocks == bm.num_blocks and not any(bm.ref_counts)  # no leak
    return results, core, max_held


def test_engine_matches_no_freeing_and_transformers(gemma):
    requests = {
        "long": (_tokens(26, 1), greedy(40)),  # 65 computed tokens: 17 blocks, the window 3
        "short": (_tokens(7, 2), greedy(30)),
        "n2": (_tokens(13, 3), greedy(24, n=2)),  # forked after the prompt
        "beam": (_tokens(11, 4), SamplingParams(use_beam_search=True, beam_width=2, n=2, max_tokens=20)),
    }
    # a 16-token budget: the prompts are prefilled in chunks, mixed with decodes
    freed, core, max_held = run_engine(gemma, requests, max_num_batched_tokens=16)
    kept, _, max_held_kept = run_engine(gemma, requests, free=False, max_num_batched_tokens=16)
    assert freed == kept
    assert max_held[1] <= GEMMA_MAX_HELD < max_held_kept[1]  # sliding tables bounded; without freeing not
    assert max_held[0] == max_held_kept[0] == 16  # the global table holds every block (64 tokens after a step)
    assert core.scheduler.num_preemptions == 0
    for rid in ("long", "short", "n2"):
        expected = hf_greedy(gemma, requests[rid][0], requests[rid][1].max_tokens)
        for index in range(requests[rid][1].n):
            assert freed[(rid, index)] == expected, f"{rid}#{index}"


def test_preemption(gemma):
    prompts = [_tokens(18, 6 + i) for i in range(3)]  # none ends early (eos)
    # 3 sequences of 18 + 30 tokens need 12 global + 2 x 5 sliding blocks each at the end: 48 blocks hold two
    requests = {f"p{i}": (p, greedy(30)) for i, p in enumerate(prompts)}
    got, core, max_held = run_engine(gemma, requests, num_blocks=48, max_num_batched_tokens=16)
    assert core.scheduler.num_preemptions > 0 and max_held[1] <= GEMMA_MAX_HELD
    for i, p in enumerate(prompts):
        assert got[(f"p{i}", 0)] == hf_greedy(gemma, p, 30), f"p{i}"


def test_prefix_hits_match_a_cold_run(gemma):
    prompt = _tokens(30, 1)
    shared = prompt[:20] + _tokens(6, 7)
    cold = {"cold": (prompt, greedy(12))}
    warm = {"same": (prompt, greedy(12)), "shared": (shared, greedy(12))}  # once 'cold' has finished
    got, core, max_held = run_engine(gemma, [cold, warm])
    # 7 blocks of 'same' and 5 of 'shared' (the sliding groups kept the blocks their windows see of them)
    assert core.scheduler.prefix_hit_tokens == 28 + 20
    assert got[("same", 0)] == got[("cold", 0)] == hf_greedy(gemma, prompt, 12)
    assert got[("shared", 0)] == hf_greedy(gemma, shared, 12)


def test_speculative_decoding(gemma):
    prompt = _tokens(26, 1)
    spec = {"method": "self", "num_speculative_tokens": 3, "draft_num_layers": 1}  # a sliding layer drafts
    got, core, max_held = run_engine(gemma, {"r": (prompt, greedy(30))}, speculative_config=spec)
    assert core.num_draft_tokens > 0 and core.num_accepted_tokens < core.num_draft_tokens
    assert max_held[1] <= GEMMA_MAX_HELD
    assert got[("r", 0)] == hf_greedy(gemma, prompt, 40)[:30]


def test_lookahead_decoding(gemma):
    """A draft tree sees its ancestors within each layer's window (by the drafts' positions); the accepted nodes'
    K/V move in every group's table."""
    prompt = _tokens(26, 4)  # an output some of whose drafts are right
    spec = {"method": "lookahead", "max_window_size": 4, "max_ngram_size": 3, "max_verification_set_size": 4}
    got, core, max_held = run_engine(gemma, {"r": (prompt, greedy(40))}, speculative_config=spec)
    assert core.num_accepted_tokens > 0
    assert max_held[1] <= GEMMA_MAX_HELD + 4  # the tree's 15 slots run up to 4 blocks ahead of the sequence
    assert got[("r", 0)] == hf_greedy(gemma, prompt, 40)


def test_disaggregated_split_moves_every_groups_kv(gemma):
    prompt = _tokens(26, 1)
    ctx = make_core(gemma)  # the context instance: prefills, samples one token, pins the prompt's KV
    ctx.add_request(EngineRequest("c", list(prompt), greedy(20), context_only=True))
    outs = [out for _ in range(10) if ctx.has_work for out in ctx.step()]
    first, handle = outs[-1].new_token_ids, outs[-1].disaggregated_params.handle  # the engine's PromptHandoff
    assert len(ctx.pinned.pins[handle].blocks) == 3  # every group's blocks of the prompt, none given back
    kv = _export(ctx, handle)
    assert ctx.block_manager.num_free_blocks == ctx.block_manager.num_blocks and kv.shape[:3] == (6, 2, 26)
    gen = make_core(gemma)  # the generation instance: imports the KV, decodes on (giving blocks back)
    gen.add_request(
        EngineRequest(
            "g",
            list(prompt),
            greedy(20),
            eos_token_ids=tuple(gemma.cfg.eos_token_ids),
            imported_kv=kv,
            first_gen_tokens=first,
        )
    )
    tokens = [t for _ in range(40) if gen.has_work for out in gen.step() for t in out.new_token_ids]
    assert tokens == hf_greedy(gemma, prompt, 20)
    bm = gen.block_manager
    assert bm.num_free_blocks == bm.num_blocks and not any(bm.ref_counts)


def test_abort_gives_every_groups_blocks_back(gemma):
    core = make_core(gemma)
    bm = core.block_manager
    for i in range(3):
        core.add_request(EngineRequest(f"a{i}", _tokens(20, 20 + i), greedy(30, n=2 if i == 0 else 1)))
    for _ in range(12):  # 31 tokens each: the sliding tables have given blocks back
        core.step()
    running = core.scheduler.running
    assert len(running) == 4 and all(FREED in t for s in running for t in s.block_tables[1:])
    for i in range(3):
        core.abort_request(f"a{i}")
    assert not core.has_work and bm.num_free_blocks == bm.num_blocks and not any(bm.ref_counts)
