"""The `petrel` command line: help texts, friendly errors, prompt files, chat input."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import types

import pytest

from petrel.cli import parse_prompts, read_message

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def petrel(*args, stdin: str | None = None, timeout: float = 120):
    """`petrel ARGS` as a user's shell runs it: a new interpreter (exit code, stdout, stderr of the process)."""
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run(
        [sys.executable, "-m", "petrel.cli", *args],
        input=stdin,
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        cwd=ROOT,
    )


@pytest.fixture()
def petrel_here(capsys, monkeypatch):
    """`petrel ARGS` run by petrel.cli.main in this process, as `petrel` does (its exit code, stdout, stderr),
    without an interpreter start-up per command: the exit code is main's return or argparse's SystemExit, and a
    traceback would be an exception here that fails the test."""
    from petrel.cli import main

    def run(*args, stdin: str | None = None):
        if stdin is not None:
            monkeypatch.setattr(sys, "stdin", io.StringIO(stdin))
        monkeypatch.chdir(ROOT)
        try:
            code = main(list(args))
        except SystemExit as exc:  # argparse: --help and usage errors
            code = exc.code
        out = capsys.readouterr()
        return types.SimpleNamespace(returncode=code, stdout=out.out, stderr=out.err)

    return run


# ------------------------------------------------------------------------------------------- help


@pytest.mark.parametrize(
    "command, expected",
    [
        ((), ["generate", "chat", "serve", "bench", "examples:", "petrel generate --input"]),
        (("generate",), ["--input", "--output", "examples:", "JSONL", "finish_reason"]),
        (("chat",), ["/reset", "/exit", "examples:", "continues"]),
        (("serve",), ["--api-key", "examples:", "chat page"]),
    ],
)
def test_help_has_a_description_and_examples(command, expected, petrel_here):
    r = petrel_here(*command, "--help")
    assert r.returncode == 0, r.stderr
    for text in expected:
        assert text in r.stdout, (command, text)


# ------------------------------------------------------------------------------------------- errors


def test_missing_model_is_one_clear_line(tmp_path):
    missing = tmp_path / "no-such-model.gguf"
    r = petrel("generate", "hi", "--model", str(missing))
    assert r.returncode == 2
    assert "Traceback" not in r.stderr
    assert r.stderr.startswith("petrel: error:") and str(missing) in r.stderr


@pytest.mark.parametrize(
    "args, message",
    [
        (("generate", "--input", "/no/such/prompts.txt"), "cannot read /no/such/prompts.txt"),
        (("generate",), "give a prompt, or --input FILE"),
        (("generate", "hi", "--input", "x.txt"), "not both"),
        (("serve", "--chat-template", "not-a-file-nor-a-template"), "--chat-template"),
        (("serve", "--speculative-config", "{method: ngram}"), "--speculative-config: not valid JSON"),
        (("generate", "hi", "--speculative-config", '{"method": "medusa"}'), "speculative_config.method"),
        (
            ("serve", "--speculative-config", '{"method": "lookahead", "max_ngram_size": 0}'),
            "speculative_config max_window_size / max_ngram_size / max_verification_set_size",
        ),
    ],
)
def test_user_mistakes_exit_2_without_a_traceback(args, message, petrel_here):
    r = petrel_here(*args)
    assert r.returncode == 2, r.stderr
    assert "Traceback" not in r.stderr
    assert message in r.stderr


# ------------------------------------------------------------------------------------------- prompt files


def test_plain_text_is_one_prompt_per_line():
    assert parse_prompts("Hello\n\n  The sky is  \r\nlast") == ["Hello", "  The sky is  ", "last"]


def test_jsonl_is_detected_by_a_leading_brace():
    text = '\n  {"prompt": "a", "id": 1}\n\n{"prompt": "b\\nc"}\n'
    assert parse_prompts(text) == ["a", "b\nc"]
    assert parse_prompts('not json {"prompt": "x"}') == ['not json {"prompt": "x"}']


@pytest.mark.parametrize(
    "text, message",
    [
        ('{"prompt": "a"}\n{oops', "line 2: not valid JSON"),
        ('{"text": "a"}', 'line 1: expected an object with a "prompt" string'),
        ('{"prompt": 3}', "line 1"),
        ("\n  \n", "no prompts"),
    ],
)
def test_bad_prompt_files_name_the_line(text, message):
    with pytest.raises(ValueError, match=message):
        parse_prompts(text, "prompts.jsonl")


# ------------------------------------------------------------------------------------------- chat input


def test_chat_lines_ending_in_a_backslash_continue():
    lines = iter(["first \\", "second\\", "third", "next"])
    assert read_message(lambda _prompt: next(lines)) == "first \nsecond\nthird"
    assert read_message(lambda _prompt: next(lines)) == "next"

    def eof(_prompt):
        raise EOFError

    assert read_message(eof) is None


# ------------------------------------------------------------------------------------------- end to end


@pytest.mark.e2e
def test_generate_input_file_writes_jsonl(tmp_path, petrel_here):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("The capital of France is\nOne, two, three,\n")
    out = tmp_path / "out.jsonl"
    r = petrel_here("generate", "--input", str(prompts), "--output", str(out), "--max-tokens", "4")
    assert r.returncode == 0, r.stderr
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [row["prompt"] for row in rows] == ["The capital of France is", "One, two, three,"]
    for row in rows:
        assert set(row) == {"prompt", "text", "finish_reason", "num_tokens"}
        assert isinstance(row["text"], str) and row["finish_reason"] in ("length", "stop")
        assert 1 <= row["num_tokens"] <= 4

    r = petrel_here("generate", "--input", "-", "--max-tokens", "2", stdin='{"prompt": "Hi"}\n')
    assert r.returncode == 0, r.stderr
    (row,) = [json.loads(line) for line in r.stdout.splitlines()]
    assert row["prompt"] == "Hi" and row["num_tokens"] <= 2


def test_serve_takes_a_smaller_step_budget_unless_told():
    import argparse

    from petrel.config import EngineConfig
    from petrel.serve.server import SERVE_MAX_NUM_BATCHED_TOKENS, add_arguments, engine_options

    parse = add_arguments(argparse.ArgumentParser()).parse_args
    assert SERVE_MAX_NUM_BATCHED_TOKENS < EngineConfig.max_num_batched_tokens
    assert engine_options(parse([]))["max_num_batched_tokens"] == SERVE_MAX_NUM_BATCHED_TOKENS
    assert engine_options(parse(["--max-num-batched-tokens", "4096"]))["max_num_batched_tokens"] == 4096
    # without chunked prefill a prompt longer than the budget would wait to run alone: the engine's default stays
    assert "max_num_batched_tokens" not in engine_options(parse(["--no-chunked-prefill"]))
