"""Weights kept quantized (EngineConfig.quantization): GGUF block readers against the gguf package's dequantizer,
QuantizedLinear against the dequantized product (AVX2 kernels and the torch fallback, few rows and many), int8 and
LoRA on the tiny Llama against transformers, and the real default model's greedy tokens, GGUF blocks kept vs
dequantized."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from test_int8_gemm import rounded_rows

from petrel import LLM, LoRARequest, SamplingParams
from petrel.config import EngineConfig
from petrel.model import gemm_kernels, quant_kernels, quantization
from petrel.model.gguf_quants import READERS
from petrel.model.quantization import GEMV_MAX_ROWS, QuantizedLinear, QuantizedWeight

gguf = pytest.importorskip("gguf")

F16_FIELDS = {"Q4_1": (0, 2), "Q5_1": (0, 2), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}


def random_blocks(type_name: str, rows: int, cols: int, seed: int = 0) -> np.ndarray:
    """Random GGUF blocks of a [rows, cols] tensor, their float16 scales set to modest values."""
    _, elems, size, _, _ = READERS[type_name]
    rng = np.random.default_rng(seed)
    n = rows * cols // elems
    blocks = rng.integers(0, 256, (n, size), dtype=np.uint8)
    if type_name == "MXFP4":  # an E8M0 exponent byte, scales 2^-10 .. 2^-4 (random bytes reach 2^128)
        blocks[:, 0] = rng.integers(117, 124, n)
        return blocks.reshape(rows, -1)
    for offset in F16_FIELDS.get(type_name, (0,)):
        blocks[:, offset : offset + 2] = rng.uniform(1e-3, 2e-2, (n, 1)).astype(np.float16).view(np.uint8)
    return blocks.reshape(rows, -1)


def reference(type_name: str, raw: np.ndarray, rows: int, cols: int) -> torch.Tensor:
    qtype = gguf.GGMLQuantizationType[type_name]
    return torch.from_numpy(gguf.quants.dequantize(raw, qtype).reshape(rows, cols).astype(np.float32))


@pytest.mark.parametrize("type_name", sorted(READERS))
def test_block_reader_equals_gguf_dequantize(type_name):
    raw = random_blocks(type_name, 6, 512)
    weight = QuantizedWeight.from_gguf(type_name, raw, 6, 512)
    assert torch.equal(weight.dequantize(), reference(type_name, raw, 6, 512))
    rows = torch.tensor([5, 0, 5])
    assert torch.equal(weight.dequantize(rows), reference(type_name, raw, 6, 512)[rows])


@pytest.fixture(params=["kernels", "kernels-floats", "torch"])
def backend(request, monkeypatch):
    """The kernels (integer products from INT8_MIN_ROWS rows), the kernels' float products only
    (PETREL_INT8_COMPUTE=0), or torch alone."""
    if request.param == "torch":
        monkeypatch.setattr(quant_kernels, "library", lambda: None)
        return "torch"
    if quant_kernels.library() is None:
        pytest.skip("the AVX2 kernels cannot run here (no AVX2/FMA or no C compiler)")
    if request.param == "kernels-floats":
        monkeypatch.setenv("PETREL_INT8_COMPUTE", "0")
    return "kernels"


def rounded_activations(x: torch.Tensor) -> torch.Tensor:
    """x as quant_kernels.c's few-row products see it: per 32 values, round(x / d) * d with d = max|x| / 32767."""
    blocks = x.reshape(-1, 32)
    d = blocks.abs().amax(dim=1, keepdim=True) / 32767
    inverse = torch.where(d > 0, 1 / d, torch.zeros_like(d))
    return (torch.round(blocks * inverse).double() * d.double()).reshape(x.shape)


def rounded_groups_of_32(x: torch.Tensor) -> torch.Tensor:
    """x as group_gemm_q8.c rounds it (4-bit codes; 8-bit ones on AVX-512 VNNI), float64: per 32 values
    round(x * (127 / max|x|)) (float32, half to even) times max|x| / 127."""
    blocks = x.reshape(-1, 32)
    top = blocks.abs().amax(dim=1, keepdim=True)
    most = torch.full_like(top, 127)
    inverse = torch.where(top > 0, most / top, torch.zeros_like(top))
    return (torch.round(blocks * inverse).double() * (top / most).double()).reshape(x.shape)


