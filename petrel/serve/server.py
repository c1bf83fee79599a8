"""`petrel serve`: options, the engine, uvicorn. BackgroundServer runs the app in a thread (tests, benchmarks)."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import socket
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import uvicorn

from petrel.cli_options import (
    dtype_arguments,
    dtype_options,
    kv_store_arguments,
    kv_store_options,
    kv_tier_arguments,
    kv_tier_options,
    multimodal_arguments,
    multimodal_options,
    parallel_arguments,
    parallel_options,
    speculative_config_json,
)
from petrel.heap import freeze_startup_objects
from petrel.serve.connections import (
    DEFAULT_HEADER_TIMEOUT,
    ConnectionGuard,
    default_max_connections,
    guarded_config,
    raise_open_file_limit,
)
from petrel.serve.limits import DEFAULT_BODY_TIMEOUT
from petrel.serve.media_fetch import (
    DEFAULT_FETCH_TIMEOUT,
    DEFAULT_MAX_FETCHES,
    DEFAULT_REQUEST_FETCH_TIMEOUT,
    FetchOptions,
)

# A server's step budget: a burst of requests gets its first tokens a few prompts at a time instead of a 2048-token
# step at a time. W3 (16 streams, the peers' serve client then): 2048 -> 512 tokens moved TTFT p50 4.94 -> 2.10 s,
# p99 8.25 -> 6.73 s at the same throughput (150.6 -> 153.7 tok/s); offline W2 prefers 2048 (180 vs 169 tok/s).
SERVE_MAX_NUM_BATCHED_TOKENS = 512


def add_arguments(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    p.add_argument(
        "--model", default=None, help="GGUF file, Hugging Face directory or hub id (default: SmolLM2-135M-Instruct)"
    )
    p.add_argument("--tokenizer", default=None, help="another tokenizer directory or hub id")
    p.add_argument(
        "--mmproj", default=None, help="llama.cpp vision projector GGUF (Idefics3 / SmolVLM) for a llama text GGUF"
    )
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument(
        "--api-key",
        default=os.environ.get("PETREL_API_KEY"),
        help="require `Authorization: Bearer KEY` on /v1, /tokenize and /detokenize, and on every gRPC call "
        "but HealthCheck (default: $PETREL_API_KEY, else none)",
    )
    p.add_argument("--served-model-name", default=None, help="the model name clients send (default: the model's)")
    p.add_argument("--chat-template", default=None, help="a Jinja chat template (file or text) overriding the model's")
    p.add_argument(
        "--trust-special-tokens-in-messages",
        action="store_true",
        help="special-token strings (e.g. <|im_start|>) written in chat messages act as control tokens; "
        "only for trusted clients: by default they are text, so no message can forge another turn",
    )
    p.add_argument("--max-n", type=int, default=16, help="most choices (n) per request")
    p.add_argument(
        "--embedding-pooling",
        choices=("last", "mean"),
        default="last",
        help="how /v1/embeddings pools an input's final hidden states: the last token's (default) or their mean",
    )
    p.add_argument(
        "--max-queue-len",
        type=int,
        default=1024,
        help="requests that may wait beyond the running batch; more get 429 (-1: no limit)",
    )
    p.add_argument("--max-request-bytes", type=int, default=16 * 1024 * 1024, help="larger bodies get 413")
    p.add_argument(
        "--max-connections",
        type=int,
        default=None,
        help="open connections at most; at the cap a new one evicts the connection waiting longest "
        "for its request headers, else gets 503 (default: half the open-file limit, at most 4096)",
    )
    p.add_argument(
        "--header-timeout",
        type=float,
        default=DEFAULT_HEADER_TIMEOUT,
        help="seconds a connection may take to send a request's headers, from connecting or the "
        f"previous response; then it is closed (default {DEFAULT_HEADER_TIMEOUT:g})",
    )
    p.add_argument(
        "--body-timeout",
        type=float,
        default=DEFAULT_BODY_TIMEOUT,
        help="seconds a request body may stall between chunks before a 408 (default "
        f"{DEFAULT_BODY_TIMEOUT:g}; 0: no limit)",
    )
    p.add_argument(
        "--grpc-port",
        type=int,
        default=None,
        help="also serve the TensorRT-LLM gRPC worker service (trtllm.TrtllmService, what the smg gateway "
        "drives: `smg launch --worker-urls grpc://HOST:PORT`) on this port, over the same engine, at --host, "
        "without TLS; with --api-key every call but HealthCheck needs metadata `authorization: Bearer KEY` "
        "(needs `pip install petrel[grpc]`)",
    )
    p.add_argument(
        "--grpc-service",
        default="trtllm",
        choices=["trtllm", "vllm"],
        help="the gRPC service --grpc-port serves: trtllm, or vllm (smg's vLLM protocol: what the gateway's "
        "--pd-disaggregation drives, with --kv-transfer-role prefill / decode)",
    )
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    g = p.add_argument_group("engine options (see petrel/config.py)")
    dtype_arguments(g)
    g.add_argument("--device", default="cpu")
    g.add_argument(
        "--quantization",
        default=None,
        choices=["none", "int8", "gguf", "bf16"],
        help="weights kept quantized: int8 per row (any model) or the GGUF's own blocks (default: none)",
    )
    g.add_argument("--max-model-len", type=int, default=None)
    g.add_argument("--block-size", type=int, default=None)
    g.add_argument("--kv-cache-memory", type=int, default=None, help="bytes for the KV cache")
    g.add_argument("--max-num-seqs", type=int, default=None)
    g.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=None,
        help=f"tokens per step (default {SERVE_MAX_NUM_BATCHED_TOKENS} with chunked prefill: the first "
        "tokens of a burst of requests come sooner; offline LLM's default is larger, for throughput)",
    )
    g.add_argument("--no-prefix-caching", action="store_true")
    g.add_argument("--no-chunked-prefill", action="store_true")
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--num-threads", type=int, default=None, help="torch intra-op threads")
    g.add_argument("--enable-lora", action="store_true", help="serve LoRA adapters (see --lora-modules)")
    g.add_argument(
        "--lora-modules",
        nargs="+",
        default=None,
        metavar="NAME=PATH",
        help="PEFT LoRA adapters served under NAME (a request's `model` picks one); needs --enable-lora",
    )
    g.add_argument("--max-loras", type=int, default=None, help="LoRA adapters resident (and running) at once")
    g.add_argument("--max-lora-rank", type=int, default=None, help="largest LoRA rank accepted")
    g.add_argument(
        "--speculative-config",
        type=speculative_config_json,
        default=None,
        metavar="JSON",
        help='speculative decoding, e.g. \'{"method": "ngram", "num_speculative_tokens": 4}\' '
        '(methods: ngram, draft_model with "draft_model": PATH, self with "draft_num_layers": N, lookahead with '
        '"max_window_size", "max_ngram_size", "max_verification_set_size")',
    )
    multimodal_arguments(p)
    kv_tier_arguments(p)
    p.add_argument(
        "--no-remote-media",
        action="store_true",
        help="refuse http(s) image URLs in chat messages (data: URLs are always taken)",
    )
    p.add_argument(
        "--allowed-media-domains",
        nargs="+",
        default=None,
        metavar="HOST",
        help="fetch image / video URLs only from these host names (each redirect's too; default: any public host)",
    )
    p.add_argument(
        "--allow-private-media",
        action="store_true",
        help="let image / video URLs reach loopback, private, link-local and other non-public addresses (by "
        "default a URL whose host resolves to one is refused)",
    )
    p.add_argument(
        "--media-fetch-timeout",
        type=float,
        default=DEFAULT_FETCH_TIMEOUT,
        help=f"seconds one image / video URL may take, connection to last byte, redirects included (default "
        f"{DEFAULT_FETCH_TIMEOUT:g})",
    )
    p.add_argument(
        "--media-request-timeout",
        type=float,
        default=DEFAULT_REQUEST_FETCH_TIMEOUT,
        help=f"seconds all the image / video URLs of one request may take (default {DEFAULT_REQUEST_FETCH_TIMEOUT:g})",
    )
    p.add_argument(
        "--max-media-fetches",
        type=int,
        default=DEFAULT_MAX_FETCHES,
        help=f"requests fetching image / video URLs at once, on a pool of their own; more get 429 (default "
        f"{DEFAULT_MAX_FETCHES})",
    )
    d = p.add_argument_group("disaggregated serving (off unless --kv-transfer-role is given)")
    d.add_argument(
        "--kv-transfer-role",
        default=None,
        choices=["prefill", "decode", "both"],
        help="prefill: answer context_only requests and serve their prompt KV; decode: answer "
        "generation_only requests, fetching it from a --kv-transfer-peers server; both",
    )
    d.add_argument(
        "--kv-transfer-peers",
        nargs="+",
        default=None,
        metavar="HOST:PORT",
        help="decode: the prefill servers' KV transfer endpoints it may fetch from (as they advertise "
        "them in ctx_info_endpoint); any other is refused without connecting",
    )
    d.add_argument(
        "--kv-transfer-secret",
        default=os.environ.get("PETREL_KV_TRANSFER_SECRET"),
        help="the secret every prefill and decode server shares: a fetch without it is refused "
        "(default: $PETREL_KV_TRANSFER_SECRET, else the --api-key)",
    )
    d.add_argument(
        "--kv-transfer-host", default=None, help="prefill: the address its KV transfer server listens on (127.0.0.1)"
    )
    d.add_argument("--kv-transfer-port", type=int, default=None, help="and its port (default: one the OS picks)")
    d.add_argument(
        "--kv-transfer-timeout",
        type=float,
        default=None,
        help="seconds a context_only request's prompt KV stays pinned waiting to be fetched, and a "
        "fetch's deadline (60)",
    )
    d.add_argument(
        "--kv-transfer-max-pinned",
        type=int,
        default=None,
        help="prefill: context_only prompts pinned at once; more get 429 (64)",
    )
    d.add_argument(
        "--kv-transfer-max-pinned-share",
        type=float,
        default=None,
        help="prefill: the most of the KV cache they may hold, 0..1; more get 429 (0.25)",
    )
    d.add_argument(
        "--kv-transfer-max-fetches", type=int, default=None, help="decode: KV fetches at once; more get 429 (4)"
    )
    parallel_arguments(g)
    kv_store_arguments(p)
    return p


def engine_options(args) -> dict:
    options = {**dtype_options(args), "device": args.device}
    for key in (
        "tokenizer",
        "mmproj",
        "max_model_len",
        "block_size",
        "kv_cache_memory",
        "max_num_seqs",
        "max_num_batched_tokens",
        "seed",
        "num_threads",
        "speculative_config",
        "max_loras",
        "max_lora_rank",
        "kv_transfer_host",
        "kv_transfer_port",
        "kv_transfer_timeout",
        "quantization",
        "kv_transfer_role",
        "kv_transfer_peers",
        "kv_transfer_max_pinned",
        "kv_transfer_max_pinned_share",
        "kv_transfer_max_fetches",
    ):
        value = getattr(args, key)
        if value is not None:
            options[key] = value
    if args.kv_transfer_role is not None:  # the secret travels only to an instance that takes a role
        options["kv_transfer_secret"] = args.kv_transfer_secret or args.api_key
    if args.no_prefix_caching:
        options["enable_prefix_caching"] = False
    if args.no_chunked_prefill:
        options["enable_chunked_prefill"] = False
    elif args.max_num_batched_tokens is None:
        options["max_num_batched_tokens"] = SERVE_MAX_NUM_BATCHED_TOKENS
    if args.enable_lora:
        options["enable_lora"] = True
    options.update(parallel_options(args))
    options.update(multimodal_options(args))
    options.update(kv_store_options(args))
    options.update(kv_tier_options(args))
    return options


def media_fetch_options(args) -> FetchOptions:
    """--allowed-media-domains, --allow-private-media, --media-fetch-timeout, --media-request-timeout,
    --max-media-fetches as FetchOptions; ValueError naming the flag for a bad value."""
    for flag, value in (
        ("--media-fetch-timeout", args.media_fetch_timeout),
        ("--media-request-timeout", args.media_request_timeout),
    ):
        if not value > 0:
            raise ValueError(f"{flag} must be positive, got {value:g}")
    if args.max_media_fetches < 1:
        raise ValueError(f"--max-media-fetches must be at least 1, got {args.max_media_fetches}")
    return FetchOptions(
        allow_private=args.allow_private_media,
        allowed_domains=frozenset(args.allowed_media_domains) if args.allowed_media_domains else None,
        timeout=args.media_fetch_timeout,
        request_timeout=args.media_request_timeout,
        max_concurrent=args.max_media_fetches,
    )


def lora_modules(args) -> dict[str, str]:
    """--lora-modules NAME=PATH ... as {name: path}; ValueError for a malformed one or without --enable-lora."""
    modules = {}
    for item in args.lora_modules or []:
        name, sep, path = item.partition("=")
        if not sep or not name or not path:
            raise ValueError(f"--lora-modules: expected NAME=PATH, got {item!r}")
        if name in modules:
            raise ValueError(f"--lora-modules: name {name!r} given twice")
        modules[name] = path
    if modules and not args.enable_lora:
        raise ValueError("--lora-modules needs --enable-lora")
    return modules


def run(args) -> int:
    from petrel import LLM

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.body_timeout < 0:
        raise ValueError(f"--body-timeout must be positive, or 0 for no limit; got {args.body_timeout:g}")
    file_limit = raise_open_file_limit()
    guard = ConnectionGuard(args.header_timeout, args.max_connections or default_max_connections(file_limit))
    loras = lora_modules(args)
    media_fetch = media_fetch_options(args)
    with ThreadPoolExecutor(1, thread_name_prefix="petrel-load") as pool:
        loading = pool.submit(LLM, args.model, **engine_options(args))
        try:  # FastAPI and the app's modules import while the model loads (most of loading frees the GIL)
            from petrel.serve.app import build_app
            from petrel.serve.chat_template import load_template_source

            template = load_template_source(args.chat_template)
        except BaseException:
            loading.add_done_callback(lambda f: f.exception() is None and f.result().shutdown())
            raise
        llm = loading.result()
    try:
        app = build_app(
            llm,
            args.served_model_name,
            args.api_key,
            template,
            max_n=args.max_n,
            trust_special_tokens=args.trust_special_tokens_in_messages,
            max_queue_len=None if args.max_queue_len < 0 else args.max_queue_len,
            max_request_bytes=args.max_request_bytes,
            lora_modules=loras,
            body_timeout=args.body_timeout or None,
            embedding_pooling=args.embedding_pooling,
            allow_remote_media=not args.no_remote_media,
            media_fetch=media_fetch,
        )
        config = guarded_config(
            app, guard, host=args.host, port=args.port, log_level=args.log_level, timeout_graceful_shutdown=5
        )
        grpc_server = start_grpc(llm, app.state.petrel, template, args)
        print(startup_banner(llm, app.state.petrel.model_name, args.host, args.port), file=sys.stderr, flush=True)
        if grpc_server is not None:
            print(f"petrel serve: gRPC worker ({args.grpc_service} service) at {grpc_server.address}", file=sys.stderr)
        # uvicorn re-raises the signal that stopped it once it has shut down; with these handlers that
        # ends here, so a drained SIGTERM / Ctrl-C exits 0 instead of dying by the signal
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: None)
        freeze_startup_objects()
        DrainingServer(config, llm).run()
        if grpc_server is not None:
            grpc_server.stop()
    finally:
        llm.shutdown()
    return 0


def start_grpc(llm, state, chat_template: str | None, args):
    """The gRPC worker beside the HTTP server (--grpc-port), with the HTTP server's host, API key, request size
    limit, model name, LoRA adapters and queue limit; None without --grpc-port."""
    if args.grpc_port is None:
        return None
    from petrel.grpc import build_grpc_server

    return build_grpc_server(
        llm,
        state.model_name,
        args.host,
        args.grpc_port,
        service=args.grpc_service,
        api_key=args.api_key,
        max_request_bytes=args.max_request_bytes,
        max_pending=state.max_pending,
        max_n=args.max_n,
        chat_template=chat_template,
        lora_modules=state.lora_modules,
        health_timeout=state.health_timeout,
    ).start()


def startup_banner(llm, model_name: str, host: str, port: int) -> str:
    """What `petrel serve` says before it listens: the model, dtype, device, KV-cache capacity, the URL."""
    bm = llm.engine.core.block_manager
    shown = f"[{host}]" if ":" in host else host
    url = f"http://{'127.0.0.1' if host in ('0.0.0.0', '') else shown}:{port}"
    return (
        f"petrel serve: model {model_name} ({getattr(llm.config, 'model', None) or 'default'}), "
        f"dtype {llm.config.dtype}, device {llm.config.device}, "
        f"KV cache {llm.engine.kv_cache_tokens} tokens ({bm.num_blocks} blocks of {bm.block_size}"
        f"{f' shared by {bm.num_groups} layer groups' if bm.num_groups > 1 else ''}, "
        f"{llm.engine.kv_bytes_per_token} bytes a token), "
        f"max model len {llm.engine.max_model_len}\n"
        f"{kv_transfer_banner(llm)}"
        f"petrel serve: API at {url}/v1, chat page at {url}/"
    )


def kv_transfer_banner(llm) -> str:
    """The disaggregated-serving role, and the endpoint decode servers list in --kv-transfer-peers."""
    role = llm.config.kv_transfer_role
    if role is None:
        return ""
    served = f", KV transfer server at {llm.kv_transfer_endpoint}" if llm.kv_transfer_endpoint else ""
    peers = f", fetching from {' '.join(llm.config.kv_transfer_peers)}" if llm.config.kv_transfer_peers else ""
    return f"petrel serve: disaggregated serving role {role}{served}{peers}\n"


class DrainingServer(uvicorn.Server):
    """On SIGTERM / Ctrl-C: end every request in flight with a final error event (streams then close with
    [DONE]), so uvicorn's graceful shutdown finds nothing left to wait for and the process exits 0."""

    def __init__(self, config, llm):
        super().__init__(config)
        self.llm = llm

    def handle_exit(self, sig, frame) -> None:
        self.llm.engine.abort_all("the server is shutting down")
        super().handle_exit(sig, frame)


class BackgroundServer:
    """uvicorn serving `app` on 127.0.0.1 in a daemon thread, on a free port picked by the OS, through a
    ConnectionGuard (`self.guard`) with these limits (as `petrel serve`'s --header-timeout, --max-connections)."""

    def __init__(
        self,
        app,
        host: str = "127.0.0.1",
        port: int = 0,
        log_level: str = "warning",
        header_timeout: float = DEFAULT_HEADER_TIMEOUT,
        max_connections: int | None = None,
    ):
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((host, port))
        self.host, self.port = self.sock.getsockname()[:2]
        self.guard = ConnectionGuard(header_timeout, max_connections)
        config = guarded_config(app, self.guard, log_level=log_level, timeout_graceful_shutdown=2)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(
            target=self.server.run, kwargs={"sockets": [self.sock]}, name="petrel-serve", daemon=True
        )

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, timeout: float = 30.0) -> BackgroundServer:
        self.thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the server did not start")
            time.sleep(0.02)
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)
        self.sock.close()

    def __enter__(self) -> BackgroundServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
