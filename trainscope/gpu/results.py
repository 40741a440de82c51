"""make gpu-check's results: each check's goals and their verdicts from what it measured, whether it confirms what
the plan says it does, and the Markdown of the results file.

Every check of the plan has goals of its own that its figures can fail (`goals_of`): a training run's record complete,
the precision in effect; a multi-process run's world size, distributed type and backend as planned, on CUDA, its
loss finite and falling, DDP's communication measured and agreeing with DDP's logger, FSDP2's layers sharded with
its collectives run; a benchmark's verdict. A check confirms what the plan says only where it ran to its end and met
every goal (`confirmed`): one skipped, stopped or failed, or with a goal not met or not measured, confirms nothing, and
the report says which and why. A speed ratio of two single runs is an observation, never a goal: one run each
measures no noise.

MFU is headlined on real tokens (padding positions are not the model's work: --unpad counts real tokens, a padded run
its padded positions) and names the datasheet peak it is a share of (fp32 runs against the fp32 non-tensor peak,
TF32 and bf16 against their tensor-core peaks: rows of different precisions are shares of different peaks).
"""

import math
from collections.abc import Callable

from trainscope.core import launching
from trainscope.gpu.plan import SHARED_NOTE

# ---- the goals across checks, each reachable by the plan's step times (gpu_check_plan) and judged on one check
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
    "compile_recompiles": (
        0,
        "at most",
        "graphs compiled in the compiled run's steady window (its first evaluation's "
        "compile is warm-up); no MFU goal: per-batch-padded tweets at batch 32 keep a GPU bound by "
        "the host (1.5% MFU compiled on an H200)",
    ),
}
GOAL_CHECK = {"timing_agreement": "timing-sync", "compile_recompiles": "compile-bf16"}
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
UNPAD_LOSS_TOLERANCE = 0.05  # --unpad's first logged loss against the padded run's, same seed and batches, bf16
# The datasheet peak each precision's MFU is a share of (trainscope.measure.flops.PEAK_TFLOPS)
PEAK_KINDS = {"fp32": "fp32 non-tensor", "tf32": "TF32 tensor", "bf16": "bf16 tensor", "fp16": "fp16 tensor"}


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


# ---------------------------------------------------------------- each check's goals

# A judge reads a check's result (and the others', and the report's GPU count): (met, what it read); met is None
# where the figure is not there (not measured: the goal is not met either)
Judge = Callable[[dict, dict, int], tuple[bool | None, str]]


def _read(value, met: bool, shown=None) -> tuple[bool | None, str]:
    return (None, "not measured") if value is None else (met, str(value if shown is None else shown))


def _complete(result: dict, results: dict, gpus: int) -> tuple[bool | None, str]:
    """The run record's status; results written before gpu-check kept it (run 2's): a record read after an exit of
    0 with its steady figures is a complete one."""
    if "status" in result:
        return result["status"] == "complete", str(result["status"])
    if (result.get("throughput") or {}).get("samples_per_s") is not None:
        return True, "complete (its summary read after exit 0)"
    return None, "not measured"


def _equals(key: str, expected) -> Judge:
    def judge(result: dict, results: dict, gpus: int):
        value = result.get(key)
        return _read(value, value == expected)

    return judge


def _on_cuda(result: dict, results: dict, gpus: int):
    device = result.get("device")
    return _read(device, str(device).startswith("cuda"))


def _losses(result: dict) -> list[float] | None:
    return [loss for _, loss in result.get("losses") or []] or None


def _loss_falls(result: dict, results: dict, gpus: int):
    losses = _losses(result)
    if not losses or len(losses) < MIN_LOGGED_LOSSES:
        return None, f"{len(losses or [])} logged losses: at least {MIN_LOGGED_LOSSES} judge a trend"
    if not all(math.isfinite(loss) for loss in losses):
        return False, "not finite"
    half = len(losses) // 2
    earlier, later = sum(losses[:half]) / half, sum(losses[-half:]) / half
    return later < earlier, f"mean {earlier:.4g} -> {later:.4g} over {len(losses)} logged steps"


def _fsdp_ranks(result: dict) -> list[dict] | None:
    return result.get("fsdp") or None


