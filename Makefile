# make run: the local stack (Envoy + ext_proc + 4 simulated vLLM backends). make test: the whole suite.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: run test lint bench clean

$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --disable-pip-version-check -c constraints.txt -e '.[dev]'
	touch $(STAMP)

run: $(STAMP)
	$(BIN)/kvroute-dev up

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

test: $(STAMP) lint
	$(BIN)/python -m pytest

bench: $(STAMP)
	$(BIN)/kvroute-dev bench core
	$(BIN)/kvroute-dev bench latency

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis .benchmarks