@pytest.mark.parametrize("rows", [1, 3, 7, 40, 300])  # few-row kernel; integers, or float tiles, torch GEMM
@pytest.mark.parametrize("fmt", [*sorted(READERS), "int8"])
def test_quantized_linear_matches_dequantized_product(fmt, rows, backend):
    """QuantizedLinear computes the dequantized weight's product: exactly (up to float summation order) on the torch
    path and from GEMV_MAX_ROWS rows in floats; the kernels' few-row products round the activations to int16 per 32
    first and keep the exact sums for the weights' mins; from INT8_MIN_ROWS rows (unless PETREL_INT8_COMPUTE=0)
    each row of x is rounded to 16-bit integers (int8_gemm.c, group_gemm.c: at K = 512 both keep all 16 bits), or
    for 4-bit codes, and on AVX-512 VNNI 8-bit ones in groups of 32 or more, each 32 values to 8-bit ones
    (group_gemm_q8.c)."""
    from test_group_gemm import eight_bit_activations

    out_features, in_features = 160, 512
    if fmt == "int8":
        dense = torch.randn(out_features, in_features, generator=torch.Generator().manual_seed(1))
        weight = QuantizedWeight.int8_per_channel(dense)
        w = weight.dequantize()
        assert (w - dense).abs().max() <= dense.abs().amax(dim=1).max() / 254 + 1e-6  # half a step at most
    else:
        raw = random_blocks(fmt, out_features, in_features)
        weight = QuantizedWeight.from_gguf(fmt, raw, out_features, in_features)
        w = reference(fmt, raw, out_features, in_features)
    bias = torch.randn(out_features)
    layer = QuantizedLinear(weight, bias)
    x = torch.randn(rows, in_features, generator=torch.Generator().manual_seed(rows))
    exact = x.double() @ w.double().t() + bias.double()
    expected, rounding_cost = exact, torch.full_like(exact, 1e-4 * exact.abs().max().item())
    if backend == "kernels" and rows <= GEMV_MAX_ROWS:
        mins = weight.mins if weight.mins is not None else torch.zeros_like(weight.scale)
        w_mins = mins.double().repeat_interleave(weight.group_size, dim=1)
        expected = rounded_activations(x) @ (w.double() - w_mins).t() + x.double() @ w_mins.t() + bias.double()
    elif backend == "kernels" and 0 < weight.integer_rows <= rows and eight_bit_activations(weight):
        expected = rounded_groups_of_32(x) @ w.double().t() + bias.double()
        half_steps = (x.reshape(-1, 32).abs().amax(dim=1, keepdim=True) / 254).expand(-1, 32).reshape(x.shape)
        rounding_cost = half_steps.double() @ w.double().abs().t() + 1e-5 * exact.abs().max().item()  # per element
    elif backend == "kernels" and 0 < weight.integer_rows <= rows:
        codes, scales = rounded_rows(x)
        expected = (codes * scales) @ w.double().t() + bias.double()
    got = layer(x)
    assert got.shape == (rows, out_features) and got.dtype == torch.float32 and got.is_contiguous()
    scale = exact.abs().max().item()
    assert (got.double() - expected).abs().max().item() <= 1e-5 * scale + 1e-5
    assert ((got.double() - exact).abs() <= rounding_cost).all()  # what rounding the activations costs
    assert layer(x.bfloat16()).dtype == torch.bfloat16


def test_mixed_formats_fuse_exactly():
    """A fused projection whose shards came in different formats (Q4_K + Q6_K + Q8_0, as in Q4_K_M files) is held
    as 8-bit codes in the smallest group; its weights equal the shards' own."""
    parts = [
        QuantizedWeight.from_gguf(t, random_blocks(t, 32, 256, seed=i), 32, 256)
        for i, t in enumerate(["Q4_K", "Q6_K", "Q8_0"])
    ]
    fused = QuantizedWeight.concat(parts)
    assert fused.bits == 8 and fused.group_size == 16 and fused.shape == (96, 256)
    assert torch.equal(fused.dequantize(), torch.cat([p.dequantize() for p in parts]))
    same = QuantizedWeight.concat([parts[0], parts[0]])
    assert same.bits == 4 and same.shape == (64, 256)


