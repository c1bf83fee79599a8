"""The sampler's effect, checked against transformers' logits processors on random logits: no model, no engine.

Each test drives petrel.engine.sampler.Sampler directly with small Sequences, many rows with different
parameters in ONE batch (so each row's own parameters are what counts). The reference processes each row in
petrel's documented order (the docstring at the top of sampler.py):

    logit bias -> bad words -> repetition penalty -> presence / frequency penalties -> min_tokens masking
    -> (random rows only) temperature -> top-k -> top-p -> min-p

with transformers' own classes where transformers has the step (RepetitionPenaltyLogitsProcessor,
TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper, MinPLogitsWarper) and an explicit formula where it
has not (logit bias; OpenAI's presence / frequency penalties, counted over the output tokens only; bad words;
min_tokens). What is compared is the processed distribution itself: asking for logprobs of the whole vocabulary
returns every token's log-probability, so the set of tokens that can be drawn (finite logprob) must equal the
reference's set and every logprob must equal log_softmax of the reference logits. A statistical test then checks
that the draws come from that set with the reference's frequencies.

Where petrel and transformers differ on purpose, the test follows petrel's definition and says so:
- top-p: petrel drops a token when the mass of the tokens strictly better than it EXCEEDS top_p; transformers
  drops it when that mass REACHES top_p. They differ only when the mass equals top_p exactly
  (test_top_p_keeps_the_token_whose_better_mass_equals_top_p); rows whose mass lies within float rounding of
  top_p are redrawn before comparing with transformers.
- greedy rows (temperature < 1e-5 or top_k == 1) skip the warpers: their token is the argmax of the penalised
  logits and their logprobs are log_softmax of those logits (not a point mass).
"""

from __future__ import annotations

import dataclasses
import itertools
import math