def _layers_sharded(result: dict, results: dict, gpus: int):
    ranks, wrap = _fsdp_ranks(result), result.get("fsdp_wrap")
    if not ranks or not wrap:
        return None, "not measured"
    missing = sorted({kind for rank in ranks for kind in wrap if not rank["sharded_modules"].get(kind)})
    if missing:
        return False, f"{', '.join(missing)} not sharded (sharded: {', '.join(ranks[0]['sharded_modules'])})"
    layers = min(sum(rank["sharded_modules"][kind] for kind in wrap) for rank in ranks)
    return True, f"{layers} {'/'.join(wrap)} sharded on each of {len(ranks)} ranks"


def _parameter_shares(result: dict, results: dict, gpus: int):
    ranks = _fsdp_ranks(result)
    if not ranks:
        return None, "not measured"
    shares = [rank["local_parameters"] / rank["parameters"] for rank in ranks]
    even = all(abs(share * len(ranks) - 1) <= FSDP_SHARE_TOLERANCE for share in shares)
    shown = ", ".join(f"{share:.1%}" for share in shares)
    return even, f"{shown} of {ranks[0]['parameters'] / 1e6:.3g} M parameters ({len(ranks)} ranks)"


def _collectives_ran(result: dict, results: dict, gpus: int):
    ranks = _fsdp_ranks(result)
    counts = [rank.get("collectives") for rank in ranks or []]
    if not counts or None in counts:
        return None, "not measured"
    ran = all(count["all_gathers"] > 0 and count["reduce_scatters"] > 0 for count in counts)
    return ran, "; ".join(f"{c['all_gathers']} all-gathers, {c['reduce_scatters']} reduce-scatters" for c in counts)


def _communication_measured(result: dict, results: dict, gpus: int):
    block = result.get("communication")
    return _read(block, bool((block or {}).get("measured")), "measured" if (block or {}).get("measured") else "no")


def _agrees_with_ddp(result: dict, results: dict, gpus: int):
    agreement = ((result.get("communication") or {}).get("agreement") or {}).get("ddp")
    if not agreement:
        return None, "not measured"
    return agreement.get("verdict") == "agree", (
        f"{agreement.get('verdict')} (median difference {agreement.get('median_difference', 0) * 1e3:.3g} ms, "
        f"tolerance {agreement.get('tolerance', 0) * 1e3:.3g} ms)"
    )


def _snapshot_written(result: dict, results: dict, gpus: int):
    path = (result.get("memory_snapshot") or {}).get("path")
    return _read(path, bool(path), "written")


def _profile_written(result: dict, results: dict, gpus: int):
    return _read(result.get("profile"), bool(result.get("profile")), "written")


def _compiled(dynamic: bool | None) -> Judge:
    def judge(result: dict, results: dict, gpus: int):
        compiled = result.get("compile")
        if not compiled:
            return None, "not measured"
        if dynamic is None:
            return compiled.get("compile_s") is not None, f"compiled in {compiled.get('compile_s') or 0:.0f} s"
        return bool(compiled.get("dynamic")) == dynamic, f"dynamic {'yes' if compiled.get('dynamic') else 'no'}"

    return judge


def _unpad_loss(result: dict, results: dict, gpus: int):
    ours, padded = result.get("losses") or [], (results.get("precision-bf16") or {}).get("losses") or []
    if not ours or not padded or ours[0][0] != padded[0][0]:
        return None, "not measured"
    (step, loss), reference = ours[0], padded[0][1]
    difference = abs(loss - reference) / abs(reference)
    return math.isfinite(loss) and difference <= UNPAD_LOSS_TOLERANCE, (
        f"step {step}: {loss:.4g} against {reference:.4g} ({difference:.2%})"
    )


def _scaler(result: dict, results: dict, gpus: int):
    found = result.get("scaler")
    return _read(
        found, bool((found or {}).get("ok")), f"{(found or {}).get('counted')} of {(found or {}).get('planted')}"
    )


def _compare_dp(arm: str) -> Judge:
    def judge(result: dict, results: dict, gpus: int):
        measured = (((result.get("compare_dp") or {}).get("results") or {}).get(arm)) or None
        if measured is None:
            return None, "not measured"
        status, world = measured.get("status"), measured.get("world_size")
        if arm == "ddp":
            return status == "measured" and world == gpus, f"{status}, world size {world}"
        return status == "measured", str(status)

    return judge


