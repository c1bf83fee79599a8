"""Beam search on the tiny random Llama: the engine's beams against transformers' beam search, greedy
equivalence at width 1, KV sharing under preemption, and mixed beam widths in one batch."""

from __future__ import annotations

import pytest
import torch
from tiny_llama import _tokens

from petrel.config import EngineConfig
from petrel.engine.beam_search import BeamSearch
from petrel.engine.engine_core import EngineCore
from petrel.engine.model_runner import kv_bytes_per_block
from petrel.engine.sequence import EngineRequest
from petrel.sampling_params import SamplingParams


def run_engine(t, requests: list[tuple[list[int], SamplingParams, tuple]], **config) -> tuple[dict, EngineCore]:
    """requests: (prompt, params, eos ids). Returns {request index: {output index: last EngineOutput, with all
    of that sequence's tokens}}."""
    config.setdefault("kv_cache_memory", 256 * kv_bytes_per_block(t.cfg, 4, torch.float32))
    core = EngineCore(EngineConfig(block_size=4, **config), t.model, t.cfg)
    for i, (prompt, params, eos) in enumerate(requests):
        core.add_request(EngineRequest(i, list(prompt), params, eos_token_ids=eos))
    results: dict = {i: {} for i in range(len(requests))}
    for _ in range(2000):
        if not core.has_work:
            break
        for out in core.step():
            seen = results[out.request_id].get(out.index)
            if seen is not None:  # a sampled sequence streams token by token; beams arrive whole, once
                assert not requests[out.request_id][1].use_beam_search, "two outputs for one beam"
                assert seen.finish_reason is None, "output after finish"
                out.new_token_ids = seen.new_token_ids + out.new_token_ids
            results[out.request_id][out.index] = out
        core.block_manager.check_integrity()
    assert not core.has_work
    assert core.block_manager.num_free_blocks == core.block_manager.num_blocks, "beams leaked KV blocks"
    return results, core


def hf_beams(t, prompt, width, n, max_tokens, eos, length_penalty, early_stopping):
    with torch.no_grad():
        out = t.hf.generate(
            torch.tensor([prompt]),
            num_beams=width,
            num_return_sequences=n,
            do_sample=False,
            max_new_tokens=max_tokens,
            eos_token_id=list(eos) or None,
            pad_token_id=0,
            length_penalty=length_penalty,
            early_stopping=early_stopping,
            output_scores=True,
            return_dict_in_generate=True,
        )
    beams = []
    for row in out.sequences[:, len(prompt) :].tolist():
        cut = next((i + 1 for i, tok in enumerate(row) if tok in eos), len(row))  # transformers pads after EOS
        beams.append(row[:cut])
    return beams, out.sequences_scores.tolist()


def beam_params(width, n, max_tokens, length_penalty=1.0, early_stopping=False, **kw):
    return SamplingParams(
        use_beam_search=True,
        beam_width=width,
        n=n,
        max_tokens=max_tokens,
        length_penalty=length_penalty,
        early_stopping=early_stopping,
        **kw,
    )


# eos 151 and 218 are tokens this tiny model likes, so hypotheses do end early
@pytest.mark.parametrize("eos", [(), (151,), (218,)], ids=["no-eos", "eos151", "eos218"])
@pytest.mark.parametrize("length_penalty,early_stopping", [(1.0, False), (1.0, True), (0.5, False), (2.0, "never")])
def test_beams_match_transformers(tiny, eos, length_penalty, early_stopping):
    t = tiny(2, False)
    prompts = [_tokens(5 + s, 100 + s) for s in range(4)]
    width, n, max_tokens = 3, 3, 8
    params = beam_params(width, n, max_tokens, length_penalty, early_stopping)
    results, _ = run_engine(t, [(p, params, eos) for p in prompts])  # all four prompts batched together
    for i, prompt in enumerate(prompts):
        expected, scores = hf_beams(t, prompt, width, n, max_tokens, eos, length_penalty, early_stopping)
        got = [results[i][k].new_token_ids for k in range(n)]
        assert got == expected, f"prompt {i}: petrel {got} != transformers {expected}"
        for k in range(n):
            out = results[i][k]
            score = out.cumulative_logprob / len(out.new_token_ids) ** length_penalty
            assert score == pytest.approx(scores[k], abs=1e-4)
            ended = bool(eos) and out.new_token_ids[-1] in eos
            assert out.finish_reason == ("stop" if ended else "length")


def test_width_one_is_greedy(tiny):
    t = tiny(4, True)
    prompts = [_tokens(6, 7), _tokens(11, 8)]
    greedy, _ = run_engine(t, [(p, SamplingParams(temperature=0.0, max_tokens=10), ()) for p in prompts])
    beams, _ = run_engine(t, [(p, beam_params(1, 1, 10), ()) for p in prompts])
    for i in range(len(prompts)):
        assert beams[i][0].new_token_ids == greedy[i][0].new_token_ids


