"""The benchmark workloads W1-W4 of the project's bench/WORKLOADS.md, made here from their definitions (nothing is
read from disk), so petrel's benchmarks and the peers' scripts (benchmarks/peers/) run exactly the same token ids.

  W1  single stream: the chat template applied to W1_USER_MESSAGE, greedy, exactly 256 new tokens.
  W2  offline batch: 64 prompts of token ids from numpy default_rng(0), lengths 64..512, exactly 128 new tokens
      each, greedy, all submitted at once.
  W3  online serving: the W2 prompts as streaming /v1/completions requests, 128 tokens, client concurrency 16.
  W4  shared prefix: a 1,024-token prefix from default_rng(1), then 32 suffixes of 32 tokens from the same
      generator, 64 new tokens each, greedy, submitted at once.
  W5  many shared prefixes (KV tiers, `petrel bench tiers`): 64 distinct 2,048-token prefixes from default_rng(5),
      4 requests each (the prefix and a 32-token suffix of its own), in random order, 16 new tokens each, greedy,
      a few at a time, with a KV cache that holds 8 of the prefixes: TTFT and throughput with the tiers off, a
      host-memory tier, host + disk.
  W6  long contexts: 4 prompts of 8,192 token ids from default_rng(6) (ids in [100, 30000) clipped to the model's
      vocabulary), 256 new tokens each, submitted at once; then 1 prompt (default_rng(7)) at the longest context the
      KV budget holds (w6_plan: the model's context and the KV bytes per token decide; a prompt that does not fit
      the model's context with its new tokens is shortened, and the plan says so).

Only numpy is needed (the peers' virtual environments import this file without petrel's dependencies)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

W1_USER_MESSAGE = "Write a short story about a robot learning to paint."
# The W1 prompt of the default model (SmolLM2-135M-Instruct) as transformers' tokenizer makes it; the peers' scripts
# send these ids, and `petrel bench` reports whether petrel's tokenizer agrees.
W1_REFERENCE_IDS = [
    1,
    9690,
    198,
    2683,
    359,
    253,
    5356,
    5646,
    11173,
    3365,
    3511,
    308,
    34519,
    28,
    7018,
    411,
    407,
    19712,
    8182,
    2,
    198,
    1,
    4093,
    198,
    19161,
    253,
    1890,
    1977,
    563,
    253,
    8085,
    1380,
    288,
    7670,
    30,
    2,
    198,
    1,
    520,
    9531,
    198,
]

W2_SEED, W2_NUM_REQUESTS, W2_MIN_LEN, W2_MAX_LEN = 0, 64, 64, 512  # lengths inclusive
W4_SEED = 1
TOKEN_LOW, TOKEN_HIGH = 100, 30000  # [low, high)
W3_CONCURRENCY, W3_NEW_TOKENS = 16, 128
W6_SEED, W6_LONG_SEED = 6, 7


@dataclass(frozen=True)
class Sizes:
    """How much of each workload a run does: FULL is WORKLOADS.md's, QUICK a smoke test's."""

    w1_new_tokens: int = 256
    w1_runs: int = 3
    w2_num_requests: int = 64
    w2_new_tokens: int = 128
    w2_max_prompt_len: int | None = None  # truncate prompts (--quick only)
    w4_num_requests: int = 32
    w4_prefix_len: int = 1024
    w4_suffix_len: int = 32
    w4_new_tokens: int = 64
    w6_num_requests: int = 4
    w6_prompt_len: int = 8192
    w6_new_tokens: int = 256
    w6_max_long_context: int | None = None  # cap on the long request's context (--quick only)


FULL = Sizes()
QUICK = Sizes(
    w1_new_tokens=32,
    w1_runs=1,
    w2_num_requests=8,
    w2_new_tokens=16,
    w2_max_prompt_len=128,
    w4_num_requests=4,
    w4_prefix_len=128,
    w4_suffix_len=16,
    w4_new_tokens=8,
    w6_num_requests=2,
    w6_prompt_len=512,
    w6_new_tokens=16,
    w6_max_long_context=1024,
)


def make_w2_prompts(num_requests: int = W2_NUM_REQUESTS, max_prompt_len: int | None = None) -> list[list[int]]:
    """W2's prompts (all 64 drawn, then the first `num_requests`, each cut to `max_prompt_len` tokens if given)."""
    rng = np.random.default_rng(W2_SEED)
    lengths = rng.integers(W2_MIN_LEN, W2_MAX_LEN + 1, size=W2_NUM_REQUESTS)
    prompts = [rng.integers(TOKEN_LOW, TOKEN_HIGH, size=int(n)).tolist() for n in lengths]
    prompts = prompts[:num_requests]
    if max_prompt_len is not None:
        prompts = [p[:max_prompt_len] for p in prompts]
    return prompts