def test_quantization_option_is_validated(tiny):
    with pytest.raises(ValueError, match="quantization"):
        EngineConfig(quantization="int4")
    from petrel.model.loader import load_model, resolve_model

    with pytest.raises(ValueError, match="quantization 'gguf'"):
        load_model(resolve_model(tiny(2, False).path), torch.float32, "cpu", "gguf")


def _int8_reference(hf):
    """transformers' model with every projection, head and embedding replaced by its int8 per-row dequantization."""
    ref = copy.deepcopy(hf)
    with torch.no_grad():
        for module in ref.modules():
            if isinstance(module, (torch.nn.Linear, torch.nn.Embedding)):
                module.weight.copy_(QuantizedWeight.int8_per_channel(module.weight).dequantize())
    return ref


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_int8_logits_and_lora_match_transformers_on_dequantized_weights(tiny, tmp_path, tied, monkeypatch):
    """quantization='int8' (a LoRA adapter on top too) gives the logits of transformers run on the int8-dequantized
    weights (and peft's adapter merged into them). Every product here takes the exact path (dequantized tiles): the
    few-row and integer kernels' rounding of the activations is what test_quantized_linear_matches_dequantized_product
    and test_int8_gemm check."""
    monkeypatch.setattr(quantization, "GEMV_MAX_ROWS", 0)
    monkeypatch.setenv("PETREL_INT8_COMPUTE", "0")
    from test_lora import hf_greedy, make_adapter, prompt

    from petrel.model.loader import resolve_model
    from petrel.model.tokenizer import load_tokenizer

    t = tiny(2, tied)
    ref = _int8_reference(t.hf)
    merged = make_adapter(ref, tmp_path / "adapter", seed=3)
    load_tokenizer(resolve_model(None)).save_pretrained(tmp_path / "tok")
    llm = LLM(t.path, tokenizer=str(tmp_path / "tok"), kv_cache_memory=1 << 20, quantization="int8", enable_lora=True)
    try:
        model = llm.engine.core.runner.model
        assert isinstance(model.model.layers[0].mlp.down_proj.base, QuantizedLinear)
        assert (model.lm_head.qweight is model.model.embed_tokens.qweight) == tied
        params = SamplingParams(
            temperature=0, max_tokens=5, ignore_eos=True, return_context_logits=True, return_generation_logits=True
        )
        ids = prompt(4)
        for lora, oracle in ((None, ref), (LoRARequest("a", 1, str(tmp_path / "adapter")), merged)):
            out = llm.generate(ids, params, use_tqdm=False, lora_request=lora)
            tokens = out.outputs[0].token_ids
            with torch.no_grad():
                expected = oracle(torch.tensor([ids + tokens])).logits[0].float()
            torch.testing.assert_close(out.context_logits, expected[: len(ids)], atol=1e-3, rtol=1e-3)
            torch.testing.assert_close(
                out.outputs[0].generation_logits,
                expected[len(ids) - 1 : len(ids) + len(tokens) - 1],
                atol=1e-3,
                rtol=1e-3,
            )
        prompts = [prompt(10 + i, 5 + i) for i in range(16)]  # decode batches past the GEMV's row limit
        outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == [hf_greedy(ref, p, 4) for p in prompts]
    finally:
        llm.shutdown()


