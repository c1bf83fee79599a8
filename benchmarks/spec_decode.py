"""Speculative decoding: W1 and an input-heavy "edit this text" workload, without and with each method, in one run.

    python benchmarks/spec_decode.py --out benchmarks/results/DATE-spec-decode.json
    python benchmarks/spec_decode.py --methods none,ngram --quick      # a smoke run
    python benchmarks/spec_decode.py --methods none,ngram,lookahead --batch-sizes 1,4,16 --max-tokens 64

Each configuration gets its own engine on the default model (float32), warmed up once, then:
  W1    the W1 chat prompt, greedy, exactly 256 new tokens (EOS ignored), one request;
  edit  EDIT_TEXTS, each in a chat prompt asking to fix its typos and return it in full, greedy, up to 256 new
        tokens (the model's own EOS ends it), one request at a time: the output repeats most of the prompt.
With --batch-sizes, the workloads are instead two sets of 16 prompts run b at a time (one generate call of b
prompts, greedy, exactly --max-tokens new tokens each):
  repetitive@b  the edit prompts (EDIT_TEXTS under EDIT_INSTRUCTIONS): the output copies the prompt;
  open@b        OPEN_QUESTIONS: answers that copy nothing.
Reported per workload: output tokens, wall seconds, output tokens/s, speedup over 'none' in the same run,
draft tokens verified and accepted (acceptance rate) and accepted tokens per verify round. Greedy outputs
must be identical to 'none' token for token; a configuration that differs is marked invalid. The machine's load
average (os.getloadavg) is recorded before and after each configuration.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time

EDIT_TEXTS = [
    "The petrel is a seabird that spends most of it's life far from land. It flys low over the waves, "
    "sometimes pattering its feet on the water as if walking, which is were its name comes from: Saint Peter "
    "walked on water. Petrels eat small fish, squid and krill, and they can smell food from many kilometers away.",
    "To make bread, mix flour, water, salt and yeast in a large bowl. Knead the dough for ten minutes untill it is "
    "smooth, then leave it to rise in a warm place for a hour. Shape the loaf, let it rise again, and bake it at "
    "220 degrees for thirty minutes, untill the crust is golden and the bottom sounds hollow when tapped.",
    "Our team meeting is moved from Tuesday to Thursday at 10 am. Please bring you're notes on the quarterly "
    "report, and be ready to discuss the budget for the next project. If you can not attend, send a short "
    "update by email before the meeting so that we can include it in the minutes.",
    "The library will be closed on Monday for maintenance. All books due on that day can be returned on Tuesday "
    "without a fine. The reading room on the second floor will reopen next week with new chairs, better lights "
    "and more power outlets, so that students can work their for longer.",
]
EDIT_INSTRUCTION = "Fix the spelling mistakes in this text and return the whole corrected text, nothing else:\n\n"
EDIT_INSTRUCTIONS = [
    EDIT_INSTRUCTION,
    "Correct the typos below and give back the full text, unchanged otherwise:\n\n",
    "Proofread this paragraph and return it in full with the mistakes fixed:\n\n",
    "Rewrite the text exactly, only fixing its spelling errors:\n\n",
]
OPEN_QUESTIONS = [
    "Write a short poem about the sea.",
    "What is 17 times 23? Explain how you computed it.",
    "List three colors and one fact about each.",
    "Explain what a binary search does, step by step.",
    "Give me three ideas for a rainy Sunday afternoon.",
    "Why is the sky blue? Answer for a ten-year-old.",
    "Describe a cat to someone who has never seen one.",
    "What are the pros and cons of working from home?",
    "Invent a name and a slogan for a bakery.",
    "How do plants make their food?",
    "Tell a very short story about a lost key.",
    "What should I pack for a weekend in the mountains?",
    "Explain the difference between weather and climate.",
    "Suggest a healthy breakfast and say why it is healthy.",
    "What makes a good friend?",
    "Describe how a bicycle works.",
]

METHODS = {
    "none": None,
    "ngram": {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4},
    "self": {"method": "self", "num_speculative_tokens": 2, "draft_num_layers": 20},
    "draft_model": {"method": "draft_model", "num_speculative_tokens": 4},  # the default model drafts for itself
    "lookahead": {"method": "lookahead", "max_window_size": 4, "max_ngram_size": 4, "max_verification_set_size": 4},
    # a tree of 7 drafts a step instead of 23: for a CPU, where each draft costs compute
    "lookahead_small": {
        "method": "lookahead",
        "max_window_size": 2,
        "max_ngram_size": 3,
        "max_verification_set_size": 2,
    },
}


def run_config(name: str, spec: dict | None, w1_tokens: int, edit_texts: list[str]) -> dict:
    from petrel import LLM, SamplingParams
    from petrel.bench import W1_USER_MESSAGE

    llm = LLM(speculative_config=_resolved(spec))
    try:
        llm.generate("Hello", SamplingParams(max_tokens=8, temperature=0), use_tqdm=False)  # warm-up
        w1_prompt = llm.apply_chat_template([{"role": "user", "content": W1_USER_MESSAGE}])
        w1 = _measure(llm, [w1_prompt], SamplingParams(temperature=0, max_tokens=w1_tokens, ignore_eos=True))
        edits = [llm.apply_chat_template([{"role": "user", "content": EDIT_INSTRUCTION + t}]) for t in edit_texts]
        edit = _measure(llm, edits, SamplingParams(temperature=0, max_tokens=256))
        return {"method": name, "speculative_config": spec, "w1": w1, "edit": edit}
    finally:
        llm.shutdown()


def _resolved(spec: dict | None) -> dict | None:
    if spec is not None and spec["method"] == "draft_model":
        from petrel.model.loader import default_model_path

        return dict(spec, draft_model=default_model_path())
    return spec


def batch_workloads(llm) -> dict[str, list[str]]:
    """16 chat prompts of each kind: edits (the answer copies the prompt) and open questions (it copies nothing)."""
    edits = [i + t for i in EDIT_INSTRUCTIONS for t in EDIT_TEXTS]
    return {
        kind: [llm.apply_chat_template([{"role": "user", "content": c}]) for c in contents]
        for kind, contents in (("repetitive", edits), ("open", OPEN_QUESTIONS))
    }


def run_batches(name: str, spec: dict | None, batch_sizes: list[int], max_tokens: int) -> dict:
    """Each workload's 16 prompts, b at a time, for each batch size b."""
    from petrel import LLM, SamplingParams

    load_before = os.getloadavg()
    llm = LLM(speculative_config=_resolved(spec))
    try:
        llm.generate(["Hello"] * max(batch_sizes), SamplingParams(max_tokens=8, temperature=0), use_tqdm=False)
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        out = {"method": name, "speculative_config": spec}
        for kind, prompts in batch_workloads(llm).items():
            for b in batch_sizes:
                out[f"{kind}@{b}"] = _measure(llm, [prompts[i : i + b] for i in range(0, len(prompts), b)], params)
        out["load_average"] = [round(x, 2) for x in (*load_before, *os.getloadavg())]
        return out
    finally:
        llm.shutdown()


