"""Report rows: pure functions from run records and sweep results to table rows. No plotting, no I/O
except `collect`, which finds and reads the records (skipping what is not one, with a warning), and
`save_figure`, which writes a figure the scripts have drawn."""

import json
import sys
from dataclasses import dataclass, field
from pathlib import Path

from trainscope.records import read_record, read_steps
from trainscope.timing import CATEGORIES, STAGES

EXPERIMENTS = {  # folder under runs/ -> the make target that produces it
    "profile": "make profile",
    "amp": "make amp-compare",
    "ckpt": "make ckpt-compare",
    "batch": "make batch-sweep",
    "matrix": "make matrix",
}
RESULTS = {"loaders": ("loaders/loaders.json", "make sweep-workers"),
           "compare_dp": ("compare_dp/compare_dp.json", "make compare-dp")}


def save_figure(figure, stem: Path, **savefig_options) -> list[Path]:
    """Write a matplotlib figure as stem.png and stem.pdf and close it."""
    import matplotlib.pyplot as plt

    paths = [Path(f"{stem}.{suffix}") for suffix in ("png", "pdf")]
    for path in paths:
        figure.savefig(path, dpi=150, **savefig_options)
    plt.close(figure)
    return paths


@dataclass
class Collected:
    runs: dict = field(default_factory=dict)        # experiment -> {run name: record (with "steps")}
    other_runs: list = field(default_factory=list)  # complete records outside the experiment folders
    results: dict = field(default_factory=dict)     # loaders / compare_dp / batch_sweep -> parsed JSON
    warnings: list = field(default_factory=list)


def collect(runs_dir: Path, results_dir: Path) -> Collected:
    """Read every run record under runs_dir and the sweep results under results_dir."""
    found = Collected()
    for path in sorted(Path(runs_dir).rglob("record.json")) if Path(runs_dir).exists() else []:
        try:
            record = read_record(path.parent)
        except ValueError as error:
            found.warnings.append(f"skipped {error}")
            continue
        if record.get("status") != "complete":
            found.warnings.append(f"skipped {path}: status {record.get('status')!r}, not complete")
            continue
        record["steps"] = read_steps(path.parent)
        record["path"] = str(path.parent)
        experiment = path.parent.parent.name if path.parent.parent != Path(runs_dir) else None
        if experiment in EXPERIMENTS:
            found.runs.setdefault(experiment, {})[path.parent.name] = record
        else:
            found.other_runs.append(record)
    for name, (relative, _) in RESULTS.items():
        found.results[name] = _read_json(Path(results_dir) / relative, found.warnings)
    found.results["batch_sweep"] = _read_json(Path(runs_dir) / "batch" / "sweep.json", found.warnings)
    found.results["matrix"] = _read_json(Path(runs_dir) / "matrix" / "matrix.json", found.warnings)
    for warning in found.warnings:
        print(f"warning: {warning}", file=sys.stderr)
    return found


def _read_json(path: Path, warnings: list):
    if not path.exists():
        return None
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as error:
        warnings.append(f"skipped {path}: not readable JSON ({error})")
        return None


def missing(experiment: str) -> str:
    target = EXPERIMENTS.get(experiment) or RESULTS[experiment][1]
    return f"Not run yet: `{target}` produces it."


# ---------------------------------------------------------------- where the time went


def time_breakdown(record: dict) -> dict:
    """The five categories and the finer stages of a run (median over ranks), seconds and % of wall."""
    run = record["summary"]["timing"]["across_ranks"]["run"]
    wall = run["wall_s"]["median"]
    categories = [{"name": name, "seconds": run["category_seconds"][name]["median"]} for name in CATEGORIES]
    stages = [{"name": stage, "seconds": run["seconds"][stage]["median"]} for stage in (*STAGES, "other")]
    total = sum(c["seconds"] for c in categories)
    for row in categories + stages:
        row["percent"] = 100 * row["seconds"] / total if total else 0.0
    return {"run": record["run_name"], "wall_s": wall, "categories": categories, "stages": stages,
            "world_size": record["summary"]["world_size"], "device": record["environment"]["device_name"],
            "precision": record["environment"]["effective_precision"]}


def pick_profile_run(found: Collected) -> dict | None:
    """The `make profile` run, else the newest complete run anywhere."""
    if found.runs.get("profile"):
        return next(iter(found.runs["profile"].values()))
    candidates = found.other_runs + [r for runs in found.runs.values() for r in runs.values()]
    return max(candidates, key=lambda r: r.get("finished", ""), default=None)


