# Single entry point. `make test` works on a fresh machine: it creates .venv, installs nanocp with its test
# extras (CPU torch 2.13.0 where no CUDA is present), builds the C++ core and runs ruff + pytest.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.nanocp-installed
SOURCES := pyproject.toml CMakeLists.txt $(wildcard control_plane/csrc/*.cpp control_plane/csrc/*.h data_plane/csrc/*.cpp)
HAS_CUDA := $(shell command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1 && echo 1)

.PHONY: install test lint format serve slow reliability bench gpu-check clean

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

$(STAMP): $(BIN)/python $(SOURCES)
ifeq ($(HAS_CUDA),1)
	$(BIN)/pip install -q torch
else
	$(BIN)/pip install -q torch==2.13.0
endif
	$(BIN)/pip install -q -e '.[test]'
	touch $(STAMP)

install: $(STAMP)

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

format: $(STAMP)
	$(BIN)/ruff format .
	$(BIN)/ruff check --fix .

test: $(STAMP) lint
	$(BIN)/python -m pytest -q

slow: $(STAMP)
	$(BIN)/python -m pytest -q -m slow

reliability: $(STAMP)
	$(BIN)/python -m pytest -q -m reliability

serve: $(STAMP)
	$(BIN)/nanocp serve --model tiny

bench: $(STAMP)
	$(BIN)/python -m nanocp.bench.run_all

# On a GPU machine's own Python (no virtual environment): build against its torch, then run the prepared check
# (docs/gpu.md). Results go to $OUT (the lent machine's output folder) or ./gpu_check.
gpu-check:
	CMAKE_BUILD_PARALLEL_LEVEL=$$(nproc) $(PY) -m pip install -q --no-build-isolation --no-deps --no-index -e .
	$(PY) -m nanocp.bench.gpu_check --out $${OUT:-gpu_check}

clean:
	rm -rf build $(VENV)
