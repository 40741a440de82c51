"""make amp-compare: the same run in fp32 and in mixed precision (fp16 on GPUs, bf16 on a CPU): one long run
each (accuracy and loss curves in one W&B group), speed paired by logged interval (the same steps, hence
the same batches)."""

from pathlib import Path

from trainscope import bench, reporting
from trainscope.experiments.base import (Experiment, experiment, planned_arm, runs_option, speed_cells,
                                         verdicts_text, write)
from trainscope.record_view import RunView
from trainscope.records import read_steps
from trainscope.reporting import Headline
from trainscope.tables import Table, num, pyplot


def arguments(parser) -> None:
    runs_option(parser, rounds=None, config=None)
    parser.add_argument("--configs", nargs="+", default=["cpu", "bf16"], help="configs; the first is the baseline")
    parser.add_argument("--group", default=None, help="W&B group of both runs (default: amp)")


def run(args, train_args: list[str]) -> dict:
    runs = Path(args.runs)
    arms = [planned_arm(config, config, ["--tracker-group", args.group or "amp"]) for config in args.configs]
    summary = experiment(runs, "amp", arms, train_args, rounds=1)
    base = arms[0].name
    for arm in arms[1:]:
        if arm.skipped is None:
            walls = interval_walls(runs / f"{base}-r0", runs / f"{arm.name}-r0")
            summary["comparisons"][arm.name]["speed_by_interval"] = (
                bench.compare_samples(*walls, higher_is_better=False) if walls[0] else None)
    write(runs, "amp", summary, train_args, rounds=1)
    return summary


def interval_walls(baseline_run: Path, other_run: Path) -> tuple[list[float], list[float]]:
    """Wall seconds of the logged intervals both runs share (the same optimizer steps, hence the same batches)."""
    base = {line["step"]: line["wall_s"] for line in read_steps(baseline_run)}
    other = {line["step"]: line["wall_s"] for line in read_steps(other_run)}
    steps = sorted(base.keys() & other.keys())
    return [base[s] for s in steps], [other[s] for s in steps]


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
    report.figure(figure, "amp_loss", "Training loss, FP32 and mixed precision", list(records.values()))
    rows = [[r["arm"], r.get("precision", "-"), num(r.get("validation_accuracy"), 4), num(r.get("test_accuracy"), 4),
             num(r.get("samples_per_s"), 1), num(r.get("peak_memory_gib")), *speed_cells(r)]
            for r in reporting.arm_rows(comparison)]
    report.table(Table("Mixed precision vs FP32 (one run each, same seed, steps and threads)",
                       ["config", "precision", "val acc", "test acc", "samples/s", "peak GiB", "speed vs fp32", "verdict"],
                       rows, "amp", align="llrrrrrl"))
    for name, against in comparison["comparisons"].items():
        by_interval = against.get("speed_by_interval")
        if by_interval:
            report.text(f"`{name}` against `{comparison['baseline']}`, {PER_INTERVAL} (the same steps and batches): "
                        f"{bench.describe(by_interval)}.")


PER_INTERVAL = "per logged interval"


def headline(found: reporting.Collected) -> Headline | None:
    """Mixed precision's speed against fp32: per logged interval where measured (the section's sentence), else
    the whole run's (its table's cell); the runs' warnings named."""
    comparison, runs = found.comparisons.get("amp"), found.runs.get("amp", {})
    if not (comparison and runs):
        return None
    parts, verdicts = [], {}
    for name, against in comparison["comparisons"].items():
        speed = against.get("speed_by_interval") or against["speed"]
        warned = comparison["arms"][name].get("warnings") or []
        how = PER_INTERVAL if against.get("speed_by_interval") else "the whole run"
        parts.append(f"`{name}` against `{comparison['baseline']}`, {how}: {bench.ratio_text(speed)}"
                     + (f" (warned: {', '.join(warned)})" if warned else ""))
        verdicts[name] = speed["verdict"]
    if not parts:
        return Headline(f"only `{comparison['baseline']}` ran", "nothing compared")
    return Headline("; ".join(parts), verdicts_text(verdicts))


EXPERIMENT = Experiment(name="amp", title="Mixed precision vs FP32", target="make amp-compare", folder="amp",
                        section=section, headline=headline, arguments=arguments, run=run,
                        help="fp32 and mixed precision: one long run each")


