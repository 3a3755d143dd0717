PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
# The stamp's name changes whenever what setup installs changes, so an older .venv is brought up to date.
STAMP := $(VENV)/.installed-3
REFERENCE := $(VENV)/reference
# Where pip finds torch. Empty: pip's own configuration decides. Elsewhere, e.g.
# TORCH_INDEX=https://download.pytorch.org/whl/cpu gives the CPU build instead of the CUDA one.
TORCH_INDEX ?=
TORCH_PIN := torch==2.13.0

.PHONY: setup demo demo-buffer demo-arithmetic test fuzz lint format bench bench-rollout clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# torch first, pinned, from TORCH_INDEX when it is set.
	$(PY) -m pip install -q $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX)) $(TORCH_PIN)
	# A venv set up before the reference lived in its own directory holds atroposlib itself; its scripts go with it.
	$(PY) -m pip uninstall -q -y atroposlib
	$(PY) -m pip install -q -e '.[dev,ray,train,hf]'
	# The published reference server and its HTTP tests (its other dependencies are not needed), kept in a
	# directory of its own that the tests and benchmarks put on PYTHONPATH: installed into the venv, its
	# run-api console script would replace rollhub's.
	rm -rf $(REFERENCE)
	$(PY) -m pip install -q --no-deps --target $(REFERENCE) atroposlib==0.4.0
	rm -rf $(REFERENCE)/bin
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

# The long property-based ingest fuzz (thousands of hostile bodies; the default suite runs a bounded sample).
fuzz: $(STAMP)
	$(PY) -m pytest -q -m slow tests/server/test_ingest_fuzz.py

bench: $(STAMP)
	$(PY) benchmarks/buffer.py

bench-rollout: $(STAMP)
	$(PY) benchmarks/rollout.py

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
