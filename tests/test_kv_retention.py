"""KV cache retention (petrel/engine/kv_retention.py): a request's KvCacheRetentionConfig decides which of its
cached blocks are evicted last, for how long, and which ones a lower KV tier takes.

First the block manager alone (priorities, LRU among equals, durations with a fake clock, decode blocks, what goes
down a tier) and the host tier; then through the Executor on the tiny random Llama: a high-priority system prompt
stays cached through a flood of other prompts that evicts it without a policy; secondary_offload_min_priority keeps
low-priority blocks out of the host tier (host_cache_size) while the others come back from it."""

from __future__ import annotations

import datetime
import itertools

import pytest
import torch

from petrel.config import EngineConfig
from petrel.engine.block_manager import BlockManager
from petrel.engine.kv_retention import DEFAULT_PRIORITY, KvRetention, make_retention
from petrel.engine.sequence import EngineRequest, Sequence
from petrel.executor import (
    Executor,
    ExecutorConfig,
    KvCacheConfig,
    KvCacheRetentionConfig,
    OutputConfig,
    Request,
    TokenRangeRetentionConfig,
)
from petrel.kv_tiers.host import HostTier
from petrel.sampling_params import SamplingParams

BS = 4
_ids = itertools.count()


def make_seq(tokens, retention=None) -> Sequence:
    req = EngineRequest(f"r-{next(_ids)}", list(tokens), SamplingParams(max_tokens=64), kv_retention=retention)
    seq = Sequence(req, 0, req.prompt_token_ids, len(req.prompt_token_ids))
    req.seqs.append(seq)
    return seq


def run(bm: BlockManager, tokens, retention=None, generated=0) -> Sequence:
    """Admit, compute the prompt (and `generated` more tokens), publish, free: its full blocks stay cached."""
    seq = make_seq(tokens, retention)
    bm.match_prefix(seq)
    assert bm.allocate_slots(seq, seq.num_tokens - seq.num_computed_tokens)
    seq.num_computed_tokens = seq.num_tokens
    for i in range(generated):
        seq.token_ids.append(900 + i)
        assert bm.allocate_slots(seq, 1)
        seq.num_computed_tokens += 1
    bm.cache_computed_blocks(seq)
    hashes = list(seq.block_hashes)
    bm.free(seq)
    return hashes


def cached(bm: BlockManager, hashes) -> list[bool]:
    return [h in bm.hash_to_block for h in hashes]


def keep(start, end, priority, duration_ms=None) -> KvRetention:
    return make_retention(
        {
            "token_range_retention_configs": [
                dict(token_start=start, token_end=end, priority=priority, duration_ms=duration_ms)
            ]
        }
    )


def test_lowest_priority_goes_first_and_lru_among_equals():
    bm = BlockManager(8, BS)
    system = run(bm, range(100, 100 + 2 * BS + 1), keep(0, 2 * BS, 90))  # 2 blocks at 90
    other = run(bm, range(200, 200 + 2 * BS + 1))  # 2 blocks at the default, more recent
    assert [bm.block_priority.get(bm.hash_to_block[h], DEFAULT_PRIORITY) for h in system + other] == [90, 90, 35, 35]
    run(bm, range(300, 300 + 5 * BS + 1))  # needs 6 blocks: 4 free, then the 2 default ones go
    assert cached(bm, system) == [True, True] and cached(bm, other) == [False, False]
    bm.check_integrity()
    plain = BlockManager(8, BS)  # without the policy the older system prompt would have gone first
    system = run(plain, range(100, 100 + 2 * BS + 1))
    other = run(plain, range(200, 200 + 2 * BS + 1))
    run(plain, range(300, 300 + 5 * BS + 1))
    assert cached(plain, system) == [False, False] and cached(plain, other) == [True, True]


