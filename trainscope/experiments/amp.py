"""make amp-compare: the same run in fp32 and in mixed precision (fp16 on GPUs, bf16 on a CPU), whole runs in
alternating rounds (trainscope.measure.bench, like every other comparison): speed judged over the rounds' runs, loss
curves of the first round's (one W&B group), accuracy and peak memory per arm.

Speed is never judged from the logged intervals of one run: the intervals of one run share its process, its
memory layout and whatever else ran beside it, so they are not independent measurements; a comparison with
fewer than bench.MIN_PAIRS rounds says "too few pairs" and gives no verdict."""

from pathlib import Path

from trainscope.core.record_view import RunView
from trainscope.experiments.base import Experiment, arms_headline, experiment, planned_arm, runs_option, speed_cells
from trainscope.measure import bench
from trainscope.report import inputs as reporting
from trainscope.report.tables import Table, num, pyplot


def arguments(parser) -> None:
    runs_option(parser, rounds=bench.MIN_PAIRS, config=None)
    parser.add_argument("--configs", nargs="+", default=["cpu", "bf16"], help="configs; the first is the baseline")
    parser.add_argument("--group", default=None, help="W&B group of every run (default: amp)")


def run(args, train_args: list[str]) -> dict:
    arms = [planned_arm(config, config, ["--tracker-group", args.group or "amp"]) for config in args.configs]
    return experiment(Path(args.runs), "amp", arms, train_args, args.rounds)


def section(report, found: reporting.Collected) -> None:
    comparison, runs = found.comparisons.get("amp"), found.runs.get("amp", {})
    if not report.begin(EXPERIMENT.title, comparison and runs, EXPERIMENT.missing()):
        return
    records = reporting.first_round_runs(comparison, runs)
    figure, axis = pyplot().subplots(figsize=(7, 4))
    for name, record in records.items():
        steps, losses = RunView(record).losses
        axis.plot(steps, losses, marker=".", label=f"{name} ({RunView(record).precision})")
    axis.set_xlabel("optimizer step")
    axis.set_ylabel("training loss")
    axis.grid(alpha=0.3)
    axis.legend()
    report.figure(figure, "amp_loss", "Training loss, FP32 and mixed precision (first round)", list(records.values()))
    rows = [
        [
            r["arm"],
            r.get("precision", "-"),
            num(r.get("validation_accuracy"), 4),
            num(r.get("test_accuracy"), 4),
            num(r.get("samples_per_s"), 1),
            num(r.get("peak_memory_gib")),
            *speed_cells(r),
        ]
        for r in reporting.arm_rows(comparison)
    ]
    rounds = comparison.get("rounds", 1)
    report.table(
        Table(
            f"Mixed precision vs FP32 ({rounds} alternating round{'s' * (rounds != 1)} of whole runs, "
            "same seed, steps and threads; medians)",
            ["config", "precision", "val acc", "test acc", "samples/s", "peak GiB", "speed vs fp32", "verdict"],
            rows,
            "amp",
            align="llrrrrrl",
        )
    )
    few = [
        name
        for name, against in comparison["comparisons"].items()
        if against.get("speed") and against["speed"]["pairs"] < bench.MIN_PAIRS
    ]
    if few:
        report.text(
            f"{', '.join(f'`{n}`' for n in few)} against `{comparison['baseline']}`: too few pairs for a "
            f"verdict ({rounds} round{'s' * (rounds != 1)} of whole runs; a verdict needs {bench.MIN_PAIRS}, as "
            f"`{EXPERIMENT.target}` runs)."
        )


def headline(found: reporting.Collected):
    """Mixed precision's whole-run speed against fp32 over the alternating rounds, as the table gives it, with the
    runs' warnings named."""
    comparison = found.comparisons.get("amp")

    def warned(name: str, against: dict) -> str:
        warnings = comparison["arms"][name].get("warnings")
        return f" (warned: {', '.join(warnings)})" if warnings else ""

    return arms_headline(comparison, found.runs.get("amp", {}), warned)


EXPERIMENT = Experiment(
    name="amp",
    title="Mixed precision vs FP32",
    target="make amp-compare",
    folder="amp",
    section=section,
    headline=headline,
    arguments=arguments,
    run=run,
    help="fp32 and mixed precision: whole runs in alternating rounds",
)
