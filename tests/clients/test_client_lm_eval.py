"""lm-evaluation-harness's `local-completions` model against `petrel serve` on a small multiple-choice task written
here: every per-sample log-likelihood equals lm-eval's transformers (`hf`) model's on the same weights within 1e-3."""

from __future__ import annotations

import json

import openai
import pytest

ITEMS = [
    {"question": "A petrel is a kind of", "choices": ["seabird", "mountain", "engine", "coin"], "answer": 0},
    {"question": "Water freezes at zero degrees", "choices": ["Celsius", "Kelvin", "percent"], "answer": 0},
    {"question": "The opposite of hot is", "choices": ["cold", "loud", "blue"], "answer": 0},
]
TASK = """task: petrel_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: answer
target_delimiter: " "
metric_list:
  - metric: acc
"""


def _loglikelihoods(lm, task_manager) -> list[float]:
    from lm_eval import simple_evaluate

    results = simple_evaluate(model=lm, tasks=["petrel_mc"], task_manager=task_manager, log_samples=True)
    samples = sorted(results["samples"]["petrel_mc"], key=lambda s: s["doc_id"])
    return [resp[0][0] for s in samples for resp in s["resps"]]


def test_local_completions_loglikelihoods_equal_hf(served, llm, hf_model, tmp_path):
    lm_eval = pytest.importorskip("lm_eval")
    from lm_eval.models.huggingface import HFLM
    from lm_eval.models.openai_completions import LocalCompletionsAPI
    from lm_eval.tasks import TaskManager

    data = tmp_path / "items.jsonl"
    data.write_text("".join(json.dumps(item) + "\n" for item in ITEMS))
    (tmp_path / "petrel_mc.yaml").write_text(TASK.format(data=data))
    tokenizer_dir = tmp_path / "tokenizer"
    llm.tokenizer.save_pretrained(tokenizer_dir)
    tasks = TaskManager(include_path=str(tmp_path))

    served_lm = LocalCompletionsAPI(
        base_url=f"{served}/v1/completions",
        model=openai.OpenAI(base_url=f"{served}/v1", api_key="unused").models.list().data[0].id,
        tokenizer=str(tokenizer_dir),
        tokenizer_backend="huggingface",
        max_retries=1,
    )
    hf_lm = HFLM(pretrained=hf_model, tokenizer=llm.tokenizer, batch_size=1)
    got, want = _loglikelihoods(served_lm, tasks), _loglikelihoods(hf_lm, tasks)
    assert len(got) == sum(len(item["choices"]) for item in ITEMS) == len(want)
    assert max(abs(a - b) for a, b in zip(got, want)) < 1e-3
    assert lm_eval.__version__