def _bf16_reference(hf):
    """transformers' float32 model with every projection, head and embedding rounded to bfloat16."""
    ref = copy.deepcopy(hf)
    with torch.no_grad():
        for module in ref.modules():
            if isinstance(module, (torch.nn.Linear, torch.nn.Embedding)):
                module.weight.copy_(module.weight.bfloat16().float())
    return ref


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_bf16_dtype_on_cpu_matches_transformers_on_rounded_weights(tiny, tmp_path, tied, monkeypatch):
    """dtype='bfloat16' on the CPU holds the projections, head and embedding in bfloat16 with float32 activations
    (quantization 'bf16'); with a float32 KV cache asked for, the logits are transformers' in float32 on the weights
    rounded to bfloat16 (the kernels widen each weight exactly), through the decoder stack's kernel, the few-row
    products and the GEMM."""
    from test_lora import hf_greedy, prompt

    from petrel.model import dense_kernels
    from petrel.model.loader import resolve_model
    from petrel.model.tokenizer import load_tokenizer

    monkeypatch.setenv(
        "PETREL_BF16_ACTIVATIONS", "0"
    )  # exact: x rounded to bfloat16 is the e2e test's and the kernels'
    t = tiny(2, tied)
    ref = _bf16_reference(t.hf)
    load_tokenizer(resolve_model(None)).save_pretrained(tmp_path / "tok")
    llm = LLM(
        t.path, tokenizer=str(tmp_path / "tok"), kv_cache_memory=1 << 20, dtype="bfloat16", kv_cache_dtype="float32"
    )
    try:
        assert (llm.engine.config.dtype, llm.engine.config.quantization) == ("float32", "bf16")
        model = llm.engine.core.runner.model
        down = model.model.layers[0].mlp.down_proj
        assert isinstance(down, QuantizedLinear) and down.qweight.codes.dtype == torch.bfloat16
        assert (model.lm_head.qweight is model.model.embed_tokens.qweight) == tied
        stacks = []
        build = dense_kernels.DecoderStack.build
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(dense_kernels.DecoderStack, "build", lambda *a: stacks.append(build(*a)) or stacks[-1])
            params = SamplingParams(
                temperature=0, max_tokens=5, ignore_eos=True, return_context_logits=True, return_generation_logits=True
            )
            ids = prompt(4)
            out = llm.generate(ids, params, use_tqdm=False)
        assert stacks and all(s is not None for s in stacks)  # the decode steps ran the one-call stack
        tokens = out.outputs[0].token_ids
        with torch.no_grad():
            expected = ref(torch.tensor([ids + tokens])).logits[0].float()
        torch.testing.assert_close(out.context_logits, expected[: len(ids)], atol=1e-3, rtol=1e-3)
        torch.testing.assert_close(
            out.outputs[0].generation_logits, expected[len(ids) - 1 : len(ids) + len(tokens) - 1], atol=1e-3, rtol=1e-3
        )
        prompts = [prompt(10 + i, 15 + i) for i in range(16)]  # a prefill past the few-row limit: the GEMM
        outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == [hf_greedy(ref, p, 4) for p in prompts]
    finally:
        llm.shutdown()


def test_bf16_dtype_keeps_a_bfloat16_cache_of_twice_the_blocks(tiny, tmp_path):
    """dtype 'bfloat16' on the CPU holds its KV cache in bfloat16 (kv_cache_dtype 'auto'): the same kv_cache_memory
    holds twice the blocks of a float32 cache; requests run through it and give every block back."""
    from petrel.model.loader import resolve_model
    from petrel.model.tokenizer import load_tokenizer

    t = tiny(2, False)
    load_tokenizer(resolve_model(None)).save_pretrained(tmp_path / "tok")
    blocks = {}
    for kv_dtype in ("float32", "auto"):
        llm = LLM(
            t.path, tokenizer=str(tmp_path / "tok"), kv_cache_memory=1 << 20, dtype="bfloat16", kv_cache_dtype=kv_dtype
        )
        try:
            core = llm.engine.core
            blocks[str(core.runner.cache_tensors[0].dtype)] = core.block_manager.num_blocks
            prompts = [[5 + i, 17, 200 + i, 42] * (3 + i) for i in range(6)]
            params = SamplingParams(temperature=0, max_tokens=9, ignore_eos=True)
            outs = llm.generate(prompts, params, use_tqdm=False)
            assert [len(o.outputs[0].token_ids) for o in outs] == [9] * 6
            assert core.block_manager.num_free_blocks == core.block_manager.num_blocks
        finally:
            llm.shutdown()
    assert blocks["torch.bfloat16"] == 2 * blocks["torch.float32"], blocks


