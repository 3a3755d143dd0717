PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: setup demo demo-buffer demo-arithmetic test lint format bench bench-rollout clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# torch first, pinned: the pin resolves to a local CPU wheel instead of the CUDA build.
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[dev,ray,train]'
	# The published reference server and its HTTP tests (its other dependencies are not needed).
	$(PY) -m pip install -q --no-deps atroposlib==0.4.0
	touch $(STAMP)

setup: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/rollhub demo cartpole

demo-buffer: $(STAMP)
	$(VENV)/bin/rollhub demo buffer

demo-arithmetic: $(STAMP)
	$(VENV)/bin/rollhub demo arithmetic

test: $(STAMP)
	$(PY) -m pytest -q

lint: $(STAMP)
	$(VENV)/bin/ruff check src tests benchmarks examples
	$(VENV)/bin/ruff format --check src tests benchmarks examples

format: $(STAMP)
	$(VENV)/bin/ruff format src tests benchmarks examples
	$(VENV)/bin/ruff check --fix src tests benchmarks examples

bench: $(STAMP)
	$(PY) benchmarks/buffer.py

bench-rollout: $(STAMP)
	$(PY) benchmarks/rollout.py

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
