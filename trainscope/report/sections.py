"""What every section of the report shares: its inputs, its headline and answers, and the rows, as pure functions
from run records (read through trainscope.core.record_view) and results to table rows. No plotting and no I/O,
except `collect`, which finds and reads the inputs, each listed with its sha256.

How it works: docs/design.md#in-the-code-what-the-reports-sections-share-trainscopereportsectionspy.
"""

import json
import re
from dataclasses import dataclass, field
from pathlib import Path

from trainscope.core.paths import ROOT
from trainscope.core.record_view import RunView
from trainscope.core.records import read_record, read_steps
from trainscope.core.results_view import Machine, results_machine
from trainscope.measure import bench
from trainscope.measure.timing import CATEGORIES, STAGES


@dataclass(frozen=True)
class Headline:
    """A section's answer at a glance: its headline figure and its verdict, worded by the functions its section
    words them with. The report prints it under the section's heading and, with the section's page, on its
    first page (trainscope.experiments.base.Experiment.headline declares it)."""

    text: str
    verdict: str


@dataclass(frozen=True)
class Answer:
    """An answer to one of the assignment's questions on the report's first page: a sentence a student reads without
    a legend (the figure, its interval in words, what it can claim) and the machine that measured it."""

    text: str
    machine: Machine | None = None


def ratio_words(comparison: dict, against: str) -> str:
    """'1.17 times as fast as 0 workers (1.04 to 1.23 in 5 alternating pairs: faster, p 0.008)': a speed ratio and
    its spread for a reader without the tables' notation; a single pair says it decides nothing."""
    pairs, p = comparison["pairs"], comparison.get("p_value")
    if pairs < 2:
        return f"{comparison['median_ratio']:.2f} times as fast as {against} (one run each: too few for a verdict)"
    return (
        f"{comparison['median_ratio']:.2f} times as fast as {against} ({comparison['min_ratio']:.2f} to "
        f"{comparison['max_ratio']:.2f} in {pairs} alternating pairs: {comparison['verdict']}"
        + (f", p {p:.2g}" if p is not None else "")
        + ")"
    )


@dataclass
class Folder:
    """One folder of an experiment's runs, <runs>/<name>/: its comparison.json (judged again by today's rules, None
    where it has none) and its run records by name. `kept`: a folder kept beside the experiment's declared one."""

    name: str
    path: Path
    comparison: dict | None = None
    runs: dict = field(default_factory=dict)
    kept: bool = False


@dataclass
class Collected:
    runs: dict = field(default_factory=dict)  # experiment -> {run name: record (with "steps")} of its declared folder
    other_runs: list = field(default_factory=list)  # complete records outside the experiment folders
    top_runs: list = field(default_factory=list)  # those of them directly under the runs folder (make train's)
    asked_run: str | None = None  # the main run named on report.py's command line (--run)
    comparisons: dict = field(default_factory=dict)  # experiment -> its declared folder's comparison.json
    folders: dict = field(default_factory=dict)  # experiment -> [Folder]: its declared one, then those kept beside it
    results: dict = field(default_factory=dict)  # experiment -> its results file, parsed
    gpu_checks: dict = field(default_factory=dict)  # <results>/gpu/<device>[.runN].json -> make gpu-check's results
    inputs: list = field(default_factory=list)  # every file read, for the digests
    machines: dict = field(default_factory=dict)  # Machine -> the inputs it measured (records, results files)
    skipped: list = field(default_factory=list)  # one line per input that could not be used


def collect(runs_dir: Path, results_dir: Path, experiments) -> Collected:
    """Read every run record under runs_dir, the declared experiments' comparisons and results files."""
    found = Collected()
    runs_dir, results_dir = Path(runs_dir), Path(results_dir)
    kept = kept_beside(runs_dir, experiments)
    folders = {e.folder: Folder(e.folder, runs_dir / e.folder) for e in experiments if e.folder}
    folders.update({name: Folder(name, runs_dir / name, kept=True) for name in kept})
    for path in sorted(runs_dir.rglob("record.json")) if runs_dir.exists() else []:
        _collect_record(found, path, runs_dir, folders)
    for experiment in experiments:
        mine = [folders[experiment.folder]] if experiment.folder else []
        for folder in mine + [folders[name] for name, owner in kept.items() if owner is experiment]:
            if not folder.kept and folder.runs:
                found.runs[experiment.name] = folder.runs
            comparison = _read_json(folder.path / "comparison.json", found)
            if comparison is not None:
                folder.comparison = (experiment.rejudge or rejudged)(comparison, folder.runs)
                if not folder.kept:
                    found.comparisons[experiment.name] = folder.comparison
            if folder.comparison is not None or folder.runs:
                found.folders.setdefault(experiment.name, []).append(folder)
        if experiment.results:
            found.results[experiment.name] = _read_json(results_dir / experiment.results, found)
    for path in sorted((results_dir / "gpu").glob("*.json")) if (results_dir / "gpu").is_dir() else []:
        checks = _read_json(path, found)
        if isinstance(checks, dict) and checks.get("benchmark") == "gpu_check":
            found.gpu_checks[f"gpu/{path.name}"] = checks
    return found


