"""make gpu-check's goals: what each check holds to and how its figures are judged. A check's declaration in
trainscope.gpu.checks names its goals (keys of GOALS); each goal says what it holds to, from the planned check, and
judges a result: (met, what it read), met None where the figure is not there (not measured: not met either).

How it works: docs/gpu.md#what-make-gpu-check-does.
"""

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass

# ---- the goals across checks, each judged on one check (the plan declares it there)
CROSS = {
    "timing_agreement": (
        1.0,
        "at most",
        "the largest disagreement over its tolerance, max(5% of the stage, 1 ms): "
        "forward and backward (device-bound in fp32) |events - sync|; data and optimizer only events "
        "above sync (sync adds the host's work that events hides behind the queued device work: the "
        "second check's optimizer 0.076 s events against 0.181 s sync); a 2 ms optimizer stage cannot "
        "be told apart at 5% (0.1 ms)",
    ),
    "compile_recompiles": (
        0,
        "at most",
        "graphs compiled in the compiled run's steady window (its first evaluation's "
        "compile is warm-up); no MFU goal: per-batch-padded tweets at batch 32 keep a GPU bound by "
        "the host (1.5% MFU compiled on an H200)",
    ),
}
# Speed ratios of single runs (one run of each precision): observations stated with their value, never goals, since
# one run each measures no noise (alternating pairs do: make amp-compare, docs/benchmarks.md)
OBSERVATIONS = {
    "bf16_over_fp32": (
        "precision-bf16",
        "bf16 samples/s over fp32's, one run each (the second check read 1.50); at batch 32 x 128 bf16 is bound by "
        "the host (on an H200 1.39% of the bf16 tensor peak on real tokens), not by the datasheet peaks' ratio",
    ),
    "bf16_over_tf32": (
        "precision-tf32",
        "bf16 samples/s over TF32's, one run each; both bound by the host at this size",
    ),
}
TIMING_TOLERANCE = (0.05, 0.001)  # a share of the stage, and at least this many seconds
# A falling loss: the later half of the logged losses below the earlier half on average, read from at least this
# many (the first and last of four losses are two noisy batches)
MIN_LOGGED_LOSSES = 8
FSDP_SHARE_TOLERANCE = 0.1  # each rank's local shards within 10% of 1/world of the parameters (dim-0 padding)
# --unpad's logged losses against the padded run's at the same steps (same seed and batches, bf16): the H200 read at
# most 0.13% (benchmarks/gpu/h200-2026-11-28, run 2); predictions that stay uniform (ln 3) were 2.4-4.9% off
UNPAD_LOSS_TOLERANCE = 0.01
# DDP's ranks end with the same parameters: float64 sums of the same values agree to rounding alone
CHECKSUM_TOLERANCE = 1e-9


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
    """The figures of CROSS and OBSERVATIONS, from the measured ones (None where a check did not produce its figure)."""
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
    target, direction, _ = CROSS[goal]
    return value <= target if direction == "at most" else value >= target


# ---------------------------------------------------------------- the judges: (step, result, results, gpus)

Verdict = tuple[bool | None, str]


def _read(value, met: bool, shown=None) -> Verdict:
    return (None, "not measured") if value is None else (met, str(value if shown is None else shown))


def _complete(step, result, results, gpus) -> Verdict:
    """The run record's status; results written before gpu-check kept it (run 2's): a record read after an exit of
    0 with its steady figures is a complete one."""
    if "status" in result:
        return result["status"] == "complete", str(result["status"])
    if (result.get("throughput") or {}).get("samples_per_s") is not None:
        return True, "complete (its summary read after exit 0)"
    return None, "not measured"


def _equals(key: str, expected: Callable[[dict], object]) -> Callable:
    def judge(step, result, results, gpus) -> Verdict:
        return _read(result.get(key), result.get(key) == expected(step))

    return judge


def _on_cuda(step, result, results, gpus) -> Verdict:
    return _read(result.get("device"), str(result.get("device")).startswith("cuda"))


def _loss_falls(step, result, results, gpus) -> Verdict:
    losses = [loss for _, loss in result.get("losses") or []]
    if len(losses) < MIN_LOGGED_LOSSES:
        return None, f"{len(losses)} logged losses: at least {MIN_LOGGED_LOSSES} judge a trend"
    if not all(math.isfinite(loss) for loss in losses):
        return False, "not finite"
    half = len(losses) // 2
    earlier, later = sum(losses[:half]) / half, sum(losses[-half:]) / half
    return later < earlier, f"mean {earlier:.4g} -> {later:.4g} over {len(losses)} logged steps"


def _ends(result) -> list[dict] | None:
    return result.get("end_state") or None


