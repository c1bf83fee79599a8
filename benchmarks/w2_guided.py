"""W2 with a JSON schema on every request against W2 unconstrained, on one engine in one run.

Each run submits the 64 W2 prompts at once, 128 new tokens each, greedy, EOS ignored. The schema asks for
at least 64 records, so no output can complete within 128 tokens and both runs produce exactly the same
number of tokens: the difference is the cost of guided decoding (grammar masks every step).

    python benchmarks/w2_guided.py [--quick] [--out results.json]
"""

from __future__ import annotations

import argparse
import json
import time

from petrel import LLM, GuidedDecodingParams, SamplingParams
from petrel.bench import make_w2_prompts

SCHEMA = {
    "type": "object",
    "properties": {
        "records": {
            "type": "array",
            "minItems": 64,
            "items": {
                "type": "object",
                "properties": {
                    "id": {"type": "integer", "minimum": 0, "maximum": 99999},
                    "name": {"type": "string", "maxLength": 24},
                    "tags": {"type": "array", "maxItems": 3, "items": {"enum": ["red", "green", "blue"]}},
                },
                "required": ["id", "name", "tags"],
            },
        }
    },
    "required": ["records"],
}


def run(llm: LLM, prompts: list[list[int]], new_tokens: int, guided: GuidedDecodingParams | None) -> dict:
    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True, guided_decoding=guided)
    t0 = time.perf_counter()
    # a salt per run: neither run may reuse the other's prompt blocks from the prefix cache
    outs = llm.generate(prompts, params, use_tqdm=False, cache_salt="guided" if guided else "plain")
    wall = time.perf_counter() - t0
    counts = [len(o.outputs[0].token_ids) for o in outs]
    result = {
        "wall_s": round(wall, 2),
        "output_tokens": sum(counts),
        "output_tok_s": round(sum(counts) / wall, 1),
        "all_full_length": all(c == new_tokens for c in counts),
    }
    if guided is not None:  # every output is a valid prefix of the schema's JSON: it starts the object
        result["outputs_start_with"] = sorted({o.outputs[0].text.lstrip()[:12] for o in outs})[:3]
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="8 requests x 16 tokens (a smoke run)")
    parser.add_argument("--out", default=None, help="also write the JSON here")
    args = parser.parse_args()
    num, new_tokens = (8, 16) if args.quick else (64, 128)
    prompts = make_w2_prompts(num)
    llm = LLM()
    guided = GuidedDecodingParams(json=SCHEMA)
    llm.generate(
        prompts[0][:32], SamplingParams(max_tokens=4, guided_decoding=guided), use_tqdm=False
    )  # warm up + compile
    plain = run(llm, prompts, new_tokens, None)
    constrained = run(llm, prompts, new_tokens, guided)
    report = {
        "workload": "w2 + json schema",
        "dtype": llm.config.dtype,
        "requests": num,
        "new_tokens": new_tokens,
        "unconstrained": plain,
        "json_schema": constrained,
        "ratio_constrained_over_unconstrained": round(constrained["output_tok_s"] / plain["output_tok_s"], 3),
    }
    print(json.dumps(report, indent=2))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=2)
    llm.shutdown()


if __name__ == "__main__":
    main()
