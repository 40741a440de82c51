"""make gpu-check: what only a GPU can show, checked on the GPUs present, within a time budget.

    python -m trainscope.gpu_check [--out benchmarks/gpu] [--budget 540]
    python -m trainscope.gpu_check --dry-run [--gpus N]      # the plan for N GPUs, on any machine
    make gpu-check [ARGS="--budget 900"]; make gpu-check ARGS=--dry-run (or make gpu-check --dry-run)

Without a usable CUDA device it prints one line, writes nothing and exits 0; but where the NVIDIA driver
answers (`nvidia-smi`) and this torch cannot see the GPU (a CPU-only torch), it fails with one `error:`
line naming the CUDA build of torch to install (`cuda_torch_command`).

With one, it runs the checks of `plan` (each by the documented commands, RoBERTa-base architecture-only at
sequence length 128 unless said otherwise) and writes benchmarks/gpu/<device>.{json,md} with provenance:

1. fp16 loss scaling (in this process): a CUDA GradScaler with the fused AdamW and planted inf gradients;
2. precision: fp32, TF32, bf16 and fp16: samples/s, tokens/s, MFU, peak memory per stage
   (goals: bf16 >= 3x fp32 and >= 1.5x TF32);
3. timing: the fp32 run (--timing events) again with --timing sync (per-stage seconds must agree within 5%);
4. torch.compile in bf16 with dynamic shapes (per-batch padding): compile time, recompiles, MFU (goal >= 40%);
5. a memory snapshot (--memory-snapshot) and the batch-size search (make batch-sweep's path, halving from
   --search-from on one process);
6. with two GPUs: DDP with --compile, DDP's per-step communication on device time (CUDA events) against its own logger, DDP in fp16, the fp16 and bf16
   compression hooks over NCCL, the profiler under DDP, and FSDP2; with fewer, skipped with their reason;
7. the cost of --timing events against a bare loop (make bench-overhead; target 1%), the DataLoader sweep
   with the copy to the device, and single device vs DataParallel vs DDP: alternating comparisons of
   bench.MIN_PAIRS rounds each.

Every launch has a timeout (its whole process tree is killed past it) and the plan a budget (--budget,
default 540 s, so that one H100 finishes within 10 minutes): before each check, one whose estimate does not
fit in what is left is skipped ("over the budget"), and no launch may run past the budget. The results are
rewritten (atomically) after every check, so a time limit, Ctrl-C or a hung launch keeps what was measured;
on SIGINT or SIGTERM the running launch is killed and the results say `interrupted`.

Durations are estimates from each check's workload (launches, steps, precision) and the ASSUMED_* figures of
trainscope/gpu_check.py, which are assumptions for one H100, not measurements: not measured on GPU.
"""

import argparse
import contextlib
import json
import os
import re
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
from trainscope.records import read_record

ROOT = launching.ROOT
# RoBERTa-base (architecture only) at sequence length 128, batch 32 per GPU. Padded to the maximum length:
# one shape, so precisions and configs compare on the same work. DYNAMIC pads per batch (lengths vary).
DYNAMIC = ["--model", "roberta-base", "--architecture-only", "--tokenizer", "embedded:minilm-l6", "--max-seq-length",
           "128", "--per-device-batch-size", "32", "--max-train-samples", "4096", "--max-eval-samples", "64",
           "--max-test-samples", "64", "--report-to", "none", "--log-every", "10"]
MODEL = [*DYNAMIC, "--pad-to-max-length"]
PRECISIONS = {"fp32": ("single_gpu", []), "tf32": ("single_gpu", ["--tf32"]), "bf16": ("bf16", []),
              "fp16": ("fp16", [])}
GOALS = {"timing_agreement": 0.05, "bf16_over_fp32": 3.0, "bf16_over_tf32": 1.5, "compiled_bf16_mfu": 0.40}

