"""Guided decoding on the default model: 20 JSON schemas validated by jsonschema at temperature 0 and 1,
regexes that fully match, an EBNF arithmetic grammar that parses, choices, n > 1, beams, preemption,
stop strings, the compile cache, bad constraints, and the executor's GuidedDecodingParams; then the bounds on
compiling: input limits, the compile timeout, the byte-bounded cache, one compile for concurrent identical ones."""

from __future__ import annotations

import json
import random
import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import pytest
import torch

from petrel import GuidedDecodingParams, SamplingParams
from petrel.engine.grammar import GrammarCompiler, GrammarCompilerBusy
from petrel.engine.model_runner import kv_bytes_per_block
from petrel.guided_decoding import GuidedDecodingLimits, json_depth

pytestmark = pytest.mark.e2e

NAME = {"type": "string", "maxLength": 20}
INT = {"type": "integer", "minimum": -999, "maximum": 999}  # bounded: a tiny model may otherwise write digits forever
SCHEMAS = [
    {
        "type": "object",
        "properties": {"name": NAME, "age": {"type": "integer", "minimum": 0, "maximum": 120}},
        "required": ["name", "age"],
    },
    {
        "type": "object",
        "properties": {"city": NAME, "population": {"type": "integer", "minimum": 1}},
        "required": ["city"],
    },
    {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}}, "required": ["color"]},
    {"type": "object", "properties": {"ok": {"type": "boolean"}, "note": NAME}, "required": ["ok"]},
    {"type": "object", "properties": {"score": {"type": "number", "minimum": 0, "maximum": 1}}, "required": ["score"]},
    {
        "type": "object",
        "properties": {"tags": {"type": "array", "items": NAME, "minItems": 1, "maxItems": 3}},
        "required": ["tags"],
    },
    {
        "type": "object",
        "properties": {"point": {"type": "object", "properties": {"x": INT, "y": INT}, "required": ["x", "y"]}},
        "required": ["point"],
    },
    {
        "type": "object",
        "properties": {
            "user": {
                "type": "object",
                "properties": {
                    "name": NAME,
                    "address": {
                        "type": "object",
                        "properties": {"street": NAME, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                        "required": ["street", "zip"],
                    },
                },
                "required": ["name", "address"],
            }
        },
        "required": ["user"],
    },
    {"type": "object", "properties": {"id": {"anyOf": [INT, {"type": "string", "maxLength": 8}]}}, "required": ["id"]},
    {
        "type": "object",
        "properties": {
            "values": {"type": "array", "items": {"type": "integer", "minimum": -5, "maximum": 5}, "maxItems": 4}
        },
        "required": ["values"],
    },
    {
        "type": "object",
        "properties": {"status": {"const": "done"}, "count": {"type": "integer", "minimum": 0, "maximum": 9}},
        "required": ["status", "count"],
    },
    {
        "type": "object",
        "properties": {
            "title": NAME,
            "year": {"type": "integer", "minimum": 1900, "maximum": 2030},
            "genre": {"enum": ["drama", "comedy", "horror"]},
        },
        "required": ["title", "year", "genre"],
    },
    {
        "type": "object",
        "properties": {
            "matrix": {"type": "array", "maxItems": 2, "items": {"type": "array", "maxItems": 2, "items": INT}}
        },
        "required": ["matrix"],
    },
    {
        "type": "object",
        "properties": {
            "answer": {"type": "string", "enum": ["yes", "no"]},
            "confidence": {"type": "number", "minimum": 0, "maximum": 1},
        },
        "required": ["answer"],
    },
    {
        "type": "object",
        "properties": {"email": {"type": "string", "pattern": "^[a-z]{1,8}@[a-z]{1,8}\\.com$"}},
        "required": ["email"],
    },
    {
        "type": "object",
        "properties": {
            "items": {
                "type": "array",
                "maxItems": 2,
                "items": {
                    "type": "object",
                    "properties": {"sku": NAME, "qty": {"type": "integer", "minimum": 1, "maximum": 10}},
                    "required": ["sku", "qty"],
                },
            }
        },
        "required": ["items"],
    },
    {
        "type": "object",
        "properties": {"value": {"anyOf": [{"type": "boolean"}, {"type": "null"}]}},
        "required": ["value"],
    },
    {"type": "object", "properties": {"first": NAME, "last": NAME, "middle": NAME}, "required": ["first", "last"]},
    {
        "type": "object",
        "properties": {"temperature": {"type": "number", "minimum": -50, "maximum": 50}, "unit": {"enum": ["C", "F"]}},
        "required": ["temperature", "unit"],
    },
    {
        "type": "object",
        "properties": {
            "shape": {
                "anyOf": [
                    {
                        "type": "object",
                        "properties": {
                            "kind": {"const": "circle"},
                            "r": {"type": "integer", "minimum": 1, "maximum": 9},
                        },
                        "required": ["kind", "r"],
                    },
                    {
                        "type": "object",
                        "properties": {
                            "kind": {"const": "square"},
                            "side": {"type": "integer", "minimum": 1, "maximum": 9},
                        },
                        "required": ["kind", "side"],
                    },
                ]
            }
        },
        "required": ["shape"],
    },
]


