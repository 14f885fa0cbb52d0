# Set-up and entry points. `make demo` trains on the embedded default (tiny Qwen3-MoE, CPU, local MLflow
# store); `make test` runs the test suite. Both create the virtual environment on first use.
PYTHON ?= python3.11
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(VENV)/bin/pip
STAMP  := $(VENV)/.installed

.PHONY: setup demo test test-all clean

$(STAMP): setup.cfg pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip
	# torch first and pinned: pip takes the CPU build from the local wheel store, never a CUDA download
	$(PIP) install --quiet torch==2.13.0
	$(PIP) install --quiet -e '.[test,math]'
	touch $(STAMP)

setup: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/dcmdp train configs/default.yaml

test: $(STAMP)
	$(PY) -m pytest -q -m "not slow"

test-all: $(STAMP)
	$(PY) -m pytest -q

clean:
	rm -rf $(VENV) .dcmdp_cache outputs mlruns