def test_bf16_dtype_becomes_bf16_weights_only_on_one_cpu_process():
    """On the CPU (one process) dtype 'bfloat16' means float32 activations beside a bfloat16 KV cache, the weights
    held in bfloat16 unless another quantization holds them; it keeps its meaning on CUDA and over tensor-parallel
    ranks (whose weights are not held quantized); quantization 'bf16' may also be asked for by name."""
    bf16 = EngineConfig(dtype="bfloat16")
    assert (bf16.dtype, bf16.quantization, bf16.kv_cache_dtype) == ("float32", "bf16", "bfloat16")
    assert bf16.kv_cache_torch_dtype == torch.bfloat16
    int8 = EngineConfig(dtype="bfloat16", quantization="int8")
    assert (int8.dtype, int8.quantization, int8.kv_cache_dtype) == ("float32", "int8", "bfloat16")
    for kwargs in ({"device": "cuda"}, {"tensor_parallel_size": 2}):
        config = EngineConfig(dtype="bfloat16", **kwargs)
        assert config.dtype == "bfloat16" and config.quantization is None, kwargs
        assert config.kv_cache_dtype == "bfloat16", kwargs
    assert EngineConfig(quantization="bf16").dtype == "float32"
    assert EngineConfig(quantization="bf16").kv_cache_dtype == "float32"  # asked for by name: the cache as dtype's


@pytest.mark.e2e
@pytest.mark.parametrize("rounding", ["weights", "default", "tiles"])
def test_default_model_bf16_agrees_with_transformers_on_rounded_weights(hf_model, rounding, monkeypatch):
    """The default model at dtype 'bfloat16', 32 prompts at once (a prefill past the few-row kernels, decode steps of
    32 rows). With float32 activations (PETREL_BF16_ACTIVATIONS=0) and a float32 KV cache the greedy continuations
    and their logits are transformers' on the weights rounded to bfloat16. As dtype 'bfloat16' runs by default (a
    bfloat16 KV cache; where the CPU has AVX512_BF16, x rounded to bfloat16 in the products too) they drift, bounded
    (measured on Zen 4, the projections in panels, the attention's queries and weights rounded to bfloat16 too: 379
    of 384 steps keep the top token, its logprob moving by 0.008 on average, 0.043 at most;
    with only the cache rounded, PETREL_BF16_ACTIVATIONS=0: 383 of 384, 0.004, 0.035; with the products of 32 rows
    and more through oneDNN, PETREL_AMX=force (petrel/model/amx.py: its outputs rounded to bfloat16 too): 379 of 384,
    0.010, 0.10)."""
    from test_lora import hf_greedy

    from petrel.model import amx

    options = {}
    if rounding == "weights":
        monkeypatch.setenv("PETREL_BF16_ACTIVATIONS", "0")
        options["kv_cache_dtype"] = "float32"
    if rounding == "tiles":
        if not amx.onednn_runs_bf16():
            pytest.skip("this torch's oneDNN runs no bfloat16 products here")
        monkeypatch.setenv("PETREL_AMX", "force")
    ref = _bf16_reference(hf_model)
    llm = LLM(dtype="bfloat16", kv_cache_memory=64 << 20, **options)
    try:
        model = llm.engine.core.runner.model  # the projections and the tied embedding in panels where x is rounded
        for qweight in (model.model.layers[0].mlp.down_proj.qweight, model.model.embed_tokens.qweight):
            assert qweight.panels == (rounding != "weights" and gemm_kernels.bf16_panels())
        assert rounding != "tiles" or model.model.layers[0].mlp.down_proj.qweight.tiles is not None
        tok = llm.tokenizer
        prompts = [tok.encode(f"{p} ({i})") for i in range(4) for p in PROMPTS]
        params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, return_generation_logits=True)
        outs = llm.generate(prompts, params, use_tqdm=False)
        steps = agree = 0
        drift = []
        for ids, out in zip(prompts, outs):
            tokens, got = list(out.outputs[0].token_ids), out.outputs[0].generation_logits
            with torch.no_grad():
                expected = ref(torch.tensor([ids + tokens])).logits[0].float()[len(ids) - 1 : -1]
            if rounding == "weights":
                assert tokens == hf_greedy(ref, ids, 12)
                torch.testing.assert_close(got, expected, atol=2e-3, rtol=1e-3)
            top = expected.argmax(-1, keepdim=True)
            steps, agree = steps + len(top), agree + int((got.argmax(-1, keepdim=True) == top).sum())
            drift.append((got.log_softmax(-1).gather(1, top) - expected.log_softmax(-1).gather(1, top)).abs())
        drift = torch.cat(drift)
        assert agree >= 0.97 * steps and drift.mean() < 0.02 and drift.max() < 0.2, (agree, steps, drift.max())
    finally:
        llm.shutdown()


