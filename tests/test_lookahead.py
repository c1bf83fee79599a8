"""Lookahead decoding (speculative_config method 'lookahead') on the tiny random Llama: greedy tokens and logprobs
equal plain decoding's in mixed batches, under preemption and at every stop; a seeded sampled request draws the
same tokens as without drafts; tokens sampled while walking a draft tree keep the target's distribution; the
window and the n-gram pool behave as TensorRT-LLM's; bad sizes are refused by name."""

from __future__ import annotations

import pytest
import torch
from test_speculative import _chi_square_p_value, batch_requests, drain, run, tokens_of
from tiny_llama import _tokens

from petrel.config import EngineConfig, SpeculativeConfig
from petrel.engine.draft_tree import DraftTree
from petrel.engine.engine_core import EngineCore
from petrel.engine.lookahead import LookaheadProposer, NgramPool, lookahead_draft_len
from petrel.engine.model_runner import kv_bytes_per_block
from petrel.engine.sequence import EngineRequest, Sequence
from petrel.sampling_params import SamplingParams

SIZES = [(4, 3, 4), (5, 4, 5), (2, 2, 1), (1, 3, 2)]


def make_core(t, sizes: tuple[int, int, int] | None, num_blocks: int = 512, block_size: int = 4) -> EngineCore:
    spec = None
    if sizes is not None:
        w, n, g = sizes
        spec = SpeculativeConfig("lookahead", max_window_size=w, max_ngram_size=n, max_verification_set_size=g)
    config = EngineConfig(
        block_size=block_size,
        kv_cache_memory=num_blocks * kv_bytes_per_block(t.cfg, block_size, torch.float32),
        speculative_config=spec,
    )
    return EngineCore(config, t.model, t.cfg)


def counting_slot_copies(core: EngineCore) -> list[int]:
    """Record how many K/V slots each step's accepted tree nodes moved."""
    counts, move = [], core.runner.move_slots
    core.runner.move_slots = lambda copies: (counts.append(len(copies)), move(copies))
    return counts


def greedy(max_tokens: int, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kw)


@pytest.fixture(scope="module")
def plain_outputs(tiny):
    outs, _ = run(make_core(tiny(2, False), None), batch_requests())
    return outs


@pytest.mark.parametrize("sizes", SIZES, ids=[f"W{w}N{n}G{g}" for w, n, g in SIZES])
def test_greedy_tokens_and_logprobs_equal_plain_decoding(tiny, plain_outputs, sizes):
    """The batch mixes short and repetitive prompts, n=2 and beam search (which never drafts)."""
    outs, stats = run(make_core(tiny(2, False), sizes), batch_requests())
    assert outs.keys() == plain_outputs.keys()
    for key, expected in plain_outputs.items():
        got = outs[key]
        assert tokens_of(got) == tokens_of(expected), key
        assert got[-1].finish_reason == expected[-1].finish_reason
        lps = [lp for o in got for lp in (o.new_logprobs or [])]
        ref = [lp for o in expected for lp in (o.new_logprobs or [])]
        assert [(a.token_id, a.rank, [i for i, _ in a.top]) for a in lps] == [
            (b.token_id, b.rank, [i for i, _ in b.top]) for b in ref
        ]
        assert all(a.logprob == pytest.approx(b.logprob, abs=1e-4) for a, b in zip(lps, ref))
    assert sum(s.num_draft_tokens for s in stats) > 0
    assert sum(s.num_accepted_tokens for s in stats) > 0


def long_requests(max_tokens: int = 80) -> list:
    return [(f"x{i}", _tokens(8, 500 + i), greedy(max_tokens, logprobs=1)) for i in range(4)]


def test_accepted_tree_nodes_move_to_their_slots_and_save_steps(tiny):
    """Long greedy runs, whose outputs fall into cycles the window and the pool find: nodes accepted off the
    first branch had their K/V copied to their positions' slots (across block boundaries, blocks of 4), the
    later tokens (which attend to them) are still plain decoding's, in fewer steps."""
    t = tiny(2, False)
    plain, plain_stats = run(make_core(t, None), long_requests())
    core = make_core(t, (5, 4, 5))
    copies = counting_slot_copies(core)
    outs, stats = run(core, long_requests())
    for key in plain:
        assert tokens_of(outs[key]) == tokens_of(plain[key]), key
    assert sum(copies) > 0
    assert len(stats) < 0.85 * len(plain_stats)


