"""make matrix: train.py under each config and switch, in alternating rounds, with per-stage attribution.

A variant is `config[+switch...]`, e.g. `cpu`, `ddp`, `bf16+ckpt+compile`; configs this machine cannot run are
skipped with their reason; the first variant is the baseline.
"""

from pathlib import Path

from trainscope.core import launching
from trainscope.core.record_view import RunView
from trainscope.experiments.base import (
    Arm,
    Experiment,
    ExperimentFailed,
    arm_table,
    arms_headline,
    experiment,
    planned_arm,
    runs_option,
)
from trainscope.report import sections
from trainscope.report.tables import Table, num, pyplot

SWITCHES = {
    "ckpt": ["--gradient-checkpointing"],
    "compile": ["--compile"],
    "lora": ["--lora"],
    "events": ["--timing", "events"],
    "sync": ["--timing", "sync"],
    "tf32": ["--tf32"],
}


def arguments(parser) -> None:
    runs_option(parser, config=None)
    parser.add_argument(
        "--variants",
        nargs="+",
        required=True,
        help=f"config[+switch...], switches: {', '.join(SWITCHES)}; the first is the baseline",
    )


def parse_variant(variant: str) -> Arm:
    """'bf16+ckpt+compile' -> Arm(config bf16, flags --gradient-checkpointing --compile), planned for here."""
    config, *switches = variant.split("+")
    unknown = [s for s in switches if s not in SWITCHES]
    if unknown:
        raise ExperimentFailed(f"unknown switch(es) {unknown} in {variant!r}: choose from {', '.join(SWITCHES)}")
    if not launching.config_path(config).exists():
        raise ExperimentFailed(f"no {launching.config_path(config)} for variant {variant!r}")
    return planned_arm(variant, config, [flag for s in switches for flag in SWITCHES[s]])


def run(args, train_args: list[str]) -> dict:
    return experiment(Path(args.runs), "matrix", [parse_variant(v) for v in args.variants], train_args, args.rounds)


def section(report, found: sections.Collected) -> None:
    comparison, runs = found.comparisons.get("matrix"), found.runs.get("matrix", {})
    if not report.begin(EXPERIMENT.title, comparison and runs, EXPERIMENT.missing()):
        return
    records = sections.first_round_runs(comparison, runs)
    names = list(records)
    per_step = {name: RunView(records[name]).stage_seconds_per_step() for name in names}
    figure, axis = pyplot().subplots(figsize=(8, 4))
    bottom = [0.0] * len(names)
    for stage in ("data", "forward", "backward", "optimizer", "other"):
        values = [per_step[n][stage] for n in names]
        axis.bar(names, values, bottom=bottom, label=stage)
        bottom = [b + v for b, v in zip(bottom, values)]
    axis.set_ylabel("seconds per optimizer step (steady, first round)")
    axis.legend(fontsize=8)
    axis.tick_params(axis="x", labelsize=8)
    report.figure(figure, "matrix", "Stage time per step for each variant", list(records.values()))
    report.table(
        arm_table(comparison, f"Variants (same seed and steps, {comparison['rounds']} alternating rounds)", "matrix")
    )
    cells = [
        [
            f"{names[0]} -> {name}",
            part["stage"],
            num(part["baseline_s"], 4),
            num(part["other_s"], 4),
            f"{part['delta_s']:+.4f}",
            num(part["share_of_change"], 1, percent=True),
        ]
        for name in names[1:]
        for part in sections.attribution(records[names[0]], records[name])
    ]
    if cells:
        report.table(
            Table(
                "Speed-up attribution: per-step stage seconds against the first variant (first round)",
                ["comparison", "stage", "before s", "after s", "change s", "share of change"],
                cells,
                "attribution",
                align="llrrrr",
            )
        )


def headline(found: sections.Collected):
    return arms_headline(found.comparisons.get("matrix"), found.runs.get("matrix", {}))


EXPERIMENT = Experiment(
    name="matrix",
    title="Configs and switches side by side",
    target="make matrix",
    folder="matrix",
    section=section,
    headline=headline,
    arguments=arguments,
    run=run,
    help="train.py under each config and switch",
)