# ---- what the estimates assume (one H100 SXM 80 GB, a 16-core host): assumptions, not measured on GPU
ASSUMED_LAUNCH_S = 12.0  # one `accelerate launch train.py`: launcher, imports, data, model build, CUDA context,
#                          the final evaluation (64 + 64 samples) and the record
ASSUMED_PROCESS_GROUP_S = 5.0  # a 2-process launch: the second process and NCCL's communicator
ASSUMED_SCRIPT_S = 8.0  # a benchmark script's own start: imports, data, model, CUDA context
# One optimizer step of RoBERTa-base, batch 32, sequence 128 (about 2.2 training TFLOP) per precision
ASSUMED_STEP_S = {"fp32": 0.10, "tf32": 0.04, "bf16": 0.03, "fp16": 0.03}
ASSUMED_COMPILE_S = 60.0  # torch.compile (inductor) of RoBERTa-base's training step
ASSUMED_EXTRA_S = {"snapshot": 5.0, "profile": 5.0, "search": 10.0}  # pickling a snapshot, writing a trace,
#                                                                      the batch search's tries
ASSUMED_LOADER_POINT_S = 1.5  # loaders_bench: one setting in one repeat (a pass with the copy, or 10 MiniLM steps)
ASSUMED_DP_LOOP_S = 2.0  # compare_dp.py: one in-process loop (22 MiniLM steps of 32)
ASSUMED_SCALER_S = 5.0  # the in-process scaler check: CUDA context and 16 tiny steps
TIMEOUT_FACTOR, MIN_TIMEOUT_S = 3.0, 60.0  # a launch is killed past 3x its estimate (at least a minute)
DEFAULT_BUDGET_S = 540.0
PRECISION_STEPS = 50
OVERHEAD_STEPS, OVERHEAD_WARMUP = 50, 5  # 45 steady fp32 steps: about 4.5 s per arm and round (assumed)
LOADER_WORKERS = ("0", "4")


def train_estimate(steps: int, precision: str, processes: int = 1, extra: float = 0.0) -> float:
    """Seconds for one launch of train.py: the fixed cost, the steps at the assumed step time, and extras."""
    return (ASSUMED_LAUNCH_S + (ASSUMED_PROCESS_GROUP_S if processes > 1 else 0.0)
            + steps * ASSUMED_STEP_S[precision] + extra)


def timeout_for(estimate: float) -> float:
    return max(MIN_TIMEOUT_S, TIMEOUT_FACTOR * estimate)


def training_check(name: str, config: str, args: list[str], steps: int, precision: str, confirms: str,
                   extra: float = 0.0) -> dict:
    processes = launching.config_facts(launching.config_path(config))["num_processes"]
    estimate = train_estimate(steps, precision, processes, extra)
    return {"name": name, "config": config, "args": [*args, "--max-steps", str(steps)], "confirms": confirms,
            "estimate_s": estimate, "timeout_s": timeout_for(estimate),
            "estimate": f"{processes} process{'es' if processes > 1 else ''}, {steps} {precision} steps"
                        + (f" + {extra:.0f} s" if extra else "")}


def command_check(name: str, command: list[str], estimate: float, how: str, confirms: str) -> dict:
    return {"name": name, "command": command, "confirms": confirms, "estimate_s": estimate,
            "timeout_s": timeout_for(estimate), "estimate": how}


