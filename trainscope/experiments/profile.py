"""make profile: where the time goes, from a run without the profiler (the report's pie chart and table), the top
operators from a profiled run of the same steps (the two runs' step lines give the profiler's own cost), and the gap
to this machine's measured matmul peak, per precision (the pair again under bf16.yaml where bf16 is faster here)."""

from pathlib import Path

import torch

from trainscope.core import launching
from trainscope.core.record_view import RunView
from trainscope.core.records import read_record, read_steps
from trainscope.experiments.base import Arm, Experiment, experiment, runs_option, write
from trainscope.measure import bench, gap, peak
from trainscope.measure.profiling import operator_rows
from trainscope.report import sections
from trainscope.report.sections import Headline
from trainscope.report.tables import Table, num, pyplot

PEAK_SHARE_COLUMNS = ["run", "precision", "peak GFLOP/s", "achieved GFLOP/s", "share of peak", "on real tokens GFLOP/s",
                      "share on real tokens", "floor s", "training s"]  # fmt: skip


def run(args, train_args: list[str]) -> dict:
    runs = Path(args.runs)
    flags = ["--log-every", "1"]
    arms = [Arm("default", args.config, flags), Arm("profiled", args.config, [*flags, "--profile"])]
    if args.bf16 == "on" or (args.bf16 == "auto" and bf16_is_faster_here(args.config)):
        arms += [Arm("bf16", "bf16", flags), Arm("bf16-profiled", "bf16", [*flags, "--profile"])]
    summary = experiment(runs, "profile", arms, train_args, rounds=1)
    window = RunView(read_record(runs / "profiled-r0")).profile["window"]
    summary["profiler_overhead"] = profiler_overhead(runs / "default-r0", runs / "profiled-r0", window)
    write(runs, "profile", summary, train_args, rounds=1)
    return summary


def bf16_is_faster_here(config: str | None) -> bool:
    """Whether the bf16 pair is worth running: on a GPU always (bf16 is what it trains in), on a CPU where this
    machine's bf16 matmuls measured faster than its fp32 ones (emulated bf16 would take an hour here)."""
    if config == "bf16" or not launching.plan("bf16").runnable:
        return False
    if launching.plan("bf16").on_cpu is False:
        return True
    cpu = torch.device("cpu")
    rates = {p: peak.rate(cpu, p, peak.square(cpu), processes=1) for p in ("fp32", "bf16")}
    return bool(rates["bf16"] and rates["bf16"].tflops > rates["fp32"].tflops)


def profiler_overhead(default_run: Path, profiled_run: Path, window: dict) -> dict | None:
    """Profiled / unprofiled wall time of the traced steps (the same steps and batches in both runs)."""
    default = {line["step"]: line["wall_s"] for line in read_steps(default_run)}
    traced = {line["step"]: line["wall_s"] for line in read_steps(profiled_run)}
    steps = [s for s in range(window["first_step"], window["last_step"] + 1) if s in default and s in traced]
    if not steps:
        return None
    return {
        "steps": steps,
        **bench.spread([traced[s] / default[s] for s in steps]),
        "total_ratio": sum(traced[s] for s in steps) / sum(default[s] for s in steps),
    }


def section(report, found: sections.Collected) -> None:
    record, why = sections.breakdown_choice(found)
    if not report.begin(EXPERIMENT.title, record, EXPERIMENT.missing()):
        return
    breakdown = sections.time_breakdown(record)
    report.text(
        f"From run `{breakdown['run']}` ({why}; `--run NAME` picks another), which ran without the profiler"
        + ("." if "profile" in found.runs else f" ({EXPERIMENT.missing()})")
    )
    report.figure(pie(breakdown), "time_breakdown", "Share of wall time per category", [record])
    rows = [[c["name"], num(c["seconds"]), share(c)] for c in breakdown["categories"]]
    rows += [[f"  stage: {s['name']}", num(s["seconds"]), share(s)] for s in breakdown["stages"]]
    rows.append(["wall time", num(breakdown["wall_s"]), "100.0%"])
    report.table(
        Table(
            "Where the time went (median over ranks, profiler off): the five categories, then the stages",
            ["category / stage", "seconds", "share"],
            rows,
            "time_breakdown",
        )
    )
    top_operators(report, found)
    peak_gap(report, found)


def sources(found: sections.Collected) -> list[tuple[str, dict]]:
    """The section's runs: the time breakdown's (trainscope.report.sections.pick_breakdown_run) and make profile's."""
    main, runs = sections.pick_breakdown_run(found), found.runs.get("profile", {})
    own = list(runs.items())
    return own if main is None or any(main is r for r in runs.values()) else [(RunView(main).name, main), *own]


def share(row: dict) -> str:
    return num(row["percent"], 1) + "%"


