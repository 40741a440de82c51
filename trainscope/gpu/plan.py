"""make gpu-check's plan: the checks in the order they run, each with its command, what only a GPU run confirms,
its estimated seconds and timeout, and the plan's total, default budget and parts.

The multi-process checks run first; on one GPU they run as 2 processes sharing it over gloo. The plan is cut into
parts, each one command that fits a session's device time (`--part K`); on one GPU it leaves out what `--only NAME`
runs. Durations rest on trainscope.gpu.estimates.

How it works: docs/gpu.md#what-make-gpu-check-does.
"""

import copy
import math
import sys

from trainscope.core import launching
from trainscope.core.errors import UserError
from trainscope.gpu.estimates import (
    ASSUMED_COMPILE_PROCESSES,
    ASSUMED_DP_LOOP_S,
    ASSUMED_EXTRA_S,
    ASSUMED_PROCESS_GROUP_S,
    ASSUMED_SCALER_S,
    ASSUMED_SCRIPT_S,
    MEASURED_COMPILE_S,
    MEASURED_LAUNCH_S,
    MEASURED_LOADER_PASS_S,
    SESSION_S,
    cut,
    first_costs,
    timeout_for,
    train_estimate,
)
from trainscope.measure import bench
from trainscope.run.startup import BACKEND_ENV

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

SHARED_STEPS = 20  # a shared GPU's check: the code path (warm-up, steady steps, the loss's trend), not its speed
SHARED_BACKEND = "gloo"
LOGGED_LOSSES = 10  # a multi-process check logs its loss this many times, for the trend its goal reads
# After a collective times out: the peers name the failed rank and the record is written (seconds); a check's timeout
# leaves this beyond its estimate and its --distributed-timeout, which is at least MIN_DISTRIBUTED_TIMEOUT_S (a rank
# may wait that long for another's start-up work: its operators timed, the first evaluation)
DISTRIBUTED_EVIDENCE_S = 30.0
MIN_DISTRIBUTED_TIMEOUT_S = 60
PRECISION_STEPS = 50
OVERHEAD_STEPS, OVERHEAD_WARMUP = 75, 5  # 70 steady fp32 steps: about 4.2 s per arm and round (0.060 s measured)
LOADER_WORKERS = ("0", "4")
# A batch whose copy shows: 512 rows padded to 512 positions, 2 MiB of token ids and 2 MiB of mask (int64) a batch,
# against 20 KB at the run's batch of 32 short tweets, where the pass measured the collate
LOADER_BATCH, LOADER_LENGTH = 512, 512
# With one GPU: what the plan leaves out, to keep it to few sessions (`--only NAME` runs it), and what cannot run there
LEFT_OUT_ON_ONE_GPU = {
    "memory-snapshot": "run 2 on the H200 recorded its window and dumped it within its timeout",
    "ddp-compile": "two processes compiling at once (about 3 minutes) on the shared GPU",
    "overhead": "10 launches of 75 steps (about 4.5 minutes)",
}
NEEDS_TWO_GPUS = {
    "compare-dp": "needs 2 GPUs: compare_dp.py's DDP workers each bind cuda:<local rank> over NCCL (a second "
    "process cannot share the GPU there, and one process has no all-reduce); DataParallel needs two",
}


def training_check(
    name: str, config: str, args: list[str], steps: int, precision: str, confirms: str, extra: float = 0.0
) -> dict:
    processes = launching.config_facts(launching.config_path(config))["num_processes"]
    step = {
        "name": name,
        "config": config,
        "args": list(args),
        "steps": steps,
        "extra_s": extra,
        "confirms": confirms,
        "precision": precision,
        "processes": processes,
    }
    return _estimated(step)


