# make run: the local stack (Envoy + ext_proc + 4 simulated vLLM backends). make test: the whole suite.
# make test-fast: the quick lane (no real vLLM, no peer routers, no Kubernetes, no bench smoke runs,
# no Prometheus or trace collector, the Envoy scenarios in kvroute's own layout only, none of the
# scenarios marked slow).
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# Keep compiled bytecode (and pytest's rewritten test modules) between runs even where the
# environment turns it off: recompiling every test module costs each pytest worker about 3 s.
unexport PYTHONDONTWRITEBYTECODE

.PHONY: run test test-fast lint bench clean crd docs

$(STAMP): pyproject.toml constraints.txt tools/install_dev.py
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --disable-pip-version-check -c constraints.txt -e '.[dev]'
	$(BIN)/python tools/install_dev.py
	touch $(STAMP)

run: $(STAMP)
	$(BIN)/kvroute-dev up

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

test: $(STAMP) lint
	$(BIN)/python -m pytest

# Your own loop, under a minute: everything but real vLLM, peer routers and Kubernetes, in four
# workers on two cores (its tests mostly wait on the Envoy, ext_proc and simulator processes they start).
test-fast: $(STAMP)
	$(BIN)/python -m pytest -q -n 4 --dist worksteal -m "not vllm and not peers and not k8s and not node and not bench and not layouts and not observability and not slow"

# Regenerate what is derived from the settings' declarations (tests fail when these are stale).
crd: $(STAMP)
	$(BIN)/python -m tools.crd

docs: $(STAMP)
	$(BIN)/python -m tools.settings_doc > docs/settings.md.tmp  # a failed run leaves the page as it was
	mv docs/settings.md.tmp docs/settings.md

bench: $(STAMP)
	$(BIN)/kvroute-dev bench core
	$(BIN)/kvroute-dev bench latency

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis .benchmarks
