"""POST /v1/embeddings: each input's final (normed) hidden states from the served model, pooled and L2-normalised.

Pooling (build_app's embedding_pooling, `petrel serve --embedding-pooling`): 'last' (the default: the last
token's hidden state, the one that has seen the whole input in a causal model, as decoder embedding models use)
or 'mean' (over the input's tokens). The engine runs each input as a prompt asking for its context hidden states
(SamplingParams.additional_model_outputs); the one token it samples after the prefill is dropped, so no decode
step runs. `dimensions` is refused: the served model's hidden size is the one it has.
"""

from __future__ import annotations

import base64
from typing import Literal

import torch
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from pydantic import Field

from petrel.sampling_params import SamplingParams
from petrel.serve.completions import _prompts
from petrel.serve.errors import ERROR_RESPONSES, APIError, from_value_error
from petrel.serve.params import check_prompt_length
from petrel.serve.protocol import Prompt, _Request, _Response
from petrel.serve.streams import ServeState, outputs_or_none

POOLING = ("last", "mean")


class EmbeddingRequest(_Request):
    model: str | None = Field(None, description="the served model name (optional: there is one model)")
    input: Prompt = Field(description="a string, a list of strings, token ids, or a list of token-id lists")
    encoding_format: Literal["float", "base64"] = Field(
        "float", description="base64: each embedding's little-endian float32 bytes"
    )
    dimensions: int | None = Field(None, description="not supported: the model's hidden size is the dimension")
    user: str | None = Field(None, description="accepted and ignored")


class EmbeddingData(_Response):
    object: Literal["embedding"] = "embedding"
    index: int
    embedding: list[float] | str


class EmbeddingUsage(_Response):
    prompt_tokens: int
    total_tokens: int


class EmbeddingResponse(_Response):
    object: Literal["list"] = "list"
    data: list[EmbeddingData]
    model: str
    usage: EmbeddingUsage


def pool(hidden: torch.Tensor, pooling: str) -> torch.Tensor:
    """[tokens, hidden] -> the L2-normalised [hidden] embedding."""
    vector = hidden[-1] if pooling == "last" else hidden.mean(dim=0)
    return torch.nn.functional.normalize(vector.float(), dim=0)


def _encode(vector: torch.Tensor, encoding_format: str) -> list[float] | str:
    if encoding_format == "base64":
        return base64.b64encode(vector.numpy().astype("<f4").tobytes()).decode("ascii")
    return vector.tolist()


async def create_embeddings(state: ServeState, req: EmbeddingRequest, request, pooling: str) -> EmbeddingResponse:
    lora_request = state.check_model(req.model)
    if req.dimensions is not None:
        raise APIError(
            "dimensions is not supported: the embedding has the served model's hidden size", 400, param="dimensions"
        )
    try:
        prompts = await _prompts(state, req.input)
    except APIError as exc:
        raise APIError(exc.message.replace("prompt", "input"), exc.status, param="input", code=exc.code) from None
    params = SamplingParams(max_tokens=1, temperature=0.0, additional_model_outputs=["hidden_states"])
    futures = []
    try:
        for _, ids in prompts:
            check_prompt_length(len(ids), state.limits, "input")
        state.check_capacity(len(prompts))
        for _, ids in prompts:
            futures.append(state.generate_async(ids, params, False, None, lora_request))
    except ValueError as exc:
        for f in futures:
            f.abort()
        raise from_value_error(exc, {"prompt": "input"}) from None
    except RuntimeError as exc:  # the engine is shut down
        raise APIError(str(exc), 503) from None
    outputs = await outputs_or_none(state, request, futures)
    if outputs is None:
        return None
    data = []
    for i, out in enumerate(outputs):
        hidden = out.outputs[0].additional_context_outputs["hidden_states"]
        data.append(EmbeddingData(index=i, embedding=_encode(pool(hidden, pooling), req.encoding_format)))
    tokens = sum(len(out.prompt_token_ids) for out in outputs)
    return EmbeddingResponse(
        data=data,
        model=state.response_model(req.model),
        usage=EmbeddingUsage(prompt_tokens=tokens, total_tokens=tokens),
    )


def add_embedding_routes(router: APIRouter, state: ServeState, pooling: str = "last") -> None:
    if pooling not in POOLING:
        raise ValueError(f"embedding_pooling must be one of {POOLING}, got {pooling!r}")

    @router.post(
        "/embeddings",
        response_model=None,
        responses={200: {"model": EmbeddingResponse}, **ERROR_RESPONSES},
        summary=f"Embeddings: the served model's final hidden states, {pooling}-pooled, L2-normalised",
    )
    async def embeddings(body: EmbeddingRequest, request: Request):
        result = await create_embeddings(state, body, request, pooling)
        if result is None:
            return Response(status_code=499)
        return JSONResponse(result.model_dump(mode="json"))
