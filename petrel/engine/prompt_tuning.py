"""Prompt tuning (TensorRT-LLM's PromptTuningConfig): a request's `prompt_embedding_table` gives the embeddings of
its virtual prompt tokens. A prompt id >= vocab_size is a virtual token: the model takes row (id - vocab_size) of
the table as its input embedding instead of a row of the embedding matrix. Only prompts hold virtual tokens (the
sampler never emits one), so decode steps, and the one-call decode path, see real vocabulary ids only.

A request with a table keys its prefix-cache blocks by the table too (table_digest, in the root block hash), so
two tables never share KV blocks of the same ids.
"""

from __future__ import annotations

import hashlib

import torch


def table_digest(table: torch.Tensor | None) -> str:
    """A digest of the table's shape, dtype and values ('' without a table)."""
    if table is None:
        return ""
    data = table.detach().cpu().contiguous()
    h = hashlib.sha256(f"{tuple(data.shape)}:{data.dtype}".encode())
    h.update(data.view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def check_prompt_tuning_engine(model, speculative_config) -> None:
    """ValueError when this engine cannot run a request with a prompt embedding table."""
    if not getattr(model, "supports_prompt_tuning", False):
        raise ValueError(f"prompt_embedding_table (prompt_tuning_config) is not supported by {type(model).__name__}")
    if speculative_config is not None and speculative_config.method == "draft_model":
        raise ValueError(
            "prompt_embedding_table (prompt_tuning_config) cannot run with speculative method 'draft_model' "
            "(the draft model has no embeddings for the virtual tokens)"
        )


def check_virtual_tokens(prompt_token_ids: list[int], table, vocab_size: int, hidden_size: int | None) -> list[int]:
    """ValueError for a table of the wrong width or virtual ids past its rows; returns the ids outside the
    vocabulary that the table does not cover (the caller reports those as plain bad ids). Without a table,
    request_checks.check_request checks the ids itself."""
    rows = table.shape[0]
    if hidden_size is not None and table.shape[1] != hidden_size:
        raise ValueError(
            f"prompt_embedding_table (prompt_tuning_config.embedding_table) has width {table.shape[1]}, "
            f"the model's hidden size is {hidden_size}"
        )
    past = [t for t in prompt_token_ids if isinstance(t, int) and t >= vocab_size + rows]
    if past:
        raise ValueError(
            f"prompt_token_ids has virtual token ids past the prompt_embedding_table (prompt_tuning_config: "
            f"{rows} rows, ids {vocab_size}..{vocab_size + rows - 1}): {past[:5]}"
        )
    return [t for t in prompt_token_ids if not isinstance(t, int) or t < 0]


def virtual_token_embeddings(spans, vocab_size: int, device: torch.device, dtype: torch.dtype):
    """For a flat batch of QuerySpans: (rows of the virtual tokens, their embeddings [k, hidden]), or None when no
    span has one."""
    rows, values, row = [], [], 0
    for span in spans:
        table = span.embedding_table
        if table is not None:
            ids = torch.tensor(span.token_ids, dtype=torch.long)
            at = torch.nonzero(ids >= vocab_size).flatten()
            if at.numel():
                rows.append(at + row)
                values.append(table[ids[at] - vocab_size].to(device=device, dtype=dtype))
        row += len(span.token_ids)
    if not rows:
        return None
    return torch.cat(rows).to(device), torch.cat(values)
