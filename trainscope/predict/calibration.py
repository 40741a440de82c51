"""The predictor's fitted terms, once per machine: the allocator's share of a CPU process's peak RSS and the
framework's own time, fitted on short training runs whose predictions are made uncalibrated (trainscope.predict).

How it works: docs/predict.md#in-the-code-how-the-predictor-is-calibrated-trainscopepredictcalibrationpy.
"""

import argparse
import contextlib
import functools
import itertools
import json
import math
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch

from trainscope.core import launching
from trainscope.core.errors import one_line
from trainscope.core.launching import split_args, train_in_this_process
from trainscope.core.paths import GIB, cache_dir
from trainscope.core.record_view import RunView
from trainscope.core.records import now_iso, read_record, write_json_atomic
from trainscope.measure import peak
from trainscope.predict.kept import BUSY_CORES, NotKept, contradictions, cpu_seconds

SWITCH_ENV = "TRAINSCOPE_CALIBRATION"  # "off": no calibration on first use
FIRST_USE_BUDGET_S = 60.0
CALIBRATION_VERSION = 3  # in the key: bump when what a calibration means changes


def calibration_key(device: torch.device) -> dict:
    """The machine, without threads and processes: the allocator's behaviour is a process's own."""
    key = peak.machine_key(device, threads=1, processes=1)
    return {**{k: v for k, v in key.items() if k not in ("threads", "processes")}, "version": CALIBRATION_VERSION}


def calibration_path(device: torch.device) -> Path:
    return cache_dir() / "predict" / f"calibration-{peak.key_id(calibration_key(device))}.json"


def read_calibration(device: torch.device) -> dict:
    return peak.read_keyed(calibration_path(device), calibration_key(device))


def fit_allocator(points: list[tuple[float, float]]) -> dict:
    """Least squares of a CPU process's memory beyond the tensors it holds (peak RSS less the RSS before the model,
    the parameters and the step's live peak) on that live peak: share = factor x live + constant. `points` are
    (live bytes, beyond bytes) of calibration runs."""
    xs, ys = np.array([p[0] for p in points], float), np.array([p[1] for p in points], float)
    if len(points) >= 2 and np.ptp(xs) > 0:
        factor, constant = np.polyfit(xs, ys, 1)
    else:
        factor, constant = 0.0, float(ys.mean()) if len(points) else 0.0
    residuals = ys - (factor * xs + constant)
    return {
        "factor": float(factor),
        "constant_bytes": float(constant),
        "runs": len(points),
        "residual_bytes": float(np.abs(residuals).max()) if len(points) else None,
    }


# ---------------------------------------------------------------- the runs it is fitted on

# Short runs of shapes unlike the predict-check's (trainscope/experiments/prediction.py): the allocator's share is
# fitted on these, and judged on those. The 2-process run also measures this machine's all-reduce for later DDP
# predictions (remember_communication). name -> (config, train.py flags); a config this machine cannot run is skipped.
CALIBRATION_SHAPES = {
    "bs8": ("cpu", ["--per-device-batch-size", "8"]),
    "bs24": ("cpu", ["--per-device-batch-size", "24"]),
    "bs48-len64": ("cpu", ["--per-device-batch-size", "48", "--max-seq-length", "64"]),
    "bs24-ckpt": ("cpu", ["--per-device-batch-size", "24", "--gradient-checkpointing"]),
    "tiny-bs64": ("cpu", ["--model", "embedded:tiny-bert", "--per-device-batch-size", "64"]),
    "ddp-bs8": ("ddp", ["--per-device-batch-size", "8"]),
}
CALIBRATION_ARGS = (
    "--max-train-samples 1000 --max-eval-samples 96 --max-test-samples 96 --max-steps 10 --log-every 10 --report-to none"
).split()


def allocator_point(record: dict) -> tuple[float, float] | None:
    """(live bytes, bytes beyond the tensors) of one complete CPU run: its peak RSS less the RSS before the model,
    the parameters and the step's live peak, all as its prediction had them."""

    view = RunView(record)
    block = view.prediction
    peak_gib, kind = view.peak_memory
    if block is None or peak_gib is None or kind != "peak RSS":
        return None
    gib = block["memory"]["terms_gib"]
    live = block["memory"]["live_gib"]
    return live * GIB, (peak_gib - gib["baseline"] - gib["parameters"] - live) * GIB


