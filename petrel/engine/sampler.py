"""Logits -> tokens and logprobs for a whole step at once.

Order: logits processors (per request, then the engine's batched post-processor), logit bias, bad words,
penalties, min_tokens masking, the grammar masks of guided sequences; then beam-search rows report their
best candidates, greedy rows take argmax, and random rows go through temperature, top-k, top-p, min-p and
an exponential race (which lets a per-sequence generator make a seeded sequence reproducible in any batch).
Logprobs come from the same processed distribution the token was drawn from, with the token's rank.

The logits may live on a GPU: a step without logprobs, beams, drafts or logits processors reads the device once
(the chosen tokens with their logprobs, in one transfer); what decides the path is known on the host.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from petrel.engine.grammar import apply_grammar_masks
from petrel.engine.post_processors import BatchedPostProcessor, run_post_processors
from petrel.engine.sequence import Sequence


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
            if 0 in row.beam_candidates:
                result.beam_candidates[i] = row.beam_candidates[0]
            if 0 in row.beam_logp:
                result.beam_logp[i] = row.beam_logp[0]
        return result

    def _choose(self, logits: torch.Tensor, seqs: list[Sequence], drafts: list[int | None] | None) -> SampleResult:
        """Bias, bad words, penalties, min_tokens and grammar masks on a copy of the processed logits (the input
        stays as it was, so a failed batch can be chosen again row by row), then each row's token."""
        logits = logits.clone()
        params = [s.params for s in seqs]
        for i, p in enumerate(params):
            if p.logit_bias:
                ids = torch.tensor(list(p.logit_bias), device=logits.device)
                logits[i, ids] += torch.tensor(list(p.logit_bias.values()), device=logits.device)
        self._ban_bad_words(logits, seqs)
        if any(p.needs_penalties for p in params):
            self._apply_penalties(logits, seqs)
        for i, (seq, p) in enumerate(zip(seqs, params)):
            if seq.num_output_tokens < p.min_tokens:
                banned = list(p.stop_token_ids) + ([] if p.ignore_eos else list(seq.request.eos_token_ids))
                if banned:
                    logits[i, banned] = float("-inf")
        guided = {i: seq.grammar for i, seq in enumerate(seqs) if seq.grammar is not None}
        if guided:
            apply_grammar_masks(logits, guided)

        beams = [i for i, p in enumerate(params) if p.use_beam_search]
        random_rows = [i for i, p in enumerate(params) if not (p.greedy or p.use_beam_search)]
        tokens = logits.argmax(dim=-1)
        if random_rows:  # processed in place (temperature, top-k/p, min-p)
            sampled = self._sample_random(
                logits,
                [seqs[i] for i in random_rows],
                random_rows,
                [drafts[i] for i in random_rows] if drafts else None,
            )
            tokens[random_rows] = sampled

        plain = [i for i, p in enumerate(params) if not p.use_beam_search]
        # every sampled token's logprob (cumulative_logprob), fetched with the tokens in one transfer (float64
        # holds every token id exactly)
        to_host = tokens.double()
        if plain:
            logp = torch.log_softmax(logits if not beams else logits[plain], dim=-1)  # on CPU cheaper than logsumexp
            chosen = tokens if not beams else tokens[plain]
            to_host = torch.cat([to_host, logp.gather(1, chosen.unsqueeze(1)).squeeze(1).double()])
        values = to_host.tolist()
        n = len(seqs)
        result = SampleResult([int(t) for t in values[:n]], [None] * n, sampled_logprobs=[None] * n)
        for i, value in zip(plain, values[n:]):
            result.sampled_logprobs[i] = value
        if beams:
            self._beam_candidates(logits, beams, params, result)
        if plain:  # the top-k and rank where asked for
            wanted = [j for j, i in enumerate(plain) if params[i].logprobs is not None]
            if wanted:
                rows = torch.tensor(wanted, device=logp.device)
                entries = _gather_logprobs(logp[rows], chosen[rows], [params[plain[j]].logprobs for j in wanted])
                for j, lp in zip(wanted, entries):
                    result.logprobs[plain[j]] = lp
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
        self, logits: torch.Tensor, seqs: list[Sequence], rows: list[int], drafts: list[int | None] | None = None
    ) -> torch.Tensor:
        """Temperature, top-k, top-p, min-p on the given rows (in place), then draw one token per row.

        A row with a draft token d (speculative decoding, d proposed deterministically) keeps d with probability
        p(d); otherwise it draws from p with d removed. Either way the token is distributed exactly as p."""
        x = logits[rows]
        params = [s.params for s in seqs]
        temps = torch.tensor([p.temperature for p in params], device=x.device).unsqueeze(1)
        x = x / temps
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
        logits[rows] = x
        probs = x.softmax(dim=1)
        noise = torch.empty_like(probs)
        accepted = {}
        for j, seq in enumerate(seqs):
            generator = seq.generator or self._engine_generator(x.device)
            draft = drafts[j] if drafts else None
            if draft is not None:
                if torch.rand((), generator=generator, device=generator.device).item() < probs[j, draft].item():
                    accepted[j] = draft
                else:
                    probs[j, draft] = 0.0
            if generator.device == noise.device:
                noise[j].exponential_(generator=generator)
            else:  # a seeded request's CPU generator: its draws do not depend on the device
                noise[j] = torch.empty(noise.shape[1]).exponential_(generator=generator).to(noise.device)
        tokens = (probs / noise).argmax(dim=1)
        for j, draft in accepted.items():
            tokens[j] = draft
        return tokens
