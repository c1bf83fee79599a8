"""The latent KV cache (multi-head latent attention, petrel/model/kv_layout.py's "latent" kind) as a first-class cache:
blocks evicted to the KV tiers come back in the block format that names the latent layout and give the tokens and
logprobs of recomputing them (and transformers'); a prompt's latent rows move between a prefill and a decode instance
and the decode instance's tokens equal one instance's; the engine and the server report KV bytes per token."""

from __future__ import annotations

import json
import struct

import pytest
import torch

pytest.importorskip("transformers")

from test_model_tiny import hf_greedy  # noqa: E402
from tiny_deepseek import deepseek_factory  # noqa: E402

from petrel import LLM, DisaggregatedParams, SamplingParams  # noqa: E402
from petrel.engine.model_runner import kv_bytes_per_block  # noqa: E402
from petrel.kv_tiers.block_codec import (  # noqa: E402
    MAGIC,
    VERSION,
    BlockCodecError,
    BlockLayout,
    decode_block,
    encode_block,
)
from petrel.model.kv_layout import expanded_kv_values_per_token, kv_layout_of  # noqa: E402

BS = 4
NUM_BLOCKS = 16
PROMPT = [(i * 37 + 11) % 250 + 3 for i in range(40)]
FILLERS = [[(i * 53 + 7 * k) % 250 + 3 for i in range(56)] for k in (1, 2)]
GREEDY = SamplingParams(temperature=0, max_tokens=8, logprobs=3, ignore_eos=True)
REUSED = (len(PROMPT) - 1) // BS


@pytest.fixture(scope="module")
def v3(tmp_path_factory):
    return deepseek_factory(tmp_path_factory)("deepseek_v3")


def _llm(t, tok, num_blocks: int = NUM_BLOCKS, **options) -> LLM:
    per_block = kv_bytes_per_block(t.cfg, BS, torch.float32)
    return LLM(t.path, tokenizer=tok, block_size=BS, kv_cache_memory=num_blocks * per_block, **options)


def _run(llm: LLM, prompt=PROMPT):
    out = llm.generate(prompt, GREEDY, use_tqdm=False)
    c = out.outputs[0]
    return c.token_ids, [sorted((t, lp.logprob) for t, lp in pos.items()) for pos in c.logprobs], out.num_cached_tokens


# ---------------------------------------------------------------- the block format


def _latent_layout(**changes) -> BlockLayout:
    fields = dict(fingerprint="f" * 32, dtype="float32", num_layers=3, block_size=BS, kv_heads=1, head_dim=40)
    return BlockLayout(**{**fields, "kind": "latent", **changes})


def test_block_format_carries_the_latent_layout():
    layout = _latent_layout()
    assert layout.shape == (3, 1, BS, 1, 40) and layout.payload_bytes == 3 * BS * 40 * 4
    kv = torch.randn(layout.shape)
    blob = encode_block(layout, b"k" * 32, 0, range(BS), kv)
    assert torch.equal(decode_block(layout, blob, b"k" * 32, 0, range(BS)), kv)
    assert json.loads(blob[len(MAGIC) + 6 : blob.index(b"}") + 1])["kind"] == "latent"
    # a reader of keys and values of the same geometry (another cache kind) refuses it by name
    with pytest.raises(BlockCodecError, match="kind mismatch"):
        decode_block(BlockLayout(**{**layout.__dict__, "kind": "kv"}), blob, b"k" * 32, 0, range(BS))
    plain = BlockLayout(**{**layout.__dict__, "kind": "kv", "head_dim": 20})
    # a blob written before caches had kinds is a key-and-value block
    kv_plain = torch.randn(plain.shape)
    header = json.loads(encode_block(plain, b"k" * 32, 0, range(BS), kv_plain)[len(MAGIC) + 6 :].split(b"}")[0] + b"}")
    del header["kind"]
    raw = json.dumps(header, separators=(",", ":")).encode()
    old = MAGIC + struct.pack(">HI", VERSION, len(raw)) + raw + kv_plain.numpy().tobytes()
    assert torch.equal(decode_block(plain, old, b"k" * 32, 0, range(BS)), kv_plain)
    with pytest.raises(BlockCodecError, match="kind mismatch"):
        decode_block(_latent_layout(head_dim=20), old, b"k" * 32, 0, range(BS))