@pytest.mark.parametrize("elapsed, kept", [(4.0, "system"), (6.0, "other")])
def test_a_priority_runs_out_after_its_duration(elapsed, kept):
    """The system prompt at 90 for 5 s, another at 50 for good: within the 5 s the other one is evicted first,
    after them the system prompt's blocks are back at the default (35) and go first."""
    bm = BlockManager(8, BS)
    now = [0.0]
    bm.clock = lambda: now[0]
    system = run(bm, range(100, 100 + 2 * BS + 1), keep(0, None, 90, duration_ms=datetime.timedelta(seconds=5)))
    other = run(bm, range(200, 200 + 2 * BS + 1), keep(0, None, 50))
    now[0] = elapsed
    run(bm, range(300, 300 + 5 * BS + 1))  # needs 2 of the 4 cached blocks
    assert cached(bm, system) == [kept == "system"] * 2 and cached(bm, other) == [kept == "other"] * 2
    bm.check_integrity()


def test_ranges_pick_blocks_by_their_first_token_and_decode_blocks_their_own():
    policy = make_retention(
        KvCacheRetentionConfig(
            [TokenRangeRetentionConfig(0, 6, 80), TokenRangeRetentionConfig(8, None, 10)], decode_retention_priority=60
        )
    )
    bm = BlockManager(16, BS)
    hashes = run(bm, range(100, 100 + 4 * BS), policy, generated=2 * BS + 1)  # 4 prompt blocks, 2 generated
    got = [bm.block_priority.get(bm.hash_to_block[h], DEFAULT_PRIORITY) for h in hashes]
    assert got == [80, 80, 10, 10, 60, 60]  # block 1 starts at token 4 < 6: 80; block 2 at 8: 10
    again = make_seq(range(100, 100 + 4 * BS + 1), keep(0, None, 99))  # a hit with a policy re-prioritizes
    bm.match_prefix(again)
    assert [bm.block_priority[bm.hash_to_block[h]] for h in hashes[:4]] == [99] * 4
    bm.free(again)
    bm.check_integrity()


def test_only_blocks_at_the_offload_priority_go_down_a_tier_and_the_host_tier_keeps_the_highest():
    bm = BlockManager(6, BS)
    bm.tier_fetch = lambda group, h, tokens: None
    bm.offload_min_priority = 50
    run(bm, range(100, 100 + 2 * BS + 1), keep(0, None, 20))  # below the offload priority
    high = run(bm, range(200, 200 + 2 * BS + 1), keep(0, None, 70))
    run(bm, range(300, 300 + 5 * BS + 1))  # evicts all four
    assert sorted(h for _, _, h, _ in bm.pending_evictions) == sorted(high)
    assert bm.evicted_priorities == {(0, h): 70 for h in high}
    tier = HostTier(30)
    tier.put(b"a", b"x" * 10, priority=90)
    tier.put(b"b", b"x" * 10, priority=10)
    tier.put(b"c", b"x" * 10)
    tier.put(b"d", b"x" * 10)  # full: the lowest priority goes, though it is not the oldest
    assert [tier.contains(k) for k in (b"a", b"b", b"c", b"d")] == [True, False, True, True]


@pytest.mark.parametrize(
    "config, field",
    [
        (KvCacheRetentionConfig([TokenRangeRetentionConfig(0, 8, 101)]), "priority"),
        (KvCacheRetentionConfig([TokenRangeRetentionConfig(4, 4, 50)]), "token_end"),
        (KvCacheRetentionConfig([TokenRangeRetentionConfig(0, 8), TokenRangeRetentionConfig(4, 12)]), "overlap"),
        (KvCacheRetentionConfig([TokenRangeRetentionConfig(0), TokenRangeRetentionConfig(8, 12)]), "overlap"),
        (KvCacheRetentionConfig([TokenRangeRetentionConfig(-1, 8)]), "token_start"),
        (KvCacheRetentionConfig(decode_retention_priority=-5), "decode_retention_priority"),
        (KvCacheRetentionConfig(decode_duration_ms="soon"), "decode_duration_ms"),
        (KvCacheRetentionConfig(transfer_mode="GDS", directory="/tmp"), "transfer_mode"),
        ("keep it", "kv_cache_retention_config"),
    ],
)
def test_bad_policies_are_refused_naming_the_field(executor, config, field):
    rid = executor.enqueue_request(Request([5, 6, 7], 2, kv_cache_retention_config=config))
    [r] = executor.await_responses(rid, timeout=30)
    assert r.has_error() and "kv_cache_retention_config" in r.error_msg and field in r.error_msg