PROMPTS = [
    "The capital of France is",
    "Write a short poem about the sea.",
    "def fibonacci(n):",
    "Explain photosynthesis in simple terms.",
    "List three colors:",
    "Once upon a time,",
    "The quick brown fox",
    "What is 12 times 7?",
]


def dequantized_logits(llm, out) -> torch.Tensor:
    """The logits the dequantized engine `llm` gives at each of out's generated positions, fed the same tokens (one
    prefill of the whole text)."""
    prompt, tokens = list(out.prompt_token_ids), list(out.outputs[0].token_ids)
    params = SamplingParams(max_tokens=1, return_context_logits=True)
    return llm.generate([prompt + tokens[:-1]], params, use_tqdm=False)[0].context_logits[len(prompt) - 1 :]


@pytest.mark.e2e
def test_default_model_gguf_blocks_agree_with_dequantized(llm, monkeypatch):
    """The default model (Q4_1 projections, Q8_0 embedding and tied head) with its blocks kept: at every step of 8
    greedy generations x 64 tokens, its logits are those of the dequantized engine given the same tokens (which
    computes exactly: one prefill of the whole text), up to the activations' rounding in the few-row kernels (and
    to 16 bits a row in the prompts' integer products; 8-bit ones: the test below)."""
    monkeypatch.setenv("PETREL_Q4_ACTIVATIONS", "16")
    monkeypatch.setenv("PETREL_INT8_ACTIVATIONS", "16")  # the Q8_0 head's too
    params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True, return_generation_logits=True)
    quantized = LLM(quantization="gguf")
    try:
        model = quantized.engine.core.runner.model
        kinds = {m.qweight.kind for m in model.modules() if isinstance(m, QuantizedLinear)}
        assert kinds == {"Q4_1", "Q8_0"}
        outs = quantized.generate(PROMPTS, params, use_tqdm=False)
    finally:
        quantized.shutdown()
    agree, worst = 0, 0.0
    for out in outs:
        exact, native = dequantized_logits(llm, out), out.outputs[0].generation_logits
        assert native.shape == exact.shape == (64, model.config.vocab_size)
        agree += int((native.argmax(-1) == exact.argmax(-1)).sum())
        worst = max(
            worst,
            (native.log_softmax(-1) - exact.log_softmax(-1))
            .gather(1, exact.argmax(-1, keepdim=True))
            .abs()
            .max()
            .item(),
        )
    print(
        f"gguf-native vs dequantized: top-1 agreement {agree}/{64 * len(PROMPTS)}, "
        f"largest logprob change of the exact top token {worst:.3f}"
    )
    assert agree >= 0.99 * 64 * len(PROMPTS)  # measured: 512 / 512, 0.002
    assert worst < 0.05


MORE_PROMPTS = [
    "The largest planet in the solar system is",
    "import numpy as np\n",
    "Give me a recipe for pancakes.",
    "Translate 'good morning' into French:",
    "A haiku about autumn:",
    "Why is the sky blue?",
    "1, 2, 3, 4,",
    "Dear customer,",
]


