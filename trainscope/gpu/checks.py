"""Every check of make gpu-check, declared once; trainscope.gpu.plan orders them, fits them to the GPUs and cuts parts.

How it works: docs/gpu.md#what-make-gpu-check-does.
"""

import sys

from trainscope.core import launching
from trainscope.gpu.estimates import (
    ASSUMED_COMPILE_PROCESSES,
    ASSUMED_DP_LOOP_S,
    ASSUMED_EXTRA_S,
    ASSUMED_SCALER_S,
    ASSUMED_SCRIPT_S,
    MEASURED_BUCKET_TIMING_S,
    MEASURED_COMPILE_S,
    MEASURED_EXTRA_S,
    MEASURED_LAUNCH_S,
    MEASURED_LOADER_PASS_S,
    MEASURED_PROCESS_GROUP_S,
    MEASURED_SHARED_STEP_S,
    timeout_for,
    train_estimate,
)
from trainscope.measure import bench
from trainscope.run.startup import BACKEND_ENV

# RoBERTa-base (architecture only) at sequence length 128, batch 32 per GPU. Padded to the maximum length:
# one shape, so precisions and configs compare on the same work. DYNAMIC pads per batch (lengths vary).
DYNAMIC = (
    "--model roberta-base --architecture-only --tokenizer embedded:minilm-l6 --max-seq-length 128 "
    "--per-device-batch-size 32 --max-train-samples 4096 --max-eval-samples 64 --max-test-samples 64 "
    "--report-to none --log-every 10"
).split()
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
PRECISION_STEPS = 50
OVERHEAD_STEPS, OVERHEAD_WARMUP = 75, 5  # 70 steady fp32 steps: about 4.2 s per arm and round (0.060 s measured)
LOADER_WORKERS = ("0", "4")
# A batch whose copy shows: 512 rows padded to 512 positions, 2 MiB of token ids and 2 MiB of mask (int64) a batch,
# against 20 KB at the run's batch of 32 short tweets, where the pass measured the collate
LOADER_BATCH, LOADER_LENGTH = 512, 512


def training_check(
    name: str,
    config: str,
    args: list[str],
    steps: int,
    precision: str,
    confirms: str,
    goals: tuple[str, ...] = (),
    extra: float = 0.0,
    on_one_gpu: str | None = None,
) -> dict:
    """A train.py check: its launch, what it confirms and its goals (keys of trainscope.gpu.goals.GOALS): those of
    every training run (its record complete; several processes: on CUDA, as launched, the loss falling, and DDP's
    ranks ending with the same parameters; the precision in effect, FSDP2's being its policy's) and its own;
    `on_one_gpu`: what a multi-process check confirms where its processes share one GPU over gloo."""
    facts = launching.config_facts(launching.config_path(config))
    processes, kind = facts["num_processes"], facts["distributed_type"]
    several = ("on_cuda", "world_size", "distributed_type", "backend", "loss_falls") if processes > 1 else ()
    step = {
        "name": name,
        "config": config,
        "args": list(args),
        "steps": steps,
        "extra_s": extra,
        "confirms": confirms,
        "precision": precision,
        "processes": processes,
        "distributed_type": kind,
        "goals": [
            "complete",
            *several,
            *(["same_parameters"] if several and kind == "MULTI_GPU" else []),
            *(["precision"] if kind != "FSDP" else []),
            *goals,
        ],
        **({"confirms_on_one_gpu": on_one_gpu} if on_one_gpu else {}),
    }
    return _estimated(step)