def chat(llm, text: str) -> dict:
    return llm.apply_chat_template([{"role": "user", "content": text}])


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_twenty_json_schemas_validate(llm, temperature):
    prompts = [chat(llm, f"Reply with JSON matching this schema: {json.dumps(s)}") for s in SCHEMAS]
    params = [
        SamplingParams(
            temperature=temperature,
            seed=i,
            max_tokens=160,
            repetition_penalty=1.1,
            guided_decoding=GuidedDecodingParams(json=s),
        )
        for i, s in enumerate(SCHEMAS)
    ]
    outs = llm.generate(prompts, params, use_tqdm=False)
    for schema, out in zip(SCHEMAS, outs):
        co = out.outputs[0]
        assert co.finish_reason == "stop", f"did not finish within 160 tokens: {co.text!r}"
        jsonschema.validate(json.loads(co.text), schema)
        assert not _free_whitespace(co.text), co.text  # compact by default: nothing to pad with


def _free_whitespace(text: str) -> bool:
    """Whether JSON text has whitespace outside its strings other than xgrammar's compact separators (one space
    after each , and :)."""
    in_string = escaped = False
    previous = ""
    for c in text:
        if in_string:
            escaped, in_string = (not escaped and c == "\\"), in_string and (escaped or c != '"')
        elif c == '"':
            in_string = True
        elif c.isspace() and not (c == " " and previous in (",", ":")):
            return True
        previous = c
    return False


def test_json_whitespace_is_compact_unless_asked_and_keys_the_cache():
    assert not _free_whitespace('{"a b": [1, "x\\"  y"]}') and _free_whitespace('{"a":  1}')
    assert _free_whitespace('{"a": 1\n}') and _free_whitespace(' {"a": 1}')
    for kind in ({"json": {"type": "object"}}, {"json_object": True}):
        compact, free = GuidedDecodingParams(**kind), GuidedDecodingParams(**kind, any_whitespace=True)
        assert not compact.any_whitespace and compact.spec != free.spec  # never one cached grammar for both


REGEXES = {
    "date": r"(19|20)\d\d-(0[1-9]|1[0-2])-(0[1-9]|[12]\d|3[01])",
    "phone": r"\(\d{3}\) \d{3}-\d{4}",
    "ipv4": r"((25[0-5]|2[0-4]\d|1\d\d|[1-9]?\d)\.){3}(25[0-5]|2[0-4]\d|1\d\d|[1-9]?\d)",
}


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_regexes_fully_match(llm, temperature):
    names = list(REGEXES)
    prompts = [f"Here is a {name}:" for name in names]
    params = [
        SamplingParams(
            temperature=temperature, seed=3, max_tokens=40, guided_decoding=GuidedDecodingParams(regex=REGEXES[n])
        )
        for n in names
    ]
    for name, out in zip(names, llm.generate(prompts, params, use_tqdm=False)):
        co = out.outputs[0]
        assert co.finish_reason == "stop" and re.fullmatch(REGEXES[name], co.text), (name, co.text)


