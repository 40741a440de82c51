"""The prediction itself: the block a run records (docs/RECORD.md `prediction`) -- the run's batches, its step traced
and costed, the time and memory models, the calibration it used and what each figure rests on -- made before the
run without moving its random state, and never failing it."""

import contextlib
import os
import time

import torch

from trainscope.core import environment
from trainscope.core.errors import one_line
from trainscope.core.records import now_iso
from trainscope.predict import calibration, op_costs, trace
from trainscope.predict.memory_model import peak_memory
from trainscope.predict.planned import Batches, PlannedRun, planned_run_for, run_batches
from trainscope.predict.step import VERSION, model_dims, traced_length, traced_step
from trainscope.predict.time_model import predict_time


@contextlib.contextmanager
def _random_state_kept():
    """Predicting never moves the run's random state (CPU and CUDA generators), whatever it builds or times."""
    cpu = torch.get_rng_state()
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
    try:
        yield
    finally:
        torch.set_rng_state(cpu)
        if cuda is not None:
            torch.cuda.set_rng_state_all(cuda)


@_random_state_kept()
def predict(planned: PlannedRun, store: bool = True, fitted: dict | None = None) -> dict:
    """The prediction block (docs/RECORD.md `prediction`), with this machine's calibration (made now on first use,
    trainscope.predict.calibration.ensure) or the one given (`fitted`: {} for none)."""
    started = time.perf_counter()
    device = planned.device
    # before the costs are read: a first-use calibration times and caches costs of its own
    fitted = calibration.ensure(device) if fitted is None else fitted
    costs = op_costs.OpCosts(device, planned.threads, planned.local_processes, store=store)
    notes = []
    batches = run_batches(planned)
    traced, evaluated = traced_steps(planned, batches, costs)
    time_block = predict_time(planned, batches, traced, evaluated, costs, notes, fitted.get("time") or {})
    memory_block = peak_memory(planned, traced, batches.longest, notes, fitted.get("allocator"))
    costs.save()
    notes += _left_out(planned, costs)
    return {
        "version": VERSION,
        "made": now_iso(),
        "seconds": time.perf_counter() - started,
        "calibration": calibration_state(fitted, device),
        "sources": sources(memory_block, time_block),
        "machine": {
            "device": str(device),
            "device_name": environment.device_name(device),
            "precision": planned.precision,
            "threads": planned.threads,
            "processes": planned.processes,
            "cost_cache": str(costs.path),
            "timed_now": costs.measured,
        },
        "batches": _batches_block(planned, batches, traced.length),
        "memory": memory_block,
        "time": time_block,
        "notes": notes,
    }


def traced_steps(planned: PlannedRun, batches: Batches, costs) -> tuple[trace.Trace, trace.Trace]:
    """The training step traced at the run's batch and a length near its steady batches' mean, and the evaluation
    batch near its batches' mean (traced_length: a length that is no other size of the model)."""
    from trainscope.workload import modeling  # deferred: it loads transformers' models

    settings = planned.settings
    config = modeling.model_config(settings, planned.label_names)
    eval_batch = settings.resolved_eval_batch_size
    avoid = model_dims(config, settings.per_device_batch_size, eval_batch, len(planned.label_names))
    positions = modeling.config_positions(config)
    length = traced_length(float(batches.steady.mean()), settings.per_device_batch_size, avoid, positions)
    traced = traced_step("train", planned, settings.per_device_batch_size, length, avoid, costs)
    eval_all = batches.eval_lengths
    eval_length = traced_length(float(eval_all.mean()) if len(eval_all) else length, eval_batch, avoid, positions)
    return traced, traced_step("eval", planned, eval_batch, eval_length, avoid, costs)


def _left_out(planned: PlannedRun, costs) -> list[str]:
    """The notes on what the prediction does not model."""
    notes = []
    if costs.unmeasured:
        notes.append(f"operators that could not be timed alone, counted as free: {', '.join(sorted(costs.unmeasured))}")
    if costs.not_cached:
        notes.append(f"operator timings: {costs.not_cached} (the step's time may be overstated)")
    if planned.settings.compile:
        notes.append(
            "--compile: the prediction is of the eager model (compiled kernels and compile time are not modelled)"
        )
    if os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true":
        notes.append("FSDP: parameters, gradients and optimizer state are predicted unsharded")
    return notes


