"""What the engine checks before it queues a request: a ValueError naming what it could not serve."""

from __future__ import annotations

from petrel.sampling_params import SamplingParams


def check_request(
    prompt_token_ids: list[int],
    params: SamplingParams,
    vocab_size: int,
    max_model_len: int,
    hidden_size: int | None = None,
    eos_token_ids=(),
) -> None:
    """The prompt is non-empty, inside the vocabulary (or its prompt_embedding_table's virtual ids) and shorter than
    the context; the sampling parameters fit the model (SamplingParams.validate_for_model, with its end-of-sequence
    tokens)."""
    if not prompt_token_ids:
        raise ValueError("prompt is empty: at least one token is needed")
    if params.prompt_embedding_table is None:
        bad = [t for t in prompt_token_ids if not isinstance(t, int) or not 0 <= t < vocab_size]
    else:
        from petrel.engine.prompt_tuning import check_virtual_tokens

        bad = check_virtual_tokens(prompt_token_ids, params.prompt_embedding_table, vocab_size, hidden_size)
    if bad:
        raise ValueError(f"prompt_token_ids has ids outside the vocabulary (size {vocab_size}): {bad[:5]}")
    if len(prompt_token_ids) >= max_model_len:
        raise ValueError(
            f"prompt is {len(prompt_token_ids)} tokens, the model's context is "
            f"{max_model_len}: max is {max_model_len - 1}"
        )
    params.validate_for_model(vocab_size, eos_token_ids)