def _estimated(step: dict) -> dict:
    """The step's args, estimate and timeout from its steps, precision, processes and extras."""
    shared, steps, extra = bool(step.get("shared_gpu")), step["steps"], step["extra_s"]
    step["args"] = _with_flag(step["args"], "--max-steps", str(steps))
    if step["processes"] > 1:
        step["args"] = _with_flag(step["args"], "--log-every", str(max(1, steps // LOGGED_LOSSES)))
    step["estimate_s"] = train_estimate(steps, step["precision"], step["processes"], extra, shared)
    step["timeout_s"] = timeout_for(step["estimate_s"])
    processes = step["processes"]
    step["estimate"] = (
        f"{processes} process{'es' if processes > 1 else ''}"
        + (" sharing one GPU over gloo" if shared else "")
        + f", {steps} {step['precision']} steps"
        + (f" + {extra:.0f} s" if extra else "")
    )
    return step


def _with_flag(args: list[str], flag: str, value: str) -> list[str]:
    """`args` with `flag value` (replacing the flag's value where it is there)."""
    if flag in args:
        at = args.index(flag)
        return [*args[:at], flag, value, *args[at + 2 :]]
    return [*args, flag, value]


def command_check(name: str, command: list[str], estimate: float, how: str, confirms: str) -> dict:
    return {
        "name": name,
        "command": command,
        "confirms": confirms,
        "estimate_s": estimate,
        "timeout_s": timeout_for(estimate),
        "estimate": how,
    }


def distributed_timeout(step: dict) -> int:
    """A multi-process check's --distributed-timeout: what its timeout leaves after its estimate (a collective can
    hang at the run's end) and DISTRIBUTED_EVIDENCE_S (the peers' report and the record written)."""
    return math.floor(step["timeout_s"] - step["estimate_s"] - DISTRIBUTED_EVIDENCE_S)


def _distributed_timeouts(steps: list[dict]) -> None:
    """Each multi-process check's timeout made room for MIN_DISTRIBUTED_TIMEOUT_S and DISTRIBUTED_EVIDENCE_S past its
    estimate, and its --distributed-timeout set to what that timeout leaves (train.py's default, 600 s, outlived the
    checks' timeouts of 109-138 s: a hung collective was killed before the run could say anything)."""
    for step in steps:
        if "config" not in step or step["processes"] < 2:
            continue
        least = math.ceil(step["estimate_s"]) + MIN_DISTRIBUTED_TIMEOUT_S + DISTRIBUTED_EVIDENCE_S
        step["timeout_s"] = max(step["timeout_s"], least)
        step["args"] = _with_flag(step["args"], "--distributed-timeout", str(distributed_timeout(step)))


def plan(gpus: int | None = None, only: list[str] | None = None) -> list[dict]:
    """The checks, in the order they run (the most informative first: a short budget skips the tail): those of
    several processes, then those of one GPU, then the benchmarks. Each has a name, what only a GPU run confirms,
    a train.py run (config + args, and `env` to launch it with) or a command ("{out}" stands for its results folder),
    its estimated seconds (with how they were estimated) and its timeout. A check that cannot run on `gpus` GPUs is
    marked skipped with its reason; with one GPU the multi-process training checks share it (`shared_gpu`), and
    LEFT_OUT_ON_ONE_GPU is left out (skipped, `left_out`). `only`: just the checks named, the left-out ones among
    them run. The checks are numbered into parts (`part`), each one command within a session's device time, each
    check's estimate as in its part alone. With no GPU (a dry run) it is planned as for one."""
    gpus = max(launching.cuda_devices() if gpus is None else gpus, 1)
    steps = [
        *_two_gpu_checks(),
        *_ddp_variant_checks(),
        _compare_dp_check(gpus),
        *_single_gpu_checks(_precision_checks()),
        _loaders_check(),
        _batch_search_check(),
        _compile_check(),
        _overhead_check(),
    ]
    for step in steps:
        _fit(step, gpus)
    if only:
        unknown = sorted(set(only) - {step["name"] for step in steps})
        if unknown:
            raise UserError(f"--only {' '.join(unknown)}: no such check (the dry run lists them)")
        steps = [step for step in steps if step["name"] in only]
        for step in steps:
            if step.pop("left_out", False):
                del step["skipped"]
    cut(steps, _charged)
    return steps


def _charged(steps: list[dict]) -> list[dict]:
    """Copies of `steps` planned as one command: what only its first launches cost, and the multi-process checks'
    --distributed-timeout from their estimates."""
    charged = copy.deepcopy(steps)
    first_costs(charged)
    _distributed_timeouts(charged)
    return charged


def _fit(step: dict, gpus: int) -> None:
    """The check as it runs on `gpus` GPUs: skipped where it cannot, shared over gloo where one GPU holds its
    processes, left out where the one-GPU plan has no room for it."""
    name, processes = step["name"], step.get("processes", 1)
    if gpus == 1 and name in NEEDS_TWO_GPUS:
        step["skipped"] = NEEDS_TWO_GPUS[name]
        return
    if "config" in step and not launching.plan(step["config"], gpus).runnable:
        if gpus == 1 and processes == 2:
            share_one_gpu(step)
        else:
            step["skipped"] = launching.plan(step["config"], gpus).reason
            return
    if gpus == 1 and name in LEFT_OUT_ON_ONE_GPU:
        step["skipped"] = (
            f"left out of the one-GPU plan, each of whose parts takes a session's {SESSION_S / 60:.0f} minutes of "
            f"GPU time: {LEFT_OUT_ON_ONE_GPU[name]}; `python -m trainscope.gpu.check --only {name}` runs it"
        )
        step["left_out"] = True


def share_one_gpu(step: dict) -> None:
    """A 2-process training check on one GPU: both processes on it over gloo, SHARED_STEPS steps, what it confirms
    the code path's, not its speed."""
    step.update(
        shared_gpu=True,
        env={BACKEND_ENV: SHARED_BACKEND},
        steps=min(step["steps"], SHARED_STEPS),
        confirms=f"{SHARED_NOTE}. {SHARED_CONFIRMS[step['name']]}",
    )
    _estimated(step)


SHARED_NOTE = "2 processes sharing one GPU over gloo: speed not representative"
# What a multi-process check confirms on one GPU shared over gloo: its code path on CUDA tensors
SHARED_CONFIRMS = {
    "fsdp2": "FSDP2 (accelerate_configs/fsdp.yaml, bf16) on CUDA tensors: the layers of its wrap list sharded by "
    "Accelerate's own prepare on each rank, each rank holding about half the parameters (its local shards), FSDP2's "
    "all-gathers and reduce-scatters run between the ranks",
    "ddp-communication-memory": "DDP's exposed communication measured on every step with CUDA events on the compute "
    "stream, against DDP's own logger on the same iterations; the one read of DDP's buckets out of each process's "
    "peak memory",
    "ddp-profile": "torch.profiler under DDP on CUDA: the trace written and read with two ranks (gloo's collectives "
    "are host operators: no NCCL kernels to count)",
    "ddp-fp16": "DDP in fp16 on CUDA (accelerate_configs/ddp_fp16.yaml): the loss scaler on every rank",
    "ddp-comm-hook-fp16": "DDP's fp16 compression hook on CUDA tensors; exposed communication against DDP's logger",
    "ddp-comm-hook-bf16": "DDP's bf16 compression hook on CUDA tensors, all-reduced by gloo in bf16; exposed "
    "communication against DDP's logger",
    "ddp-compile": "torch.compile under DDP on CUDA: compile time, recompiles",
}


def _precision_checks() -> dict[str, dict]:
    """precision-<name>: RoBERTa-base in each precision of PRECISIONS, timed with --timing events."""
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
    return precision


def _single_gpu_checks(precision: dict[str, dict]) -> list[dict]:
    """What one GPU shows: the scaler, the precisions, a memory snapshot, --unpad and the second clock."""
    steps = [
        command_check(
            "scaler",
            [sys.executable, "-m", "trainscope.gpu.check", "--scaler-check", "--out", "{out}"],
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
    # the same run with padding-free encoder layers: trainscope.workload.unpad's kernels on CUDA, and its loss as the padded run's
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
    return steps


def _two_gpu_checks() -> list[dict]:
    """Several processes: FSDP2, DDP's communication and its memory, the profiler under DDP (one GPU each over NCCL;
    on one GPU, `share_one_gpu`)."""
    steps = []
    steps.append(
        training_check(
            "fsdp2",
            "fsdp",
            MODEL,
            50,
            "bf16",
            "FSDP2 over NCCL (accelerate_configs/fsdp.yaml, bf16): the layers of its wrap list sharded on each "
            "rank, each rank holding about 1/world of the parameters (its local shards), FSDP2's all-gathers and "
            "reduce-scatters run between the GPUs",
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
    return steps


def _ddp_variant_checks() -> list[dict]:
    """Several processes: DDP in fp16, under the compression hooks and compiled."""
    steps = []
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
    return steps


def _compare_dp_check(gpus: int) -> dict:
    """compare_dp.py: one device, DataParallel and DDP, bench.MIN_PAIRS rounds."""
    pairs = bench.MIN_PAIRS
    several = gpus > 1  # DataParallel's loop, and a second DDP process
    dp_round = (
        ASSUMED_DP_LOOP_S * (2 if several else 1) + MEASURED_LAUNCH_S + (ASSUMED_PROCESS_GROUP_S if several else 0)
    )
    return command_check(
        "compare-dp",
        [sys.executable, "compare_dp.py", "--rounds", str(pairs), "--results-dir", "{out}", *SMALL_MODEL],
        ASSUMED_SCRIPT_S + pairs * dp_round,
        f"{pairs} rounds of the in-process loops and a DDP launch",
        "each DDP worker binds its own GPU (NCCL), one process per GPU, and DataParallel runs on two GPUs or more: "
        "speed against one device",
    )


def _loaders_check() -> dict:
    """loaders_bench.py: the copy to the device, pinned and not, at a batch whose copy shows."""
    pairs = bench.MIN_PAIRS
    passes = 2 * 2 * len(LOADER_WORKERS) * pairs  # pinned and not, with and without the copy
    return command_check(
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


def _batch_search_check() -> dict:
    """The batch-size search against a real out-of-memory error, then one short run of batch 32."""
    search = train_estimate(0, "fp32", extra=ASSUMED_EXTRA_S["search"]) + train_estimate(6, "fp32")
    return command_check(
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


def _compile_check() -> dict:
    return training_check(
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


def _overhead_check() -> dict:
    """--timing events against a bare loop (trainscope.experiments.benchmarks.overhead)."""
    pairs = bench.MIN_PAIRS
    overhead_run = train_estimate(OVERHEAD_STEPS, "fp32")
    return command_check(
        "overhead",
        [
            sys.executable,
            "-m",
            "trainscope.experiments.benchmarks.overhead",
            "--pairs",
            str(pairs),
            "--warm-rounds",
            "0",
            "--scripts",
            "train",
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


SCALER_CONFIRMS = "a CUDA GradScaler with the fused AdamW skips exactly the steps with planted inf gradients"
