"""Asynchronous KV tier fetches (petrel/kv_tiers/fetch_worker.py): a request whose blocks are on disk or in
the shared store waits for the fetch worker to read them while the batch runs on; its tokens equal recomputation
and its perf metrics carry the wait. A fetch past its deadline admits the request to recompute; an aborted fetch
leaves nothing behind. The store here is a dict whose reads wait on a gate the test opens (a slow network)."""

from __future__ import annotations

import threading
import time

import pytest
import torch
from test_kv_tiers import BS, FILLERS, GREEDY, PROMPT, REUSED, _layout, _llm, model  # noqa: F401 - fixtures
from test_model_tiny import greedy, hf_greedy

from petrel import SamplingParams
from petrel.config import EngineConfig
from petrel.engine.engine_core import EngineCore
from petrel.engine.model_runner import kv_bytes_per_block
from petrel.engine.sequence import EngineRequest, SequenceStatus
from petrel.kv_tiers.base import BlockStore, StoreStats
from petrel.kv_tiers.chain import TierChain
from petrel.kv_tiers.disk import DiskTier
from petrel.kv_tiers.fetch_worker import Fetch
from petrel.kv_tiers.host import HostTier

WORKER = "petrel-kv-fetch"
RUNNER = [(i * 29 + 5) % 250 + 3 for i in range(8)]  # a request that decodes while another one waits


class SlowStore(BlockStore):
    """A shared store in a dict whose reads wait until `gate` is set (10 s at most), noting the reading threads."""

    name = "store"

    def __init__(self):
        self.blobs: dict[bytes, bytes] = {}
        self.gate = threading.Event()
        self.gate.set()
        self.readers: set[str] = set()
        self._stats = StoreStats()

    def get(self, key: bytes) -> bytes | None:
        self.readers.add(threading.current_thread().name)
        self.gate.wait(10)
        blob = self.blobs.get(key)
        if blob is not None:
            self._stats.hits += 1
        return blob

    def put(self, key: bytes, blob: bytes) -> None:
        self.blobs[key] = blob

    def contains(self, key: bytes) -> bool:
        return key in self.blobs

    def stats(self) -> dict[str, int]:
        return self._stats.as_dict()


@pytest.fixture
def store_core(model, monkeypatch):  # noqa: F811
    """core(**options): an EngineCore of the tiny model on a SlowStore (core.store), closed after the test."""
    cores = []

    def make(num_blocks: int = 32, **options) -> EngineCore:
        store = SlowStore()
        monkeypatch.setattr("petrel.engine.kv_tier_io.store_from_config", lambda config, **kw: store)
        per_block = kv_bytes_per_block(model.cfg, BS, torch.float32)
        config = EngineConfig(
            dtype="float32",
            device="cpu",
            block_size=BS,
            kv_cache_memory=num_blocks * per_block,
            kv_store_url="redis://127.0.0.1:1/0",  # never dialed: the store is the SlowStore
            **options,
        )
        core = EngineCore(config, model.model, model.cfg)
        core.store = store
        cores.append(core)
        return core

    yield make
    for core in cores:
        core.store.gate.set()
        core.close()


def _add(core: EngineCore, rid: str, prompt: list[int], params: SamplingParams = GREEDY) -> EngineRequest:
    request = EngineRequest(rid, list(prompt), params)
    core.add_request(request)
    return request


def _finish(core: EngineCore, rid: str, outputs: dict | None = None, timeout: float = 20.0) -> dict:
    """Step until request rid finished; {request id: [its outputs]} of everything that ran meanwhile."""
    outputs = {} if outputs is None else outputs
    deadline = time.monotonic() + timeout
    while rid in core.requests:
        assert time.monotonic() < deadline, f"{rid} did not finish"
        for out in core.step():
            outputs.setdefault(out.request_id, []).append(out)
    return outputs


def _tokens(outs) -> tuple[list[int], list[float]]:
    return [t for o in outs for t in o.new_token_ids], [lp for o in outs for lp in o.sampled_logprobs]


def _assert_clean(core: EngineCore) -> None:
    bm = core.block_manager
    bm.check_integrity()
    assert bm.num_free_blocks == bm.num_blocks and not bm.pending_loads and not bm.pending_evictions
    assert not core.tier_io.held and not core.tier_io.tiers.staged