def _measure(llm, prompts: list, params) -> dict:
    """One generate call per item (a prompt, or a list of prompts run as one batch); totals over the items."""
    before = llm.engine.call(lambda core: (core.num_draft_tokens, core.num_accepted_tokens))
    tokens, rounds, wall = [], 0, 0.0
    for prompt in prompts:
        t0 = time.perf_counter()
        outs = llm.generate(prompt, params, use_tqdm=False)
        wall += time.perf_counter() - t0
        for out in outs if isinstance(outs, list) else [outs]:
            tokens.append(out.outputs[0].token_ids)
            rounds += out.outputs[0].spec_verify_ct or 0
    after = llm.engine.call(lambda core: (core.num_draft_tokens, core.num_accepted_tokens))
    drafted, accepted = after[0] - before[0], after[1] - before[1]
    n = sum(len(t) for t in tokens)
    return {
        "output_tokens": n,
        "wall_s": round(wall, 3),
        "output_tok_s": round(n / wall, 2),
        "draft_tokens": drafted,
        "accepted_tokens": accepted,
        "acceptance_rate": round(accepted / drafted, 3) if drafted else None,
        "accepted_per_round": round(accepted / rounds, 3) if rounds else None,
        "token_ids": tokens,
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--methods", default=",".join(METHODS), help=f"comma-separated, from {list(METHODS)}")
    ap.add_argument("--quick", action="store_true", help="32 W1 tokens, one edit text")
    ap.add_argument("--out", default=None, help="write the results as one JSON document")
    ap.add_argument("--batch-sizes", default=None, help="e.g. 1,4,16: the batched workloads instead of W1 and edit")
    ap.add_argument("--max-tokens", type=int, default=64, help="new tokens a request in the batched workloads")
    args = ap.parse_args(argv)
    methods = args.methods.split(",")
    unknown = [m for m in methods if m not in METHODS]
    if unknown:
        ap.error(f"unknown method(s) {unknown}")
    if "none" not in methods:
        methods.insert(0, "none")
    w1_tokens, texts = (32, EDIT_TEXTS[:1]) if args.quick else (256, EDIT_TEXTS)
    results = []
    for name in methods:
        print(f"[spec-bench] {name} ...", file=sys.stderr, flush=True)
        if args.batch_sizes:
            sizes = [int(b) for b in args.batch_sizes.split(",")]
            results.append(run_batches(name, METHODS[name], sizes, args.max_tokens))
        else:
            results.append(run_config(name, METHODS[name], w1_tokens, texts))
    base = results[0]
    workloads = [k for k in base if isinstance(base[k], dict) and "output_tokens" in base[k]]
    rows = []
    for r in results:
        for wl in workloads:
            m = r[wl]
            same = m["token_ids"] == base[wl]["token_ids"]
            rows.append(
                {
                    "method": r["method"],
                    "workload": wl,
                    "valid": same,
                    "output_tokens": m["output_tokens"],
                    "wall_s": m["wall_s"],
                    "output_tok_s": m["output_tok_s"],
                    "speedup": round(m["output_tok_s"] / base[wl]["output_tok_s"], 3) if same else None,
                    "acceptance_rate": m["acceptance_rate"],
                    "accepted_per_round": m["accepted_per_round"],
                    "draft_tokens": m["draft_tokens"],
                    "accepted_tokens": m["accepted_tokens"],
                    "load_average": r.get("load_average"),
                }
            )
    for row in rows:
        print(json.dumps(row))
    print("\n| method | workload | output tok/s | speedup | acceptance | accepted / round |", file=sys.stderr)
    print("| --- | --- | ---: | ---: | ---: | ---: |", file=sys.stderr)
    for row in rows:
        sp = f"{row['speedup']:.2f}x" if row["speedup"] else ("INVALID" if not row["valid"] else "-")
        acc = f"{row['acceptance_rate']:.0%}" if row["acceptance_rate"] is not None else "-"
        per = f"{row['accepted_per_round']:.2f}" if row["accepted_per_round"] is not None else "-"
        print(
            f"| {row['method']} | {row['workload']} | {row['output_tok_s']:.1f} | {sp} | {acc} | {per} |",
            file=sys.stderr,
        )
    if args.out:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
        doc = {
            "date": time.strftime("%Y-%m-%d"),
            "commit": commit,
            "machine": platform.platform(),
            "dtype": "float32",
            "command": "python benchmarks/spec_decode.py " + " ".join(argv or sys.argv[1:]),
            "rows": rows,
        }
        with open(args.out, "w") as f:
            json.dump(doc, f, indent=1)
    return 0 if all(r["valid"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
