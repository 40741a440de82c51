"""make predict-check: the prediction made before each run (trainscope.predict) against what the run measured, over
runs of many shapes -- configs (CPU, bf16, 2-process DDP), batch sizes, sequence lengths and padding, activation
checkpointing on and off, LoRA, three models -- with the median and worst error of each predicted quantity and the
term of the model furthest off.

Each shape runs once (a prediction is judged against one run; its own noise is in the error). The allocator's share
is calibrated first on other shapes (`python -m trainscope.predict --calibrate`, which the make target runs).
"""

import os
import resource
import shlex
import statistics
import time
from pathlib import Path

from trainscope import bench, reporting
from trainscope.experiments.base import Experiment, ExperimentFailed, planned_arm, run_arm, runs_option
from trainscope.record_view import RunView
from trainscope.reporting import Headline
from trainscope.records import read_record
from trainscope.tables import Table, num, pyplot

ROBERTA = ["--model", "roberta-base", "--architecture-only", "--tokenizer", "embedded:minilm-l6"]
# name -> (config, train.py flags): none of them a calibration shape (trainscope.predict.CALIBRATION_SHAPES).
SHAPES = {
    "minilm-bs32": ("cpu", []),
    "minilm-bs16": ("cpu", ["--per-device-batch-size", "16"]),
    "minilm-bs64": ("cpu", ["--per-device-batch-size", "64"]),
    "minilm-bs32-ckpt": ("cpu", ["--gradient-checkpointing"]),
    "minilm-bs32-lora": ("cpu", ["--lora"]),
    "minilm-bs32-len64-padded": ("cpu", ["--max-seq-length", "64", "--pad-to-max-length"]),
    "minilm-bs16-grouped": ("cpu", ["--per-device-batch-size", "16", "--group-by-length"]),
    "minilm-bs16-accum2": ("cpu", ["--per-device-batch-size", "16", "--gradient-accumulation-steps", "2"]),
    "minilm-bf16-bs32": ("bf16", []),
    "minilm-bf16-bs32-ckpt": ("bf16", ["--gradient-checkpointing"]),
    "minilm-ddp-bs32": ("ddp", []),
    "minilm-ddp-bs16-lora": ("ddp", ["--per-device-batch-size", "16", "--lora"]),
    "tiny-bs32": ("cpu", ["--model", "embedded:tiny-bert"]),
    "roberta-bs8": ("cpu", [*ROBERTA, "--per-device-batch-size", "8"]),
    "roberta-bs8-lora": ("cpu", [*ROBERTA, "--per-device-batch-size", "8", "--lora"]),
}
QUANTITIES = {"peak_memory_gib": "peak memory", "step_s": "steady step", "run_s": "run time"}


def arguments(parser) -> None:
    runs_option(parser, rounds=None, config=None)
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES), metavar="SHAPE",
                        help=f"shapes to run (default all {len(SHAPES)}): {', '.join(SHAPES)}")


