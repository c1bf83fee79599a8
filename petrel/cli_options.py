"""Command-line options that more than one command takes: `petrel generate | chat` (petrel/cli.py), `petrel serve`
(petrel/serve/server.py) and `petrel bench` (petrel/bench/) define them from here, so each command's
module depends on this one and none on another command's."""

from __future__ import annotations

import argparse
import json
import os


def parse_choices(text: str, known, what: str) -> list[str]:
    """A comma-separated option as a list, every item one of `known` (SystemExit naming one that is not)."""
    items = [x.strip().lower() for x in text.split(",") if x.strip()]
    for x in items:
        if x not in known:
            raise SystemExit(f"unknown {what} {x!r}; known: {', '.join(known)}")
    return items


def speculative_config_json(text: str) -> dict:
    """argparse type of --speculative-config: a JSON object (checked when the engine starts)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not valid JSON ({exc.msg})") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("expected a JSON object")
    return value


def dtype_arguments(p) -> None:
    """--dtype, --kv-cache-dtype and --float32-matmul-precision (generate, chat, serve)."""
    dtypes = ["auto", "float32", "bfloat16", "float16"]
    p.add_argument("--dtype", default="auto", choices=dtypes)
    p.add_argument(
        "--kv-cache-dtype",
        default="auto",
        choices=dtypes,
        help="what the KV cache holds (auto: what --dtype asks for; on the CPU bfloat16 beside float32 arithmetic)",
    )
    p.add_argument(
        "--float32-matmul-precision",
        default="highest",
        choices=["highest", "medium"],
        help="float32 weights' prompt-sized products: float32 (highest), or bfloat16 on AMX tiles where the CPU has "
        "them (medium)",
    )


def dtype_options(args) -> dict:
    """The LLM / EngineConfig keywords of the options dtype_arguments added."""
    return {
        "dtype": args.dtype,
        "kv_cache_dtype": args.kv_cache_dtype,
        "float32_matmul_precision": args.float32_matmul_precision,
    }


def parallel_arguments(p) -> None:
    """--tensor-parallel-size and --distributed-executor-backend (generate, chat, serve, bench)."""
    p.add_argument(
        "--tensor-parallel-size",
        "-tp",
        type=int,
        default=None,
        metavar="N",
        help="split the model over N ranks: this process and N-1 workers (default 1)",
    )
    p.add_argument(
        "--distributed-executor-backend",
        choices=["mp", "ray"],
        default=None,
        help="how the workers run: local processes (mp, the default) or Ray actors (ray; joins the "
        "cluster at RAY_ADDRESS when set)",
    )


def parallel_options(args) -> dict:
    """The LLM / EngineConfig keywords of the options parallel_arguments added, only those given."""
    options = {}
    if args.tensor_parallel_size is not None:
        options["tensor_parallel_size"] = args.tensor_parallel_size
    if args.distributed_executor_backend is not None:
        options["distributed_executor_backend"] = args.distributed_executor_backend
    return options


def limit_mm_per_prompt(text: str) -> dict:
    """argparse type of --limit-mm-per-prompt: vLLM's forms, image=N (comma-separated kinds) or a JSON object."""
    text = text.strip()
    if text.startswith("{"):
        try:
            value = json.loads(text)
        except json.JSONDecodeError as exc:
            raise argparse.ArgumentTypeError(f"not valid JSON ({exc.msg})") from None
    else:
        value = {}
        for item in filter(None, (x.strip() for x in text.split(","))):
            kind, sep, count = item.partition("=")
            if not sep or not count.strip().isdigit():
                raise argparse.ArgumentTypeError(f"expected KIND=N (e.g. image=2), got {item!r}")
            value[kind.strip()] = int(count)
    if not isinstance(value, dict) or set(value) - {"image", "video"}:
        raise argparse.ArgumentTypeError(f"petrel's models take images and videos (image=N,video=M), got {text!r}")
    return value