def time_point(record: dict) -> dict | None:
    """What one complete single-process run tells of the framework's own costs: its measured steady step and
    evaluation less their (uncalibrated) predictions, beside the predicted time of the operators other than matrix
    products and the operators dispatched. None for a calibrated prediction or several processes (DDP's wait)."""

    view = RunView(record)
    block = view.prediction
    if block is None or not view.step_s or block["time"].get("calibration") or view.world_size > 1:
        return None
    timing = block["time"]
    return {
        "step_s": view.step_s,
        "step_residual_s": view.step_s - timing["step_s"],
        "step_operator_s": timing["kinds_s"]["operator"],
        "step_dispatches": timing["dispatches"]["step"],
        "evaluation_residual_s": view.eval_s - timing["evaluation_s"],
        "evaluation_passes": timing["evaluation_passes"],
        "evaluation_operator_s": timing["evaluation_operator_s"],
        "evaluation_dispatches": timing["dispatches"]["evaluation"],
    }


def _bounded_least_squares(columns: np.ndarray, target: np.ndarray, lower: list, upper: list) -> np.ndarray:
    """min |columns x - target| with lower <= x <= upper, by trying each set of coefficients held at a bound (a
    handful of coefficients: every combination is cheap)."""
    best, best_cost = np.zeros(columns.shape[1]), math.inf
    for held in itertools.product(*[(None, lo, hi) for lo, hi in zip(lower, upper)]):
        if any(h is not None and not math.isfinite(h) for h in held):
            continue
        free = [i for i, h in enumerate(held) if h is None]
        fixed = [i for i, h in enumerate(held) if h is not None]
        x = np.array([0.0 if h is None else h for h in held], float)
        if free:
            x[free] = np.linalg.lstsq(columns[:, free], target - columns[:, fixed] @ x[fixed], rcond=None)[0]
        if all(lo - 1e-12 <= v <= hi + 1e-12 for v, lo, hi in zip(x, lower, upper)):
            cost = float(np.sum((columns @ x - target) ** 2))
            if cost < best_cost:
                best, best_cost = x, cost
    return best


# The framework's time, fitted within: the operators' factor less 1, seconds per operator dispatched, per step.
TIME_LOWER, TIME_UPPER = [-0.5, 0.0, 0.0], [1.0, 1e-3, 1.0]
# Fewer calibration runs than this (a first-use calibration its budget cut short): only the per-step constant is
# fitted, the operators' factor and the cost per dispatch are not (held at 1 and 0).
MIN_TIME_POINTS = 3


def _at_bound(name: str, value: float, low: float, high: float) -> str | None:
    if math.isclose(value, low, abs_tol=1e-12):
        return f"{name} at its lower bound {low:g}"
    if math.isclose(value, high, abs_tol=1e-12):
        return f"{name} at its upper bound {high:g}"
    return None


def _fit_few(residual: np.ndarray) -> tuple[tuple, list, list]:
    """From fewer than MIN_TIME_POINTS runs: ((0, 0, the median residual, at least 0), at_bound, not_fitted)."""
    shapes = f"{len(residual)} shape{'s' if len(residual) != 1 else ''}"
    wanted = float(np.median(residual)) if len(residual) else 0.0
    at_bound = [
        f"step_s at its lower bound 0 (fitted from {shapes}: their median residual {wanted * 1e3:+.1f} ms a step "
        "wanted below it; make predict-calibrate for a full fit)"
    ] if wanted < 0 else []  # fmt: skip
    held = f"not fitted (from {shapes}, {MIN_TIME_POINTS} needed): held at"
    not_fitted = [
        f"operator_factor {held} 1, the operators as timed alone",
        f"dispatch_s {held} 0, nothing per operator dispatched",
    ]
    return (0.0, 0.0, max(0.0, wanted)), at_bound, not_fitted


def fit_time(points: list[dict]) -> dict:
    """The framework's own costs as this machine shows them, from the calibration runs: a step's residual (measured
    less predicted) = a x its non-matmul operators' time + d x the operators it dispatches + c, fitted on relative
    residuals (each run's row over its measured step: the prediction is judged by its relative error), with
    -0.5 <= a <= 1 and d, c at least 0: a training step's operators scale by 1 + a (inside a step their inputs are
    colder than when timed alone), each dispatch costs d, each step c more (the loop). Each evaluation pass costs
    the median of what its residual leaves after its dispatches, at least 0. From fewer than MIN_TIME_POINTS runs
    only c (`not_fitted`); a term the fit held at a bound is in `at_bound` (docs/predict.md)."""
    columns = np.array([[p["step_operator_s"], p["step_dispatches"], 1.0] for p in points], float)
    residual = np.array([p["step_residual_s"] for p in points], float)
    weights = np.array([1.0 / p["step_s"] for p in points], float)
    at_bound, not_fitted = [], []
    if len(points) < MIN_TIME_POINTS:
        (slope, dispatch, constant), at_bound, not_fitted = _fit_few(residual)
    else:
        slope, dispatch, constant = _bounded_least_squares(
            columns * weights[:, None], residual * weights, TIME_LOWER, TIME_UPPER
        )
        bounds = {
            "operator_factor": (1 + slope, 1 + TIME_LOWER[0], 1 + TIME_UPPER[0]),
            "dispatch_s": (dispatch, TIME_LOWER[1], TIME_UPPER[1]),
            "step_s": (constant, TIME_LOWER[2], TIME_UPPER[2]),
        }
        at_bound = [held for name, limits in bounds.items() if (held := _at_bound(name, *limits))]
    passes = [
        (p["evaluation_residual_s"] - dispatch * p["evaluation_dispatches"]) / p["evaluation_passes"]
        for p in points
        if p["evaluation_passes"]
    ]
    per_pass = statistics.median(passes) if passes else 0.0
    if per_pass < 0:
        at_bound.append(
            f"evaluation_pass_s at its lower bound 0 (the median pass's residual {per_pass * 1e3:+.1f} ms wanted "
            "below it)"
        )
    fitted = columns @ np.array([slope, dispatch, constant])
    return {
        "operator_factor": float(1 + slope),
        "dispatch_s": float(dispatch),
        "step_s": float(constant),
        "evaluation_pass_s": float(max(0.0, per_pass)),
        "runs": len(points),
        "residual_s": float(np.abs(residual - fitted).max()) if len(points) else None,
        "at_bound": at_bound,
        "not_fitted": not_fitted,
    }


def fit(records: dict, method: str, seconds: float) -> dict:
    """The calibration of this machine from the records of uncalibrated runs ({name: record}), as stored."""
    points, timings = {}, {}
    for name, record in records.items():
        timing, point = time_point(record), allocator_point(record)
        if timing is not None:
            timings[name] = timing
        if point is not None:
            points[name] = point
    return {
        "key": calibration_key(_device_of(records)),
        "measured": now_iso(),
        "method": method,
        "seconds": seconds,
        "shapes": list(records),
        "allocator": {**fit_allocator(list(points.values())), "calibrated": True} if points else None,
        "time": fit_time(list(timings.values())) if timings else None,
        "points": {
            "allocator": {k: [v[0] / GIB, v[1] / GIB] for k, v in points.items()},
            "time": {k: v["step_residual_s"] / v["step_s"] for k, v in timings.items()},
        },
    }


def _forget(device: torch.device) -> None:
    for each in {device, torch.device("cpu")}:
        calibration_path(each).unlink(missing_ok=True)
        _failure_path(each).unlink(missing_ok=True)


def calibrate(runs: Path, train_args: list[str]) -> dict:
    """Run the calibration shapes (uncalibrated: an earlier calibration is removed first), fit the allocator's share
    and the loop's own costs on their records, and store them for this machine."""

    started = time.perf_counter()
    _forget(torch.device("cuda" if torch.cuda.is_available() else "cpu"))
    records = {}
    for name, (config, flags) in CALIBRATION_SHAPES.items():
        plan = launching.plan(config)
        if not plan.runnable:
            print(f"skipped {name}: {plan.reason}", flush=True)
            continue
        result = launching.run_training(
            [*CALIBRATION_ARGS, *flags, *train_args, "--output-dir", str(runs), "--run-name", name, "--overwrite"],
            config=config,
            env=launching.training_env(plan.on_cpu, {SWITCH_ENV: "off"}),
        )
        if result.returncode != 0:
            raise RuntimeError(f"calibration run {name} failed: {launching.failure_reason(result)}")
        records[name] = read_record(runs / name)
        _say(name, records[name])
    if not records:
        raise RuntimeError("no calibration shape can run here")
    if contradicting := contradictions(records):
        raise NotKept(f"its runs contradict each other ({'; '.join(contradicting)}): not stored; calibrate again")
    fitted = fit(
        records,
        f"full: {len(records)} train.py runs (python -m trainscope.predict --calibrate)",
        time.perf_counter() - started,
    )
    write_json_atomic(calibration_path(_device_of(records)), fitted)
    return fitted


def _device_of(records: dict) -> torch.device:
    return torch.device(next(iter(records.values()))["environment"]["device"].split(":")[0])


def _say(name: str, record: dict) -> None:
    timing, point = time_point(record), allocator_point(record)
    if point is not None:
        step = (
            f"step {timing['step_residual_s']:+.4f} s off"
            if timing
            else "step time not fitted (several processes: the framework's time is fitted on one)"
        )
        print(f"{name}: live {point[0] / GIB:.3f} GiB, beyond the tensors {point[1] / GIB:.3f} GiB; {step}", flush=True)


# ---------------------------------------------------------------- on first use

# Short single-process runs in one worker process, each a train.py run of a few steps: two batches of the default
# model (the allocator's share grows with what lives), its checkpointed step (more operators dispatched per second of
# work), and the tiny model (the framework's time alone). Cheapest and most telling first: the budget may end them.
QUICK_SHAPES = {
    "tiny-bs64": ["--model", "embedded:tiny-bert", "--per-device-batch-size", "64"],
    "bs8": ["--per-device-batch-size", "8"],
    "bs24": ["--per-device-batch-size", "24"],
    "bs16-ckpt": ["--per-device-batch-size", "16", "--gradient-checkpointing"],
}
QUICK_ARGS = (
    "--max-train-samples 400 --max-eval-samples 32 --max-test-samples 32 --max-steps 5 --log-every 5 "
    "--timing-warmup-steps 2 --report-to none --threads auto"
).split()


def _lock(path: Path):
    """An exclusive lock on `path` (other processes block until it is released); a no-op where fcntl is missing."""
    try:
        import fcntl
    except ImportError:
        return contextlib.nullcontext()

    @contextlib.contextmanager
    def held():
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "a") as handle:
            fcntl.flock(handle, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(handle, fcntl.LOCK_UN)

    return held()


def cached(device: torch.device) -> dict:
    """This machine's cached calibration, or `{error}` saying how to make one (a training run makes none: its
    prediction is then uncalibrated)."""
    return read_calibration(device) or {
        "error": "not calibrated on this machine: a training run does not calibrate; train.py --predict does on "
        "first use (a minute, cached), make predict-calibrate in full"
    }


def ensure(device: torch.device, budget_s: float | None = None, shapes: dict | None = None) -> dict:
    """This machine's calibration: the cached one, else one made now (`first_use`, marked `made_now`) and cached;
    `{error}` where switched off or not made (a failure is remembered for RETRY_AFTER_S). One process of a launch
    calibrates, the others wait and read."""
    found = read_calibration(device)
    if found:
        return found
    if os.environ.get(SWITCH_ENV, "").lower() in ("off", "0", "false", "no"):
        return {"error": f"switched off ({SWITCH_ENV}=off)"}
    with _lock(calibration_path(device).with_suffix(".lock")):
        found = read_calibration(device) or _recent_failure(device)
        if found:
            return found
        try:
            return first_use(device, budget_s, shapes)
        except NotKept as refused:  # the next run tries again: the machine may be quiet then
            return {"error": f"the first-use calibration was refused ({refused}); make predict-calibrate makes one"}
        except (RuntimeError, OSError, subprocess.SubprocessError, ValueError) as error:
            failed = {
                "error": f"the first-use calibration failed ({one_line(error)}); make predict-calibrate makes it",
                "at": time.time(),
            }
            write_json_atomic(_failure_path(device), failed)
            return failed


RETRY_AFTER_S = 24 * 3600


def _failure_path(device: torch.device) -> Path:
    return calibration_path(device).with_suffix(".failed.json")


def _recent_failure(device: torch.device) -> dict:
    try:
        failed = json.loads(_failure_path(device).read_text())
        return failed if time.time() - failed["at"] < RETRY_AFTER_S else {}
    except (OSError, ValueError, KeyError, TypeError):
        return {}


def first_use(device: torch.device, budget_s: float | None = None, shapes: dict | None = None) -> dict:
    """QUICK_SHAPES (or `shapes`) run in one worker process within `budget_s` seconds (FIRST_USE_BUDGET_S), fitted
    and cached."""
    shapes = QUICK_SHAPES if shapes is None else shapes
    budget_s = budget_s or FIRST_USE_BUDGET_S
    started = time.perf_counter()
    say = functools.partial(print, file=sys.stderr, flush=True)
    say(f"calibrating the predictor on this machine (first use, at most {budget_s:.0f} s; cached)")
    records, others = _quick_runs(device, shapes, budget_s)
    if not records:
        raise RuntimeError(f"the first-use calibration finished no run within {budget_s:.0f} s")
    if contradicting := contradictions(records):
        raise NotKept(f"its runs contradict each other: {'; '.join(contradicting)}")
    seconds = time.perf_counter() - started
    left_out = [name for name in shapes if name not in records]
    fitted = fit(
        records,
        f"first use: {len(records)} short run{'s' if len(records) > 1 else ''} in one process"
        + (f" ({', '.join(left_out)} left out: the {budget_s:.0f} s budget)" if left_out else ""),
        seconds,
    )
    fitted["others_cores"] = others
    if others is not None and others > BUSY_CORES:
        busy = f"other processes kept {others:.2f} cores busy while it ran: kept for this run only"
        say(f"calibrated in {seconds:.0f} s, not cached ({busy})")
        return {**fitted, "made_now": True, "not_cached": busy}
    write_json_atomic(calibration_path(_device_of(records)), fitted)
    _failure_path(device).unlink(missing_ok=True)
    say(f"calibrated in {seconds:.0f} s: {calibration_path(_device_of(records))}")
    return {**fitted, "made_now": True}


# What a launcher set that the worker, one process of its own in fp32, must not inherit.
LAUNCH_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
              "ACCELERATE_MIXED_PRECISION")  # fmt: skip


def _quick_runs(device: torch.device, shapes: dict, budget_s: float) -> tuple[dict, float | None]:
    """The shapes' complete records, run by one worker process that starts no shape it would not finish within
    `budget_s` (and is killed at it), and the cores other processes kept busy meanwhile."""
    import tempfile

    with tempfile.TemporaryDirectory(prefix="trainscope-calibration-") as folder:
        runs = Path(folder)
        (runs / "shapes.json").write_text(json.dumps(shapes))
        deadline = time.time() + budget_s
        command = [sys.executable, "-m", "trainscope.predict.calibration", "--worker", str(runs), "--deadline",
                   str(deadline)]  # fmt: skip
        env = {**os.environ, SWITCH_ENV: "off", **({"ACCELERATE_USE_CPU": "1"} if device.type == "cpu" else {})}
        for name in LAUNCH_ENV:
            env.pop(name, None)
        before = cpu_seconds()
        with contextlib.suppress(subprocess.TimeoutExpired):  # killed at the budget: what finished in time is fitted
            subprocess.run(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                           timeout=max(1.0, deadline - time.time()), check=False)  # fmt: skip
        others = peak.other_cores(before, cpu_seconds())  # the worker's CPU is its children's, this process's own
        records = {name: read_record(runs / name) for name in shapes if (runs / name / "record.json").exists()}
    return {name: r for name, r in records.items() if r.get("status") == "complete"}, others


def _reset_peak_rss() -> None:
    """Start the process's peak RSS again from what it holds now (Linux: /proc/self/clear_refs), after giving freed
    heap back: each run's peak is its own, as in a process of its own."""
    import ctypes
    import gc

    gc.collect()
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    with contextlib.suppress(OSError):
        Path("/proc/self/clear_refs").write_text("5")


def worker(runs: Path, deadline: float) -> None:
    """The shapes of `runs`/shapes.json as train.py runs in this process, one after the other, until the deadline
    (time.time()): a shape is started only where the slowest so far would still finish by then."""

    shapes = json.loads((runs / "shapes.json").read_text())
    slowest = 0.0
    for name, flags in shapes.items():
        if time.time() + slowest > deadline:
            break
        began = time.perf_counter()
        _reset_peak_rss()
        train_in_this_process([*QUICK_ARGS, *flags, "--output-dir", str(runs), "--run-name", name, "--overwrite"])
        slowest = max(slowest, time.perf_counter() - began)


def main(argv=None) -> None:
    import tempfile

    ours, train_args = split_args(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(
        prog="python -m trainscope.predict",
        description="Calibrate the predictor's fitted terms on this machine -- the allocator's share of a CPU "
        "process's peak RSS, the framework's own time (per operator dispatched, per step, per evaluation pass, a "
        "factor on the non-matmul operators) -- from short train.py runs of six shapes, uncalibrated (a few minutes "
        "on 2 cores); the 2-process one also measures DDP's all-reduce. Flags after -- go to every run. Without it, a "
        "prediction on an uncalibrated machine calibrates it on first use (four shorter runs, at most a minute). "
        "Predictions themselves: python train.py --predict [flags].",
    )
    parser.add_argument("--calibrate", action="store_true", help="run the full calibration")
    parser.add_argument("--first-use", action="store_true", help="run the first-use calibration now (forgetting any)")
    parser.add_argument("--runs", default=None, help="keep the calibration runs here (default: a temporary folder)")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--deadline", type=float, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(ours)
    if args.worker:
        return worker(Path(args.worker), args.deadline or time.time() + FIRST_USE_BUDGET_S)
    if not (args.calibrate or args.first_use):
        parser.error("--calibrate or --first-use")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    with contextlib.ExitStack() as stack:
        runs = Path(args.runs) if args.runs else Path(stack.enter_context(tempfile.TemporaryDirectory()))
        try:
            if args.first_use:
                _forget(device)
                fitted = first_use(device)
            else:
                fitted = calibrate(runs, train_args)
        except RuntimeError as error:
            print(f"error: {error}", file=sys.stderr)
            sys.exit(1)
    print("\n".join(summary_lines(fitted)))
    print(f"stored in {calibration_path(device)}")


def summary_lines(fitted: dict) -> list[str]:
    allocator, timing = fitted.get("allocator"), fitted.get("time")
    lines = [f"calibration: {fitted.get('method', 'full')}, {fitted.get('seconds') or 0:.0f} s"]
    if allocator:
        lines.append(
            f"allocator's share: {allocator['factor']:.3f} x live + {allocator['constant_bytes'] / GIB:.3f} GiB "
            f"over {allocator['runs']} runs (largest residual {allocator['residual_bytes'] / GIB:.3f} GiB)"
        )
    if timing:
        lines.append(
            f"the framework's own costs: operators x{timing['operator_factor']:.3f}, "
            f"{timing['dispatch_s'] * 1e6:.1f} us per operator dispatched, {timing['step_s'] * 1e3:.1f} ms per "
            f"step, {timing['evaluation_pass_s'] * 1e3:.1f} ms per evaluation pass over {timing['runs']} runs"
        )
        lines += [f"warning: {bound} (the fit wanted beyond it)" for bound in timing.get("at_bound") or []]
        lines += [f"warning: {term}; make predict-calibrate for a full fit" for term in timing.get("not_fitted") or []]
    return lines


if __name__ == "__main__":
    main()
