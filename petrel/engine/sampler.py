"""Logits -> tokens and logprobs for a whole step at once.

Order: logits processors (per request, then the engine's batched post-processor), logit bias, bad words,
penalties, min_tokens masking, the grammar masks of guided sequences; then beam-search rows report their
best candidates, greedy rows take argmax, and random rows go through temperature, top-k, top-p, min-p and
inverse-CDF sampling with one uniform draw per row from the row's generator (so a seeded sequence, which has
its own, is reproducible in any batch). Logprobs come from the same processed distribution the token was drawn
from, with the token's rank; a row that asks for none still gets its token's logprob (cumulative_logprob).

The logits may live on a GPU: a step without logprobs, beams, drafts or logits processors reads the device once
(the chosen tokens with their logprobs, in one transfer); what decides the path is known on the host.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from petrel.engine.grammar import apply_grammar_masks
from petrel.engine.post_processors import BatchedPostProcessor, run_post_processors
from petrel.engine.sequence import Sequence
from petrel.model import dense_kernels


@dataclass
class TokenLogprobs:
    """One sampled position: the token's logprob and rank, and the top-k alternatives (id, logprob)."""

    token_id: int
    logprob: float
    rank: int
    top: list[tuple[int, float]]


@dataclass
class SampleResult:
    token_ids: list[int]
    logprobs: list[TokenLogprobs | None]
    # beam-search rows: best (token, logprob) candidates, and the row's log-distribution when logprobs are asked
    beam_candidates: dict[int, list[tuple[int, float]]] = field(default_factory=dict)
    beam_logp: dict[int, torch.Tensor] = field(default_factory=dict)
    errors: dict[int, str] = field(default_factory=dict)  # rows whose request failed (a processor raised)
    # rows whose every token was banned (bad words, min_tokens, a grammar): their token_ids entry is no token
    no_token_left: set[int] = field(default_factory=set)
    # per row, the chosen token's logprob under the processed distribution (None for beam rows): what
    # cumulative_logprob sums, whether or not logprobs were asked for
    sampled_logprobs: list[float | None] = field(default_factory=list)


def token_logprobs(logp_row: torch.Tensor, token: int, k: int) -> TokenLogprobs:
    """The token's logprob and rank in one log-distribution row, with the top-k alternatives."""
    return _gather_logprobs(logp_row.unsqueeze(0), torch.tensor([token], device=logp_row.device), [k])[0]


