"""make predict-check: the prediction made before each run (trainscope.predict) against what the run measured, over
runs of many shapes, with the median and worst error of each predicted quantity, calibrated (the runs' own
predictions) and on first use (the same runs predicted again with the calibration a new machine makes by itself).

How it works: docs/predict.md#in-the-code-how-make-predict-check-judges-trainscopeexperimentspredictionpy.
"""

import os
import shlex
import statistics
import time
from pathlib import Path

import torch

from trainscope import predict
from trainscope.core.environment import usable_cores
from trainscope.core.paths import GIB
from trainscope.core.record_view import RunView
from trainscope.core.records import read_record, write_json_atomic
from trainscope.experiments.base import Experiment, ExperimentFailed, planned_arm, run_arm, runs_option
from trainscope.measure import bench, peak
from trainscope.predict import calibration
from trainscope.predict.kept import BUSY_CORES, cpu_seconds
from trainscope.report import document, sections
from trainscope.report.document import Bullets, Heading, Paragraph
from trainscope.report.sections import Headline
from trainscope.report.tables import Table, num, pyplot

ROBERTA = ["--model", "roberta-base", "--architecture-only", "--tokenizer", "embedded:minilm-l6"]
# name -> (config, train.py flags): none of them a calibration shape (trainscope.predict.calibration.CALIBRATION_SHAPES, QUICK_SHAPES).
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
QUANTITIES = {
    "peak_memory_gib": "peak memory",
    "peak_above_baseline_gib": "peak above the start",
    "step_s": "steady step",
    "run_s": "run time",
}
MODES = {"calibrated": "calibrated", "first_use": "first use"}


def arguments(parser) -> None:
    runs_option(parser, rounds=None, config=None)
    parser.add_argument(
        "--shapes",
        nargs="+",
        default=list(SHAPES),
        choices=list(SHAPES),
        metavar="SHAPE",
        help=f"shapes to run (default all {len(SHAPES)}): {', '.join(SHAPES)}",
    )
    parser.add_argument(
        "--no-first-use",
        action="store_true",
        help="judge only the calibrated predictions (no first-use calibration, no second prediction)",
    )


def machine_load() -> dict:
    """What the machine's cores have done so far (trainscope.predict.kept.cpu_seconds: the whole machine's, and this
    process's with the runs it waited for, whose load is not interference), the 1-minute load average beside them:
    a prediction is of an undisturbed machine."""
    busy, own, clock = cpu_seconds() or (None, None, time.monotonic())
    return {"load_average_1min": round(os.getloadavg()[0], 2), "usable_cores": usable_cores(), "machine_cpu_s": busy,
            "own_cpu_s": own, "monotonic_s": clock}  # fmt: skip


def other_cores(load: dict) -> float | None:
    """Cores other processes kept busy on average while the shapes ran (trainscope.measure.peak.other_cores); None
    where /proc/stat could not be read."""
    return peak.other_cores(
        *[
            (r["machine_cpu_s"], r["own_cpu_s"], r["monotonic_s"]) if r.get("machine_cpu_s") is not None else None
            for r in (load["before"], load["after"])
        ]
    )


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
    result = {
        "experiment": "predict-check",
        "train_args": train_args,
        "runs": rows,
        "summary": summarize(rows),
        "machine_load": load,
        "skipped": {a.name: a.skipped for a in arms if a.skipped},
    }
    if not args.no_first_use:
        result["first_use"] = first_use_check(records)
    bench.write_results(runs / "comparison", result, markdown(result, train_args))
    print((runs / "comparison.md").read_text())
    return result


def first_use_check(records: dict) -> dict:
    """The runs predicted again with the calibration a new machine makes on first use (made now, timed), judged on
    what they measured; the machine's full calibration is put back afterwards."""
    device = torch.device((RunView(next(iter(records.values()))).device or "cpu").split(":")[0])
    full = calibration.read_calibration(device)
    try:
        calibration.calibration_path(device).unlink(missing_ok=True)
        fitted = calibration.first_use(device)
    except RuntimeError as error:  # judged on nothing: said, and the calibrated check stands
        return {"error": str(error), "calibration": {}, "at_bound": [], "runs": [], "summary": None}
    finally:
        if full:
            write_json_atomic(calibration.calibration_path(device), full)
    again = {
        name: RunView(record).with_prediction_error(repredicted(record, fitted))
        for name, record in records.items()
        if RunView(record).prediction
    }
    rows = run_rows(again)
    return {
        "calibration": {k: fitted.get(k) for k in ("method", "seconds", "measured", "shapes")},
        "at_bound": (fitted.get("time") or {}).get("at_bound") or [],
        "runs": rows,
        "summary": summarize(rows),
    }


