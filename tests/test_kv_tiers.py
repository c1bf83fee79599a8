"""Lower KV tiers (petrel/kv_tiers): blocks evicted from a tiny KV cache go to host memory and disk and come back
by hash. A prompt served from a tier gives the same greedy tokens and logprobs as recomputing it (an engine
without tiers, and transformers); a corrupted or truncated block is refused and recomputed; another cache_salt,
LoRA adapter or model never reuses a block; a full disk tier evicts and never errors; no KV block leaks."""

from __future__ import annotations

import os

import pytest
import torch
from test_hybrid_kv import gemma, run_engine  # noqa: F401 - a fixture
from test_model_tiny import greedy, hf_greedy
from tiny_llama import _tokens

from petrel import LLM, SamplingParams
from petrel.engine.model_runner import kv_bytes_per_block
from petrel.kv_tiers.block_codec import BlockCodecError, BlockLayout, decode_block, encode_block, model_fingerprint
from petrel.kv_tiers.chain import TierChain, build_tiers
from petrel.kv_tiers.disk import DiskTier
from petrel.kv_tiers.host import HostTier

BS = 4
NUM_BLOCKS = 16  # 64 tokens: one 56-token filler prompt (+ 8 generated) takes every block
PROMPT = [(i * 37 + 11) % 250 + 3 for i in range(40)]  # 9 full blocks can be reused (one token is always run)
FILLERS = [[(i * 53 + 7 * k) % 250 + 3 for i in range(56)] for k in (1, 2)]
GREEDY = SamplingParams(temperature=0, max_tokens=8, logprobs=3, ignore_eos=True)
REUSED = (len(PROMPT) - 1) // BS  # blocks of PROMPT a hit can serve


# ------------------------------------------------------------------------------------------- helpers
def _layout(**changes) -> BlockLayout:
    fields = dict(fingerprint="f" * 32, dtype="float32", num_layers=2, block_size=BS, kv_heads=2, head_dim=8)
    return BlockLayout(**{**fields, **changes})


def _kv(layout: BlockLayout, seed: int = 0) -> torch.Tensor:
    return torch.randn(layout.shape, generator=torch.Generator().manual_seed(seed)).to(layout.torch_dtype)


@pytest.fixture(scope="module")
def model(tiny):
    return tiny(2, False)


def _llm(t, tok, num_blocks: int = NUM_BLOCKS, **options) -> LLM:
    per_block = kv_bytes_per_block(t.cfg, BS, torch.float32)
    return LLM(t.path, tokenizer=tok, block_size=BS, kv_cache_memory=num_blocks * per_block, **options)


def _run(llm: LLM, prompt=PROMPT, **kw):
    """(tokens, logprobs of each token and its top alternatives, cached prompt tokens) of a greedy run."""
    return _result(llm.generate(prompt, GREEDY, use_tqdm=False, **kw))


def _result(out):
    c = out.outputs[0]
    lps = [sorted((t, lp.logprob) for t, lp in pos.items()) for pos in c.logprobs]
    return c.token_ids, lps, out.num_cached_tokens


def _evict(llm: LLM) -> None:
    """Run prompts that take every block of the cache: nothing of an earlier prompt stays in memory."""
    for filler in FILLERS:
        _run(llm, filler)


def _tier_stats(llm: LLM) -> dict:
    return llm.engine.call(lambda core: core.tier_io.stats())


def _run_counting(llm: LLM, prompt=PROMPT, **kw):
    """_run, and how many blocks the tiers served it."""
    before = _tier_stats(llm)["all"]["loaded_blocks"]
    result = _run(llm, prompt, **kw)
    return result, _tier_stats(llm)["all"]["loaded_blocks"] - before


def _check_no_leak(llm: LLM) -> None:
    def check(core):
        bm = core.block_manager
        bm.check_integrity()
        return bm.num_free_blocks, bm.num_blocks, bm.pending_loads, bm.pending_evictions

    free, total, loads, evictions = llm.engine.call(check)
    assert free == total and not loads and not evictions