import pytest
import torch
from transformers.generation.logits_process import (
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from petrel.engine.sampler import Sampler
from petrel.engine.sequence import EngineRequest, Sequence
from petrel.model import dense_kernels
from petrel.sampling_params import SamplingParams

INF = float("-inf")
EOS = 0  # every request's end-of-sequence token (banned while min_tokens is not reached)
_ids = itertools.count()


def make_seq(params: SamplingParams, prompt: list[int], output: list[int] = (), index: int = 0) -> Sequence:
    """A sequence as the engine hands it to the sampler: its request, params and tokens (prompt + output so far)."""
    req = EngineRequest(f"s-{next(_ids)}", list(prompt), params, eos_token_ids=(EOS,))
    seq = Sequence(req, index, list(prompt) + list(output), len(prompt))
    req.seqs.append(seq)
    return seq


# ---------------------------------------------------------------------------- the reference


def penalised_reference(raw: torch.Tensor, seq: Sequence) -> torch.Tensor:
    """The row after bias, bad words, penalties and min_tokens (what greedy rows take the argmax of)."""
    p, vocab = seq.params, raw.numel()
    x = raw.float().clone().unsqueeze(0)
    input_ids = torch.tensor([seq.token_ids])
    for token, bias in (p.logit_bias or {}).items():  # OpenAI: added to the logit
        x[0, token] += bias
    for word in p.bad_words_token_ids:  # the last token, once the rest was generated
        if len(word) == 1 or seq.token_ids[len(seq.token_ids) - len(word) + 1 :] == word[:-1]:
            x[0, word[-1]] = INF
    if p.repetition_penalty != 1.0:  # every token of prompt + output
        x = RepetitionPenaltyLogitsProcessor(p.repetition_penalty)(input_ids, x)
    counts = torch.bincount(torch.tensor(seq.output_token_ids, dtype=torch.long), minlength=vocab).float()
    # OpenAI: mu[j] -= c[j] * frequency_penalty + (c[j] > 0) * presence_penalty, c counting the output tokens
    x = x - p.frequency_penalty * counts - p.presence_penalty * (counts > 0).float()
    if seq.num_output_tokens < p.min_tokens:
        x[0, list(p.stop_token_ids) + ([] if p.ignore_eos else [EOS])] = INF
    return x[0]


def reference(raw: torch.Tensor, seq: Sequence) -> tuple[torch.Tensor, bool]:
    """(the row's processed logits, whether float rounding could decide a top-p or min-p cut-off).

    Random rows go on through transformers' warpers in petrel's order. The second value is True when a token's
    strictly-better mass is within 1e-5 of top_p, or its probability within 1e-5 (relative) of the min-p
    threshold: there the two implementations' rounding, not their definitions, decides, so the caller redraws."""
    p = seq.params
    x = penalised_reference(raw, seq).unsqueeze(0)
    if p.greedy:
        return x[0], False
    ids = torch.tensor([seq.token_ids])
    x = TemperatureLogitsWarper(p.temperature)(ids, x)
    if p.top_k:
        x = TopKLogitsWarper(p.top_k)(ids, x)
    ambiguous = False
    if p.top_p < 1.0:
        probs = torch.softmax(x[0].double(), dim=0).sort(descending=True).values
        better = probs.cumsum(0) - probs
        ambiguous |= bool(((better - p.top_p).abs() < 1e-5).any())
        x = TopPLogitsWarper(p.top_p)(ids, x)
    if p.min_p > 0.0:
        probs = torch.softmax(x[0].double(), dim=0)
        threshold = p.min_p * probs.max()
        ambiguous |= bool(((probs - threshold).abs() < 1e-5 * threshold).any())
        x = MinPLogitsWarper(p.min_p)(ids, x)
    return x[0], ambiguous


def check_row(got, ref_logits: torch.Tensor, seq: Sequence, what: str) -> None:
    """The sampler's TokenLogprobs for one row (asked for the whole vocabulary) against the reference logits."""
    vocab = ref_logits.numel()
    ref = torch.log_softmax(ref_logits.double(), dim=0)
    allowed = set(torch.isfinite(ref).nonzero().flatten().tolist())
    top = dict(got.top)
    assert len(top) == vocab, what
    got_allowed = {t for t, v in top.items() if v != INF}
    assert got_allowed == allowed, (
        f"{what}: tokens that can be drawn differ from transformers': "
        f"{len(got_allowed - allowed)} extra, {len(allowed - got_allowed)} missing"
    )
    for t in allowed:
        assert top[t] == pytest.approx(ref[t].item(), rel=1e-5, abs=1e-4), (what, t)
    assert got.token_id in allowed, f"{what}: drew token {got.token_id}, which the reference filtered out"
    assert got.logprob == top[got.token_id]
    assert got.rank == 1 + sum(v > got.logprob for v in top.values()), what
    if seq.params.greedy:
        assert got.token_id == int(ref.argmax()), f"{what}: a greedy row did not take the argmax"


# ---------------------------------------------------------------------------- one batch, every kind of row


def row_params(vocab: int, gen: torch.Generator) -> list[tuple[str, dict]]:
    """(name, SamplingParams kwargs) for every processing step alone, a few pairs, and everything at once."""

    def tok() -> int:
        return int(torch.randint(1, vocab, (1,), generator=gen))

    bias = {tok(): 5.0, tok(): -3.0, tok(): 0.5}
    return [
        ("greedy", dict(temperature=0.0)),
        ("greedy top_k=1", dict(temperature=1.0, top_k=1)),
        (
            "greedy + penalties + bias",
            dict(temperature=0.0, repetition_penalty=1.4, presence_penalty=0.7, logit_bias=bias),
        ),
        ("temperature 1", dict(temperature=1.0)),
        ("temperature 0.5", dict(temperature=0.5)),
        ("temperature 1.7", dict(temperature=1.7)),
        ("top_k 5", dict(top_k=5)),
        ("top_k half", dict(top_k=vocab // 2, temperature=0.8)),
        ("top_p 0.9", dict(top_p=0.9)),
        ("top_p 0.3", dict(top_p=0.3, temperature=1.3)),
        ("top_p 0.05", dict(top_p=0.05)),
        ("min_p 0.1", dict(min_p=0.1)),
        ("min_p 0.01 t=2", dict(min_p=0.01, temperature=2.0)),
        ("repetition 1.3", dict(repetition_penalty=1.3)),
        ("repetition 0.7", dict(repetition_penalty=0.7)),
        ("presence 1.5", dict(presence_penalty=1.5)),
        ("frequency 0.8", dict(frequency_penalty=0.8)),
        ("presence/frequency negative", dict(presence_penalty=-1.0, frequency_penalty=-0.5)),
        ("logit_bias", dict(logit_bias=bias)),
        ("logit_bias -100/+100", dict(logit_bias={tok(): -100.0, tok(): 100.0})),
        ("bad words", dict(bad_words_token_ids=[[tok()], [7, tok()], [3, 4, tok()]])),
        ("min_tokens", dict(min_tokens=20, stop_token_ids=[tok()], max_tokens=30)),
        ("top_k + top_p", dict(top_k=20, top_p=0.6)),
        ("top_p + min_p", dict(top_p=0.95, min_p=0.05, temperature=1.5)),
        (
            "everything",
            dict(
                temperature=0.7,
                top_k=vocab // 3,
                top_p=0.8,
                min_p=0.02,
                repetition_penalty=1.2,
                presence_penalty=0.4,
                frequency_penalty=0.3,
                logit_bias=bias,
                bad_words_token_ids=[[tok()]],
                min_tokens=40,
                max_tokens=50,
            ),
        ),
    ]


def tokens_with_repeats(vocab: int, n: int, gen: torch.Generator) -> list[int]:
    """n tokens drawn from a dozen, so that penalties see repeated tokens (frequency counts > 1)."""
    pool = torch.randint(1, vocab, (12,), generator=gen)
    return pool[torch.randint(0, 12, (n,), generator=gen)].tolist()


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("vocab", [64, 257, 1000])
def test_processed_distribution_matches_transformers(vocab, seed):
    """One batch holding every kind of row: each row's drawable set and logprobs equal transformers'."""
    gen = torch.Generator().manual_seed(1000 * seed + vocab)
    rows = row_params(vocab, gen)
    seqs, logits, refs = [], [], []
    for i, (name, kwargs) in enumerate(rows):
        params = SamplingParams(logprobs=vocab, **kwargs)
        seq = make_seq(params, tokens_with_repeats(vocab, 9, gen), tokens_with_repeats(vocab, 14, gen))
        if name == "bad words":  # make the multi-token words' prefixes present
            seq.token_ids[-1:] = [7]
        scale = (1.0, 3.0, 6.0)[i % 3]  # flat to peaked distributions
        for _ in range(50):  # redraw rows whose top-p / min-p cut is decided by rounding
            raw = torch.randn(vocab, generator=gen) * scale
            ref, ambiguous = reference(raw, seq)
            if not ambiguous:
                break
        else:
            raise AssertionError(f"{name}: no unambiguous logits in 50 draws")
        seqs.append(seq)
        logits.append(raw)
        refs.append(ref)
    batch = torch.stack(logits)
    result = Sampler(vocab, seed=seed).sample(batch.clone(), seqs)
    assert not result.errors
    assert len(result.token_ids) == len(rows)
    for (name, _), seq, ref, got, token in zip(rows, seqs, refs, result.logprobs, result.token_ids):
        assert got is not None and got.token_id == token
        check_row(got, ref, seq, f"vocab {vocab}, row {name!r}")


def test_each_row_alone_equals_the_row_in_the_batch():
    """Batch composition changes nothing: a row's processed distribution is the same alone and beside rows with
    other temperatures, top-k, top-p, min-p and penalties."""
    vocab = 500
    gen = torch.Generator().manual_seed(7)
    rows = row_params(vocab, gen)
    seqs = [
        make_seq(
            SamplingParams(logprobs=vocab, **kw), tokens_with_repeats(vocab, 5, gen), tokens_with_repeats(vocab, 6, gen)
        )
        for _, kw in rows
    ]
    logits = torch.randn(len(rows), vocab, generator=gen) * 4
    batched = Sampler(vocab).sample(logits.clone(), seqs)
    for i, ((name, _), seq) in enumerate(zip(rows, seqs)):
        alone = Sampler(vocab).sample(logits[i : i + 1].clone(), [seq])
        a, b = dict(alone.logprobs[0].top), dict(batched.logprobs[i].top)
        assert {t for t, v in a.items() if v != INF} == {t for t, v in b.items() if v != INF}, name
        for t, v in a.items():
            assert b[t] == pytest.approx(v, rel=1e-5, abs=1e-5), (name, t)


def test_a_row_without_top_p_keeps_every_token_beside_a_top_p_row():
    """A row that asks for no nucleus filtering (top_p=1) keeps its whole vocabulary, whatever its neighbours ask.

    Peaked logits over a real-sized vocabulary (32000) put most tokens at probabilities below float32's rounding
    of the cumulative sum, so a 'mass of strictly better tokens' computed in float32 can exceed 1.0; the row must
    not be cut there just because another row of the batch has top_p < 1."""
    vocab = 32000
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(2, vocab, generator=gen) * 6
    plain = make_seq(SamplingParams(temperature=1.0, logprobs=vocab), [1, 2, 3])
    nucleus = make_seq(SamplingParams(temperature=1.0, top_p=0.5, logprobs=1), [1, 2, 3])
    result = Sampler(vocab).sample(logits.clone(), [plain, nucleus])
    top = dict(result.logprobs[0].top)
    dropped = [t for t, v in top.items() if v == INF]
    assert not dropped, f"{len(dropped)} of {vocab} tokens filtered from a top_p=1 row"
    ref = torch.log_softmax(logits[0].double(), dim=0)
    assert max(abs(top[t] - ref[t].item()) for t in range(vocab)) < 1e-3


def test_top_p_keeps_the_token_whose_better_mass_equals_top_p():
    """petrel's top-p drops a token only when the mass of the tokens strictly better than it EXCEEDS top_p.

    Two tokens of probability exactly 0.5 with top_p=0.5: the second one's strictly-better mass is 0.5, not
    more, so petrel keeps both. transformers' TopPLogitsWarper drops a token once that mass REACHES top_p and
    keeps one; this is the documented difference, at an exact tie with top_p only."""
    vocab = 8
    logits = torch.full((1, vocab), INF)
    logits[0, 2] = logits[0, 5] = 0.0
    seq = make_seq(SamplingParams(top_p=0.5, logprobs=vocab), [1])
    result = Sampler(vocab).sample(logits.clone(), [seq])
    top = dict(result.logprobs[0].top)
    assert {t for t, v in top.items() if v != INF} == {2, 5}
    assert top[2] == pytest.approx(math.log(0.5)) and top[5] == pytest.approx(math.log(0.5))
    hf = TopPLogitsWarper(0.5)(torch.tensor([[1]]), logits.clone())
    assert int(torch.isfinite(hf).sum()) == 1  # transformers keeps one of the two


def test_top_p_is_the_mass_of_strictly_better_tokens_in_float64():
    """Off exact ties, petrel's kept set is {tokens whose strictly-better mass <= top_p}, computed here in float64
    from the definition itself, for many top_p values on one row."""
    vocab = 200
    gen = torch.Generator().manual_seed(11)
    logits = torch.randn(vocab, generator=gen) * 2
    probs = torch.softmax(logits.double(), dim=0)
    order = probs.argsort(descending=True)
    better = torch.empty_like(probs)
    better[order] = probs[order].cumsum(0) - probs[order]
    top_ps = [0.01, 0.1, 0.25, 0.5, 0.75, 0.9, 0.99]
    seqs = [make_seq(SamplingParams(top_p=tp, logprobs=vocab), [1]) for tp in top_ps]
    result = Sampler(vocab).sample(logits.repeat(len(top_ps), 1), seqs)
    for tp, got in zip(top_ps, result.logprobs):
        assert not ((better - tp).abs() < 1e-6).any()  # no rounding-decided token on this row
        expected = set((better <= tp).nonzero().flatten().tolist())
        assert {t for t, v in got.top if v != INF} == expected, tp


# ---------------------------------------------------------------------------- draws


def _chi_square_p_value(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson's test of observed counts against expected probabilities; bins expecting < 5 are pooled."""
    expected = probs * counts.sum()
    small = expected < 5
    obs = torch.cat([counts[~small], counts[small].sum().view(1)])
    exp = torch.cat([expected[~small], expected[small].sum().view(1)])
    keep = exp > 0
    obs, exp = obs[keep], exp[keep]
    stat = ((obs - exp) ** 2 / exp).sum()
    dof = obs.numel() - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2.0, dtype=torch.float64), stat.double() / 2))


def test_draws_follow_the_processed_distribution():
    """Thousands of draws per configuration, the configurations interleaved in one batch: every draw is in the
    reference's allowed set, and the frequencies pass a chi-square test against the reference probabilities."""
    vocab, n = 48, 4000
    gen = torch.Generator().manual_seed(5)
    configs = [
        dict(
            temperature=0.7,
            top_k=12,
            top_p=0.9,
            min_p=0.05,
            repetition_penalty=1.3,
            presence_penalty=0.5,
            frequency_penalty=0.3,
            logit_bias={3: 2.0, 4: -2.0},
        ),
        dict(temperature=1.3, top_p=0.6),
        dict(temperature=1.0, min_p=0.1, frequency_penalty=-0.8),
    ]
    seqs, probs, rows = [], [], []
    for kwargs in configs:
        seq = make_seq(
            SamplingParams(**kwargs), tokens_with_repeats(vocab, 6, gen), tokens_with_repeats(vocab, 10, gen)
        )
        for _ in range(50):
            raw = torch.randn(vocab, generator=gen) * 1.5
            ref, ambiguous = reference(raw, seq)
            if not ambiguous:
                break
        else:
            raise AssertionError(f"{kwargs}: no unambiguous logits in 50 draws")
        seqs.append(seq)
        rows.append(raw)
        probs.append(torch.softmax(ref.double(), dim=0))
    order = [i % len(configs) for i in range(n * len(configs))]  # interleaved rows
    batch = torch.stack([rows[c] for c in order])
    result = Sampler(vocab, seed=123).sample(batch, [seqs[c] for c in order])
    tokens = torch.tensor(result.token_ids)
    which = torch.tensor(order)
    for c, p in enumerate(probs):
        counts = torch.bincount(tokens[which == c], minlength=vocab).double()
        assert counts[p == 0].sum() == 0, f"config {c} drew a filtered token"
        assert _chi_square_p_value(counts, p) > 1e-3, (c, counts.tolist(), (p * n).tolist())


@pytest.mark.parametrize("vocab", [100, 1300])
def test_a_seeded_row_draws_the_same_tokens_in_any_batch(vocab):
    """A row with its own generator (a request with a seed) draws the same token whatever else the batch holds:
    rows of the engine's generator, or rows seeded with generators of their own."""
    logits = torch.randn(1, vocab, generator=torch.Generator().manual_seed(2)) * 2
    params = SamplingParams(temperature=0.9, top_p=0.9, seed=42)

    def draws(neighbours: int, seeded: bool = False) -> list[int]:
        seq = make_seq(params, [1, 2])
        seq.generator = torch.Generator().manual_seed(42)
        others = [make_seq(SamplingParams(temperature=1.2, top_k=5), [3]) for _ in range(neighbours)]
        for k, other in enumerate(others if seeded else ()):
            other.generator = torch.Generator().manual_seed(k)
        out = []
        for _ in range(20):
            batch = torch.cat([torch.randn(neighbours, vocab), logits])
            out.append(Sampler(vocab, seed=neighbours).sample(batch, others + [seq]).token_ids[-1])
        return out

    alone = draws(0)
    assert len(set(alone)) > 1  # really random
    assert draws(3) == alone and draws(8) == alone and draws(4, seeded=True) == alone


# ---------------------------------------------------------------------------- inverse-CDF draws, greedy rows


def test_inverse_cdf_draws_follow_the_distribution_over_blocks():
    """20,000 draws (10 batches of 2,000 rows) from a vocabulary long enough for the two-level search (1300
    tokens: five blocks of 256 and a last block of 20), two configurations interleaved: a few tokens placed at
    block edges and in the last block, with top-k removing two of them, and a dense row of 1300 small
    probabilities. Each configuration's frequencies pass a chi-square test against its float64 reference, and,
    for the few-token configuration, every |freq - p| stays within 5 binomial standard deviations
    (sqrt(p (1 - p) / n) with n = 10,000 draws; a false alarm over 8 tokens has probability about 5e-6); a
    filtered token is never drawn."""
    from petrel.engine import sampler as sampler_module

    vocab = 1300
    assert vocab >= 4 * sampler_module._BLOCK and vocab % sampler_module._BLOCK  # two levels, a shorter last block
    sparse = torch.full((vocab,), INF)
    placed = {0: 0.5, 255: 1.0, 256: -0.3, 257: 0.2, 700: 1.5, 1279: 0.0, 1280: 0.7, 1299: -1.0}
    for t, v in placed.items():
        sparse[t] = v
    dense = torch.randn(vocab, generator=torch.Generator().manual_seed(8)) * 2
    configs = [(sparse, SamplingParams(temperature=0.8, top_k=6)), (dense, SamplingParams(temperature=1.0))]
    refs = []
    for raw, params in configs:
        x = raw.double() / params.temperature
        if params.top_k:
            x[x < x.topk(params.top_k).values[-1]] = INF
        refs.append(torch.softmax(x, dim=0))
    assert (refs[0] > 0).sum() == 6  # 256 and 1299 filtered by top-k
    sampler = Sampler(vocab, seed=4)
    tokens, which = [], []
    for _ in range(10):
        order = [i % 2 for i in range(2000)]
        seqs = [make_seq(configs[c][1], [1]) for c in order]
        result = sampler.sample(torch.stack([configs[c][0] for c in order]), seqs)
        tokens += result.token_ids
        which += order
    tokens, which = torch.tensor(tokens), torch.tensor(which)
    for c, p in enumerate(refs):
        counts = torch.bincount(tokens[which == c], minlength=vocab).double()
        n = counts.sum()
        assert counts[p == 0].sum() == 0, f"config {c} drew a filtered token"
        assert _chi_square_p_value(counts, p) > 1e-3, c
        if c == 0:
            freq = counts / n
            bound = 5 * (p * (1 - p) / n).sqrt()
            assert ((freq - p).abs() <= bound).all(), ((freq - p).tolist(), bound.tolist())


@pytest.mark.parametrize("vocab", [7, 300, 1024, 1300, 4096])
def test_inverse_cdf_never_draws_a_zero_probability_token_at_the_extreme_uniforms(vocab):
    """u = 0 takes the first token of positive probability and u = 1 - 2**-53 (the largest float64 below 1) the
    last one, whatever zeros surround them (at both ends, across block edges), and no u in between takes a token
    of probability 0; a row without positive mass (its logits were all -inf: NaN probabilities) gets token 0."""
    from petrel.engine.sampler import _inverse_cdf

    gen = torch.Generator().manual_seed(vocab)
    probs, first, last = [], [], []
    for _ in range(40):
        row = torch.rand(vocab, generator=gen)
        row[row < 0.9] = 0.0  # most tokens filtered
        ends = torch.randint(0, vocab, (2,), generator=gen).sort().values.tolist()
        row[: ends[0]] = 0.0
        row[ends[1] + 1 :] = 0.0
        row[ends[0]] = row[ends[1]] = 0.95
        if ends[1] - ends[0] > 1:  # tiny but positive inside
            row[torch.randint(ends[0] + 1, ends[1], (3,), generator=gen)] = 1e-30
        row = row / row.sum()
        probs.append(row)
        nonzero = (row > 0).nonzero().flatten()
        first.append(int(nonzero[0]))
        last.append(int(nonzero[-1]))
    one = torch.zeros(vocab)
    one[vocab - 1] = 1.0  # all the mass on the very last token
    probs.append(one)
    first.append(vocab - 1)
    last.append(vocab - 1)
    probs = torch.stack(probs)
    n = probs.shape[0]
    low = _inverse_cdf(probs, torch.zeros(n, dtype=torch.float64))
    high = _inverse_cdf(probs, torch.full((n,), 1 - 2**-53, dtype=torch.float64))
    assert low.tolist() == first
    assert high.tolist() == last
    for u in torch.rand(50, generator=gen, dtype=torch.float64):  # anywhere between: a token of positive mass
        drawn = _inverse_cdf(probs, u.expand(n))
        assert (probs.gather(1, drawn.unsqueeze(1)) > 0).all()
    nan_row = torch.softmax(torch.full((1, vocab), INF), dim=1)
    assert _inverse_cdf(nan_row, torch.full((1,), 0.5, dtype=torch.float64)).tolist() == [0]


@pytest.mark.parametrize("u", [0.0, 1 - 2**-53])
def test_a_masked_token_is_never_sampled_even_at_the_extreme_uniforms(monkeypatch, u):
    """Through Sampler.sample, with every uniform forced to an end of [0, 1): top-k, top-p, min-p and -inf
    logits remove tokens, and the token drawn is the first (u = 0) or last (u -> 1) of the kept ones."""
    vocab = 2000
    gen = torch.Generator().manual_seed(21)
    logits = torch.randn(4, vocab, generator=gen) * 3
    logits[3, :1500] = INF
    logits[3, 1990:] = INF
    params = [
        SamplingParams(temperature=0.7, top_k=10),
        SamplingParams(top_p=0.3),
        SamplingParams(min_p=0.2, temperature=1.5),
        SamplingParams(temperature=1.0),
    ]
    seqs = [make_seq(p, [1]) for p in params]
    seqs[1].generator = torch.Generator().manual_seed(3)  # a seeded row draws from its own generator
    asked = [make_seq(dataclasses.replace(p, logprobs=vocab), [1]) for p in params]
    kept = [{t for t, v in row.top if v != INF} for row in Sampler(vocab).sample(logits.clone(), asked).logprobs]
    real_rand = torch.rand
    monkeypatch.setattr(torch, "rand", lambda *a, **k: real_rand(*a, **k).fill_(u))
    tokens = Sampler(vocab).sample(logits.clone(), seqs).token_ids
    monkeypatch.undo()
    for token, allowed in zip(tokens, kept):
        assert token == (min(allowed) if u == 0.0 else max(allowed)), (token, sorted(allowed)[:3])


def test_argmax_rows_equals_torch_argmax_on_ties_nan_and_a_shorter_last_block():
    from petrel.engine.sampler import _argmax_rows

    vocab = 1300  # five blocks of 256 and a last one of 20
    gen = torch.Generator().manual_seed(5)
    x = torch.randint(-3, 3, (12, vocab), generator=gen).float()  # many ties of the maximum
    x[1, 1290] = 9.0  # the maximum alone in the last block
    x[2, [10, 700, 1295]] = 9.0  # tied across blocks: the first
    x[3, [255, 256]] = 9.0  # tied across a block edge
    x[4, [1280, 1299]] = 9.0  # tied inside the last block
    x[5, [300, 900]] = float("nan")  # NaN counts as the maximum: the first NaN
    x[6, 1299] = float("nan")
    x[7] = INF  # all -inf: token 0
    x[8] = float("inf")
    x[9, [5, 1299]] = float("inf")
    assert _argmax_rows(x).tolist() == x.argmax(dim=1).tolist()
    assert _argmax_rows(x[:, :1280]).tolist() == x[:, :1280].argmax(dim=1).tolist()  # whole blocks only


@pytest.mark.parametrize("kernel", [True, False])
def test_greedy_tokens_and_logprobs_against_float64(kernel, monkeypatch):
    """Greedy rows (with and without logits-changing parameters, beside a random row): the token is torch.argmax
    of the processed logits, bit for bit, and the logprob is float64 log_softmax's within 1e-5; with the C kernel
    (dense_kernels.greedy_rows, where the kernels run) and with torch's operations."""
    if not kernel:
        monkeypatch.setattr(dense_kernels, "greedy_rows", lambda logits: None)
    vocab = 5000
    gen = torch.Generator().manual_seed(9)
    logits = torch.randn(6, vocab, generator=gen) * 4
    logits[1, [17, 4000]] = 30.0  # a tie: the first
    params = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.0, repetition_penalty=1.5, logit_bias={42: 20.0}),
        SamplingParams(temperature=1.0, top_k=1),
        SamplingParams(temperature=0.9),
        SamplingParams(temperature=0.0, logprobs=3),
    ]
    seqs = [make_seq(p, tokens_with_repeats(vocab, 8, gen), tokens_with_repeats(vocab, 5, gen)) for p in params]
    for rows in (range(6), [0, 1, 2, 3, 5]):  # with and without a random row in the batch
        batch = logits[list(rows)]
        result = Sampler(vocab).sample(batch.clone(), [seqs[i] for i in rows])
        for j, i in enumerate(rows):
            if i == 4:
                continue
            ref = penalised_reference(logits[i], seqs[i])
            assert result.token_ids[j] == int(ref.argmax()), i
            want = float(torch.log_softmax(ref.double(), dim=0)[result.token_ids[j]])
            assert abs(result.sampled_logprobs[j] - want) < 1e-5, i
        assert result.token_ids[1] == 17
        assert result.logprobs[-1].logprob == result.sampled_logprobs[-1]


