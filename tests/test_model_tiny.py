"""Model correctness on a tiny random-weight Llama: petrel's logits and greedy tokens against transformers.

A tiny Llama is built with transformers (fixed seed, float32), saved as safetensors, and loaded through
petrel's own loader. Petrel's model is then driven through the paged KV cache exactly as the engine does
(ModelRunner.prepare builds the flat batch and the attention metadata) and every logit row is compared to
transformers' full-sequence forward pass, which is the ground truth for every position (causal model).
"""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch

transformers = pytest.importorskip("transformers")

from tiny_llama import (  # noqa: E402
    ATOL,
    LLAMA3_ROPE,
    RTOL,
    VARIANT_IDS,
    VARIANTS,
    VOCAB,
    Tiny,
    _tokens,
    projection_weight,
)

from petrel.config import EngineConfig  # noqa: E402
from petrel.engine.engine_core import EngineCore  # noqa: E402
from petrel.engine.model_runner import ModelRunner, kv_bytes_per_block  # noqa: E402
from petrel.engine.scheduler import ScheduledBatch  # noqa: E402
from petrel.engine.sequence import EngineRequest, Sequence  # noqa: E402
from petrel.model import dense_kernels, gemm_kernels  # noqa: E402
from petrel.model.quantization import QuantizedLinear  # noqa: E402
from petrel.sampling_params import SamplingParams  # noqa: E402