def test_preemption_with_lookahead_gives_the_same_tokens(tiny):
    t = tiny(2, False)
    reqs = long_requests(40) + [(f"p{i}", _tokens(6, 600 + i), greedy(40)) for i in range(3)]
    plain, _ = run(make_core(t, None), reqs)
    core = make_core(t, (4, 3, 4), num_blocks=40)
    outs, _ = run(core, reqs)
    assert core.scheduler.num_preemptions > 0
    for key in plain:
        assert tokens_of(outs[key]) == tokens_of(plain[key]), key


def test_max_tokens_stop_tokens_and_stop_words_cut_where_plain_decoding_does(tiny):
    t = tiny(2, False)
    prompt = _tokens(8, 501)
    free = tokens_of(run(make_core(t, None), [("f", prompt, greedy(60))])[0][("f", 0)])
    for params in [
        greedy(7),
        greedy(60, stop_token_ids=[free[30]]),
        greedy(60, stop_token_sequences=[free[40:42]]),
    ]:
        expected = tokens_of(run(make_core(t, None), [("e", prompt, params)])[0][("e", 0)])
        got = tokens_of(run(make_core(t, (5, 4, 5)), [("e", prompt, params)])[0][("e", 0)])
        assert got == expected
        assert len(got) < 60


def test_seeded_sampled_requests_draw_the_same_tokens_as_without_lookahead(tiny):
    """A sampled row takes no acceptance draw: each emitted token is the row's own draw from its seeded generator,
    so lookahead changes how many steps a seeded request takes, never its tokens."""
    t = tiny(2, False)
    reqs = [
        (f"s{i}", _tokens(8, 500 + i), SamplingParams(temperature=0.3, seed=i, max_tokens=60, ignore_eos=True))
        for i in range(4)
    ]
    plain, plain_stats = run(make_core(t, None), reqs)
    outs, stats = run(make_core(t, (5, 4, 5)), reqs)
    for key in plain:
        assert tokens_of(outs[key]) == tokens_of(plain[key]), key
    assert sum(s.num_accepted_tokens for s in stats) > 0
    assert len(stats) < len(plain_stats)


def test_sampled_tokens_walking_a_draft_tree_keep_the_target_distribution(tiny):
    """Every third output token of many seeded requests is emitted from a draft tree's second level (the tree
    holds the top 4 tokens after the first output token, each with its own top 4): the walk samples each node's
    row and goes on when the draw is a child, so the third token's frequencies match the exact marginal
    sum p(t1) p(t2 | t1) p(t3 | t1, t2) from transformers."""
    t = tiny(2, False)
    prompt = _tokens(6, 401)
    k = 4

    def top(ids):
        logits = t.hf_logits(ids)[-1].double()
        logits[logits < logits.topk(k).values[-1]] = float("-inf")
        return torch.softmax(logits, dim=0)

    first = top(prompt)
    second = {a: top(prompt + [a]) for a in first.nonzero().flatten().tolist()}
    third = {(a, b): top(prompt + [a, b]) for a, p in second.items() for b in p.nonzero().flatten().tolist()}
    core = make_core(t, (5, 4, 5))

    def tree(seq: Sequence, budget: int) -> DraftTree:
        draft = DraftTree()
        a = seq.token_ids[-1]
        for b in second[a].nonzero().flatten().tolist():
            for c in third[(a, b)].nonzero().flatten().tolist():
                draft.add_path([b, c], budget)
        return draft

    core.drafting.lookahead.tree = tree
    n = 1200
    params = dict(temperature=1.0, top_k=k, max_tokens=3, ignore_eos=True)
    outs, stats = run(core, [(i, prompt, SamplingParams(seed=i, **params)) for i in range(n)])
    # the 2nd and 3rd tokens come from tree nodes (all but a few steps' worth, whose token budget, shared with
    # prompts, left room for part of the tree only)
    assert sum(s.num_accepted_tokens for s in stats) > 0.95 * 2 * n
    marginal = sum(first[a] * second[a][b] * third[(a, b)] for (a, b) in third)
    counts = torch.bincount(torch.tensor([tokens_of(outs[(i, 0)])[2] for i in range(n)]), minlength=t.cfg.vocab_size)
    assert counts[marginal == 0].sum() == 0
    assert _chi_square_p_value(counts.double(), marginal) > 1e-3


