"""POST /v1/chat/completions: messages -> chat template -> SamplingParams -> a response or SSE chunks,
with tool calls parsed out of the model's text (tool_parser) in both. A harmony model's output (gpt-oss:
petrel/serve/harmony.py) is split by its channels instead: analysis as reasoning_content, final as content,
commentary addressed to a function as its tool call."""

from __future__ import annotations

import time
from dataclasses import dataclass

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from petrel.serve import disagg, harmony
from petrel.serve.chat_template import conversation_chars, messages_for_template
from petrel.serve.completions import api_finish_reason
from petrel.serve.errors import APIError, from_value_error
from petrel.serve.guided import Guided, compile_guided, guided_from_request, guided_value_error
from petrel.serve.logprobs import chat_logprobs
from petrel.serve.media import holds_much_memory, load_media
from petrel.serve.openai_fields import check_modalities, with_legacy_functions
from petrel.serve.params import build_sampling_params, check_prompt_chars, check_prompt_length, resolve_max_tokens
from petrel.serve.protocol import (
    ChatChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatStreamChoice,
    ChoiceLogprobs,
    DeltaFunctionCall,
    DeltaMessage,
    DeltaToolCall,
    FunctionCall,
    PromptTokensDetails,
    ResponseMessage,
    ToolCall,
    Usage,
)
from petrel.serve.reasoning import ReasoningParser, prompt_opens_reasoning, split_reasoning, uses_think_tags
from petrel.serve.streams import SSE_DONE, ServeState, merged, new_id, outputs_or_none, sse
from petrel.serve.tool_grammar import CALL_START, any_call_grammar, named_call_grammar, named_prefill
from petrel.serve.tool_grammar import available as tool_grammar_available
from petrel.serve.tool_parser import ToolCallParser, parse_all

TOOL_CALL_STOP = "</tool_call>"


@dataclass
class ToolPlan:
    """How tools shape this request: parse the output? what the server prefilled for the model to continue."""

    parse: bool = False
    prefill: str = ""
    single: bool = False  # parallel_tool_calls=false: keep the first call
    guided: Guided | None = None  # a forced call: the grammar its arguments follow
    legacy: bool = False  # the request gave `functions`: answer with function_call
    reasoning: bool = False  # split <think>...</think> out as reasoning_content
    in_reasoning: bool = False  # the prompt opened the think block
    harmony: bool = False  # the harmony format: channels split by harmony.HarmonyParser (reasoning and calls too)
    end_tokens: tuple[str, ...] = ()  # harmony: the model's end-of-sequence tokens' text (they end a message)


def plan_tools(req: ChatCompletionRequest) -> ToolPlan:
    choice = req.tool_choice
    tools = req.tools or []
    names = [t.function.name for t in tools]
    if choice is not None and choice != "none" and not tools:
        raise APIError("tool_choice needs tools", 400, param="tool_choice")
    if not tools or choice == "none":
        return ToolPlan()
    plan = ToolPlan(parse=True, single=req.parallel_tool_calls is False)
    forced = None
    if not isinstance(choice, str) and choice is not None:
        if choice.function.name not in names:
            raise APIError(
                f"tool_choice names {choice.function.name!r}, which is not among the tools {names}",
                400,
                param="tool_choice",
            )
        forced = choice.function.name
    elif choice == "required" and len(names) == 1:
        forced = names[0]
    # a forced call: the model continues a call the server opened, so it cannot answer otherwise, and a
    # grammar holds what it writes to the tool's parameters schema (tool_grammar; without xgrammar, no grammar)
    constrain = tool_grammar_available()
    try:
        if forced is not None:
            plan.prefill = named_prefill(forced)
            if constrain:
                parameters = next(t.function.parameters for t in tools if t.function.name == forced)
                plan.guided = Guided(named_call_grammar(parameters), "tools")
        elif choice == "required":
            plan.prefill = CALL_START if constrain else CALL_START + '{"name": "'
            if constrain:
                plan.guided = Guided(
                    any_call_grammar([(t.function.name, t.function.parameters) for t in tools]), "tools"
                )
    except ValueError as exc:
        raise APIError(str(exc), 400, param="tools") from None
    if plan.prefill:
        plan.single = True
    return plan


