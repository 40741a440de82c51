"""make gpu-check: what only a GPU can show, checked on the GPUs present, within a time budget.

    python -m trainscope.gpu_check [--out benchmarks/gpu] [--budget S] [--part K]
    python -m trainscope.gpu_check --dry-run [--gpus N] [--budget S]     # the plan for N GPUs, on any machine
    make gpu-check [ARGS="--budget 240"]; make gpu-check ARGS=--dry-run (or make gpu-check --dry-run)

Without a usable CUDA device it prints one line, writes nothing and exits 0; but where the NVIDIA driver
answers (`nvidia-smi`) and this torch cannot see the GPU (a CPU-only torch), it fails with one `error:`
line naming the CUDA build of torch to install (`cuda_torch_command`).

With one, it runs the checks of `plan`, the most informative first (a short budget keeps them and skips the
tail), each in a process of its own (this process never opens a CUDA context: every check has the whole GPU, and
a GPU in exclusive-process mode runs them), by the documented commands, RoBERTa-base architecture-only at sequence
length 128 unless said otherwise, and writes benchmarks/gpu/<device>.{json,md} with provenance, and each training
run's record.json and steps.jsonl under benchmarks/gpu/<device>.runs/<check>/:

1. fp16 loss scaling: a CUDA GradScaler with the fused AdamW and planted inf gradients;
2. precision: fp32 (the operator benchmark of the prediction included: its fp32 attention kernels take
   random-generator state), a memory snapshot in fp32, bf16, --timing sync against events, TF32 and fp16:
   samples/s, tokens/s, MFU, peak memory per stage (GOALS: what the plan's step times let them reach);
3. with two GPUs: FSDP2, DDP's per-step communication on device time against its own logger and the trace, the
   profiler under DDP, DDP in fp16, the fp16 and bf16 compression hooks, DDP with --compile; with fewer, skipped
   with their reason; single device vs DataParallel vs DDP;
4. the DataLoader's copy to the device, pinned and not, at a batch whose copy shows; the batch-size search
   against a real out-of-memory error; torch.compile in bf16 with dynamic shapes; the cost of --timing events
   against a bare loop (alternating comparisons of bench.MIN_PAIRS rounds, written after every round).

Every launch has a timeout (its whole process tree is killed past it) and the plan a budget (--budget, default:
the plan's estimate plus MARGIN): before each check, one whose estimate does not fit in what is left is skipped
("over the budget"), and no launch may run past the budget. The results are rewritten (atomically) after every
check, so a time limit, Ctrl-C or a hung launch keeps what was measured; on SIGINT or SIGTERM the running launch is
killed and the results say `interrupted`. A check that fails keeps the tail of its output (the checks run with
PYTHONFAULTHANDLER=1: a crash shows its Python stack). Where one command may run at most PART_LIMIT_S, the dry
run splits the plan into parts (`--part K`, results in <device>.partK.*).

Durations are estimates from each check's workload (launches, steps, precision) and the MEASURED_* figures (the
first gpu-check on one H200) and ASSUMED_* ones (not measured on GPU) of trainscope/gpu_check.py.
"""

import argparse
import contextlib
import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

from trainscope import bench, launching
from trainscope.errors import UserError, exit_with
from trainscope.record_view import RunView
from trainscope.records import RECORD_FILE, STEPS_FILE, read_record

ROOT = launching.ROOT
# RoBERTa-base (architecture only) at sequence length 128, batch 32 per GPU. Padded to the maximum length:
# one shape, so precisions and configs compare on the same work. DYNAMIC pads per batch (lengths vary).
DYNAMIC = [
    "--model",
    "roberta-base",
    "--architecture-only",
    "--tokenizer",
    "embedded:minilm-l6",
    "--max-seq-length",
    "128",
    "--per-device-batch-size",
    "32",
    "--max-train-samples",
    "4096",
    "--max-eval-samples",
    "64",
    "--max-test-samples",
    "64",
    "--report-to",
    "none",
    "--log-every",
    "10",
]
MODEL = [*DYNAMIC, "--pad-to-max-length"]
# The embedded MiniLM's architecture (its configuration and tokenizer ship without weights on an offline machine)
SMALL_MODEL = ["--model", "embedded:minilm-l6", "--architecture-only"]
PRECISIONS = {
    "fp32": ("single_gpu", []),
    "tf32": ("single_gpu", ["--tf32"]),
    "bf16": ("bf16", []),
    "fp16": ("fp16", []),
}

