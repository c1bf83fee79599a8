"""Vision-language cost: the vision encoder per image and the time to first token with 1 and 4 images, petrel and
transformers on the same weights, in one run.

    python benchmarks/multimodal_bench.py --out benchmarks/results/DATE-multimodal.json
    python benchmarks/multimodal_bench.py --quick          # a smoke run at tiny shapes

The model is an Idefics3 / SmolVLM built with transformers' own classes and random weights (none can be
downloaded here): a SigLIP-base vision tower (hidden 768, 12 layers, 12 heads, patch 16, image 512, as SmolVLM-256M
and -500M use), SmolVLM's pixel-shuffle connector (scale factor 4: 64 tokens per 512x512 tile) and a text model of
SmolLM2-135M's shape (hidden 576, 30 layers). Images are random RGB pictures of --image-size pixels, resized and
tiled by the model's image processor (longest edge --longest-edge: 1024 gives 2x2 tiles plus the global view, 5
tiles and 320 image tokens per image).

Measured (median of --repeats, after two warm-up runs):
  encoder   one image's tiles through the vision tower + connector: petrel's encode_images (transformers' modules
            on petrel's model) and transformers' get_image_features;
  ttft      a prompt with 1 or 4 new images (never seen before: no encoder-cache or prefix-cache hit), one new
            token, wall time including the image processor: petrel's LLM.generate and transformers' processor +
            generate(max_new_tokens=1). petrel's engine-side TTFT (from admission, after the processor) and the
            encoder time its IterationStats report are given too.
Both run in this process, on the same device, dtype and torch threads.
"""

from __future__ import annotations

import argparse
import itertools
import json
import platform
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np
import torch

SPECIAL = ["<fake_token_around_image>", "<image>", "<end_of_utterance>", "<global-img>"] + [
    f"<row_{i}_col_{j}>" for i in range(1, 7) for j in range(1, 7)
]
SHAPES = {
    # SigLIP-base-patch16-512 (SmolVLM-256M / -500M's tower) and SmolLM2-135M's text model
    "full": {
        "vision": dict(
            hidden_size=768,
            intermediate_size=3072,
            num_hidden_layers=12,
            num_attention_heads=12,
            image_size=512,
            patch_size=16,
        ),
        "text": dict(
            hidden_size=576,
            intermediate_size=1536,
            num_hidden_layers=30,
            num_attention_heads=9,
            num_key_value_heads=3,
        ),
        "scale_factor": 4,
    },
    "quick": {
        "vision": dict(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=2,
            image_size=64,
            patch_size=8,
        ),
        "text": dict(
            hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2
        ),
        "scale_factor": 2,
    },
}