def _estimated(step: dict) -> dict:
    """The step's args, estimate and timeout from its steps, precision, processes and extras (those measured of its
    kind: DDP's bucket timing after training, FSDP2's start on a shared GPU)."""
    shared, steps, processes = bool(step.get("shared_gpu")), step["steps"], step["processes"]
    step["args"] = with_flag(step["args"], "--max-steps", str(steps))
    extras = {"": step["extra_s"]}
    if processes > 1:
        step["args"] = with_flag(step["args"], "--log-every", str(max(1, steps // LOGGED_LOSSES)))
        if step["distributed_type"] == "MULTI_GPU":  # over NCCL not measured: gloo's, the slower, stands for it
            hook = (
                step["args"][step["args"].index("--ddp-comm-hook") + 1] if "--ddp-comm-hook" in step["args"] else "none"
            )
            extras["DDP's buckets timed"] = MEASURED_BUCKET_TIMING_S[hook]
    if shared and step["config"] in MEASURED_EXTRA_S:
        extras[f"{step['config']}'s start"] = MEASURED_EXTRA_S[step["config"]]
    shared_step = MEASURED_SHARED_STEP_S[step["config"]] if shared else None
    step["estimate_s"] = train_estimate(steps, step["precision"], processes, sum(extras.values()), shared_step)
    step["timeout_s"] = timeout_for(step["estimate_s"])
    step["estimate"] = (
        f"{processes} process{'es' if processes > 1 else ''}"
        + (" sharing one GPU over gloo" if shared else "")
        + f", {steps} {step['precision']} steps"
        + "".join(f" + {seconds:.0f} s{f' ({what})' if what else ''}" for what, seconds in extras.items() if seconds)
    )
    return step


def with_flag(args: list[str], flag: str, value: str) -> list[str]:
    """`args` with `flag value` (replacing the flag's value where it is there)."""
    if flag in args:
        at = args.index(flag)
        return [*args[:at], flag, value, *args[at + 2 :]]
    return [*args, flag, value]


def command_check(name: str, command: list[str], estimate: float, how: str, confirms: str, goals=()) -> dict:
    """A check run as a command of its own: what it confirms and its goals (keys of trainscope.gpu.goals.GOALS)."""
    return {
        "name": name,
        "command": command,
        "confirms": confirms,
        "estimate_s": estimate,
        "timeout_s": timeout_for(estimate),
        "estimate": how,
        "goals": list(goals),
    }


def share_one_gpu(step: dict, confirms: str) -> None:
    """A 2-process training check on one GPU: both processes on it over gloo, SHARED_STEPS steps, what it `confirms`
    there (its code path's, not its speed)."""
    step.update(
        shared_gpu=True,
        env={BACKEND_ENV: SHARED_BACKEND},
        steps=min(step["steps"], SHARED_STEPS),
        confirms=f"{SHARED_NOTE}. {confirms}",
    )
    _estimated(step)


SHARED_NOTE = "2 processes sharing one GPU over gloo: speed not representative"


def declared(gpus: int) -> list[dict]:
    """Every check, in the order they run (the most informative first: a short budget skips the tail): those of
    several processes, then those of one GPU, then the benchmarks (compare-dp's rounds depend on `gpus`)."""
    return [
        *_two_gpu_checks(),
        *_ddp_variant_checks(),
        _compare_dp_check(gpus),
        *_single_gpu_checks(_precision_checks()),
        _loaders_check(),
        _batch_search_check(),
        _compile_check(),
        _tune_check(),
        _overhead_check(),
    ]


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
            "a CUDA GradScaler with the fused AdamW skips exactly the steps with planted inf gradients",
            goals=("scaler",),
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
            goals=("snapshot_written",),
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
            "--unpad on CUDA in bf16: the padding-free layers run and train (every logged loss "
            "against precision-bf16's, the same seed and batches), samples/s against "
            "precision-bf16's on the same padded-to-128 batches (one run each: an observation)",
            goals=("unpad_losses",),
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
            goals=("timing_agreement",),
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
            goals=("layers_sharded", "parameter_shares", "collectives_ran"),
            on_one_gpu="FSDP2 (accelerate_configs/fsdp.yaml, bf16) on CUDA tensors: the layers of its wrap list "
            "sharded by Accelerate's own prepare on each rank, each rank holding about half the parameters (its local "
            "shards), FSDP2's all-gathers and reduce-scatters run between the ranks",
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
            "DDP's buckets stays out of each GPU's peak memory (measurement_peak_allocated_gib); the same parameters "
            "on every rank",
            goals=("communication_measured", "agrees_with_ddp"),
            on_one_gpu="DDP's exposed communication measured on every step with CUDA events on the compute stream, "
            "against DDP's own logger on the same iterations; the one read of DDP's buckets out of each process's "
            "peak memory; both ranks end with the same parameters",
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
            goals=("trace_instrument",),
            extra=MEASURED_EXTRA_S["profile"],
            on_one_gpu="torch.profiler under DDP on CUDA: the trace of its window's steps on two ranks, DDP's "
            "all-reduces among its operators (no second instrument over gloo: its collectives are host operators, no "
            "kernels to time)",
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
            "DDP in fp16 over NCCL (accelerate_configs/ddp_fp16.yaml): a loss scaler on every rank, each in "
            "the same state after training, speed per GPU",
            goals=("scaler_every_rank",),
            on_one_gpu="DDP in fp16 on CUDA (accelerate_configs/ddp_fp16.yaml): a loss scaler on every rank, each in "
            "the same state after training, and the same parameters",
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
            goals=("communication_measured", "agrees_with_ddp"),
            on_one_gpu=f"DDP's {hook} compression hook on CUDA tensors"
            + (", all-reduced by gloo in bf16" if hook == "bf16" else "")
            + "; exposed communication against DDP's logger; the same parameters on both ranks",
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
            goals=("compiled",),
            extra=MEASURED_COMPILE_S * ASSUMED_COMPILE_PROCESSES,
            on_one_gpu="torch.compile under DDP on CUDA: compile time, recompiles",
        )
    )
    return steps


def _compare_dp_check(gpus: int) -> dict:
    """compare_dp.py: one device, DataParallel and DDP, bench.MIN_PAIRS rounds."""
    pairs = bench.MIN_PAIRS
    several = gpus > 1  # DataParallel's loop, and a second DDP process
    dp_round = (
        ASSUMED_DP_LOOP_S * (2 if several else 1) + MEASURED_LAUNCH_S + (MEASURED_PROCESS_GROUP_S if several else 0)
    )
    return command_check(
        "compare-dp",
        [sys.executable, "compare_dp.py", "--rounds", str(pairs), "--results-dir", "{out}", *SMALL_MODEL],
        ASSUMED_SCRIPT_S + pairs * dp_round,
        f"{pairs} rounds of the in-process loops and a DDP launch",
        "each DDP worker binds its own GPU (NCCL), one process per GPU, and DataParallel runs on two GPUs or more: "
        "speed against one device",
        goals=("compare_dp_ddp", "compare_dp_dp"),
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
            *f"--repeats {pairs} --modes pretokenized device-copy --pin-memory-values true false".split(),
            *f"--batch-sizes {LOADER_BATCH} --max-seq-length {LOADER_LENGTH} --pad-to-max-length".split(),
            *["--max-train-samples", "4096", *SMALL_MODEL, "--results-dir", "{out}"],
        ],
        ASSUMED_SCRIPT_S + passes * MEASURED_LOADER_PASS_S,
        f"{passes} passes at {MEASURED_LOADER_PASS_S:g} s",
        "what the copy to the device costs the loop pinned "
        f"(non-blocking) and not, with 0 and 4 workers, at a batch whose copy shows ({LOADER_BATCH} x "
        f"{LOADER_LENGTH} positions: 4 MiB of int64 a batch): copy_s per pass, and pass times with and without it",
        goals=("loader_copies",),
    )