def _same_parameters(step, result, results, gpus) -> Verdict:
    ranks = _ends(result)
    sums = [rank.get("parameter_checksum") for rank in ranks or []]
    if not sums or None in sums:
        return None, "not measured"
    spread = max(sums) - min(sums)
    shown = ", ".join(f"{s:.12g}" for s in sums)
    return len(sums) == step["processes"] and spread <= CHECKSUM_TOLERANCE * max(map(abs, sums)), shown


def _scaler_every_rank(step, result, results, gpus) -> Verdict:
    ranks = _ends(result)
    if not ranks:
        return None, "not measured"
    states = [(rank.get("loss_scale"), rank.get("scaler_growth")) for rank in ranks]
    shown = "; ".join(f"rank {k}: scale {scale}, growth tracker {growth}" for k, (scale, growth) in enumerate(states))
    return len(states) == step["processes"] and None not in states[0] and len(set(states)) == 1, shown


def _layers_sharded(step, result, results, gpus) -> Verdict:
    ranks, wrap = result.get("fsdp"), result.get("fsdp_wrap")
    if not ranks or not wrap:
        return None, "not measured"
    missing = sorted({kind for rank in ranks for kind in wrap if not rank["sharded_modules"].get(kind)})
    if missing:
        return False, f"{', '.join(missing)} not sharded (sharded: {', '.join(ranks[0]['sharded_modules'])})"
    layers = min(sum(rank["sharded_modules"][kind] for kind in wrap) for rank in ranks)
    return True, f"{layers} {'/'.join(wrap)} sharded on each of {len(ranks)} ranks"


def _parameter_shares(step, result, results, gpus) -> Verdict:
    ranks = result.get("fsdp")
    if not ranks:
        return None, "not measured"
    shares = [rank["local_parameters"] / rank["parameters"] for rank in ranks]
    even = all(abs(share * len(ranks) - 1) <= FSDP_SHARE_TOLERANCE for share in shares)
    shown = ", ".join(f"{share:.1%}" for share in shares)
    return even, f"{shown} of {ranks[0]['parameters'] / 1e6:.3g} M parameters ({len(ranks)} ranks)"


def _collectives_ran(step, result, results, gpus) -> Verdict:
    ranks = result.get("fsdp") or []
    counts = [rank.get("collectives") for rank in ranks]
    if not counts or None in counts:
        why = {rank.get("collectives_not_counted") for rank in ranks} - {None}
        return None, f"not counted: {'; '.join(sorted(why))}" if why else "not measured"
    ran = all(count["all_gathers"] > 0 and count["reduce_scatters"] > 0 for count in counts)
    return ran, "; ".join(f"{c['all_gathers']} all-gathers, {c['reduce_scatters']} reduce-scatters" for c in counts)


def _communication_measured(step, result, results, gpus) -> Verdict:
    block = result.get("communication")
    return _read(block, bool((block or {}).get("measured")), "measured" if (block or {}).get("measured") else "no")


def _agrees_with_ddp(step, result, results, gpus) -> Verdict:
    found = ((result.get("communication") or {}).get("agreement") or {}).get("ddp")
    if not found:
        return None, "not measured"
    ms = lambda key: f"{found[key] * 1e3:.1f} ms" if found.get(key) is not None else "?"  # noqa: E731
    both = f"; trainscope {ms('exposed_s')}, DDP's logger {ms('ddp_exposed_s')}" if found.get("exposed_s") else ""
    return found.get("verdict") == "agree", (
        f"{found.get('verdict')} (median difference {found.get('median_difference', 0) * 1e3:.3g} ms, "
        f"tolerance {found.get('tolerance', 0) * 1e3:.3g} ms{both}, over iterations {found.get('iterations')})"
    )


def _trace_instrument(step, result, results, gpus) -> Verdict:
    """Over NCCL, the trace's exposed communication against trainscope's: a second instrument. Over gloo there is
    none (its collectives are host operators, no device kernels to time): the trace holds its window's steps on every
    rank and DDP's all-reduces among its operators."""
    profile, block = result.get("profile"), result.get("communication") or {}
    if not profile:
        return None, "not measured"
    if not step.get("shared_gpu"):
        trace = (block.get("agreement") or {}).get("trace") or {}
        return _read(
            trace or None, trace.get("verdict") == "agree", f"{trace.get('verdict')}, {trace.get('pairs')} pairs"
        )
    window = profile.get("window") or {}
    steps = list(range(window.get("first_step", 0), window.get("last_step", -1) + 1))
    calls = profile.get("communication_calls")
    traced = block.get("trace_steps")
    met = bool(steps) and traced == steps and bool(calls)
    return met, f"traced steps {traced} of the window {steps}; {calls} communication operators"