def _loader_copies(result: dict, results: dict, gpus: int):
    entries = (((result.get("loaders") or {}).get("summary") or {}).get("settings")) or None
    if entries is None:
        return None, "not measured"
    pinned = {entry.get("pin_memory") for entry in entries if entry.get("median_copy_s") is not None}
    return {
        True,
        False,
    } <= pinned, f"copy_s measured {'pinned and pageable' if len(pinned) == 2 else pinned or 'never'}"


def _largest_batch(result: dict, results: dict, gpus: int):
    comparison = result.get("comparison")
    largest = (comparison or {}).get("largest_fitting_batch")
    return _read(largest, isinstance(largest, int) and largest >= 32)


def _batch_arm(result: dict, results: dict, gpus: int):
    arm = (((result.get("comparison") or {}).get("arms") or {}).get("bs32")) or None
    return _read(arm, (arm or {}).get("status") == "complete", (arm or {}).get("status"))


def _overhead(result: dict, results: dict, gpus: int):
    scripts = (result.get("overhead") or {}).get("scripts") or [{}]
    events = (scripts[0].get("arms") or {}).get("train.py")  # the whole run's verdict (benchmarks.whole_run)
    if events is None:
        return None, "not measured"
    step, within = events["per_step"], events["per_step"]["interval"]["high"] <= 0.01  # met: the interval within 1%
    return within, f"{step['median']:+.2%} a step (interval up to {step['interval']['high']:+.2%})"


def _cross(goal: str) -> Judge:
    def judge(result: dict, results: dict, gpus: int):
        value = verdicts(results).get(goal)
        return _read(value, value is not None and goal_met(goal, value), f"{value:.3g}" if value is not None else None)

    return judge


def goals_of(step: dict) -> list[tuple[str, Judge]]:
    """The goals of one planned check: (what it holds to, its judge). Every check has at least one a run can fail."""
    name, goals = step["name"], []
    if "config" in step:
        goals.append(("its run record is complete", _complete))
        processes = step.get("processes", 1)
        if processes > 1:
            facts = launching.config_facts(launching.config_path(step["config"]))
            backend = "gloo" if step.get("shared_gpu") else "nccl"
            goals += [
                ("on CUDA", _on_cuda),
                (f"world size {processes}", _equals("world_size", processes)),
                (
                    f"distributed type {facts['distributed_type']}",
                    _equals("distributed_type", facts["distributed_type"]),
                ),
                (f"backend {backend}", _equals("backend", backend)),
                (
                    f"the loss finite and falling (the later half of at least {MIN_LOGGED_LOSSES} logged losses "
                    "below the earlier half on average)",
                    _loss_falls,
                ),
            ]
        if name != "fsdp2":  # FSDP2's precision is its mixed-precision policy's, not autocast's
            goals.append((f"precision in effect {step['precision']}", _equals("precision", step["precision"])))
    goals += {
        "scaler": [("the counted skipped steps are the planted overflows", _scaler)],
        "fsdp2": [
            ("each layer class of its wrap list sharded on every rank", _layers_sharded),
            (
                f"each rank holds 1/world of the parameters (its local shards, within {FSDP_SHARE_TOLERANCE:.0%})",
                _parameter_shares,
            ),
            ("FSDP2's all-gathers and reduce-scatters ran on every rank", _collectives_ran),
        ],
        "memory-snapshot": [("the allocator's snapshot is written", _snapshot_written)],
        "unpad-bf16": [
            (
                f"its first logged loss within {UNPAD_LOSS_TOLERANCE:.0%} of precision-bf16's (same seed and batches)",
                _unpad_loss,
            )
        ],
        "ddp-communication-memory": [
            ("DDP's communication measured", _communication_measured),
            ("it agrees with DDP's logger within the stated tolerance", _agrees_with_ddp),
        ],
        "ddp-comm-hook-fp16": [
            ("DDP's communication measured", _communication_measured),
            ("it agrees with DDP's logger within the stated tolerance", _agrees_with_ddp),
        ],
        "ddp-comm-hook-bf16": [
            ("DDP's communication measured", _communication_measured),
            ("it agrees with DDP's logger within the stated tolerance", _agrees_with_ddp),
        ],
        "ddp-profile": [("the trace is written", _profile_written)],
        "ddp-compile": [("the model is compiled", _compiled(None))],
        "compile-bf16": [("compiled with dynamic shapes", _compiled(True))],
        "compare-dp": [
            ("DDP measured, one process per GPU", _compare_dp("ddp")),
            ("DataParallel measured", _compare_dp("data_parallel")),
        ],
        "loaders": [("the copy to the device timed pinned and pageable", _loader_copies)],
        "batch-search": [
            ("the search lands on a batch of at least 32", _largest_batch),
            ("the batch-32 run completes", _batch_arm),
        ],
        "overhead": [("--timing events within its target against a bare loop", _overhead)],
    }.get(name, [])
    goals += [
        (f"{goal} {GOALS[goal][1]} {GOALS[goal][0]}", _cross(goal))
        for goal, check in GOAL_CHECK.items()
        if check == name
    ]
    return goals