# ---- what the estimates rest on. MEASURED_*: the first make gpu-check on a GPU (one NVIDIA H200, a 16-core Xeon
# host, torch 2.11; benchmarks/gpu/nvidia-h200.*). ASSUMED_*: not measured on GPU.
MEASURED_LAUNCH_S = 29.0  # one single-GPU launch of train.py less its steps: the 50-step bf16 and fp16 launches
#                           took 31 s each (evaluation and the record included), 2.1-2.4 s of it their loops
MEASURED_FIRST_LAUNCH_S = 45.0  # the first launch's extra: the second check's precision-fp32 took 77 s against
#                                  24 s for the fp32 launches after it (8 s of the rest its operator costs); the first
#                                  check: 33 s against 22 s
MEASURED_STEP_S = {"fp32": 0.060, "bf16": 0.040, "fp16": 0.047}  # steady steps, batch 32 x 128: fp32 and bf16
#                   from the second check (536 and 803 samples/s), fp16 from the first (677 samples/s)
MEASURED_COMPILE_S = 98.0  # compile-bf16's launch (129 s) less precision-bf16's (31 s): 82 s compiling, 59 s of
#                            it in the first forward and 24.5 s at the first evaluation
ASSUMED_STEP_S = {"tf32": 0.06}  # not yet run on a GPU (the second check's budget ended before it)
ASSUMED_PROCESS_GROUP_S = 5.0  # a 2-process launch: the second process and NCCL's communicator
ASSUMED_COMPILE_PROCESSES = 1.5  # two processes compiling at once on one host's cores: 1.5x one compile
ASSUMED_OP_COSTS_S = 8.0  # a launch whose precision and process count this machine has not predicted before times
#                           the prediction's operators in a child process (Python, torch, a CUDA context)
ASSUMED_SCRIPT_S = 8.0  # a benchmark script's own start: imports, data, CUDA context
ASSUMED_EXTRA_S = {"snapshot": 5.0, "profile": 10.0, "search": 15.0}  # a snapshot's pickle (Python frames only),
#                                                 the trace and CUPTI, the batch search's out-of-memory tries
MEASURED_LOADER_PASS_S = 1.0  # loaders_bench: one pass over 4096 samples at batch 512 x 512, the second check:
#                                1.4 s without workers, 0.5-0.7 s with 4, passes alternating
ASSUMED_DP_LOOP_S = 2.0  # compare_dp.py: one in-process loop (22 MiniLM steps of 32)
ASSUMED_SCALER_S = 10.0  # the scaler check's process: Python, torch, a CUDA context and 16 tiny steps
TIMEOUT_FACTOR, MIN_TIMEOUT_S = 3.0, 60.0  # a launch is killed past 3x its estimate (at least a minute)
MARGIN = 1.15  # the default budget: the plan's estimate and 15%
PART_LIMIT_S = 600.0  # at most one command's time on a machine that lends its GPU 10 minutes a command
PRECISION_STEPS = 50
OVERHEAD_STEPS, OVERHEAD_WARMUP = 75, 5  # 70 steady fp32 steps: about 4.2 s per arm and round (0.060 s measured)
LOADER_WORKERS = ("0", "4")
# A batch whose copy shows: 512 rows padded to 512 positions, 2 MiB of token ids and 2 MiB of mask (int64) a batch,
# against 20 KB at the run's batch of 32 short tweets, where the pass measured the collate
LOADER_BATCH, LOADER_LENGTH = 512, 512

# ---- the goals, each reachable by the plan's own step times above (the reason says why it is set where it is)
GOALS = {
    "timing_agreement": (
        1.0,
        "at most",
        "the largest disagreement over its tolerance, max(5% of the stage, 1 ms): "
        "forward and backward (device-bound in fp32) |events - sync|; data and optimizer only events "
        "above sync (sync adds the host's work that events hides behind the queued device work: the "
        "second check's optimizer 0.076 s events against 0.181 s sync); a 2 ms optimizer stage cannot "
        "be told apart at 5% (0.1 ms)",
    ),
    "bf16_over_fp32": (
        1.3,
        "at least",
        "bf16 samples/s over fp32's: the second check measured 1.50 (0.060 against "
        "0.040 s a step); bf16 at batch 32 x 128 is bound by the host (5.4% MFU on an H200), so not the "
        "matmul peaks' 8x: the goal keeps room for a run's noise below what was measured",
    ),
    "bf16_over_tf32": (
        1.0,
        "at least",
        "bf16 no slower than TF32: 0.06 s (assumed) against 0.040 s (1.5x); both bound by the host at this size",
    ),
    "compile_recompiles": (
        0,
        "at most",
        "graphs compiled in the compiled run's steady window (its first evaluation's "
        "compile is warm-up); no MFU goal: per-batch-padded tweets at batch 32 keep a GPU bound by "
        "the host (1.5% MFU compiled on an H200)",
    ),
}
TIMING_TOLERANCE = (0.05, 0.001)  # a share of the stage, and at least this many seconds


def step_seconds(precision: str) -> float:
    return MEASURED_STEP_S.get(precision) or ASSUMED_STEP_S[precision]


def train_estimate(steps: int, precision: str, processes: int = 1, extra: float = 0.0) -> float:
    """Seconds for one launch of train.py: the fixed cost, the steps at their step time, and extras."""
    return (
        MEASURED_LAUNCH_S
        + (ASSUMED_PROCESS_GROUP_S if processes > 1 else 0.0)
        + steps * step_seconds(precision)
        + extra
    )


def timeout_for(estimate: float) -> float:
    return max(MIN_TIMEOUT_S, TIMEOUT_FACTOR * estimate)


def training_check(
    name: str, config: str, args: list[str], steps: int, precision: str, confirms: str, extra: float = 0.0
) -> dict:
    processes = launching.config_facts(launching.config_path(config))["num_processes"]
    estimate = train_estimate(steps, precision, processes, extra)
    return {
        "name": name,
        "config": config,
        "args": [*args, "--max-steps", str(steps)],
        "confirms": confirms,
        "estimate_s": estimate,
        "timeout_s": timeout_for(estimate),
        "precision": precision,
        "processes": processes,
        "estimate": f"{processes} process{'es' if processes > 1 else ''}, {steps} "
        f"{precision} steps" + (f" + {extra:.0f} s" if extra else ""),
    }


def command_check(name: str, command: list[str], estimate: float, how: str, confirms: str) -> dict:
    return {
        "name": name,
        "command": command,
        "confirms": confirms,
        "estimate_s": estimate,
        "timeout_s": timeout_for(estimate),
        "estimate": how,
    }


def _first_costs(steps: list[dict]) -> None:
    """Add to the estimates what only a first launch costs: the first launch of all (MEASURED_FIRST_LAUNCH_S) and the
    first of each precision and process count (its operators timed in a child process, ASSUMED_OP_COSTS_S). TF32
    runs the fp32 operators (timed by fp32's launch)."""
    first, timed = True, set()
    for step in steps:
        if step.get("skipped") or "config" not in step:
            continue
        extra, notes = 0.0, []
        if first:
            extra, first = extra + MEASURED_FIRST_LAUNCH_S, False
            notes.append(f"first launch +{MEASURED_FIRST_LAUNCH_S:.0f} s")
        kind = ("fp32" if step["precision"] == "tf32" else step["precision"], step["processes"])
        if kind not in timed:
            timed.add(kind)
            extra += ASSUMED_OP_COSTS_S
            notes.append(f"operator costs +{ASSUMED_OP_COSTS_S:.0f} s")
        if extra:
            step["estimate_s"] += extra
            step["timeout_s"] = timeout_for(step["estimate_s"])
            step["estimate"] += "; " + ", ".join(notes)