def _wait_for_worker(core: EngineCore) -> None:
    """Until the fetch worker has worked through every fetch queued so far (it takes them in order)."""
    probe = core.tier_io.worker.submit([])
    assert probe is not None and probe.done.wait(10)


def _published(core: EngineCore, model) -> tuple[list[int], list[float]]:  # noqa: F811
    """PROMPT run cold (its tokens checked against transformers), its blocks in the store, then gone from memory."""
    _add(core, "cold", PROMPT)
    cold = _tokens(_finish(core, "cold")["cold"])
    assert cold[0] == hf_greedy(model, PROMPT, GREEDY.max_tokens)
    assert len(core.store.blobs) >= REUSED
    core.block_manager.reset_prefix_cache()
    return cold


def test_a_request_waiting_for_its_fetch_does_not_stall_the_batch(store_core, model):  # noqa: F811
    core = store_core(kv_tier_fetch_timeout=30.0)
    cold = _published(core, model)
    _add(core, "runner", RUNNER, greedy(30, ignore_eos=True))
    outputs = {}
    while "runner" not in outputs:  # its (empty) fetch, then its prefill
        for out in core.step():
            outputs.setdefault(out.request_id, []).append(out)
    core.store.gate.clear()  # the store's reads now hang until the test opens the gate
    warm = _add(core, "warm", PROMPT)
    for _ in range(6):  # the runner decodes a token a step while "warm" waits for its blocks
        step = core.step()
        assert {out.request_id for out in step} == {"runner"}
        outputs["runner"] += step
        assert warm.seqs[0].status is SequenceStatus.WAITING and warm.seqs[0] in core.tier_io.held
    time.sleep(0.05)
    core.store.gate.set()
    _finish(core, "warm", outputs)
    tokens, logprobs = _tokens(outputs["warm"])
    assert tokens == cold[0]
    assert max(abs(a - b) for a, b in zip(logprobs, cold[1])) <= 1e-5
    last = outputs["warm"][-1]
    assert last.num_cached_tokens == REUSED * BS  # every reusable block came from the store, none recomputed
    assert last.kv_fetch.seconds >= 0.05 and last.kv_fetch.blocks == REUSED and last.kv_fetch.bytes > 0
    assert core.store.readers == {WORKER}  # never read on the engine thread
    _finish(core, "runner", outputs)
    assert len(_tokens(outputs["runner"])[0]) == 30
    _assert_clean(core)


def test_a_fetch_past_its_deadline_admits_the_request_to_recompute(store_core, model):  # noqa: F811
    core = store_core(kv_tier_fetch_timeout=0.2)
    cold = _published(core, model)
    core.store.gate.clear()  # the store answers only after the deadline
    t0 = time.monotonic()
    _add(core, "late", PROMPT)
    outputs = _finish(core, "late")
    core.store.gate.set()
    tokens, logprobs = _tokens(outputs["late"])
    assert tokens == cold[0] and max(abs(a - b) for a, b in zip(logprobs, cold[1])) <= 1e-5
    last = outputs["late"][-1]
    assert last.num_cached_tokens == 0 and 0.19 <= last.kv_fetch.seconds <= time.monotonic() - t0
    assert core.tier_io.stats()["all"]["fetch_timeouts"] == 1
    _wait_for_worker(core)
    _assert_clean(core)  # what the worker read after the deadline was not kept for a request gone


def test_aborting_a_fetching_request_leaks_nothing(store_core, model):  # noqa: F811
    core = store_core(kv_tier_fetch_timeout=30.0)
    _published(core, model)
    core.store.gate.clear()
    request = _add(core, "gone", PROMPT)
    for _ in range(3):
        assert core.step() == []
    fetch = core.tier_io.held[request.seqs[0]].fetch
    assert not fetch.done.is_set()  # still reading
    outputs = core.abort_request("gone")
    assert [o.finish_reason for o in outputs] == ["abort"]
    core.store.gate.set()
    assert fetch.done.wait(10) and fetch.cancelled
    assert not core.has_work
    _assert_clean(core)