def make_w4_prompts(num_requests: int = 32, prefix_len: int = 1024, suffix_len: int = 32) -> list[list[int]]:
    """W4: one 1,024-token prefix from default_rng(1), then 32 suffixes of 32 tokens from the same generator."""
    rng = np.random.default_rng(W4_SEED)
    prefix = rng.integers(TOKEN_LOW, TOKEN_HIGH, size=1024).tolist()
    suffixes = [rng.integers(TOKEN_LOW, TOKEN_HIGH, size=32).tolist() for _ in range(32)]
    return [prefix[:prefix_len] + s[:suffix_len] for s in suffixes[:num_requests]]


W5_SEED = 5


@dataclass(frozen=True)
class W5Sizes:
    """W5's scale: FULL is the workload's, QUICK a smoke test's (seconds)."""

    num_prefixes: int = 64
    prefix_len: int = 2048
    requests_per_prefix: int = 4
    suffix_len: int = 32
    new_tokens: int = 16
    cache_prefixes: int = 8  # the KV cache holds this many prefixes (with their suffixes and outputs)
    concurrency: int = 4  # requests in flight at once (a closed loop)


W5_FULL = W5Sizes()
W5_QUICK = W5Sizes(
    num_prefixes=6, prefix_len=96, requests_per_prefix=2, suffix_len=8, new_tokens=4, cache_prefixes=2, concurrency=2
)


def make_w5_prompts(sizes: W5Sizes = W5_FULL) -> list[tuple[int, list[int]]]:
    """W5's requests in their random order, as (prefix index, prompt ids)."""
    rng = np.random.default_rng(W5_SEED)
    prefixes = [rng.integers(TOKEN_LOW, TOKEN_HIGH, size=sizes.prefix_len).tolist() for _ in range(sizes.num_prefixes)]
    requests = [
        (p, prefixes[p] + rng.integers(TOKEN_LOW, TOKEN_HIGH, size=sizes.suffix_len).tolist())
        for p in range(sizes.num_prefixes)
        for _ in range(sizes.requests_per_prefix)
    ]
    return [requests[i] for i in rng.permutation(len(requests))]


def w1_prompt_ids(tokenizer) -> list[int]:
    """The chat template applied to the W1 message, as LLM.apply_chat_template does."""
    from petrel.model.tokenizer import chat_prompt

    return list(chat_prompt(tokenizer, [{"role": "user", "content": W1_USER_MESSAGE}])["prompt_token_ids"])


DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def kv_bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype_bytes: int) -> int:
    """KV cache bytes one token holds: a key and a value vector per KV head per layer."""
    return 2 * num_layers * num_kv_heads * head_dim * dtype_bytes


@dataclass(frozen=True)
class W6Plan:
    """W6's sizes for one model and KV budget; every engine of a comparison runs the prompts these numbers make."""

    vocab_size: int
    num_requests: int
    prompt_len: int  # each of the batch's prompts (8,192 unless the model's context is shorter)
    new_tokens: int
    long_prompt_len: int  # the long request's prompt; its context is long_prompt_len + new_tokens
    kv_bytes_per_token: int
    notes: tuple[str, ...] = ()

    @property
    def long_context(self) -> int:
        return self.long_prompt_len + self.new_tokens

    def to_argv(self) -> list[str]:
        """The peer scripts' options that rebuild this plan (--w6-plan PROMPT,LONG,NEW,VOCAB,REQUESTS,KVBYTES)."""
        values = (
            self.prompt_len,
            self.long_prompt_len,
            self.new_tokens,
            self.vocab_size,
            self.num_requests,
            self.kv_bytes_per_token,
        )
        return ["--w6-plan", ",".join(str(v) for v in values)]

    @classmethod
    def from_arg(cls, text: str) -> W6Plan:
        try:
            prompt, long, new, vocab, requests, kv = (int(v) for v in text.split(","))
        except ValueError:
            raise ValueError(
                f"--w6-plan {text!r}: expected six integers PROMPT,LONG,NEW,VOCAB,REQUESTS,KVBYTES"
            ) from None
        return cls(vocab, requests, prompt, new, long, kv)