def ordered_breakdown(found: sections.Collected) -> tuple[dict, str, dict, list] | None:
    """(the main run, why it is the main run, its time breakdown, its categories largest first), or None."""
    record, why = sections.breakdown_choice(found)
    if record is None:
        return None
    breakdown = sections.time_breakdown(record)
    return record, why, breakdown, sorted(breakdown["categories"], key=lambda c: -c["seconds"])


def headline(found: sections.Collected) -> Headline | None:
    """The five categories' shares of the wall time, largest first, as the section's table gives them."""
    if (chosen := ordered_breakdown(found)) is None:
        return None
    _, why, breakdown, ordered = chosen
    return Headline(
        ", ".join(f"{c['name']} {share(c)}" for c in ordered) + f" of {num(breakdown['wall_s'])} s "
        f"(run `{breakdown['run']}`, {why}, profiler off)",
        f"{ordered[0]['name']} takes the most",
    )


def answer(found: sections.Collected) -> list[sections.Answer] | None:
    """Where a step's time goes, in words: the main run's categories, largest first."""
    if (chosen := ordered_breakdown(found)) is None:
        return None
    record, why, breakdown, ordered = chosen
    rest = ", ".join(f"{c['name']} {share(c)}" for c in ordered[1:])
    data = next(c for c in ordered if c["name"] == "data loading")
    return [
        sections.Answer(
            f"In `{breakdown['run']}` ({why}: {num(breakdown['wall_s'])} s, {breakdown['world_size']} "
            f"process{'es' * (breakdown['world_size'] != 1)}, {breakdown['precision']}), {ordered[0]['name']} took "
            f"the most time, {share(ordered[0])}; then {rest}. Waiting for data was {share(data)} of it",
            RunView(record).machine,
        )
    ]


def pie(breakdown: dict):

    figure, axis = pyplot().subplots(figsize=(6.5, 4.5))
    shown = [c for c in breakdown["categories"] if c["percent"] > 0]
    axis.pie(
        [c["seconds"] for c in shown],
        labels=[f"{c['name']}\n{c['percent']:.1f}%" for c in shown],
        startangle=90,
        counterclock=False,
        wedgeprops={"linewidth": 1, "edgecolor": "white"},
    )
    axis.set_title(
        f"{breakdown['run']}: {breakdown['wall_s']:.1f} s on {breakdown['world_size']} x "
        f"{breakdown['device']} ({breakdown['precision']}, profiler off)",
        fontsize=9,
    )
    return figure


def top_operators(report, found: sections.Collected) -> None:
    profiled = found.runs.get("profile", {}).get("profiled-r0")
    profile = RunView(profiled).profile if profiled else None
    if not profile or not profile.get("top_operators"):
        return
    rows = [
        [op["name"][:60], str(op["calls"]), num(op["milliseconds"])]
        for op in operator_rows(profile["top_operators"][:10])
    ]
    report.table(
        Table(
            "Top operators by self time (torch.profiler window of a separate, profiled run)",
            ["operator", "calls", "ms"],
            rows,
            "top_operators",
        )
    )
    overhead = (found.comparisons.get("profile") or {}).get("profiler_overhead")
    if overhead:
        window = profile["window"]
        report.text(
            f"Profiler overhead on the traced steps {window['first_step']}-{window['last_step']}: profiled / "
            f"unprofiled step time {overhead['total_ratio']:.2f}x (per step {overhead['median']:.2f}x, "
            f"{overhead['min']:.2f}-{overhead['max']:.2f}); the same steps and batches in both runs."
        )


def peak_gap(report, found: sections.Collected) -> None:
    """Per precision: the unprofiled run's share of this machine's measured matmul peak, and the profiled run's gap
    table and figure (the floor, the matmuls above it, every other category)."""
    pairs = profiled_pairs(found)
    if not pairs:
        return
    report.text(
        "The gap to the machine's limit: achieved model FLOP/s (PaLM) over this machine's measured matmul "
        "peak for the precision in effect (a benchmark of its own matmuls, trainscope.measure.peak) -- not the "
        "datasheet MFU. The floor is the profiled matmuls' FLOPs at that peak; everything above it is the gap."
    )
    report.table(peak_share_table(pairs))
    for name, _plain, traced in pairs:
        where_the_gap_went(report, name, traced)


def profiled_pairs(found: sections.Collected) -> list[tuple[str, dict | None, dict]]:
    """(name, unprofiled run, profiled run) for the default precision and bf16, where the profiled run has a gap
    breakdown."""
    runs = found.runs.get("profile", {})
    pairs = [
        (name, runs.get(f"{name}-r0"), runs.get(f"{profiled}-r0"))
        for name, profiled in (("default", "profiled"), ("bf16", "bf16-profiled"))
    ]
    return [(name, plain, traced) for name, plain, traced in pairs if traced and RunView(traced).gap_breakdown]


def peak_share_row(plain: dict | None, traced: dict) -> list[str]:
    """One run against the measured peak: the unprofiled run's figures (the profiled run's where it is missing)."""
    view = RunView(plain or traced)
    measured = view.measured_peak or {}
    estimate = measured.get("gap_estimate") or {}
    return [
        view.name,
        view.precision,
        num((measured.get("peak_tflops") or 0) * 1e3, 0),
        num((measured.get("achieved_tflops") or 0) * 1e3, 0),
        num(measured.get("share"), 1, percent=True),
        num(measured.get("real_tflops") * 1e3 if measured.get("real_tflops") else None, 0),
        num(measured.get("real_share"), 1, percent=True),
        num(estimate.get("floor_s")),
        num(estimate.get("train_s")),
    ]


def peak_share_table(pairs: list[tuple[str, dict | None, dict]]) -> Table:
    """A row per precision: its run against this machine's measured matmul peak."""
    return Table(
        "Each run against this machine's measured matmul peak (steady training, profiler off; the "
        "floor is the model FLOPs at the peak, an estimate; real tokens: padding positions not counted)",
        PEAK_SHARE_COLUMNS,
        [peak_share_row(plain, traced) for _name, plain, traced in pairs],
        "peak_share",
    )


def where_the_gap_went(report, name: str, traced: dict) -> None:
    """The profiled run's gap table and figure, and the attention kernels it ran."""
    view = RunView(traced)
    peak_tflops = view.measured_peak_tflops()
    gap_rows = gap.rows(view.gap_breakdown, peak_tflops, view.padding_flops_share)
    report.table(gap_table(name, view, gap_rows, peak_tflops))
    report.figure(
        gap_figure(view.name, view.precision, gap_rows),
        f"peak_gap_{name}",
        f"Where the traced steps' time went against the {view.precision} matmul floor",
        [traced],
    )
    attention = view.gap_breakdown.get("attention_ops") or {}
    if attention:
        report.text(
            f"Attention in {view.name} ran as: "
            + ", ".join(f"`{op}` {s * 1e3:.1f} ms" for op, s in list(attention.items())[:5])
            + "."
        )


def gap_table(name: str, view: RunView, gap_rows: list[dict], peak_tflops: float | None) -> Table:
    """The gap's parts in ms and as shares of the traced steps, which close the table."""
    breakdown = view.gap_breakdown
    rate = gap.matmul_rate(breakdown)
    table_rows = [
        [
            r["part"],
            num(r["seconds"] * 1e3 if r["seconds"] is not None else None, 1),
            num(r["share"], 1, percent=True),
        ]
        for r in gap_rows
    ]
    table_rows.append(["traced steps", num(breakdown["window_s"] * 1e3, 1), "100.0%"])
    return Table(
        f"Where the gap to the measured {view.precision} matmul peak went ({view.name}: "
        f"{breakdown['basis']} over the traced steps; the matmuls ran at "
        f"{num((rate or 0) * 1e3, 0)} GFLOP/s against a peak of {num((peak_tflops or 0) * 1e3, 0)})",
        ["part", "ms", "share"],
        table_rows,
        f"peak_gap_{name}",
    )


def gap_figure(run: str, precision: str, gap_rows: list[dict]):

    shown = [r for r in gap_rows if r["seconds"] is not None and r["seconds"] > 0]
    figure, axis = pyplot().subplots(figsize=(6.5, 3.8))
    axis.barh(
        [r["part"] for r in shown][::-1],
        [r["seconds"] * 1e3 for r in shown][::-1],
        color=["tab:green" if r["part"].endswith("(floor)") else "tab:gray" for r in shown][::-1],
    )
    axis.set_xlabel("ms over the traced steps (self time)")
    axis.set_title(f"{run} ({precision}): the matmul floor and the gap", fontsize=9)
    figure.tight_layout()
    return figure


EXPERIMENT = Experiment(
    name="profile",
    title="Where the time went",
    target="make profile",
    folder="profile",
    section=section,
    headline=headline,
    question="Where does a training step's time go?",
    answer=answer,
    sources=sources,
    arguments=lambda parser: (
        runs_option(parser, rounds=None),
        parser.add_argument(
            "--bf16",
            choices=["auto", "on", "off"],
            default="auto",
            help="also the pair under accelerate_configs/bf16.yaml: auto where bf16 matmuls measured faster than fp32 "
            "here (always on a GPU)",
        ),
    ),
    run=run,
    help="a run without and a run with the profiler (and the same in bf16 where it is faster here): the time "
    "breakdown, the top operators and the gap to the measured matmul peak",
)