def _snapshot_written(step, result, results, gpus) -> Verdict:
    path = (result.get("memory_snapshot") or {}).get("path")
    return _read(path, bool(path), "written")


def _compiled(dynamic: bool | None) -> Callable:
    def judge(step, result, results, gpus) -> Verdict:
        compiled = result.get("compile")
        if not compiled:
            return None, "not measured"
        if dynamic is None:
            return compiled.get("compile_s") is not None, f"compiled in {compiled.get('compile_s') or 0:.0f} s"
        return bool(compiled.get("dynamic")) == dynamic, f"dynamic {'yes' if compiled.get('dynamic') else 'no'}"

    return judge


def _unpad_losses(step, result, results, gpus) -> Verdict:
    ours = dict(map(tuple, result.get("losses") or []))
    padded = dict(map(tuple, (results.get("precision-bf16") or {}).get("losses") or []))
    if not ours or not padded or set(ours) != set(padded):
        return None, "not measured" if not ours or not padded else f"steps {sorted(ours)} against {sorted(padded)}"
    off = {at: abs(ours[at] - padded[at]) / abs(padded[at]) for at in sorted(padded)}
    worst = max(off, key=off.get)
    met = all(math.isfinite(loss) for loss in ours.values()) and off[worst] <= UNPAD_LOSS_TOLERANCE
    return met, (
        f"at most {off[worst]:.2%} off over {len(off)} logged steps (step {worst}: {ours[worst]:.4g} against "
        f"{padded[worst]:.4g})"
    )


def _scaler(step, result, results, gpus) -> Verdict:
    found = result.get("scaler")
    return _read(
        found, bool((found or {}).get("ok")), f"{(found or {}).get('counted')} of {(found or {}).get('planted')}"
    )


def _compare_dp(arm: str) -> Callable:
    def judge(step, result, results, gpus) -> Verdict:
        measured = (((result.get("compare_dp") or {}).get("results") or {}).get(arm)) or None
        if measured is None:
            return None, "not measured"
        status, world = measured.get("status"), measured.get("world_size")
        if arm == "ddp":
            return status == "measured" and world == gpus, f"{status}, world size {world}"
        return status == "measured", str(status)

    return judge


def _loader_copies(step, result, results, gpus) -> Verdict:
    entries = (((result.get("loaders") or {}).get("summary") or {}).get("settings")) or None
    if entries is None:
        return None, "not measured"
    pinned = {entry.get("pin_memory") for entry in entries if entry.get("median_copy_s") is not None}
    shown = "pinned and pageable" if len(pinned) == 2 else pinned or "never"
    return {True, False} <= pinned, f"copy_s measured {shown}"


def _largest_batch(step, result, results, gpus) -> Verdict:
    largest = (result.get("comparison") or {}).get("largest_fitting_batch")
    return _read(largest, isinstance(largest, int) and largest >= 32)


def _batch_arm(step, result, results, gpus) -> Verdict:
    arm = (((result.get("comparison") or {}).get("arms") or {}).get("bs32")) or None
    return _read(arm, (arm or {}).get("status") == "complete", (arm or {}).get("status"))


def _overhead(step, result, results, gpus) -> Verdict:
    scripts = (result.get("overhead") or {}).get("scripts") or [{}]
    events = (scripts[0].get("arms") or {}).get("train.py")  # the whole run's verdict (benchmarks.whole_run)
    if events is None:
        return None, "not measured"
    step, within = events["per_step"], events["per_step"]["interval"]["high"] <= 0.01  # met: the interval within 1%
    return within, f"{step['median']:+.2%} a step (interval up to {step['interval']['high']:+.2%})"


# trainscope tune's CUDA graphs on the host-bound bf16 step: kept (faster, the same result) at this speed-up
TUNED_GRAPHS_RATIO = 2.0


def _tuned_graphs(step, result, results, gpus) -> Verdict:
    comparison = result.get("comparison") or {}
    trial = next((t for t in comparison.get("trials") or [] if "reduce-overhead" in (t.get("flags") or [])), None)
    if trial is None:
        return None, "not measured" + (" (no trial of the compile mode)" if comparison else "")
    ratio, kept = (
        (trial.get("speed") or {}).get("median_ratio"),
        "reduce-overhead" in (comparison.get("final_flags") or []),
    )
    if ratio is None:
        return None, "not measured (the trial's speed)"
    said = f"{ratio:.2f}x (median of {trial['speed'].get('pairs')} pairs), {trial.get('verdict')}, result {trial.get('same_result')}"
    return kept and ratio >= TUNED_GRAPHS_RATIO, said + ("; kept" if kept else "; not kept")


