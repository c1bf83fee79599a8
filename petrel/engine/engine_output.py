"""What a step reports: one EngineOutput per sequence that moved (built only by `build_output`), and the step's
IterationStats. Plain data, so it could cross a process boundary."""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from petrel.engine.sampler import TokenLogprobs
from petrel.engine.sequence import EngineRequest, Sequence


@dataclass
class EngineOutput:
    """One sequence's result of one step, as the core reports it."""

    request_id: object
    index: int
    new_token_ids: list[int]
    new_logprobs: list[TokenLogprobs] | None = None
    prompt_logprobs: list[TokenLogprobs] | None = None  # for prompt positions 1.. (position 0 has none)
    finish_reason: str | None = None  # 'stop' | 'length' | 'abort'
    stop_reason: int | str | None = None
    abort_message: str | None = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    num_cached_tokens: int = 0
    timestamp: float = 0.0
    scheduled_time: float | None = None  # when the request was first scheduled (monotonic)
    cumulative_logprob: float | None = None  # beam search: the beam's sum of logprobs
    # beam search: new_token_ids (and logprobs, generation rows) are the output's whole tokens so far, replacing
    # what was reported for this index before (a streamed beam's tokens change as beams reorder)
    replaces: bool = False
    # other sequences: each sampled token's logprob (the last len(...) of new_token_ids), always reported; the
    # output processor sums them into the chunk's cumulative_logprob
    sampled_logprobs: list[float] | None = None
    context_logits: object = None  # [prompt_len, vocab] tensor, once, when asked for
    generation_logits: object = None  # [len(new_token_ids), vocab] tensor, when asked for
    additional_context_outputs: dict | None = None
    additional_generation_outputs: dict | None = None
    spec_verify_ct: int | None = None  # speculative decoding: verify rounds so far
    accept_draft_tokens: float | None = None  # accepted draft tokens per verify round, on the final output
    # a context-only request's hand-off (petrel/engine/pinned_prompts.py PromptHandoff: its first token and the
    # handle of its pinned prompt KV), on its output; the front reports it as DisaggregatedParams
    disaggregated_params: object = None
    kv_fetch: object = None  # the request's KVFetchStats so far (petrel/outputs.py), once it waited for a KV fetch


@dataclass
class IterationStats:
    iteration: int
    timestamp: float
    step_time: float
    num_running: int
    num_waiting: int
    num_preempted: int
    num_prompt_tokens: int  # prompt tokens computed this step
    num_generation_tokens: int  # tokens sampled this step
    kv_blocks_used: int
    kv_blocks_free: int
    kv_blocks_cached: int
    prefix_cache_hit_rate: float
    num_draft_tokens: int = 0  # speculative decoding: draft tokens verified this step
    num_accepted_tokens: int = 0  # and how many of them were accepted
    # vision-language models: images run through the vision encoder this step, images whose encoder output came
    # from the encoder cache, and the encoder's time (seconds; images given as embeddings count in neither)
    num_images_encoded: int = 0
    num_encoder_cache_hits: int = 0
    encoder_time: float = 0.0
    # lower KV tiers (kv_host_tier_bytes / kv_disk_tier_path): blocks brought back from them and stored into them
    # this step, and since start each tier's counters and the fetch time (KVTierIO.stats(); None without tiers)
    kv_tier_loaded_blocks: int = 0
    kv_tier_stored_blocks: int = 0
    kv_tiers: dict | None = None
    # mixtures of experts: tokens routed to each expert this step, {layer index: [tokens of expert 0, 1, ...]} over
    # the MoE layers (the step's forwards of the model, drafts of self-speculation included); None for dense models
    expert_load: dict[int, list[int]] | None = None


