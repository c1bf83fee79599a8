"""Executor.get_kv_cache_event_manager() (KvCacheConfig.event_buffer_max_size; petrel/executor/kv_events.py) on the
tiny random Llama: the created event, a prompt's blocks stored as one chained event with their tokens and retention
priorities and the gRPC worker's int64 hashes, evictions as removed events, and the bounded queue."""

from __future__ import annotations

import pytest
import torch

from petrel.config import EngineConfig
from petrel.engine.sequence import EngineRequest, Sequence
from petrel.executor import (
    Executor,
    ExecutorConfig,
    KvCacheConfig,
    KVCacheCreatedData,
    KVCacheRemovedData,
    KvCacheRetentionConfig,
    KVCacheStoredData,
    OutputConfig,
    Request,
    TokenRangeRetentionConfig,
    UniqueToken,
)
from petrel.sampling_params import SamplingParams

BS = 4
NUM_BLOCKS = 12


def executor(tiny, tokenizer_dir, **kv) -> Executor:
    config = EngineConfig.from_kwargs(
        model=tiny(2, False).path, tokenizer=tokenizer_dir, kv_cache_memory=1 << 20, block_size=BS
    )
    return Executor(config, ExecutorConfig(kv_cache_config=KvCacheConfig(max_tokens=NUM_BLOCKS * BS, **kv)))


def run(ex: Executor, ids, retention=None) -> None:
    oc = OutputConfig(exclude_input_from_output=True)
    rid = ex.enqueue_request(
        Request(list(ids), 2, bad_words=[[2]], output_config=oc, kv_cache_retention_config=retention)
    )
    assert not ex.await_responses(rid, timeout=60)[-1].has_error()


def chain(ex: Executor, ids) -> list[bytes]:
    req = EngineRequest("chain", list(ids), SamplingParams())
    return ex.engine.call(lambda core: core.block_manager.prompt_block_hashes(Sequence(req, 0, list(ids), len(ids))))


def test_stored_and_removed_events_carry_the_blocks(tiny, tokenizer_dir):
    with executor(tiny, tokenizer_dir, event_buffer_max_size=1000) as ex:
        manager = ex.get_kv_cache_event_manager()
        [created] = manager.get_latest_events()
        assert created.data == KVCacheCreatedData([NUM_BLOCKS]) and created.window_size == ex.engine.max_model_len
        prompt = [(i * 7 + 3) % 250 + 3 for i in range(3 * BS + 1)]
        keep = KvCacheRetentionConfig([TokenRangeRetentionConfig(0, BS, 80)])
        run(ex, prompt, keep)
        [stored] = manager.get_latest_events(timeout_ms=1000)
        hashes = chain(ex, prompt)
        from petrel.executor.kv_events import block_hash_int64

        assert isinstance(stored.data, KVCacheStoredData) and stored.data.parent_hash is None
        blocks = stored.data.blocks
        assert [b.block_hash for b in blocks] == [block_hash_int64(h) for h in hashes]  # 3 prompt blocks: 12 tokens
        assert [b.tokens for b in blocks] == [[UniqueToken(t) for t in prompt[i * BS : (i + 1) * BS]] for i in range(3)]
        assert [b.priority for b in blocks] == [80, 35, 35]
        try:
            from petrel.grpc.kv_events import int64_hash
        except ImportError:  # the grpc extra is not installed
            pass
        else:
            assert [b.block_hash for b in blocks] == [int64_hash(h) for h in hashes]  # what the gRPC worker sends
        g = torch.Generator().manual_seed(0)
        for _ in range(3):  # fill the cache: the prompt's default-priority blocks are evicted
            run(ex, torch.randint(3, 250, (4 * BS + 1,), generator=g).tolist())
        removed = {
            h
            for e in manager.get_latest_events()
            if isinstance(e.data, KVCacheRemovedData)
            for h in e.data.block_hashes
        }
        assert {block_hash_int64(h) for h in hashes[1:]} <= removed and block_hash_int64(hashes[0]) not in removed
        assert manager.get_latest_events(timeout_ms=50) == []


def test_the_queue_keeps_the_newest_and_is_off_by_default(tiny, tokenizer_dir):
    with executor(tiny, tokenizer_dir, event_buffer_max_size=2) as ex:
        manager = ex.get_kv_cache_event_manager()
        prompt = [(i * 5 + 1) % 250 + 3 for i in range(3 * BS + 1)]
        run(ex, prompt)  # created + 3 stored blocks: 4 events, of which the 2 newest are kept
        from petrel.executor.kv_events import block_hash_int64

        hashes = [block_hash_int64(h) for h in chain(ex, prompt)]
        [event] = manager.get_latest_events()
        assert event.event_id == 2 and event.data.parent_hash == hashes[0]
        assert [b.block_hash for b in event.data.blocks] == hashes[1:]
    with executor(tiny, tokenizer_dir) as ex:
        assert ex.get_kv_cache_event_manager() is None
    with pytest.raises(ValueError, match="event_buffer_max_size"):
        executor(tiny, tokenizer_dir, event_buffer_max_size=-1).shutdown()