ARITHMETIC = r"""
root ::= expr
expr ::= term (("+" | "-") term){0,3}
term ::= factor (("*" | "/") factor){0,2}
factor ::= number | "(" expr ")"
number ::= [1-9] [0-9]{0,2}
"""


def _parses_as_arithmetic(text: str) -> bool:
    pos = 0

    def expr():
        nonlocal pos
        term()
        while pos < len(text) and text[pos] in "+-":
            pos += 1
            term()

    def term():
        nonlocal pos
        factor()
        while pos < len(text) and text[pos] in "*/":
            pos += 1
            factor()

    def factor():
        nonlocal pos
        if pos < len(text) and text[pos] == "(":
            pos += 1
            expr()
            assert text[pos] == ")"
            pos += 1
            return
        m = re.match(r"[1-9][0-9]{0,2}", text[pos:])
        assert m
        pos += m.end()

    try:
        expr()
        return pos == len(text)
    except (AssertionError, IndexError):
        return False


def test_ebnf_arithmetic_grammar_parses(llm):
    params = SamplingParams(
        temperature=1.0, seed=5, n=3, max_tokens=48, guided_decoding=GuidedDecodingParams(grammar=ARITHMETIC)
    )
    out = llm.generate("A long arithmetic expression: ", params, use_tqdm=False)
    for co in out.outputs:
        assert co.finish_reason == "stop", co.text
        assert _parses_as_arithmetic(co.text), co.text
    assert not _parses_as_arithmetic("1+") and not _parses_as_arithmetic("(2*3")  # the checker can fail


def test_choice_with_n_and_beams(llm):
    choices = ["apple pie", "banana split", "cherry tart"]
    guided = GuidedDecodingParams(choice=choices)
    out = llm.generate(
        chat(llm, "Pick a dessert."),
        SamplingParams(n=4, temperature=1.0, seed=9, max_tokens=10, guided_decoding=guided),
        use_tqdm=False,
    )
    assert all(co.text in choices and co.finish_reason == "stop" for co in out.outputs)
    out = llm.generate(
        chat(llm, "Pick a dessert."),
        SamplingParams(use_beam_search=True, beam_width=3, n=3, max_tokens=10, guided_decoding=guided),
        use_tqdm=False,
    )
    # beams are token paths: two may spell the same choice with different tokens
    assert all(co.text in choices and co.finish_reason == "stop" for co in out.outputs)
    assert len({tuple(co.token_ids) for co in out.outputs}) == 3