def ran(result: dict) -> bool:
    """Whether a check ran to its end: not skipped, not stopped by the budget, exit 0."""
    return not result.get("skipped") and not result.get("budget_cut") and result.get("exit", 0) == 0


def judge_check(step: dict, result: dict, results: dict, gpus: int) -> list[dict]:
    """Each goal of `step` on its result: {goal, met (True, False, None: not measured), read}."""
    judged = []
    for goal, judge in goals_of(step):
        met, read = judge(result, results, gpus)
        judged.append({"goal": goal, "met": met, "read": read})
    return judged


def confirmed(step: dict, result: dict | None, results: dict, gpus: int) -> bool:
    """Whether the check confirms what the plan says: it ran to its end and met every one of its goals."""
    return bool(result) and ran(result) and all(g["met"] is True for g in judge_check(step, result, results, gpus))


def goals_text(judged: list[dict]) -> str:
    """'all 6 met' ('met' for one), or which were not met and which not measured (with what was read)."""
    missed = [f"{g['goal']} ({g['read']})" for g in judged if g["met"] is False]
    unknown = [g["goal"] for g in judged if g["met"] is None]
    if not missed and not unknown:
        return "met" if len(judged) == 1 else f"all {len(judged)} met"
    parts = ([f"NOT met: {'; '.join(missed)}"] if missed else []) + (
        [f"not measured: {'; '.join(unknown)}"] if unknown else []
    )
    return " / ".join(parts)


def unmet(report: dict) -> list[str]:
    """The checks that ran to their end with a goal read and not met."""
    results = {c["name"]: c for c in report.get("checks", [])}
    steps = {step["name"]: step for step in report.get("plan", [])}
    return [
        name
        for name, result in results.items()
        if name in steps
        and ran(result)
        and any(g["met"] is False for g in judge_check(steps[name], result, results, report.get("gpus", 1)))
    ]


# ---------------------------------------------------------------- outcomes and the Markdown


def percent(value: float) -> str:
    return f"{value * 100:.3g}%"


def mfu_text(result: dict) -> str:
    """The row's MFU on real tokens, as a share of the datasheet peak it names (the peak the record's MFU used:
    its model TFLOP/s over its MFU), and the share counting padding beside it."""
    throughput, mfu = result.get("throughput") or {}, result.get("mfu")
    if mfu is None or not throughput.get("tflops_per_device"):
        return "MFU unknown"
    peak = throughput["tflops_per_device"] / mfu
    kind = PEAK_KINDS.get(result.get("precision"), result.get("precision") or "its precision's")
    of = f"of the {peak:.4g} TFLOP/s {kind} datasheet peak"
    real = throughput.get("real_tflops_per_device")
    if real is None:
        return f"MFU {percent(mfu)} counting padding {of} (real tokens not recorded)"
    return f"MFU {percent(real / peak)} on real tokens {of} ({percent(mfu)} counting padding)"