def plan(gpus: int | None = None) -> list[dict]:
    """The checks, in the order they run (the most informative first: a short budget skips the tail). Each has a
    name, what only a GPU run confirms, a train.py run (config + args) or a command ("{out}" stands for its
    results folder), its estimated seconds (with how they were estimated) and its timeout. A run whose config
    needs more GPUs than `gpus` is marked skipped with launching.plan's reason. With no GPU (a dry run) it is
    planned as for one."""
    gpus = max(launching.cuda_devices() if gpus is None else gpus, 1)
    precision = {
        name: training_check(
            f"precision-{name}",
            config,
            [*MODEL, *flags, "--timing", "events"],
            PRECISION_STEPS,
            name,
            f"{name} is the precision in effect; samples/s, MFU and per-stage peak memory in it",
        )
        for name, (config, flags) in PRECISIONS.items()
    }
    precision["fp32"]["confirms"] += (
        "; the prediction's operator benchmark survives fp32's memory-efficient "
        "attention (its backward takes random-generator state: the first check's fp32 "
        "runs died of SIGSEGV there)"
    )
    steps = [
        command_check(
            "scaler",
            [sys.executable, "-m", "trainscope.gpu_check", "--scaler-check", "--out", "{out}"],
            ASSUMED_SCALER_S,
            "a process of its own: Python, torch, a CUDA context, 16 tiny steps",
            SCALER_CONFIRMS,
        )
    ]
    steps.append(precision["fp32"])
    steps.append(
        training_check(
            "memory-snapshot",
            "single_gpu",
            [*MODEL, "--memory-snapshot"],
            20,
            "fp32",
            "the allocator's history (Python frames) is recorded over the window after warm-up "
            "and dumped for pytorch.org/memory_viz within its timeout",
            extra=ASSUMED_EXTRA_S["snapshot"],
        )
    )
    steps.append(precision["bf16"])
    # the same run with padding-free encoder layers: trainscope.unpad's kernels on CUDA, and its loss as the padded run's
    steps.append(
        training_check(
            "unpad-bf16",
            "bf16",
            [*MODEL, "--unpad", "--timing", "events"],
            PRECISION_STEPS,
            "bf16",
            "--unpad on CUDA in bf16: the padding-free layers run and train (their first "
            "losses against precision-bf16's, the same seed and batches), samples/s against "
            "precision-bf16's on the same padded-to-128 batches (one run each: an observation)",
        )
    )
    # precision-fp32 is timed with --timing events; the same run with --timing sync is the second clock
    steps.append(
        training_check(
            "timing-sync",
            "single_gpu",
            [*MODEL, "--timing", "sync"],
            PRECISION_STEPS,
            "fp32",
            "--timing events charges each stage its device time: precision-fp32 (events) and "
            "this run (sync) agree per stage within max(5%, 1 ms)",
        )
    )
    steps += [precision["tf32"], precision["fp16"]]
    # two GPUs: what one cannot show
    steps.append(
        training_check(
            "fsdp2",
            "fsdp",
            MODEL,
            50,
            "bf16",
            "FSDP2 over NCCL (accelerate_configs/fsdp.yaml, bf16): each layer sharded, the run's "
            "measurements read the DTensors' local shards, per-GPU memory and speed",
        )
    )
    steps.append(
        training_check(
            "ddp-communication-memory",
            "ddp",
            [*MODEL, "--measure-communication", "on", "--memory-every", "1"],
            40,
            "fp32",
            "exposed communication over NCCL, measured on every step with CUDA events on the "
            "compute stream, agrees with DDP's own logger on the same iterations; the one read of "
            "DDP's buckets stays out of each GPU's peak memory (measurement_peak_allocated_gib)",
        )
    )
    steps.append(
        training_check(
            "ddp-profile",
            "ddp",
            [*MODEL, "--profile"],
            20,
            "fp32",
            "torch.profiler under DDP over NCCL: the trace's exposed communication from the "
            "kernels' device timestamps against trainscope's (comm_instruments_disagree), each "
            "collective counted once, the gap's shares within the window",
            extra=ASSUMED_EXTRA_S["profile"],
        )
    )
    steps.append(
        training_check(
            "ddp-fp16",
            "ddp_fp16",
            MODEL,
            50,
            "fp16",
            "DDP in fp16 over NCCL (accelerate_configs/ddp_fp16.yaml): the loss scaler's skipped "
            "steps on every rank, speed per GPU",
        )
    )
    steps += [
        training_check(
            f"ddp-comm-hook-{hook}",
            "ddp",
            [*MODEL, "--ddp-comm-hook", hook],
            40,
            "fp32",
            f"DDP's {hook} compression hook over NCCL: half the all-reduce bytes; exposed "
            "communication against DDP's logger",
        )
        for hook in ("fp16", "bf16")
    ]
    steps.append(
        training_check(
            "ddp-compile",
            "ddp",
            [*MODEL, "--compile"],
            50,
            "fp32",
            "torch.compile under DDP over NCCL: compile time, recompiles, speed per GPU",
            extra=MEASURED_COMPILE_S * ASSUMED_COMPILE_PROCESSES,
        )
    )
    pairs = bench.MIN_PAIRS
    several = gpus > 1  # DataParallel's loop, and a second DDP process
    dp_round = (
        ASSUMED_DP_LOOP_S * (2 if several else 1) + MEASURED_LAUNCH_S + (ASSUMED_PROCESS_GROUP_S if several else 0)
    )
    steps.append(
        command_check(
            "compare-dp",
            [sys.executable, "compare_dp.py", "--rounds", str(pairs), "--results-dir", "{out}", *SMALL_MODEL],
            ASSUMED_SCRIPT_S + pairs * dp_round,
            f"{pairs} rounds of the in-process loops and a DDP launch",
            "each DDP worker binds its own GPU (NCCL); DataParallel needs two GPUs",
        )
    )
    passes = 2 * 2 * len(LOADER_WORKERS) * pairs  # pinned and not, with and without the copy
    steps.append(
        command_check(
            "loaders",
            [
                sys.executable,
                "loaders_bench.py",
                "--workers",
                *LOADER_WORKERS,
                "--repeats",
                str(pairs),
                "--modes",
                "pretokenized",
                "device-copy",
                "--pin-memory-values",
                "true",
                "false",
                "--batch-sizes",
                str(LOADER_BATCH),
                "--max-seq-length",
                str(LOADER_LENGTH),
                "--pad-to-max-length",
                "--max-train-samples",
                "4096",
                *SMALL_MODEL,
                "--results-dir",
                "{out}",
            ],
            ASSUMED_SCRIPT_S + passes * MEASURED_LOADER_PASS_S,
            f"{passes} passes at {MEASURED_LOADER_PASS_S:g} s",
            "what the copy to the device costs the loop pinned "
            f"(non-blocking) and not, with 0 and 4 workers, at a batch whose copy shows ({LOADER_BATCH} x "
            f"{LOADER_LENGTH} positions: 4 MiB of int64 a batch): copy_s per pass, and pass times with and without it",
        )
    )
    search = train_estimate(0, "fp32", extra=ASSUMED_EXTRA_S["search"]) + train_estimate(6, "fp32")
    steps.append(
        command_check(
            "batch-search",
            [
                sys.executable,
                "-m",
                "trainscope.experiments",
                "batch-sweep",
                "--config",
                "single_gpu",
                "--runs",
                "{out}",
                "--batch-sizes",
                "32",
                "--steps",
                "6",
                "--rounds",
                "1",
                "--search-from",
                "4096",
                "--",
                *MODEL,
            ],
            ASSUMED_SCRIPT_S + search,
            "the search's launch (the prediction and the tries), then one 6-step run of batch "
            "32 (one arm: nothing compared)",
            "a real CUDA out-of-memory error is caught, the allocator recovers between "
            "tries, and the search halves to the largest batch that fits",
        )
    )
    steps.append(
        training_check(
            "compile-bf16",
            "bf16",
            [*DYNAMIC, "--compile"],
            50,
            "bf16",
            "torch.compile in bf16 with dynamic shapes (per-batch padding; the record's "
            "compile.dynamic is true): compile time, recompiles, MFU; the first evaluation's "
            "compile timed as warm-up, not in the steady figures",
            extra=MEASURED_COMPILE_S,
        )
    )
    overhead_run = train_estimate(OVERHEAD_STEPS, "fp32")
    steps.append(
        command_check(
            "overhead",
            [
                sys.executable,
                "-m",
                "trainscope.benchmarks.overhead",
                "--pairs",
                str(pairs),
                "--modes",
                "events",
                "--out",
                "{out}/overhead",
                *MODEL,
                "--max-steps",
                str(OVERHEAD_STEPS),
                "--timing-warmup-steps",
                str(OVERHEAD_WARMUP),
            ],
            ASSUMED_SCRIPT_S + 2 * pairs * overhead_run,
            f"{pairs} pairs x 2 arms (bare, events) x {OVERHEAD_STEPS} fp32 steps of RoBERTa-base; written after every "
            "round",
            "--timing events costs at most 1% against a bare loop on one GPU (a steady window of about 4.2 s per "
            "run at the measured fp32 step: 1% of it is 42 ms, far above the clock's resolution)",
        )
    )
    for step in steps:
        if "config" in step:
            verdict = launching.plan(step["config"], gpus)
            if not verdict.runnable:
                step["skipped"] = verdict.reason
    _first_costs(steps)
    return steps


