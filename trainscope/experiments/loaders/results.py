"""The DataLoader num_workers sweep (loaders_bench.py, `make sweep-workers`): its figure, tables and report
section. The script writes <results>/loaders/loaders.json; the report and the script draw the same rows."""

from trainscope.core.results_view import LoaderSweepView, results_machine
from trainscope.experiments.base import Experiment
from trainscope.measure import bench
from trainscope.report import sections
from trainscope.report.sections import Headline
from trainscope.report.tables import Table, num, pyplot

PYTORCH_DEFAULT_WORKERS = 0


def curve_name(entry: dict) -> str:
    return (
        f"{entry['mode']} (batch {entry['batch_size']}, pin {'on' if entry['pin_memory'] else 'off'}, "
        f"persistent {'on' if entry['persistent_workers'] else 'off'}, prefetch {entry['prefetch_factor']})"
    )


def figure(report: dict):
    """Time per pass against num_workers (median, min-max band), one line per mode; data share in training."""
    view = LoaderSweepView(report)
    settings = view.settings_summary
    panels = [m for m in ("pass_s", "data_share") if any(s["metric"] == m for s in settings)]
    drawn, axes = pyplot().subplots(1, len(panels), figsize=(6.5 * len(panels), 4.2), squeeze=False)
    for axis, metric in zip(axes[0], panels):
        curves = {}
        for entry in settings:
            if entry["metric"] == metric:
                curves.setdefault(curve_name(entry), []).append(entry)
        scale = 100 if metric == "data_share" else 1
        for name, points in curves.items():
            points.sort(key=lambda p: p["num_workers"])
            x = [p["num_workers"] for p in points]
            (line,) = axis.plot(x, [p["median"] * scale for p in points], marker="o", label=name)
            axis.fill_between(
                x,
                [p["min"] * scale for p in points],
                [p["max"] * scale for p in points],
                alpha=0.2,
                color=line.get_color(),
            )
        axis.set_xlabel("num_workers (PyTorch default: 0)")
        axis.set_ylabel("pass over all training batches (s)" if metric == "pass_s" else "data share of step time (%)")
        axis.set_ylim(bottom=0)
        axis.grid(alpha=0.3)
        axis.legend(fontsize=7)
    machine = view.machine
    drawn.suptitle(
        f"DataLoader sweep: {view.dataset_rows} rows, {machine['device_name']}, "
        f"{machine['usable_cores']} cores (median, min-max band)",
        fontsize=9,
    )
    drawn.tight_layout()
    return drawn


def settings_table(report: dict) -> Table:
    rows = []
    for s in LoaderSweepView(report).settings_summary:
        passes = s["metric"] == "pass_s"
        cell = (lambda v: num(v, 3)) if passes else (lambda v: num(v, 1, percent=True))
        rows.append(
            [
                s["mode"],
                str(s["batch_size"]),
                "on" if s["pin_memory"] else "off",
                str(s["num_workers"]),
                f"{cell(s['median'])} ({'s/pass' if passes else 'data share'})",
                f"{cell(s['min'])} - {cell(s['max'])}",
                num(s.get("median_first_batch_s"), 3),
            ]
        )
    return Table(
        "DataLoader sweep: median over repeats, min - max",
        ["mode", "batch", "pin", "workers", "median", "range", "first batch s"],
        rows,
        "loaders",
        align="lrlrrrr",
    )


def knee_verdict(rows: list[dict], curve: str, summary: dict) -> dict | None:
    """The knee against the default (0 workers), repeat by repeat: pass time or step time (lower is faster)."""
    if summary["knee_workers"] == PYTORCH_DEFAULT_WORKERS or "default_median" not in summary:
        return None
    time_key = "pass_s" if summary["metric"] == "pass_s" else "step_s"
    by_repeat = {}
    for row in rows:
        if curve_name(row) == curve and row.get("pass", 0) == 0:
            by_repeat.setdefault(row["repeat"], {})[row["num_workers"]] = row[time_key]
    both = [r for r in by_repeat.values() if PYTORCH_DEFAULT_WORKERS in r and summary["knee_workers"] in r]
    if not both:
        return None
    return bench.compare_samples(
        [r[PYTORCH_DEFAULT_WORKERS] for r in both], [r[summary["knee_workers"]] for r in both], higher_is_better=False
    )


KNEE_IS_DEFAULT = "the knee is the default"