def w6_plan(
    vocab_size: int,
    max_context: int,
    kv_budget_bytes: int,
    kv_bytes: int,
    sizes: Sizes = FULL,
    block_size: int = 16,
) -> W6Plan:
    """W6's plan: the batch's prompt length (clipped to the model's context less the new tokens) and the long
    request's context: the most tokens the KV budget holds (whole blocks of `block_size`), at most the model's
    context (and --quick's cap)."""
    if max_context <= sizes.w6_new_tokens + 1:
        raise ValueError(f"W6: the model's context ({max_context}) leaves no room for {sizes.w6_new_tokens} new tokens")
    notes = []
    prompt_len = sizes.w6_prompt_len
    if prompt_len + sizes.w6_new_tokens > max_context:
        prompt_len = max_context - sizes.w6_new_tokens
        notes.append(
            f"the {sizes.w6_prompt_len}-token prompts are cut to {prompt_len} tokens: with "
            f"{sizes.w6_new_tokens} new tokens they must fit the model's context of {max_context}"
        )
    batch_tokens = sizes.w6_num_requests * (prompt_len + sizes.w6_new_tokens)
    if batch_tokens * kv_bytes > kv_budget_bytes:
        notes.append(
            f"the {sizes.w6_num_requests} requests need {batch_tokens * kv_bytes / 2**30:.2f} GiB of KV, more than the "
            f"budget of {kv_budget_bytes / 2**30:.2f} GiB: they will not all run at once"
        )
    by_budget = kv_budget_bytes // kv_bytes // block_size * block_size
    long_context = min(by_budget, max_context)
    limit = "the KV budget" if by_budget < max_context else "the model's context"
    if sizes.w6_max_long_context is not None and sizes.w6_max_long_context < long_context:
        long_context, limit = sizes.w6_max_long_context, "--quick's cap"
    if long_context <= sizes.w6_new_tokens:
        raise ValueError(f"W6: the KV budget holds {by_budget} tokens, too few for the long request")
    notes.append(
        f"long request: {long_context} tokens of context ({long_context - sizes.w6_new_tokens} prompt + "
        f"{sizes.w6_new_tokens} new), set by {limit} (KV budget {kv_budget_bytes / 2**30:.2f} GiB at {kv_bytes} "
        f"bytes/token holds {by_budget} tokens; model context {max_context})"
    )
    return W6Plan(
        vocab_size=vocab_size,
        num_requests=sizes.w6_num_requests,
        prompt_len=prompt_len,
        new_tokens=sizes.w6_new_tokens,
        long_prompt_len=long_context - sizes.w6_new_tokens,
        kv_bytes_per_token=kv_bytes,
        notes=tuple(notes),
    )


def _w6_ids(seed: int, shape, vocab_size: int) -> np.ndarray:
    """Token ids in [TOKEN_LOW, TOKEN_HIGH), the range clipped to the vocabulary (a small one: from 0)."""
    high = min(TOKEN_HIGH, vocab_size)
    low = TOKEN_LOW if high > TOKEN_LOW else 0
    return np.random.default_rng(seed).integers(low, high, size=shape)


def make_w6_prompts(plan: W6Plan) -> tuple[list[list[int]], list[int]]:
    """W6's batch (plan.num_requests prompts of plan.prompt_len ids: the beginnings of one 4 x 8,192 draw, so a
    shorter plan's prompts begin as the full one's) and its long prompt (plan.long_prompt_len ids of their own)."""
    full = max(plan.prompt_len, FULL.w6_prompt_len)
    batch = _w6_ids(W6_SEED, (max(plan.num_requests, FULL.w6_num_requests), full), plan.vocab_size)
    long = _w6_ids(W6_LONG_SEED, plan.long_prompt_len, plan.vocab_size)
    return [row[: plan.prompt_len].tolist() for row in batch[: plan.num_requests]], long.tolist()