def planned_seconds(steps: list[dict]) -> float:
    """The plan's estimated total: every check that is not skipped."""
    return sum(step["estimate_s"] for step in steps if not step.get("skipped"))


def default_budget(steps: list[dict]) -> float:
    """The plan's estimate and MARGIN, rounded up to 10 s."""
    return 10.0 * math.ceil(planned_seconds(steps) * MARGIN / 10.0)


def parts(steps: list[dict], limit_s: float = PART_LIMIT_S) -> list[list[dict]]:
    """The plan in order, cut into parts whose estimates and MARGIN fit `limit_s` each (skipped checks ride along
    with the part before them, at no cost)."""
    cut: list[list[dict]] = [[]]
    for step in steps:
        spent = planned_seconds(cut[-1])
        if not step.get("skipped") and cut[-1] and (spent + step["estimate_s"]) * MARGIN > limit_s:
            cut.append([])
        cut[-1].append(step)
    return cut


def device_slug(name: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


SCALER_CONFIRMS = "a CUDA GradScaler with the fused AdamW skips exactly the steps with planted inf gradients"
SCALER_PLANTED = (3, 7, 11)


def scaler_check() -> dict:
    """fp16 on CUDA: a real GradScaler, the fused AdamW and planted inf gradients; the skips counted. Run by
    `--scaler-check` in a process of its own (the plan's `scaler` check)."""
    from trainscope.precision import planted_overflow_run

    planted = set(SCALER_PLANTED)
    try:
        skips, _ = planted_overflow_run(torch.device("cuda"), planted)
    except Exception as error:  # a broken CUDA path is a finding, not a reason to lose the other checks
        return {"planted": len(planted), "counted": None, "ok": False, "error": " ".join(str(error).split())}
    return {"planted": len(planted), "counted": skips.total(), "ok": skips.total() == len(planted)}


# ---------------------------------------------------------------- running the plan

OUTPUT_TAIL_CHARS = 4000


def check_env() -> dict:
    """Every check's environment: a training's, with faulthandler on (a crash prints the Python stack)."""
    return launching.training_env(extra={"PYTHONFAULTHANDLER": "1"})


def output_tail(result: subprocess.CompletedProcess) -> str:
    """The end of a failed check's output: stderr's (the traceback, or faulthandler's stack) after stdout's."""
    text = "\n".join(part.strip() for part in (result.stdout or "", result.stderr or "") if part and part.strip())
    return text[-OUTPUT_TAIL_CHARS:]


def keep_records(source: Path, kept: Path | None) -> list[str]:
    """Copy every run record (record.json, steps.jsonl) under `source` to `kept`, keeping the folders below source."""
    if kept is None or not source.exists():
        return []
    copied = []
    for path in sorted([*source.rglob(RECORD_FILE), *source.rglob(STEPS_FILE)]):
        target = kept / path.relative_to(source)
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(path, target)
        copied.append(str(target))
    return copied


def run_step(step: dict, scratch: Path, timeout: float | None = None, kept: Path | None = None) -> dict:
    """One check, launched with `timeout` (its process tree is killed past it): its exit and figures; the records of
    its runs copied under `kept`/<check>, and on a failure the tail of its output."""
    base = {"name": step["name"], "estimate_s": step.get("estimate_s"), "timeout_s": timeout}
    if step.get("skipped"):
        return {**base, "seconds": 0.0, "skipped": step["skipped"]}
    started = time.monotonic()
    out = scratch / step["name"]
    if "command" in step:
        result = launching.run_captured(
            [part.replace("{out}", str(out)) for part in step["command"]], check_env(), timeout
        )
        figures = {"exit": result.returncode}
        for path in out.glob("*.json") if out.exists() else []:  # results, not the records of the runs under it
            figures[path.stem] = json.loads(path.read_text())
    else:
        result = launching.run_training(
            [*step["args"], "--output-dir", str(out), "--run-name", step["name"]],
            step["config"],
            env=check_env(),
            echo=False,
            timeout=timeout,
        )
        figures = {"exit": result.returncode}
        if result.returncode == 0:
            view = RunView(read_record(out / step["name"]))
            figures.update(
                throughput=view.throughput,
                mfu=view.mfu,
                memory=view.memory,
                compile=view.compile,
                timing=view.summary.get("timing"),
                memory_snapshot=view.summary.get("memory_snapshot"),
                communication=view.communication,
                precision=view.precision,
                warnings=view.warnings,
                measured_peak=view.summary.get("measured_peak"),
                prediction_notes=(view.record.get("prediction") or {}).get("notes"),
            )
    if result.returncode != 0:
        figures.update(error=launching.failure_reason(result), output_tail=output_tail(result))
    figures["records"] = keep_records(out, kept / step["name"] if kept else None)
    return {**base, "seconds": time.monotonic() - started, **figures}


class Interrupted(Exception):
    """SIGINT or SIGTERM while the checks ran."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


@contextlib.contextmanager
def stop_on_signals():
    """SIGINT and SIGTERM raise Interrupted in the main thread (run_captured then kills the running launch)."""

    def interrupt(signum, frame):
        raise Interrupted(signum)

    previous = {signum: signal.signal(signum, interrupt) for signum in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def execute(
    steps: list[dict],
    report: dict,
    write: Callable[[dict], None],
    budget_s: float,
    runner: Callable[[dict, float], dict],
    clock: Callable[[], float] = time.monotonic,
    started: float | None = None,
) -> dict:
    """Run the checks in order within `budget_s` seconds from `started`, calling `write(report)` after each.

    Before a check starts, one whose estimate does not fit in what is left is skipped ("over the budget");
    a check that runs gets min(its timeout, what is left) (`runner(step, timeout)` returns its result).
    SIGINT or SIGTERM stops the checks: the report keeps what finished and says `interrupted`; Interrupted is
    raised again after it is written."""
    started = clock() if started is None else started
    report.update(status="running", budget_s=budget_s, checks=[], not_run=[step["name"] for step in steps])
    current = None
    try:
        with stop_on_signals():
            write(report)
            for step in steps:
                current = step["name"]
                left = budget_s - (clock() - started)
                if step.get("skipped"):
                    result = {
                        "name": step["name"],
                        "estimate_s": step["estimate_s"],
                        "seconds": 0.0,
                        "skipped": step["skipped"],
                    }
                elif step["estimate_s"] > left:
                    result = {
                        "name": step["name"],
                        "estimate_s": step["estimate_s"],
                        "seconds": 0.0,
                        "skipped": f"over the budget (estimated {step['estimate_s']:.0f} s, "
                        f"{max(left, 0):.0f} s of the {budget_s:.0f} s left)",
                    }
                else:
                    result = runner(step, min(step["timeout_s"], left))
                    if (
                        left < step["timeout_s"]
                        and result.get("exit", 0) != 0
                        and "timed out" in str(result.get("error"))
                    ):
                        result["budget_cut"] = (
                            f"stopped where the budget ended ({left:.0f} s were left of its "
                            f"{step['timeout_s']:.0f} s timeout)"
                        )
                report["checks"].append(result)
                report["not_run"].remove(step["name"])
                report["seconds"] = clock() - started
                write(report)
    except Interrupted as stop:
        report.update(
            status="interrupted", interrupted={"signal": str(stop), "during": current}, seconds=clock() - started
        )
        write(report)
        raise
    report.update(status="complete", seconds=clock() - started)
    write(report)
    return report


# ---------------------------------------------------------------- results


def timing_agreement(events: dict, sync: dict) -> float:
    """The largest disagreement over its tolerance, max(5% of the sync figure, 1 ms): at most 1 agrees.

    Forward and backward are device-bound (fp32 at batch 32 x 128): both clocks see the device's work, so
    |events - sync| counts. Data and optimizer are host-bound: --timing sync drains the queue at every stage, so it
    adds the host's work (collate, the optimizer's launches) that under --timing events overlaps the device's queued
    backward; there only the device's time above the serialized time (events above sync) is a disagreement."""
    a, b = events["across_ranks"]["steady"]["seconds"], sync["across_ranks"]["steady"]["seconds"]
    share, floor = TIMING_TOLERANCE
    tolerance = lambda stage: max(share * b[stage]["median"], floor)  # noqa: E731
    both = [abs(a[s]["median"] - b[s]["median"]) / tolerance(s) for s in ("forward", "backward")]
    above = [
        max(0.0, a[s]["median"] - b[s]["median"]) / tolerance(s) for s in ("data", "optimizer") if s in a and s in b
    ]
    return max(both + above)


