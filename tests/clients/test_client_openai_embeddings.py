"""The openai SDK's `embeddings.create` against petrel serve: the served model's final hidden states pooled
(last token by default, mean on a server started so) and L2-normalised, equal to transformers' within 1e-4."""

from __future__ import annotations

import base64

import httpx
import numpy as np
import openai
import pytest
import torch

from petrel.serve import build_app
from petrel.serve.server import BackgroundServer

MODEL = "SmolLM2-135M-Instruct"
TEXTS = ["The quick brown fox jumps over the lazy dog.", "Embeddings are pooled hidden states."]


def _reference(llm, hf_model, text: str, pooling: str) -> np.ndarray:
    ids = llm.tokenizer(text)["input_ids"]
    with torch.no_grad():
        hidden = hf_model(torch.tensor([ids]), output_hidden_states=True).hidden_states[-1][0].float()
    vector = hidden[-1] if pooling == "last" else hidden.mean(dim=0)
    return torch.nn.functional.normalize(vector, dim=0).numpy()


@pytest.fixture(scope="module")
def client(base_url):
    return openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0)


def test_last_token_pooling_equals_transformers(llm, hf_model, client):
    # the SDK asks for base64 by default and decodes it: this is the base64 path
    out = client.embeddings.create(model=MODEL, input=TEXTS)
    assert [d.index for d in out.data] == [0, 1] and out.model == MODEL
    lengths = [len(llm.tokenizer(t)["input_ids"]) for t in TEXTS]
    assert out.usage.prompt_tokens == out.usage.total_tokens == sum(lengths)
    for d, text in zip(out.data, TEXTS):
        got = np.asarray(d.embedding, dtype=np.float32)
        assert got.shape == (llm.engine.core.model_config.hidden_size,)
        assert abs(np.linalg.norm(got) - 1) < 1e-5
        np.testing.assert_allclose(got, _reference(llm, hf_model, text, "last"), atol=1e-4)
    floats = client.embeddings.create(model=MODEL, input=TEXTS[0], encoding_format="float")
    np.testing.assert_allclose(floats.data[0].embedding, out.data[0].embedding, atol=1e-6)  # batched apart
    ids = llm.tokenizer(TEXTS[1])["input_ids"]
    by_ids = client.embeddings.create(model=MODEL, input=[ids, ids[:3]], encoding_format="float")
    np.testing.assert_allclose(by_ids.data[0].embedding, out.data[1].embedding, atol=1e-6)
    assert by_ids.usage.prompt_tokens == len(ids) + 3


def test_mean_pooling_equals_transformers(llm, hf_model):
    with BackgroundServer(build_app(llm, embedding_pooling="mean")) as srv:
        r = httpx.post(f"{srv.url}/v1/embeddings", json={"input": TEXTS[0], "encoding_format": "base64"})
    assert r.status_code == 200, r.text
    got = np.frombuffer(base64.b64decode(r.json()["data"][0]["embedding"]), dtype="<f4")
    np.testing.assert_allclose(got, _reference(llm, hf_model, TEXTS[0], "mean"), atol=1e-4)


@pytest.mark.parametrize(
    "body, param",
    [
        ({"input": "x", "dimensions": 64}, "dimensions"),
        ({"input": ""}, "input"),
        ({"input": []}, "input"),
        ({"input": [10**9]}, "input"),
        ({"input": "x", "encoding_format": "int8"}, None),
    ],
)
def test_bad_embedding_requests(served, body, param):
    r = httpx.post(f"{served}/v1/embeddings", json=body)
    assert r.status_code == 400, r.text
    if param is not None:
        assert r.json()["error"]["param"] == param
    ok = httpx.post(f"{served}/v1/embeddings", json={"input": "still serving", "encoding_format": "float"})
    assert ok.status_code == 200 and len(ok.json()["data"]) == 1


def test_build_app_refuses_an_unknown_pooling(llm):
    with pytest.raises(ValueError, match="embedding_pooling"):
        build_app(llm, embedding_pooling="cls")