def kept_beside(runs_dir: Path, experiments) -> dict:
    """{folder name: experiment} of the folders <runs>/<folder>_<suffix>/ whose comparison.json names an experiment
    declared `kept_beside` (docs/design.md#in-the-code-what-the-reports-sections-share-trainscopereportsectionspy)."""
    declared = {e.folder for e in experiments if e.folder}
    beside = [e for e in experiments if e.folder and getattr(e, "kept_beside", False)]
    kept = {}
    for path in sorted(p for p in runs_dir.iterdir() if p.is_dir()) if beside and runs_dir.is_dir() else []:
        mine = [e for e in beside if path.name.startswith(f"{e.folder}_") and path.name not in declared]
        named = _experiment_named(path / "comparison.json") if mine else None
        for experiment in mine:
            if named == experiment.name:
                kept[path.name] = experiment
    return kept


def _experiment_named(path: Path) -> str | None:
    """The experiment a comparison.json names, or None (none there, or not one)."""
    value = _read_json(path, Collected())  # what it lacks is said where the folder's own inputs are read
    return value.get("experiment") if isinstance(value, dict) else None


def folders_of(found: Collected, experiment) -> list[Folder]:
    """The folders of an experiment's results: its declared one and those kept beside it; where the inputs were
    gathered by hand (no folders), its declared folder's comparison and runs as one."""
    if experiment.name in found.folders:
        return found.folders[experiment.name]
    comparison, runs = found.comparisons.get(experiment.name), found.runs.get(experiment.name, {})
    return [Folder(experiment.folder, Path(experiment.folder), comparison, runs)] if comparison or runs else []


def _collect_record(found: Collected, path: Path, runs_dir: Path, folders: dict) -> None:
    try:
        record = read_record(path.parent)
    except ValueError as error:
        found.skipped.append(str(error))
        return
    if RunView(record).status != "complete":
        found.skipped.append(f"{path}: status {RunView(record).status!r}, not complete")
        return
    record["steps"] = read_steps(path.parent, found.skipped)
    record["path"] = str(path.parent)
    found.inputs += [path] + ([path.parent / "steps.jsonl"] if (path.parent / "steps.jsonl").exists() else [])
    found.machines.setdefault(RunView(record).machine, []).append(path)
    # an experiment's runs are <runs>/<its folder>/<run>: a folder of that name deeper down (another experiment's
    # output kept beside, e.g. <runs>/full_job/compile/) holds other runs, whose names may repeat the experiment's
    folder = path.parent.parent.name if path.parent.parent.parent == runs_dir else None
    if folder in folders:
        folders[folder].runs[path.parent.name] = record
    else:
        found.other_runs.append(record)
        if path.parent.parent == runs_dir:
            found.top_runs.append(record)


def rejudged(comparison: dict, records: dict) -> dict:
    """The comparison with every arm's speed judged again by today's test (trainscope.measure.bench) from the runs'
    own records, when they are all there: a committed comparison made under an older rule reads the same
    as a new one. An arm whose runs are missing keeps the verdict it was written with."""

    arms = comparison.get("arms") if isinstance(comparison, dict) else None
    baseline = (arms or {}).get(comparison.get("baseline"), {}) if arms else {}
    speeds = lambda arm: [RunView(records[r]).samples_per_s for r in arm.get("runs", []) if r in records]  # noqa: E731
    base = speeds(baseline) if baseline.get("status") == "complete" else []
    if not base or len(base) != len(baseline["runs"]):
        return comparison
    for name, against in (comparison.get("comparisons") or {}).items():
        mine = speeds(arms.get(name, {}))
        if len(mine) == len(arms[name].get("runs", [])) == len(base):
            against["speed"] = bench.compare_samples(base, mine)
    return comparison


def _read_json(path: Path, found: Collected):
    if not path.exists():
        return None
    try:
        value = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        found.skipped.append(f"{path}: not readable JSON ({' '.join(str(error).split())})")
        return None
    found.inputs.append(path)
    if results_machine(value) is not None:
        found.machines.setdefault(results_machine(value), []).append(path)
    return value


def machine_of(source: dict) -> Machine | None:
    """The machine of a run record (RunView.machine) or of a results file or comparison (its provenance)."""
    return RunView(source).machine if "run_name" in source else results_machine(source)