def verdicts(results: dict) -> dict:
    """The goals' figures, from the measured ones (None where a check did not produce its figure)."""
    speed = lambda name: ((results.get(f"precision-{name}") or {}).get("throughput") or {}).get("samples_per_s")  # noqa: E731
    out = {}
    if speed("bf16") and speed("fp32"):
        out["bf16_over_fp32"] = speed("bf16") / speed("fp32")
    if speed("bf16") and speed("tf32"):
        out["bf16_over_tf32"] = speed("bf16") / speed("tf32")
    events, sync = (results.get("precision-fp32") or {}).get("timing"), (results.get("timing-sync") or {}).get("timing")
    if events and sync:
        out["timing_agreement"] = timing_agreement(events, sync)
    compiled = (results.get("compile-bf16") or {}).get("compile") or {}
    if compiled.get("recompiles") is not None:
        out["compile_recompiles"] = compiled["recompiles"]
    return out


def goal_met(goal: str, value: float) -> bool:
    target, direction, _ = GOALS[goal]
    return value <= target if direction == "at most" else value >= target


def outcome(result: dict) -> str:
    if result.get("skipped"):
        return f"skipped: {result['skipped']}"
    if result.get("budget_cut"):
        return f"not finished: {result['budget_cut']}; its output so far below"
    if result.get("exit", 0) != 0:
        return f"failed: {result.get('error', 'see JSON')}"
    if result.get("throughput") and result.get("throughput", {}).get("samples_per_s") is not None:
        throughput = result["throughput"]
        text = f"{throughput['samples_per_s']:.1f} samples/s, {throughput.get('tokens_per_s') or 0:.0f} tokens/s, " + (
            f"MFU {result['mfu']:.1%}" if result.get("mfu") is not None else "MFU unknown"
        )
        compiled = result.get("compile")
        if compiled:
            text += (
                f"; compile {compiled.get('compile_s') or 0:.0f} s, dynamic shapes "
                f"{'yes' if compiled.get('dynamic') else 'no'}, {compiled.get('recompiles')} recompiles"
            )
        return text
    scaler = result.get("scaler")
    if scaler:
        return f"planted {scaler['planted']} overflows, counted {scaler['counted']}" + (
            f" ({scaler['error']})" if scaler.get("error") else ""
        )
    return "ok"


