"""DeepSeek-V2 / V3's architecture facts, read from a Hugging Face config or llama.cpp's `deepseek2` GGUF metadata and
checked: a ValueError names the field petrel cannot run. Returns ModelConfig's keyword arguments (config.py builds
it), so this module imports nothing of petrel's.

What the fields mean (petrel/model/deepseek.py, petrel/model/mla.py):
  attention  multi-head latent attention: q through a q_lora_rank latent (None: one projection, V2-Lite), keys and
             values decompressed from a kv_lora_rank latent per token, a qk_rope_head_dim rotary key shared by every
             head; the KV cache holds the latent and the rotary key (petrel/model/kv_layout.py);
  router     V2: softmax scores, the top-k ("greedy") or the top-k within the topk_group groups of best single
             expert ("group_limited_greedy"); V3: sigmoid scores, e_score_correction_bias added for choosing only,
             the groups scored by the sum of their top-2 ("noaux_tc"); weights from the unbiased scores,
             renormalised with norm_topk_prob, times routed_scaling_factor (V2's reference code renormalises
             instead of scaling: its scaling factor is then 1);
  MLP        shared experts (n_shared_experts x moe_intermediate_size wide, ungated) beside the routed ones; the
             first first_k_dense_replace layers (and those off moe_layer_freq) dense;
  rotary     on qk_rope_head_dim, consecutive pairs in the checkpoint (rope_interleave), YaRN-scaled in V3 / V2.
"""

from __future__ import annotations

DEEPSEEK_ARCHITECTURES = ("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM")
TOPK_METHODS = ("greedy", "group_limited_greedy", "noaux_tc")
SCORING_FUNCS = ("softmax", "sigmoid")
ROPE_TYPES = ("default", "yarn", "linear")
# llama.cpp's expert_gating_func values
GGUF_GATING = {1: "softmax", 2: "sigmoid"}