def _batches_block(planned: PlannedRun, batches: Batches, length: int) -> dict:
    """The prediction's `batches` block: what the run's batches are, and the length its step was traced at."""
    settings, eval_all, real = planned.settings, batches.eval_lengths, planned.lengths["train"]
    return {
        "batch": settings.per_device_batch_size,
        "micro_batches": int(len(batches.train)),
        "accumulation": batches.accumulation,
        "warmup_steps": batches.warmup,
        "traced_length": length,
        "mean_length": float(batches.steady.mean()),
        "longest": batches.longest,
        "mean_real_length": float(real.mean()) if len(real) else 0.0,
        "eval_batch": settings.resolved_eval_batch_size,
        "eval_batches": {k: int(len(v[0])) for k, v in batches.evaluation.items()},
        "eval_mean_length": float(eval_all.mean()) if len(eval_all) else None,
    }


def calibration_state(fitted: dict, device: torch.device) -> dict:
    """How the prediction was calibrated: `state` calibrated (a calibration cached before), first use (made by this
    prediction, in `seconds`) or uncalibrated (switched off, or it failed: `error`), its method and date, and each
    fitted coefficient held at a bound of its fit (a warning: the fitted model does not fit this machine)."""
    timing = fitted.get("time") or {}
    state = "first use" if fitted.get("made_now") else "calibrated" if fitted.get("key") else "uncalibrated"
    return {
        "state": state,
        "method": fitted.get("method") or ("full" if fitted.get("key") else None),
        "measured": fitted.get("measured"),
        "seconds": fitted.get("seconds"),
        "error": fitted.get("error"),
        "at_bound": list(timing.get("at_bound") or []),
        "path": str(calibration.calibration_path(device))
        if fitted.get("key") and not fitted.get("not_cached")
        else None,
        "not_cached": fitted.get("not_cached"),
    }


# What each memory term rests on (docs/predict.md): derived from the traced step, fitted, or measured in the run.
MEMORY_SOURCES = {
    "baseline": "measured",
    "parameters": "derived",
    "optimizer": "derived",
    "activations": "derived",
    "temporaries": "derived",
    "ddp_buckets": "derived",
    "allocator": "fitted",
}


def sources(memory: dict, timing: dict) -> dict:
    """The peak's and the steady step's shares derived, fitted and measured (MEMORY_SOURCES). The step's are over
    its kinds at the mean padded length: the operators' calibrated factor is fitted beyond 1 (what they cost timed
    alone is derived), the framework's time (per dispatch, per step) fitted, the collate measured now."""
    peak = {kind: 0.0 for kind in ("derived", "fitted", "measured")}
    for term, gib in memory["terms_gib"].items():
        peak[MEMORY_SOURCES.get(term, "derived")] += gib
    kinds = timing["kinds_s"]
    factor = (timing.get("calibration") or {}).get("operator_factor", 1.0)
    alone = kinds.get("operator", 0.0) / factor if factor else kinds.get("operator", 0.0)
    step = {
        "derived": kinds.get("matmul", 0.0) + alone + kinds.get("communication", 0.0),
        "fitted": kinds.get("operator", 0.0) - alone + kinds.get("framework", 0.0),
        "measured": kinds.get("data", 0.0),
    }
    share = lambda parts: {k: v / sum(parts.values()) if sum(parts.values()) else None for k, v in parts.items()}  # noqa: E731
    return {"peak_gib": peak, "peak_share": share(peak), "step_s": step, "step_share": share(step)}


def before_run(settings, started, tokenizer, data) -> dict:
    """The prediction of this launch, made on every process (peers measure what is missing at once, as the peak
    does); the main process's is the record's, its seconds trainscope's start-up. Never fails a run: an error becomes
    the block's `error`. A training run only reads a cached calibration (docs/predict.md)."""
    fitted = None if settings.predict else calibration.cached(started.state.device)
    try:
        with started.cost.timing("start_s"):
            planned = planned_run_for(settings, started, tokenizer, data)
            return predict(planned, store=started.state.is_local_main_process, fitted=fitted)
    except Exception as error:  # the run goes on without a prediction; the record says why
        return {"version": VERSION, "error": one_line(error)}