def _assert_same(run, ref) -> None:
    tokens, lps, _ = run
    ref_tokens, ref_lps, _ = ref
    assert tokens == ref_tokens
    for got, want in zip(lps, ref_lps):
        assert [t for t, _ in got] == [t for t, _ in want]
        assert max(abs(a - b) for (_, a), (_, b) in zip(got, want)) <= 1e-5


@pytest.fixture(scope="module")
def recomputed(model, tokenizer_dir):  # noqa: F811
    """PROMPT's run on an engine without tiers (computed from scratch), checked against transformers."""
    llm = _llm(model, tokenizer_dir)
    try:
        ref = _run(llm)
        _evict(llm)
        again = _run(llm)  # evicted and recomputed: the same
    finally:
        llm.shutdown()
    assert ref[2] == 0 and again[2] == 0
    assert ref[0] == hf_greedy(model, PROMPT, GREEDY.max_tokens)
    _assert_same(again, ref)
    return ref


# ------------------------------------------------------------------------------------------- the codec
def test_codec_round_trip_is_exact():
    layout = _layout()
    kv = _kv(layout)
    tokens = [5, 6, 7, 8]
    blob = encode_block(layout, b"k" * 32, 0, tokens, kv)
    assert torch.equal(decode_block(layout, blob, b"k" * 32, 0, tokens), kv)
    bf16 = _layout(dtype="bfloat16")
    kv16 = _kv(bf16, 1)
    assert torch.equal(decode_block(bf16, encode_block(bf16, b"k", 1, tokens, kv16), b"k", 1, tokens), kv16)


@pytest.mark.parametrize(
    "reader,key,group,tokens,what",
    [
        (_layout(fingerprint="e" * 32), b"k" * 32, 0, [5, 6, 7, 8], "fingerprint"),
        (_layout(dtype="bfloat16"), b"k" * 32, 0, [5, 6, 7, 8], "dtype"),
        (_layout(num_layers=3), b"k" * 32, 0, [5, 6, 7, 8], "num_layers"),
        (_layout(kv_heads=1), b"k" * 32, 0, [5, 6, 7, 8], "kv_heads"),
        (_layout(), b"j" * 32, 0, [5, 6, 7, 8], "key"),
        (_layout(), b"k" * 32, 1, [5, 6, 7, 8], "group"),
        (_layout(), b"k" * 32, 0, [5, 6, 7, 9], "tokens"),
    ],
)
def test_codec_refuses_another_identity(reader, key, group, tokens, what):
    blob = encode_block(_layout(), b"k" * 32, 0, [5, 6, 7, 8], _kv(_layout()))
    with pytest.raises(BlockCodecError, match=what):
        decode_block(reader, blob, key, group, tokens)


@pytest.mark.parametrize("damage", ["flip-payload", "truncate", "truncate-header", "magic", "garbage-header"])
def test_codec_detects_damage(damage):
    layout = _layout()
    blob = bytearray(encode_block(layout, b"k", 0, [1, 2, 3, 4], _kv(layout)))
    if damage == "flip-payload":
        blob[-10] ^= 0x40
    elif damage == "truncate":
        del blob[-100:]
    elif damage == "truncate-header":
        del blob[20:]
    elif damage == "magic":
        blob[0:1] = b"X"
    else:
        blob[14:20] = b"\xff\xfe{[}]"
    with pytest.raises(BlockCodecError):
        decode_block(layout, bytes(blob), b"k", 0, [1, 2, 3, 4])


def test_fingerprint_tells_models_apart(tiny):
    a, b = tiny(2, False), tiny(2, False, seed=1)
    assert model_fingerprint(a.model, a.cfg) == model_fingerprint(a.model, a.cfg)
    assert model_fingerprint(a.model, a.cfg) != model_fingerprint(b.model, b.cfg)  # same architecture
    assert model_fingerprint(a.model, a.cfg) != model_fingerprint(a.model, a.cfg, "int8")


