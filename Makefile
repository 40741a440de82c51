# trainscope: `make` lists the targets. Variables: make train CONFIG=accelerate_configs/bf16.yaml ARGS="--lora"
.DEFAULT_GOAL := help
SHELL := /bin/bash

PYTHON ?= python3
VENV ?= .venv
TORCH_VERSION ?= 2.13.0
PY := $(VENV)/bin/python
# Bytecode is written as Python writes it by default (into .venv and the project, once, by the first process that
# imports a module), whatever the caller's environment says: with PYTHONDONTWRITEBYTECODE set, every launched process
# would compile torch and transformers again. Compiling every package at set-up instead costs time for files most of
# which no run imports (docs/benchmarks.md#set-up-and-the-makefiles-choices-as-measured).
unexport PYTHONDONTWRITEBYTECODE
ACCELERATE := $(VENV)/bin/accelerate
CONFIG ?=
ARGS ?=
# --quiet: a one-process run that fails ends in its own error line, without the launcher's CalledProcessError traceback
# Without a config, what Accelerate would otherwise print a block about choosing itself: one process per GPU (one on a
# CPU), one machine, no mixed precision, no dynamo.
GPU_COUNT = $(if $(HAS_GPU),$(shell $(PY) -c "import torch; print(torch.cuda.device_count())"),0)
LAUNCH_DEFAULTS = --num_machines 1 --mixed_precision no --dynamo_backend no \
	$(if $(filter-out 0 1,$(GPU_COUNT)),--multi_gpu --num_processes $(GPU_COUNT),--num_processes 1)
LAUNCH = $(ACCELERATE) launch --quiet $(if $(CONFIG),--config_file $(CONFIG),$(LAUNCH_DEFAULTS))
# A GPU is one that the project's torch can use (not merely one nvidia-smi lists). Asked only where the machine shows
# a GPU's device files (NVIDIA, ROCm, WSL) or nvidia-smi: elsewhere every make call would import torch for nothing.
GPU_SIGNS := $(wildcard /dev/nvidiactl /dev/nvidia0 /dev/kfd /dev/dxg)$(shell command -v nvidia-smi 2>/dev/null)
HAS_GPU := $(if $(GPU_SIGNS),$(shell test -x $(PY) && $(PY) -c "import torch; print(1 if torch.cuda.is_available() else '')" 2>/dev/null))
# Without a GPU the default run trains on a documented subset, short enough for a CPU (docs/benchmarks.md#set-up-and-the-makefiles-choices-as-measured).
CPU_SUBSET := --max-train-samples 4000 --max-eval-samples 1000 --max-test-samples 2000
TRAIN_ARGS ?= $(if $(HAS_GPU),,$(CPU_SUBSET))

WORKERS ?=
REPEATS ?= 5
DATASET ?= embedded:tweets
LOADER_MODES ?=
SWEEP_ARGS ?=
DP_ARGS ?=
ROUNDS ?= 5
RUNS ?= runs
RESULTS ?= results
# Experiments: the same seed and steps in every variant; on a CPU a subset of the corpus. Trackers on (W&B offline).
EXP_ARGS ?= $(if $(HAS_GPU),,--max-train-samples 2000 --max-eval-samples 500 --max-test-samples 1000) --log-every 5
# Speed comparisons (alternating rounds) time steady steps, not accuracy: short runs, small evaluations.
SPEED_ARGS ?= $(EXP_ARGS) --max-steps 24 --max-eval-samples 64 --max-test-samples 64
AMP_CONFIGS ?= $(if $(HAS_GPU),single_gpu fp16 bf16,cpu bf16)
# The AMP comparison runs whole runs in $(ROUNDS) alternating rounds (a verdict needs 5). A CPU without AVX512-BF16/AMX
# emulates bf16, many times slower per step than fp32, so on a CPU each run is 12 steps of 8 at length 64 (10 of them
# steady) with small evaluations, to keep 5 rounds within minutes (docs/benchmarks.md#set-up-and-the-makefiles-choices-as-measured).
# That measures speed, not learning: the runs stop long before they learn (the loss over 50 steps, one round, no
# verdict: AMP_ARGS="--max-train-samples 800 --per-device-batch-size 16 --max-seq-length 64 --log-every 5" ROUNDS=1).
AMP_ARGS ?= $(if $(HAS_GPU),$(EXP_ARGS),--max-train-samples 800 --per-device-batch-size 8 --max-seq-length 64 \
	--max-steps 12 --max-eval-samples 64 --max-test-samples 64 --log-every 1)