def step_stats(
    iteration: int,
    t0: float,
    batch,
    scheduler,
    block_manager,
    num_prompt_tokens: int,
    num_generated: int,
    num_draft: int,
    num_accepted: int,
    encoder: tuple[int, int, float] = (0, 0, 0.0),
    kv_tiers=None,
    expert_load: dict[int, list[int]] | None = None,
) -> IterationStats:
    """The stats of the step that started at t0 (time.monotonic()) and ran `batch`; encoder: the step's (images
    encoded, encoder-cache hits, encoder seconds)."""
    queried = scheduler.prefix_queried_tokens
    return IterationStats(
        iteration=iteration,
        timestamp=time.time(),
        step_time=time.monotonic() - t0,
        num_running=len(scheduler.running),
        num_waiting=len(scheduler.waiting),
        num_preempted=len(batch.preempted),
        num_prompt_tokens=num_prompt_tokens,
        num_generation_tokens=num_generated,
        kv_blocks_used=block_manager.num_used_blocks,
        kv_blocks_free=block_manager.num_free_blocks,
        kv_blocks_cached=block_manager.num_cached_blocks,
        prefix_cache_hit_rate=scheduler.prefix_hit_tokens / queried if queried else 0.0,
        num_draft_tokens=num_draft,
        num_accepted_tokens=num_accepted,
        num_images_encoded=encoder[0],
        num_encoder_cache_hits=encoder[1],
        encoder_time=encoder[2],
        kv_tier_loaded_blocks=kv_tiers.step_loaded if kv_tiers is not None else 0,
        kv_tier_stored_blocks=kv_tiers.step_stored if kv_tiers is not None else 0,
        kv_tiers=kv_tiers.stats() if kv_tiers is not None else None,
        expert_load=expert_load,
    )


def build_output(
    req: EngineRequest,
    index: int,
    new_token_ids: list[int],
    now: float,
    *,
    seq: Sequence | None = None,
    num_output_tokens: int | None = None,
    logprobs: list | None = None,
    finish_reason: str | None = None,
    stop_reason=None,
    generation: dict[str, list] | None = None,
    with_context: bool = False,
    **fields,
) -> EngineOutput:
    """Output `index` of `req`: new_token_ids with their logprobs (when asked for) and why it finished, if it did.

    seq: the sequence reported: its counts (num_output_tokens overrides its output count: a beam hypothesis) and,
    with_context, the prompt's outputs it gathered (they ride once, on the request's first output).
    generation: per new token, the rows of generation logits / hidden states the request asked for.
    fields: the other EngineOutput fields (abort_message, cumulative_logprob, sampled_logprobs,
    disaggregated_params)."""
    if num_output_tokens is None:
        num_output_tokens = seq.num_output_tokens if seq is not None else 0
    out = EngineOutput(
        req.request_id,
        index,
        list(new_token_ids),
        logprobs,
        finish_reason=finish_reason,
        stop_reason=stop_reason,
        num_prompt_tokens=len(req.prompt_token_ids),
        num_output_tokens=num_output_tokens,
        num_cached_tokens=seq.num_cached_tokens if seq is not None else 0,
        timestamp=now,
        scheduled_time=req.first_scheduled_time,
        kv_fetch=req.kv_fetch,
        **fields,
    )
    generation = generation or {}
    if "logits" in generation:
        out.generation_logits = torch.stack(generation["logits"])
    if "hidden_states" in generation:
        out.additional_generation_outputs = {"hidden_states": torch.stack(generation["hidden_states"])}
    if with_context and seq is not None:
        _attach_context_outputs(out, seq)
    return out


def _attach_context_outputs(out: EngineOutput, seq: Sequence) -> None:
    """The prompt's outputs the request asked for: prompt logprobs, context logits, hidden states."""
    p, gathered = seq.params, seq.extra_outputs
    if p.prompt_logprobs is not None:
        out.prompt_logprobs = gathered.prompt_logprobs
    if p.return_context_logits:
        out.context_logits = torch.cat(gathered.context["logits"])
    if "hidden_states" in p.additional_model_outputs:
        out.additional_context_outputs = {"hidden_states": torch.cat(gathered.context["hidden_states"])}


def merge_outputs(first: EngineOutput, later: EngineOutput) -> EngineOutput:
    """One step's consecutive outputs of one sequence (accepted drafts, then one more token) as one output."""
    first.new_token_ids += later.new_token_ids
    if first.new_logprobs is not None and later.new_logprobs is not None:
        first.new_logprobs += later.new_logprobs
    if first.sampled_logprobs is not None and later.sampled_logprobs is not None:
        first.sampled_logprobs += later.sampled_logprobs
    for name in ("finish_reason", "stop_reason", "num_output_tokens", "timestamp"):
        setattr(first, name, getattr(later, name))
    if first.generation_logits is not None and later.generation_logits is not None:
        first.generation_logits = torch.cat([first.generation_logits, later.generation_logits])
    if first.additional_generation_outputs and later.additional_generation_outputs:
        first.additional_generation_outputs = {
            k: torch.cat([v, later.additional_generation_outputs[k]])
            for k, v in first.additional_generation_outputs.items()
        }
    return first