def outcome(result: dict) -> str:
    if result.get("skipped"):
        return f"skipped: {result['skipped']}"
    if result.get("budget_cut"):
        return f"not finished: {result['budget_cut']}; its output so far below"
    if result.get("exit", 0) != 0:
        return f"failed: {result.get('error', 'see JSON')}"
    shared = f"{SHARED_NOTE}; " if result.get("shared_gpu") else ""
    if result.get("throughput") and result.get("throughput", {}).get("samples_per_s") is not None:
        throughput = result["throughput"]
        text = (
            f"{shared}{throughput['samples_per_s']:.1f} samples/s, {throughput.get('tokens_per_s') or 0:.0f} "
            f"tokens/s, {mfu_text(result)}"
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
    return f"{shared}ran"


def why_not_confirmed(step: dict, result: dict | None, results: dict, gpus: int, interrupted: bool) -> str:
    if result is None:
        return "not run (interrupted)" if interrupted else "not run yet"
    if not ran(result):
        return outcome(result)
    return "ran; goals " + goals_text(judge_check(step, result, results, gpus))


def markdown(report: dict, note: str | None = None) -> list[str]:
    """The results file's Markdown; `note`: a line said under the status (a file rewritten from its JSON says so)."""
    status = report.get("status", "complete")
    if status == "interrupted":
        stop = report["interrupted"]
        status = f"interrupted by {stop['signal']} during {stop['during']}: what finished before is kept"
    elif status == "running":
        status = f"running: {len(report['checks'])} of {len(report['plan'])} checks done"
    results = {c["name"]: c for c in report["checks"]}
    steps = {step["name"]: step for step in report["plan"]}
    gpus = report.get("gpus", 1)
    packages = (report.get("provenance") or {}).get("packages") or {}
    torch_text = report.get("torch") or packages.get("torch") or "unknown"
    cuda_text = f", CUDA {report['cuda']}" if report.get("cuda") else ""
    lines = [f"# GPU check: {report['device']}", "", f"Status: {status}.", ""]
    if note:
        lines += [note, ""]
    lines += [
        f"Driver {report['driver']}, torch {torch_text}{cuda_text}, {gpus} GPU(s); "
        f"{report.get('seconds', 0):.0f} s of the {report['budget_s']:.0f} s budget. Estimates are from the launch "
        "and step times measured by the gpu-checks on one H200 and assumed ones (trainscope/gpu/estimates.py "
        "MEASURED_* and ASSUMED_*).",
        "",
        "| check | estimate s | timeout s | seconds | outcome | goals |",
        "|---|---:|---:|---:|---|---|",
    ]
    for r in report["checks"]:
        timeout = f"{r['timeout_s']:.0f}" if r.get("timeout_s") else ""
        step = steps.get(r["name"])
        goals = goals_text(judge_check(step, r, results, gpus)) if step and ran(r) else ""
        lines.append(
            f"| {r['name']} | {r.get('estimate_s') or 0:.0f} | {timeout} | {r['seconds']:.0f} | {outcome(r)} | {goals} |"
        )
    lines += [
        f"| {name} | | | | not run ({'interrupted' if report.get('status') == 'interrupted' else 'pending'}) | |"
        for name in report.get("not_run", [])
    ]
    skipped = [r for r in report["checks"] if r.get("skipped")]
    if skipped:
        lines += ["", "Skipped: " + "; ".join(f"{r['name']} ({r['skipped']})" for r in skipped) + "."]
    lines += ["", "Goals across checks:"]
    found = verdicts(results)
    for goal, (target, direction, why) in GOALS.items():
        value = found.get(goal)
        shown = (
            "not measured" if value is None else (f"{value:.3g}, " + ("met" if goal_met(goal, value) else "NOT met"))
        )
        lines.append(f"- {goal} {direction} {target} ({GOAL_CHECK[goal]}): {shown} ({why})")
    lines += ["", "Observations (one run each: no noise measured, so no verdict):"]
    for name, (check, what) in OBSERVATIONS.items():
        value = found.get(name)
        lines.append(f"- {name} ({check}): {'not measured' if value is None else f'{value:.3g}'} ({what})")
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
    interrupted = report.get("status") == "interrupted"
    yes = [step for step in report["plan"] if confirmed(step, results.get(step["name"]), results, gpus)]
    no = [step for step in report["plan"] if step not in yes]
    lines += ["", "What these runs confirmed that a CPU cannot (each check ran to its end and met every goal):"]
    lines += [f"- {step['name']}: {step['confirms']}" for step in yes] or ["- nothing"]
    if no:
        lines += ["", "Not confirmed (each confirms nothing):"]
        lines += [
            f"- {step['name']}: {why_not_confirmed(step, results.get(step['name']), results, gpus, interrupted)}"
            for step in no
        ]
    return lines