def repredicted(record: dict, fitted: dict) -> dict:
    """The run's prediction made again here with the calibration `fitted`, from its settings, launch and the memory
    it held before its model (measured in the run), against what it measured."""
    view = RunView(record)
    settings = predict.settings_of(record)
    planned = predict.planned_run_of(record, settings)
    planned.rss_bytes = int(view.prediction_baseline_gib * GIB)
    block = predict.predict(planned, store=False, fitted=fitted)
    return predict.prediction_errors(block, view.summary, {})


# ---------------------------------------------------------------- rows (pure)


def run_rows(records: dict) -> list[dict]:
    """One row per run with a prediction: its shape, each quantity predicted and measured, the measured terms, the
    furthest of them, and the residual (the peak less the measured terms: not a term)."""
    rows = []
    for name, record in records.items():
        view = RunView(record)
        errors = view.prediction_error
        if not errors:
            continue
        row = {
            "run": name.removesuffix("-r0"),
            "precision": view.precision,
            "world_size": view.world_size,
            "batch": view.setting("per_device_batch_size"),
            "memory_kind": errors.get("memory_kind"),
            "calibration": errors.get("calibration"),
        }
        for key in QUANTITIES:
            entry = errors.get(key) or {}
            row[key] = {k: entry.get(k) for k in ("predicted", "measured", "error")}
        row["terms"] = {f"memory: {k}": v for k, v in (errors.get("memory_terms") or {}).items() if v}
        row["terms"].update({f"time: {k}": v for k, v in (errors.get("time_terms") or {}).items() if v})
        peak, step = row["peak_memory_gib"]["measured"], row["step_s"]["measured"]
        residual = errors.get("memory_residual") or errors.get("memory_terms", {}).get("rest")  # older records: "rest"
        row["residual"] = dict(residual) if residual else None
        for term, entry in [*row["terms"].items(), ("memory: residual", row["residual"])]:
            if entry is not None:
                total = peak if term.startswith("memory") else step
                entry["share_of_total"] = abs(entry["predicted"] - entry["measured"]) / total if total else None
        row["terms"].pop("memory: rest", None)
        # the measured term furthest off, from the terms themselves (older records named their residual so)
        shares = {
            term: entry["share_of_total"]
            for term, entry in row["terms"].items()
            if entry.get("share_of_total") is not None
        }
        row["furthest"] = max(shares, key=shares.get) if shares else None
        rows.append(row)
    return rows


def summarize(rows: list[dict]) -> dict:
    """Median and worst |error| of each quantity over the runs (the worst run named), each measured term's median
    share of its total's error (the term furthest off: the largest) and the residual's."""
    result = {"runs": len(rows)}
    for key in QUANTITIES:
        errors = [(abs(r[key]["error"]), r[key]["error"], r["run"]) for r in rows if r[key].get("error") is not None]
        if errors:
            worst = max(errors)
            result[key] = {
                "median_abs_error": statistics.median(e[0] for e in errors),
                "worst_error": worst[1],
                "worst_run": worst[2],
                "runs": len(errors),
            }
    shares: dict = {}
    for row in rows:
        for term, entry in row["terms"].items():
            if entry.get("share_of_total") is not None:
                shares.setdefault(term, []).append(entry)
    result["terms"] = {term: share_summary(entries) for term, entries in shares.items()}
    if result["terms"]:
        result["furthest_term"] = max(result["terms"], key=lambda t: result["terms"][t]["median_share_of_total"])
    residuals = [r["residual"] for r in rows if r.get("residual") and r["residual"].get("share_of_total") is not None]
    if residuals:
        result["residual"] = share_summary(residuals)
    return result


def share_summary(entries: list[dict]) -> dict:
    """A term's (or the residual's) median share of its total's error and median |error| over the runs."""
    return {
        "median_share_of_total": statistics.median(e["share_of_total"] for e in entries),
        "median_abs_error": statistics.median(abs(e["error"] or 0.0) for e in entries),
        "runs": len(entries),
    }


