"""make gpu-check's results: the goals and their verdicts from the measured figures, and the Markdown of the
results file."""

import torch

# ---- the goals, each reachable by the plan's step times (gpu_check_plan); the reason says why each is set there
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
        "and step times measured by the first check on one H200 and assumed ones (trainscope/gpu_check_plan.py "
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