# ------------------------------------------------------------------------------------------- the tiers
def test_host_tier_is_a_bounded_lru_that_spills():
    spilled = []
    host = HostTier(30, spill=lambda k, b: spilled.append(k))
    for k in (b"a", b"b", b"c"):
        host.put(k, bytes(10))
    assert host.get(b"a") == bytes(10)  # a is now the most recent
    host.put(b"d", bytes(10))
    assert spilled == [b"b"] and not host.contains(b"b") and host.contains(b"a")
    assert host.used_bytes == 30 and len(host) == 3
    host.put(b"big", bytes(31))  # larger than the tier: dropped, nothing spilled
    assert not host.contains(b"big") and spilled == [b"b"]
    assert host.get(b"zz") is None
    stats = host.stats()
    assert stats["hits"] == 1 and stats["misses"] == 1 and stats["puts"] == 5 and stats["dropped"] == 1
    assert stats["bytes_in"] == 40 and stats["bytes_out"] == 10


def test_disk_tier_evicts_when_full_and_never_errors(tmp_path, monkeypatch):
    disk = DiskTier(str(tmp_path / "d"), 25)
    for i in range(10):
        disk.put(bytes([i]), bytes([i]) * 10)
    assert len(disk) == 2 and disk.used_bytes == 20  # the oldest removed to make room
    files = sorted(os.listdir(tmp_path / "d"))
    assert files == sorted([b"\x08".hex() + ".kvblock", b"\x09".hex() + ".kvblock", ".petrel-kv-tier.lock"])
    assert disk.get(b"\x09") == b"\x09" * 10 and disk.get(b"\x00") is None
    disk.put(b"big", bytes(26))  # over the whole bound: dropped
    assert disk.stats()["dropped"] == 1 and len(disk) == 2

    def disk_full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr("builtins.open", disk_full)
    disk.put(b"new", bytes(5))  # a failed write: counted, not raised
    monkeypatch.undo()
    assert not disk.contains(b"new") and disk.stats()["errors"] == 1
    assert not [n for n in os.listdir(tmp_path / "d") if ".tmp." in n]
    os.unlink(disk.file_of(b"\x08"))  # a file removed behind its back: a miss, not an error raised
    assert disk.get(b"\x08") is None and not disk.contains(b"\x08")
    disk.close()


def test_disk_tier_directory_is_one_engines(tmp_path):
    path = str(tmp_path / "d")
    os.makedirs(path)
    with open(os.path.join(path, "ab" * 32 + ".kvblock"), "wb") as f:  # a previous run's block
        f.write(b"old")
    with open(os.path.join(path, "notes.txt"), "w") as f:  # not ours: left alone
        f.write("keep")
    disk = DiskTier(path, 1000)
    assert sorted(os.listdir(path)) == [".petrel-kv-tier.lock", "notes.txt"]
    with pytest.raises(ValueError, match="in use by another petrel engine"):
        DiskTier(path, 1000)
    disk.close()
    DiskTier(path, 1000).close()


def test_chain_skips_a_bad_copy_and_counts_it():
    layout = _layout()
    host, other = HostTier(1 << 20), HostTier(1 << 20)
    other.name = "disk"
    chain = TierChain([host, other], layout)
    kv = _kv(layout)
    chain.store(0, b"h" * 32, [1, 2, 3, 4], kv)
    blob = host.get(b"h" * 32)
    other.put(b"h" * 32, blob)
    host.put(b"h" * 32, blob[:-1])  # the first tier's copy is truncated, the second's is good
    assert torch.equal(chain.fetch(0, b"h" * 32, [1, 2, 3, 4]), kv)
    assert chain.fetch(0, b"h" * 32, [1, 2, 3, 5]) is None  # other tokens: refused everywhere
    stats = chain.stats()
    assert stats["all"]["fetched_blocks"] == 1 and stats["all"]["rejected_blocks"] == 3