def machine_load() -> dict:
    """What the machine's cores have done so far, to tell what other processes took while the shapes ran: a
    prediction is of an undisturbed machine. The CPU seconds of the whole machine (/proc/stat) and of this process
    and the runs it launched and waited for (their own load is not interference); the 1-minute load average beside
    them, for the record."""
    from trainscope.environment import usable_cores

    own = sum(getattr(resource.getrusage(who), field) for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)
              for field in ("ru_utime", "ru_stime"))
    try:
        fields = [int(v) for v in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
        busy = (sum(fields[:3]) + sum(fields[5:8])) / os.sysconf("SC_CLK_TCK")  # user nice system, irq softirq steal
    except (OSError, ValueError, IndexError):
        busy = None
    return {"load_average_1min": round(os.getloadavg()[0], 2), "usable_cores": usable_cores(),
            "machine_cpu_s": busy, "own_cpu_s": own, "monotonic_s": time.monotonic()}


def other_cores(load: dict) -> float | None:
    """Cores other processes kept busy on average while the shapes ran: the machine's CPU seconds less this
    process's and its runs', over the wall time (None where /proc/stat could not be read or an older result)."""
    before, after = load["before"], load["after"]
    if before.get("machine_cpu_s") is None or after.get("machine_cpu_s") is None:
        return None
    wall = after["monotonic_s"] - before["monotonic_s"]
    others = (after["machine_cpu_s"] - before["machine_cpu_s"]) - (after["own_cpu_s"] - before["own_cpu_s"])
    return max(0.0, others) / wall if wall > 0 else None


# Other processes above a quarter of a core on average: the runs were slowed by what the predictions do not model.
BUSY_CORES = 0.25


def run(args, train_args: list[str]) -> dict:
    runs = Path(args.runs)
    arms = [planned_arm(name, *SHAPES[name]) for name in args.shapes]
    for arm in arms:
        if arm.skipped:
            print(f"skipped {arm.name}: {arm.skipped}", flush=True)
    load = {"before": machine_load()}
    for arm in (a for a in arms if a.skipped is None):
        run_arm(arm, train_args, runs, 0)
    load["after"] = machine_load()
    records = {arm.name: read_record(runs / f"{arm.name}-r0") for arm in arms if arm.skipped is None}
    rows = run_rows(records)
    if not rows:
        raise ExperimentFailed("no run recorded a prediction and its error")
    result = {"experiment": "predict-check", "train_args": train_args, "runs": rows, "summary": summarize(rows),
              "machine_load": load, "skipped": {a.name: a.skipped for a in arms if a.skipped}}
    bench.write_results(runs / "comparison", result, markdown(result, train_args))
    print((runs / "comparison.md").read_text())
    return result


# ---------------------------------------------------------------- rows (pure)


def run_rows(records: dict) -> list[dict]:
    """One row per run with a prediction: its shape, each quantity predicted and measured, the furthest term."""
    rows = []
    for name, record in records.items():
        view = RunView(record)
        errors = view.prediction_error
        if not errors:
            continue
        row = {"run": name.removesuffix("-r0"), "precision": view.precision, "world_size": view.world_size,
               "batch": view.setting("per_device_batch_size"), "memory_kind": errors.get("memory_kind"),
               "furthest": (errors.get("furthest") or {}).get("term")}
        for key in QUANTITIES:
            entry = errors.get(key) or {}
            row[key] = {k: entry.get(k) for k in ("predicted", "measured", "error")}
        row["terms"] = {f"memory: {k}": v for k, v in (errors.get("memory_terms") or {}).items() if v}
        row["terms"].update({f"time: {k}": v for k, v in (errors.get("time_terms") or {}).items() if v})
        peak, step = row["peak_memory_gib"]["measured"], row["step_s"]["measured"]
        for term, entry in row["terms"].items():
            total = peak if term.startswith("memory") else step
            entry["share_of_total"] = abs(entry["predicted"] - entry["measured"]) / total if total else None
        rows.append(row)
    return rows


def summarize(rows: list[dict]) -> dict:
    """Median and worst |error| of each quantity over the runs, and each term's median share of its total's error
    (the term furthest off: the largest)."""
    result = {"runs": len(rows)}
    for key in QUANTITIES:
        errors = [(abs(r[key]["error"]), r[key]["error"], r["run"]) for r in rows if r[key].get("error") is not None]
        if errors:
            worst = max(errors)
            result[key] = {"median_abs_error": statistics.median(e[0] for e in errors), "worst_error": worst[1],
                           "worst_run": worst[2], "runs": len(errors)}
    shares: dict = {}
    for row in rows:
        for term, entry in row["terms"].items():
            if entry.get("share_of_total") is not None:
                shares.setdefault(term, []).append((entry["share_of_total"], abs(entry["error"] or 0.0)))
    result["terms"] = {term: {"median_share_of_total": statistics.median(s for s, _ in values),
                              "median_abs_error": statistics.median(e for _, e in values), "runs": len(values)}
                       for term, values in shares.items()}
    if result["terms"]:
        result["furthest_term"] = max(result["terms"], key=lambda t: result["terms"][t]["median_share_of_total"])
    return result


def _pct(value) -> str:
    return f"{value:+.1%}" if value is not None else "-"


def run_table(rows: list[dict]) -> Table:
    cells = [[r["run"], r["precision"], str(r["world_size"]),
              *(cell for key in QUANTITIES for cell in (num(r[key]["predicted"], 3), num(r[key]["measured"], 3),
                                                        _pct(r[key]["error"]))),
              r["furthest"] or "-"] for r in rows]
    header = ["run", "precision", "procs"]
    for label in ("memory GiB", "step s", "run s"):
        header += [f"{label} pred.", "meas.", "error"]
    return Table("Predicted against measured, each run once", [*header, "furthest term"], cells, "prediction",
                 align="lll" + "rrr" * 3 + "l")


def term_table(summary: dict) -> Table:
    terms = sorted(summary.get("terms", {}).items(), key=lambda item: -item[1]["median_share_of_total"])
    cells = [[term, f"{t['median_abs_error']:.1%}", f"{t['median_share_of_total']:.1%}", str(t["runs"])]
             for term, t in terms]
    return Table("Each term of the model: its median error, and its error as a share of its total (peak or step)",
                 ["term", "median abs. error", "median share of total", "runs"], cells, "prediction-terms", align="lrrr")


def summary_text(summary: dict) -> str:
    parts = []
    for key, label in QUANTITIES.items():
        entry = summary.get(key)
        if entry:
            parts.append(f"{label}: median |error| {entry['median_abs_error']:.1%}, worst {_pct(entry['worst_error'])} "
                         f"({entry['worst_run']})")
    furthest = summary.get("furthest_term")
    text = f"Over {summary['runs']} runs, " + "; ".join(parts) + "."
    if furthest:
        text += (f" The term furthest off: {furthest} (its error is {summary['terms'][furthest]['median_share_of_total']:.1%}"
                 " of its total in the median run).")
    return text


def load_text(load: dict | None) -> str:
    if not load:
        return ""
    before, after = load["before"], load["after"]
    others = other_cores(load)
    if others is None:
        return (f"Machine load while the shapes ran: 1-minute load average {before['load_average_1min']} before, "
                f"{after['load_average_1min']} after, on {after['usable_cores']} usable cores (its own runs "
                "included: other processes not told apart).")
    return (f"Machine load while the shapes ran: other processes kept {others:.2f} of the {after['usable_cores']} "
            "usable cores busy on average (the machine's CPU time less this command's and its runs')"
            + (" -- a busy machine: its runs were slowed by other processes, which the predictions do not model."
               if others > BUSY_CORES else f": a quiet machine (at most {BUSY_CORES} of a core)."))


def markdown(result: dict, train_args: list[str]) -> list[str]:
    lines = ["# Experiment: predict-check", "", f"train.py flags: `{shlex.join(train_args)}`; each shape once.", "",
             summary_text(result["summary"]), "", load_text(result.get("machine_load")), "",
             *run_table(result["runs"]).markdown_lines(), "",
             *term_table(result["summary"]).markdown_lines()]
    if result.get("skipped"):
        lines += ["", *(f"- skipped {name}: {why}" for name, why in result["skipped"].items())]
    return lines


# ---------------------------------------------------------------- the report's section


def section(report, found: reporting.Collected) -> None:
    records = found.runs.get(EXPERIMENT.name, {})
    rows = run_rows(records)
    if not report.begin(EXPERIMENT.title, rows, EXPERIMENT.missing()):
        return
    summary = summarize(rows)
    figure, axes = pyplot().subplots(1, 3, figsize=(11, 3.8))
    for axis, (key, label) in zip(axes, QUANTITIES.items()):
        points = [(r[key]["measured"], r[key]["predicted"], r["run"]) for r in rows
                  if r[key]["measured"] is not None and r[key]["predicted"] is not None]
        if not points:
            continue
        measured, predicted, _ = zip(*points)
        top = max(max(measured), max(predicted)) * 1.1
        low = min(min(measured), min(predicted)) / 1.1
        logarithmic = low > 0 and top / low > 10  # runs of seconds beside runs of milliseconds
        low = low if logarithmic else 0.0
        axis.plot([low, top], [low, top], color="grey", linewidth=0.8, label="exact")
        for band in (0.9, 1.1):
            axis.plot([low, top], [low * band, top * band], color="grey", linewidth=0.5, linestyle=":")
        axis.scatter(measured, predicted, s=18, color="tab:blue")
        if logarithmic:
            axis.set_xscale("log")
            axis.set_yscale("log")
        axis.set_xlim(low or 0, top)
        axis.set_ylim(low or 0, top)
        unit = "GiB" if key == "peak_memory_gib" else "s"
        axis.set_xlabel(f"measured {label} ({unit})")
        axis.set_ylabel(f"predicted ({unit})")
        entry = summary.get(key) or {}
        axis.set_title(f"{label}: median |error| {entry.get('median_abs_error', float('nan')):.1%}", fontsize=9)
    figure.tight_layout()
    report.figure(figure, "prediction", "Predicted against measured (dotted: 10% either way)", list(records.values()))
    report.text(summary_text(summary))
    comparison = found.comparisons.get(EXPERIMENT.name) or {}
    if comparison.get("machine_load"):
        report.text(load_text(comparison["machine_load"]))
    report.table(run_table(rows))
    report.table(term_table(summary))


# The errors a prediction is held to (median over the shapes): the goals it is judged by on the report's first page.
GOALS = {"peak_memory_gib": 0.10, "step_s": 0.15}


def headline(found: reporting.Collected) -> Headline | None:
    """The errors over the committed shapes, in the section's words, and whether the medians meet their goals."""
    rows = run_rows(found.runs.get(EXPERIMENT.name, {}))
    if not rows:
        return None
    summary = summarize(rows)
    met = [f"{QUANTITIES[key]} {'within' if (summary.get(key) or {}).get('median_abs_error', 1.0) <= goal else 'beyond'} "
           f"{goal:.0%}" for key, goal in GOALS.items()]
    return Headline(summary_text(summary).rstrip("."), "median |error|: " + ", ".join(met))


EXPERIMENT = Experiment(name="predict-check", title="Prediction against measurement", target="make predict-check",
                        folder="predict", section=section, headline=headline, arguments=arguments, run=run,
                        help="the prediction of every run against what it measured, over many shapes",
                        needs=("experiment", "runs", "summary"), one_machine=False)
