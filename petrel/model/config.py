"""The architecture facts petrel needs about a model, read from a Hugging Face config or GGUF metadata."""

from __future__ import annotations

from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field

from petrel.model import deepseek_config
from petrel.model.deepseek_config import DEEPSEEK_ARCHITECTURES

# GGUF `general.architecture` -> the Hugging Face architecture it holds (the same metadata keys for each)
GGUF_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "gemma3": "Gemma3ForCausalLM",
    "qwen2moe": "Qwen2MoeForCausalLM",
    "qwen3moe": "Qwen3MoeForCausalLM",
    "gpt-oss": "GptOssForCausalLM",
    "deepseek2": "DeepseekV2ForCausalLM",  # V3 too: llama.cpp writes both as deepseek2 (DeepseekV2 runs either)
}
GGUF_GATING_SOFTMAX = 1  # llama.cpp's expert_gating_func values: 1 softmax, 2 sigmoid, 3 softmax over the top-k
GGUF_GATING_SOFTMAX_TOPK = 3

# mixture-of-experts families (petrel/model/moe.py) -> the config key of their expert count
MOE_ARCHITECTURES = {
    "MixtralForCausalLM": "num_local_experts",
    "Qwen2MoeForCausalLM": "num_experts",
    "Qwen3MoeForCausalLM": "num_experts",
    "GptOssForCausalLM": "num_local_experts",
}


