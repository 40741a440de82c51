"""make profile: where the time goes, from a run without the profiler, and the top operators from one with it.

The time breakdown (the report's pie chart and table) comes from the unprofiled run; the profiled run
traces a window of steps (torch.profiler) for the top operators, and the two runs' step lines on the
traced steps (the same steps, the same batches) give the profiler's own cost.
"""

from pathlib import Path

from trainscope import bench, reporting
from trainscope.experiments.base import Arm, Experiment, experiment, runs_option, write
from trainscope.record_view import RunView
from trainscope.records import read_record, read_steps
from trainscope.reporting import Headline
from trainscope.run_metrics import operator_rows
from trainscope.tables import Table, num


def run(args, train_args: list[str]) -> dict:
    runs = Path(args.runs)
    flags = ["--log-every", "1"]
    arms = [Arm("default", args.config, flags), Arm("profiled", args.config, [*flags, "--profile"])]
    summary = experiment(runs, "profile", arms, train_args, rounds=1)
    window = RunView(read_record(runs / "profiled-r0")).profile["window"]
    summary["profiler_overhead"] = profiler_overhead(runs / "default-r0", runs / "profiled-r0", window)
    write(runs, "profile", summary, train_args, rounds=1)
    return summary


def profiler_overhead(default_run: Path, profiled_run: Path, window: dict) -> dict | None:
    """Profiled / unprofiled wall time of the traced steps (the same steps and batches in both runs)."""
    default = {line["step"]: line["wall_s"] for line in read_steps(default_run)}
    traced = {line["step"]: line["wall_s"] for line in read_steps(profiled_run)}
    steps = [s for s in range(window["first_step"], window["last_step"] + 1) if s in default and s in traced]
    if not steps:
        return None
    return {"steps": steps, **bench.spread([traced[s] / default[s] for s in steps]),
            "total_ratio": sum(traced[s] for s in steps) / sum(default[s] for s in steps)}


def section(report, found: reporting.Collected) -> None:
    record = reporting.pick_breakdown_run(found)
    if not report.begin(EXPERIMENT.title, record, EXPERIMENT.missing()):
        return
    breakdown = reporting.time_breakdown(record)
    report.text(f"From run `{breakdown['run']}`, which ran without the profiler"
                + ("." if "profile" in found.runs else f" ({EXPERIMENT.missing()})"))
    report.figure(pie(breakdown), "time_breakdown", "Share of wall time per category", [record])
    rows = [[c["name"], num(c["seconds"]), share(c)] for c in breakdown["categories"]]
    rows += [[f"  stage: {s['name']}", num(s["seconds"]), share(s)] for s in breakdown["stages"]]
    rows.append(["wall time", num(breakdown["wall_s"]), "100.0%"])
    report.table(Table("Where the time went (median over ranks, profiler off): the five categories, then the stages",
                       ["category / stage", "seconds", "share"], rows, "time_breakdown"))
    top_operators(report, found)


def share(row: dict) -> str:
    return num(row["percent"], 1) + "%"


def headline(found: reporting.Collected) -> Headline | None:
    """The five categories' shares of the wall time, largest first, as the section's table gives them."""
    record = reporting.pick_breakdown_run(found)
    if record is None:
        return None
    breakdown = reporting.time_breakdown(record)
    ordered = sorted(breakdown["categories"], key=lambda c: -c["seconds"])
    return Headline(", ".join(f"{c['name']} {share(c)}" for c in ordered) + f" of {num(breakdown['wall_s'])} s "
                    f"(run `{breakdown['run']}`, profiler off)", f"{ordered[0]['name']} takes the most")


def pie(breakdown: dict):
    from trainscope.tables import pyplot

    figure, axis = pyplot().subplots(figsize=(6.5, 4.5))
    shown = [c for c in breakdown["categories"] if c["percent"] > 0]
    axis.pie([c["seconds"] for c in shown], labels=[f"{c['name']}\n{c['percent']:.1f}%" for c in shown],
             startangle=90, counterclock=False, wedgeprops={"linewidth": 1, "edgecolor": "white"})
    axis.set_title(f"{breakdown['run']}: {breakdown['wall_s']:.1f} s on {breakdown['world_size']} x "
                   f"{breakdown['device']} ({breakdown['precision']}, profiler off)", fontsize=9)
    return figure


def top_operators(report, found: reporting.Collected) -> None:
    profiled = found.runs.get("profile", {}).get("profiled-r0")
    profile = RunView(profiled).profile if profiled else None
    if not profile or not profile.get("top_operators"):
        return
    rows = [[op["name"][:60], str(op["calls"]), num(op["milliseconds"])] for op in operator_rows(profile["top_operators"][:10])]
    report.table(Table("Top operators by self time (torch.profiler window of a separate, profiled run)",
                       ["operator", "calls", "ms"], rows, "top_operators"))
    overhead = (found.comparisons.get("profile") or {}).get("profiler_overhead")
    if overhead:
        window = profile["window"]
        report.text(f"Profiler overhead on the traced steps {window['first_step']}-{window['last_step']}: profiled / "
                    f"unprofiled step time {overhead['total_ratio']:.2f}x (per step {overhead['median']:.2f}x, "
                    f"{overhead['min']:.2f}-{overhead['max']:.2f}); the same steps and batches in both runs.")


EXPERIMENT = Experiment(
    name="profile", title="Where the time went", target="make profile", folder="profile", section=section,
    headline=headline,
    arguments=lambda parser: runs_option(parser, rounds=None), run=run,
    help="a run without and a run with the profiler: the time breakdown and the top operators")
