# Quickstart: `make run` and `make test` work on a fresh machine with Python 3 and make.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
# A CPU build of torch lies on local disk on our machines; pinning it first keeps pip from
# pulling a multi-GB CUDA build through the looser `torch>=2.4` requirement.
TORCH_PIN ?= torch==2.13.0

.PHONY: run generate test lint format bench clean install install-dev

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip

$(VENV)/.installed: $(PY) pyproject.toml
	@$(PY) -c "import torch" 2>/dev/null || $(PIP) install -q "$(TORCH_PIN)"
	$(PIP) install -q -e .
	@touch $@

$(VENV)/.installed-dev: $(VENV)/.installed pyproject.toml
	$(PIP) install -q -e ".[dev]"
	@touch $@

install: $(VENV)/.installed
install-dev: $(VENV)/.installed-dev

run: $(VENV)/.installed
	$(VENV)/bin/superinfer serve --model tiny-random

generate: $(VENV)/.installed
	$(VENV)/bin/superinfer generate --model tiny-random --prompt "Hello, SuperInfer" \
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

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache build *.egg-info