def test_a_tier_that_raises_is_a_miss_not_a_failure():
    class Broken:
        name = "store"

        def get(self, key):
            raise ConnectionError("gone")

        def put(self, key, blob):
            raise ConnectionError("gone")

        def contains(self, key):
            return False

        def stats(self):
            return {}

    layout = _layout()
    host = HostTier(1 << 20)
    chain = TierChain([Broken(), host], layout)
    chain.store(0, b"h" * 32, [1, 2, 3, 4], _kv(layout))  # logged and counted
    host.put(b"h" * 32, encode_block(layout, b"h" * 32, 0, [1, 2, 3, 4], _kv(layout)))
    assert torch.equal(chain.fetch(0, b"h" * 32, [1, 2, 3, 4]), _kv(layout))  # the next tier still answers
    stats = chain.stats()["all"]
    assert stats["failed_puts"] == 1 and stats["failed_gets"] == 1 and stats["stored_blocks"] == 0


def test_options_are_checked():
    from petrel.config import EngineConfig

    with pytest.raises(ValueError, match="kv_host_tier_bytes must be a positive"):
        EngineConfig(kv_host_tier_bytes=0)
    with pytest.raises(ValueError, match="kv_disk_tier_bytes must be a positive"):
        EngineConfig(kv_disk_tier_path="/tmp/x", kv_disk_tier_bytes=-1)
    with pytest.raises(ValueError, match="needs enable_prefix_caching"):
        EngineConfig(kv_host_tier_bytes=1 << 20, enable_prefix_caching=False)
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        EngineConfig(kv_disk_tier_path="/tmp/x", tensor_parallel_size=2)
    with pytest.raises(TypeError, match="kv_host_tier_bytes"):
        EngineConfig(kv_host_tier_bytes="1G")
    assert build_tiers(_layout(), None, None, None) is None


# ------------------------------------------------------------------------------------------- the block manager
def test_block_manager_lists_evictions_and_tier_hits_without_a_model():
    """Without torch: a fake tier (a dict of what was evicted). An evicted cached block is listed for copying out;
    a prompt that misses in memory takes the tier's blocks into fresh, published blocks with their KV pending; a
    pending block evicted before its KV was written is neither copied out nor kept; no room means memory only."""
    from test_window_blocks import compute, make_seq

    from petrel.engine.block_manager import BlockManager

    bm = BlockManager(8, BS)
    tier: dict = {}
    bm.tier_fetch = lambda group, h, tokens: tier.get((group, h, tokens))

    def drain():  # what KVTierIO does: evicted blocks go down, loads are written
        for _block, group, h, tokens in bm.pending_evictions:
            tier[(group, h, tokens)] = f"kv of {tokens}"
        bm.pending_evictions, bm.pending_loads = [], {}

    a = make_seq(range(3, 3 + 4 * BS + 1))  # 4 full blocks + 1 token
    bm.match_prefix(a)
    compute(bm, a, a.num_tokens)
    hashes = list(a.block_hashes)
    bm.free(a)
    filler = make_seq(range(100, 100 + 8 * BS))  # takes all 8 blocks: a's 4 cached ones are evicted
    bm.match_prefix(filler)
    compute(bm, filler, filler.num_tokens)
    assert [h for _, _, h, _ in bm.pending_evictions] == hashes[::-1]  # freed tail first; the partial one uncached
    drain()
    bm.free(filler)
    again = make_seq(range(3, 3 + 4 * BS + 1))
    bm.match_prefix(again)
    assert again.num_computed_tokens == 4 * BS and again.num_cached_tokens == 4 * BS
    assert sorted(bm.pending_loads.values()) == sorted(tier.values())
    assert all(bm.hash_to_block[h] == b for h, b in zip(hashes, again.block_table))  # published at once
    bm.check_integrity()
    bm.free(again)  # not admitted after all: the loaded blocks stay cached, their KV still pending
    assert len(bm.pending_loads) == 4 and bm.num_cached_blocks == 4 + 4  # and the filler's last ones
    other = make_seq(range(200, 200 + 8 * BS))
    bm.match_prefix(other)
    assert bm.allocate_slots(other, other.num_tokens)  # evicts everything cached, the pending loads too
    assert not bm.pending_loads and all(h not in hashes for _, _, h, _ in bm.pending_evictions)
    bm.pending_evictions = []
    small = BlockManager(3, BS)  # the tier's 4 blocks do not fit: memory only
    small.tier_fetch = bm.tier_fetch
    seq = make_seq(range(3, 3 + 4 * BS + 1))
    small.match_prefix(seq)
    assert seq.num_computed_tokens == 0 and not small.pending_loads
    small.check_integrity()