# ------------------------------------------------------------------------------------------- the Executor
def _executor(tiny, tokenizer_dir, **kv) -> Executor:
    config = EngineConfig.from_kwargs(
        model=tiny(2, False).path, tokenizer=tokenizer_dir, kv_cache_memory=1 << 20, block_size=BS
    )
    return Executor(config, ExecutorConfig(kv_cache_config=KvCacheConfig(**kv)))


@pytest.fixture(scope="module")
def executor(tiny, tokenizer_dir):
    with _executor(tiny, tokenizer_dir, max_tokens=12 * BS) as ex:
        yield ex


SYSTEM = [(i * 37 + 11) % 250 + 3 for i in range(4 * BS)]  # 4 full blocks


def reused_blocks(ex: Executor, ids, retention=None) -> int:
    oc = OutputConfig(exclude_input_from_output=True, return_perf_metrics=True)
    rid = ex.enqueue_request(
        Request(list(ids), 4, bad_words=[[2]], output_config=oc, kv_cache_retention_config=retention)
    )
    r = ex.await_responses(rid, timeout=60)[-1]
    assert not r.has_error(), r.error_msg
    return r.result.request_perf_metrics.kv_cache_metrics.num_reused_blocks


def flood(ex: Executor, seed: int, count: int = 3) -> None:
    g = torch.Generator().manual_seed(seed)
    for _ in range(count):  # 17 + 4 tokens: 6 blocks each, of a 12-block cache
        reused_blocks(ex, torch.randint(3, 250, (4 * BS + 1,), generator=g).tolist())


def test_a_kept_system_prompt_survives_a_flood_that_evicts_it_without_a_policy(executor):
    policy = KvCacheRetentionConfig([TokenRangeRetentionConfig(0, len(SYSTEM), 100)])
    for retention, want in ((None, 0), (policy, 4)):
        prompt = [((i + want) * 41 + 5) % 250 + 3 for i in range(4 * BS)]  # another system prompt each round
        reused_blocks(executor, prompt + [7], retention)
        flood(executor, seed=want)
        assert reused_blocks(executor, prompt + [9]) == want


def test_secondary_offload_min_priority_decides_what_the_host_tier_takes(tiny, tokenizer_dir):
    """Both prompts below the default priority, so the flood (at the default) evicts them first; only the one at
    or above secondary_offload_min_priority goes to the host tier and comes back from it."""
    with _executor(
        tiny, tokenizer_dir, max_tokens=12 * BS, host_cache_size=1 << 20, secondary_offload_min_priority=20
    ) as ex:
        assert ex.engine.config.kv_host_tier_bytes == 1 << 20
        low = [(i * 13 + 1) % 250 + 3 for i in range(4 * BS)]
        high = [(i * 17 + 2) % 250 + 3 for i in range(4 * BS)]
        reused_blocks(ex, low + [7], KvCacheRetentionConfig([TokenRangeRetentionConfig(0, None, 10)]))
        reused_blocks(ex, high + [7], KvCacheRetentionConfig([TokenRangeRetentionConfig(0, None, 30)]))
        flood(ex, seed=5, count=3)
        assert reused_blocks(ex, high + [9]) == 4
        assert ex.engine.call(lambda core: core.tier_io.loaded_blocks) == 4  # all four back from the host tier
        assert reused_blocks(ex, low + [9]) == 0  # never offloaded
    with pytest.raises(ValueError, match="secondary_offload_min_priority"):
        _executor(tiny, tokenizer_dir, secondary_offload_min_priority=101).shutdown()


def test_kv_cache_placement_fields_say_what_petrel_does(tiny, tokenizer_dir):
    _executor(tiny, tokenizer_dir, onboard_blocks=True, use_uvm=True).shutdown()  # petrel's behaviour on the CPU
    for kv, field in (
        ({"onboard_blocks": False}, "onboard_blocks"),
        ({"cross_kv_cache_fraction": 0.5}, "decoder-only"),
    ):
        with pytest.raises(ValueError, match=field):
            _executor(tiny, tokenizer_dir, **kv).shutdown()