def _pct(value) -> str:
    return f"{value:+.1%}" if value is not None else "-"


TABLE_QUANTITIES = {"peak_memory_gib": "memory GiB", "step_s": "step s", "run_s": "run s"}


def run_table(rows: list[dict], mode: str = "calibrated") -> Table:
    cells = [
        [
            r["run"],
            r["precision"],
            str(r["world_size"]),
            *(
                cell
                for key in TABLE_QUANTITIES
                for cell in (num(r[key]["predicted"], 3), num(r[key]["measured"], 3), _pct(r[key]["error"]))
            ),
            _pct((r.get("peak_above_baseline_gib") or {}).get("error")),
            r["furthest"] or "-",
        ]
        for r in rows
    ]
    header = ["run", "precision", "procs"]
    for label in TABLE_QUANTITIES.values():
        header += [f"{label} pred.", "meas.", "error"]
    return Table(
        f"Predicted against measured, each run once ({mode})",
        [*header, "peak above start", "furthest term"],
        cells,
        "prediction" if mode == "calibrated" else "prediction-first-use",
        align="lll" + "rrr" * 3 + "rl",
    )


def term_table(summary: dict) -> Table:
    terms = sorted(summary.get("terms", {}).items(), key=lambda item: -item[1]["median_share_of_total"])
    if summary.get("residual"):
        terms.append(("memory: residual (the peak less the measured terms)", summary["residual"]))
    cells = [
        [term, f"{t['median_abs_error']:.1%}", f"{t['median_share_of_total']:.1%}", str(t["runs"])] for term, t in terms
    ]
    return Table(
        "Each term of the model: its median error, and its error as a share of its total (peak or step)",
        ["term", "median abs. error", "median share of total", "runs"],
        cells,
        "prediction-terms",
        align="lrrr",
    )


def summary_text(summary: dict, mode: str | None = None) -> str:
    parts = []
    for key, label in QUANTITIES.items():
        entry = summary.get(key)
        if entry:
            parts.append(
                f"{label}: median |error| {entry['median_abs_error']:.1%}, worst {_pct(entry['worst_error'])} "
                f"({entry['worst_run']})"
            )
    furthest, residual = summary.get("furthest_term"), summary.get("residual")
    text = f"{MODES[mode].capitalize() + ', o' if mode else 'O'}ver {summary['runs']} runs, " + "; ".join(parts) + "."
    if furthest:
        text += (
            f" The measured term furthest off: {furthest} (its error is "
            f"{summary['terms'][furthest]['median_share_of_total']:.1%} of its total in the median run)"
        )
        text += (
            f"; the residual (the peak less the measured terms, not a term) is off by "
            f"{residual['median_share_of_total']:.1%} of the peak in the median run."
            if residual
            else "."
        )
    return text


def goals_text(result: dict) -> str:
    """Each mode's median errors against their goals."""
    lines = []
    for mode in MODES:
        summary = result["summary"] if mode == "calibrated" else (result.get("first_use") or {}).get("summary")
        if not summary:
            continue
        met = [
            f"{QUANTITIES[key]} {(summary.get(key) or {}).get('median_abs_error', float('nan')):.1%} "
            f"({'within' if (summary.get(key) or {}).get('median_abs_error', 1.0) <= goal else 'beyond'} {goal:.0%})"
            for key, goal in GOALS[mode].items()
        ]
        lines.append(f"{MODES[mode]}: median |error| " + ", ".join(met))
    return "Goals: " + "; ".join(lines) + "." if lines else ""


def first_use_text(first: dict | None) -> str:
    if not first:
        return ""
    if first.get("error"):
        return f"First use: not judged ({first['error']})."
    made = first["calibration"]
    bounds = f" Held at a bound of its fit: {'; '.join(first['at_bound'])}." if first.get("at_bound") else ""
    return (
        f"First use: the calibration a new machine makes by itself took {made.get('seconds') or 0:.0f} s "
        f"({made.get('method')}); each run predicted again with it from its record.{bounds} "
        + summary_text(first["summary"], "first_use")
    )