# ------------------------------------------------------------------------------------------- the engine
@pytest.mark.parametrize("tiers", ["host", "disk", "host+disk"])
def test_prompt_from_a_tier_equals_recomputation(model, tokenizer_dir, recomputed, tmp_path, tiers):  # noqa: F811
    options = {}
    if "host" in tiers:  # with a disk below, the host tier holds only 3 blocks: most spill to disk
        options["kv_host_tier_bytes"] = 8000 if "disk" in tiers else 1 << 20
    if "disk" in tiers:
        options["kv_disk_tier_path"] = str(tmp_path / "kv")
        options["kv_disk_tier_bytes"] = 1 << 20
    llm = _llm(model, tokenizer_dir, **options)
    try:
        cold = _run(llm)
        _assert_same(cold, recomputed)
        _evict(llm)
        before = _tier_stats(llm)["all"]["loaded_blocks"]
        warm = _run(llm)
        stats = _tier_stats(llm)
        assert warm[2] == REUSED * BS  # every reusable block came back...
        assert stats["all"]["loaded_blocks"] - before == REUSED  # ...from the tiers, none was still in memory
        _assert_same(warm, recomputed)
        last = tiers.split("+")[-1]  # with both, the fillers' blocks came later and hold the host tier
        assert stats[last]["hits"] >= REUSED and stats[last]["bytes_out"] > 0
        if tiers == "host+disk":
            assert stats["host"]["puts"] > 0 and stats["disk"]["puts"] > 0  # the host tier spilled to disk
        assert stats["all"]["rejected_blocks"] == 0 and stats["all"]["fetch_seconds"] > 0
        it = llm.get_latest_iteration_stats()
        assert it.kv_tiers is not None and it.kv_tiers["all"]["loaded_blocks"] == stats["all"]["loaded_blocks"]
        _check_no_leak(llm)
    finally:
        llm.shutdown()


