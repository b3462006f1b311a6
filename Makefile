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

# Files the formatter has been run over (until the whole tree is formatted: then ".").
FORMATTED ?= backend/slipstream/kv_events \
	backend/slipstream/server/openai/__init__.py \
	backend/slipstream/server/openai/app.py \
	backend/slipstream/server/openai/errors.py \
	backend/slipstream/server/openai/frontend.py \
	backend/slipstream/server/openai/requests.py \
	backend/slipstream/server/openai/responses.py \
	backend/slipstream/server/openai/triton_client.py \
	backend/slipstream/core/block_hash.py \
	backend/slipstream/core/kv_cache_events.py \
	backend/slipstream/core/lora_errors.py \
	backend/slipstream/core/step_budget.py \
	backend/slipstream/core/structured_outputs.py \
	backend/slipstream/worker/kv_cache.py \
	backend/slipstream/worker/lora_adapter.py \
	backend/slipstream/worker/lora_layers.py \
	backend/slipstream/worker/structured_output.py \
	backend/slipstream/testing.py \
	client_examples \
	scripts \
	tests/scheduler_support.py

lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check $(FORMATTED)
	$(BIN)/mypy
