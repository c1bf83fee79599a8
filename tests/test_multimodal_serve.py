"""`petrel serve` with a vision-language model: image_url content parts (data URLs) through the official openai
client give transformers' tokens; malformed, non-image, oversized, too many or remote-when-off images are a 400
naming the content part, and the server keeps serving."""

from __future__ import annotations

import base64
import io
import struct
import zlib

import httpx
import openai
import pytest
import torch

from petrel import LLM
from petrel.serve import build_app
from petrel.serve.server import BackgroundServer

pytest.importorskip("transformers")
from tiny_vlm import build_tiny_idefics3, image  # noqa: E402

A, B = image(150, 100, 0), image(40, 40, 1)


@pytest.fixture(scope="module")
def vlm(tmp_path_factory):
    return build_tiny_idefics3(str(tmp_path_factory.mktemp("tiny-idefics3-serve")))


@pytest.fixture(scope="module")
def server(vlm):
    llm = LLM(vlm.path, kv_cache_memory=1 << 24, limit_mm_per_prompt={"image": 2})
    with BackgroundServer(build_app(llm, allow_remote_media=False)) as srv:
        yield srv
    llm.shutdown()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)


def data_url(img) -> str:
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def _png_header(width: int, height: int) -> bytes:
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    header = chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0))
    return b"\x89PNG\r\n\x1a\n" + header + chunk(b"IDAT", zlib.compress(b"\0" * 64)) + chunk(b"IEND", b"")


def _messages(*urls, text="What is this?"):
    parts = [{"type": "image_url", "image_url": {"url": u}} for u in urls]
    return [{"role": "user", "content": [*parts, {"type": "text", "text": text}]}]


def _hf_tokens(vlm, images, text="What is this?", n=6) -> list[int]:
    messages = [{"role": "user", "content": [*({"type": "image"} for _ in images), {"type": "text", "text": text}]}]
    prompt = vlm.processor.apply_chat_template(messages, add_generation_prompt=True)
    inputs = vlm.inputs(prompt, list(images))
    with torch.no_grad():
        out = vlm.hf.generate(**inputs, max_new_tokens=n, do_sample=False)
    return out[0, inputs["input_ids"].shape[1] :].tolist()


@pytest.mark.parametrize("images", [[A], [A, B]], ids=["1-image", "2-images"])
def test_image_url_data_urls_give_transformers_tokens(client, vlm, images):
    kwargs = dict(
        model=vlm.path, max_tokens=6, temperature=0, extra_body={"return_token_ids": True, "ignore_eos": True}
    )
    resp = client.chat.completions.create(messages=_messages(*map(data_url, images)), **kwargs)
    assert resp.choices[0].token_ids == _hf_tokens(vlm, images)
    stream = client.chat.completions.create(messages=_messages(*map(data_url, images)), stream=True, **kwargs)
    streamed = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert streamed == resp.choices[0].message.content


@pytest.mark.parametrize(
    "urls,param,match",
    [
        (["data:image/png;base64,@@not base64@@"], "messages.0.content.0", "not valid base64"),
        (["data:image/png;base64," + base64.b64encode(b"plain text").decode()], "messages.0.content.0", "decodable"),
        (
            ["data:image/png;base64," + base64.b64encode(_png_header(10000, 10000)).decode()],
            "messages.0.content.0",
            "10000x10000 pixels, over the limit",
        ),
        ([data_url(A)] * 3, "messages.0.content.2", "3 images in this request, over the limit of 2"),
        (["http://127.0.0.1:9/cat.png"], "messages.0.content.0", "--no-remote-media"),
        (["file:///etc/passwd"], "messages.0.content.0", "data: or http"),
    ],
    ids=["base64", "not-an-image", "100-megapixels", "too-many", "remote-off", "scheme"],
)
def test_bad_image_parts_are_400_naming_the_part(client, vlm, urls, param, match):
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=vlm.path, messages=_messages(*urls), max_tokens=2)
    body = err.value.body
    assert body["param"] == param and match in body["message"]
    ok = client.chat.completions.create(model=vlm.path, messages=_messages(data_url(B)), max_tokens=2)
    assert ok.choices[0].message.content is not None  # the server goes on


def test_text_only_model_refuses_image_parts(tiny, tmp_path_factory):
    from petrel.model.loader import resolve_model
    from petrel.model.tokenizer import load_tokenizer

    tok_dir = tmp_path_factory.mktemp("tokenizer-serve")
    load_tokenizer(resolve_model(None)).save_pretrained(tok_dir)
    llm = LLM(tiny(2, False).path, tokenizer=str(tok_dir), kv_cache_memory=1 << 20)
    try:
        with BackgroundServer(build_app(llm)) as srv:
            r = httpx.post(f"{srv.url}/v1/chat/completions", json={"messages": _messages(data_url(A)), "max_tokens": 2})
            info = httpx.get(f"{srv.url}/model_info").json()
    finally:
        llm.shutdown()
    assert r.status_code == 400
    assert "takes no images" in r.json()["error"]["message"]
    assert r.json()["error"]["param"] == "messages.0.content.0.type"
    assert info["has_image_understanding"] is False  # the chat page shows no attach button


