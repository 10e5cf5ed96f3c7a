# Xema-Ray. Every target sets up .venv on first use; nothing needs to be installed beforehand.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
OUT ?= out

.PHONY: install test test-all serve bench gpu-check clean

$(STAMP): pyproject.toml CMakeLists.txt allocator_ext/CMakeLists.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# torch first: 2.13.0 (CPU) lies on this disk; letting pip resolve "torch" would fetch a multi-GB CUDA build
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[dev]'
	touch $(STAMP)

install: $(STAMP)

# CPU tests (what CI runs). GPU tests are marked `gpu` and run by `make gpu-check`.
test: install
	$(PY) -m pytest -q -m "not gpu"

serve: install
	@echo "make serve: not yet — the Ray Serve application (deployments/xema.yaml) lands with the serving issue (#7)."
	@echo "Meanwhile the memory analyzer runs on CPU:  $(VENV)/bin/xema analyze --model tiny-cogvideox --height 64 --width 64 --frames 9 --steps 4"

bench: install
	mkdir -p bench/results
	$(PY) bench/bench_analyzer.py --out bench/results/analyzer.json
	@if [ -f bench/bench_layout.py ]; then $(PY) bench/bench_layout.py --out bench/results/layout.json; fi

# On a GPU machine: the -m gpu tests plus GPU benchmarks, JSON under $(OUT).
gpu-check:
	mkdir -p $(OUT)
	$(PYTHON) -m pytest -q -m gpu --junitxml=$(OUT)/gpu-tests.xml tests

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