def test_disk_tier_reads_go_through_the_worker_and_show_in_perf_metrics(model, tokenizer_dir, tmp_path, monkeypatch):  # noqa: F811
    readers = set()
    disk_get = DiskTier.get

    def noted_get(self, key):
        readers.add(threading.current_thread().name)
        return disk_get(self, key)

    monkeypatch.setattr(DiskTier, "get", noted_get)
    llm = _llm(model, tokenizer_dir, kv_disk_tier_path=str(tmp_path / "kv"), kv_disk_tier_bytes=1 << 20)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, return_perf_metrics=True)
    try:
        cold = llm.generate(PROMPT, params, use_tqdm=False)
        for filler in FILLERS:  # every block of PROMPT evicted to disk
            llm.generate(filler, params, use_tqdm=False)
        warm = llm.generate(PROMPT, params, use_tqdm=False)
    finally:
        llm.shutdown()
    assert warm.outputs[0].token_ids == cold.outputs[0].token_ids == hf_greedy(model, PROMPT, 8)
    assert warm.num_cached_tokens == REUSED * BS
    metrics = warm.outputs[0].request_perf_metrics
    assert metrics.kv_cache_fetched_blocks == REUSED and metrics.kv_cache_fetched_bytes > 0
    assert metrics.kv_cache_fetch_time > 0
    assert cold.outputs[0].request_perf_metrics.kv_cache_fetched_blocks == 0
    assert readers == {WORKER}


def test_read_slow_stages_the_chain_up_to_its_first_miss_and_cancel_drops_it(tmp_path):
    layout = _layout()
    host, disk = HostTier(1 << 20), DiskTier(str(tmp_path / "d"), 1 << 20)
    chain = TierChain([host, disk], layout)
    keys = [bytes([i]) * 32 for i in range(5)]
    host.put(keys[0], b"in host")
    for key in (keys[1], keys[2], keys[4]):  # keys[3] is nowhere: keys[4] cannot be used and is not read
        disk.put(key, b"on disk " + key[:1])
    assert chain.slow_keys(keys) == keys[1:]
    assert chain.slow_keys([keys[0], keys[3], keys[4]]) == []  # the first block past memory is on no tier
    fetch = Fetch(keys, deadline=time.monotonic() + 10)
    chain.read_slow(fetch)
    assert list(chain.staged) == keys[1:3] and fetch.blocks == 2 and fetch.bytes == 2 * 9
    assert chain.slow_keys(keys) == [] and disk.stats()["hits"] == 2  # now past memory: keys[3], on no tier
    chain.cancel(fetch)
    assert not chain.staged and chain.staged_bytes == 0
    chain.read_slow(fetch)  # a cancelled fetch stages nothing more
    assert not chain.staged
    disk.close()


def test_the_scheduler_passes_over_a_held_request_and_admits_it_once_released():
    from test_window_blocks import compute, make_seq

    from petrel.engine.block_manager import BlockManager
    from petrel.engine.scheduler import Scheduler

    bm = BlockManager(32, BS)
    first = make_seq(range(3, 3 + 4 * BS + 1))
    bm.match_prefix(first)
    compute(bm, first, first.num_tokens)
    bm.free(first)
    longer = make_seq(range(3, 3 + 6 * BS + 1))  # its first 4 blocks are in the prefix cache, the next 2 are not
    assert bm.blocks_past_memory(longer) == [(0, h) for h in bm.prompt_block_hashes(longer)[4:]]
    assert bm.blocks_past_memory(make_seq(range(3, 3 + 4 * BS + 1))) == []

    sched = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=256)
    fetching = {longer}
    sched.fetch_pending = lambda seq: seq in fetching
    others = [make_seq(range(100 * k, 100 * k + 9)) for k in (1, 2)]
    for seq in [longer, *others]:
        sched.add(seq)
    assert sched.schedule().seqs == others and list(sched.waiting) == [longer]
    assert sched.schedule().seqs == others  # still held: the running ones go on
    fetching.clear()
    batch = sched.schedule()
    assert longer in batch.seqs and not sched.waiting and longer.num_cached_tokens == 4 * BS
    bm.check_integrity()


def test_the_fetch_timeout_option():
    import argparse

    from petrel.serve.server import add_arguments, engine_options

    args = add_arguments(argparse.ArgumentParser()).parse_args(["--kv-tier-fetch-timeout", "0.5"])
    assert engine_options(args)["kv_tier_fetch_timeout"] == 0.5
    assert EngineConfig().kv_tier_fetch_timeout == 2.0
    with pytest.raises(ValueError, match="kv_tier_fetch_timeout must be a positive"):
        EngineConfig(kv_host_tier_bytes=1 << 20, kv_tier_fetch_timeout=0)