class PagedDriver:
    """Runs petrel's model over the paged KV cache the way the engine does, returning every row's logits.

    Blocks are handed out in a scrambled order so that block tables are neither contiguous nor sorted.
    """

    def __init__(
        self, tiny: Tiny, block_size: int = 4, num_blocks: int = 64, seed: int = 0, kv_cache_dtype=torch.float32
    ):
        self.runner = ModelRunner(
            tiny.model, tiny.cfg, num_blocks, block_size, torch.float32, "cpu", kv_cache_dtype=kv_cache_dtype
        )
        self.block_size = block_size
        g = torch.Generator().manual_seed(seed)
        self.free = torch.randperm(num_blocks, generator=g).tolist()
        self._n = 0

    def new_seq(self, token_ids: list[int]) -> Sequence:
        self._n += 1
        req = EngineRequest(f"r{self._n}", list(token_ids), SamplingParams(temperature=0.0))
        return Sequence(req, 0, token_ids, len(token_ids))

    def step(self, work: list[tuple[Sequence, int]]) -> list[torch.Tensor]:
        """One step: each (seq, n) computes its next n tokens. Returns [n, vocab] logits per item, in order."""
        bs = self.block_size
        for seq, n in work:
            assert seq.num_computed_tokens + n <= seq.num_tokens
            needed = -(-(seq.num_computed_tokens + n) // bs) - len(seq.block_table)
            for _ in range(max(needed, 0)):
                seq.block_table.append(self.free.pop())
        order = sorted(range(len(work)), key=lambda i: work[i][1] != 1)  # decodes first, as the scheduler does
        batch = ScheduledBatch(seqs=[work[i][0] for i in order], num_new_tokens=[work[i][1] for i in order])
        with torch.inference_mode():
            input_ids, positions, meta = self.runner.build_inputs(self.runner.spans(batch))
            hidden = self.runner.model(input_ids, positions, self.runner.kv_caches, meta)
            logits = self.runner.model.compute_logits(hidden)
        assert logits.shape == (batch.num_tokens, VOCAB)
        out: list = [None] * len(work)
        row = 0
        for i in order:
            seq, n = work[i]
            out[i] = logits[row : row + n]
            row += n
            seq.num_computed_tokens += n
        return out

    def run_chunks(self, seq: Sequence, chunks: list[int]) -> torch.Tensor:
        assert sum(chunks) == seq.num_tokens
        return torch.cat([self.step([(seq, n)])[0] for n in chunks])

    def decode_side_by_side(self, tokens: list[int], other: list[int], first=(6, 5)) -> tuple[torch.Tensor, ...]:
        """Two sequences whose first steps prefill first[0] and first[1] tokens together, then each decoded a token
        a step, `other` beside `tokens` while it lasts: each one's logits for all its tokens."""
        a, b = self.new_seq(tokens), self.new_seq(other)
        got_a, got_b = (list(pair) for pair in zip(self.step([(a, first[0]), (b, first[1])])))
        while a.num_computed_tokens < a.num_tokens or b.num_computed_tokens < b.num_tokens:
            work = [(s, 1) for s in (a, b) if s.num_computed_tokens < s.num_tokens]
            for seq, out in zip([s for s, _ in work], self.step(work)):
                (got_a if seq is a else got_b).append(out)
        return torch.cat(got_a), torch.cat(got_b)


def loaded_logits_match(t: Tiny, model, cfg, path: str, what: str, atol: float = 1e-4) -> None:
    """A model petrel loaded from `path` (model, cfg) gives t's transformers logits: a prompt of 19 tokens and one
    of 8 prefilled together, then the first decoded 8 more tokens."""
    g = Tiny(t.hf, model, cfg, path)
    tokens, other = _tokens(19, 70), _tokens(8, 71)
    drv = PagedDriver(g)
    a, b = drv.new_seq(tokens), drv.new_seq(other)
    got_a, got_b = drv.step([(a, 11), (b, 8)])
    got_a = [got_a, *(drv.step([(a, 1)])[0] for _ in range(8))]
    expected = torch.cat([t.hf_logits(tokens)[:19], t.hf_logits(other)])
    got = torch.cat([*got_a, got_b])
    torch.testing.assert_close(got, expected, atol=atol, rtol=atol, msg=lambda m: f"{what}: {m}")


def one_calls(monkeypatch, owner, name: str) -> list[bool]:
    """From now on, whether each call of owner.name (a one-kernel-call path) took its step, in order."""
    taken, original = [], getattr(owner, name)

    def recording(self, *args):
        out = original(self, *args)
        taken.append(out is not None)
        return out

    monkeypatch.setattr(owner, name, recording)
    return taken


def stack_calls(monkeypatch) -> list[bool]:
    """From now on, whether each step ran the decoder stack as one kernel call (LlamaForCausalLM._step_in_one_call
    took it), in order."""
    from petrel.model.llama import LlamaForCausalLM

    return one_calls(monkeypatch, LlamaForCausalLM, "_step_in_one_call")


@pytest.fixture(params=["native", "torch"])
def kernels(request, monkeypatch):
    """Run a test with petrel's float32 CPU kernels (decode attention, few-row products) and with its torch paths."""
    if request.param == "torch":
        monkeypatch.setattr(dense_kernels, "library", lambda: None)
    elif dense_kernels.library() is None:
        pytest.skip("petrel's float32 kernels cannot run here (no AVX2/FMA or no C compiler)")
    return request.param


def assert_close(actual: torch.Tensor, expected: torch.Tensor, what: str = ""):
    torch.testing.assert_close(actual, expected, atol=ATOL, rtol=RTOL, msg=lambda m: f"{what}: {m}")


# ---------------------------------------------------------------- 1. prefill


@pytest.mark.parametrize("kv_heads,tied", VARIANTS, ids=VARIANT_IDS)
def test_loader_config_and_weights(tiny, kv_heads, tied):
    t = tiny(kv_heads, tied)
    assert t.cfg.architecture == "LlamaForCausalLM"
    assert (t.cfg.vocab_size, t.cfg.hidden_size, t.cfg.head_dim) == (VOCAB, 64, 16)
    assert t.cfg.eos_token_ids == [2] and t.cfg.rope_scaling is None
    head, embed = t.model.lm_head, t.model.model.embed_tokens
    if tied:  # one weight: rows, or panels (hold_f32_panels)
        assert (head.qweight is embed.qweight) if isinstance(head, QuantizedLinear) else (head.weight is embed.weight)
    hf_sd = t.hf.state_dict()
    for i in range(2):
        a = f"model.layers.{i}.self_attn."
        # float32 projections held in panels wherever the kernels run (quantization.hold_f32_panels), else rows
        qkv_proj = t.model.get_submodule(a + "qkv_proj")
        assert isinstance(qkv_proj, QuantizedLinear) == gemm_kernels.f32_panels()
        qkv = projection_weight(qkv_proj)
        torch.testing.assert_close(
            qkv,
            torch.cat([hf_sd[a + "q_proj.weight"], hf_sd[a + "k_proj.weight"], hf_sd[a + "v_proj.weight"]]),
            atol=0,
            rtol=0,
        )
    torch.testing.assert_close(projection_weight(head), t.hf.lm_head.weight, atol=0, rtol=0)


@pytest.mark.parametrize("kv_heads,tied", VARIANTS, ids=VARIANT_IDS)
def test_prefill_matches_transformers(tiny, kv_heads, tied):
    t = tiny(kv_heads, tied)
    drv = PagedDriver(t, block_size=4)
    a, b, c = _tokens(23, 1), _tokens(9, 2), _tokens(16, 3)  # 23 and 9 end mid-block, 16 fills 4 blocks
    alone = drv.run_chunks(drv.new_seq(a), [len(a)])
    assert_close(alone, t.hf_logits(a), "single prefill")
    # several prompts prefilled in one flat batch
    seqs = [drv.new_seq(x) for x in (a, b, c)]
    outs = drv.step([(s, s.num_tokens) for s in seqs])
    for x, out in zip((a, b, c), outs):
        assert_close(out, t.hf_logits(x), f"batched prefill of {len(x)} tokens")


def test_prefill_single_token_prompt(tiny):
    """A one-token prompt is a one-token query: it runs through the decode path with an empty history."""
    t = tiny(2, False)
    drv = PagedDriver(t)
    a, b = _tokens(1, 4), _tokens(11, 5)
    outs = drv.step([(drv.new_seq(b), 11), (drv.new_seq(a), 1)])
    assert_close(outs[1], t.hf_logits(a), "one-token prompt")
    assert_close(outs[0], t.hf_logits(b), "prefill next to it")


def test_explicit_head_dim(tiny):
    """head_dim from the config (32), not hidden_size // heads (16): q/o projections are wider than hidden."""
    t = tiny(2, False, head_dim=32)
    assert t.cfg.head_dim == 32
    drv = PagedDriver(t, block_size=4)
    tokens = _tokens(15, 6)
    assert_close(drv.run_chunks(drv.new_seq(tokens), [6, 5, 1, 1, 1, 1]), t.hf_logits(tokens), "head_dim 32")


# ---------------------------------------------------------------- 2. decode through the paged cache


@pytest.mark.parametrize("kv_heads,tied", VARIANTS, ids=VARIANT_IDS)
def test_step_by_step_decode_matches_transformers(tiny, kv_heads, tied, kernels):
    t = tiny(kv_heads, tied)
    drv = PagedDriver(t, block_size=4)
    tokens = _tokens(26, 10)  # 7 prompt tokens, then 19 one-token steps: 7 blocks of 4
    seq = drv.new_seq(tokens)
    logits = drv.run_chunks(seq, [7] + [1] * 19)
    assert len(seq.block_table) == 7
    assert_close(logits, t.hf_logits(tokens), "step-by-step decode")


def quantized_copy(t: Tiny, fmt: str) -> SimpleNamespace:
    """The tiny model with every layer's projections quantized: int8 per row, GGUF Q4_1 blocks (gguf's own
    quantizer) kept as 4-bit codes, or bfloat16 (in panels where the CPU multiplies them so, as dtype="bfloat16"
    holds them)."""
    import gguf

    from petrel.model.quantization import QuantizedLinear, QuantizedWeight

    model = copy.deepcopy(t.model)
    for layer in model.model.layers:
        for owner, name in (
            (layer.self_attn, "qkv_proj"),
            (layer.self_attn, "o_proj"),
            (layer.mlp, "gate_up_proj"),
            (layer.mlp, "down_proj"),
        ):
            weight = projection_weight(getattr(owner, name))
            if fmt == "int8":
                qweight = QuantizedWeight.int8_per_channel(weight)
            elif fmt == "bfloat16":
                qweight = QuantizedWeight.bfloat16(weight, panels=gemm_kernels.bf16_panels())
            else:
                raw = gguf.quants.quantize(weight.numpy(), gguf.GGMLQuantizationType[fmt])
                qweight = QuantizedWeight.from_gguf(fmt, raw, *weight.shape)
            setattr(owner, name, QuantizedLinear(qweight))
    return SimpleNamespace(model=model, cfg=t.cfg)


@pytest.mark.parametrize(
    "weights,kv_cache_dtype",
    [
        ("float32", torch.float32),
        ("int8", torch.float32),
        ("Q4_1", torch.float32),
        ("float32", torch.bfloat16),
        ("bfloat16", torch.bfloat16),
    ],
    ids=["float32", "int8", "Q4_1", "bf16-cache", "bf16"],
)
@pytest.mark.parametrize("kv_heads", [4, 2], ids=["mha", "gqa"])
def test_decode_layer_in_one_call_equals_separate_calls(tiny, kv_heads, weights, kv_cache_dtype, monkeypatch):
    """A decode-only step runs the whole decoder stack as one kernel call (dense_kernels.decode_layers), or, without
    it, each Llama layer as one call (decode_layer), with float32 or quantized projections, beside a float32 or a
    bfloat16 cache (which the kernels write rounded as torch rounds); the logits must be those of the layers'
    separate modules, and each path must really be taken for this model."""
    if dense_kernels.library() is None:
        pytest.skip("petrel's float32 kernels cannot run here (no AVX2/FMA or no C compiler)")
    from petrel.model.llama import LlamaDecoderLayer, LlamaForCausalLM

    t = tiny(kv_heads, False) if weights == "float32" else quantized_copy(tiny(kv_heads, False), weights)
    prompts = [_tokens(9, 70), _tokens(14, 71), _tokens(5, 72)]

    def decode_logits() -> torch.Tensor:
        drv = PagedDriver(t, block_size=4, kv_cache_dtype=kv_cache_dtype)
        seqs = [drv.new_seq(p) for p in prompts]
        drv.step([(s, len(s.token_ids)) for s in seqs])
        rows = []
        for i in range(6):  # decode-only steps, three sequences each
            for s in seqs:
                s.token_ids.append(100 + i)
            rows += drv.step([(s, 1) for s in seqs])
        return torch.cat(rows)

    stack_taken = stack_calls(monkeypatch)
    layer_taken = one_calls(monkeypatch, LlamaDecoderLayer, "_decode_in_one_call")
    stacked = decode_logits()
    assert stack_taken == [True] * 7 and not any(layer_taken)  # every step (the three prompts' too), all layers
    layer_taken.clear()
    monkeypatch.setattr(LlamaForCausalLM, "_step_in_one_call", lambda self, *a: None)
    per_layer = decode_logits()
    assert sum(layer_taken) == 6 * len(t.model.model.layers)
    monkeypatch.setattr(LlamaDecoderLayer, "_decode_in_one_call", lambda self, *a: None)
    separate = decode_logits()
    torch.testing.assert_close(stacked, separate, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(per_layer, separate, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    "weights,kv_cache_dtype",
    [("float32", torch.float32), ("Q4_1", torch.float32), ("float32", torch.bfloat16), ("bfloat16", torch.bfloat16)],
    ids=["float32", "Q4_1", "bf16-cache", "bf16"],
)
@pytest.mark.parametrize("kv_heads", [4, 2], ids=["mha", "gqa"])
def test_prompt_chunks_in_one_call_equal_separate_calls(tiny, kv_heads, weights, kv_cache_dtype, monkeypatch):
    """Steps with prompt chunks run the decoder stack as one kernel call too (decode_layers with its prompt_chunks):
    a prompt alone, a chunk after the prompt's cached first part, chunks after decode rows, two prompts, decode rows
    and then a continued chunk and a whole prompt; every row's logits must be the separate modules', and each such
    step must take the one call. A step of 310 rows takes it where every product runs one kernel at any count of
    rows (weights in panels: float32 ones wherever the kernels run, with either ISA's blocks; integer products), and
    only there."""
    if dense_kernels.library() is None:
        pytest.skip("petrel's float32 kernels cannot run here (no AVX2/FMA or no C compiler)")
    from petrel.model.llama import LlamaForCausalLM

    t = tiny(kv_heads, False) if weights == "float32" else quantized_copy(tiny(kv_heads, False), weights)

    def step_logits() -> torch.Tensor:
        drv = PagedDriver(t, block_size=4, num_blocks=160, kv_cache_dtype=kv_cache_dtype)
        a, b, c = drv.new_seq(_tokens(9, 60)), drv.new_seq(_tokens(14, 61)), drv.new_seq(_tokens(5, 62))
        rows = drv.step([(a, 9)])  # a prompt alone
        rows += drv.step([(b, 6)])  # a first chunk (ending inside a block)
        a.token_ids.append(100)
        rows += drv.step([(a, 1), (b, 8)])  # a decode row, then the rest of b after its cached 6 positions
        a.token_ids.append(101)
        rows += drv.step([(a, 1), (c, 5)])  # a decode row, then a whole prompt
        a.token_ids.append(102)
        b.token_ids.append(103)
        rows += drv.step([(a, 1), (b, 1)])  # decodes only
        d, e, f = drv.new_seq(_tokens(3, 63)), drv.new_seq(_tokens(11, 64)), drv.new_seq(_tokens(7, 65))
        rows += drv.step([(d, 3), (e, 5)])  # two prompts
        a.token_ids.append(104)
        c.token_ids.append(105)
        rows += drv.step([(a, 1), (c, 1), (e, 6), (f, 7)])  # decodes, the rest of e, a whole prompt
        g, h = drv.new_seq(_tokens(150, 66)), drv.new_seq(_tokens(160, 67))
        rows += drv.step([(g, 150), (h, 160)])  # 310 rows
        return torch.cat(rows)

    big_steps = t.model.model.layers[0].one_call_parts().max_rows >= 310
    if weights == "float32":
        assert big_steps == gemm_kernels.f32_panels()
    taken = stack_calls(monkeypatch)
    stacked = step_logits()
    assert taken == [True] * 7 + [big_steps]
    monkeypatch.setattr(LlamaForCausalLM, "_step_in_one_call", lambda self, *a: None)
    separate = step_logits()
    torch.testing.assert_close(stacked, separate, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kv_heads", [4, 2], ids=["mha", "gqa"])
def test_bfloat16_cache_reads_the_same_on_every_path(tiny, kv_heads, monkeypatch):
    """A bfloat16 KV cache beside float32 arithmetic (EngineConfig.kv_cache_dtype): prompt chunks, a chunk after a
    cached prefix and decode steps give the same logits with petrel's kernels as with the torch path (both attend
    over the cache's rounded keys and values), near transformers' float32 logits but not equal to them (K and V
    rounded to 8 significant bits). Where the CPU has AVX512_BF16, the kernels' prompt attention also rounds q and
    its weights to bfloat16 (as products with bfloat16 operands round x; PETREL_BF16_ACTIVATIONS=0 keeps them
    float32): near the torch path's logits, not equal."""
    if dense_kernels.library() is None:
        pytest.skip("petrel's float32 kernels cannot run here (no AVX2/FMA or no C compiler)")
    t = tiny(kv_heads, False)
    tokens = _tokens(24, 12)

    def logits() -> torch.Tensor:
        drv = PagedDriver(t, block_size=4, kv_cache_dtype=torch.bfloat16)
        assert drv.runner.kv_caches[0].dtype == torch.bfloat16
        return drv.run_chunks(drv.new_seq(tokens), [9, 6] + [1] * 9)

    kernels = logits()
    with monkeypatch.context() as exact:
        exact.setenv("PETREL_BF16_ACTIVATIONS", "0")
        kernels_exact = logits()
    monkeypatch.setattr(dense_kernels, "library", lambda: None)
    monkeypatch.setattr(gemm_kernels, "library", lambda: None)
    torch_path = logits()
    # the two paths' float32 sums differ in their last bits, which can round a cached K or V value to the next
    # bfloat16 (a 2^-8 step): ~1e-4 in the logits of that position (7.6e-5 seen); the rounding itself moves them
    # 0.006-0.009 (drift below), so reading the cache unrounded on either path would show
    torch.testing.assert_close(kernels_exact, torch_path, atol=5e-4, rtol=1e-5)
    assert (kernels - torch_path).abs().max().item() < 0.02
    # q and the weights rounded to bfloat16 only where dpbf16 runs (kernels and kernels_exact are the same
    # kernels, summing in the same order, everywhere else)
    activation_rounding = (kernels - kernels_exact).abs().max().item()
    assert (activation_rounding > 0) == (gemm_kernels.bf16_pairs_rows() > 0)
    drift = (kernels_exact - t.hf_logits(tokens)).abs().max().item()  # 0.006-0.009 here, logits up to ~4.4
    assert 0 < drift < 0.03


def test_decode_matches_transformers_kv_cache_generation(tiny, kernels):
    """Greedy decode: feed petrel's own argmax back, step by step, and compare with transformers' cached generate."""
    t = tiny(2, False)
    drv = PagedDriver(t, block_size=4)
    prompt = _tokens(6, 11)
    steps = 14
    with torch.no_grad():
        ref = t.hf.generate(
            torch.tensor([prompt]),
            do_sample=False,
            max_new_tokens=steps,
            min_new_tokens=steps,
            output_logits=True,
            return_dict_in_generate=True,
            pad_token_id=0,
        )
    ref_tokens = ref.sequences[0, len(prompt) :].tolist()
    ref_logits = torch.cat(ref.logits).float()  # [steps, vocab], one row per generated token
    seq = drv.new_seq(prompt)

    def greedy(row: torch.Tensor) -> int:  # min_new_tokens: transformers never picks eos here
        row = row[-1].clone()
        row[2] = float("-inf")
        return int(row.argmax())

    got_logits = [drv.step([(seq, len(prompt))])[0][-1:]]
    for _ in range(steps - 1):
        seq.token_ids.append(greedy(got_logits[-1]))
        got_logits.append(drv.step([(seq, 1)])[0])
    seq.token_ids.append(greedy(got_logits[-1]))
    assert seq.token_ids[len(prompt) :] == ref_tokens
    # output_logits are the raw logits, before transformers' logits processors
    assert_close(torch.cat(got_logits), ref_logits, "decode vs transformers generate")


@pytest.mark.parametrize("kv_heads", [4, 2], ids=["mha", "gqa"])
def test_mixed_batch_matches_each_sequence_alone(tiny, kv_heads, kernels):
    """Decodes of sequences of different lengths share a step with a prefill; each matches its reference."""
    t = tiny(kv_heads, False)
    drv = PagedDriver(t, block_size=4)
    a_tokens, b_tokens, c_tokens = _tokens(30, 20), _tokens(20, 21), _tokens(13, 22)
    a, b, c = drv.new_seq(a_tokens), drv.new_seq(b_tokens), drv.new_seq(c_tokens)
    got = {id(s): [] for s in (a, b, c)}

    def step(work):
        for (s, _), out in zip(work, drv.step(work)):
            got[id(s)].append(out)

    step([(a, 10)])  # A prefills alone
    step([(a, 1), (b, 13)])  # A decodes while B prefills
    step([(a, 1), (b, 1), (c, 5)])  # two decodes of different table widths + C's first chunk
    step([(c, 4), (b, 1), (a, 1)])  # C's second chunk listed first: the batch puts decodes first
    for _ in range(4):  # three decodes of three different lengths
        step([(a, 1), (b, 1), (c, 1)])
    step([(b, 1), (a, 1)])  # C finished; A and B go on
    for _ in range(12):
        step([(a, 1)])
    for s, tokens in ((a, a_tokens), (b, b_tokens), (c, c_tokens)):
        assert s.num_computed_tokens == s.num_tokens
        assert_close(torch.cat(got[id(s)]), t.hf_logits(tokens), f"sequence of {len(tokens)} tokens in a mixed batch")
    # and the same sequences run alone in a fresh cache give the same logits
    for tokens in (a_tokens, b_tokens, c_tokens):
        solo = PagedDriver(t, block_size=4, seed=1)
        s = solo.new_seq(tokens)
        assert_close(solo.run_chunks(s, [len(tokens)]), t.hf_logits(tokens), "alone")


# ---------------------------------------------------------------- 3. chunked prefill


@pytest.mark.parametrize(
    "chunks",
    [[8, 12, 9], [5, 7, 17], [6, 1, 22], [14, 15]],
    ids=["aligned", "unaligned", "one-token-chunk", "two-chunks"],
)
@pytest.mark.parametrize("kv_heads", [4, 2], ids=["mha", "gqa"])
def test_chunked_prefill_matches_one_shot(tiny, kv_heads, chunks):
    t = tiny(kv_heads, False)
    tokens = _tokens(29, 30)
    one_shot_drv = PagedDriver(t, block_size=4)
    one_shot = one_shot_drv.run_chunks(one_shot_drv.new_seq(tokens), [29])
    drv = PagedDriver(t, block_size=4, seed=3)
    chunked = drv.run_chunks(drv.new_seq(tokens), chunks)
    assert_close(chunked, one_shot, f"chunks {chunks} vs one shot")
    assert_close(chunked, t.hf_logits(tokens), f"chunks {chunks} vs transformers")


def test_chunked_prefill_next_to_other_work(tiny):
    """Chunks of one prompt interleaved with another prompt's chunks and a third sequence's decodes."""
    t = tiny(2, True)
    drv = PagedDriver(t, block_size=4)
    x_tokens, y_tokens, z_tokens = _tokens(25, 40), _tokens(17, 41), _tokens(12, 42)
    x, y, z = drv.new_seq(x_tokens), drv.new_seq(y_tokens), drv.new_seq(z_tokens)
    got = {id(s): [] for s in (x, y, z)}
    plan = [[(z, 8)], [(x, 9), (y, 6), (z, 1)], [(y, 11), (z, 1), (x, 7)], [(x, 9), (z, 1)], [(z, 1)]]
    for work in plan:
        for (s, _), out in zip(work, drv.step(work)):
            got[id(s)].append(out)
    for s, tokens in ((x, x_tokens), (y, y_tokens), (z, z_tokens)):
        assert_close(torch.cat(got[id(s)]), t.hf_logits(tokens), f"{len(tokens)}-token sequence")


# ---------------------------------------------------------------- 4. Llama 3 rope scaling


@pytest.mark.parametrize("kv_heads", [4, 2], ids=["mha", "gqa"])
def test_llama3_rope_scaling_matches_transformers(tiny, kv_heads):
    t = tiny(kv_heads, False, LLAMA3_ROPE)
    assert t.cfg.rope_scaling is not None and t.cfg.rope_scaling["rope_type"] == "llama3"
    assert t.cfg.rope_scaling["factor"] == 8.0 and t.cfg.rope_scaling["original_max_position_embeddings"] == 64
    tokens = _tokens(150, 50)  # well past the original 64 positions
    drv = PagedDriver(t, block_size=4)
    seq = drv.new_seq(tokens)
    logits = drv.run_chunks(seq, [100, 37] + [1] * 13)  # prefill, a chunk, decodes at positions 137..149
    ref = t.hf_logits(tokens)
    assert_close(logits, ref, "llama3 rope")
    # the scaling matters: the same weights without it give different logits
    unscaled = tiny(kv_heads, False, None)
    for (name, w), (_, w0) in zip(t.hf.named_parameters(), unscaled.hf.named_parameters()):
        assert torch.equal(w, w0), name
    assert not torch.allclose(unscaled.hf_logits(tokens)[64:], ref[64:], atol=1e-2)


# ---------------------------------------------------------------- 5. the whole engine, greedy


def _engine_generate(t: Tiny, prompts: list[list[int]], max_tokens: int, **engine_kwargs) -> tuple[dict, EngineCore]:
    core = EngineCore(EngineConfig(dtype="float32", device="cpu", **engine_kwargs), t.model, t.cfg)
    for i, p in enumerate(prompts):
        core.add_request(
            EngineRequest(
                f"req{i}",
                list(p),
                SamplingParams(temperature=0.0, max_tokens=max_tokens),
                eos_token_ids=tuple(t.cfg.eos_token_ids),
            )
        )
    results = {f"req{i}": [] for i in range(len(prompts))}
    finish = {}
    for _ in range(1000):
        if not core.has_work:
            break
        for out in core.step():
            assert out.request_id not in finish, "output after finish"
            results[out.request_id].extend(out.new_token_ids)
            if out.finish_reason is not None:
                finish[out.request_id] = out.finish_reason
        core.block_manager.check_integrity()
    assert not core.has_work and set(finish) == set(results)
    return results, core


def _hf_generate(t: Tiny, prompt: list[int], max_tokens: int) -> list[int]:
    with torch.no_grad():
        out = t.hf.generate(
            torch.tensor([prompt]),
            do_sample=False,
            max_new_tokens=max_tokens,
            eos_token_id=t.cfg.eos_token_ids,
            pad_token_id=0,
            output_logits=True,
            return_dict_in_generate=True,
        )
    # precondition: no near-ties, so float rounding cannot flip a greedy choice
    top2 = torch.cat(out.logits).topk(2, dim=-1).values
    assert float((top2[:, 0] - top2[:, 1]).min()) > 10 * ATOL, "reference has a near-tie: pick another seed"
    return out.sequences[0, len(prompt) :].tolist()


_hf_greedy_cache: dict = {}


def hf_greedy(t: Tiny, prompt: list[int], max_tokens: int) -> list[int]:
    """_hf_generate computed once per model, prompt and length (the model is kept with its entry, so its id is
    never reused while the entry lives)."""
    key = (id(t.hf), tuple(prompt), max_tokens)
    if key not in _hf_greedy_cache:
        _hf_greedy_cache[key] = (t.hf, _hf_generate(t, prompt, max_tokens))
    return _hf_greedy_cache[key][1]


def greedy(max_tokens: int, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, **kw)


@pytest.mark.parametrize(
    "engine_kwargs,expect_preemption",
    [
        (dict(block_size=4, max_num_batched_tokens=16), False),  # chunked prefill mixed with decodes
        (dict(block_size=4, max_num_batched_tokens=2048), False),  # all prompts in one step
        (dict(block_size=4, max_num_batched_tokens=16, max_num_seqs=3), True),  # tight memory: recomputation
    ],
    ids=["chunked", "one-shot", "preempting"],
)
def test_engine_greedy_matches_transformers_generate(tiny, engine_kwargs, expect_preemption):
    t = tiny(2, False)
    shared = _tokens(9, 60)
    # The last two share a 2-block prefix. With a 16-token budget the third is admitted once the second has
    # computed those blocks: the prefix cache serves 8 of its 9 tokens, and its last prompt token runs as a
    # one-token query in the same step as the second prompt's final chunk (so the batch must put it first).
    prompts = [_tokens(21, 61), shared + _tokens(5, 62), shared]
    max_tokens = 20
    per_block = kv_bytes_per_block(t.cfg, engine_kwargs["block_size"], torch.float32)
    # roomy: 64 blocks; tight: 12 blocks (48 tokens) for three sequences that grow to 41 + 34 + 29 tokens
    blocks = 12 if expect_preemption else 64
    results, core = _engine_generate(t, prompts, max_tokens, kv_cache_memory=blocks * per_block, **engine_kwargs)
    assert core.block_manager.num_blocks == blocks
    if engine_kwargs["max_num_batched_tokens"] == 16:  # the third prompt reused the second one's blocks
        hits = core.scheduler.prefix_hit_tokens  # (recomputation after preemption may reuse more)
        assert hits >= 8 if expect_preemption else hits == 8
    if expect_preemption:
        assert core.scheduler.num_preemptions > 0
    else:
        assert core.scheduler.num_preemptions == 0
    for i, p in enumerate(prompts):
        expected = _hf_generate(t, p, max_tokens)
        assert results[f"req{i}"] == expected, f"prompt {i}: petrel {results[f'req{i}']} != transformers {expected}"