def plan(gpus: int | None = None) -> list[dict]:
    """The checks, in the order they run (what matters most first: the budget skips the tail). Each has a
    name, what only a GPU run confirms, a train.py run (config + args) or a command ("{out}" stands for its
    results folder), its estimated seconds (with how they were estimated) and its timeout. A run whose config
    needs more GPUs than `gpus` is marked skipped with launching.plan's reason. With no GPU (a dry run) it is
    planned as for one."""
    gpus = max(launching.cuda_devices() if gpus is None else gpus, 1)
    steps = [training_check(f"precision-{name}", config, [*MODEL, *flags, "--timing", "events"], PRECISION_STEPS,
                            name, f"{name} is the precision in effect; samples/s, MFU and per-stage peak memory in it")
             for name, (config, flags) in PRECISIONS.items()]
    # precision-fp32 is timed with --timing events; the same run with --timing sync is the second clock
    steps.insert(1, training_check("timing-sync", "single_gpu", [*MODEL, "--timing", "sync"], PRECISION_STEPS, "fp32",
                                   "--timing events charges each stage its device time: precision-fp32 (events) and "
                                   f"this run (sync) agree within {GOALS['timing_agreement']:.0%} per stage"))
    steps.append(training_check("compile-bf16", "bf16", [*DYNAMIC, "--compile"], 50, "bf16",
                                "torch.compile in bf16 with dynamic shapes (per-batch padding; the record's "
                                "compile.dynamic is true): compile time, recompiles, MFU", extra=ASSUMED_COMPILE_S))
    steps.append(training_check("memory-snapshot", "single_gpu", [*MODEL, "--memory-snapshot"], 20, "fp32",
                                "the allocator's history is recorded over the window after warm-up and dumped for "
                                "pytorch.org/memory_viz", extra=ASSUMED_EXTRA_S["snapshot"]))
    search = train_estimate(0, "fp32", extra=ASSUMED_EXTRA_S["search"]) + train_estimate(6, "fp32")
    steps.append(command_check("batch-search", [
        sys.executable, "-m", "trainscope.experiments", "batch-sweep", "--config", "single_gpu", "--runs", "{out}",
        "--batch-sizes", "32", "--steps", "6", "--rounds", "1", "--search-from", "4096", "--", *MODEL],
        ASSUMED_SCRIPT_S + search, "the search's launch and its tries, then one 6-step run of batch 32 (one arm: "
        "nothing compared)", "a real CUDA out-of-memory error is caught, the allocator recovers between tries, and "
        "the search halves to the largest batch that fits"))
    # two GPUs: what one cannot show
    steps.append(training_check("ddp-compile", "ddp", [*MODEL, "--compile"], 50, "fp32",
                                "torch.compile under DDP over NCCL: compile time, recompiles, speed per GPU",
                                extra=ASSUMED_COMPILE_S))
    steps.append(training_check("ddp-communication-memory", "ddp",
                                [*MODEL, "--measure-communication", "on", "--memory-every", "1"], 40, "fp32",
                                "exposed communication over NCCL, measured on every step with CUDA events on the "
                                "compute stream, agrees with DDP's own logger on the same iterations; the one read of "
                                "DDP's buckets stays out of each GPU's peak memory (measurement_peak_allocated_gib)"))
    steps.append(training_check("ddp-fp16", "ddp_fp16", MODEL, 50, "fp16",
                                "DDP in fp16 over NCCL (accelerate_configs/ddp_fp16.yaml): the loss scaler's skipped "
                                "steps on every rank, speed per GPU"))
    steps += [training_check(f"ddp-comm-hook-{hook}", "ddp", [*MODEL, "--ddp-comm-hook", hook], 40, "fp32",
                             f"DDP's {hook} compression hook over NCCL: half the all-reduce bytes; exposed "
                             "communication against DDP's logger") for hook in ("fp16", "bf16")]
    steps.append(training_check("ddp-profile", "ddp", [*MODEL, "--profile"], 20, "fp32",
                                "torch.profiler under DDP over NCCL: the trace's exposed communication against DDP's "
                                "logger (comm_instruments_disagree)", extra=ASSUMED_EXTRA_S["profile"]))
    steps.append(training_check("fsdp2", "fsdp", MODEL, 50, "bf16",
                                "FSDP2 over NCCL (accelerate_configs/fsdp.yaml, bf16): each layer sharded, per-GPU "
                                "memory and speed"))
    # the comparisons: alternating rounds, at least bench.MIN_PAIRS each
    pairs = bench.MIN_PAIRS
    overhead_run = train_estimate(OVERHEAD_STEPS, "fp32")
    steps.append(command_check("overhead", [
        sys.executable, "-m", "trainscope.benchmarks.overhead", "--pairs", str(pairs), "--modes", "events",
        "--out", "{out}/overhead", *MODEL, "--max-steps", str(OVERHEAD_STEPS), "--timing-warmup-steps",
        str(OVERHEAD_WARMUP)], ASSUMED_SCRIPT_S + 2 * pairs * overhead_run,
        f"{pairs} pairs x 2 arms (bare, events) x {OVERHEAD_STEPS} fp32 steps of RoBERTa-base; sync and the "
        "memory statistics every step: make bench-overhead, not in the 10-minute plan",
        "--timing events costs at most 1% against a bare loop on one GPU (a steady window of about 4.5 s per "
        "run, assumed: 1% of it is 45 ms, far above the clock's resolution)"))
    points = 2 * len(LOADER_WORKERS) * pairs
    steps.append(command_check("loaders", [
        sys.executable, "loaders_bench.py", "--workers", *LOADER_WORKERS, "--repeats", str(pairs), "--modes",
        "device-copy", "in-training", "--max-train-samples", "4096", "--results-dir", "{out}"],
        ASSUMED_SCRIPT_S + points * ASSUMED_LOADER_POINT_S,
        f"{points} settings x repeats at {ASSUMED_LOADER_POINT_S:g} s", "where pinned memory and workers hide the "
        "copy to the device"))
    several = gpus > 1  # DataParallel's loop, and a second DDP process
    dp_round = ASSUMED_DP_LOOP_S * (2 if several else 1) + ASSUMED_LAUNCH_S + (ASSUMED_PROCESS_GROUP_S if several else 0)
    steps.append(command_check("compare-dp", [sys.executable, "compare_dp.py", "--rounds", str(pairs),
                                              "--results-dir", "{out}"], ASSUMED_SCRIPT_S + pairs * dp_round,
                               f"{pairs} rounds of the in-process loops and a DDP launch",
                               "each DDP worker binds its own GPU (NCCL); DataParallel needs two GPUs"))
    for step in steps:
        if "config" in step:
            verdict = launching.plan(step["config"], gpus)
            if not verdict.runnable:
                step["skipped"] = verdict.reason
    return steps


