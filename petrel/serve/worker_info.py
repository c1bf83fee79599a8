"""What a gateway learns about a worker (the smg gateway reads these over HTTP and gRPC): the model, the server,
and the engine's load (running / waiting sequences, KV-cache usage), read inside the engine loop."""

from __future__ import annotations

import time

import petrel

BACKEND = "petrel"


def engine_load(core) -> dict:
    """The load numbers, taken in the engine loop (engine.call(engine_load)). token_usage counts the blocks
    requests hold (cached, evictable blocks are free to take)."""
    bm, sched = core.block_manager, core.scheduler
    block_size = bm.block_size
    queried, hits = sched.prefix_queried_tokens, sched.prefix_hit_tokens
    return {
        "num_running_reqs": len(sched.running),
        "num_waiting_reqs": len(sched.waiting),
        "num_used_tokens": bm.num_used_blocks * block_size,
        "max_total_num_tokens": bm.num_blocks * block_size,
        "token_usage": bm.num_used_blocks / bm.num_blocks if bm.num_blocks else 0.0,
        "cache_hit_rate": hits / queried if queried else 0.0,
    }


def model_info(llm, served_name: str) -> dict:
    cfg = llm.engine.model_config
    return {
        "model_path": getattr(llm.config, "model", None) or served_name,
        "served_model_name": served_name,
        "max_model_len": llm.engine.max_model_len,
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "num_layers": cfg.num_hidden_layers,
        "num_heads": cfg.num_attention_heads,
        "is_generation": True,
        "has_image_understanding": llm.engine.mm_processor is not None,  # takes image_url parts (the chat page asks)
    }


def server_info(llm, served_name: str) -> dict:
    config = llm.config
    return {
        "version": petrel.__version__,
        "backend": BACKEND,
        "served_model_name": served_name,
        "tp_size": config.tensor_parallel_size,
        "pp_size": 1,
        "max_num_seqs": config.max_num_seqs,
        "max_model_len": llm.engine.max_model_len,
        "block_size": llm.engine.core.block_manager.block_size,
        "dtype": str(config.dtype),
        "kv_cache_dtype": str(config.kv_cache_dtype),
        "kv_bytes_per_token": llm.engine.kv_bytes_per_token,  # over every layer (a latent cache's: less)
        "kv_transfer_role": config.kv_transfer_role,
    }


def loads_response(load: dict, max_running: int) -> dict:
    """GET /v1/loads: one scheduler's load in the shape the gateway parses (WorkerLoadResponse)."""
    snapshot = dict(load, dp_rank=0, max_running_requests=max_running)
    snapshot["num_total_reqs"] = load["num_running_reqs"] + load["num_waiting_reqs"]
    snapshot["utilization"] = load["token_usage"]
    snapshot["gen_throughput"] = 0.0
    return {
        "timestamp": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "dp_rank_count": 1,
        "loads": [snapshot],
    }
