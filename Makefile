# Slipstream: `make demo` (install, start Triton on the default model, stream one answer, exit),
# `make serve` (same, keeps serving on 8000/8001/8002), `make test`, `make lint`, `make install`.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
DEMO_PROMPT ?= What is the capital of France?
SERVE_ARGS ?=
PYTEST_ARGS ?= -q

.PHONY: install demo serve test lint

install:
	PYTHON="$(PYTHON)" VENV="$(VENV)" bash scripts/install.sh

demo: install
	$(BIN)/slipstream serve --http-port 0 --grpc-port 0 --metrics-port 0 \
		--prompt "$(DEMO_PROMPT)" --exit-after-prompt $(SERVE_ARGS)

serve: install
	$(BIN)/slipstream serve --prompt "$(DEMO_PROMPT)" $(SERVE_ARGS)

test: install
	$(BIN)/python -m pytest $(PYTEST_ARGS)

lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy
