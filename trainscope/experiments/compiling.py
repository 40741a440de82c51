"""make bench-compile: --compile against eager on the tiny model: compile time, recompiles, speed."""

from trainscope.core.record_view import RunView
from trainscope.experiments.base import Experiment, arm_table, arms_headline, fixed_arms, runs_option
from trainscope.report import sections

ARMS = {"eager": [], "compiled": ["--compile"]}


def section(report, found: sections.Collected) -> None:
    comparison, runs = found.comparisons.get("compile"), found.runs.get("compile", {})
    if not report.begin(EXPERIMENT.title, comparison and runs, EXPERIMENT.missing()):
        return
    report.table(
        arm_table(comparison, f"--compile against eager ({comparison['rounds']} alternating rounds)", "compile")
    )
    compiled = compile_blocks(comparison, runs)
    if compiled:
        report.text(
            f"Compile time {compile_time(compiled)} (outside the timed steady phase), recompiles "
            f"{sorted({c['recompiles'] for c in compiled})} with dynamic shapes."
        )


def compile_blocks(comparison: dict, runs: dict) -> list[dict]:
    return [
        RunView(runs[name]).compile for name in comparison["arms"].get("compiled", {}).get("runs", []) if name in runs
    ]


def compile_time(compiled: list[dict]) -> str:
    seconds = sorted(c["compile_s"] for c in compiled)
    return f"{seconds[0]:.1f}-{seconds[-1]:.1f} s"


def headline(found: sections.Collected):
    comparison, runs = found.comparisons.get("compile"), found.runs.get("compile", {})
    compiled = compile_blocks(comparison, runs) if comparison else []
    return arms_headline(
        comparison,
        runs,
        lambda name, against: f", compile time {compile_time(compiled)}" if name == "compiled" and compiled else "",
    )


EXPERIMENT = Experiment(
    name="compile",
    title="torch.compile against eager",
    target="make bench-compile",
    folder="compile",
    section=section,
    headline=headline,
    arguments=runs_option,
    run=fixed_arms("compile", ARMS),
    help="--compile against eager: compile time, recompiles, speed",
)