BASE_CONFIG ?= $(if $(HAS_GPU),single_gpu,cpu)
MATRIX_VARIANTS ?= $(if $(HAS_GPU),single_gpu bf16 fp16 ddp ddp_fp16 single_gpu+ckpt bf16+compile,cpu ddp cpu+ckpt cpu+compile)
BATCH_SIZES ?= 8 16 32 64 128
BATCH_ROUNDS ?= 5
REPORT_ARGS ?=
DDP_COST_ARGS ?= $(SPEED_ARGS) --max-steps 20
# make profile also profiles under bf16.yaml: auto where this machine's bf16 matmuls measured faster (on/off to force)
PROFILE_BF16 ?= auto
DDP_COST_ROUNDS ?= 5
# DDP settings to compare with the defaults (empty: all of them; see SETTINGS in trainscope/experiments/ddp_cost.py).
DDP_SETTINGS ?=
# make tune: the README's main command, shortened to a proxy of 30 steps that keeps its evaluation (on a CPU).
TUNE_ARGS ?= $(TRAIN_ARGS) $(if $(HAS_GPU),,--max-steps 30) --report-to none
TUNE_BUDGET ?= 2400
# Alternating rounds per trial (one seed each, judged once after the last): 6 against 6 can pass Holm over 23 tests.
TUNE_ROUNDS ?= 6
# make tune-confirm: trainscope tune --confirm on make train's full job (TRAIN_ARGS, trackers off): the change make
# tune kept, against the command as it is (how long its rounds take: docs/tune.md#the-result-and-make-tune-confirm).
CONFIRM_ARGS ?= $(TRAIN_ARGS) --report-to none
CONFIRM_ROUNDS ?= 5
CONFIRM_BUDGET ?= 7200
# The change to confirm: make tune's result (default), or another comparison.json with the change in `final_change`
CONFIRM_TUNED ?= $(RUNS)/tune/comparison.json
# make predict-check: short runs of many shapes (12 steps, 2 of them warm-up), each predicted at its start.
PREDICT_ARGS ?= --max-train-samples 2000 --max-eval-samples 128 --max-test-samples 128 --max-steps 12 --log-every 12 \
	--report-to none
PREDICT_SHAPES ?=
COMPILE_ARGS ?= --model embedded:tiny-bert --max-train-samples 512 --max-eval-samples 64 --max-test-samples 64 \
	--per-device-batch-size 16 --max-steps 24 --report-to none
EXPERIMENTS = $(PY) -m trainscope.experiments

.PHONY: help setup train train-lm lint format test bench-overhead bench-import bench-dropout-draw bench-advice bench-trainer bench-compile sweep-workers compare-dp amp-compare \
	ckpt-compare batch-sweep matrix profile ddp-cost tune tune-confirm advise gpu-check report experiments clean predict \
	test-oldest oldest-transformers \
	predict-calibrate predict-check

help: ## list the targets
	@awk 'BEGIN {FS = ":.*## "} /^[a-zA-Z_-]+:.*## / {printf "  make %-16s %s\n", $$1, $$2}' $(MAKEFILE_LIST)
	@echo "  variables: CONFIG=accelerate_configs/<x>.yaml ARGS='<train.py flags>' RUNS=runs RESULTS=results ROUNDS=$(ROUNDS)"
	@echo "  the committed report: make report (on a clone without runs/ or results/), or make report RUNS=benchmarks/runs RESULTS=benchmarks"

# uv installs what pip would from the same places, about ten times faster (docs/benchmarks.md#set-up-and-the-makefiles-choices-as-measured).
# It reads none of pip's settings, so pip's own are passed on (`pip config list`: index, extra indexes,
# find-links and constraints, from pip's files and PIP_* variables), with pip's rule of the best match over every
# index. The uv on PATH, or one pip installs into the venv; where neither works, or uv fails, pip installs.
define PIP_SETTINGS_FOR_UV
import ast, shlex, subprocess, sys
flags = {"index-url": "--index-url", "extra-index-url": "--extra-index-url", "find-links": "--find-links",
         "constraint": "--constraint"}
