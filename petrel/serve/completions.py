"""POST /v1/completions: prompts -> SamplingParams -> futures -> a CompletionResponse or SSE chunks."""

from __future__ import annotations

import copy
import dataclasses
import time

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from petrel.serve import disagg
from petrel.serve.errors import APIError, from_value_error
from petrel.serve.guided import compile_guided, guided_from_request, guided_value_error
from petrel.serve.logprobs import completion_logprobs
from petrel.serve.metrics import api_finish_reason
from petrel.serve.params import build_sampling_params, check_prompt_chars, check_prompt_length, resolve_max_tokens
from petrel.serve.protocol import (
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
    CompletionStreamResponse,
    PromptTokensDetails,
    Usage,
)
from petrel.serve.streams import SSE_DONE, ServeState, abort_unfinished, merged, new_id, outputs_or_none, sse

DEFAULT_MAX_TOKENS = 16  # OpenAI's default for the legacy endpoint


async def _prompts(state: ServeState, prompt) -> list[tuple[str, list[int]]]:
    """(text, token ids) per prompt; the text of a token-id prompt is its decoding (for echo). Prompts too long
    for the context by their characters alone are refused first; the tokenizing runs off the event loop."""
    items = _prompt_items(state, prompt)
    for item in items:
        if isinstance(item, str):
            check_prompt_chars(len(item), state.limits, "prompt")
        else:
            check_prompt_length(len(item), state.limits, "prompt")
    return await state.run_blocking(_tokenize_prompts, state, items)


def _prompt_items(state: ServeState, prompt) -> list:
    if isinstance(prompt, str):
        items = [prompt]
    elif prompt and isinstance(prompt[0], int):
        items = [list(prompt)]
    else:
        items = list(prompt)
    if not items:
        raise APIError("prompt is an empty list", 400, param="prompt")
    if len(items) > state.limits.max_prompts:
        raise APIError(
            f"prompt has {len(items)} prompts; this server allows {state.limits.max_prompts} per request",
            400,
            param="prompt",
        )
    return items


def _tokenize_prompts(state: ServeState, items: list) -> list[tuple[str, list[int]]]:
    tok = state.llm.tokenizer
    vocab = state.limits.vocab_size
    out = []
    for item in items:
        if isinstance(item, str):
            out.append((item, tok(item)["input_ids"]))
        else:
            bad = [t for t in item if not 0 <= t < vocab]
            if bad:
                raise APIError(
                    f"prompt has token ids outside the vocabulary (size {vocab}): {bad[:5]}", 400, param="prompt"
                )
            out.append((tok.decode(item), list(item)))
    return out


def _without_generated(out):
    """A max_tokens=0 request's output: the prompt only (its logprobs kept), no token generated."""
    out = copy.copy(out)
    out.outputs = [
        dataclasses.replace(co, text="", token_ids=[], logprobs=[] if co.logprobs is not None else None)
        for co in out.outputs
    ]
    for co in out.outputs:
        co.finish_reason, co.stop_reason = "length", None
    return out


def _usage(outputs) -> Usage:
    prompt = sum(len(o.prompt_token_ids) for o in outputs)
    completion = sum(len(co.token_ids) for o in outputs for co in o.outputs)
    return Usage(
        prompt_tokens=prompt,
        completion_tokens=completion,
        total_tokens=prompt + completion,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=sum(o.num_cached_tokens for o in outputs)),
        kv_transfer=disagg.kv_transfer_usage(outputs),
    )


