# Slipstream: `make demo` (install, start Triton on the default model, stream one answer, exit),
# `make serve` (same, keeps serving on 8000/8001/8002), `make test` (the fast tier, then the
# tests that start a real tritonserver; `make test-fast` / `make test-server` run one of them),
# `make lint`, `make install`.
# demo/serve/install install what serving needs (the `serve` extra); test/lint add the test,
# lint, deploy-check and benchmark tools (`install-dev`).
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
DEMO_PROMPT ?= What is the capital of France?
SERVE_ARGS ?=
PYTEST_ARGS ?= -q
PYTEST = $(BIN)/python -m pytest $(PYTEST_ARGS)
SERVE_EXTRAS := serve
DEV_EXTRAS := serve,test,dev,deploy,bench,kernels

.PHONY: install install-dev demo serve test test-fast test-server lint image-test

install:
	PYTHON="$(PYTHON)" VENV="$(VENV)" EXTRAS="$(SERVE_EXTRAS)" bash scripts/install.sh

install-dev:
	PYTHON="$(PYTHON)" VENV="$(VENV)" EXTRAS="$(DEV_EXTRAS)" bash scripts/install.sh

demo: install
	$(BIN)/slipstream serve --http-port 0 --grpc-port 0 --metrics-port 0 \
		--prompt "$(DEMO_PROMPT)" --exit-after-prompt $(SERVE_ARGS)

serve: install
	$(BIN)/slipstream serve --prompt "$(DEMO_PROMPT)" $(SERVE_ARGS)

# Two tiers: `server` marks every test that starts a tritonserver or `slipstream serve`
# (tests/server_guard.py fails an unmarked one that does), so `not server` starts none.
test: install-dev
	$(PYTEST) -m "not server"
	$(PYTEST) -m server

test-fast: install-dev
	$(PYTEST) -m "not server"

test-server: install-dev
	$(PYTEST) -m server

lint: install-dev
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

# The CPU image built and run with podman (apt-get install podman debootstrap runc; root).
image-test: install-dev
	SLIPSTREAM_IMAGE_TESTS=1 $(BIN)/python -m pytest -m image -rs tests/deploy/test_cpu_image.py