# ---------------------------------------------------------------- the engine


@pytest.mark.parametrize("tiers", ["host", "disk"])
def test_latent_blocks_from_the_tiers_equal_recomputation(v3, tokenizer_dir, tmp_path, tiers):
    """A prompt's latent blocks evicted from a 16-block cache (fillers take every block) come back from host memory
    or disk: its tokens and logprobs equal its first, computed run's and transformers' tokens."""
    options = {"kv_host_tier_bytes": 1 << 20} if tiers == "host" else {"kv_disk_tier_path": str(tmp_path / "kv")}
    llm = _llm(v3, tokenizer_dir, **options)
    try:
        cold = _run(llm)
        for filler in FILLERS:
            _run(llm, filler)
        warm = _run(llm)
        stats = llm.engine.call(lambda core: core.tier_io.stats())
        layout = llm.engine.call(lambda core: core.tier_io.tiers.layout)
    finally:
        llm.shutdown()
    assert cold[0] == hf_greedy(v3, PROMPT, GREEDY.max_tokens)
    assert cold[2] == 0 and warm[2] == REUSED * BS
    assert stats["all"]["loaded_blocks"] == REUSED and stats["all"]["rejected_blocks"] == 0
    assert (layout.kind, layout.kv_heads, layout.head_dim) == ("latent", 1, 40)
    assert warm[0] == cold[0]
    for got, want in zip(warm[1], cold[1]):
        assert [t for t, _ in got] == [t for t, _ in want]
        assert max(abs(a - b) for (_, a), (_, b) in zip(got, want)) <= 1e-5


def test_latent_prompt_moves_from_a_prefill_to_a_decode_instance(v3, tokenizer_dir):
    secret = "test-latent-transfer"
    common = dict(tokenizer=tokenizer_dir, kv_cache_memory=1 << 20, kv_transfer_secret=secret)
    prefill = LLM(v3.path, block_size=4, kv_transfer_role="prefill", kv_transfer_timeout=5, **common)
    decode = LLM(
        v3.path,
        block_size=16,
        kv_transfer_role="decode",
        kv_transfer_peers=[prefill.kv_transfer_endpoint],
        kv_transfer_timeout=5,
        **common,
    )
    greedy = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    prompts = [PROMPT[:17], PROMPT[3:36]]  # partial last blocks in both block sizes
    try:
        contexts = prefill.generate(
            prompts, greedy, use_tqdm=False, disaggregated_params=DisaggregatedParams(request_type="context_only")
        )
        params = [
            DisaggregatedParams(**{**c.disaggregated_params.to_dict(), "request_type": "generation_only"})
            for c in contexts
        ]
        outs = decode.generate(prompts, greedy, use_tqdm=False, disaggregated_params=params)
    finally:
        prefill.shutdown()
        decode.shutdown()
    for p, out in zip(prompts, outs):
        assert out.outputs[0].token_ids == hf_greedy(v3, p, 10)
        assert out.kv_transfer.num_bytes == 3 * 1 * len(p) * 1 * 40 * 4  # layers x one latent row a token


def test_kv_bytes_per_token_reported_and_against_expanded_heads(v3, tokenizer_dir):
    from petrel.serve.server import startup_banner
    from petrel.serve.worker_info import server_info

    cfg = v3.cfg
    llm = _llm(v3, tokenizer_dir)
    try:
        assert llm.engine.kv_bytes_per_token == 3 * 40 * 4
        assert server_info(llm, "tiny")["kv_bytes_per_token"] == 3 * 40 * 4
        assert "480 bytes a token" in startup_banner(llm, "tiny", "127.0.0.1", 8000)
    finally:
        llm.shutdown()
    # expanded, every head would cache its key (16 + 8) and value (16): 4 x 40 values a layer against 40
    assert expanded_kv_values_per_token(cfg) == 4 * 40 == 4 * kv_layout_of(cfg).values_per_token