def _check_unsupported(req: ChatCompletionRequest) -> None:
    if req.top_logprobs is not None and not req.logprobs:
        raise APIError("top_logprobs needs logprobs=true", 400, param="top_logprobs")


def _call_objects(calls, prefix: str) -> list[ToolCall]:
    return [
        ToolCall(id=new_id(prefix).replace("-", "_"), function=FunctionCall(name=c.name, arguments=c.arguments))
        for c in calls
    ]


async def create_chat_completion(state: ServeState, req: ChatCompletionRequest, request: Request) -> Response:
    lora_request = state.check_model(req.model)
    _check_unsupported(req)
    check_modalities(req)
    await state.check_schemas(req)
    req, legacy = with_legacy_functions(req)
    dp = disagg.from_request(req, 1)
    guided = guided_from_request(req)
    plan = plan_tools(req)
    plan.legacy = legacy
    plan.reasoning = uses_think_tags(state.template.source) and not plan.prefill
    plan.harmony = state.template.harmony
    if plan.harmony:
        plan.reasoning = False
        if plan.prefill:
            raise APIError(
                "tool_choice 'required' or naming a function is not supported with the harmony format (gpt-oss): "
                "use 'auto' or 'none'",
                400,
                param="tool_choice",
            )
    if plan.guided is not None:
        if guided is not None:
            raise APIError(
                f"tool_choice {'required' if req.tool_choice == 'required' else 'naming a function'} "
                f"constrains the output to a tool call; it cannot be combined with {guided.param}",
                400,
                param=guided.param,
            )
        guided = plan.guided
    template = state.template
    if req.tools and state.media.takes_images:
        raise APIError("tools are not supported with a vision-language model yet", 400, param="tools")
    messages = messages_for_template(
        req.messages, template.supports_tools, state.media.takes_images, state.media.takes_videos
    )
    tools = [t.model_dump(exclude_none=True) for t in req.tools] if plan.parse else None
    check_prompt_chars(conversation_chars(messages, tools), state.limits, "messages")
    processor = getattr(state.llm.engine, "mm_processor", None)
    images, videos = await load_media(state, req.messages, processor)
    template_kwargs = req.chat_template_kwargs
    if req.reasoning_effort is not None and "reasoning_effort" not in (template_kwargs or {}):
        template_kwargs = {**(template_kwargs or {}), "reasoning_effort": req.reasoning_effort}  # gpt-oss reads it
    prompt_text, ids = await state.run_blocking(
        template.prompt,
        messages,
        tools,
        req.add_generation_prompt,
        req.continue_final_message,
        template_kwargs,
        plan.prefill,
    )
    multi_modal = None
    if images or videos:  # the engine's processor expands each placeholder the template wrote into the media's tokens
        try:
            ids, multi_modal = await state.run_media(processor.process, ids, images, *([videos] if videos else []))
        except ValueError as exc:
            raise APIError(str(exc), 400, param="messages") from None
        finally:  # the decoded pixels go now (the engine keeps the processed tiles), and the heap gives them back
            trim, images, videos = holds_much_memory(images, videos), None, None
            if trim:
                state.trimmer.request(state.media_pool)
    check_prompt_length(len(ids), state.limits, "messages")
    plan.in_reasoning = plan.reasoning and prompt_opens_reasoning(prompt_text)
    param = (
        "max_tokens" if req.max_completion_tokens is None and req.max_tokens is not None else "max_completion_tokens"
    )
    requested = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    max_tokens = resolve_max_tokens(requested, None, len(ids), state.limits, param)
    k = (req.top_logprobs or 0) if req.logprobs else None
    params = build_sampling_params(
        req,
        max_tokens=max_tokens,
        limits=state.limits,
        logprobs=k,
        extra_stop=[TOOL_CALL_STOP] if plan.prefill else None,
        renames={"max_tokens": param, "logprobs": "top_logprobs"},
        guided_decoding=guided.params if guided else None,
    )
    if plan.harmony:  # the channels' control tokens stay in the text; the answer and a tool call end the output
        params.skip_special_tokens = False
        stops = [state.llm.tokenizer.convert_tokens_to_ids(t) for t in harmony.STOP_TOKENS]
        params.stop_token_ids = list(dict.fromkeys([*(params.stop_token_ids or []), *stops]))
        eos = state.llm.engine.eos_token_ids
        plan.end_tokens = tuple(state.llm.tokenizer.convert_ids_to_tokens(list(eos))) if eos else ()
    await compile_guided(state, guided)
    state.check_capacity(req.n)
    prompt = ids if multi_modal is None else {"prompt_token_ids": ids, "multi_modal_inputs": multi_modal}
    try:
        future = await disagg.submit(
            state, prompt, params, req.stream, req.cache_salt, lora_request, dp, req.dkv_hint()
        )
    except ValueError as exc:
        raise guided_value_error(exc, guided) or from_value_error(exc, {"prompt": "messages"}) from None
    except RuntimeError as exc:  # the engine is shut down
        raise APIError(str(exc), 503) from None
    rid, created = new_id("chatcmpl"), int(time.time())
    if req.stream:
        return StreamingResponse(_stream(state, req, plan, future, ids, rid, created), media_type="text/event-stream")
    outputs = await outputs_or_none(state, request, [future])
    if outputs is None:
        return Response(status_code=499)
    (out,) = outputs
    choices = []
    for co in out.outputs:
        reasoning, text = split_reasoning(co.text, plan.in_reasoning) if plan.reasoning else (None, co.text)
        message = ResponseMessage(content=text)
        finish = api_finish_reason(co.finish_reason)
        if plan.harmony:
            message, finish = _harmony_message(plan, co.text, finish)
            reasoning = message.reasoning_content
        elif plan.parse:
            parsed = parse_all(text, prefix=plan.prefill)
            calls = parsed.calls[:1] if plan.single else parsed.calls
            if calls and plan.legacy:
                message = ResponseMessage(
                    content=parsed.content or None,
                    function_call=FunctionCall(name=calls[0].name, arguments=calls[0].arguments),
                )
                finish = "function_call"
            elif calls:
                message = ResponseMessage(content=parsed.content or None, tool_calls=_call_objects(calls, "call"))
                finish = "tool_calls"
            else:
                message = ResponseMessage(content=parsed.content)
        message.reasoning_content = reasoning
        choice = ChatChoice(
            index=co.index,
            message=message,
            finish_reason=finish,
            stop_reason=co.stop_reason,
            disaggregated_params=disagg.choice_params(out),
        )
        if k is not None:
            choice.logprobs = ChoiceLogprobs(
                content=chat_logprobs(co.token_ids, co.logprobs or [], k, state.token_text)
            )
        if req.return_token_ids:
            choice.token_ids = co.token_ids
        choices.append(choice)
    body = ChatCompletionResponse(
        id=rid,
        created=created,
        model=state.response_model(req.model),
        choices=choices,
        usage=_usage(out),
        prompt_token_ids=ids if req.return_token_ids else None,
    )
    return JSONResponse(body.model_dump(mode="json"))