def markdown(report: dict) -> list[str]:
    status = report.get("status", "complete")
    if status == "interrupted":
        stop = report["interrupted"]
        status = f"interrupted by {stop['signal']} during {stop['during']}: what finished before is kept"
    elif status == "running":
        status = f"running: {len(report['checks'])} of {len(report['plan'])} checks done"
    lines = [
        f"# GPU check: {report['device']}",
        "",
        f"Status: {status}.",
        "",
        f"Driver {report['driver']}, torch {torch.__version__}, CUDA {torch.version.cuda}, {report['gpus']} GPU(s); "
        f"{report.get('seconds', 0):.0f} s of the {report['budget_s']:.0f} s budget. Estimates are from the launch "
        "and step times measured by the first check on one H200 and assumed ones (trainscope/gpu_check.py "
        "MEASURED_* and ASSUMED_*).",
        "",
        "| check | estimate s | timeout s | seconds | outcome |",
        "|---|---:|---:|---:|---|",
    ]
    for r in report["checks"]:
        timeout = f"{r['timeout_s']:.0f}" if r.get("timeout_s") else ""
        lines.append(
            f"| {r['name']} | {r.get('estimate_s') or 0:.0f} | {timeout} | {r['seconds']:.0f} | {outcome(r)} |"
        )
    lines += [
        f"| {name} | | | | not run ({'interrupted' if report.get('status') == 'interrupted' else 'pending'}) |"
        for name in report.get("not_run", [])
    ]
    skipped = [r for r in report["checks"] if r.get("skipped")]
    if skipped:
        lines += ["", "Skipped: " + "; ".join(f"{r['name']} ({r['skipped']})" for r in skipped) + "."]
    lines += ["", "Goals:"]
    for goal, (target, direction, why) in GOALS.items():
        value = report.get("verdicts", {}).get(goal)
        shown = (
            "not measured" if value is None else (f"{value:.3g}, " + ("met" if goal_met(goal, value) else "NOT met"))
        )
        lines.append(f"- {goal} {direction} {target}: {shown} ({why})")
    notes = [
        (r["name"], note)
        for r in report["checks"]
        for note in r.get("prediction_notes") or []
        if "could not be timed" in note
    ]
    if notes:
        lines += ["", "Prediction notes:", *[f"- {name}: {note}" for name, note in notes]]
    failed = [r for r in report["checks"] if r.get("output_tail")]
    for r in failed:
        lines += ["", f"## {r['name']}: the end of its output", "", "```", *r["output_tail"].splitlines()[-40:], "```"]
    lines += ["", "What these runs confirm that a CPU cannot:"]
    lines += [f"- {step['name']}: {step['confirms']}" for step in report["plan"]]
    return lines


# ---------------------------------------------------------------- the driver and the torch that can see it