# ---------------------------------------------------------------- runs side by side


def run_row(record: dict) -> dict:
    summary = record["summary"]
    memory = summary["memory"]
    peak = memory.get("max_allocated_gib") or memory["peak_rss_gib"]
    validation = summary["validation"][-1] if summary["validation"] else {}
    return {
        "run": record["run_name"],
        "precision": record["environment"]["effective_precision"],
        "requested_precision": record["environment"]["requested_precision"],
        "world_size": summary["world_size"],
        "validation_accuracy": validation.get("accuracy"),
        "test_accuracy": summary["test"]["accuracy"],
        "test_macro_f1": summary["test"]["macro_f1"],
        "wall_s": summary["wall_s"],
        "samples_per_s": summary["throughput"]["samples_per_s"],
        "step_s": summary["throughput"]["step_s"],
        "peak_memory_gib": peak["max"],
        "memory_kind": "max allocated" if "max_allocated_gib" in memory else "peak RSS",
        "final_train_loss": summary["final_train_loss"],
    }


def amp_rows(runs: dict) -> list[dict]:
    """fp32 first, then each mixed-precision run with its ratios to fp32."""
    rows = [run_row(r) for r in runs.values()]
    rows.sort(key=lambda r: (r["precision"] not in ("fp32", "tf32"), r["run"]))
    if not rows:
        return []
    baseline = rows[0]
    for row in rows:
        row["speedup"] = row["samples_per_s"] / baseline["samples_per_s"]
        row["wall_ratio"] = row["wall_s"] / baseline["wall_s"]
        row["memory_ratio"] = row["peak_memory_gib"] / baseline["peak_memory_gib"]
        row["test_accuracy_delta"] = row["test_accuracy"] - baseline["test_accuracy"]
    return rows


def loss_curves(runs: dict) -> dict:
    """Run name -> (steps, training losses), from each run's step lines."""
    return {name: ([line["step"] for line in r["steps"]], [line["loss"] for line in r["steps"]])
            for name, r in runs.items()}


def ckpt_rows(runs: dict) -> list[dict]:
    rows = [run_row(r) for name, r in sorted(runs.items(), key=lambda kv: kv[0] != "off")]
    for row, record in zip(rows, [runs[r["run"]] for r in rows]):
        row["gradient_checkpointing"] = record["settings"]["gradient_checkpointing"]
    if len(rows) >= 2:
        off = rows[0]
        for row in rows:
            row["step_ratio"] = row["step_s"] / off["step_s"]
            row["memory_ratio"] = row["peak_memory_gib"] / off["peak_memory_gib"]
    return rows


def batch_rows(sweep: dict | None) -> list[dict]:
    return [row for row in (sweep or {}).get("rows", [])]


def stage_seconds_per_step(record: dict) -> dict:
    """Training stages per optimizer step (steady phase, median over ranks)."""
    summary = record["summary"]
    phase = "steady" if summary["timing"]["across_ranks"]["steady"]["wall_s"]["median"] > 0 else "run"
    steps = summary["throughput"]["optimizer_steps"] or summary["optimizer_steps"]
    seconds = summary["timing"]["across_ranks"][phase]["seconds"]
    return {stage: seconds[stage]["median"] / steps for stage in ("data", "forward", "backward", "optimizer", "other")}


def attribution(baseline: dict, other: dict) -> list[dict]:
    """Which stage got faster or slower, by how much, from `baseline` to `other` (per optimizer step).

    The deltas add up to the change in step time; `share` is each stage's part of that change.
    """
    before, after = stage_seconds_per_step(baseline), stage_seconds_per_step(other)
    total = sum(after.values()) - sum(before.values())
    return [{"stage": stage, "baseline_s": before[stage], "other_s": after[stage],
             "delta_s": after[stage] - before[stage],
             "share_of_change": (after[stage] - before[stage]) / total if total else 0.0}
            for stage in before]


def matrix_rows(runs: dict, order: list[str] | None = None) -> list[dict]:
    names = [n for n in (order or []) if n in runs] + sorted(n for n in runs if n not in (order or []))
    rows = []
    for name in names:
        row = run_row(runs[name])
        row.update({f"{stage}_s_per_step": value for stage, value in stage_seconds_per_step(runs[name]).items()})
        rows.append(row)
    if rows:
        for row in rows:
            row["speedup"] = row["samples_per_s"] / rows[0]["samples_per_s"]
    return rows
