"""How far a quantized model's integer products move its logprobs from its dequantized weights' products, on W2's
prompts: the drift the quantized paths' tests bound (tests/test_quantization.py).

    python benchmarks/quant_drift.py                       # the default model's Q4_1 GGUF, 32 prompts <= 256 tokens
    python benchmarks/quant_drift.py --model x.gguf --prompts 64 --max-prompt-len 512 --new-tokens 16
    python benchmarks/quant_drift.py --quantization int8    # the default model's weights as int8, one scale a row

Three runs of LLM(quantization="gguf", or --quantization), each in a child process of its own, greedy, with every
prompt position's logits (context logits) and the generated ones: the reference, PETREL_INT8_COMPUTE=0 (the
dequantized weights' float products, activations unrounded), then the integer products with 16-bit activations a row
(PETREL_Q4_ACTIVATIONS=16, PETREL_INT8_ACTIVATIONS=16) and with 8-bit ones a group of 32 (the default for 4-bit
codes, and for 8-bit ones on AVX-512 VNNI). At the prompts'
positions every run sees the same tokens, so their log-softmaxes compare position by position: top-1 agreement,
the reference's top token's |delta logprob| (mean, 99th percentile, largest) and the largest |delta logprob| over
the whole vocabulary; then how many greedy continuations equal the reference's.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile

MODES = {
    "float products": {"PETREL_INT8_COMPUTE": "0"},
    "integers, 16-bit activations": {"PETREL_Q4_ACTIVATIONS": "16", "PETREL_INT8_ACTIVATIONS": "16"},
    "integers, 8-bit activations": {"PETREL_Q4_ACTIVATIONS": "8", "PETREL_INT8_ACTIVATIONS": "8"},
}


def child(args) -> None:
    import torch

    from petrel import LLM, SamplingParams
    from petrel.bench.workloads import make_w2_prompts

    prompts = make_w2_prompts(args.prompts, args.max_prompt_len)
    llm = LLM(model=args.model, quantization=args.quantization, kv_cache_memory=1 << 30)
    params = SamplingParams(
        temperature=0,
        max_tokens=args.new_tokens,
        ignore_eos=True,
        return_context_logits=True,
    )
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    torch.save([(list(o.outputs[0].token_ids), o.context_logits) for o in outs], args.child)
    llm.shutdown()


def compare(reference: list, other: list) -> str:
    import torch

    agree = positions = same_tokens = 0
    top_changes, worst = [], 0.0
    for (ref_tokens, ref_logits), (tokens, logits) in zip(reference, other):
        expected, got = ref_logits.log_softmax(-1), logits.log_softmax(-1)
        best = expected.argmax(-1, keepdim=True)
        agree += int((got.argmax(-1, keepdim=True) == best).sum())
        positions += best.numel()
        top_changes.append((got.gather(-1, best) - expected.gather(-1, best)).abs().squeeze(-1))
        worst = max(worst, (got - expected).abs().max().item())
        same_tokens += int(tokens == ref_tokens)
    change = torch.cat(top_changes)
    return (
        f"top-1 agreement {agree}/{positions} ({agree / positions:.1%}); top token's |delta logprob| mean "
        f"{change.mean():.4f}, p99 {change.quantile(0.99):.3f}, largest {change.max():.3f}; largest over the "
        f"vocabulary {worst:.2f}; greedy continuations equal {same_tokens}/{len(reference)}"
    )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="a GGUF file (default: petrel's default model)")
    ap.add_argument("--quantization", default="gguf", help="gguf (the file's blocks) or int8")
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--max-prompt-len", type=int, default=256)
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args)
        return 0
    import torch

    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for i, (name, env) in enumerate(MODES.items()):
            path = os.path.join(tmp, f"{i}.pt")
            command = [sys.executable, __file__, "--child", path, "--prompts", str(args.prompts)]
            command += ["--max-prompt-len", str(args.max_prompt_len), "--new-tokens", str(args.new_tokens)]
            command += ["--quantization", args.quantization]
            if args.model:
                command += ["--model", args.model]
            subprocess.run(command, env={**os.environ, **env}, check=True)
            results[name] = torch.load(path)
    reference = results.pop("float products")
    lens = [len(logits) for _, logits in reference]
    print(
        f"{len(reference)} W2 prompts of {min(lens)}-{max(lens)} tokens, {args.new_tokens} greedy tokens each; "
        "against the float products:"
    )
    for name, other in results.items():
        print(f"  {name}: {compare(reference, other)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