def test_tokenize_refuses_image_parts(server, vlm):
    r = httpx.post(f"{server.url}/tokenize", json={"messages": _messages(data_url(A))})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages.0.content.0"
    text = [{"role": "user", "content": "What is this?"}]  # text alone: as the template renders it
    r = httpx.post(f"{server.url}/tokenize", json={"messages": text})
    want = vlm.processor.apply_chat_template(
        [{"role": "user", "content": [{"type": "text", "text": "What is this?"}]}], add_generation_prompt=True
    )
    assert r.status_code == 200 and r.json()["tokens"] == vlm.processor.tokenizer(want)["input_ids"]


def test_serve_options():
    import argparse

    from petrel.cli_options import limit_mm_per_prompt
    from petrel.serve.server import add_arguments, engine_options

    assert limit_mm_per_prompt("image=3") == limit_mm_per_prompt('{"image": 3}') == {"image": 3}
    assert limit_mm_per_prompt("image=2,video=1") == {"image": 2, "video": 1}
    for bad in ("audio=1", "image", "image=x", "[1]"):
        with pytest.raises(argparse.ArgumentTypeError):
            limit_mm_per_prompt(bad)
    args = add_arguments(argparse.ArgumentParser()).parse_args(
        ["--limit-mm-per-prompt", "image=2", "--max-image-pixels", "1000000", "--no-remote-media"]
    )
    options = engine_options(args)
    assert options["limit_mm_per_prompt"] == {"image": 2} and options["max_image_pixels"] == 1_000_000
    assert args.no_remote_media


def test_chat_messages_of_a_vision_model(client, vlm):
    """A system message given as a string reaches the template as parts (vision templates read parts); a final
    assistant message is continued; tools are refused by name."""
    messages = [{"role": "system", "content": "Be brief."}, *_messages(data_url(B))]
    out = client.chat.completions.create(model=vlm.path, messages=messages, max_tokens=2)
    assert out.choices[0].message.content is not None
    cont = client.chat.completions.create(
        model=vlm.path,
        messages=[*_messages(data_url(B)), {"role": "assistant", "content": "It is"}],
        max_tokens=2,
        extra_body={"add_generation_prompt": False, "continue_final_message": True, "return_token_ids": True},
    )
    assert vlm.processor.tokenizer.decode(cont.prompt_token_ids).endswith("\nAssistant: It is")  # left open
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(
            model=vlm.path,
            messages=_messages(data_url(B)),
            max_tokens=2,
            tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}],
        )
    assert err.value.body["param"] == "tools"


def _metric(text: str, name: str) -> float:
    line = next(x for x in text.splitlines() if x.startswith(name + "{"))
    return float(line.rsplit(" ", 1)[1])


def test_encoder_metrics_count_images_and_cache_hits(server, vlm):
    names = ("petrel_encoder_images_encoded_total", "petrel_encoder_cache_hits_total", "petrel_encoder_seconds_total")

    def scrape():
        text = httpx.get(f"{server.url}/metrics").text
        assert all(f"# TYPE {n} counter" in text for n in names)
        return [_metric(text, n) for n in names]

    before = scrape()
    picture = data_url(image(72, 56, 41))  # an image no other test sends
    for text in ("What is this?", "Describe it."):  # the second: a cache hit (its text differs before the image)
        messages = [{"role": "system", "content": text}, *_messages(picture)]
        httpx.post(f"{server.url}/v1/chat/completions", json={"messages": messages, "max_tokens": 1}, timeout=60)
    encoded, hits, seconds = (b - a for a, b in zip(before, scrape()))
    assert (encoded, hits) == (1, 1) and seconds > 0


def test_chat_page_attaches_images_for_a_vision_model(server, vlm):
    """The page's contract: it shows an attach button (hidden until /model_info says the model takes images) and
    file input; the message content its content.js builds from a data: URL and text is what the server takes,
    and gives transformers' tokens."""
    import json
    import shutil
    import subprocess
    from pathlib import Path

    page = httpx.get(f"{server.url}/").text
    assert 'id="attach"' in page and 'id="image-file" type="file" accept="image/*"' in page
    assert "/static/content.js" in page
    assert httpx.get(f"{server.url}/model_info").json()["has_image_understanding"] is True
    js = httpx.get(f"{server.url}/static/app.js").text
    assert "/model_info" in js and "takesImages" in js and "userContent" in js
    node = shutil.which("node")
    if node is None:
        pytest.skip("needs node to run the page's content.js")
    content_js = Path(__file__).parent.parent / "petrel" / "serve" / "static" / "content.js"
    served = httpx.get(f"{server.url}/static/content.js").text
    assert served == content_js.read_text()
    script = (
        f"const c = require({json.dumps(str(content_js))});"
        f"const m = c.userContent('What is this?', [{json.dumps(data_url(A))}]);"
        "process.stdout.write(JSON.stringify({content: m, text: c.contentText(m), images: c.contentImages(m).length,"
        " plain: c.userContent('hi', []), takes: [c.takesImages({has_image_understanding: true}), c.takesImages({})]}))"
    )
    out = json.loads(subprocess.run([node, "-e", script], capture_output=True, check=True, text=True).stdout)
    assert out["text"] == "What is this?" and out["images"] == 1 and out["plain"] == "hi"
    assert out["takes"] == [True, False]
    body = {
        "model": vlm.path,
        "messages": [{"role": "user", "content": out["content"]}],
        "max_tokens": 6,
        "temperature": 0,
        "return_token_ids": True,
        "ignore_eos": True,
    }
    r = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["token_ids"] == _hf_tokens(vlm, [A])