def test_per_request_sizes_within_the_engine_maximum(tiny):
    """A request's own lookahead_config: (1, 1, 0) decodes plainly, smaller sizes draft smaller trees, sizes past
    the engine's maximum (or without lookahead in the engine) are refused by name."""
    t = tiny(2, False)
    prompt = _tokens(8, 502)
    expected = tokens_of(run(make_core(t, None), [("e", prompt, greedy(40))])[0][("e", 0)])
    core = make_core(t, (4, 3, 4))
    for sizes in [(1, 1, 0), (2, 2, 1), (4, 3, 4)]:
        core.add_request(EngineRequest("r", prompt, greedy(40, lookahead_config=sizes), eos_token_ids=(2,)))
        outs, stats = drain(core)
        assert tokens_of(outs[("r", 0)]) == expected
        biggest = max(s.num_draft_tokens for s in stats)
        assert biggest <= lookahead_draft_len(*sizes)
        if sizes == (1, 1, 0):
            assert biggest == 0
    with pytest.raises(ValueError, match="lookahead_config"):
        core.validate(prompt, greedy(4, lookahead_config=(5, 3, 4)))
    with pytest.raises(ValueError, match="lookahead_config"):
        make_core(t, None).validate(prompt, greedy(4, lookahead_config=(2, 2, 1)))


@pytest.mark.parametrize(
    "value",
    [(0, 3, 4), (4, 0, 4), (4, 3, -1), (2, 1, 0), (1, 1, 1), (4, 3), "443", (4.0, 3, 4)],
)
def test_bad_lookahead_config_is_a_value_error_naming_the_field(value):
    with pytest.raises(ValueError, match="lookahead_config"):
        SamplingParams(lookahead_config=value)


@pytest.mark.parametrize("sizes", [(0, 3, 4), (4, 1, 4), (4, 3, 0), (4, True, 4)])
def test_bad_engine_sizes_are_a_value_error_naming_the_fields(sizes):
    w, n, g = sizes
    with pytest.raises(ValueError, match="max_window_size"):
        EngineConfig(
            speculative_config={
                "method": "lookahead",
                "max_window_size": w,
                "max_ngram_size": n,
                "max_verification_set_size": g,
            }
        )


def test_pool_keeps_the_latest_distinct_ngrams_of_each_key():
    pool = NgramPool(n=3, size=2)
    pool.add_tokens([1, 2, 3, 1, 2, 4, 1, 5, 6, 1, 2, 3], 0)
    assert pool.guesses(1) == [(2, 3), (5, 6)]  # latest first: (2, 4) fell out, (2, 3) came back
    assert pool.guesses(2) == [(4, 1), (3, 1)]
    assert pool.guesses(9) == []


def test_the_tree_holds_candidates_and_window_rows_and_the_window_moves_on():
    """The tree: the candidates after the last token (the prompt's n-grams) and every window row's path (row 0
    after the last token, row i after the first tokens of rows 1..i), shared prefixes merged, within the budget.
    After the step each row takes the greedy token after its last node; a full row first gives its n-gram (its
    tokens and that output) to the pool and drops its first token."""
    w, n, g = 3, 3, 2
    proposer = LookaheadProposer(w, n, g)
    prompt = [7, 8, 9, 7, 8, 5, 7]
    seq = Sequence(EngineRequest("r", prompt, greedy(10)), 0, prompt, len(prompt))
    tree = proposer.tree(seq, lookahead_draft_len(w, n, g))
    state = seq.spec.lookahead
    assert state.pool.guesses(7) == [(8, 5), (8, 9)]
    r1, r2 = state.rows[1][0], state.rows[2][0]
    paths = {tuple(tree.path_tokens(node)) for node in range(1, len(tree) + 1)}
    assert {(8, 5), (8, 9), (r1,), (r1, r2)} <= paths
    assert len(paths) == len(tree) <= lookahead_draft_len(w, n, g)  # no path twice
    ends = state.row_ends
    assert ends[0] == 0 and tree.path_tokens(ends[1]) == [r1] and tree.path_tokens(ends[2]) == [r1, r2]
    proposer.observe(seq, {node: 100 + node for node in ends.values()})  # filling: each row grows
    assert state.rows == [[7, 100], [r1, 100 + ends[1]], [r2, 100 + ends[2]]]
    tree = proposer.tree(seq, lookahead_draft_len(w, n, g))  # full rows now
    ends = state.row_ends
    a1, a2 = state.rows[1][1], state.rows[2][1]
    assert [tree.path_tokens(ends[i]) for i in range(3)] == [[100], [r1, a1], [r1, r2, a2]]
    proposer.observe(seq, {node: 200 + node for node in ends.values()})
    b = [200 + ends[i] for i in range(3)]
    assert state.rows == [[100, b[0]], [a1, b[1]], [a2, b[2]]]
    assert (100, b[0]) in state.pool.guesses(7)  # row 0's n-gram starts at the last token
    assert (a1, b[1]) in state.pool.guesses(r1) and (a2, b[2]) in state.pool.guesses(r2)
    assert len(proposer.tree(seq, 2)) <= 2  # a small budget: only whole paths that fit