def _positive(value, field: str, where: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{where}: {field} {value!r} is not a positive integer")
    return value


def check_router(where: str, experts: int, top_k, scoring, method, n_group, topk_group, keys: dict) -> None:
    """The router's fields fit together (keys: each field's name where it was read, for the message)."""
    _positive(experts, keys["experts"], where)
    if not isinstance(top_k, int) or not 1 <= top_k <= experts:
        raise ValueError(f"{where}: {keys['top_k']} {top_k!r} must be between 1 and {keys['experts']} ({experts})")
    if scoring not in SCORING_FUNCS:
        raise ValueError(f"{where}: {keys['scoring']} {scoring!r} is not supported (supported: softmax, sigmoid)")
    if method not in TOPK_METHODS:
        raise ValueError(f"{where}: topk_method {method!r} is not supported (supported: {', '.join(TOPK_METHODS)})")
    _positive(n_group, keys["n_group"], where)
    if experts % n_group:
        raise ValueError(f"{where}: {keys['n_group']} {n_group} does not divide the {experts} experts into groups")
    if not isinstance(topk_group, int) or not 1 <= topk_group <= n_group:
        raise ValueError(f"{where}: {keys['topk_group']} {topk_group!r} must be between 1 and {keys['n_group']}")
    if method != "greedy" and top_k > topk_group * (experts // n_group):
        raise ValueError(
            f"{where}: {keys['top_k']} {top_k} is more than the {topk_group} chosen groups of "
            f"{experts // n_group} experts hold"
        )
    if method == "noaux_tc" and n_group > 1 and experts // n_group < 2:
        raise ValueError(
            f"{where}: {keys['n_group']} {n_group} leaves groups of one expert; noaux_tc scores a group by its top 2"
        )


def _check_rope(where: str, scaling: dict | None, rope_dim: int) -> None:
    if rope_dim % 2:
        raise ValueError(f"{where}: qk_rope_head_dim {rope_dim} must be even")
    scaling = scaling or {}
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind not in ROPE_TYPES:
        raise ValueError(f"{where}: rope_scaling type {kind!r} is not supported (supported: {', '.join(ROPE_TYPES)})")
    if kind in ("yarn", "linear") and not (isinstance(scaling.get("factor"), (int, float)) and scaling["factor"] > 0):
        raise ValueError(f"{where}: rope_scaling factor {scaling.get('factor')!r} must be a positive number")
    if kind == "yarn" and not isinstance(scaling.get("original_max_position_embeddings"), int):
        raise ValueError(f"{where}: rope_scaling original_max_position_embeddings must be given for yarn")


def dense_layers(layers: int, first_dense: int, freq: int = 1) -> list[int]:
    """The layers that keep a dense MLP: the first first_dense, and those off every freq-th (DeepSeek's rule: a layer
    is sparse when index >= first_k_dense_replace and index % moe_layer_freq == 0)."""
    return [i for i in range(layers) if i < first_dense or i % freq]


def from_hf(architecture: str, cfg: dict, rope_theta: float, rope_scaling: dict | None) -> dict:
    """ModelConfig's fields of a DeepseekV2ForCausalLM / DeepseekV3ForCausalLM config (rope_theta and rope_scaling as
    config.py read them from either rope layout)."""
    where = architecture
    v3 = architecture == "DeepseekV3ForCausalLM"
    act = cfg.get("hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"{where}: hidden_act {act!r} is not supported (supported: silu)")
    heads = _positive(cfg.get("num_attention_heads"), "num_attention_heads", where)
    layers = _positive(cfg.get("num_hidden_layers"), "num_hidden_layers", where)
    rank = _positive(cfg.get("kv_lora_rank"), "kv_lora_rank", where)
    q_rank = cfg.get("q_lora_rank")
    if q_rank is not None:
        _positive(q_rank, "q_lora_rank", where)
    nope = _positive(cfg.get("qk_nope_head_dim"), "qk_nope_head_dim", where)
    rope = _positive(cfg.get("qk_rope_head_dim"), "qk_rope_head_dim", where)
    v_dim = _positive(cfg.get("v_head_dim"), "v_head_dim", where)
    _check_rope(where, rope_scaling, rope)
    experts = cfg.get("n_routed_experts")
    moe: dict = {}
    if experts is not None:
        scoring = cfg.get("scoring_func", "sigmoid" if v3 else "softmax")
        method = cfg.get("topk_method", "noaux_tc" if v3 else "greedy")
        n_group = cfg.get("n_group") or 1
        topk_group = cfg.get("topk_group") or 1
        top_k = cfg.get("num_experts_per_tok")
        keys = dict(
            experts="n_routed_experts",
            top_k="num_experts_per_tok",
            scoring="scoring_func",
            n_group="n_group",
            topk_group="topk_group",
        )
        check_router(where, experts, top_k, scoring, method, n_group, topk_group, keys)
        if method == "greedy":
            n_group = topk_group = 1
        norm = bool(cfg.get("norm_topk_prob", False))
        scale = float(cfg.get("routed_scaling_factor", 1.0))
        if not v3 and norm:  # DeepSeek-V2's reference router: renormalised weights are not scaled
            scale = 1.0
        first = cfg.get("first_k_dense_replace") or 0
        freq = cfg.get("moe_layer_freq", 1) or 1
        if not isinstance(first, int) or first < 0:
            raise ValueError(f"{where}: first_k_dense_replace {first!r} is not a layer count")
        _positive(freq, "moe_layer_freq", where)
        inter = _positive(cfg.get("moe_intermediate_size"), "moe_intermediate_size", where)
        shared = cfg.get("n_shared_experts") or 0
        if not isinstance(shared, int) or shared < 0:
            raise ValueError(f"{where}: n_shared_experts {shared!r} is not a count of experts")
        moe = dict(
            num_experts=experts,
            num_experts_per_tok=top_k,
            moe_intermediate_size=inter,
            norm_topk_prob=norm,
            shared_expert_intermediate_size=inter * shared,
            dense_layers=dense_layers(layers, first, freq),
            scoring_func=scoring,
            topk_method=method,
            n_group=n_group,
            topk_group=topk_group,
            routed_scaling_factor=scale,
        )
    quant = cfg.get("quantization_config")
    if quant is not None and quant.get("quant_method") != "fp8":
        raise ValueError(
            f"{where}: quantization_config quant_method {quant.get('quant_method')!r} is not supported "
            f"(supported: fp8 blocks, dequantized at load)"
        )
    return dict(
        num_attention_heads=heads,
        num_key_value_heads=heads,  # MLA: every head has its own keys and values, decompressed from one latent
        head_dim=nope + rope,
        kv_lora_rank=rank,
        q_lora_rank=q_rank or 0,
        qk_nope_head_dim=nope,
        qk_rope_head_dim=rope,
        v_head_dim=v_dim,
        rope_interleave=bool(cfg.get("rope_interleave", True)) if v3 else True,
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
        attention_bias=bool(cfg.get("attention_bias", False)),
        mlp_bias=False,
        **moe,
    )


def from_gguf(get, names: set[str]) -> dict:
    """ModelConfig's fields of a llama.cpp `deepseek2` GGUF: get(key) reads `deepseek2.<key>`; names are the file's
    tensor names (whether queries go through a latent, the score-correction bias). Both of the converter's layouts:
    MLA written as one KV head of kv_lora_rank + rope (attention.key_length_mla / value_length_mla give the heads'
    dimensions; attn_k_b and attn_v_b), or the older one with attn_kv_b and the heads' own key_length."""
    where = "GGUF deepseek2"
    heads = _positive(get("attention.head_count"), "deepseek2.attention.head_count", where)
    layers = _positive(get("block_count"), "deepseek2.block_count", where)
    rank = _positive(get("attention.kv_lora_rank"), "deepseek2.attention.kv_lora_rank", where)
    rope = _positive(get("rope.dimension_count"), "deepseek2.rope.dimension_count", where)
    if get("attention.key_length_mla") is not None:
        qk_head = _positive(get("attention.key_length_mla"), "deepseek2.attention.key_length_mla", where)
        v_dim = _positive(get("attention.value_length_mla"), "deepseek2.attention.value_length_mla", where)
    else:
        qk_head = _positive(get("attention.key_length"), "deepseek2.attention.key_length", where)
        v_dim = _positive(get("attention.value_length"), "deepseek2.attention.value_length", where)
    nope = qk_head - rope
    if nope < 1:
        raise ValueError(f"{where}: key length {qk_head} leaves no room beside the rotary dimension {rope}")
    scaling = None
    kind = get("rope.scaling.type")
    if kind == "yarn":
        log_mul = float(get("rope.scaling.yarn_log_multiplier", 0.0) or 0.0)
        mscale_all_dim = log_mul / 0.1  # the converter writes 0.1 * mscale_all_dim
        scaling = {
            "rope_type": "yarn",
            "factor": float(get("rope.scaling.factor")),
            "original_max_position_embeddings": get("rope.scaling.original_context_length"),
            "beta_fast": float(get("rope.scaling.yarn_beta_fast", 32.0)),
            "beta_slow": float(get("rope.scaling.yarn_beta_slow", 1.0)),
            # DeepSeek's mscale equals its mscale_all_dim: rotary values unscaled, the softmax scale by mscale^2
            "mscale": mscale_all_dim,
            "mscale_all_dim": mscale_all_dim,
        }
        attn_factor = get("rope.scaling.yarn_attn_factor")
        if attn_factor is not None:
            scaling["attention_factor"] = float(attn_factor)
    elif kind == "linear":
        scaling = {"rope_type": "linear", "factor": float(get("rope.scaling.factor"))}
    elif kind not in (None, "none"):
        raise ValueError(f"{where}: rope.scaling.type {kind!r} is not supported (supported: yarn, linear)")
    _check_rope(where, scaling, rope)
    moe: dict = {}
    experts = get("expert_count")
    if experts:
        top_k = get("expert_used_count")
        gating = get("expert_gating_func", 1)
        scoring = GGUF_GATING.get(gating, gating)
        n_group, topk_group = get("expert_group_count") or 1, get("expert_group_used_count") or 1
        biased = any(n.endswith((".exp_probs_b.bias", ".exp_probs_b")) for n in names)
        method = "noaux_tc" if biased else ("group_limited_greedy" if n_group > 1 else "greedy")
        keys = dict(
            experts="deepseek2.expert_count",
            top_k="deepseek2.expert_used_count",
            scoring="deepseek2.expert_gating_func",
            n_group="deepseek2.expert_group_count",
            topk_group="deepseek2.expert_group_used_count",
        )
        check_router(where, experts, top_k, scoring, method, n_group, topk_group, keys)
        inter = _positive(get("expert_feed_forward_length"), "deepseek2.expert_feed_forward_length", where)
        shared = get("expert_shared_count", 0) or 0
        first = get("leading_dense_block_count", 0) or 0
        moe = dict(
            num_experts=experts,
            num_experts_per_tok=top_k,
            moe_intermediate_size=inter,
            norm_topk_prob=bool(get("expert_weights_norm", False)),
            shared_expert_intermediate_size=inter * shared,
            dense_layers=dense_layers(layers, first),
            scoring_func=scoring,
            topk_method=method,
            n_group=n_group if method != "greedy" else 1,
            topk_group=topk_group if method != "greedy" else 1,
            routed_scaling_factor=float(get("expert_weights_scale", 1.0) or 1.0),
        )
    q_rank = get("attention.q_lora_rank") or 0
    if not q_rank and "blk.0.attn_q_a.weight" in names:
        raise ValueError(f"{where}: attn_q_a tensors without attention.q_lora_rank")
    return dict(
        num_attention_heads=heads,
        num_key_value_heads=heads,
        head_dim=qk_head,
        kv_lora_rank=rank,
        q_lora_rank=q_rank,
        qk_nope_head_dim=nope,
        qk_rope_head_dim=rope,
        v_head_dim=v_dim,
        rope_interleave=True,  # llama.cpp's deepseek2 rotates consecutive pairs, the checkpoint's layout
        rope_scaling=scaling,
        **moe,
    )