def planned_seconds(steps: list[dict]) -> float:
    """The plan's estimated total: the in-process scaler check and every check that is not skipped."""
    return ASSUMED_SCALER_S + sum(step["estimate_s"] for step in steps if not step.get("skipped"))


def device_slug(name: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


SCALER_CONFIRMS = "a CUDA GradScaler with the fused AdamW skips exactly the steps with planted inf gradients"


def scaler_check() -> dict:
    """fp16 on CUDA: a real GradScaler, the fused AdamW and planted inf gradients; the skips counted."""
    from trainscope.precision import planted_overflow_run

    planted = {3, 7, 11}
    try:
        skips, _ = planted_overflow_run(torch.device("cuda"), planted)
    except Exception as error:  # a broken CUDA path is a finding, not a reason to lose the other checks
        return {"planted": len(planted), "counted": None, "ok": False, "error": " ".join(str(error).split())}
    return {"planted": len(planted), "counted": skips.total(), "ok": skips.total() == len(planted)}


# ---------------------------------------------------------------- running the plan


def run_step(step: dict, scratch: Path, timeout: float | None = None) -> dict:
    """One check, launched with `timeout` (its process tree is killed past it): its exit and figures."""
    base = {"name": step["name"], "estimate_s": step.get("estimate_s"), "timeout_s": timeout}
    if step.get("skipped"):
        return {**base, "seconds": 0.0, "skipped": step["skipped"]}
    started = time.monotonic()
    if "command" in step:
        out = scratch / step["name"]
        result = launching.run_captured([part.replace("{out}", str(out)) for part in step["command"]],
                                        launching.training_env(), timeout)
        figures = {"exit": result.returncode, "output_tail": result.stdout[-2000:]}
        if result.returncode != 0:
            figures["error"] = launching.failure_reason(result)
        for path in out.glob("*.json") if out.exists() else []:  # results, not the records of the runs under it
            figures[path.stem] = json.loads(path.read_text())
    else:
        result = launching.run_training([*step["args"], "--output-dir", str(scratch), "--run-name", step["name"]],
                                        step["config"], echo=False, timeout=timeout)
        figures = {"exit": result.returncode}
        if result.returncode == 0:
            view = RunView(read_record(scratch / step["name"]))
            figures.update(throughput=view.throughput, mfu=view.mfu, memory=view.memory, compile=view.compile,
                           timing=view.summary.get("timing"), memory_snapshot=view.summary.get("memory_snapshot"),
                           communication=view.communication, precision=view.precision, warnings=view.warnings)
        else:
            figures["error"] = launching.failure_reason(result)
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


def execute(steps: list[dict], report: dict, write: Callable[[dict], None], budget_s: float,
            runner: Callable[[dict, float], dict], clock: Callable[[], float] = time.monotonic,
            started: float | None = None, before: Callable[[], dict] | None = None) -> dict:
    """Run the checks in order within `budget_s` seconds from `started`, calling `write(report)` after each.

    Before a check starts, one whose estimate does not fit in what is left is skipped ("over the budget");
    a check that runs gets min(its timeout, what is left) (`runner(step, timeout)` returns its result).
    `before` (the in-process scaler check) runs first. SIGINT or SIGTERM stops the checks: the report
    keeps what finished and says `interrupted`; Interrupted is raised again after it is written."""
    started = clock() if started is None else started
    report.update(status="running", budget_s=budget_s, checks=[], not_run=[step["name"] for step in steps])
    current = "scaler"
    try:
        with stop_on_signals():
            if before is not None:
                report["scaler"] = before()
                write(report)
            for step in steps:
                current = step["name"]
                left = budget_s - (clock() - started)
                if step.get("skipped"):
                    result = {"name": step["name"], "estimate_s": step["estimate_s"], "seconds": 0.0,
                              "skipped": step["skipped"]}
                elif step["estimate_s"] > left:
                    result = {"name": step["name"], "estimate_s": step["estimate_s"], "seconds": 0.0,
                              "skipped": f"over the budget (estimated {step['estimate_s']:.0f} s, "
                                         f"{max(left, 0):.0f} s of the {budget_s:.0f} s left)"}
                else:
                    result = runner(step, min(step["timeout_s"], left))
                report["checks"].append(result)
                report["not_run"].remove(step["name"])
                report["seconds"] = clock() - started
                write(report)
    except Interrupted as stop:
        report.update(status="interrupted", interrupted={"signal": str(stop), "during": current},
                      seconds=clock() - started)
        write(report)
        raise
    report.update(status="complete", seconds=clock() - started)
    write(report)
    return report


# ---------------------------------------------------------------- results


def verdicts(results: dict) -> dict:
    """The goals, from the measured figures (None where a check did not produce its figure)."""
    speed = lambda name: ((results.get(f"precision-{name}") or {}).get("throughput") or {}).get("samples_per_s")  # noqa: E731
    out = {}
    if speed("bf16") and speed("fp32") and speed("tf32"):
        out["bf16_over_fp32"] = speed("bf16") / speed("fp32")
        out["bf16_over_tf32"] = speed("bf16") / speed("tf32")
    events, sync = (results.get("precision-fp32") or {}).get("timing"), (results.get("timing-sync") or {}).get("timing")
    if events and sync:
        a, b = events["across_ranks"]["steady"]["seconds"], sync["across_ranks"]["steady"]["seconds"]
        out["timing_agreement"] = max(abs(a[s]["median"] - b[s]["median"]) / max(b[s]["median"], 1e-9)
                                      for s in ("forward", "backward", "optimizer"))
    out["compiled_bf16_mfu"] = (results.get("compile-bf16") or {}).get("mfu")
    return out


def outcome(result: dict) -> str:
    if result.get("skipped"):
        return f"skipped: {result['skipped']}"
    if result.get("exit", 0) != 0:
        return f"failed: {result.get('error', 'see JSON')}"
    if result.get("throughput") and result.get("throughput", {}).get("samples_per_s") is not None:
        throughput = result["throughput"]
        text = (f"{throughput['samples_per_s']:.1f} samples/s, {throughput.get('tokens_per_s') or 0:.0f} tokens/s, "
                + (f"MFU {result['mfu']:.1%}" if result.get("mfu") is not None else "MFU unknown"))
        compiled = result.get("compile")
        if compiled:
            text += (f"; compile {compiled.get('compile_s') or 0:.0f} s, dynamic shapes "
                     f"{'yes' if compiled.get('dynamic') else 'no'}, {compiled.get('recompiles')} recompiles")
        return text
    return "ok"


def markdown(report: dict) -> list[str]:
    status = report.get("status", "complete")
    if status == "interrupted":
        stop = report["interrupted"]
        status = f"interrupted by {stop['signal']} during {stop['during']}: what finished before is kept"
    elif status == "running":
        status = f"running: {len(report['checks'])} of {len(report['plan'])} checks done"
    lines = [f"# GPU check: {report['device']}", "", f"Status: {status}.", "",
             f"Driver {report['driver']}, torch {torch.__version__}, CUDA {torch.version.cuda}, {report['gpus']} GPU(s); "
             f"{report.get('seconds', 0):.0f} s of the {report['budget_s']:.0f} s budget. Estimates are from assumed "
             "step and launch times (trainscope/gpu_check.py ASSUMED_*), not measured.", "",
             "| check | estimate s | timeout s | seconds | outcome |", "|---|---:|---:|---:|---|"]
    for r in report["checks"]:
        timeout = f"{r['timeout_s']:.0f}" if r.get("timeout_s") else ""
        lines.append(f"| {r['name']} | {r.get('estimate_s') or 0:.0f} | {timeout} | {r['seconds']:.0f} | {outcome(r)} |")
    lines += [f"| {name} | | | | not run ({'interrupted' if report.get('status') == 'interrupted' else 'pending'}) |"
              for name in report.get("not_run", [])]
    scaler = report.get("scaler")
    if scaler:
        lines += ["", f"fp16 skipped steps: planted {scaler['planted']}, counted {scaler['counted']}"
                  + (f" ({scaler['error']})" if scaler.get("error") else "") + "."]
    skipped = [r for r in report["checks"] if r.get("skipped")]
    if skipped:
        lines += ["", "Skipped: " + "; ".join(f"{r['name']} ({r['skipped']})" for r in skipped) + "."]
    lines.append("")
    for goal, target in GOALS.items():
        value = report.get("verdicts", {}).get(goal)
        lines.append(f"- {goal}: " + ("not measured" if value is None else f"{value:.3f} (goal {target})"))
    lines += ["", "What these runs confirm that a CPU cannot:", f"- scaler: {SCALER_CONFIRMS}"]
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


def cuda_torch_command(smi_output: str | None, torch_version: str = torch.__version__,
                       torch_cuda: str | None = torch.version.cuda, environ=None) -> str | None:
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
        return (f"the NVIDIA driver answers (nvidia-smi: {driver}) but torch {torch_version} (built for CUDA "
                f"{torch_cuda}) cannot use the GPU: check CUDA_VISIBLE_DEVICES and the GPU's device files "
                "(/dev/nvidia*) in this container")
    tag = cuda_wheel_tag(driver_cuda) if driver_cuda else None
    advice = ""
    if tag is None:
        (major, minor), tag = TORCH_CUDA_BUILDS[0], "cu{}{}".format(*TORCH_CUDA_BUILDS[0])
        advice = f"update the NVIDIA driver to one of CUDA {major}.{minor} or later, then "
    what = "is a CPU-only build" if built_for is None else f"is built for CUDA {torch_cuda}, newer than the driver"
    return (f"the NVIDIA driver answers (nvidia-smi: {driver}) but torch {torch_version} {what}: {advice}install "
            f"the CUDA build: {python_shown()} -m pip install torch=={torch_version.split('+')[0]}+{tag} "
            f"--index-url https://download.pytorch.org/whl/{tag}")


def print_plan(steps: list[dict], gpus: int, budget_s: float) -> None:
    for step in steps:
        command = " ".join(step.get("command") or launching.train_command(step["args"], step["config"]))
        if step.get("skipped"):
            print(f"{step['name']}: skipped ({step['skipped']})")
        else:
            print(f"{step['name']} (estimate {step['estimate_s']:.0f} s: {step['estimate']}; timeout "
                  f"{step['timeout_s']:.0f} s): {command}")
        print(f"    confirms: {step['confirms']}")
    print(f"scaler (in this process, estimate {ASSUMED_SCALER_S:.0f} s): fp16 loss scaling with planted inf "
          f"gradients\n    confirms: {SCALER_CONFIRMS}")
    total, left, over = planned_seconds(steps), budget_s - ASSUMED_SCALER_S, []
    for step in steps:
        if step.get("skipped"):
            continue
        if step["estimate_s"] > left:
            over.append(step["name"])
        else:
            left -= step["estimate_s"]
    print(f"total estimated for {gpus} GPU{'s' if gpus > 1 else ''}: {total:.0f} s ({total / 60:.1f} min) against a "
          f"budget of {budget_s:.0f} s; estimates from assumed launch and step times on one H100, not measured on GPU")
    if over:
        print(f"over the budget by these estimates (skipped when run): {', '.join(over)}; --budget "
              f"{total + 30:.0f} would hold them all")


def parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "gpu"), help="results folder (default benchmarks/gpu)")
    parser.add_argument("--budget", type=float, default=DEFAULT_BUDGET_S,
                        help=f"seconds for all the checks (default {DEFAULT_BUDGET_S:.0f}: one H100 within 10 "
                        "minutes); a check whose estimate does not fit in what is left is skipped, and no launch runs past it")
    parser.add_argument("--dry-run", action="store_true",
                        help="print the checks, their commands, estimates and timeouts, and the total; run nothing")
    parser.add_argument("--gpus", type=int, default=None,
                        help="with --dry-run: plan for this many GPUs (default: the GPUs present, or one)")
    parser.add_argument("--torch-check", action="store_true", help=argparse.SUPPRESS)  # make setup's check
    return parser


