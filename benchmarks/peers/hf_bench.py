"""transformers, the peer in $PEERS_HOME/venv-hf: W1, W2 and W4 on the default model's fp32 Hugging Face directory.

    venv-hf/bin/python hf_bench.py w1 [--runs 3] [--tag NAME]
    venv-hf/bin/python hf_bench.py w2 [--batch-size 16] [--tag NAME]
    venv-hf/bin/python hf_bench.py w4 [--batch-size 16] [--tag NAME]
    venv-hf/bin/python hf_bench.py w6 --w6-plan PROMPT,LONG,NEW,VOCAB,REQUESTS,KVBYTES [--model-dir DIR]

The engine is driven exactly as `petrel bench --engines hf` drives it (petrel/bench/runners.py HFRunner): greedy
generate() with min_new_tokens = max_new_tokens, W1 timed token by token through a streamer, W2 and W4 as
left-padded, length-sorted batches of --batch-size. transformers has no prefix cache: W4 is W2's kind of run on the
shared-prefix prompts. W6 runs its requests one at a time (generate() has no continuous batching), each timed
token by token as W1 is. Only this venv's torch and transformers are used.
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import peer_common as peers  # noqa: E402


def pad_token_id(model_dir: str) -> int:
    """The id that left-pads a batch: the model's pad token, else its (first) EOS, else 0."""
    from transformers import AutoConfig

    if model_dir.endswith(".gguf"):  # --model-dir may be a GGUF file (HFRunner loads it through gguf_file)
        config = AutoConfig.from_pretrained(os.path.dirname(model_dir), gguf_file=os.path.basename(model_dir))
    else:
        config = AutoConfig.from_pretrained(model_dir)
    eos = config.eos_token_id
    eos = eos[0] if isinstance(eos, (list, tuple)) else eos
    return config.pad_token_id if config.pad_token_id is not None else (eos if eos is not None else 0)


def main() -> None:
    p = peers.parser(__doc__.split("\n\n")[0], ("w1", "w2", "w4", "w6"))
    p.add_argument("--batch-size", type=int, default=16, help="W2/W4 prompts per generate() call (default 16)")
    p.add_argument(
        "--model-dir",
        default=peers.MODEL_DIR,
        help="a Hugging Face directory or GGUF file (default: the peers' fp32 copy of the default model)",
    )
    args = p.parse_args()
    sizes = peers.sizes_of(args)

    import torch
    import transformers

    from petrel.bench.runners import HFRunner

    runner = HFRunner(
        argparse.Namespace(dtype="float32", hf_batch_size=args.batch_size), args.model_dir, pad_token_id(args.model_dir)
    )
    info = {
        **runner.info(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "torch_threads": torch.get_num_threads(),
        "args": vars(args),
    }
    prompt = peers.w1_prompt(args)
    info["warmup_s"] = runner.warmup(prompt)
    if args.workload == "w6":
        plan = peers.w6_plan_of(args)
        batch, long = peers.make_w6_prompts(plan)
        records = {"batch": [], "long": []}
        for key, prompts in (("batch", batch), ("long", [long])):
            for i, ids in enumerate(prompts):
                runner.w1(ids, plan.new_tokens, i)
                t_send, times = runner.last_times
                records[key].append({"t_send": t_send, "prompt_len": len(ids), "times": times})
                print(f"w6 {key} {i}: TTFT {times[0] - t_send if times else float('nan'):.2f} s", flush=True)
        result = peers.w6_result(plan, records["batch"], records["long"], "requests one at a time")
    elif args.workload == "w1":
        runs, returned, ids = [], [], []
        for r in range(sizes.w1_runs):
            m, ids = runner.w1(prompt, sizes.w1_new_tokens, r)
            runs.append(m)
            returned.append(len(ids))
            print(
                f"run {r}: TTFT {1000 * (m['ttft_s'] or float('nan')):.1f} ms, "
                f"decode {m['decode_tok_s'] or float('nan'):.2f} tok/s",
                flush=True,
            )
        result = peers.w1_result(runs, returned, sizes.w1_new_tokens, ids)
    else:
        prompts, n = peers.batch_prompts(args.workload, sizes)
        res = runner.batch(prompts, n, args.workload)
        result = peers.batch_result(
            args.workload, prompts, res["counts"], res["wall_s"], n, res["cached"] if args.workload == "w4" else None
        )
        result["padded_prompt_tokens"] = res["padded_prompt_tokens"]
    runner.close()
    peers.save_result(f"hf_{args.workload}" + (f"_{args.tag}" if args.tag else ""), {**info, **result})


if __name__ == "__main__":
    main()
