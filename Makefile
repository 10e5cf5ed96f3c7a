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
PLAN_TABLE ?= plans/a6000x8.json

.PHONY: install pyc test serve demo-plan serve-emulated bench-emulated loadtest-emulated checkpoints serve-checkpoints plan layouts serve-a6000x8 verify loadtest figures bench bench-preemption bench-tenancy gpu-kit bench-scale gpu-check clean

# torch for the machine (install/install.py, docs/install-gpu.md): where nvidia-smi lists a GPU, the CUDA
# build of torch 2.13.0 (PyPI's: CUDA 13.0, NVIDIA driver >= 580; TORCH_INDEX=.../whl/cu128 for CUDA 12.8)
# and the [sp] extra; elsewhere (CI) what it always was. DEVICE=cpu|cuda overrides the detection.
DEVICE ?= auto
TORCH_INDEX ?=

# the C++ sources too: an edited allocator or solver is rebuilt by the next `make install` / `make test`
$(STAMP): pyproject.toml CMakeLists.txt allocator_ext/CMakeLists.txt $(wildcard allocator_ext/src/*) install/install.py
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# torch first: 2.13.0 (CPU) lies on this disk; letting pip resolve "torch" would fetch a multi-GB CUDA build
	$(PY) install/install.py --python $(PY) --device $(DEVICE) $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX),)
	touch $(STAMP)

install: $(STAMP)

# CPU tests (what CI runs). GPU tests are marked `gpu` and run by `make gpu-check`. Under the string-hash
# seed the layouts are solved and served with (xema_ray/hash_seed.py), so traces need no seeded child process.
# PYTHONFAULTHANDLER: a crash after the last test (interpreter teardown) still prints every thread's stack.
# TEST_PROCESSES: pytest processes (pytest-xdist, --dist loadfile: a module's tests and fixtures on one;
# --no-loadscope-reorder: modules in the collection's order, not the most tests first);
# 2 by default (docs/repository.md); 1 runs every module in file order on one process. On two or more,
# each module in ALONE_TESTS runs afterwards on a process of its own, with nothing beside it.
TEST_PROCESSES ?= 2
#: a multi-node scale-out whose replicas' requests once went unanswered beside another module's cluster;
#: a group's wake from zero, the last module on two processes, which most likely stalled a CI run until its
#: 90 min ran out (its wait for the answer had no bound then)
ALONE_TESTS := tests/serving/scale/test_scale_out.py tests/serving/scale/test_scale_to_zero_live.py
TEST_ENV := PYTHONHASHSEED=0 PYTHONFAULTHANDLER=1
# TEST_TIMEOUT_S: a test that runs longer, its setup and teardown included, fails (pytest-timeout, SIGALRM:
# its stack in its report, its fixtures torn down, the run goes on), so a hang fails one test instead of
# stalling the run. Should the signal not be taken (a wait in native code), pytest's faulthandler prints
# every thread's stack a minute later. --durations: the slowest tests, at the end of every run.
TEST_TIMEOUT_S ?= 900
PYTEST := $(TEST_ENV) $(PY) -m pytest -q -m "not gpu" --timeout=$(TEST_TIMEOUT_S) --timeout-method=signal \
  -o faulthandler_timeout=$(shell echo $$(( $(TEST_TIMEOUT_S) + 60 ))) --durations=10
test: install pyc
ifeq ($(filter-out 0 1,$(TEST_PROCESSES)),)
	$(PYTEST)
else
	$(PYTEST) -n $(TEST_PROCESSES) --dist loadfile --no-loadscope-reorder $(addprefix --ignore=,$(ALONE_TESTS)); \
	  parallel=$$?; alone=0; for m in $(ALONE_TESTS); do $(PYTEST) $$m || alone=$$?; done; \
	  echo "make test: $(TEST_PROCESSES) processes exited $$parallel, then each of $(ALONE_TESTS) alone $$alone"; \
	  [ $$parallel -eq 0 ] && [ $$alone -eq 0 ]
endif

# The project's modules compiled once (only what changed since): every process of the app and of the
# tests imports them, and where PYTHONDONTWRITEBYTECODE is set none of them would keep its bytecode.
pyc: install
	$(PY) -m compileall -q -j 0 xema_ray planner deployments bench loadtests tests >/dev/null

# The Ray Serve app on CPU with the tiny models (plans from the committed plans/demo-cpu.json); Ctrl+C stops it.
# `xema serve` is `serve run` with the app's Ray settings: Ray's internal ports on 127.0.0.1 only
# (XEMA_RAY_OPEN_PORTS=1 opens them) and the proxy's errors as JSON (docs/serving.md "Ports").
serve: install pyc
	PYTHONPATH=$(CURDIR) $(VENV)/bin/xema serve deployments/xema.yaml

# The demo's committed plan table, planned as start-up would plan deployments/xema.yaml (calibrated on this
# machine, no cache kept); OVERHEAD_S / VIDEO_OVERHEAD_S: the serving path's seconds per image request / video job, measured on
# the 2-core VM (BENCHMARKS.md "Start-up"), added to every latency: the demo's SLOs price what a request pays.
demo-plan: install
	PYTHONPATH=$(CURDIR) $(PY) -m deployments.planning deployments/xema.yaml --out plans/demo-cpu.json --overhead-s $(or $(OVERHEAD_S),0.033) --video-overhead-s $(or $(VIDEO_OVERHEAD_S),0.2)

# The paper's 8x A6000 box emulated on this machine (docs/emulated.md): a Ray node of its own that
# declares 8 GPUs, workers that take plans/a6000x8.json's latencies / time_scale; Ctrl+C stops it.
# PORT=8250 serves elsewhere than the YAML's 8000.
serve-emulated: install
	PYTHONPATH=$(CURDIR) $(PY) -m deployments.emulated_box deployments/xema-a6000x8-emulated.yaml $(if $(PORT),--port $(PORT),)

# Tiny but complete diffusers directories (transformer, VAE, scheduler, text encoder, tokenizer) under checkpoints/;
# LAYOUT=published lays them out as the real models' Hugging Face repositories are (dtypes, shards, tokenizers).
checkpoints: install
	$(PY) -m xema_ray.checkpoints --out checkpoints $(if $(LAYOUT),--layout $(LAYOUT),)

# The tiny models served from those directories (their own tokenizers and text encoders); LAYOUT=published too.
serve-checkpoints: checkpoints
	PYTHONPATH=$(CURDIR) $(VENV)/bin/xema serve deployments/xema-checkpoints.yaml

# Plan the paper's templates for the reference box's model groups (each for its own GPUs; cost model, no GPU needed),
# static layouts included (into plans/a6000x8.layouts/, not committed), then verify every entry: the one command
# that regenerates the committed reference table and bench/results/verify-a6000x8.json.
plan: install
	$(PY) -m planner plan --templates paper --deployment deployments/xema-a6000x8.yaml --budget 48GB --hardware a6000 --out plans/a6000x8.json
	$(VENV)/bin/xema verify --plan-table plans/a6000x8.json --json bench/results/verify-a6000x8.json

# The layout files a plan table names, solved again from its entries (deterministic: the ids must match; ~5 MB
# each, so they are not committed). Fails if one solves differently (model code changed: make plan).
layouts: install
	$(VENV)/bin/xema layouts --plan-table $(PLAN_TABLE)

# The reference box (8x RTX A6000; weights under /models): its layouts first, then xema serve.
serve-a6000x8: layouts
	PYTHONPATH=$(CURDIR) $(VENV)/bin/xema serve deployments/xema-a6000x8.yaml

# The serving worker's own load + execute for every entry of a plan table, counted on the meta device.
verify: install
	$(VENV)/bin/xema verify --plan-table $(PLAN_TABLE) --json bench/results/verify.json

# Open-loop Poisson load test against the app (started if not running), then the simulator on the same arrivals.
loadtest: install
	mkdir -p loadtests/results
	PYTHONPATH=$(CURDIR) $(PY) -m loadtests.run --rate $(RATE) --duration $(DURATION) --mix $(MIX)

# The load test against the emulated 8x A6000 box (docs/emulated.md) on a Ray cluster of its own
# (no `ray stop`): the paper's templates at the reference box's time scales. RATE is per second on
# the emulated clock. PORT: its HTTP port.
loadtest-emulated: install
	mkdir -p loadtests/results/emulated
	PYTHONPATH=$(CURDIR) $(PY) -m loadtests.run --config deployments/xema-a6000x8-emulated.yaml --url http://127.0.0.1:$(or $(PORT),8000) --rate $(RATE) --duration $(DURATION) --mix $(MIX) --out loadtests/results/emulated

# Figures 9/10/14 analogues from the simulator (plans the paper templates; traces cached in plans/.traces).
figures: install
	mkdir -p bench/results
	$(PY) bench/figures.py --out bench/results

# the figures again from the committed plan tables (bench/results/plans): minutes, no re-planning
figures-resim: install
	$(PY) bench/figures.py --out bench/results --reuse-plans

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

# Live vs simulated SLO attainment on the emulated 8x A6000 box (docs/emulated.md, BENCHMARKS.md "Live vs simulated"):
# Flux.2 and CogVideoX-5B at three rates each, preemption on; <= 15 min on 2 CPUs.
bench-emulated: install
	mkdir -p bench/results
	PYTHONPATH=$(CURDIR) $(PY) bench/bench_emulated.py --out bench/results/emulated.json

# The batching policy by measurement (issue #50, BENCHMARKS.md "One batch key"): by_key vs mixed with a
# guidance mix, simulated over a rate sweep and live on the emulated box's Flux.2 group (60 s per policy)
bench-batch-key: install
	mkdir -p bench/results
	PYTHONPATH=$(CURDIR) $(PY) bench/bench_batch_key.py --out bench/results/batch_key.json

# Step-level preemption: simulated attainment with/without on the reference box + live latency on CPU (<= 10 min)
bench-preemption: install
	mkdir -p bench/results
	PYTHONPATH=$(CURDIR) $(PY) bench/bench_preemption.py --out bench/results/preemption.json

# Scale-out on a local cluster (head + 4 nodes x 8 emulated GPUs): front door at >= 32 GPUs, autoscaling through a
# load step, a node killed under load (<= 10 min); bench/results/scale.json + scale.png
bench-scale: install
	mkdir -p bench/results
	PYTHONPATH=$(CURDIR) $(PY) bench/bench_scale.py --out bench/results/scale.json

# Store faults and live preemption decisions (docs/tenancy.md, BENCHMARKS.md "Faults"; needs redis-server; <= 15 min)
bench-tenancy: install
	PYTHONPATH=$(CURDIR) $(PY) bench/store_pause.py
	PYTHONPATH=$(CURDIR) $(PY) bench/preemption_live.py --n 80 --rate 1.0
	PYTHONPATH=$(CURDIR) $(PY) bench/preemption_live.py --n 60 --rate 1.0 --steps 100

# Here (registry reachable): the cp312 wheels the GPU machine lacks, into the ignored .whl/ the
# device calls carry, with .whl/manifest.json (kit <= 48 MiB, tree + kit <= 64 MiB). docs/gpu-check.md.
gpu-kit: install
	$(PY) gpu_check/gpu_kit.py

# On a GPU machine, after `bash gpu_check/gpu_prep.sh`: the GPU tests (found by their gpu marker) one process
# each, in priority order, PYTHONHASHSEED=0, gpu-check.json rewritten after each; PART=1 or PART=2 for one
# device call each, UNTIL=<unix time> to start no test that cannot finish by then (docs/gpu-check.md; LIST=1
# prints both calls laid out in the device time). Without CUDA it writes a "no CUDA GPU" record and exits 0;
# DRY_RUN=1 collects and plans only. It runs under .venv's python where there is one (here), else python3
# (the GPU machine: no .venv travels). bench/gpu_check.py is the same check.
PART ?= all
gpu-check:
	mkdir -p $(OUT)
	$(if $(wildcard $(PY)),$(PY),$(PYTHON)) gpu_check/run.py --out $(OUT) --part $(PART) $(if $(UNTIL),--until $(UNTIL)) $(if $(DRY_RUN),--dry-run) $(if $(LIST),--list)

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