def build_model(path: str, shapes: dict, longest_edge: int):
    """A random-weight SmolVLM saved as a Hugging Face directory (config, safetensors, processor, tokenizer)."""
    from transformers import Idefics3Processor, SmolVLMConfig, SmolVLMForConditionalGeneration

    try:
        from transformers import Idefics3ImageProcessorPil as ImageProcessor
    except ImportError:  # transformers 4
        from transformers import Idefics3ImageProcessor as ImageProcessor

    from petrel.model.loader import resolve_model
    from petrel.model.tokenizer import load_tokenizer

    tok = load_tokenizer(resolve_model(None))
    tok.add_special_tokens({"additional_special_tokens": SPECIAL})
    vision, scale = shapes["vision"], shapes["scale_factor"]
    config = SmolVLMConfig(
        text_config=dict(
            model_type="llama",
            vocab_size=49280,
            max_position_embeddings=8192,
            rms_norm_eps=1e-5,
            bos_token_id=1,
            eos_token_id=2,
            **shapes["text"],
        ),
        vision_config=vision,
        scale_factor=scale,
        image_token_id=tok.convert_tokens_to_ids("<image>"),
    )
    torch.manual_seed(0)
    hf = SmolVLMForConditionalGeneration(config).float().eval()
    hf.save_pretrained(path)
    image_seq_len = (vision["image_size"] // vision["patch_size"]) ** 2 // (scale * scale)
    image_processor = ImageProcessor(
        size={"longest_edge": longest_edge}, max_image_size={"longest_edge": vision["image_size"]}
    )
    processor = Idefics3Processor(image_processor=image_processor, tokenizer=tok, image_seq_len=image_seq_len)
    processor.save_pretrained(path)
    return hf, processor


SEEDS = itertools.count(1000)  # every picture of a run is new: no encoder-cache or prefix-cache hit


def pictures(n: int, size: int) -> list:
    from PIL import Image

    rng = np.random.RandomState(next(SEEDS))
    return [Image.fromarray(rng.randint(0, 256, (size, size, 3), dtype=np.uint8)) for _ in range(n)]


def prompt_for(k: int) -> str:
    return "<|im_start|>User:" + "<image>" * k + "Describe the images.<end_of_utterance>\nAssistant:"


def median_time(fn, repeats: int, warmup: int = 2) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def bench_encoder(llm, hf, processor, args) -> dict:
    """Seconds per image through the vision tower + connector (its tiles as one batch)."""
    (image,) = pictures(1, args.image_size)
    tiles = processor.image_processor(images=[[image]], return_tensors="pt")["pixel_values"][0].float()
    model = llm.engine.core.runner.model
    dev = args.device

    def petrel_encode():
        model.encode_images([tiles])
        _sync(dev)

    pixel_values = tiles.unsqueeze(0).to(dev)

    def hf_encode():
        with torch.no_grad():
            hf.model.get_image_features(pixel_values)
        _sync(dev)

    # both on the engine's thread (where petrel encodes), between its steps: nothing else runs meanwhile
    return {
        "tiles_per_image": int(tiles.shape[0]),
        "petrel_s": llm.engine.call(lambda core: median_time(petrel_encode, args.repeats), timeout=None),
        "transformers_s": llm.engine.call(lambda core: median_time(hf_encode, args.repeats), timeout=None),
    }


def bench_ttft(llm, hf, processor, k: int, args) -> dict:
    """A prompt with k new images, one new token: wall seconds (processor included), petrel and transformers."""
    from petrel import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=1, return_perf_metrics=True)
    engine_ttft, encoder_s, prompt_tokens = [], [], 0

    def petrel_run():
        nonlocal prompt_tokens
        history = llm.engine.stats_history
        llm.engine.call(lambda core: history.clear())
        images = pictures(k, args.image_size)
        out = llm.generate({"prompt": prompt_for(k), "multi_modal_data": {"image": images}}, params, use_tqdm=False)
        prompt_tokens = len(out.prompt_token_ids)
        engine_ttft.append(out.request_perf_metrics.ttft)
        steps = llm.engine.call(lambda core: list(history))
        encoder_s.append(sum(s.encoder_time for s in steps))
        assert sum(s.num_images_encoded for s in steps) == k, "an image was not encoded (a cache hit?)"

    def hf_run():
        images = pictures(k, args.image_size)
        inputs = processor(text=[prompt_for(k)], images=[images], return_tensors="pt").to(args.device)
        with torch.no_grad():
            hf.generate(**inputs, max_new_tokens=1, do_sample=False)
        _sync(args.device)

    petrel_s = median_time(petrel_run, args.repeats)
    return {
        "images": k,
        "prompt_tokens": prompt_tokens,
        "petrel_s": petrel_s,
        "petrel_engine_ttft_s": statistics.median(engine_ttft[2:]),  # after the warm-up runs
        "petrel_encoder_s": statistics.median(encoder_s[2:]),
        "transformers_s": median_time(hf_run, args.repeats),
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="tiny shapes, 3 repeats: checks the script runs")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--image-size", type=int, default=768, help="side of the square input pictures (pixels)")
    ap.add_argument("--longest-edge", type=int, default=1024, help="the image processor's resize target")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--out", default="multimodal_bench.json", help="where the JSON results go")
    args = ap.parse_args(argv)
    shapes = SHAPES["quick" if args.quick else "full"]
    if args.quick:
        args.repeats, args.image_size, args.longest_edge = 3, 100, 128
    from petrel import LLM

    with tempfile.TemporaryDirectory(prefix="petrel-mm-bench-") as path:
        print("[mm-bench] building the model ...", file=sys.stderr, flush=True)
        hf, processor = build_model(path, shapes, args.longest_edge)
        hf = hf.to(args.device)
        llm = LLM(path, device=args.device, dtype="float32", kv_cache_memory=1 << 28, limit_mm_per_prompt={"image": 4})
        try:
            print("[mm-bench] encoder ...", file=sys.stderr, flush=True)
            encoder = bench_encoder(llm, hf, processor, args)
            ttft = []
            for k in (1, 4):
                print(f"[mm-bench] TTFT with {k} image(s) ...", file=sys.stderr, flush=True)
                ttft.append(bench_ttft(llm, hf, processor, k, args))
        finally:
            llm.shutdown()
    print("\n| measure | petrel | transformers | petrel / transformers |")
    print("| --- | ---: | ---: | ---: |")
    print(
        f"| encoder, one image ({encoder['tiles_per_image']} tiles) | {encoder['petrel_s'] * 1e3:.1f} ms "
        f"| {encoder['transformers_s'] * 1e3:.1f} ms | {encoder['petrel_s'] / encoder['transformers_s']:.2f} |"
    )
    for row in ttft:
        print(
            f"| TTFT, {row['images']} image(s), {row['prompt_tokens']} prompt tokens | {row['petrel_s'] * 1e3:.1f} ms "
            f"(engine {row['petrel_engine_ttft_s'] * 1e3:.1f}, encoder {row['petrel_encoder_s'] * 1e3:.1f}) "
            f"| {row['transformers_s'] * 1e3:.1f} ms | {row['petrel_s'] / row['transformers_s']:.2f} |"
        )
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    doc = {
        "date": time.strftime("%Y-%m-%d"),
        "commit": commit,
        "machine": platform.platform(),
        "device": args.device,
        "torch_threads": torch.get_num_threads(),
        "dtype": "float32",
        "shapes": shapes,
        "image_size": args.image_size,
        "longest_edge": args.longest_edge,
        "repeats": args.repeats,
        "command": "python benchmarks/multimodal_bench.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "encoder": encoder,
        "ttft": ttft,
    }
    with open(args.out, "w") as f:
        json.dump(doc, f, indent=1)
    print(f"\nwrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