def multimodal_arguments(p) -> None:
    """Options of vision-language models (`petrel serve`)."""
    g = p.add_argument_group("images (vision-language models)")
    g.add_argument(
        "--limit-mm-per-prompt",
        type=limit_mm_per_prompt,
        default=None,
        metavar="image=N,video=M",
        help='most images / videos in one request (image=N,video=M, or JSON {"image": N}); default: no limit',
    )
    g.add_argument("--max-image-pixels", type=int, default=None, help="pixel budget of one image (40000000)")
    g.add_argument(
        "--encoder-cache-memory", type=int, default=None, help="bytes of image encoder outputs kept for reuse"
    )


def multimodal_options(args) -> dict:
    """The LLM / EngineConfig keywords of the options multimodal_arguments added, only those given."""
    names = ("limit_mm_per_prompt", "max_image_pixels", "encoder_cache_memory")
    return {name: getattr(args, name) for name in names if getattr(args, name, None) is not None}


def kv_store_arguments(p) -> None:
    """--kv-store-url: the KV block store instances share (`petrel serve`)."""
    g = p.add_argument_group("shared KV block store")
    g.add_argument(
        "--kv-store-url",
        default=os.environ.get("PETREL_KV_STORE_URL"),
        metavar="URL",
        help="a Redis or Valkey server (redis://HOST:PORT/DB, rediss://, unix://) where instances publish the KV "
        "blocks they compute and fetch those others computed (needs `pip install petrel[kv-store]`; "
        "default: $PETREL_KV_STORE_URL, else none)",
    )


def kv_store_options(args) -> dict:
    """The LLM / EngineConfig keywords of the options kv_store_arguments added, only those given."""
    url = getattr(args, "kv_store_url", None)
    return {"kv_store_url": url} if url else {}


def byte_size(text: str) -> int:
    """argparse type of a size in bytes, with an optional K/M/G/T suffix (powers of 1024): 8G, 512M, 1048576."""
    raw = text.strip().upper().removesuffix("B").removesuffix("I")
    scale = {"K": 1024, "M": 1024**2, "G": 1024**3, "T": 1024**4}.get(raw[-1:], 1)
    try:
        value = int(float(raw[:-1] if scale != 1 else raw) * scale)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (use bytes or e.g. 512M, 8G)") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"a size must be positive, got {text!r}")
    return value


def kv_tier_arguments(p) -> None:
    """--kv-host-tier-bytes, --kv-disk-tier-path, --kv-disk-tier-bytes and --kv-tier-fetch-timeout (serve, generate,
    chat)."""
    g = p.add_argument_group("KV tiers (prefix-cache blocks evicted from the KV cache, kept and brought back)")
    g.add_argument(
        "--kv-host-tier-bytes",
        type=byte_size,
        default=None,
        metavar="SIZE",
        help="keep evicted KV blocks in host memory, up to SIZE bytes (e.g. 8G); least recently used go to the "
        "disk tier when there is one (default: off)",
    )
    g.add_argument(
        "--kv-disk-tier-path",
        default=None,
        metavar="DIR",
        help="keep evicted KV blocks as files in DIR (this engine's while it runs: a previous run's blocks are "
        "removed at start) (default: off)",
    )
    g.add_argument(
        "--kv-disk-tier-bytes",
        type=byte_size,
        default=None,
        metavar="SIZE",
        help="the most bytes the disk tier holds; the oldest blocks are removed to make room (default 8G)",
    )
    g.add_argument(
        "--kv-tier-fetch-timeout",
        type=float,
        default=None,
        metavar="SECONDS",
        help="the longest a request waits for its blocks to be read from the disk tier or the shared KV store "
        "before it is admitted and computes the rest (default 2)",
    )


def kv_tier_options(args) -> dict:
    """The LLM / EngineConfig keywords of the options kv_tier_arguments added, only those given."""
    names = ("kv_host_tier_bytes", "kv_disk_tier_path", "kv_disk_tier_bytes", "kv_tier_fetch_timeout")
    return {name: getattr(args, name) for name in names if getattr(args, name, None) is not None}