def knees(report: dict) -> list[tuple[str, dict, dict | None]]:
    """(curve, its summary, its knee against the default judged by today's test from the sweep's own rows)."""
    view = LoaderSweepView(report)
    return [
        (name, curve, knee_verdict(view.rows, name, curve) if view.rows else curve.get("knee_against_default"))
        for name, curve in view.curves.items()
    ]


def knee_table(report: dict) -> Table:
    """The knee of each curve against the default."""
    rows = [
        [
            name,
            str(curve["knee_workers"]),
            str(curve["best_workers"]),
            bench.ratio_text(against) if against else KNEE_IS_DEFAULT,
            against["verdict"] if against else "",
            f"`{curve['flags']}`",
        ]
        for name, curve, against in knees(report)
    ]
    return Table(
        "The knee of each curve against PyTorch's default (0 workers)",
        ["curve", "knee (workers)", "best (workers)", "knee vs default", "verdict", "flags"],
        rows,
        "loaders_knee",
        align="lrrrll",
    )


def headline(found: sections.Collected) -> Headline | None:
    """Each curve's knee against PyTorch's default, as the knee table gives it."""
    sweep = found.results.get("loaders")
    if not sweep:
        return None
    mode = lambda name: name.split(" (")[0]  # noqa: E731  the curve's loading mode
    parts = [
        f"{mode(name)}: knee at {curve['knee_workers']} workers, {bench.ratio_text(against)} against "
        f"{PYTORCH_DEFAULT_WORKERS}"
        if against
        else f"{mode(name)}: {KNEE_IS_DEFAULT} ({PYTORCH_DEFAULT_WORKERS} workers)"
        for name, curve, against in knees(sweep)
    ]
    verdicts = [f"{mode(name)}: {against['verdict']}" for name, _, against in knees(sweep) if against]
    return Headline("; ".join(parts), "; ".join(verdicts) or KNEE_IS_DEFAULT)


MODE_WORDS = {  # each curve's loading mode, for a reader who has not read the section
    "pretokenized": "with the data tokenized before training",
    "on-the-fly": "tokenizing each batch as it loads",
    "in-training": "inside real training steps",
    "device-copy": "copying each batch to the device",
}


def answer(found: sections.Collected) -> list[sections.Answer] | None:
    """How many workers, in words: each curve's knee against PyTorch's default, with its interval."""
    sweep = found.results.get("loaders")
    if not sweep:
        return None
    parts = []
    for name, curve, against in knees(sweep):
        mode = name.split(" (")[0]
        where = MODE_WORDS.get(mode, mode)
        if against:
            parts.append(
                f"{where.capitalize()}, {curve['knee_workers']} workers loaded "
                + sections.ratio_words(against, f"{PYTORCH_DEFAULT_WORKERS} (PyTorch's default)")
            )
        else:
            parts.append(
                f"{where.capitalize()}, no number of workers did better than {PYTORCH_DEFAULT_WORKERS} (PyTorch's "
                "default, loading in the training process)"
            )
    flags = {curve["flags"] for _, curve, against in knees(sweep) if against}
    tail = f". The flags to use: {'; '.join(f'`{f}`' for f in sorted(flags))}" if flags else ""
    return [sections.Answer(". ".join(parts) + tail, results_machine(sweep))]


def section(report, found: sections.Collected) -> None:
    sweep = found.results.get("loaders")
    if not report.begin(EXPERIMENT.title, sweep, EXPERIMENT.missing()):
        return
    view = LoaderSweepView(sweep)
    machine = view.machine
    report.text(
        f"{machine['device_name']}, {machine['usable_cores']} usable cores "
        f"({machine['cpu_budget_per_process']} per training process), {view.dataset_rows} training rows, "
        f"{view.repeats} repeats in alternating order. PyTorch's default is num_workers="
        f"{view.default_workers} (loading in the training process)."
    )
    report.figure(figure(sweep), "loaders", "Pass time against num_workers")
    report.table(settings_table(sweep))
    report.table(knee_table(sweep))


EXPERIMENT = Experiment(
    name="loaders",
    title="DataLoader num_workers",
    target="make sweep-workers",
    results="loaders/loaders.json",
    section=section,
    headline=headline,
    question="How many DataLoader workers (num_workers)?",
    answer=answer,
    needs=("benchmark", "machine", "sweep", "summary", "dataset_rows", "pytorch_default_num_workers"),
)
