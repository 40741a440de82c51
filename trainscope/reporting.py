"""Report rows: pure functions from run records and results to table rows. No plotting and no I/O,
except `collect`, which finds and reads the inputs: every record and results file it reads is listed
with its sha256 (the report's provenance), and what it cannot use is skipped with a one-line reason.

Inputs: <runs>/<experiment>/<run>/record.json (+ steps.jsonl) and <runs>/<experiment>/comparison.json
for the experiments below; <results>/loaders/loaders.json and <results>/compare_dp/compare_dp.json.
"""

import json
from dataclasses import dataclass, field
from pathlib import Path

from trainscope.records import read_record, read_steps
from trainscope.summary import peak_memory
from trainscope.timing import CATEGORIES, STAGES

EXPERIMENTS = {  # folder under runs/ -> the make target that produces it
    "profile": "make profile",
    "amp": "make amp-compare",
    "ckpt": "make ckpt-compare",
    "batch": "make batch-sweep",
    "matrix": "make matrix",
    "ddp_cost": "make ddp-cost",
    "tune": "make tune",
}
RESULTS = {"loaders": ("loaders/loaders.json", "make sweep-workers"),
           "compare_dp": ("compare_dp/compare_dp.json", "make compare-dp")}


@dataclass
class Collected:
    runs: dict = field(default_factory=dict)          # experiment -> {run name: record (with "steps")}
    other_runs: list = field(default_factory=list)    # complete records outside the experiment folders
    comparisons: dict = field(default_factory=dict)   # experiment -> comparison.json
    results: dict = field(default_factory=dict)       # loaders / compare_dp / ... -> parsed JSON
    inputs: list = field(default_factory=list)        # every file read, for the digests
    skipped: list = field(default_factory=list)       # one line per input that could not be used


def collect(runs_dir: Path, results_dir: Path) -> Collected:
    """Read every run record under runs_dir, the experiments' comparisons and the results under results_dir."""
    found = Collected()
    runs_dir, results_dir = Path(runs_dir), Path(results_dir)
    for path in sorted(runs_dir.rglob("record.json")) if runs_dir.exists() else []:
        _collect_record(found, path, runs_dir)
    for experiment in EXPERIMENTS:
        comparison = _read_json(runs_dir / experiment / "comparison.json", found)
        if comparison is not None:
            found.comparisons[experiment] = comparison
    for name, (relative, _) in RESULTS.items():
        found.results[name] = _read_json(results_dir / relative, found)
    return found


def _collect_record(found: Collected, path: Path, runs_dir: Path) -> None:
    try:
        record = read_record(path.parent)
    except ValueError as error:
        found.skipped.append(str(error))
        return
    if record.get("status") != "complete":
        found.skipped.append(f"{path}: status {record.get('status')!r}, not complete")
        return
    record["steps"] = read_steps(path.parent, found.skipped)
    record["path"] = str(path.parent)
    found.inputs += [path] + ([path.parent / "steps.jsonl"] if (path.parent / "steps.jsonl").exists() else [])
    experiment = path.parent.parent.name if path.parent.parent != runs_dir else None
    if experiment in EXPERIMENTS:
        found.runs.setdefault(experiment, {})[path.parent.name] = record
    else:
        found.other_runs.append(record)


def _read_json(path: Path, found: Collected):
    if not path.exists():
        return None
    try:
        value = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        found.skipped.append(f"{path}: not readable JSON ({' '.join(str(error).split())})")
        return None
    found.inputs.append(path)
    return value


def missing(experiment: str) -> str:
    target = EXPERIMENTS.get(experiment) or RESULTS[experiment][1]
    return f"Not run yet: `{target}` produces it."


def warnings_of(records) -> list[str]:
    """'run: [code] message' lines for the records a figure shows."""
    return [f"{r['run_name']}: [{w['code']}] {w['message']}" for r in records for w in r.get("warnings", [])]


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


def pick_breakdown_run(found: Collected) -> dict | None:
    """The time breakdown comes from a run without the profiler: `make profile`'s default run, else the
    newest complete run anywhere that did not profile."""
    profile_runs = found.runs.get("profile", {})
    if "default-r0" in profile_runs:
        return profile_runs["default-r0"]
    candidates = [r for r in found.other_runs + [r for runs in found.runs.values() for r in runs.values()]
                  if not r["settings"].get("profile")]
    return max(candidates, key=lambda r: r.get("finished", ""), default=None)


# ---------------------------------------------------------------- runs side by side


def run_row(record: dict) -> dict:
    summary = record["summary"]
    validation = summary["validation"][-1] if summary["validation"] else {}
    peak, kind = peak_memory(summary["memory"])
    return {
        "run": record["run_name"],
        "precision": record["environment"]["effective_precision"],
        "requested_precision": record["environment"]["requested_precision"],
        "world_size": summary["world_size"],
        "threads": record["environment"].get("torch_threads"),
        "validation_accuracy": validation.get("accuracy"),
        "test_accuracy": summary["test"]["accuracy"],
        "test_macro_f1": summary["test"]["macro_f1"],
        "wall_s": summary["wall_s"],
        "samples_per_s": summary["throughput"]["samples_per_s"],
        "step_s": summary["throughput"]["step_s"],
        "peak_memory_gib": peak,
        "memory_kind": kind,
        "final_train_loss": summary["final_train_loss"],
    }


def arm_rows(comparison: dict) -> list[dict]:
    """One row per arm of an experiment: medians and ranges over rounds, the verdict against the baseline."""
    rows = []
    for name, arm in comparison["arms"].items():
        row = {"arm": name, "config": arm["config"], "flags": " ".join(arm["flags"]), "status": arm["status"]}
        if arm["status"] != "complete":
            rows.append({**row, "reason": arm["reason"]})
            continue
        against = comparison["comparisons"].get(name, {})
        row.update({k: arm[k] for k in ("precision", "world_size", "memory_kind", "warnings")})
        for metric in ("samples_per_s", "step_s", "peak_memory_gib", "test_accuracy", "validation_accuracy"):
            row[metric] = arm[metric]["median"] if arm.get(metric) else None
            row[f"{metric}_range"] = (arm[metric]["min"], arm[metric]["max"]) if arm.get(metric) else None
        row["speed"] = against.get("speed")
        row["memory_ratio"] = against["memory_ratio"]["median"] if against.get("memory_ratio") else None
        rows.append(row)
    return rows


def loss_curves(runs: dict) -> dict:
    """Run name -> (steps, training losses), from each run's step lines."""
    return {name: ([line["step"] for line in r["steps"]], [line["loss"] for line in r["steps"]])
            for name, r in runs.items()}


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


def first_round_runs(comparison: dict, runs: dict) -> dict:
    """arm -> its first round's record (the run a figure of per-run detail shows)."""
    return {name: runs[arm["runs"][0]] for name, arm in comparison["arms"].items()
            if arm["status"] == "complete" and arm["runs"][0] in runs}