# the venv's pip where it has one, else the system Python's (given as the argument)
for python in (sys.executable, *sys.argv[1:]):
    listed = subprocess.run([python, "-m", "pip", "config", "list"], capture_output=True, text=True)
    if listed.returncode == 0:
        break
listed = listed.stdout if listed.returncode == 0 else ""
found = {}
for line in listed.splitlines():
    key, _, value = line.partition("=")
    section, _, name = key.rpartition(".")
    found.setdefault(name, {})[section] = ast.literal_eval(value).split()
args = ["--index-strategy", "unsafe-best-match"]
for name, flag in flags.items():
    # pip's order: a PIP_* variable, then the install command's own section, then the global one
    items = next((found[name][s] for s in (":env:", "install", "global") if s in found.get(name, {})), [])
    args += [part for item in items for part in (flag, item)]
print(shlex.join(args))
endef
export PIP_SETTINGS_FOR_UV
UV_SETTINGS = $(PY) -c "$$PIP_SETTINGS_FOR_UV" $(PYTHON)
# The venv's own pip, put there only when it is needed (ensurepip takes seconds:
# docs/benchmarks.md#set-up-and-the-makefiles-choices-as-measured): to install uv where the system's pip cannot, or to
# install what uv could not.
# $(call VENV_PIP,<pip arguments>)
VENV_PIP = { { $(PY) -m pip --version >/dev/null 2>&1 || $(PY) -m ensurepip >/dev/null 2>&1; } && $(PY) -m pip $(1); }
# $(call INSTALL,<pip arguments>): by uv (on PATH, else installed into the venv by the system's pip or the venv's),
# else by pip
INSTALL = { uv=$$(command -v uv || { { test -x $(VENV)/bin/uv || $(PYTHON) -m pip --python $(PY) install -q uv \
	>/dev/null 2>&1 || $(call VENV_PIP,install -q uv) >/dev/null 2>&1; } && echo $(VENV)/bin/uv; }) && \
	settings=$$($(UV_SETTINGS)) && eval "$$uv pip install -q --python $(PY) $$settings $(1)"; } || \
	$(call VENV_PIP,install -q --no-compile $(1))

# make setup says in one line a step what it installs and where; each install's output goes to $(SETUP_LOG), whose end
# is shown when a step fails. make V=1 shows every command and its output instead.
SETUP_LOG = $(VENV)/setup.log
Q = $(if $(filter-out 0,$(V)),,@)
# $(call LOGGED,<command>): the command, its output in the log (make V=1: on the terminal)
LOGGED = $(if $(Q),{ $(1); } >>$(SETUP_LOG) 2>&1 || { tail -n 25 $(SETUP_LOG) >&2; \
	echo "make setup: failed (the whole log: $(SETUP_LOG); every command: make setup V=1)" >&2; exit 1; },$(1))

# The venv sees the system's packages only where the system Python has torch (a GPU host's CUDA build, reused).
# Elsewhere it is isolated: packages the system happens to have change what every process imports (boto3 through
# accelerate, scipy through evaluate and transformers, trio through the HTTP client) and slow every process's start
# (docs/benchmarks.md#set-up-and-the-makefiles-choices-as-measured).
$(VENV)/.installed: requirements.txt requirements-embedded.txt
	$(Q)test -x $(PY) || { if $(PYTHON) -c "import torch" 2>/dev/null; then system=--system-site-packages; \
		seen="seeing the system's packages, its torch reused"; else system=; seen="isolated from the system's packages"; fi; \
		echo "setup: $(VENV)/ by $(PYTHON), $$seen"; $(PYTHON) -m venv --without-pip $$system $(VENV); }
	$(Q): > $(SETUP_LOG)
	$(Q)if torch=$$($(PY) -c "import torch; print(torch.__version__)" 2>/dev/null); then echo "setup: torch $$torch, already there"; \
		else echo "setup: torch==$(TORCH_VERSION) into $(VENV)/"; $(call LOGGED,$(call INSTALL,torch==$(TORCH_VERSION))); fi
	@echo "setup: requirements.txt and requirements-embedded.txt into $(VENV)/ (output: $(SETUP_LOG))"
	$(Q)$(call LOGGED,$(call INSTALL,-r requirements.txt))
	$(Q)$(call LOGGED,$(call INSTALL,--no-deps -r requirements-embedded.txt))
	$(Q)touch $@