def _harmony_message(plan: ToolPlan, text: str, finish: str | None) -> tuple[ResponseMessage, str | None]:
    """A harmony output's message (reasoning, content, the calls when the request gave tools) and finish reason."""
    parsed = harmony.split_output(text, plan.end_tokens)
    calls = (parsed.calls[:1] if plan.single else parsed.calls) if plan.parse else []
    message = ResponseMessage(content=parsed.content or (None if calls else ""))
    if calls and plan.legacy:
        message.function_call = FunctionCall(name=calls[0].name, arguments=calls[0].arguments)
        finish = "function_call"
    elif calls:
        message.tool_calls = _call_objects(calls, "call")
        finish = "tool_calls"
    message.reasoning_content = parsed.reasoning or None
    return message, finish


def _finish(plan: ToolPlan, num_calls: int, reason: str | None) -> str | None:
    if num_calls:
        return "function_call" if plan.legacy else "tool_calls"
    return api_finish_reason(reason)


def _usage(out) -> Usage:
    prompt = len(out.prompt_token_ids)
    completion = sum(len(co.token_ids) for co in out.outputs)
    return Usage(
        prompt_tokens=prompt,
        completion_tokens=completion,
        total_tokens=prompt + completion,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=out.num_cached_tokens),
        kv_transfer=disagg.kv_transfer_usage([out]),
    )