def test_a_failed_batch_is_chosen_again_row_by_row_from_the_unchanged_logits():
    """A row whose logit_bias names a token past the vocabulary makes the batch raise after other rows' bias
    and penalties were applied; the rows are then chosen one at a time from the logits as they came in (the
    bias counted once), so the other rows get what they get alone, and only that row fails."""
    vocab = 2000
    gen = torch.Generator().manual_seed(13)
    logits = torch.randn(3, vocab, generator=gen) * 2
    params = [
        SamplingParams(temperature=0.0, logit_bias={7: 6.0}, repetition_penalty=1.3),
        SamplingParams(temperature=0.0, logit_bias={vocab + 5: 1.0}),
        SamplingParams(temperature=0.0, logit_bias={9: 7.0}),
    ]
    seqs = [make_seq(p, [1, 2, 7]) for p in params]
    before = logits.clone()
    result = Sampler(vocab).sample(logits, seqs)
    assert torch.equal(logits, before)
    assert set(result.errors) == {1} and "sampling failed" in result.errors[1]
    for i in (0, 2):
        alone = Sampler(vocab).sample(before[i : i + 1].clone(), [seqs[i]])
        assert (result.token_ids[i], result.sampled_logprobs[i]) == (alone.token_ids[0], alone.sampled_logprobs[0])
        ref = penalised_reference(before[i], seqs[i])
        assert abs(result.sampled_logprobs[i] - float(torch.log_softmax(ref.double(), 0)[int(ref.argmax())])) < 1e-5


