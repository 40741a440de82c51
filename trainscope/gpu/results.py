"""make gpu-check's results: each check's goals judged, whether it confirms what the plan says, the results page.

How it works: docs/gpu.md#what-make-gpu-check-does."""

from trainscope.gpu import goals
from trainscope.gpu.checks import SHARED_NOTE
from trainscope.gpu.goals import CROSS, OBSERVATIONS, goal_met, verdicts
from trainscope.report.document import Bullets, Code, Heading, Paragraph
from trainscope.report.document import markdown as page
from trainscope.report.tables import Table

# The datasheet peak each precision's MFU is a share of (trainscope.measure.flops.PEAK_TFLOPS)
PEAK_KINDS = {"fp32": "fp32 non-tensor", "tf32": "TF32 tensor", "bf16": "bf16 tensor", "fp16": "fp16 tensor"}


def declared(step: dict) -> dict:
    """The planned check with the goals it names; a plan written before checks named their goals (an older results
    file) takes those the check is declared with now, and the facts they read."""
    if "goals" in step:
        return step
    from trainscope.gpu.plan import plan  # today's declarations, by name

    planned = {s["name"]: s for s in plan(gpus=1 if step.get("shared_gpu") or step.get("processes", 1) == 1 else 2)}
    return {**planned.get(step["name"], {"goals": []}), **step}


def goals_of(step: dict) -> list[tuple]:
    """The goals of one planned check: (what it holds to, its judge of (result, results, gpus))."""
    return goals.bound(declared(step))


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
    """'all 6 met' ('met' for one), or which were not met and which not measured (each with what was read, or why
    it could not be)."""
    missed = [f"{g['goal']} ({g['read']})" for g in judged if g["met"] is False]
    unknown = [
        g["goal"] + (f" ({g['read']})" if g["read"] != "not measured" else "") for g in judged if g["met"] is None
    ]
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


# ---------------------------------------------------------------- outcomes and the page


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


def status_text(report: dict) -> str:
    status = report.get("status", "complete")
    if status == "interrupted":
        stop = report["interrupted"]
        return f"interrupted by {stop['signal']} during {stop['during']}: what finished before is kept"
    if status == "running":
        return f"running: {len(report['checks'])} of {len(report['plan'])} checks done"
    return status


def checks_table(report: dict, steps: dict, results: dict, gpus: int) -> Table:
    """One row a check: its estimate (as charged when it started), timeout, seconds, outcome and goals."""
    rows = []
    for r in report["checks"]:
        step = steps.get(r["name"])
        judged = goals_text(judge_check(step, r, results, gpus)) if step and ran(r) else ""
        timeout = f"{r['timeout_s']:.0f}" if r.get("timeout_s") else ""
        estimate = r.get("expected_s") or r.get("estimate_s") or 0
        rows.append([r["name"], f"{estimate:.0f}", timeout, f"{r['seconds']:.0f}", outcome(r), judged])
    waiting = "interrupted" if report.get("status") == "interrupted" else "pending"
    rows += [[name, "", "", "", f"not run ({waiting})", ""] for name in report.get("not_run", [])]
    headers = ["check", "estimate s", "timeout s", "seconds", "outcome", "goals"]
    return Table("GPU checks", headers, rows, label="gpu_check", align="lrrrll")


def cross_bullets(report: dict, results: dict) -> tuple[Bullets, Bullets]:
    """The goals across checks (with the check that judges each) and the observations, with what was read."""
    found, held_by = verdicts(results), {key: s["name"] for s in report["plan"] for key in declared(s)["goals"]}
    crossed = []
    for goal, (target, direction, why) in CROSS.items():
        value = found.get(goal)
        met = "not measured" if value is None else f"{value:.3g}, " + ("met" if goal_met(goal, value) else "NOT met")
        crossed.append(f"{goal} {direction} {target} ({held_by.get(goal, 'not planned')}): {met} ({why})")
    seen = [
        f"{name} ({check}): {'not measured' if found.get(name) is None else f'{found[name]:.3g}'} ({what})"
        for name, (check, what) in OBSERVATIONS.items()
    ]
    return Bullets(crossed), Bullets(seen)


SCALED = (
    "; each check's as it started (the cold costs a check skipped before it left, and scaled by what the checks "
    "before it took against their estimates: the estimate s column)"
)


def markdown(report: dict, note: str | None = None) -> list[str]:
    """The results page's Markdown; `note`: a line said under the status (a file rewritten from its JSON says so)."""
    results = {c["name"]: c for c in report["checks"]}
    steps = {step["name"]: step for step in report["plan"]}
    gpus, interrupted = report.get("gpus", 1), report.get("status") == "interrupted"
    packages = (report.get("provenance") or {}).get("packages") or {}
    torch_text = report.get("torch") or packages.get("torch") or "unknown"
    cuda_text = f", CUDA {report['cuda']}" if report.get("cuda") else ""
    skipped = [r for r in report["checks"] if r.get("skipped")]
    crossed, seen = cross_bullets(report, results)
    notes = [
        f"{r['name']}: {text}" for r in report["checks"] for text in r.get("prediction_notes") or []
        if "could not be timed" in text
    ]  # fmt: skip
    yes = [step for step in report["plan"] if confirmed(step, results.get(step["name"]), results, gpus)]
    no = [step for step in report["plan"] if step not in yes]
    blocks = [
        Heading(f"GPU check: {report['device']}"),
        Paragraph(f"Status: {status_text(report)}."),
        Paragraph(note or ""),
        Paragraph(
            f"Driver {report['driver']}, torch {torch_text}{cuda_text}, {gpus} GPU(s); {report.get('seconds', 0):.0f} "
            f"s of the {report['budget_s']:.0f} s budget"
            + (f", counted from {report['budget_from']}" if report.get("budget_from") else "")
            + ". Estimates are from the launch and step times measured by the gpu-checks on one H200 and assumed ones "
            "(trainscope/gpu/estimates.py MEASURED_* and ASSUMED_*)"
            + (SCALED if any("expected_s" in r for r in report["checks"]) else "")
            + "."
        ),
        checks_table(report, steps, results, gpus),
        Paragraph("Skipped: " + "; ".join(f"{r['name']} ({r['skipped']})" for r in skipped) + "." if skipped else ""),
        Heading("Goals across checks", 2),
        crossed,
        Heading("Observations (one run each: no noise measured, so no verdict)", 2),
        seen,
        *([Heading("Prediction notes", 2), Bullets(notes)] if notes else []),
    ]
    for r in report["checks"]:
        if r.get("output_tail"):
            tail = "\n".join(r["output_tail"].splitlines()[-40:])
            blocks += [Heading(f"{r['name']}: the end of its output", 2), Code(tail)]
    blocks += [
        Heading("What these runs confirmed that a CPU cannot (each check ran to its end and met every goal)", 2),
        Bullets([f"{step['name']}: {step['confirms']}" for step in yes] or ["nothing"]),
    ]
    if no:
        why = [why_not_confirmed(s, results.get(s["name"]), results, gpus, interrupted) for s in no]
        blocks += [
            Heading("Not confirmed (each confirms nothing)", 2),
            Bullets([f"{step['name']}: {reason}" for step, reason in zip(no, why)]),
        ]
    return page(blocks)
