# Xema-Ray. Every target sets up .venv on first use; nothing needs to be installed beforehand.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
OUT ?= out

RATE ?= 0.5
DURATION ?= 60
MIX ?= uniform

.PHONY: install test serve checkpoints serve-checkpoints plan verify loadtest figures bench bench-preemption bench-tenancy gpu-check clean

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

# The Ray Serve app on CPU with the three tiny models (plans computed at start-up); Ctrl+C stops it.
# `xema serve` is `serve run` with the app's Ray settings: Ray's internal ports on 127.0.0.1 only
# (XEMA_RAY_OPEN_PORTS=1 opens them) and the proxy's errors as JSON (docs/serving.md "Ports").
serve: install
	PYTHONPATH=$(CURDIR) $(VENV)/bin/xema serve deployments/xema.yaml

# Tiny but complete diffusers directories (transformer, VAE, scheduler, text encoder, tokenizer) under checkpoints/.
checkpoints: install
	$(PY) -m xema_ray.checkpoints --out checkpoints

# The tiny models served from those directories (their own tokenizers and text encoders).
serve-checkpoints: checkpoints
	PYTHONPATH=$(CURDIR) $(VENV)/bin/xema serve deployments/xema-checkpoints.yaml

# Plan the paper's templates for the reference box's model groups (each for its own GPUs; cost model, no GPU needed).
plan: install
	$(PY) -m planner plan --templates paper --deployment deployments/xema-a6000x8.yaml --budget 48GB --hardware a6000 --out plans/a6000x8.json
	$(VENV)/bin/xema verify --plan-table plans/a6000x8.json --json bench/results/verify-a6000x8.json

# The serving worker's own load + execute for every entry of a plan table, counted on the meta device.
PLAN_TABLE ?= plans/a6000x8.json
verify: install
	$(VENV)/bin/xema verify --plan-table $(PLAN_TABLE) --json bench/results/verify.json

# Open-loop Poisson load test against the app (started if not running), then the simulator on the same arrivals.
loadtest: install
	mkdir -p loadtests/results
	PYTHONPATH=$(CURDIR) $(PY) -m loadtests.run --rate $(RATE) --duration $(DURATION) --mix $(MIX)

# Figures 9/10/14 analogues from the simulator (plans the paper templates; traces cached in plans/.traces).
figures: install
	mkdir -p bench/results
	$(PY) bench/figures.py --out bench/results

bench: install
	mkdir -p bench/results
	$(PY) bench/bench_analyzer.py --out bench/results/analyzer.json
	$(PY) bench/bench_layout.py --out bench/results/layout.json
	$(PY) bench/bench_profiler.py --out bench/results/profiler.json
	$(PY) bench/bench_planner.py --out bench/results/planner.json
	$(PY) bench/bench_mitigation.py --out bench/results/mitigation.json
	$(PY) bench/bench_residency.py --out bench/results/residency.json
	PYTHONPATH=$(CURDIR) $(PY) bench/bench_serving.py --out bench/results/serving.json
	PYTHONPATH=$(CURDIR) $(PY) bench/bench_jobs.py --loadtest-seconds 40 --out bench/results/jobs.json
	PYTHONPATH=$(CURDIR) $(PY) bench/bench_preemption.py --out bench/results/preemption.json

# Step-level preemption: simulated attainment with/without on the reference box + live latency on CPU (<= 10 min)
bench-preemption: install
	mkdir -p bench/results
	PYTHONPATH=$(CURDIR) $(PY) bench/bench_preemption.py --out bench/results/preemption.json

# Store faults and live preemption decisions (docs/tenancy.md, bench/sections/tenancy.md; needs redis-server; <= 15 min)
bench-tenancy: install
	PYTHONPATH=$(CURDIR) $(PY) bench/store_pause.py
	PYTHONPATH=$(CURDIR) $(PY) bench/preemption_live.py --n 80 --rate 1.0
	PYTHONPATH=$(CURDIR) $(PY) bench/preemption_live.py --n 60 --rate 1.0 --steps 100

# On a GPU machine: the -m gpu tests plus GPU benchmarks (<= 8 min), JSON under $(OUT); skips cleanly without CUDA.
gpu-check:
	mkdir -p $(OUT)
	$(PYTHON) bench/gpu_check.py --out $(OUT)

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