def test_executor_lookahead_under_an_executor_wide_maximum(tiny, tokenizer_dir):
    """ExecutorConfig.decoding_config's lookahead_decoding_config is the maximum; a Request's lookahead_config picks
    its own sizes within it; greedy tokens are the plain executor's; sizes past the maximum are an error Response
    naming the field, and a bad decoding_config stops the Executor from starting."""
    from test_executor_spec import NO_EOS, PROMPT, _engine_config, collect

    from petrel.executor import DecodingConfig, Executor, ExecutorConfig, LookaheadDecodingConfig, Request

    def tokens(ex, **fields):
        rid = ex.enqueue_request(Request(list(PROMPT), 30, bad_words=NO_EOS, **fields))
        last = collect(ex, rid)[-1]
        assert not last.has_error(), last.error_msg
        return last.result.output_token_ids[0]

    plain = Executor(_engine_config(tiny, tokenizer_dir))
    try:
        expected = tokens(plain)
        refused = collect(
            plain, plain.enqueue_request(Request(list(PROMPT), 4, lookahead_config=LookaheadDecodingConfig(2, 2, 1)))
        )
        assert "lookahead_config" in refused[-1].error_msg
    finally:
        plain.shutdown()
    config = ExecutorConfig(decoding_config=DecodingConfig(lookahead_decoding_config=LookaheadDecodingConfig(4, 3, 4)))
    ex = Executor(_engine_config(tiny, tokenizer_dir), executor_config=config)
    try:
        assert tokens(ex) == expected
        assert tokens(ex, lookahead_config=LookaheadDecodingConfig(2, 2, 1)) == expected
        assert ex.engine.call(lambda core: core.num_draft_tokens) > 0
        for bad in (LookaheadDecodingConfig(5, 3, 4), LookaheadDecodingConfig(2, 1, 1), (4, 3, 4)):
            rid = ex.enqueue_request(Request(list(PROMPT), 4, lookahead_config=bad))
            assert "lookahead_config" in collect(ex, rid)[-1].error_msg
    finally:
        ex.shutdown()
    for decoding in (
        DecodingConfig(decoding_mode="medusa"),
        DecodingConfig(decoding_mode="lookahead"),
        DecodingConfig(lookahead_decoding_config=LookaheadDecodingConfig(0, 3, 4)),
    ):
        with pytest.raises(ValueError, match="decoding_config"):
            Executor(_engine_config(tiny, tokenizer_dir), executor_config=ExecutorConfig(decoding_config=decoding))


def test_tensorrt_llm_style_config_objects_are_taken_as_sizes():
    """LLM(speculative_config=LookaheadDecodingConfig(W, N, G)) and SamplingParams(lookahead_config=...) take
    TensorRT-LLM's (and petrel.executor's) config object as well as a dict or a tuple."""
    from petrel.executor import LookaheadDecodingConfig

    spec = EngineConfig(speculative_config=LookaheadDecodingConfig(3, 4, 2)).speculative_config
    assert (spec.method, spec.lookahead_sizes) == ("lookahead", (3, 4, 2))
    assert SamplingParams(lookahead_config=LookaheadDecodingConfig(2, 2, 1)).lookahead_config == (2, 2, 1)
    assert SamplingParams(lookahead_config=[2, 3, 0]).lookahead_config == (2, 3, 0)