@pytest.mark.e2e
@pytest.mark.parametrize("activations", [8, 16], ids=["a8", "a16"])
def test_default_model_gguf_integer_products_agree_with_dequantized(llm, activations, monkeypatch):
    """16 greedy generations x 32 tokens with the default model's blocks kept: every product of 13 rows and more
    (each step's prompts, then the 16 decodes) in integers, 4-bit codes (and, on AVX-512 VNNI, the Q8_0 head's 8-bit
    ones) times activations rounded to `activations` bits (8: one scale a group of 32, as llama.cpp's Q8 blocks; 16:
    one a row), against the dequantized engine given the same tokens. The rounding moves some near-ties: measured
    top-1 agreement a8 497-501/512, a16 512/512; the exact top token's logprob change, mean and largest, a8
    0.034-0.036 and 0.28-0.37, a16 0.0008 and 0.007."""
    from petrel.model import quant_kernels

    if quant_kernels.library() is None:
        pytest.skip("the kernels cannot run here")
    monkeypatch.setenv("PETREL_Q4_ACTIVATIONS", str(activations))
    monkeypatch.setenv("PETREL_INT8_ACTIVATIONS", str(activations))
    calls = []
    kernel = quant_kernels.group_gemm
    monkeypatch.setattr(quant_kernels, "group_gemm", lambda *a: calls.append(a[2].shape[0]) or kernel(*a))
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True, return_generation_logits=True)
    quantized = LLM(quantization="gguf")
    try:
        outs = quantized.generate(PROMPTS + MORE_PROMPTS, params, use_tqdm=False)
    finally:
        quantized.shutdown()
    assert calls and min(calls) >= 13  # the prompts' products (Python); the decodes' call group_gemm from C
    assert_integer_products_close(
        f"gguf ({activations}-bit activations)", outs, [dequantized_logits(llm, o) for o in outs], activations
    )


def assert_integer_products_close(what: str, outs, exacts: list[torch.Tensor], activations: int) -> None:
    """The generated positions' logits against the exact ones: top-1 agreement of 95% (8-bit activations) or 99%
    (16-bit), and the exact top token's logprob changing by less than 0.06 or 0.005 on average."""
    agree, changes = 0, []
    for out, exact in zip(outs, exacts):
        native = out.outputs[0].generation_logits
        agree += int((native.argmax(-1) == exact.argmax(-1)).sum())
        best = exact.argmax(-1, keepdim=True)
        changes.append((native.log_softmax(-1) - exact.log_softmax(-1)).gather(1, best).abs().squeeze(1))
    change = torch.cat(changes)
    print(
        f"{what} integer products vs dequantized: top-1 agreement {agree}/{change.numel()}, exact top token's "
        f"logprob change mean {change.mean():.4f}, largest {change.max():.3f}"
    )
    assert agree >= (0.95 if activations == 8 else 0.99) * change.numel()
    assert change.mean() < (0.06 if activations == 8 else 0.005)


@pytest.mark.e2e
@pytest.mark.parametrize("activations", [8, 16], ids=["a8", "a16"])
def test_default_model_int8_integer_products_agree_with_dequantized(activations, monkeypatch):
    """quantization='int8' on the default model, 16 greedy generations x 32 tokens: every product of 13 rows and
    more (the prompts, then the 16 decodes through decode_layers) in integers, x rounded to `activations` bits (8:
    one scale a group of 32 and the codes offset to unsigned bytes, AVX-512 VNNI's default, group_gemm_q8.c; 16:
    one a row, int8_gemm.c), against the same engine's float products of the dequantized weights
    (PETREL_INT8_COMPUTE=0) given the same tokens. Measured: top-1 agreement a8 498/512, a16 511/512; the exact top
    token's logprob change, mean and largest, a8 0.035 and 0.30 (as GGUF Q4_1's 8-bit activations: 0.036, 0.28),
    a16 0.0019 and 0.015."""
    from petrel.model import quant_kernels

    if quant_kernels.library() is None:
        pytest.skip("the kernels cannot run here")
    monkeypatch.setenv("PETREL_INT8_ACTIVATIONS", str(activations))
    if quant_kernels.int8_activation_bits() != activations:
        pytest.skip("8-bit activations for 8-bit codes need AVX-512 VNNI")
    calls = []
    kernel = quant_kernels.int8_gemm
    monkeypatch.setattr(quant_kernels, "int8_gemm", lambda *a: calls.append(a[1].shape[0]) or kernel(*a))
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True, return_generation_logits=True)
    quantized = LLM(quantization="int8")
    try:
        outs = quantized.generate(PROMPTS + MORE_PROMPTS, params, use_tqdm=False)
        assert calls and min(calls) >= 13  # the prompts' products (Python); the decodes' call int8_gemm from C
        monkeypatch.setenv("PETREL_INT8_COMPUTE", "0")
        calls.clear()
        exacts = [dequantized_logits(quantized, out) for out in outs]
        assert not calls
    finally:
        quantized.shutdown()
    assert_integer_products_close(f"int8 ({activations}-bit activations)", outs, exacts, activations)