def main(argv=None) -> None:
    args = parser().parse_args(argv)
    if args.budget <= 0:
        parser().error("--budget must be positive")
    if args.gpus is not None and (not args.dry_run or args.gpus < 1):
        parser().error("--gpus plans for that many GPUs (at least 1) with --dry-run; a real check uses the GPUs "
                       "present")
    if args.torch_check:  # make setup: a warning, since CPU work still runs with this torch
        missing = cuda_torch_command(nvidia_smi())
        if missing:
            print(f"warning: {missing} (make gpu-check refuses to run until then)", file=sys.stderr)
        return
    if args.dry_run:
        gpus = args.gpus or launching.cuda_devices() or 1
        if args.gpus is None and not launching.cuda_devices():
            print("no CUDA device here: planned as for one GPU (--gpus N plans for N)")
        print_plan(plan(gpus), gpus, args.budget)
        return
    started = time.monotonic()
    if not torch.cuda.is_available():
        missing = cuda_torch_command(nvidia_smi())
        if missing:
            exit_with(UserError(missing), code=1)
        print(f"gpu-check: no usable CUDA device for this torch ({torch.__version__}): nothing measured, nothing written")
        return
    name, gpus = torch.cuda.get_device_name(0), launching.cuda_devices()
    steps = plan(gpus)
    stem = Path(args.out) / device_slug(name)
    report = {"benchmark": "gpu_check", "benchmark_version": 2, "device": name, "driver": driver_version(),
              "gpus": gpus, "plan": steps, "assumed": {"launch_s": ASSUMED_LAUNCH_S, "step_s": ASSUMED_STEP_S,
                                         "compile_s": ASSUMED_COMPILE_S, "planned_s": planned_seconds(steps)}}

    shown = []

    def write(current: dict) -> None:
        current["verdicts"] = verdicts({c["name"]: c for c in current["checks"]})
        bench.write_results(stem, current, markdown(current))
        for check in current["checks"][len(shown):]:  # what finished since the last write, as the file says it
            print(f"  {check['name']}: {outcome(check)} ({check['seconds']:.0f} s)", flush=True)
            shown.append(check["name"])

    print(f"gpu-check: {len(steps)} checks on {gpus} x {name}, budget {args.budget:.0f} s; results after every check "
          f"in {stem}.md", flush=True)
    with tempfile.TemporaryDirectory() as scratch:
        def runner(step: dict, timeout: float) -> dict:
            print(f"{step['name']} (estimate {step['estimate_s']:.0f} s, timeout {timeout:.0f} s)", flush=True)
            return run_step(step, Path(scratch), timeout)

        try:
            execute(steps, report, write, args.budget, runner, started=started, before=scaler_check)
        except Interrupted as stop:
            done = len([c for c in report["checks"] if not c.get("skipped")])
            exit_with(UserError(f"{stop} during {report['interrupted']['during']}, which was stopped (its launch "
                                f"killed); the {done} checks that finished are in {stem}.json and .md"),
                      code=128 + stop.signum)
    failed = [c["name"] for c in report["checks"] if not c.get("skipped") and c.get("exit", 0) != 0]
    print(f"wrote {stem}.json and {stem}.md")
    if failed or not report["scaler"].get("ok"):
        exit_with(UserError(f"{', '.join(failed + ([] if report['scaler'].get('ok') else ['scaler']))} failed: "
                            f"see {stem}.md"), code=1)


if __name__ == "__main__":
    main()