async def _stream(state: ServeState, req: ChatCompletionRequest, plan: ToolPlan, future, ids, rid: str, created: int):
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    exclude = None if include_usage else {"usage"}
    k = (req.top_logprobs or 0) if req.logprobs else None
    parsers = {}
    thinkers = {i: ReasoningParser(plan.in_reasoning) for i in range(req.n)} if plan.reasoning else {}
    channels = {i: harmony.HarmonyParser(plan.end_tokens) for i in range(req.n)} if plan.harmony else {}
    num_calls = {i: 0 for i in range(req.n)}

    def chunk(choice: ChatStreamChoice) -> str:
        body = ChatCompletionChunk(id=rid, created=created, model=state.response_model(req.model), choices=[choice])
        return sse(body.model_dump(mode="json", exclude=exclude))

    def deltas(i: int, content: str, fragments) -> list[DeltaMessage]:
        """The content, then one delta per call fragment (a call's first names it, with "" arguments)."""
        out = [DeltaMessage(content=content)] if content else []
        for f in fragments:
            if plan.single and f.index > 0:
                continue
            num_calls[i] = max(num_calls[i], f.index + 1)
            if plan.legacy:
                out.append(DeltaMessage(function_call=DeltaFunctionCall(name=f.name, arguments=f.arguments)))
                continue
            head = {} if f.name is None else {"id": new_id("call").replace("-", "_"), "type": "function"}
            function = DeltaFunctionCall(name=f.name, arguments=f.arguments)
            out.append(DeltaMessage(tool_calls=[DeltaToolCall(index=f.index, function=function, **head)]))
        return out

    for i in range(req.n):
        yield chunk(ChatStreamChoice(index=i, delta=DeltaMessage(role="assistant", content="")))
        if plan.parse and not plan.harmony:
            parsers[i] = ToolCallParser(incremental=True)
            parsers[i].feed(plan.prefill)  # the prefill opens a call block: it yields nothing by itself
    try:
        async for _, c in merged([future]):  # events straight from each step's chunks
            i = c.index
            done = c.finish_reason is not None
            text, messages = c.text, []
            if plan.harmony:
                split = channels[i].feed(text)
                if done:
                    split += channels[i].finish()
                messages = [DeltaMessage(reasoning_content=split.reasoning)] if split.reasoning else []
                messages += deltas(i, split.content, split.fragments if plan.parse else [])
                text = ""
            if plan.reasoning:
                reasoning, text = thinkers[i].feed(text)
                if done:
                    more = thinkers[i].finish()
                    reasoning, text = reasoning + more[0], text + more[1]
                messages = [DeltaMessage(reasoning_content=reasoning)] if reasoning else []
            if plan.harmony:
                pass
            elif plan.parse:
                parsed = parsers[i].feed(text)
                if done:
                    parsed += parsers[i].finish()
                messages += deltas(i, parsed.content, parsed.fragments)
            elif text:
                messages.append(DeltaMessage(content=text))
            toks = c.output_ids
            # the step's logprobs and token ids ride on its first delta (an empty one when it has none)
            choice = ChatStreamChoice(index=i, delta=messages[0] if messages else DeltaMessage())
            if k is not None and toks:
                choice.logprobs = ChoiceLogprobs(content=chat_logprobs(toks, c.logprob_entries(), k, state.token_text))
            if req.return_token_ids and toks:
                choice.token_ids = toks
            if messages or choice.logprobs or choice.token_ids:
                yield chunk(choice)
            for delta in messages[1:]:
                yield chunk(ChatStreamChoice(index=i, delta=delta))
            if done:
                reason = _finish(plan, num_calls[i], c.completion_finish_reason)
                yield chunk(
                    ChatStreamChoice(
                        index=i, delta=DeltaMessage(), finish_reason=reason, stop_reason=c.completion_stop_reason
                    )
                )
    except RuntimeError as exc:
        yield sse(APIError(str(exc), 500).body())
        yield SSE_DONE
        return
    finally:  # the client went away (cancelled or closed generator): free the request's KV blocks (counted aborted)
        if not future.done():
            future.abort()
    last = future.result(timeout=0)
    if include_usage:
        body = ChatCompletionChunk(
            id=rid, created=created, model=state.response_model(req.model), choices=[], usage=_usage(last)
        )
        yield sse(body.model_dump(mode="json"))
    yield SSE_DONE
