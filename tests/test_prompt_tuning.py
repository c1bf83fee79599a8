"""Prompt tuning (TensorRT-LLM's PromptTuningConfig) on the tiny random Llama: prompt ids >= vocab_size take
their embeddings from SamplingParams.prompt_embedding_table (row id - vocab_size). A table whose rows equal the
embedding rows of real tokens gives exactly the real prompt's tokens and logits; another table changes them; the
prefix cache never shares blocks across tables."""

from __future__ import annotations

import pytest
import torch
from test_speculative import make_core, run, tokens_of
from tiny_llama import _tokens

from petrel.engine.sequence import EngineRequest
from petrel.sampling_params import SamplingParams

PROMPT = _tokens(12, 401)
VIRTUAL = [3, 4, 5, 9]  # prompt positions given as virtual tokens


def params(table=None, **kw) -> SamplingParams:
    return SamplingParams(
        temperature=0.0,
        max_tokens=10,
        ignore_eos=True,
        return_generation_logits=True,
        prompt_embedding_table=table,
        **kw,
    )


def virtual_prompt(vocab: int) -> list[int]:
    """PROMPT with the VIRTUAL positions replaced by ids vocab, vocab + 1, ... (in order)."""
    ids = list(PROMPT)
    for row, pos in enumerate(VIRTUAL):
        ids[pos] = vocab + row
    return ids


def matching_table(t) -> torch.Tensor:
    """The table whose rows are the embedding rows of the real tokens the virtual ones stand for."""
    with torch.no_grad():  # the embedding's own lookups: rows, or rows gathered from panels
        return t.model.model.embed_tokens(torch.tensor([PROMPT[p] for p in VIRTUAL])).clone()


def generate(core, rid, prompt, p):
    outs, _ = run(core, [(rid, prompt, p)])
    got = outs[(rid, 0)]
    return tokens_of(got), torch.cat([o.generation_logits for o in got]), got[0].num_cached_tokens


@pytest.mark.parametrize("method", [None, "ngram", "self"])
def test_table_of_real_embedding_rows_gives_the_real_prompts_tokens_and_logits(tiny, method):
    t = tiny(2, False)
    vocab = t.cfg.vocab_size
    real_tokens, real_logits, _ = generate(make_core(t, tiny, None), "real", PROMPT, params())
    tokens, logits, _ = generate(make_core(t, tiny, method), "pt", virtual_prompt(vocab), params(matching_table(t)))
    assert tokens == real_tokens
    assert logits.shape == real_logits.shape == (10, vocab)
    if method is None:
        assert torch.equal(logits, real_logits)
    else:  # verify rows run in a different batch shape than single decodes
        torch.testing.assert_close(logits, real_logits, atol=1e-4, rtol=1e-4)


def test_another_table_gives_other_tokens(tiny):
    t = tiny(2, False)
    vocab = t.cfg.vocab_size
    real_tokens, real_logits, _ = generate(make_core(t, tiny, None), "real", PROMPT, params())
    other = torch.randn(len(VIRTUAL), t.cfg.hidden_size, generator=torch.Generator().manual_seed(7))
    tokens, logits, _ = generate(make_core(t, tiny, None), "pt", virtual_prompt(vocab), params(other))
    assert not torch.allclose(logits[0], real_logits[0])
    assert tokens != real_tokens


def test_prefix_cache_is_not_shared_across_tables(tiny):
    t = tiny(2, False)
    vocab = t.cfg.vocab_size
    prompt = virtual_prompt(vocab)
    table_a = matching_table(t)
    table_b = torch.randn(table_a.shape, generator=torch.Generator().manual_seed(8))
    fresh_b = generate(make_core(t, tiny, None), "b", prompt, params(table_b))
    core = make_core(t, tiny, None)
    generate(core, "a1", prompt, params(table_a))
    tokens_b, logits_b, cached_b = generate(core, "b", prompt, params(table_b))  # same ids, another table
    assert cached_b == 0
    assert tokens_b == fresh_b[0] and torch.equal(logits_b, fresh_b[1])
    tokens_a, _, cached_a = generate(core, "a2", prompt, params(table_a.clone()))  # the same table's values again
    assert cached_a > 0
    assert tokens_a == generate(make_core(t, tiny, None), "real", PROMPT, params())[0]


def test_repetition_penalty_skips_virtual_tokens(tiny):
    t = tiny(2, False)
    vocab = t.cfg.vocab_size
    kw = dict(repetition_penalty=1.3)
    tokens, _, _ = generate(make_core(t, tiny, None), "pt", virtual_prompt(vocab), params(matching_table(t), **kw))
    assert len(tokens) == 10 and all(0 <= x < vocab for x in tokens)


def test_virtual_ids_past_the_table_or_a_wrong_width_are_a_value_error(tiny):
    t = tiny(2, False)
    vocab = t.cfg.vocab_size
    core = make_core(t, tiny, None)
    table = matching_table(t)
    with pytest.raises(ValueError, match=rf"prompt_tuning_config.*\[{vocab + len(VIRTUAL)}\]"):
        core.validate(PROMPT + [vocab + len(VIRTUAL)], params(table))
    with pytest.raises(ValueError, match="outside the vocabulary"):  # virtual ids without a table
        core.validate(virtual_prompt(vocab), params())
    with pytest.raises(ValueError, match="prompt_embedding_table.*hidden size"):
        core.validate(virtual_prompt(vocab), params(torch.zeros(len(VIRTUAL), t.cfg.hidden_size + 1)))
    with pytest.raises(ValueError, match="prompt_embedding_table"):
        params(torch.zeros(t.cfg.hidden_size))  # not [rows, hidden]
    with pytest.raises(ValueError, match="prompt_logprobs"):
        params(table, prompt_logprobs=1)
    core.add_request(EngineRequest("ok", virtual_prompt(vocab), params(table)))  # the valid request still runs
    assert core.has_work


def test_draft_model_speculation_refuses_a_table(tiny):
    t = tiny(2, False)
    core = make_core(t, tiny, "draft-same")
    with pytest.raises(ValueError, match="prompt_tuning_config.*draft_model"):
        core.validate(virtual_prompt(t.cfg.vocab_size), params(matching_table(t)))


class ByteTokenizer:
    """256 tokens, one per byte: a virtual id (>= 256) is no token of it."""

    def __len__(self) -> int:
        return 256

    @staticmethod
    def decode(ids, skip_special_tokens: bool = True) -> str:
        return bytes(ids).decode("utf-8", errors="replace")


def test_the_output_text_leaves_the_virtual_prompt_tokens_out():
    from petrel.engine.engine_output import EngineOutput
    from petrel.engine.output_processor import RequestOutputProcessor

    p = SamplingParams(max_tokens=4, prompt_embedding_table=torch.zeros(2, 8))
    proc = RequestOutputProcessor("r", ByteTokenizer(), list(b"ab") + [256, 257] + list(b" c"), p)
    chunk, _ = proc.process(EngineOutput("r", 0, list(b"ok!"), finish_reason="length", num_output_tokens=3))
    assert chunk.text == "ok!" and chunk.output_ids == list(b"ok!")