# The project itself on the venv's path (what `pip install -e .` does, without a build): `import trainscope` works in
# any script run with the venv's python, examples/ and your own training included; and its command, `trainscope`.
$(VENV)/.project: $(VENV)/.installed
	@echo "setup: trainscope on $(VENV)/'s import path (trainscope-project.pth)"
	$(Q)$(PY) -c "import pathlib, site; pathlib.Path(site.getsitepackages()[0], 'trainscope-project.pth').write_text('$(CURDIR)\n')"
	$(Q)touch $@

$(VENV)/bin/trainscope: $(VENV)/.installed
	$(Q)printf '#!/bin/sh\nexec "$$(dirname "$$0")/python" -m trainscope "$$@"\n' > $@ && chmod +x $@

setup: $(VENV)/.project $(VENV)/bin/trainscope ## create .venv (reusing an installed torch) with everything trainscope needs
	@# a GPU host (nvidia-smi answers) whose torch cannot see the GPU: a warning naming the CUDA build to install
	@if nvidia-smi >/dev/null 2>&1; then $(PY) -m trainscope.gpu.check --torch-check; fi

train: setup ## fine-tune the embedded MiniLM-L6 on the embedded tweets on whatever hardware is here
	$(LAUNCH) train.py $(TRAIN_ARGS) $(ARGS)

train-lm: setup ## train a decoder-only language model from scratch (the embedded tiny GPT-2, random weights, on the tweets; ARGS="--model gpt2": pretrained) -> runs/
	$(LAUNCH) examples/causal_lm.py $(ARGS)

predict: setup ## predict a run before running it: peak memory (fits or not), step and run time; nothing trained (CONFIG, ARGS)
	$(LAUNCH) train.py --predict $(TRAIN_ARGS) $(ARGS)

predict-calibrate: setup ## the predictor's fitted terms (allocator share, framework time) from six short runs, once per machine (minutes)
	$(PY) -m trainscope.predict --calibrate

predict-check: setup ## calibrate, then predicted against measured over 15 shapes (configs, batches, ckpt, LoRA, DDP), calibrated and on first use -> runs/predict/
	$(PY) -m trainscope.predict --calibrate
	$(EXPERIMENTS) predict-check --runs $(RUNS)/predict $(if $(PREDICT_SHAPES),--shapes $(PREDICT_SHAPES)) -- $(PREDICT_ARGS)

lint: setup ## ruff's linter and formatter check (configured in pyproject.toml); `make format` rewrites
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .

format: setup ## format the code with ruff (pyproject.toml)
	$(PY) -m ruff format .
	$(PY) -m ruff check --fix .

test: lint ## lint, then run the test suite (CPU only, GPUs hidden; launches every config in accelerate_configs/)
	CUDA_VISIBLE_DEVICES= $(PY) -m pytest -q tests

# The oldest versions the project supports (pyproject.toml): the GPU machines' torch and transformers. Their venv is
# `make setup`'s with torch $(OLDEST_TORCH) (PyPI's CUDA build, its nvidia-* libraries with it: that torch loads them
# even on a machine without a GPU), then transformers moved to $(OLDEST_TRANSFORMERS); uv links both from its cache.
OLDEST_VENV ?= .venv-oldest
OLDEST_TORCH ?= 2.11.0
OLDEST_TRANSFORMERS ?= 5.17.0
# The tests that reach into the libraries' internals: FSDP2's state (stood in for each torch, and FSDP2 over gloo on
# 2 ranks), DDP's logger, Accelerate's state and placement, the Trainer, FlopCounterMode's attention formulas
OLDEST_TESTS ?= tests/test_sharding.py tests/test_shared_gpu.py tests/test_trainer.py \
	tests/test_decoder_flops.py::test_cpu_fused_sdpa_attention_is_not_counted_by_torch_and_is_by_trainscope \
	'tests/test_launches.py::test_every_config_launches_as_documented[fsdp]' \
	'tests/test_launches.py::test_every_config_launches_as_documented[ddp_fp16]' \
	tests/test_launches.py::test_fsdp_yaml_trains_as_fsdp2_over_gloo_on_cpu_processes_where_asked

