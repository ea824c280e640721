# Two entry points (see README): `make demo` and `make test`. Both set up .venv from nothing.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1
export TRANSFORMERS_VERBOSITY := error
export HF_HUB_DISABLE_PROGRESS_BARS := 1
export TOKENIZERS_PARALLELISM := false

.PHONY: setup demo test test-fast protos check-protos deploy-check lint-imports node-client bench clean

setup: $(VENV)/.ok
$(VENV)/.ok: pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0   # first: the local CPU wheel (anything else pulls CUDA)
	$(BIN)/pip install -q -e '.[server,dev]'
	touch $@

demo: setup
	$(BIN)/python -m bench.demo

test: setup check-protos deploy-check lint-imports node-client
	$(BIN)/python -m pytest

test-fast: setup
	$(BIN)/python -m pytest -m "not slow"

protos: setup
	PYTHON=$(BIN)/python protos/gen.sh

check-protos: setup
	PYTHON=$(BIN)/python protos/gen.sh --check

deploy-check: setup
	VENV=$(VENV) bash deploy/check.sh

# the Node client written from the .proto (clients/node; tests/test_node_client.py), where npm is installed
NODE_OK := clients/node/node_modules/.ok
node-client: $(NODE_OK)
$(NODE_OK): clients/node/package-lock.json
	@if command -v npm > /dev/null; then npm ci --prefix clients/node --no-audit --no-fund --loglevel=error && touch $@; \
	else echo "npm not found: tests/test_node_client.py will be skipped"; fi

# the layers' import contracts (pyproject.toml [tool.importlinter]) and no cycles between the packages
lint-imports: setup
	$(BIN)/lint-imports --no-cache
	$(BIN)/python tools/import_cycles.py

bench: setup
	$(BIN)/python -m bench.engine
	$(BIN)/python -m bench.run
	$(BIN)/python -m bench.concurrency

clean:
	rm -rf $(VENV) .pytest_cache clients/node/node_modules
