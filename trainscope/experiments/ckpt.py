"""make ckpt-compare: activation checkpointing off and on, in alternating rounds: step time and peak memory."""

from trainscope.experiments.base import Experiment, arm_table, arms_headline, errors, fixed_arms, runs_option
from trainscope.measure import bench
from trainscope.report import sections
from trainscope.report.tables import pyplot

ARMS = {"off": [], "on": ["--gradient-checkpointing"]}


def section(report, found: sections.Collected) -> None:
    comparison, runs = found.comparisons.get("ckpt"), found.runs.get("ckpt", {})
    if not report.begin(EXPERIMENT.title, comparison and runs, EXPERIMENT.missing()):
        return
    rows = [r for r in sections.arm_rows(comparison) if r["status"] == "complete"]
    figure, (time_axis, memory_axis) = pyplot().subplots(1, 2, figsize=(8, 3.5))
    labels = [r["arm"] for r in rows]
    time_axis.bar(labels, [r["step_s"] for r in rows], yerr=errors(rows, "step_s"), capsize=4, color="tab:blue")
    time_axis.set_ylabel("seconds per optimizer step (median, min-max)")
    memory_axis.bar(labels, [r["peak_memory_gib"] for r in rows], color="tab:orange")
    memory_axis.set_ylabel(f"peak memory GiB ({rows[0]['memory_kind']})")
    figure.tight_layout()
    report.figure(
        figure,
        "ckpt",
        "Activation checkpointing: time and memory",
        list(sections.first_round_runs(comparison, runs).values()),
    )
    report.table(
        arm_table(
            comparison, f"Activation checkpointing off and on ({comparison['rounds']} alternating rounds)", "ckpt"
        )
    )
    for name, against in comparison["comparisons"].items():
        report.text(f"`{name}`: {memory_text(against)}, speed {bench.describe(against['speed'])}.")
    if rows[0]["memory_kind"] == "peak RSS":
        report.text(
            "On a CPU the memory column is the process's peak RSS, which includes the Python runtime and "
            "libraries; activation savings show in full as device memory on a GPU."
        )


def memory_text(against: dict) -> str:
    return f"memory {against['memory_ratio']['median']:.2f}x the baseline's"


def headline(found: sections.Collected):
    return arms_headline(
        found.comparisons.get("ckpt"), found.runs.get("ckpt", {}), lambda name, against: f", {memory_text(against)}"
    )


EXPERIMENT = Experiment(
    name="ckpt",
    title="Activation checkpointing",
    target="make ckpt-compare",
    folder="ckpt",
    section=section,
    headline=headline,
    arguments=runs_option,
    run=fixed_arms("ckpt", ARMS),
    help="activation checkpointing off and on: step time and peak memory",
)