def _batch_search_check() -> dict:
    """The batch-size search against a real out-of-memory error, then one short run of batch 32."""
    search = train_estimate(0, "fp32", extra=ASSUMED_EXTRA_S["search"]) + train_estimate(6, "fp32")
    return command_check(
        "batch-search",
        [
            *[sys.executable, "-m", "trainscope.experiments", "batch-sweep", "--config", "single_gpu"],
            *"--runs {out} --batch-sizes 32 --steps 6 --rounds 1 --search-from 4096 --".split(),
            *MODEL,
        ],
        ASSUMED_SCRIPT_S + search,
        "the search's launch (the prediction and the tries), then one 6-step run of batch "
        "32 (one arm: nothing compared)",
        "a real CUDA out-of-memory error is caught, the allocator recovers between "
        "tries, and the search halves to the largest batch that fits",
        goals=("largest_batch", "batch_arm"),
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
        goals=("compiled_dynamic", "compile_recompiles"),
        extra=MEASURED_COMPILE_S,
    )


# trainscope tune's own budget on the GPU: the determinism probe's two runs and 5 rounds of one trial, about 12
# launches of 50 bf16 steps (run 4 on the H200: 25-45 s each, the first compile about 32 s more)
TUNE_BUDGET_S = 440


def _tune_check() -> dict:
    """trainscope tune on precision-bf16's command, from outside train.py: the host-bound rule's CUDA graphs."""
    return command_check(
        "tune-bf16",
        [
            *[sys.executable, "-m", "trainscope", "tune", "--runs", "{out}", "--budget", str(TUNE_BUDGET_S)],
            *"--rounds 5 --only compile --max-suggestions 1 --".split(),
            *launching.train_command([*MODEL, "--timing", "events", "--max-steps", str(PRECISION_STEPS)], "bf16"),
        ],
        ASSUMED_SCRIPT_S + TUNE_BUDGET_S,
        f"trainscope tune within {TUNE_BUDGET_S} s: the command twice, then 5 alternating rounds of one change",
        "trainscope tune on the host-bound bf16 step, from outside train.py: CUDA graphs (--compile-mode "
        "reduce-overhead) kept with the same losses and at least 2x the samples/s (a step of 22 ms or less)",
        goals=("tuned_graphs",),
    )


def _overhead_check() -> dict:
    """--timing events against a bare loop (trainscope.experiments.benchmarks.overhead)."""
    pairs = bench.MIN_PAIRS
    overhead_run = train_estimate(OVERHEAD_STEPS, "fp32")
    return command_check(
        "overhead",
        [
            *[sys.executable, "-m", "trainscope.experiments.benchmarks.overhead"],
            *f"--pairs {pairs} --warm-rounds 0 --scripts train --modes events --out {{out}}/overhead".split(),
            *MODEL,
            *f"--max-steps {OVERHEAD_STEPS} --timing-warmup-steps {OVERHEAD_WARMUP}".split(),
        ],
        ASSUMED_SCRIPT_S + 2 * pairs * overhead_run,
        f"{pairs} pairs x 2 arms (bare, events) x {OVERHEAD_STEPS} fp32 steps of RoBERTa-base; written after every "
        "round",
        "--timing events costs at most 1% against a bare loop on one GPU (a steady window of about 4.2 s per "
        "run at the measured fp32 step: 1% of it is 42 ms, far above the clock's resolution)",
        goals=("overhead",),
    )
