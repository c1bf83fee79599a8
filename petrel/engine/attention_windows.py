"""Attention windows and sinks asked for by the engine's options, on any model (TensorRT-LLM's KvCacheConfig
max_attention_window and sink_token_length). No model weights change; only which keys each layer's queries see.

max_attention_window: one window per layer, the list repeated over the layers when shorter (TensorRT-LLM's rule:
[4096, 256] on a 4-layer model is 4096, 256, 4096, 256). A window at least as long as the longest sequence the
engine serves (max_model_len, else the model's context) is no limit: that layer stays global. A layer the model
already windows (Mistral, Gemma 3's local layers) keeps the smaller of the two.

sink_token_length S (StreamingLLM's attention sinks): every windowed layer's query also sees the first S positions
of the sequence. A layer of window W then sees the first S positions and its last W - S (W keys in all, as
TensorRT-LLM counts them), so S must be below every window. Positions are the text's own (the rotary embedding is
not shifted into the cache's positions), which is what an explicit attention mask over the whole sequence gives.

The model's layers get the recent part (W - S) as their `sliding_window` and S as `attention_sinks`
(petrel/model/attention.py masks with both); the model config's `sliding_windows` becomes the recent parts, so
the KV groups (petrel/engine/kv_groups.py) and the block manager give back the blocks behind them, keeping the
sink blocks (the first ceil(S / block_size) of a windowed table).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class AttentionWindows:
    windows: list[int | None]  # per layer: the recent keys a query sees (None: every key)
    sinks: int  # the first positions every windowed layer's queries also see (0: none)


def check_window_options(max_attention_window, sink_token_length) -> None:
    """ValueError naming the option for a malformed value (the model is not needed for these)."""
    if max_attention_window is not None:
        if not isinstance(max_attention_window, (list, tuple)) or not max_attention_window:
            raise ValueError(f"max_attention_window must be a non-empty list of windows, got {max_attention_window!r}")
        for w in max_attention_window:
            if isinstance(w, bool) or not isinstance(w, int) or w < 1:
                raise ValueError(f"max_attention_window entries must be integers >= 1, got {max_attention_window!r}")
    if sink_token_length is not None and (
        isinstance(sink_token_length, bool) or not isinstance(sink_token_length, int) or sink_token_length < 0
    ):
        raise ValueError(f"sink_token_length must be an integer >= 0, got {sink_token_length!r}")


def attention_windows(model_config, max_attention_window, sink_token_length, max_model_len: int | None):
    """Each layer's window and the sinks, from the model's own windows and the options (ValueError naming the
    option when they cannot go together)."""
    check_window_options(max_attention_window, sink_token_length)
    if getattr(model_config, "kv_lora_rank", 0) and (max_attention_window or sink_token_length):
        raise ValueError(
            f"max_attention_window and sink_token_length: {model_config.architecture}'s latent attention attends "
            f"every key (no window)"
        )
    layers = model_config.num_hidden_layers
    longest = max_model_len or model_config.max_position_embeddings
    own = list(model_config.sliding_windows) or [None] * layers
    windows = []
    for layer in range(layers):
        asked = max_attention_window[layer % len(max_attention_window)] if max_attention_window else None
        if asked is not None and asked >= longest:
            asked = None  # no shorter than every sequence: no limit
        limits = [w for w in (own[layer], asked) if w is not None]
        windows.append(min(limits) if limits else None)
    sinks = sink_token_length or 0
    if sinks:
        limited = [w for w in windows if w is not None]
        if not limited:
            raise ValueError(
                "sink_token_length needs a limited attention window (max_attention_window below the longest "
                f"sequence, {longest} tokens, or a model with sliding-window layers): every layer sees every key"
            )
        if sinks >= min(limited):
            raise ValueError(
                f"sink_token_length {sinks} must be below every attention window (the smallest is {min(limited)}): "
                "a window counts its sink tokens"
            )
        windows = [None if w is None else w - sinks for w in windows]
    return AttentionWindows(windows, sinks)


def apply_attention_windows(model, model_config, config) -> None:
    """Give the model's layers (and its config) the windows and sinks EngineConfig asks for; nothing when it asks
    for none. Every tensor-parallel rank calls this alike after loading its shard."""
    if config.max_attention_window is None and not config.sink_token_length:
        return
    plan = attention_windows(model_config, config.max_attention_window, config.sink_token_length, config.max_model_len)
    model_config.sliding_windows = list(plan.windows) if any(w is not None for w in plan.windows) else []
    model_config.attention_sinks = plan.sinks
    for layer, window in zip(model.model.layers, plan.windows):
        layer.self_attn.sliding_window = window
        layer.self_attn.attention_sinks = plan.sinks if window is not None else 0