@dataclass
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # bias on q, k, v and o projections (Llama's flag)
    qkv_bias: bool = False  # bias on q, k, v only (Qwen2)
    qk_norm: bool = False  # RMS norm over each head of q and k, before rotary (Qwen3)
    mlp_bias: bool = False
    sliding_windows: list[int | None] = field(default_factory=list)  # per layer: keys a query sees, None = all
    attention_sinks: int = 0  # the first positions every windowed layer also sees (petrel/engine/attention_windows.py)
    # a learned logit per query head that joins each softmax over the keys and is dropped from the output, so a head
    # may attend to nothing (gpt-oss's "sinks"; not attention_sinks above, StreamingLLM's kept first positions)
    sink_logits: bool = False
    rope_local_theta: float | None = None  # rotary base of the sliding-window layers (Gemma 3); None = rope_theta
    query_pre_attn_scalar: float | None = None  # attention scale is this ** -0.5 (Gemma); None = head_dim
    final_logit_softcapping: float | None = None  # logits = cap * tanh(logits / cap) (Gemma)
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    mrope_section: list[int] | None = None  # multimodal rotary (Qwen2-VL): head_dim / 2 frequencies per t/h/w stream
    # mixture of experts (petrel/model/moe.py; num_experts 0: a dense model): each token's MLP is the weighted sum
    # of num_experts_per_tok experts of moe_intermediate_size picked by a softmax router (the top-k probabilities
    # renormalised to sum 1 with norm_topk_prob), plus, with shared_expert_intermediate_size, an expert every token
    # takes, scaled by sigmoid(shared_expert_gate(x)); the layers in dense_layers keep a dense MLP of
    # intermediate_size instead
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    shared_expert_intermediate_size: int = 0
    dense_layers: list[int] = field(default_factory=list)
    # gpt-oss's experts: a bias on the router's logits; routing "softmax_topk" (a softmax over every expert, then the
    # top k) or "topk_softmax" (the top k logits, then a softmax over those k); biases on each expert's gate/up and
    # down products; the activation "silu" (silu(gate) * up) or "swiglu_clamped" ((clamp(up, -limit, limit) + 1) *
    # g * sigmoid(swiglu_alpha * g), g = min(gate, swiglu_limit))
    router_bias: bool = False
    routing: str = "softmax_topk"
    expert_bias: bool = False
    expert_activation: str = "silu"
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    # DeepSeek-V2 / V3 (petrel/model/deepseek_config.py says what each field means): multi-head latent attention
    # (kv_lora_rank 0: ordinary heads) and the grouped, scaled router (the others: softmax, greedy, unscaled)
    kv_lora_rank: int = 0
    q_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    rope_interleave: bool = False  # rotary on consecutive pairs in the checkpoint's rows (petrel de-interleaves them)
    scoring_func: str = "softmax"
    topk_method: str = "greedy"
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    # a vision-language model's whole Hugging Face config (the fields above are its text_config's); None: text only
    multimodal_config: dict | None = field(default=None, repr=False)

    @classmethod
    def from_hf_config(cls, cfg: dict) -> ModelConfig:
        if isinstance(cfg.get("text_config"), dict):  # a vision-language model (Idefics3, SmolVLM)
            text = dict(cfg["text_config"], architectures=cfg.get("architectures"))
            for key in ("tie_word_embeddings", "eos_token_id"):  # the top level's, when it has them
                if key in cfg:
                    text[key] = cfg[key]
            out = cls.from_hf_config(text)
            out.multimodal_config = cfg
            return out
        archs = cfg.get("architectures") or []
        architecture = archs[0] if archs else cfg.get("model_type", "?")
        heads = cfg["num_attention_heads"]
        eos = cfg.get("eos_token_id")
        rope_scaling = cfg.get("rope_scaling")
        rope_theta = cfg.get("rope_theta")
        rope_params = cfg.get("rope_parameters")  # newer transformers layout
        gemma = architecture == "Gemma3ForCausalLM"
        local_theta = None
        if gemma:
            rope_theta, rope_scaling, local_theta = _gemma3_rope(cfg)
            rope_params = None
            _check_gemma3(cfg)
        if rope_params:
            rope_theta = rope_params.get("rope_theta", rope_theta)
            if rope_params.get("rope_type", "default") != "default":
                rope_scaling = rope_params
        qwen_vl = architecture in ("Qwen2VLForConditionalGeneration", "Qwen2_5_VLForConditionalGeneration")
        mrope = (rope_scaling or {}).get("mrope_section") or (rope_params or {}).get("mrope_section")
        if mrope and (rope_scaling or {}).get("rope_type", (rope_scaling or {}).get("type")) in ("mrope", "default"):
            rope_scaling = None  # M-RoPE over plain frequencies (the published configs say type "mrope" or "default")
        partial = (rope_params or {}).get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0))
        if partial != 1.0:
            raise ValueError(f"partial rotary embedding (partial_rotary_factor {partial}) is not supported")
        if architecture in DEEPSEEK_ARCHITECTURES:
            return cls._deepseek(architecture, cfg, rope_theta or 10000.0, rope_scaling)
        moe = _hf_moe(architecture, cfg) if architecture in MOE_ARCHITECTURES else {}
        moe_qkv_bias = moe.pop("qkv_bias", False)
        gpt_oss = architecture == "GptOssForCausalLM"
        return cls(
            architecture=architecture,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_hidden_layers=cfg["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=rope_theta or 10000.0,
            rope_scaling=rope_scaling,
            tie_word_embeddings=cfg.get("tie_word_embeddings", gemma),  # Gemma's config default is tied
            attention_bias=cfg.get("attention_bias", gpt_oss),  # gpt-oss's config default is True
            # Qwen2 always has them (the config does not say); Qwen2-MoE's config says (qkv_bias, default true)
            qkv_bias=architecture == "Qwen2ForCausalLM" or qwen_vl or moe_qkv_bias,
            qk_norm=architecture in ("Qwen3ForCausalLM", "Gemma3ForCausalLM", "Qwen3MoeForCausalLM"),
            mlp_bias=cfg.get("mlp_bias", False),
            sliding_windows=_gemma3_sliding_windows(cfg) if gemma else _sliding_windows(cfg),
            sink_logits=gpt_oss,
            rope_local_theta=local_theta,
            query_pre_attn_scalar=cfg.get("query_pre_attn_scalar", 256) if gemma else None,
            final_logit_softcapping=cfg.get("final_logit_softcapping") if gemma else None,
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=[eos] if isinstance(eos, int) else list(eos or []),
            mrope_section=list(mrope) if mrope else None,
            multimodal_config=cfg if qwen_vl else None,  # the published Qwen2-VL configs are flat (no text_config)
            **moe,
        )

    @classmethod
    def _deepseek(cls, architecture: str, cfg: dict, rope_theta: float, rope_scaling: dict | None) -> ModelConfig:
        eos = cfg.get("eos_token_id")
        return cls(
            architecture=architecture,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_hidden_layers=cfg["num_hidden_layers"],
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            tie_word_embeddings=cfg.get("tie_word_embeddings", False),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=[eos] if isinstance(eos, int) else list(eos or []),
            **deepseek_config.from_hf(architecture, cfg, rope_theta, rope_scaling),
        )

    @classmethod
    def _deepseek_gguf(cls, meta: dict, get, has_output_tensor: bool, tensor_names: AbstractSet[str]) -> ModelConfig:
        fields = deepseek_config.from_gguf(get, set(tensor_names))
        eos = meta.get("tokenizer.ggml.eos_token_id")
        v3 = fields.get("topk_method") == "noaux_tc"
        return cls(
            architecture="DeepseekV3ForCausalLM" if v3 else "DeepseekV2ForCausalLM",
            vocab_size=get("vocab_size") or len(meta["tokenizer.ggml.tokens"]),
            hidden_size=get("embedding_length"),
            intermediate_size=get("feed_forward_length"),
            num_hidden_layers=get("block_count"),
            max_position_embeddings=get("context_length", 2048),
            rms_norm_eps=get("attention.layer_norm_rms_epsilon", 1e-6),
            rope_theta=get("rope.freq_base", 10000.0),
            tie_word_embeddings=not has_output_tensor,
            bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
            eos_token_ids=[eos] if eos is not None else [],
            **fields,
        )

    @property
    def latent_attention(self) -> bool:
        """Multi-head latent attention (DeepSeek): the KV cache holds a latent and a rotary key per token."""
        return self.kv_lora_rank > 0

    def is_moe_layer(self, layer: int) -> bool:
        """Whether this layer's MLP is a mixture of experts (petrel/model/moe.py)."""
        return self.num_experts > 0 and layer not in self.dense_layers

    def sliding_window(self, layer: int) -> int | None:
        return self.sliding_windows[layer] if self.sliding_windows else None

    @property
    def uniform_sliding_window(self) -> int | None:
        """The window when every layer slides with the same one (Mistral, Phi-3, Qwen2 with every layer sliding),
        else None. Only then can one block table serve every layer and give back the blocks behind the window: mixed
        layers (Gemma 3, Qwen2 with max_window_layers) get a table per group of layers (petrel/engine/kv_groups.py)."""
        windows = self.sliding_windows
        if windows and windows[0] is not None and all(w == windows[0] for w in windows):
            return windows[0]
        return None

    @classmethod
    def from_gguf_metadata(
        cls, meta: dict, has_output_tensor: bool, tensor_names: AbstractSet[str] = frozenset()
    ) -> ModelConfig:
        """tensor_names: the file's tensors (a deepseek2 file's say whether queries go through a latent and whether
        the router has a score-correction bias)."""
        arch = meta["general.architecture"]
        if arch not in GGUF_ARCHITECTURES:
            raise ValueError(
                f"GGUF architecture {arch!r} is not supported (supported: {', '.join(GGUF_ARCHITECTURES)})"
            )

        def get(key, default=None):
            return meta.get(f"{arch}.{key}", default)

        heads = get("attention.head_count")
        hidden = get("embedding_length")
        gpt_oss = arch == "gpt-oss"
        scaling = None
        if get("rope.scaling.type") == "linear":
            scaling = {"rope_type": "linear", "factor": get("rope.scaling.factor")}
        if get("rope.scaling.type") == "yarn":
            scaling = {
                "rope_type": "yarn",
                "factor": get("rope.scaling.factor"),
                "original_max_position_embeddings": get("rope.scaling.original_context_length"),
                "beta_fast": get("rope.scaling.yarn_beta_fast") or 32.0,
                "beta_slow": get("rope.scaling.yarn_beta_slow") or 1.0,
                "truncate": not gpt_oss,  # gpt-oss's own YaRN keeps the ramp's bounds fractional
            }
        eos = meta.get("tokenizer.ggml.eos_token_id")
        architecture = GGUF_ARCHITECTURES[arch]
        if arch == "deepseek2":
            return cls._deepseek_gguf(meta, get, has_output_tensor, tensor_names)
        if arch == "llama" and get("expert_count"):  # llama.cpp writes Mixtral as a llama with experts
            architecture = "MixtralForCausalLM"
        moe = _gguf_moe(arch, architecture, get) if architecture in MOE_ARCHITECTURES else {}
        gemma = architecture == "Gemma3ForCausalLM"
        head_dim = get("attention.key_length") or hidden // heads
        layers = get("block_count")
        windows: list[int | None] = []
        if gemma and get("attn_logit_softcapping") is not None:
            raise ValueError(
                f"attention logit soft-capping (attn_logit_softcapping {get('attn_logit_softcapping')}) "
                f"is not supported"
            )
        if gpt_oss:  # llama.cpp's rule for gpt-oss: the even layers slide, the odd ones see everything
            windows = [get("attention.sliding_window") if i % 2 == 0 else None for i in range(layers)]
        if gemma:  # every 6th layer global unless the file says otherwise (llama.cpp's default for gemma3)
            pattern = get("attention.sliding_window_pattern", 6)
            window = get("attention.sliding_window")
            if isinstance(pattern, list):  # per layer, True = sliding
                windows = [window if sliding else None for sliding in pattern]
            else:
                windows = _gemma3_sliding_windows(
                    {"sliding_window": window, "num_hidden_layers": layers, "sliding_window_pattern": pattern}
                )
        return cls(
            architecture=architecture,
            vocab_size=get("vocab_size") or len(meta["tokenizer.ggml.tokens"]),
            hidden_size=hidden,
            intermediate_size=get("feed_forward_length"),
            num_hidden_layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=get("attention.head_count_kv", heads),
            head_dim=head_dim,
            max_position_embeddings=get("context_length", 2048),
            rms_norm_eps=get("attention.layer_norm_rms_epsilon", 1e-6),
            rope_theta=get("rope.freq_base", 10000.0),
            rope_scaling=scaling,
            tie_word_embeddings=not has_output_tensor,
            attention_bias=gpt_oss,
            sink_logits=gpt_oss,
            qkv_bias=architecture in ("Qwen2ForCausalLM", "Qwen2MoeForCausalLM"),  # load_model_config checks
            qk_norm=architecture in ("Qwen3ForCausalLM", "Gemma3ForCausalLM", "Qwen3MoeForCausalLM"),
            sliding_windows=windows,
            rope_local_theta=10_000.0 if gemma else None,
            # llama.cpp's rule: hidden / heads for the 62-layer 27B, head_dim for the others
            query_pre_attn_scalar=(hidden // heads if layers == 62 else head_dim) if gemma else None,
            final_logit_softcapping=get("final_logit_softcapping") if gemma else None,
            bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
            eos_token_ids=[eos] if eos is not None else [],
            **moe,
        )


def _gguf_moe(arch: str, architecture: str, get) -> dict:
    """The mixture-of-experts fields of a GGUF's metadata (llama.cpp's keys, under the architecture's prefix),
    checked; which layers are dense the tensors say (loader.load_model_config). Routing weights are renormalised
    as llama.cpp does for each architecture (Mixtral and Qwen3-MoE yes, Qwen2-MoE no) unless expert_weights_norm
    says."""
    experts, top_k = get("expert_count"), get("expert_used_count")
    if not isinstance(experts, int) or experts < 1:
        raise ValueError(f"GGUF {arch}.expert_count {experts!r} is not a positive number of experts")
    if not isinstance(top_k, int) or not 1 <= top_k <= experts:
        raise ValueError(f"GGUF {arch}.expert_used_count {top_k!r} must be between 1 and expert_count ({experts})")
    gpt_oss = architecture == "GptOssForCausalLM"
    gating = get("expert_gating_func", GGUF_GATING_SOFTMAX_TOPK if gpt_oss else GGUF_GATING_SOFTMAX)
    if gating != (GGUF_GATING_SOFTMAX_TOPK if gpt_oss else GGUF_GATING_SOFTMAX):
        supported = "3, softmax over the top k" if gpt_oss else "1, softmax"
        raise ValueError(f"GGUF {arch}.expert_gating_func {gating!r} is not supported (supported: {supported})")
    shared_count = get("expert_shared_count", 1 if get("expert_shared_feed_forward_length") else 0)
    if shared_count not in (0, 1):
        raise ValueError(f"GGUF {arch}.expert_shared_count {shared_count!r} is not supported (supported: 0 or 1)")
    for key in ("expert_weights_scale", "expert_group_count"):
        if get(key) not in (None, 0, 1, 1.0):
            raise ValueError(f"GGUF {arch}.{key} {get(key)!r} is not supported")
    out = dict(
        num_experts=experts,
        num_experts_per_tok=top_k,
        moe_intermediate_size=get("expert_feed_forward_length") or get("feed_forward_length"),
        norm_topk_prob=bool(get("expert_weights_norm", architecture != "Qwen2MoeForCausalLM")),
        shared_expert_intermediate_size=(get("expert_shared_feed_forward_length") or 0) if shared_count else 0,
    )
    if gpt_oss:  # what llama.cpp's gpt-oss graph does, whatever the metadata says (alpha 1.702, limit 7)
        out.update(router_bias=True, routing="topk_softmax", expert_bias=True, expert_activation="swiglu_clamped")
    return out


def _hf_moe(architecture: str, cfg: dict) -> dict:
    """The mixture-of-experts fields of a Mixtral, Qwen2-MoE or Qwen3-MoE config (and Qwen2-MoE's qkv_bias), checked:
    a ValueError names the field petrel cannot run."""
    count_key = MOE_ARCHITECTURES[architecture]
    if count_key not in cfg:  # transformers 5 writes Qwen3-MoE's count as Mixtral's key
        count_key = next((k for k in ("num_experts", "num_local_experts") if k in cfg), count_key)
    experts, top_k = cfg.get(count_key), cfg.get("num_experts_per_tok")
    if not isinstance(experts, int) or experts < 1:
        raise ValueError(f"{architecture}: {count_key} {experts!r} is not a positive number of experts")
    if not isinstance(top_k, int) or not 1 <= top_k <= experts:
        raise ValueError(f"{architecture}: num_experts_per_tok {top_k!r} must be between 1 and {count_key} ({experts})")
    scoring = cfg.get("scoring_func", "softmax")
    if scoring != "softmax":
        raise ValueError(f"{architecture}: scoring_func {scoring!r} is not supported (supported: softmax)")
    act = cfg.get("hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"{architecture}: hidden_act {act!r} is not supported (supported: silu)")
    layers = cfg["num_hidden_layers"]
    if (
        architecture == "GptOssForCausalLM"
    ):  # every layer sparse, experts intermediate_size wide (petrel/model/gpt_oss.py)
        return dict(
            num_experts=experts,
            num_experts_per_tok=top_k,
            moe_intermediate_size=cfg["intermediate_size"],
            router_bias=True,
            routing="topk_softmax",
            expert_bias=True,
            expert_activation="swiglu_clamped",
            swiglu_alpha=float(cfg.get("swiglu_alpha", 1.702)),
            swiglu_limit=float(cfg.get("swiglu_limit", 7.0)),
        )
    if architecture == "MixtralForCausalLM":  # every layer sparse, its experts intermediate_size wide, renormalised
        return dict(
            num_experts=experts,
            num_experts_per_tok=top_k,
            moe_intermediate_size=cfg["intermediate_size"],
            norm_topk_prob=True,
        )
    step = cfg.get("decoder_sparse_step", 1) or 1
    only = cfg.get("mlp_only_layers") or []
    if not isinstance(step, int) or step < 1:
        raise ValueError(f"{architecture}: decoder_sparse_step {step!r} is not a positive integer")
    if any(not isinstance(i, int) or not 0 <= i < layers for i in only):
        raise ValueError(f"{architecture}: mlp_only_layers {only!r} names layers the model does not have")
    out = dict(
        num_experts=experts,
        num_experts_per_tok=top_k,
        moe_intermediate_size=cfg["moe_intermediate_size"],
        norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
        dense_layers=[i for i in range(layers) if i in only or (i + 1) % step],
    )
    if architecture == "Qwen2MoeForCausalLM":
        out["shared_expert_intermediate_size"] = cfg.get("shared_expert_intermediate_size") or 0
        out["qkv_bias"] = cfg.get("qkv_bias", True)
    return out


def _sliding_windows(cfg: dict) -> list[int | None]:
    """Each layer's attention window from a Hugging Face config: `sliding_window` (Mistral, Phi-3: every layer),
    gated by `use_sliding_window` and split by `layer_types` or `max_window_layers` (Qwen2, Qwen3)."""
    window, n = cfg.get("sliding_window"), cfg["num_hidden_layers"]
    if not window or cfg.get("use_sliding_window", True) is False:
        return []
    types = cfg.get("layer_types")
    if types is None and "max_window_layers" in cfg:
        types = ["sliding_attention" if i >= cfg["max_window_layers"] else "full_attention" for i in range(n)]
    if types is None:
        return [window] * n
    return [window if t == "sliding_attention" else None for t in types]


def _gemma3_rope(cfg: dict) -> tuple[float, dict | None, float]:
    """(global theta, global scaling, local theta) of a Gemma 3 config: transformers 5 writes `rope_parameters`
    per layer type; older configs hold rope_theta, rope_scaling (global layers) and rope_local_base_freq."""
    params = cfg.get("rope_parameters") or {}
    full = params.get("full_attention") or {}
    local = params.get("sliding_attention") or {}
    theta = full.get("rope_theta", cfg.get("rope_theta", 1_000_000.0))
    scaling = full if full.get("rope_type", "default") != "default" else cfg.get("rope_scaling")
    if local.get("rope_type", "default") != "default":
        raise ValueError(f"rope scaling on Gemma 3 sliding-window layers ({local}) is not supported")
    local_theta = local.get("rope_theta", cfg.get("rope_local_base_freq", 10_000.0))
    return theta, scaling, local_theta


def _check_gemma3(cfg: dict) -> None:
    if cfg.get("attn_logit_softcapping") is not None:
        raise ValueError(
            f"attention logit soft-capping (attn_logit_softcapping {cfg['attn_logit_softcapping']}) is not supported"
        )
    if cfg.get("use_bidirectional_attention"):
        raise ValueError("bidirectional attention (use_bidirectional_attention) is not supported")
    act = cfg.get("hidden_activation") or cfg.get("hidden_act") or "gelu_pytorch_tanh"
    if act not in ("gelu_pytorch_tanh", "gelu_tanh"):
        raise ValueError(f"Gemma 3 activation {act!r} is not supported (supported: gelu_pytorch_tanh)")


def _gemma3_sliding_windows(cfg: dict) -> list[int | None]:
    """Gemma 3: `layer_types`, or every `sliding_window_pattern`-th layer global (default 6), the rest windowed."""
    window, n = cfg.get("sliding_window") or 4096, cfg["num_hidden_layers"]
    types = cfg.get("layer_types")
    if types is None:
        pattern = cfg.get("sliding_window_pattern") or cfg.get("_sliding_window_pattern") or 6
        types = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(n)]
    return [window if t == "sliding_attention" else None for t in types]