def prompt_logprobs(logits: torch.Tensor, next_tokens: list[int], k: int) -> list[TokenLogprobs]:
    """Logprobs of the actual next prompt tokens under the raw distribution, with top-k and rank."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    return _gather_logprobs(logp, torch.tensor(next_tokens, device=logp.device), [k] * len(next_tokens))


def _gather_logprobs(logp: torch.Tensor, tokens: torch.Tensor, ks: list[int]) -> list[TokenLogprobs]:
    chosen = logp.gather(1, tokens.unsqueeze(1))
    ranks = (logp > chosen).sum(dim=1) + 1
    kmax = max(ks)
    top_vals, top_ids = logp.topk(kmax, dim=1) if kmax else (None, None)
    out = []
    chosen, ranks, tokens = chosen.squeeze(1).tolist(), ranks.tolist(), tokens.tolist()
    for i, k in enumerate(ks):
        top = list(zip(top_ids[i, :k].tolist(), top_vals[i, :k].tolist())) if k else []
        out.append(TokenLogprobs(tokens[i], chosen[i], ranks[i], top))
    return out


class Sampler:
    def __init__(self, vocab_size: int, seed: int = 0, batched_post_processor: BatchedPostProcessor | None = None):
        self.vocab_size = vocab_size
        self.seed = seed
        self.generator = torch.Generator().manual_seed(seed)
        self._device_generators: dict[torch.device, torch.Generator] = {}
        self.batched_post_processor = batched_post_processor
        self._scratch_buffers: dict[str, torch.Tensor] = {}

    def _scratch(self, name: str, like: torch.Tensor) -> torch.Tensor:
        """An uninitialised tensor shaped like `like`, whose memory a CPU sampler keeps from step to step for one
        of its few [rows, vocab] intermediates: a fresh 12 MB tensor per step (64 rows x 49152) is paid in page
        faults, measured costlier than the softmax written into it. Elsewhere the device's allocator caches, and
        an intermediate over _SCRATCH_MAX_ELEMENTS (a big batch of a big vocabulary) is not kept."""
        if like.device.type != "cpu" or like.numel() > _SCRATCH_MAX_ELEMENTS:
            return torch.empty_like(like)
        buf = self._scratch_buffers.get(name)
        if buf is None or buf.numel() < like.numel() or buf.dtype != like.dtype:
            buf = self._scratch_buffers[name] = torch.empty(like.numel(), dtype=like.dtype)
        return buf[: like.numel()].view(like.shape)

    def _engine_generator(self, device: torch.device) -> torch.Generator:
        """The generator of rows without a seed of their own, on the logits' device."""
        if device.type == "cpu":
            return self.generator
        if device not in self._device_generators:
            self._device_generators[device] = torch.Generator(device).manual_seed(self.seed)
        return self._device_generators[device]

    def _run_processors(self, logits: torch.Tensor, seqs: list[Sequence]) -> dict[int, str]:
        """Run the requests' logits processors, then the executor's post-processors (named ones, then the batched
        one), each getting a request's beams in one [beam_width, vocab] tensor. A processor that raises fails its
        own rows only: the returned {row: error} lets the core end those requests while the rest of the step
        goes on."""
        errors: dict[int, str] = {}
        for i, seq in enumerate(seqs):
            try:
                for fn in seq.params.logits_processors or ():
                    logits[i] = fn(seq.output_token_ids, logits[i])
            except Exception as exc:  # noqa: BLE001 - user code: fail that request, not the step
                errors[i] = f"logits processor failed: {type(exc).__name__}: {exc}"
        run_post_processors(logits, seqs, self.batched_post_processor, errors)
        return errors

    def _ban_bad_words(self, logits: torch.Tensor, seqs: list[Sequence]) -> None:
        """A bad word's last token is banned when the sequence already ends with the rest of it."""
        for i, seq in enumerate(seqs):
            words = seq.params.bad_words_token_ids
            if not words:
                continue
            tokens = seq.token_ids
            banned = [w[-1] for w in words if len(w) == 1 or tokens[len(tokens) - len(w) + 1 :] == w[:-1]]
            if banned:
                logits[i, banned] = float("-inf")

    def sample(
        self, logits: torch.Tensor, seqs: list[Sequence], drafts: list[int | None] | None = None
    ) -> SampleResult:
        """drafts: a speculative draft token per row (or None). A greedy row ignores it (the caller compares);
        a random row accepts it with its probability, else samples from the rest of the distribution.

        One request's failure fails that request only: a logits processor that raises marks its row, and if
        choosing the tokens raises for the batch, the rows are chosen again one at a time, so the rows that
        raise alone are the only ones marked (in result.errors) while the others get their tokens."""
        logits = logits.float()
        errors = self._run_processors(logits, seqs)
        for i in errors:  # keep the failed rows harmless for the rest of the step
            logits[i] = 0.0
        try:
            result = self._choose(logits, seqs, drafts)
        except Exception:  # noqa: BLE001 - find the rows that fail on their own
            result = self._choose_row_by_row(logits, seqs, drafts)
        for i, message in errors.items():
            result.errors.setdefault(i, message)
        return result

    def _choose_row_by_row(
        self, logits: torch.Tensor, seqs: list[Sequence], drafts: list[int | None] | None
    ) -> SampleResult:
        """_choose for each row alone; a row that raises gets an error instead of a token."""
        result = SampleResult([0] * len(seqs), [None] * len(seqs), sampled_logprobs=[None] * len(seqs))
        for i, seq in enumerate(seqs):
            try:
                row = self._choose(logits[i : i + 1], [seq], [drafts[i]] if drafts else None)
            except Exception as exc:  # noqa: BLE001 - this request's own failure
                result.errors[i] = f"sampling failed: {type(exc).__name__}: {exc}"
                continue
            result.token_ids[i], result.logprobs[i] = row.token_ids[0], row.logprobs[0]
            result.sampled_logprobs[i] = row.sampled_logprobs[0]
            if row.no_token_left:
                result.no_token_left.add(i)
            if 0 in row.beam_candidates:
                result.beam_candidates[i] = row.beam_candidates[0]
            if 0 in row.beam_logp:
                result.beam_logp[i] = row.beam_logp[0]
        return result

    def _choose(self, logits: torch.Tensor, seqs: list[Sequence], drafts: list[int | None] | None) -> SampleResult:
        """Bias, bad words, penalties, min_tokens and grammar masks, then each row's token. A failed batch is
        chosen again row by row from the same input, so what this does to it must come out the same done twice:
        bans (-inf for bad words, min_tokens and grammars) go into the input itself, but where a row adds to its
        logits (bias, penalties) the whole step works on a copy; the random rows' temperature / top-k / top-p /
        min-p make a new tensor of their own. A row whose every token is banned is in result.no_token_left: what was
        drawn for it is no token (_no_token_left)."""
        params = [s.params for s in seqs]
        n = len(seqs)
        guided = {i: seq.grammar for i, seq in enumerate(seqs) if seq.grammar is not None}
        min_tokens = [i for i, (seq, p) in enumerate(zip(seqs, params)) if seq.num_output_tokens < p.min_tokens]
        # rows whose bans might leave no token: checked once the bans are in
        bannable = sorted(
            i
            for i in {*guided, *min_tokens, *(i for i, p in enumerate(params) if p.bad_words_token_ids)}
            if not params[i].use_beam_search
        )
        if any(p.logit_bias or p.needs_penalties for p in params):
            logits = self._scratch("logits", logits).copy_(logits)
        for i, p in enumerate(params):
            if p.logit_bias:
                ids = torch.tensor(list(p.logit_bias), device=logits.device)
                logits[i, ids] += torch.tensor(list(p.logit_bias.values()), device=logits.device)
        self._ban_bad_words(logits, seqs)
        if any(p.needs_penalties for p in params):
            self._apply_penalties(logits, seqs)
        banned_rows, banned_ids = [], []  # min_tokens: each row's stop tokens (and EOS) banned, in one operation
        for i in min_tokens:
            p = params[i]
            banned = list(p.stop_token_ids) + ([] if p.ignore_eos else list(seqs[i].request.eos_token_ids))
            banned_rows += [i] * len(banned)
            banned_ids += banned
        if banned_ids:
            logits[banned_rows, banned_ids] = float("-inf")
        if guided:
            apply_grammar_masks(logits, guided)
        no_token_left = _no_token_left(logits, bannable) if bannable else None

        beams = [i for i, p in enumerate(params) if p.use_beam_search]
        random_rows = [i for i, p in enumerate(params) if not (p.greedy or p.use_beam_search)]
        plain = [i for i, p in enumerate(params) if not p.use_beam_search]
        wanted = [i for i in plain if params[i].logprobs is not None]  # the top-k and rank asked for
        sampled_lp = torch.zeros(n, device=logits.device)  # the chosen token's logprob, per plain row
        greedy = _greedy_rows(logits) if len(random_rows) < n else None  # (argmax, its logprob) of every row
        tokens = greedy[0] if greedy else None
        if random_rows:
            sampled, random_lp, processed = self._sample_random(
                logits if len(random_rows) == n else logits[random_rows],
                [seqs[i] for i in random_rows],
                [drafts[i] for i in random_rows] if drafts else None,
            )
            if tokens is None:
                tokens, sampled_lp = sampled, random_lp
            else:
                tokens[random_rows] = sampled
                sampled_lp[random_rows] = random_lp
        random_set = set(random_rows)
        greedy_rows = [i for i in plain if i not in random_set and params[i].logprobs is None]
        if greedy_rows:  # their token's logprob only (no top-k or rank asked for)
            if len(greedy_rows) == n:
                sampled_lp = greedy[1]
            else:
                rows = torch.tensor(greedy_rows, device=logits.device)
                sampled_lp[rows] = greedy[1][rows]
        if wanted:  # the whole processed log-distribution of these rows, for the top-k and rank
            processed_rows = logits[wanted]
            position = {i: j for j, i in enumerate(random_rows)}
            for k, i in enumerate(wanted):
                if i in position:
                    processed_rows[k] = processed[position[i]]
            logp = torch.log_softmax(processed_rows, dim=-1)
            chosen = tokens[wanted]
            sampled_lp[wanted] = logp.gather(1, chosen.unsqueeze(1)).squeeze(1)

        # the tokens with their logprobs in one transfer (float64 holds every token id exactly)
        to_host = tokens.double()
        if plain:
            to_host = torch.cat([to_host, (sampled_lp if len(plain) == n else sampled_lp[plain]).double()])
        if no_token_left is not None:
            to_host = torch.cat([to_host, no_token_left.double()])
        values = to_host.tolist()
        result = SampleResult([int(t) for t in values[:n]], [None] * n, sampled_logprobs=[None] * n)
        for i, value in zip(plain, values[n : n + len(plain)]):
            result.sampled_logprobs[i] = value
        if no_token_left is not None:
            result.no_token_left = {i for i, dead in zip(bannable, values[n + len(plain) :]) if dead}
        if beams:
            self._beam_candidates(logits, beams, params, result)
        if wanted:
            entries = _gather_logprobs(logp, chosen, [params[i].logprobs for i in wanted])
            for i, lp in zip(wanted, entries):
                result.logprobs[i] = lp
        return result

    def _beam_candidates(self, logits: torch.Tensor, rows: list[int], params, result: SampleResult) -> None:
        logp = torch.log_softmax(logits[rows], dim=-1)
        k = min(2 * max(params[i].num_beams for i in rows), logp.shape[1])
        vals, ids = logp.topk(k, dim=1)
        vals, ids = vals.tolist(), ids.tolist()
        for j, i in enumerate(rows):
            width = min(2 * params[i].num_beams, k)
            result.beam_candidates[i] = [(t, v) for t, v in zip(ids[j][:width], vals[j][:width]) if v != float("-inf")]
            if params[i].logprobs is not None:
                result.beam_logp[i] = logp[j]

    def _apply_penalties(self, logits: torch.Tensor, seqs: list[Sequence]) -> None:
        for i, seq in enumerate(seqs):
            p = seq.params
            if not p.needs_penalties:
                continue
            row = logits[i]
            if p.repetition_penalty != 1.0:
                # a prompt's virtual tokens (prompt tuning, ids >= vocab) are no vocabulary token to penalise
                ids = sorted(t for t in set(seq.token_ids) if t < row.shape[0])
                seen = torch.tensor(ids, dtype=torch.long, device=row.device)
                vals = row[seen]
                row[seen] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
            if (p.presence_penalty or p.frequency_penalty) and seq.num_output_tokens:
                out = torch.tensor(seq.output_token_ids, dtype=torch.long, device=row.device)
                counts = torch.zeros_like(row).scatter_add_(0, out, torch.ones_like(out, dtype=row.dtype))
                row -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(row.dtype)

    def _sample_random(
        self, logits: torch.Tensor, seqs: list[Sequence], drafts: list[int | None] | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Temperature, top-k, top-p, min-p on these rows' logits (into a new tensor; the input is not changed),
        then one token per row by inverse-CDF sampling: one uniform draw u from the row's generator picks the
        first token whose cumulative probability exceeds u (see _inverse_cdf). A seeded sequence draws only from
        its own generator, on the CPU whatever the logits' device, so its tokens do not depend on the device or
        on the other rows of the batch.

        A row with a draft token d (speculative decoding, d proposed deterministically) keeps d with probability
        p(d); otherwise it draws from p with d removed. Either way the token is distributed exactly as p.

        Returns (tokens, each token's logprob under the processed distribution, the processed logits)."""
        params = [s.params for s in seqs]
        x = logits  # temperature 1 leaves the logits as they are
        if any(p.temperature != 1.0 for p in params):
            temps = torch.tensor([p.temperature for p in params], device=logits.device).unsqueeze(1)
            x = torch.div(logits, temps, out=self._scratch("x", logits))
        top_ks = [p.top_k for p in params]
        if any(top_ks):
            kmax = max(top_ks)
            kth = x.topk(kmax, dim=1).values
            ks = torch.tensor([k if k else kmax for k in top_ks], device=x.device) - 1
            threshold = kth.gather(1, ks.unsqueeze(1))
            no_topk = torch.tensor([k == 0 for k in top_ks], device=x.device).unsqueeze(1)
            x = x.masked_fill((x < threshold) & ~no_topk, float("-inf"))
        if any(p.top_p < 1.0 for p in params):
            top_ps = torch.tensor([p.top_p for p in params], device=x.device)
            sorted_x, order = x.sort(dim=1, descending=True)
            probs = sorted_x.softmax(dim=1)
            before = probs.cumsum(dim=1) - probs  # mass of strictly better tokens
            drop = (before > top_ps.unsqueeze(1)) & (top_ps < 1.0).unsqueeze(
                1
            )  # top_p 1: keep all (mass may round past 1)
            sorted_x = sorted_x.masked_fill(drop, float("-inf"))
            x = torch.empty_like(x).scatter_(1, order, sorted_x)
        if any(p.min_p > 0 for p in params):
            min_ps = torch.tensor([p.min_p for p in params], device=x.device)
            probs = x.softmax(dim=1)
            x = x.masked_fill(probs < min_ps.unsqueeze(1) * probs.max(dim=1, keepdim=True).values, float("-inf"))
        probs = torch.softmax(x, dim=1, out=self._scratch("probs", x))
        draw_probs = probs
        accepted = {}
        own: dict[int, torch.Tensor] = {}  # the draws of rows with a generator of their own
        for j, seq in enumerate(seqs):
            draft = drafts[j] if drafts else None
            generator = seq.generator
            if draft is not None:
                generator = generator or self._engine_generator(x.device)
                if torch.rand((), generator=generator, device=generator.device).item() < probs[j, draft].item():
                    accepted[j] = draft
                else:
                    if draw_probs is probs:
                        draw_probs = probs.clone()
                    draw_probs[j, draft] = 0.0
            if seq.generator is not None:  # a seeded request's CPU generator: its draw does not depend on the device
                own[j] = torch.rand((), dtype=torch.float64, generator=seq.generator, device=seq.generator.device)
        if len(own) == len(seqs):
            u = torch.stack([own[j] for j in range(len(seqs))]).to(x.device)
        else:
            u = torch.rand(len(seqs), dtype=torch.float64, generator=self._engine_generator(x.device), device=x.device)
            if own:
                u[list(own)] = torch.stack(list(own.values())).to(x.device)
        tokens = _inverse_cdf(draw_probs, u)
        for j, draft in accepted.items():
            tokens[j] = draft
        # the processed distribution's probability, not the one with a rejected draft removed
        logprobs = probs.gather(1, tokens.unsqueeze(1)).squeeze(1).log()
        return tokens, logprobs, x


_BLOCK = 256  # tokens per block of the two-level searches below
_SCRATCH_MAX_ELEMENTS = 1 << 23  # 32 MB of float32 a kept intermediate at most (64 rows x 49,152 ids: 12 MB)


def _no_token_left(logits: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """Which of `rows` have every token banned (-inf): no token may be taken from them (the argmax of such a row is
    token 0, which was emitted again and again; a draw from it is NaN). The logits are left as they are, the step
    computes as usual and the caller discards what these rows drew. The flags stay on the logits' device (read
    with the tokens, in one transfer)."""
    return torch.isneginf(logits.index_select(0, torch.tensor(rows, device=logits.device))).all(dim=1)


def _greedy_rows(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row, the greedy token (argmax: the first maximum, or the first NaN) and its log-softmax. On CPU, one C
    call (dense_kernels.greedy_rows: two passes over each row) where torch takes several operations, each waking its
    threads on a decode step (measured 0.39 ms a step at one row of 49,152 in W1's engine against ~0.05)."""
    kernel = dense_kernels.greedy_rows(logits)
    if kernel is not None:
        return kernel
    tokens = _argmax_rows(logits)
    return tokens, torch.log_softmax(logits, dim=1).gather(1, tokens.unsqueeze(1)).squeeze(1)


def _argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """x.argmax(dim=1), the same index on ties (the first maximum) and NaN (the first NaN).

    On CPU, torch's argmax over a long row is a scalar loop while amax is vectorised (measured 3.2 ms against
    0.2 ms for [64, 49152]): each row's blocks' maxima (amax) name the first block holding the row's maximum (the
    argmax of the block maxima, NaN counting as the maximum, as in argmax), and the argmax within that block is
    the row's."""
    rows, vocab = x.shape
    if x.device.type != "cpu" or vocab < 4 * _BLOCK or rows == 0:
        return x.argmax(dim=1)
    main = vocab // _BLOCK * _BLOCK
    maxima = x[:, :main].unflatten(1, (-1, _BLOCK)).amax(dim=2)
    if main < vocab:
        maxima = torch.cat([maxima, x[:, main:].amax(dim=1, keepdim=True)], dim=1)
    ids = (maxima.argmax(dim=1) * _BLOCK).unsqueeze(1) + torch.arange(_BLOCK, device=x.device)
    ids = ids.clamp_(max=vocab - 1)  # a last, shorter block repeats its last token after it: no earlier maximum
    return ids.gather(1, x.gather(1, ids).argmax(dim=1, keepdim=True)).squeeze(1)


def _first_above(cdf: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Per row, the first column whose cumulative sum (cdf, non-decreasing, float64) exceeds target (>= 0).

    The target is first brought below the row's total, so the column exists, and since a zero entry leaves the
    cumulative sum unchanged, the column found always holds a positive entry. A row whose total is not positive
    (no entry is; NaN) gets column 0."""
    total = cdf[:, -1]
    target = torch.minimum(target, torch.nextafter(total, torch.zeros_like(total)))
    col = torch.searchsorted(cdf, target.unsqueeze(1), right=True).squeeze(1)
    return torch.where(total > 0, col.clamp_(max=cdf.shape[1] - 1), 0)


def _inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Per row, the token of probs (non-negative, any total) at u (float64 in [0, 1)) times the row's total mass:
    the first token whose cumulative probability exceeds it, so token t comes with probability probs[t] / total
    for a uniform u, and a token of probability 0 never comes (see _first_above). A row without positive mass
    (its logits were all -inf, or NaN) gets token 0, as argmax of its NaN probabilities did.

    Sums are float64, so no token's mass is lost to rounding a long running sum (in float32, a token below half
    an ulp of the sum before it, ~6e-8 near 1, would add nothing and never be drawn). A full float64 cumulative
    sum of [64, 49152] costs about 4 ms on CPU, so a long row is searched in two levels: the cumulative sum of
    its blocks' sums finds the block, and the cumulative sum of that block alone finds the token. The blocks
    are summed in float32 (relative error ~1e-6 at most): a token's probability is exact to that relative error, and
    a token of probability 0 is still never drawn."""
    rows, vocab = probs.shape
    if vocab < 4 * _BLOCK:
        cdf = probs.double().cumsum(dim=1)
        return _first_above(cdf, u * cdf[:, -1])
    main = vocab // _BLOCK * _BLOCK
    sums = probs[:, :main].unflatten(1, (-1, _BLOCK)).sum(dim=2)
    if main < vocab:
        sums = torch.cat([sums, probs[:, main:].sum(dim=1, keepdim=True)], dim=1)
    block_cdf = sums.double().cumsum(dim=1)
    target = u * block_cdf[:, -1]
    block = _first_above(block_cdf, target)
    before = torch.where(block > 0, block_cdf.gather(1, (block - 1).clamp(min=0).unsqueeze(1)).squeeze(1), 0.0)
    ids = (block * _BLOCK).unsqueeze(1) + torch.arange(_BLOCK, device=probs.device)
    inside = probs.gather(1, ids.clamp(max=vocab - 1)).masked_fill_(ids >= vocab, 0.0)
    col = _first_above(inside.double().cumsum(dim=1), (target - before).clamp_(min=0.0))
    return torch.where(block_cdf[:, -1] > 0, ids.gather(1, col.unsqueeze(1)).squeeze(1), 0)