@pytest.mark.parametrize("damage", ["corrupt", "truncate"])
def test_damaged_disk_blocks_are_recomputed(model, tokenizer_dir, recomputed, tmp_path, damage):  # noqa: F811
    path = tmp_path / "kv"
    llm = _llm(model, tokenizer_dir, kv_disk_tier_path=str(path), kv_disk_tier_bytes=1 << 20)
    try:
        _run(llm)
        _evict(llm)
        files = [path / n for n in os.listdir(path) if n.endswith(".kvblock")]
        assert len(files) >= REUSED
        for f in files:
            data = bytearray(f.read_bytes())
            if damage == "corrupt":
                data[-7] ^= 0x01  # one bit of the payload
            else:
                del data[len(data) // 2 :]
            f.write_bytes(bytes(data))
        warm, loaded = _run_counting(llm)
        stats = _tier_stats(llm)
        assert warm[2] == 0 and loaded == 0  # the first block was refused, so nothing was reused
        assert stats["all"]["rejected_blocks"] >= 1
        _assert_same(warm, recomputed)
        _check_no_leak(llm)
    finally:
        llm.shutdown()


def test_cache_salt_isolates_tiers(model, tokenizer_dir, recomputed):  # noqa: F811
    llm = _llm(model, tokenizer_dir, kv_host_tier_bytes=1 << 20)
    try:
        _run(llm, cache_salt="alice")
        _evict(llm)
        other, loaded = _run_counting(llm, cache_salt="bob")
        assert other[2] == 0 and loaded == 0
        _assert_same(other, recomputed)
        _evict(llm)
        same, loaded = _run_counting(llm, cache_salt="alice")
        assert same[2] == REUSED * BS and loaded == REUSED
        _assert_same(same, recomputed)
        _check_no_leak(llm)
    finally:
        llm.shutdown()


def test_another_models_blocks_are_refused(tiny, tokenizer_dir):  # noqa: F811
    """Model B's engine, handed model A's blocks under the very keys B looks up (same tokens, same hash seed),
    refuses them (the fingerprint differs) and recomputes."""
    a, b = tiny(2, False), tiny(2, False, seed=1)
    llm_a = _llm(a, tokenizer_dir, kv_host_tier_bytes=1 << 20)
    try:
        _run(llm_a)
        _evict(llm_a)
        blobs = llm_a.engine.call(lambda core: dict(core.tier_io.tiers.tiers[0]._blobs))
    finally:
        llm_a.shutdown()
    llm_b = _llm(b, tokenizer_dir, kv_host_tier_bytes=1 << 20)
    try:
        ref = _run(llm_b)
        _evict(llm_b)

        def plant(core):
            host = core.tier_io.tiers.tiers[0]
            for key, blob in blobs.items():
                host.put(key, blob)

        llm_b.engine.call(plant)
        rejected = _tier_stats(llm_b)["all"]["rejected_blocks"]
        got, loaded = _run_counting(llm_b)
        assert got[2] == 0 and loaded == 0 and _tier_stats(llm_b)["all"]["rejected_blocks"] > rejected
        _assert_same(got, ref)
        assert ref[0] == hf_greedy(b, PROMPT, GREEDY.max_tokens)
        _check_no_leak(llm_b)
    finally:
        llm_b.shutdown()


def test_lora_isolates_tiers(model, tokenizer_dir, tmp_path):  # noqa: F811
    pytest.importorskip("peft")
    from test_lora import make_adapter

    from petrel import LoRARequest

    make_adapter(model.hf, tmp_path / "a1", seed=1)
    make_adapter(model.hf, tmp_path / "a2", seed=2)
    lora1, lora2 = LoRARequest("a1", 1, str(tmp_path / "a1")), LoRARequest("a2", 2, str(tmp_path / "a2"))
    llm = _llm(model, tokenizer_dir, kv_host_tier_bytes=1 << 20, enable_lora=True)
    try:
        first = _run(llm, lora_request=lora1)
        _evict(llm)
        other, loaded = _run_counting(llm, lora_request=lora2)
        assert other[2] == 0 and loaded == 0 and other[0] != first[0]
        _evict(llm)
        base, loaded = _run_counting(llm)  # the base model
        assert base[2] == 0 and loaded == 0
        _evict(llm)
        again, loaded = _run_counting(llm, lora_request=lora1)
        assert again[2] == REUSED * BS and loaded == REUSED
        _assert_same(again, first)
        _check_no_leak(llm)
    finally:
        llm.shutdown()


def test_full_disk_tier_in_an_engine_evicts_and_never_errors(model, tokenizer_dir, recomputed, tmp_path):  # noqa: F811
    path = tmp_path / "kv"
    llm = _llm(model, tokenizer_dir, kv_disk_tier_path=str(path), kv_disk_tier_bytes=3 * 2600)  # ~3 blocks
    try:
        for _ in range(2):
            _assert_same(_run(llm), recomputed)
            _evict(llm)
        stats = _tier_stats(llm)["disk"]
        assert stats["puts"] > 3 and stats["errors"] == 0
        disk_bytes = sum(os.path.getsize(path / n) for n in os.listdir(path) if n.endswith(".kvblock"))
        assert 0 < disk_bytes <= 3 * 2600
        _check_no_leak(llm)
    finally:
        llm.shutdown()


def test_hybrid_model_blocks_come_back_per_kv_group(gemma):  # noqa: F811
    """A tiny Gemma 3 (a global and two sliding KV groups): each group's evicted blocks go down and come back under
    their own key; the tokens equal a cold run's and transformers'."""
    prompt = _tokens(30, 1)
    waves = [{"cold": (prompt, greedy(12))}] + [{f"f{i}": (_tokens(30, 20 + i), greedy(12))} for i in range(2)]
    waves.append({"warm": (prompt, greedy(12))})
    got, core, _ = run_engine(gemma, waves, num_blocks=40, kv_host_tier_bytes=1 << 22)
    stats = core.tier_io.stats()
    assert stats["all"]["loaded_blocks"] > 0 and stats["all"]["rejected_blocks"] == 0
    keys = list(core.tier_io.tiers.tiers[0]._blobs)
    assert {len(k) for k in keys} == {32, 34}  # the global group's blocks, and the sliding groups' (group in key)
    assert got[("warm", 0)] == got[("cold", 0)] == hf_greedy(gemma, prompt, 12)


def test_serve_flags_reach_the_engine_options(tmp_path):
    import argparse

    from petrel.serve.server import add_arguments, engine_options

    def parse(argv):
        return engine_options(add_arguments(argparse.ArgumentParser()).parse_args(argv))

    options = parse(
        ["--kv-host-tier-bytes", "2G", "--kv-disk-tier-path", str(tmp_path), "--kv-disk-tier-bytes", "512M"]
    )
    assert options["kv_host_tier_bytes"] == 2 * 1024**3 and options["kv_disk_tier_bytes"] == 512 * 1024**2
    assert options["kv_disk_tier_path"] == str(tmp_path)
    assert not {"kv_host_tier_bytes", "kv_disk_tier_path", "kv_disk_tier_bytes"} & set(parse([]))
    with pytest.raises(SystemExit):
        parse(["--kv-host-tier-bytes", "lots"])


def test_metrics_report_each_tier(model, tokenizer_dir, tmp_path):  # noqa: F811
    from fastapi.testclient import TestClient

    from petrel.serve.app import build_app

    llm = _llm(model, tokenizer_dir, kv_host_tier_bytes=8000, kv_disk_tier_path=str(tmp_path / "kv"))
    try:
        _run(llm)
        _evict(llm)
        _run(llm)
        stats = _tier_stats(llm)
        with TestClient(build_app(llm, served_model_name="tiny")) as client:
            text = client.get("/metrics").text
    finally:
        llm.shutdown()
    for tier in ("host", "disk"):
        for counter, name in (("hits", "hits"), ("bytes_in", "bytes_written"), ("bytes_out", "bytes_read")):
            assert f'petrel_kv_tier_{name}{{model_name="tiny",tier="{tier}"}} {float(stats[tier][counter])}' in text
    loaded = float(stats["all"]["loaded_blocks"])
    assert loaded >= REUSED and f'petrel_kv_tier_blocks{{event="loaded",model_name="tiny"}} {loaded}' in text
    assert 'petrel_kv_tier_seconds{model_name="tiny",phase="fetch"}' in text


def test_w5_prompts_and_a_tiny_bench_run(model, tokenizer_dir, tmp_path, capsys):  # noqa: F811
    from petrel.bench.tiers import main
    from petrel.bench.workloads import W5_FULL, W5Sizes, make_w5_prompts

    full = make_w5_prompts(W5_FULL)
    assert len(full) == 64 * 4 and all(len(p) == 2048 + 32 for _, p in full)
    assert sorted(i for i, _ in full) == sorted(list(range(64)) * 4)  # 4 requests per prefix...
    assert [i for i, _ in full[:8]] != sorted(i for i, _ in full[:8])  # ...in random order
    assert len({tuple(p[:2048]) for _, p in full}) == 64 and len({tuple(p) for _, p in full}) == 256
    small = make_w5_prompts(W5Sizes(num_prefixes=3, prefix_len=16, requests_per_prefix=2, suffix_len=4))
    assert len(small) == 6 and all(len(p) == 20 for _, p in small)
    out = tmp_path / "w5.json"
    argv = ["--model", model.path, "--tokenizer", tokenizer_dir, "--quick", "--block-size", "4", "--out", str(out)]
    assert main(argv + ["--disk-tier-path", str(tmp_path / "kv")]) == 0
    import json

    doc = json.loads(out.read_text())
    by = {r["tiers"]: r for r in doc["results"]}
    assert set(by) == {"off", "host", "host+disk"} and all(r["valid"] for r in by.values())
    assert by["off"]["kv_tiers"] is None and by["host"]["kv_tiers"]["all"]["loaded_blocks"] > 0
    assert by["host"]["computed_prompt_tokens"] < by["off"]["computed_prompt_tokens"]
    assert by["host+disk"]["kv_tiers"]["disk"]["puts"] > 0


def test_a_batch_sharing_prefixes_from_the_tiers_equals_recomputation(model, tokenizer_dir, tmp_path):  # noqa: F811
    """Six prompts on three prefixes at once, after their blocks went down to the tiers (a small host tier over
    a disk tier): blocks come back while other sequences run and are preempted for room, and every output equals
    an engine without tiers."""
    prefixes = [[(i * 13 + 5 * k) % 250 + 3 for i in range(12)] for k in range(3)]
    prompts = [p + [(7 * j + k) % 250 + 3 for j in range(5)] for k, p in enumerate(prefixes) for _ in range(2)]
    prompts = [p[:-1] + [p[-1] + n] for n, p in enumerate(prompts)]  # every suffix its own
    params = SamplingParams(temperature=0, max_tokens=6, logprobs=2, ignore_eos=True)

    def batch(llm):
        return [_result(o) for o in llm.generate(prompts, params, use_tqdm=False)]

    plain = _llm(model, tokenizer_dir, num_blocks=20)
    try:
        want = batch(plain)
    finally:
        plain.shutdown()
    llm = _llm(model, tokenizer_dir, num_blocks=20, kv_host_tier_bytes=4 * 2600, kv_disk_tier_path=str(tmp_path))
    try:
        batch(llm)
        _evict(llm)
        before = _tier_stats(llm)["all"]["loaded_blocks"]
        got = batch(llm)
        assert _tier_stats(llm)["all"]["loaded_blocks"] > before
        assert llm.engine.call(lambda core: core.scheduler.num_preemptions) > 0
        for g, w in zip(got, want):
            _assert_same(g, w)
        _check_no_leak(llm)
    finally:
        llm.shutdown()


@pytest.mark.parametrize("seed", range(6))
def test_random_scheduling_with_tiers_keeps_every_block_true(seed):
    """The scheduler's seeded random operations (tests/test_scheduler_properties.py: preemption, forks, beams,
    pins, aborts, resets, sliding-window groups) with a fake tier under the block manager that does what
    KVTierIO does right after each schedule: an evicted block's slot contents go down, a tier hit's come back.
    The harness's shadow of every KV slot then checks that each computed position of a running sequence, and each
    block in the prefix cache, holds the tokens it should: a block brought back to the wrong place, or one copied
    out after being overwritten, would fail it."""
    from test_scheduler_properties import OPERATIONS, make_core

    core = make_core(seed)
    bm, tier, loads = core.bm, {}, [0]

    def fetch(group, block_hash, tokens):
        entry = tier.get((group, block_hash))  # the codec's check: the header's tokens are the block's
        return list(entry[1]) if entry is not None and entry[0] == tokens else None

    def drain():
        for block, group, block_hash, tokens in bm.pending_evictions:
            tier[(group, block_hash)] = (tokens, list(core.kv[block]))
        for block, kv in bm.pending_loads.items():
            core.kv[block] = kv
        loads[0] += len(bm.pending_loads)
        bm.pending_evictions, bm.pending_loads = [], {}

    schedule = core.sched.schedule

    def schedule_then_drain():
        batch = schedule()
        drain()
        return batch

    bm.tier_fetch, core.sched.schedule = fetch, schedule_then_drain
    names, weights = zip(*OPERATIONS)
    ops = {
        "add": core.add_request,
        "step": core.step,
        "abort": core.abort,
        "stop_string": core.stop_string,
        "release_pin": core.release_pin,
        "reset_prefix_cache": core.reset_prefix_cache,
    }
    for _ in range(400):
        ops[core.rng.choices(names, weights)[0]]()
        core.check_invariants()
    while core.pins:
        core.release_pin()
    for _ in range(2000):
        if not core.sched.has_work:
            break
        core.step()
        core.check_invariants()
        while core.pins:
            core.release_pin()
    else:
        raise AssertionError("the requests did not finish")
    core.check_all_free()
    if bm.enable_prefix_caching:
        assert tier and loads[0] > 0  # blocks went down and came back