def load_text(load: dict | None) -> str:
    if not load:
        return ""
    before, after = load["before"], load["after"]
    others = other_cores(load)
    if others is None:
        return (
            f"Machine load while the shapes ran: 1-minute load average {before['load_average_1min']} before, "
            f"{after['load_average_1min']} after, on {after['usable_cores']} usable cores (its own runs "
            "included: other processes not told apart)."
        )
    return (
        f"Machine load while the shapes ran: other processes kept {others:.2f} of the {after['usable_cores']} "
        "usable cores busy on average (the machine's CPU time less this command's and its runs')"
        + (
            " -- a busy machine: its runs were slowed by other processes, which the predictions do not model."
            if others > BUSY_CORES
            else f": a quiet machine (at most {BUSY_CORES} of a core)."
        )
    )


def markdown(result: dict, train_args: list[str]) -> list[str]:
    first_use = (result.get("first_use") or {}).get("runs")
    return document.markdown(
        [
            Heading("Experiment: predict-check"),
            Paragraph(f"train.py flags: `{shlex.join(train_args)}`; each shape once."),
            *map(Paragraph, (goals_text(result), summary_text(result["summary"], "calibrated"))),
            *map(Paragraph, (first_use_text(result.get("first_use")), load_text(result.get("machine_load")))),
            run_table(result["runs"]),
            term_table(result["summary"]),
            run_table(first_use, "first use") if first_use else None,
            Bullets([f"skipped {name}: {why}" for name, why in (result.get("skipped") or {}).items()]),
        ]
    )


# ---------------------------------------------------------------- the report's section


def section(report, found: sections.Collected) -> None:
    records = found.runs.get(EXPERIMENT.name, {})
    rows = run_rows(records)
    if not report.begin(EXPERIMENT.title, rows, EXPERIMENT.missing()):
        return
    summary = summarize(rows)
    figure, axes = pyplot().subplots(1, 3, figsize=(11, 3.8))
    for axis, key in zip(axes, TABLE_QUANTITIES):
        label = QUANTITIES[key]
        points = [
            (r[key]["measured"], r[key]["predicted"], r["run"])
            for r in rows
            if r[key]["measured"] is not None and r[key]["predicted"] is not None
        ]
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
    report.text(summary_text(summary, "calibrated"))
    comparison = found.comparisons.get(EXPERIMENT.name) or {}
    if comparison.get("first_use"):
        report.text(first_use_text(comparison["first_use"]))
    if comparison.get("machine_load"):
        report.text(load_text(comparison["machine_load"]))
    report.table(run_table(rows))
    report.table(term_table(summary))


# The errors a prediction is held to (median over the shapes): the goals it is judged by on the report's first page.
GOALS = {
    "calibrated": {"peak_memory_gib": 0.10, "step_s": 0.15},
    "first_use": {"peak_memory_gib": 0.15, "step_s": 0.15},
}


def headline(found: sections.Collected) -> Headline | None:
    """The median errors over the committed shapes, calibrated and on first use (where the comparison has it), and
    whether each meets its goal: short, for the first page (the section has the worst shapes and the terms)."""
    rows = run_rows(found.runs.get(EXPERIMENT.name, {}))
    if not rows:
        return None
    first = ((found.comparisons.get(EXPERIMENT.name) or {}).get("first_use") or {}).get("summary")
    modes = {"calibrated": summarize(rows), **({"first_use": first} if first else {})}
    answer, verdict = [], []
    for mode, summary in modes.items():
        errors = {key: (summary.get(key) or {}).get("median_abs_error") for key in GOALS[mode]}
        answer.append(
            f"{MODES[mode]}, "
            + ", ".join(f"{QUANTITIES[key]} {error:.1%}" for key, error in errors.items() if error is not None)
        )
        verdict.append(
            f"{MODES[mode]}: "
            + ", ".join(
                f"{QUANTITIES[key]} {'within' if error <= goal else 'beyond'} {goal:.0%}"
                for (key, goal), error in zip(GOALS[mode].items(), errors.values())
                if error is not None
            )
        )
    return Headline(
        f"over {len(rows)} runs, median |error|: " + "; ".join(answer), "median |error|: " + "; ".join(verdict)
    )


EXPERIMENT = Experiment(
    name="predict-check",
    title="Prediction against measurement",
    target="make predict-check",
    folder="predict",
    section=section,
    headline=headline,
    arguments=arguments,
    run=run,
    help="the prediction of every run against what it measured, over many shapes",
    needs=("experiment", "runs", "summary"),
    one_machine=False,
)