def test_guided_stop_string_and_preemption(llm):
    """A stop string inside guided output ends it there; under forced preemption guided outputs are unchanged."""
    from petrel import LLM

    schema = SCHEMAS[11]
    prompt = chat(llm, "Describe a film as JSON.")
    base = llm.generate(
        prompt,
        SamplingParams(temperature=0, max_tokens=120, guided_decoding=GuidedDecodingParams(json=schema)),
        use_tqdm=False,
    ).outputs[0]
    jsonschema.validate(json.loads(base.text), schema)
    cut = llm.generate(
        prompt,
        SamplingParams(
            temperature=0, max_tokens=120, stop=['"year"'], guided_decoding=GuidedDecodingParams(json=schema)
        ),
        use_tqdm=False,
    ).outputs[0]
    assert base.text.startswith(cut.text) and cut.stop_reason == '"year"'
    per_block = kv_bytes_per_block(llm.engine.model_config, 16, torch.float32)
    blocks_each = -(-(len(prompt["prompt_token_ids"]) + len(base.token_ids)) // 16)
    small = LLM(
        kv_cache_memory=int(2.5 * blocks_each) * per_block, max_num_batched_tokens=64
    )  # 4 requests, room for 2.5
    try:
        params = SamplingParams(temperature=0, max_tokens=120, guided_decoding=GuidedDecodingParams(json=schema))
        outs = small.generate([prompt] * 4, params, use_tqdm=False)
        assert small.engine.core.scheduler.num_preemptions > 0
        assert all(o.outputs[0].text == base.text for o in outs)
    finally:
        small.shutdown()


def test_compile_cache_and_bad_constraints(llm):
    compiler = llm.engine.grammar_compiler
    schema = {"type": "object", "properties": {"q": {"type": "integer"}}, "required": ["q"]}
    before = compiler.num_compiled
    for text in (json.dumps(schema), schema, json.dumps(schema, indent=2)):  # one constraint, three spellings
        llm.generate(
            "x", SamplingParams(max_tokens=12, guided_decoding=GuidedDecodingParams(json=text)), use_tqdm=False
        )
    assert compiler.num_compiled == before + 1  # compiled once, then served from the cache
    ok = llm.generate_async("The sky is", SamplingParams(temperature=0, max_tokens=30))
    for bad, needle in [
        (dict(regex="(unclosed"), "regex"),
        (dict(grammar="root ::= ("), "grammar"),
        (dict(json="{not json"), "json"),
        (dict(json=[1, 2]), "json"),
    ]:
        with pytest.raises(ValueError, match=needle):
            llm.generate("x", SamplingParams(guided_decoding=GuidedDecodingParams(**bad)), use_tqdm=False)
    with pytest.raises(ValueError, match="exactly one"):
        GuidedDecodingParams(regex="a", choice=["b"])
    assert ok.result(timeout=60).outputs[0].finish_reason == "length"


def test_executor_guided_decoding(llm):
    from petrel.executor import Executor, GuideType, Request
    from petrel.executor import GuidedDecodingParams as ExecGuided

    # the executor runs its own engine; a small KV cache keeps this test light
    with Executor(kv_cache_memory=64 * 1024 * 1024) as ex:
        ids = llm.apply_chat_template([{"role": "user", "content": "Give a date."}])["prompt_token_ids"]
        rid = ex.enqueue_request(Request(ids, 30, guided_decoding_params=ExecGuided(GuideType.REGEX, REGEXES["date"])))
        jid = ex.enqueue_request(
            Request(ids, 60, guided_decoding_params=ExecGuided(GuideType.JSON_SCHEMA, json.dumps(SCHEMAS[2])))
        )
        bad = ex.enqueue_request(Request(ids, 30, guided_decoding_params=ExecGuided(GuideType.REGEX, "(")))
        tok = llm.tokenizer
        [r] = ex.await_responses(rid, timeout=120)
        assert re.fullmatch(
            REGEXES["date"], tok.decode(r.result.output_token_ids[0][len(ids) :], skip_special_tokens=True)
        )
        [r] = ex.await_responses(jid, timeout=120)
        jsonschema.validate(
            json.loads(tok.decode(r.result.output_token_ids[0][len(ids) :], skip_special_tokens=True)), SCHEMAS[2]
        )
        [r] = ex.await_responses(bad, timeout=10)
        assert r.has_error() and "regex" in r.error_msg


# ------------------------------------------------------------------------------------------- bounded compiles


def _slow_schema(repeats: int, tag: str) -> dict:
    """A schema of a few bytes whose compile grows with repeats squared (~1.5 s at 5000, ~25 s at 20000)."""
    pattern = {"type": "string", "pattern": f"^a{{{repeats}}}$"}
    return {"type": "object", "properties": {tag: pattern}, "required": [tag]}


def _deep_schema(levels: int) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(levels):
        schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
    return schema


OVER_THE_LIMITS = [  # (constraint just over a default limit, the field its error names)
    (dict(choice=[f"c{i}" for i in range(4097)]), "guided_decoding.choice has 4097 strings"),
    (dict(choice=["x" * 40_000, "y" * 40_000]), "guided_decoding.choice has 80000 bytes"),
    (
        dict(json={"type": "object", "properties": {f"field_{i}": {"type": "integer"} for i in range(2500)}}),
        "guided_decoding.json has",
    ),
    (dict(json=_deep_schema(70)), "guided_decoding.json has 141 levels of nesting"),
    (dict(json='{"type": "array", "items": ' * 5000 + "{}" + "}" * 5000), "guided_decoding.json has 5001 levels"),
    (dict(regex="|".join(f"word{i}" for i in range(2500))), "guided_decoding.regex has"),
    (dict(grammar="root ::= " + " | ".join(f'"w{i}" [0-9]*' for i in range(9000))), "guided_decoding.grammar has"),
]


def test_constraints_over_the_limits_are_refused_before_compiling(llm):
    compiler = llm.engine.grammar_compiler
    before = compiler.num_compiled
    for kwargs, message in OVER_THE_LIMITS:
        with pytest.raises(ValueError, match=re.escape(message)):
            llm.generate(
                "x", SamplingParams(max_tokens=1, guided_decoding=GuidedDecodingParams(**kwargs)), use_tqdm=False
            )
    huge = GuidedDecodingParams(choice=[f"choice number {i}" for i in range(100_000)])  # once: minutes, ~1 GB
    started = time.monotonic()
    with pytest.raises(ValueError, match="guided_decoding.choice has 100000 strings"):
        compiler.compile(huge)
    assert time.monotonic() - started < 2
    assert compiler.num_compiled == before  # not one of them reached a compile


def test_limits_are_parameters_and_name_the_field():
    limits = GuidedDecodingLimits(max_choices=2, max_regex_bytes=4, max_schema_depth=2)
    limits.check(GuidedDecodingParams(choice=["a", "b"]))
    with pytest.raises(ValueError, match=r"guided_decoding.choice has 3 strings; at most 2"):
        limits.check(GuidedDecodingParams(choice=["a", "b", "c"]))
    with pytest.raises(ValueError, match=r"guided_decoding.regex has 5 bytes; at most 4"):
        limits.check(GuidedDecodingParams(regex="a{1,}"))
    limits.check(GuidedDecodingParams(json={"type": "array", "items": {"type": "string"}}))
    with pytest.raises(ValueError, match=r"guided_decoding.json has 3 levels of nesting; at most 2"):
        limits.check(GuidedDecodingParams(json={"type": "array", "items": {"type": "array", "items": {}}}))
    assert json_depth('{"a": "[[{{", "b": [1, {"c": "\\"]"}]}') == 3  # brackets in strings are text
    with pytest.raises(ValueError, match="max_choices must be a positive integer"):
        GuidedDecodingLimits(max_choices=0)


@pytest.fixture(scope="module")
def small_compiler(llm):
    """A compiler of its own, with one worker, a 1 s compile timeout and a 1.2 MB cache."""
    compiler = GrammarCompiler(
        llm.tokenizer,
        llm.engine.model_config.vocab_size,
        list(llm.engine.eos_token_ids),
        compile_timeout=1.0,
        cache_bytes=1_200_000,
        workers=1,
    )
    yield compiler
    compiler.close()


def _choices(tag: str) -> GuidedDecodingParams:
    """150 random strings: a compiled grammar of ~525 kB (SmolLM2's vocabulary), the same for the same tag."""
    rng = random.Random(tag)
    return GuidedDecodingParams(
        choice=[tag + " " + "".join(rng.choice("abcdefghij klmnop") for _ in range(16)) for _ in range(150)]
    )


def test_cache_is_bounded_by_bytes(small_compiler):
    compiler = small_compiler
    sizes = {}
    for tag in "ABC":
        sizes[tag] = compiler.compile(_choices(tag)).memory_size_bytes
        assert compiler.cached_bytes <= compiler.cache_bytes
    assert all(400_000 < s < 600_000 for s in sizes.values()), sizes  # three don't fit in 1.2 MB; two do
    assert not compiler.is_cached(_choices("A"))  # the least recently used went first
    assert compiler.is_cached(_choices("B")) and compiler.is_cached(_choices("C"))
    compiler.compile(_choices("B"))  # B used again: C is now the oldest
    compiler.compile(_choices("D"))
    assert compiler.is_cached(_choices("B")) and not compiler.is_cached(_choices("C"))
    # a grammar a request still holds is found again without a compile, however much the cache has evicted
    held = compiler.compile(_choices("E"))
    for tag in "FG":
        compiler.compile(_choices(tag))
    before = compiler.num_compiled
    assert not compiler.is_cached(_choices("E"))
    assert compiler.compile(_choices("E")) is held and compiler.num_compiled == before


def test_compile_timeout_kills_the_compile_and_the_compiler_goes_on(small_compiler, monkeypatch):
    compiler = small_compiler
    compiler.compile(GuidedDecodingParams(regex="[0-9]+"))  # the worker is up
    monkeypatch.setattr(compiler, "max_queued", 0)  # one compile at a time, none waiting
    slow = GuidedDecodingParams(json=_slow_schema(20_000, "slow"))  # ~25 s if left to run
    started = time.monotonic()
    first, same = compiler.submit(slow), compiler.submit(slow)  # the second shares the first's compile
    with pytest.raises(GrammarCompilerBusy, match="busy"):
        compiler.submit(GuidedDecodingParams(json=_slow_schema(20_000, "other")))  # refused at once
    for future in (first, same):
        with pytest.raises(ValueError, match=r"guided_decoding.json: the constraint took longer than 1 s to compile"):
            future.result()
    assert time.monotonic() - started < 5
    out = compiler.compile(GuidedDecodingParams(regex="(yes|no)!"))  # on a fresh worker
    matcher = compiler.matcher(out)
    assert matcher.accept_string("yes!") and matcher.is_completed()


def test_concurrent_identical_constraints_compile_once(llm):
    compiler = llm.engine.grammar_compiler
    params = GuidedDecodingParams(json=_slow_schema(3000, "shared"))  # ~0.5 s: the four overlap
    before = compiler.num_compiled
    barrier = threading.Barrier(4)

    def compile_after_barrier():
        barrier.wait()
        return compiler.compile(params)

    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(lambda _: compile_after_barrier(), range(4)))
    assert all(r is results[0] for r in results)
    assert compiler.num_compiled == before + 1


def test_a_regex_whose_repeats_multiply_out_too_far_is_refused_before_compiling():
    """`((a|b){1,1000}){1,1000}c{1,100000}` is 36 bytes, compiled for seconds and handed over ~100 MB: it is
    refused by its size once repeat counts are multiplied out; long but plain repeats are not."""
    from petrel.guided_decoding import GuidedDecodingLimits, regex_size

    limits = GuidedDecodingLimits()
    with pytest.raises(ValueError, match="guided_decoding.regex has 1100000 pieces"):
        limits.check(GuidedDecodingParams(regex="((a|b){1,1000}){1,1000}c{1,100000}"))
    limits.check(GuidedDecodingParams(regex="[a-z]{20000}"))
    limits.check(GuidedDecodingParams(regex="(a+)+$"))  # unbounded repeats compile to loops
    assert regex_size("(ab|cd){1,500}") == 2000 and regex_size("(x)?(?(1)a{5}|b{7})") == 13
    assert regex_size("[\\p{L}]+") == len("[\\p{L}]+")  # a dialect Python cannot read: its length