def test_beams_survive_preemption_and_share_blocks(tiny):
    """With KV room for little more than one request's beams, beams are preempted and recomputed; the
    results equal a roomy run, and every block comes back."""
    t = tiny(2, False)
    prompts = [_tokens(9, 30 + i) for i in range(3)]
    params = beam_params(4, 2, 12)
    roomy, _ = run_engine(t, [(p, params, ()) for p in prompts])
    per_block = kv_bytes_per_block(t.cfg, 4, torch.float32)
    tight, core = run_engine(t, [(p, params, ()) for p in prompts], kv_cache_memory=20 * per_block)
    assert core.scheduler.num_preemptions > 0
    for i in range(len(prompts)):
        assert [tight[i][k].new_token_ids for k in range(2)] == [roomy[i][k].new_token_ids for k in range(2)]


def test_forked_beams_share_prompt_blocks(tiny):
    t = tiny(2, False)
    core = EngineCore(
        EngineConfig(block_size=4, kv_cache_memory=64 * kv_bytes_per_block(t.cfg, 4, torch.float32)), t.model, t.cfg
    )
    core.add_request(EngineRequest(0, _tokens(16, 3), beam_params(4, 4, 20), eos_token_ids=()))
    core.step()  # prefill: 4 full prompt blocks, the first token's candidates, 4 beams forked
    core.step()
    beams = [s for s in core.requests[0].seqs if not s.is_finished]
    assert len(beams) == 4
    prompt_blocks = {tuple(s.block_table[:4]) for s in beams}
    assert len(prompt_blocks) == 1, "beams must share the prompt's blocks"
    assert all(core.block_manager.ref_counts[b] == 4 for b in beams[0].block_table[:4])


def test_mixed_beam_widths_run_in_one_batch(tiny):
    t = tiny(2, True)
    reqs = [
        (_tokens(7, 1), beam_params(2, 2, 9), ()),
        (_tokens(12, 2), beam_params(4, 3, 9), ()),
        (_tokens(5, 3), SamplingParams(temperature=0.0, max_tokens=9), ()),
        (_tokens(8, 4), beam_params(3, 1, 9), ()),
    ]
    together, core = run_engine(t, reqs)
    for i, req in enumerate(reqs):
        alone, _ = run_engine(t, [req])
        assert {k: o.new_token_ids for k, o in together[i].items()} == {k: o.new_token_ids for k, o in alone[0].items()}


def test_select_ends_only_top_ranked_end_tokens():
    bs = BeamSearch(width=2)
    # beam 0: end token 9 is the best candidate overall -> a hypothesis; beam 1's end token ranks below 2 -> dropped
    cands = [[(9, -0.1), (4, -0.5), (5, -2.0)], [(6, -0.2), (7, -0.3), (9, -0.4)]]
    keep, ended = bs.select(cands, [0.0, -1.0], 3, lambda beam, tok: tok == 9)
    assert [(c.beam, c.token_id) for c in ended] == [(0, 9)]
    assert [(c.beam, c.token_id) for c in keep] == [(0, 4), (1, 6)]


def test_beam_search_params_are_validated():
    with pytest.raises(ValueError, match="n"):
        SamplingParams(use_beam_search=True, beam_width=2, n=3)
    with pytest.raises(ValueError, match="stop"):
        SamplingParams(use_beam_search=True, beam_width=2, stop=["x"])
    with pytest.raises(ValueError, match="early_stopping"):
        SamplingParams(use_beam_search=True, beam_width=2, early_stopping="sometimes")
    with pytest.raises(ValueError, match="beam_width"):
        SamplingParams(beam_width=3)


def test_stop_token_sequences_end_beams(tiny):
    """Beams go through the stop check every sequence does: a one-token stop sequence ends hypotheses exactly as
    that end token does in transformers (reported as the sequence); a two-token one appears in no output except
    as the end of a 'stop' one."""
    t = tiny(2, False)
    prompts = [_tokens(5 + s, 100 + s) for s in range(4)]
    width, n, max_tokens = 3, 3, 8
    params = beam_params(width, n, max_tokens, 0.5, stop_token_sequences=[[218]])
    results, _ = run_engine(t, [(p, params, ()) for p in prompts])
    ended = 0
    for i, prompt in enumerate(prompts):
        expected, _ = hf_beams(t, prompt, width, n, max_tokens, (218,), 0.5, False)
        assert [results[i][k].new_token_ids for k in range(n)] == expected
        for k in range(n):
            out = results[i][k]
            stopped = out.new_token_ids[-1] == 218
            ended += stopped
            assert (out.finish_reason, out.stop_reason) == (("stop", (218,)) if stopped else ("length", None))
    assert ended > 0  # (before beams took the one stop check, stop_token_sequences did not end them)

    free, _ = run_engine(t, [(prompts[0], beam_params(width, n, max_tokens), ())])
    word = free[0][0].new_token_ids[2:4]  # a pair the best beam produces when nothing stops it
    results, _ = run_engine(
        t, [(p, beam_params(width, n, max_tokens, stop_token_sequences=[word]), ()) for p in prompts]
    )
    outputs = [results[i][k] for i in range(len(prompts)) for k in range(n)]
    for out in outputs:
        ids = out.new_token_ids
        inside = [j for j in range(len(ids) - 1) if ids[j : j + 2] == word]
        assert inside in ([], [len(ids) - 2]), (ids, word)
        assert (out.stop_reason == tuple(word)) == (inside == [len(ids) - 2])
    assert any(out.stop_reason == tuple(word) for out in outputs)
