"""petrel generate | chat | serve | bench"""
from __future__ import annotations

import argparse
import sys


def _engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="GGUF file, Hugging Face directory or hub id (default: SmolLM2-135M-Instruct)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--kv-cache-memory", type=int, default=None, help="bytes for the KV cache")
    p.add_argument("--max-num-seqs", type=int, default=None)


def _sampling_args(p: argparse.ArgumentParser, max_tokens: int) -> None:
    p.add_argument("--max-tokens", type=int, default=max_tokens)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None)


def _make_llm(args):
    from petrel import LLM
    options = {"dtype": args.dtype}
    if args.kv_cache_memory:
        options["kv_cache_memory"] = args.kv_cache_memory
    if args.max_num_seqs:
        options["max_num_seqs"] = args.max_num_seqs
    return LLM(args.model, **options)


def _params(args):
    from petrel import SamplingParams
    return SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                          top_k=args.top_k, seed=args.seed)


def _stream(llm, prompt, params) -> str:
    future = llm.generate_async(prompt, params, streaming=True)
    text = ""
    for partial in future:
        piece = partial.outputs[0].text_diff
        text += piece
        print(piece, end="", flush=True)
    print(flush=True)
    return text


def cmd_generate(args) -> int:
    with _make_llm(args) as llm:
        prompt = args.prompt
        if args.chat_template:
            prompt = llm.apply_chat_template([{"role": "user", "content": prompt}])
        _stream(llm, prompt, _params(args))
    return 0


def cmd_chat(args) -> int:
    with _make_llm(args) as llm:
        messages = [{"role": "system", "content": args.system}] if args.system else []
        print("petrel chat: type a message, an empty line or Ctrl-D to quit.", file=sys.stderr)
        while True:
            try:
                line = input("> ")
            except (EOFError, KeyboardInterrupt):
                print(file=sys.stderr)
                break
            if not line.strip():
                break
            messages.append({"role": "user", "content": line})
            reply = _stream(llm, llm.apply_chat_template(messages), _params(args))
            messages.append({"role": "assistant", "content": reply})
    return 0


def cmd_bench(argv: list[str]) -> int:
    from petrel import bench
    return bench.main(argv)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "bench":
        return cmd_bench(argv[1:])
    parser = argparse.ArgumentParser(prog="petrel", description="petrel: a fast LLM inference engine")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="stream a completion of one prompt to the terminal")
    gen.add_argument("prompt")
    gen.add_argument("--chat-template", action=argparse.BooleanOptionalAction, default=True,
                     help="wrap the prompt as a user message in the model's chat template (default on)")
    _engine_args(gen)
    _sampling_args(gen, 256)
    chat = sub.add_parser("chat", help="an interactive chat in the terminal")
    chat.add_argument("--system", default=None, help="a system message")
    _engine_args(chat)
    _sampling_args(chat, 512)
    sub.add_parser("bench", help="benchmarks W1/W2/W4 against transformers (see `petrel bench --help`)")
    from petrel.serve.server import add_arguments as serve_arguments
    serve_arguments(sub.add_parser("serve", help="an OpenAI-compatible HTTP server (see `petrel serve --help`)"))
    args = parser.parse_args(argv)
    try:
        if args.command == "serve":
            from petrel.serve.server import run as cmd_serve
            return cmd_serve(args)
        return cmd_generate(args) if args.command == "generate" else cmd_chat(args)
    except ValueError as exc:
        print(f"petrel: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