def machines(sources) -> dict[Machine, list[str]]:
    """{machine: the labels of the sources it measured, each once}, from (label, run record or results file) pairs;
    a source that names no machine is left out."""
    grouped: dict[Machine, list[str]] = {}
    for label, source in sources:
        machine = machine_of(source) if source else None
        if machine is not None and label not in grouped.setdefault(machine, []):
            grouped[machine].append(label)
    return grouped


# ---------------------------------------------------------------- paths as the report prints them

_IN_ROOT = re.compile(r"(?<![\w./~-])" + re.escape(str(ROOT)) + r"(?:/|(?![\w./-]))")


def shown_path(path) -> str:
    """A path as the report prints it: relative to the project's root where it lies inside it ('.' for the root),
    else as given (a relative path as it was typed)."""
    path = Path(path)
    if path.is_absolute():
        for candidate in (path, path.resolve()):
            try:
                return str(candidate.relative_to(ROOT))
            except ValueError:
                pass
    return str(path)


def shown_text(text: str) -> str:
    """`text` with every absolute path inside the project's root written relative to it (a command line, a skipped
    input's reason)."""
    return _IN_ROOT.sub(lambda match: "" if match.group(0).endswith("/") else ".", text)


# ---------------------------------------------------------------- where the time went


def time_breakdown(record: dict) -> dict:
    """The five categories and the finer stages of a run (median over ranks), seconds and % of wall."""
    view = RunView(record)
    seconds = view.category_seconds("run")
    categories = [{"name": name, "seconds": seconds[name]} for name in CATEGORIES]
    stages = [{"name": stage, "seconds": view.stage_seconds("run")[stage]} for stage in (*STAGES, "other")]
    total = sum(c["seconds"] for c in categories)
    for row in categories + stages:
        row["percent"] = 100 * row["seconds"] / total if total else 0.0
    return {
        "run": view.name,
        "wall_s": view.wall_median("run"),
        "categories": categories,
        "stages": stages,
        "world_size": view.world_size,
        "device": view.device_name,
        "precision": view.precision,
    }


def pick_breakdown_run(found: Collected) -> dict | None:
    """The report's main run (where the time went), chosen as docs/design.md#which-run-the-report-calls-the-main-run
    says."""
    return breakdown_choice(found)[0]


def breakdown_choice(found: Collected) -> tuple[dict | None, str]:
    """(the report's main run, why it is the one: a phrase the page prints beside its name)."""
    if found.asked_run is not None:
        return named_run(found, found.asked_run), "named by --run"
    profiled = found.runs.get("profile", {})
    machines = {RunView(r).machine for r in profiled.values()}
    trained = [r for r in found.top_runs if RunView(r).script == "train.py" and not RunView(r).setting("profile")]
    beside = [r for r in trained if not machines or RunView(r).machine in machines]
    if beside:
        return max(beside, key=lambda r: RunView(r).finished), "make train's newest run"
    default = profiled.get("default-r0")
    if default is None:
        return None, ""
    return default, "make profile's run" + ("; make train's ran on another machine" if trained else "")


def named_run(found: Collected, name: str) -> dict | None:
    """The run called `name` (its run name, or its folder's path under the runs folder) among every complete record
    collected (the experiments' folders, those kept beside them, and the others), None where none is."""
    kept = [r for folders in found.folders.values() for f in folders if f.kept for r in f.runs.values()]
    records = [*found.other_runs, *(r for runs in found.runs.values() for r in runs.values()), *kept]
    return next(
        (r for r in records if RunView(r).name == name or (r.get("path") and Path(r["path"]) == Path(name))), None
    )


# ---------------------------------------------------------------- runs side by side


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


def attribution(baseline: dict, other: dict) -> list[dict]:
    """Which stage got faster or slower, by how much, from `baseline` to `other` (per optimizer step).

    The deltas add up to the change in step time; `share` is each stage's part of that change.
    """
    before, after = RunView(baseline).stage_seconds_per_step(), RunView(other).stage_seconds_per_step()
    total = sum(after.values()) - sum(before.values())
    return [
        {
            "stage": stage,
            "baseline_s": before[stage],
            "other_s": after[stage],
            "delta_s": after[stage] - before[stage],
            "share_of_change": (after[stage] - before[stage]) / total if total else 0.0,
        }
        for stage in before
    ]


def first_round_runs(comparison: dict, runs: dict) -> dict:
    """arm -> its first round's record (the run a figure of per-run detail shows)."""
    return {
        name: runs[arm["runs"][0]]
        for name, arm in comparison["arms"].items()
        if arm["status"] == "complete" and arm["runs"][0] in runs
    }