$(OLDEST_VENV)/.oldest: requirements.txt requirements-embedded.txt
	@$(MAKE) --no-print-directory setup VENV=$(OLDEST_VENV) TORCH_VERSION=$(OLDEST_TORCH)
	@echo "setup: transformers==$(OLDEST_TRANSFORMERS) into $(OLDEST_VENV)/"
	$(Q)$(MAKE) --no-print-directory VENV=$(OLDEST_VENV) oldest-transformers
	$(Q)touch $@

oldest-transformers:
	$(Q)$(call LOGGED,$(call INSTALL,transformers==$(OLDEST_TRANSFORMERS)))

test-oldest: $(OLDEST_VENV)/.oldest ## the tests that reach into torch's, Accelerate's and transformers' internals, at the oldest versions supported (torch 2.11, transformers 5.17, in .venv-oldest)
	CUDA_VISIBLE_DEVICES= $(OLDEST_VENV)/bin/python -m pytest -q -p no:cacheprovider $(OLDEST_TESTS)

sweep-workers: setup ## DataLoader num_workers sweep with a plot -> results/loaders/ (WORKERS, REPEATS, DATASET, LOADER_MODES)
	$(PY) loaders_bench.py $(if $(WORKERS),--workers $(WORKERS)) --repeats $(REPEATS) --dataset $(DATASET) \
		$(if $(LOADER_MODES),--modes $(LOADER_MODES)) \
		--results-dir $(RESULTS)/loaders $(SWEEP_ARGS)

compare-dp: setup ## nn.DataParallel vs DDP on the same model, data and steps -> results/compare_dp/ (DP_ARGS)
	$(PY) compare_dp.py --results-dir $(RESULTS)/compare_dp --rounds $(ROUNDS) $(DP_ARGS)

amp-compare: setup ## the same run in fp32 and mixed precision (fp16 on GPUs, bf16 on a CPU), alternating rounds, one W&B group -> runs/amp/
	$(EXPERIMENTS) amp --runs $(RUNS)/amp --configs $(AMP_CONFIGS) --rounds $(ROUNDS) -- $(AMP_ARGS)

ckpt-compare: setup ## activation checkpointing off and on, alternating rounds: step time and peak memory -> runs/ckpt/
	$(EXPERIMENTS) ckpt --runs $(RUNS)/ckpt --config $(BASE_CONFIG) --rounds $(ROUNDS) -- $(SPEED_ARGS)

batch-sweep: setup ## throughput and memory against batch size; largest batch that fits; best one -> runs/batch/
	$(EXPERIMENTS) batch-sweep --config $(BASE_CONFIG) --runs $(RUNS)/batch --batch-sizes $(BATCH_SIZES) \
		--rounds $(BATCH_ROUNDS) -- $(EXP_ARGS)

matrix: setup ## train.py under each config and switch, alternating rounds (configs this machine cannot run: skipped) -> runs/matrix/
	$(EXPERIMENTS) matrix --runs $(RUNS)/matrix --rounds $(ROUNDS) --variants $(MATRIX_VARIANTS) -- $(SPEED_ARGS)

profile: setup ## the time breakdown (a run without the profiler), the top operators and the gap to the measured matmul peak (profiled runs, fp32 and bf16 where faster) -> runs/profile/
	$(EXPERIMENTS) profile --runs $(RUNS)/profile --config $(BASE_CONFIG) --bf16 $(PROFILE_BF16) -- $(EXP_ARGS)

ddp-cost: setup ## what DDP communication costs: bucket sizes, flags, compression hooks against DDP's defaults -> runs/ddp_cost/
	$(EXPERIMENTS) ddp-cost --runs $(RUNS)/ddp_cost --rounds $(DDP_COST_ROUNDS) $(if $(DDP_SETTINGS),--settings $(DDP_SETTINGS)) -- $(DDP_COST_ARGS)