async def create_completion(state: ServeState, req: CompletionRequest, request: Request) -> Response:
    lora_request = state.check_model(req.model)
    if req.suffix:
        raise APIError(
            "suffix (fill-in-the-middle) is not supported: petrel has no FIM prompt format for the served model "
            "(its tokenizer has no fill-in-the-middle tokens)",
            400,
            param="suffix",
        )
    if req.max_tokens == 0 and not req.echo:
        raise APIError(
            "max_tokens 0 generates nothing: it is for scoring the prompt, with echo=true (and logprobs)",
            400,
            param="max_tokens",
        )
    if req.best_of is not None and req.best_of != req.n:
        raise APIError(
            "best_of is supported only equal to n (petrel returns every sequence it samples)", 400, param="best_of"
        )
    prompts = await _prompts(state, req.prompt)
    dp = disagg.from_request(req, len(prompts))
    guided = guided_from_request(req)
    requested = req.max_tokens if "max_tokens" in req.model_fields_set else None
    # max_tokens 0 (with echo): the prompt is scored in its prefill; the one token the engine samples is dropped
    score_only = req.max_tokens == 0
    if score_only and req.min_tokens:
        raise APIError("min_tokens needs max_tokens >= min_tokens; max_tokens is 0", 400, param="min_tokens")
    params_list = []
    for _, ids in prompts:
        check_prompt_length(len(ids), state.limits, "prompt")
        max_tokens = resolve_max_tokens(requested, DEFAULT_MAX_TOKENS, len(ids), state.limits, "max_tokens")
        params_list.append(
            build_sampling_params(
                req,
                max_tokens=max(max_tokens, 1),
                limits=state.limits,
                logprobs=req.logprobs,
                prompt_logprobs=req.logprobs if req.echo and req.logprobs is not None else None,
                guided_decoding=guided.params if guided else None,
            )
        )
    await compile_guided(state, guided)
    state.check_capacity(len(prompts) * req.n)
    futures = []
    try:
        for (_, ids), params in zip(prompts, params_list):
            futures.append(
                await disagg.submit(state, ids, params, req.stream, req.cache_salt, lora_request, dp, req.dkv_hint())
            )
    except ValueError as exc:
        abort_unfinished(futures)
        raise guided_value_error(exc, guided) or from_value_error(exc) from None
    except RuntimeError as exc:  # the engine is shut down
        abort_unfinished(futures)
        raise APIError(str(exc), 503) from None
    rid, created = new_id("cmpl"), int(time.time())
    if req.stream:
        return StreamingResponse(_stream(state, req, prompts, futures, rid, created), media_type="text/event-stream")
    outputs = await outputs_or_none(state, request, futures)
    if outputs is None:
        return Response(status_code=499)
    if score_only:
        outputs = [_without_generated(out) for out in outputs]
    choices = []
    for p, ((text, ids), out) in enumerate(zip(prompts, outputs)):
        for co in out.outputs:
            choice = CompletionChoice(
                index=p * req.n + co.index,
                text=(text if req.echo else "") + co.text,
                finish_reason=api_finish_reason(co.finish_reason),
                stop_reason=co.stop_reason,
                disaggregated_params=disagg.choice_params(out),
            )
            if req.logprobs is not None:
                toks = (ids if req.echo else []) + co.token_ids
                entries = (list(out.prompt_logprobs or [None] * len(ids)) if req.echo else []) + list(co.logprobs or [])
                choice.logprobs = completion_logprobs(toks, entries, req.logprobs, state.token_text)
            if req.return_token_ids:
                choice.prompt_token_ids, choice.token_ids = ids, co.token_ids
            choices.append(choice)
    body = CompletionResponse(
        id=rid, created=created, model=state.response_model(req.model), choices=choices, usage=_usage(outputs)
    )
    return JSONResponse(body.model_dump(mode="json"))


async def _stream(state: ServeState, req: CompletionRequest, prompts, futures, rid: str, created: int):
    """SSE events built straight from each step's chunks (one event per choice that has something new)."""
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    exclude = None if include_usage else {"usage"}
    want_tokens = req.logprobs is not None or req.return_token_ids
    n = req.n
    echoed: set[int] = set()
    finished = [0] * len(futures)  # per prompt: choices finished
    offsets: dict[int, int] = {}
    prompt_entries: dict[int, list] = {}  # per prompt: its logprob entries (echo), from the chunk carrying them
    final_outputs = [None] * len(futures)

    def event(choice: CompletionChoice) -> str:
        body = CompletionStreamResponse(
            id=rid, created=created, model=state.response_model(req.model), choices=[choice]
        )
        return sse(body.model_dump(mode="json", exclude=exclude))

    try:
        async for p, c in merged(futures):
            text0, ids = prompts[p]
            idx = p * n + c.index
            if c.input_token_logprobs is not None:
                prompt_entries[p] = c.prompt_logprob_entries()
            text, toks = c.text, c.output_ids
            if req.max_tokens == 0:  # scoring the prompt: the sampled token is dropped
                text, toks = "", []
            prompt_part = req.echo and idx not in echoed
            if prompt_part:
                echoed.add(idx)
                text = text0 + text
            done = c.finish_reason is not None
            if not (text or (want_tokens and toks) or done or prompt_part):
                continue
            choice = CompletionChoice(index=idx, text=text)
            if req.logprobs is not None:
                all_toks = (ids if prompt_part else []) + toks
                all_entries = ((prompt_entries.get(p) or [None] * len(ids)) if prompt_part else []) + (
                    c.logprob_entries() if toks else []
                )
                choice.logprobs = completion_logprobs(
                    all_toks, all_entries, req.logprobs, state.token_text, offsets.get(idx, 0)
                )
                offsets[idx] = offsets.get(idx, 0) + sum(len(t) for t in choice.logprobs.tokens)
            if req.return_token_ids:
                choice.token_ids = toks
                if prompt_part:
                    choice.prompt_token_ids = ids
            if done:
                choice.finish_reason = api_finish_reason(c.completion_finish_reason)
                choice.stop_reason = c.completion_stop_reason
                if req.max_tokens == 0:
                    choice.finish_reason, choice.stop_reason = "length", None
            yield event(choice)
            if done:
                finished[p] += 1
                if finished[p] == n:  # the prompt's request is over: keep its output for the usage
                    out = futures[p].result(timeout=0)
                    final_outputs[p] = _without_generated(out) if req.max_tokens == 0 else out
    except RuntimeError as exc:
        yield sse(APIError(str(exc), 500).body())
        yield SSE_DONE
        return
    finally:  # the client went away (cancelled or closed generator): free the requests' KV blocks (counted aborted)
        abort_unfinished(futures)
    if include_usage:
        body = CompletionStreamResponse(
            id=rid, created=created, model=state.response_model(req.model), choices=[], usage=_usage(final_outputs)
        )
        yield sse(body.model_dump(mode="json"))
    yield SSE_DONE