def nvidia_smi(*args: str) -> str | None:
    """nvidia-smi's output, or None where it does not answer (no NVIDIA driver here)."""
    try:
        result = subprocess.run(["nvidia-smi", *args], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.SubprocessError):
        return None
    return result.stdout if result.returncode == 0 else None


def driver_version() -> str | None:
    out = nvidia_smi("--query-gpu=driver_version", "--format=csv,noheader")
    return out.strip().splitlines()[0] if out and out.strip() else None


def driver_cuda_version(smi_output: str | None) -> tuple[int, int] | None:
    """The newest CUDA the driver runs: the `CUDA Version: 12.8` of nvidia-smi's header."""
    found = re.search(r"CUDA Version:\s*(\d+)\.(\d+)", smi_output or "")
    return (int(found.group(1)), int(found.group(2))) if found else None


# The CUDA builds of torch on download.pytorch.org/whl/<tag>: those of torch 2.9, assumed for this torch too
# (pytorch.org/get-started/locally lists the current ones).
TORCH_CUDA_BUILDS = ((12, 6), (12, 8), (13, 0))


def cuda_wheel_tag(driver_cuda: tuple[int, int]) -> str | None:
    """The newest CUDA build of torch that the driver runs (a driver runs CUDA runtimes up to the version
    nvidia-smi states): e.g. cu128 for a driver of CUDA 12.9; None where the driver is older than every build."""
    fitting = [build for build in TORCH_CUDA_BUILDS if build <= driver_cuda]
    return f"cu{fitting[-1][0]}{fitting[-1][1]}" if fitting else None


def python_shown() -> str:
    """This interpreter as a user types it: .venv/bin/python inside the repository."""
    python = Path(sys.executable)
    return str(python.relative_to(ROOT) if python.is_relative_to(ROOT) else python)


def cuda_torch_command(
    smi_output: str | None,
    torch_version: str = torch.__version__,
    torch_cuda: str | None = torch.version.cuda,
    environ=None,
) -> str | None:
    """Where the NVIDIA driver answers (`smi_output`: nvidia-smi's output, None without a driver) and this torch
    cannot use the GPU: why, and which torch to install, as one sentence. None where there is no driver, the
    GPU is usable, or CUDA_VISIBLE_DEVICES hides every GPU on purpose (as `make test` does).

    The build: the newest of TORCH_CUDA_BUILDS not newer than the CUDA version the driver states (`cu128` for a
    driver of CUDA 12.9); a driver older than every build is to be updated first."""
    environ = os.environ if environ is None else environ
    hidden = environ.get("CUDA_VISIBLE_DEVICES", "x").strip() in ("", "-1")
    if smi_output is None or hidden or torch.cuda.is_available():
        return None
    driver_cuda = driver_cuda_version(smi_output)
    driver = f"CUDA {driver_cuda[0]}.{driver_cuda[1]}" if driver_cuda else "no CUDA version stated"
    built_for = tuple(int(part) for part in torch_cuda.split(".")[:2]) if torch_cuda else None
    if built_for is not None and (driver_cuda is None or built_for <= driver_cuda):
        return (
            f"the NVIDIA driver answers (nvidia-smi: {driver}) but torch {torch_version} (built for CUDA "
            f"{torch_cuda}) cannot use the GPU: check CUDA_VISIBLE_DEVICES and the GPU's device files "
            "(/dev/nvidia*) in this container"
        )
    tag = cuda_wheel_tag(driver_cuda) if driver_cuda else None
    advice = ""
    if tag is None:
        (major, minor), tag = TORCH_CUDA_BUILDS[0], "cu{}{}".format(*TORCH_CUDA_BUILDS[0])
        advice = f"update the NVIDIA driver to one of CUDA {major}.{minor} or later, then "
    what = "is a CPU-only build" if built_for is None else f"is built for CUDA {torch_cuda}, newer than the driver"
    return (
        f"the NVIDIA driver answers (nvidia-smi: {driver}) but torch {torch_version} {what}: {advice}install "
        f"the CUDA build: {python_shown()} -m pip install torch=={torch_version.split('+')[0]}+{tag} "
        f"--index-url https://download.pytorch.org/whl/{tag}"
    )


def print_plan(steps: list[dict], gpus: int, budget_s: float) -> None:
    for step in steps:
        command = " ".join(step.get("command") or launching.train_command(step["args"], step["config"]))
        if step.get("skipped"):
            print(f"{step['name']}: skipped ({step['skipped']})")
        else:
            print(
                f"{step['name']} (estimate {step['estimate_s']:.0f} s: {step['estimate']}; timeout "
                f"{step['timeout_s']:.0f} s): {command}"
            )
        print(f"    confirms: {step['confirms']}")
    total, left, over = planned_seconds(steps), budget_s, []
    for step in steps:
        if step.get("skipped"):
            continue
        if step["estimate_s"] > left:
            over.append(step["name"])
        else:
            left -= step["estimate_s"]
    print(
        f"total estimated for {gpus} GPU{'s' if gpus > 1 else ''}: {total:.0f} s ({total / 60:.1f} min) against a "
        f"budget of {budget_s:.0f} s (default: the estimate and {MARGIN - 1:.0%}, {default_budget(steps):.0f} s); "
        "estimates from the launch and step times measured on one H200 and assumed ones (MEASURED_* and ASSUMED_* "
        "in trainscope/gpu_check.py)"
    )
    if over:
        print(f"over the budget by these estimates (skipped when run): {', '.join(over)}")
    cut = parts(steps)
    if len(cut) > 1:
        print(f"in parts of at most {PART_LIMIT_S:.0f} s a command (each part's estimate and {MARGIN - 1:.0%}):")
        for index, part in enumerate(cut, 1):
            names = [step["name"] for step in part if not step.get("skipped")]
            print(
                f"  part {index} ({planned_seconds(part):.0f} s: {', '.join(names)}): python -m trainscope.gpu_check "
                f"--part {index}"
            )


def parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--out", default=str(ROOT / "benchmarks" / "gpu"), help="results folder (default benchmarks/gpu)"
    )
    parser.add_argument(
        "--budget",
        type=float,
        default=None,
        help=f"seconds for all the checks (default: the plan's estimate and {MARGIN - 1:.0%}); a check "
        "whose estimate does not fit in what is left is skipped, and no launch runs past it",
    )
    parser.add_argument(
        "--part",
        type=int,
        default=None,
        help=f"run only part K of the plan cut into parts of at most {PART_LIMIT_S:.0f} s (the dry "
        "run lists them); results in <device>.partK.*",
    )
    parser.add_argument(
        "--dry-run",
        action="store_true",
        help="print the checks, their commands, estimates and timeouts, the total and the parts; run nothing",
    )
    parser.add_argument(
        "--gpus",
        type=int,
        default=None,
        help="with --dry-run: plan for this many GPUs (default: the GPUs present, or one)",
    )
    parser.add_argument("--torch-check", action="store_true", help=argparse.SUPPRESS)  # make setup's check
    parser.add_argument("--scaler-check", action="store_true", help=argparse.SUPPRESS)  # the scaler check's process
    return parser


def select_part(steps: list[dict], part: int | None) -> list[dict]:
    if part is None:
        return steps
    cut = parts(steps)
    if not 1 <= part <= len(cut):
        raise UserError(f"--part {part}: the plan has {len(cut)} part(s) on this machine (--dry-run lists them)")
    return cut[part - 1]


def main(argv=None) -> None:
    args = parser().parse_args(argv)
    if args.budget is not None and args.budget <= 0:
        parser().error("--budget must be positive")
    if args.gpus is not None and (not args.dry_run or args.gpus < 1):
        parser().error(
            "--gpus plans for that many GPUs (at least 1) with --dry-run; a real check uses the GPUs present"
        )
    if args.torch_check:  # make setup: a warning, since CPU work still runs with this torch
        missing = cuda_torch_command(nvidia_smi())
        if missing:
            print(f"warning: {missing} (make gpu-check refuses to run until then)", file=sys.stderr)
        return
    if args.scaler_check:  # the scaler check, in the process the plan launched for it
        found = scaler_check()
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "scaler.json").write_text(json.dumps(found))
        print(json.dumps(found))
        return
    if args.dry_run:
        gpus = args.gpus or launching.cuda_devices() or 1
        if args.gpus is None and not launching.cuda_devices():
            print("no CUDA device here: planned as for one GPU (--gpus N plans for N)")
        try:
            steps = select_part(plan(gpus), args.part)
        except UserError as error:
            exit_with(error, code=2)
        print_plan(steps, gpus, args.budget or default_budget(steps))
        return
    started = time.monotonic()
    if not torch.cuda.is_available():
        missing = cuda_torch_command(nvidia_smi())
        if missing:
            exit_with(UserError(missing), code=1)
        print(
            f"gpu-check: no usable CUDA device for this torch ({torch.__version__}): nothing measured, nothing written"
        )
        return
    # the device's name and count without a CUDA context in this process (the properties need none)
    name, gpus = torch.cuda.get_device_name(0), launching.cuda_devices()
    try:
        steps = select_part(plan(gpus), args.part)
    except UserError as error:
        exit_with(error, code=2)
    budget = args.budget or default_budget(steps)
    stem = Path(args.out) / (device_slug(name) + (f".part{args.part}" if args.part else ""))
    kept = stem.with_name(stem.name + ".runs")
    report = {
        "benchmark": "gpu_check",
        "benchmark_version": 3,
        "device": name,
        "driver": driver_version(),
        "gpus": gpus,
        "part": args.part,
        "plan": steps,
        "estimates": {
            "measured_launch_s": MEASURED_LAUNCH_S,
            "measured_step_s": MEASURED_STEP_S,
            "measured_compile_s": MEASURED_COMPILE_S,
            "assumed_step_s": ASSUMED_STEP_S,
            "planned_s": planned_seconds(steps),
        },
    }
    shown = []

    def write(current: dict) -> None:
        by_name = {c["name"]: c for c in current["checks"]}
        current["verdicts"] = verdicts(by_name)
        current["scaler"] = (by_name.get("scaler") or {}).get("scaler")
        bench.write_results(stem, current, markdown(current))
        for check in current["checks"][len(shown) :]:  # what finished since the last write, as the file says it
            print(f"  {check['name']}: {outcome(check)} ({check['seconds']:.0f} s)", flush=True)
            shown.append(check["name"])

    print(
        f"gpu-check: {len(steps)} checks on {gpus} x {name}, budget {budget:.0f} s; results after every check "
        f"in {stem}.md",
        flush=True,
    )
    with tempfile.TemporaryDirectory() as scratch:

        def runner(step: dict, timeout: float) -> dict:
            print(f"{step['name']} (estimate {step['estimate_s']:.0f} s, timeout {timeout:.0f} s)", flush=True)
            return run_step(step, Path(scratch), timeout, kept)

        try:
            execute(steps, report, write, budget, runner, started=started)
        except Interrupted as stop:
            done = len([c for c in report["checks"] if not c.get("skipped")])
            exit_with(
                UserError(
                    f"{stop} during {report['interrupted']['during']}, which was stopped (its launch "
                    f"killed); the {done} checks that finished are in {stem}.json and .md"
                ),
                code=128 + stop.signum,
            )
    failed = [
        c["name"]
        for c in report["checks"]
        if not c.get("skipped") and not c.get("budget_cut") and c.get("exit", 0) != 0
    ]
    if report.get("scaler") is not None and not report["scaler"].get("ok") and "scaler" not in failed:
        failed.append("scaler")
    print(f"wrote {stem}.json and {stem}.md")
    if failed:
        exit_with(UserError(f"{', '.join(failed)} failed: see {stem}.md"), code=1)


if __name__ == "__main__":
    main()