tune: setup ## trainscope tune on the main command: the advisor's changes tried, kept where faster with the same result (TUNE_BUDGET s) -> runs/tune/
	$(PY) -m trainscope tune --runs $(RUNS)/tune --budget $(TUNE_BUDGET) --rounds $(TUNE_ROUNDS) -- $(LAUNCH) train.py $(TUNE_ARGS)

tune-confirm: setup ## trainscope tune --confirm: make tune's kept change against make train's full job, paired seeds (12-14 full jobs: about 50 min on 2 CPU cores) -> runs/tune_confirm/
	$(PY) -m trainscope tune --runs $(RUNS)/tune_confirm --confirm $(CONFIRM_TUNED) --rounds $(CONFIRM_ROUNDS) \
		--budget $(CONFIRM_BUDGET) -- $(LAUNCH) train.py $(CONFIRM_ARGS)

advise: setup ## what to try next for one run: make advise RUN=runs/<run-name>
	$(PY) report.py --advise $(RUN)

report: setup ## every figure and table from runs/ and results/ -> results/report/ (a fresh clone: benchmarks/ -> reports/; RUN=<name>: its main run)
	$(PY) report.py $(if $(filter command line environment,$(origin RUNS)),--runs $(RUNS)) \
		$(if $(filter command line environment,$(origin RESULTS)),--results $(RESULTS)) $(if $(RUN),--run $(RUN)) $(REPORT_ARGS)

experiments: profile amp-compare ckpt-compare batch-sweep matrix ddp-cost sweep-workers compare-dp ## run every experiment the report shows

bench-trainer: setup ## train.py (accelerate launch and python) vs transformers.Trainer, same batches; the callback's cost on a Trainer script's whole run -> benchmarks/trainer_peer.*
	$(PY) -m trainscope.experiments.benchmarks.trainer_peer $(ARGS)

bench-overhead: setup ## what trainscope costs the whole run: train.py and a Run loop, each with and without it -> benchmarks/timing_overhead.*
	$(PY) -m trainscope.experiments.benchmarks.overhead $(ARGS)

bench-import: setup ## what import trainscope; trainscope.Run adds to import accelerate, fresh interpreters in alternating pairs -> benchmarks/import_weight.*
	$(PY) -m trainscope.experiments.benchmarks.import_weight $(ARGS)

bench-dropout-draw: setup ## the dropout loop's draw against torch's bernoulli_, ns an element, alternating pairs -> benchmarks/dropout_draw.*
	$(PY) -m trainscope.experiments.benchmarks.dropout_draw $(ARGS)

bench-advice: setup ## the advisor's estimates (precision, threads, batch) against what the change measures on five loops, alternating pairs -> benchmarks/advice_check.*
	$(PY) -m trainscope.experiments.benchmarks.advice_check $(ARGS)

bench-compile: setup ## --compile against eager on the tiny model: compile time, recompiles, speed -> runs/compile/
	$(EXPERIMENTS) compile --runs $(RUNS)/compile --config $(BASE_CONFIG) --rounds $(ROUNDS) -- $(COMPILE_ARGS)

# `make gpu-check --dry-run` (make's -n) runs the plan's dry run (a `+` line runs under -n) instead of only echoing it;
# under -n the setup prerequisite is only echoed, so the line makes the venv itself first (a sub-make without -n).
GPU_CHECK_DRY_RUN = $(findstring n,$(firstword -$(MAKEFLAGS)))
gpu-check: setup ## what only a GPU can confirm, most informative first (ARGS='--budget N' or '--part K'; default budget: the plan's estimate + 15%); the plan: make gpu-check --dry-run -> benchmarks/gpu/<device>.*
	$(if $(GPU_CHECK_DRY_RUN),+MAKEFLAGS= $(MAKE) --no-print-directory -s setup VENV=$(VENV) PYTHON=$(PYTHON) && )$(PY) -m trainscope.gpu.check \
		$(if $(GPU_CHECK_DRY_RUN),--dry-run) $(ARGS)

clean: ## remove runs/, results/ and caches (keeps .venv)
	rm -rf runs results .pytest_cache
	find . -name __pycache__ -prune -exec rm -rf {} +