def test_bans_go_into_the_logits_and_a_second_choice_from_them_is_the_same():
    """min_tokens and bad words only ban (-inf), in the input itself (no copy of a [rows, vocab] tensor a step):
    the banned tokens are never chosen, rows without bans keep theirs, and choosing again from the same input (what
    a failed batch does row by row) gives the same tokens and logprobs."""
    vocab = 500
    logits = torch.randn(3, vocab, generator=torch.Generator().manual_seed(5))
    logits[:, EOS] = logits[:, 11] = logits[:, 12] = 50.0  # EOS, a stop token and a bad word's end lead every row
    params = [
        SamplingParams(temperature=0.0, min_tokens=5, stop_token_ids=[11], bad_words_token_ids=[[12]]),
        SamplingParams(temperature=0.0, min_tokens=5, stop_token_ids=[11], logprobs=2),
        SamplingParams(temperature=0.0),  # no bans: EOS stays its choice
    ]
    seqs = [make_seq(p, [1, 2, 3]) for p in params]
    first = Sampler(vocab).sample(logits, seqs)
    assert first.token_ids[0] not in (EOS, 11, 12) and first.token_ids[1] == 12 and first.token_ids[2] == EOS
    assert logits[0, EOS] == logits[0, 11] == logits[0, 12] == INF and logits[1, 11] == INF
    assert logits[2, EOS] == 50.0  # the row without bans is left as it came
    again = Sampler(vocab).sample(logits, seqs)
    assert again.token_ids == first.token_ids and again.sampled_logprobs == first.sampled_logprobs
    assert again.logprobs[1] == first.logprobs[1] and first.logprobs[1].top[0][0] == 12