def _cross(goal: str) -> Callable:
    def judge(step, result, results, gpus) -> Verdict:
        value = verdicts(results).get(goal)
        return _read(value, value is not None and goal_met(goal, value), f"{value:.3g}" if value is not None else None)

    return judge


@dataclass(frozen=True)
class Goal:
    """What a check holds to (a text, or the text from its planned step) and the judge of its result."""

    text: str | Callable[[dict], str]
    judge: Callable[[dict, dict, dict, int], Verdict]

    def describe(self, step: dict) -> str:
        return self.text if isinstance(self.text, str) else self.text(step)


def _backend(step: dict) -> str:
    return "gloo" if step.get("shared_gpu") else "nccl"


GOALS = {
    "complete": Goal("its run record is complete", _complete),
    "on_cuda": Goal("on CUDA", _on_cuda),
    "world_size": Goal(lambda s: f"world size {s['processes']}", _equals("world_size", lambda s: s["processes"])),
    "distributed_type": Goal(
        lambda s: f"distributed type {s['distributed_type']}",
        _equals("distributed_type", lambda s: s["distributed_type"]),
    ),
    "backend": Goal(lambda s: f"backend {_backend(s)}", _equals("backend", _backend)),
    "loss_falls": Goal(
        f"the loss finite and falling (the later half of at least {MIN_LOGGED_LOSSES} logged losses below the "
        "earlier half on average)",
        _loss_falls,
    ),
    "same_parameters": Goal(
        "every rank ends with the same parameters (its parameters' checksum, within "
        f"{CHECKSUM_TOLERANCE:g} of its size: a DDP whose gradients were not averaged fails it)",
        _same_parameters,
    ),
    "precision": Goal(
        lambda s: f"precision in effect {s['precision']}", _equals("precision", lambda s: s["precision"])
    ),
    "scaler": Goal("the counted skipped steps are the planted overflows", _scaler),
    "scaler_every_rank": Goal(
        "a loss scaler on every rank, each in the same state (its scale and growth tracker, read after training)",
        _scaler_every_rank,
    ),
    "layers_sharded": Goal("each layer class of its wrap list sharded on every rank", _layers_sharded),
    "parameter_shares": Goal(
        f"each rank holds 1/world of the parameters (its local shards, within {FSDP_SHARE_TOLERANCE:.0%})",
        _parameter_shares,
    ),
    "collectives_ran": Goal("FSDP2's all-gathers and reduce-scatters ran on every rank", _collectives_ran),
    "snapshot_written": Goal("the allocator's snapshot is written", _snapshot_written),
    "unpad_losses": Goal(
        f"each of its logged losses within {UNPAD_LOSS_TOLERANCE:.0%} of precision-bf16's at the same step (same "
        "seed and batches)",
        _unpad_losses,
    ),
    "communication_measured": Goal("DDP's communication measured", _communication_measured),
    "agrees_with_ddp": Goal(
        "it agrees with DDP's logger within the stated tolerance, both over the same iterations", _agrees_with_ddp
    ),
    "trace_instrument": Goal(
        lambda s: (
            "the trace holds its window's steps and DDP's all-reduces (no second instrument over gloo: its "
            "collectives are host operators, with no device kernels for the trace to time)"
            if s.get("shared_gpu")
            else "the trace's exposed communication (the kernels' device timestamps) agrees with trainscope's"
        ),
        _trace_instrument,
    ),
    "compiled": Goal("the model is compiled", _compiled(None)),
    "compiled_dynamic": Goal("compiled with dynamic shapes", _compiled(True)),
    "compare_dp_ddp": Goal("DDP measured, one process per GPU", _compare_dp("ddp")),
    "compare_dp_dp": Goal("DataParallel measured", _compare_dp("data_parallel")),
    "loader_copies": Goal("the copy to the device timed pinned and pageable", _loader_copies),
    "largest_batch": Goal("the search lands on a batch of at least 32", _largest_batch),
    "batch_arm": Goal("the batch-32 run completes", _batch_arm),
    "overhead": Goal("--timing events within its target against a bare loop", _overhead),
    "tuned_graphs": Goal(f"CUDA graphs kept by trainscope tune at {TUNED_GRAPHS_RATIO:g}x or more", _tuned_graphs),
    **{goal: Goal(f"{goal} {direction} {target}", _cross(goal)) for goal, (target, direction, _) in CROSS.items()},
}


def bound(step: dict) -> list[tuple[str, Callable[[dict, dict, int], Verdict]]]:
    """The goals `step` declares: (what it holds to, its judge of (result, results, gpus))."""
    return [(GOALS[key].describe(step), functools.partial(GOALS[key].judge, step)) for key in step["goals"]]
