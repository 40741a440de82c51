"""Every figure and table from what has been run: report.md, report.pdf and their parts, into results/report/ for
your runs, or into reports/ (the committed report) when built from the committed benchmarks.

Reads the run records under --runs and the results files under --results; each experiment declared in
trainscope.experiments writes its own section (a figure, booktabs LaTeX tables, text), in the registry's
order, and every figure is followed by the health warnings of the runs it shows. An experiment that has
not been run becomes a line naming the make target that produces it; a corrupt, foreign or
unknown-schema record is skipped with a one-line reason, listed in the report. inputs.json, beside the report, lists
every file read with its sha256, and the report's provenance (collected before anything is written).

Without --runs and --results, the report is built from runs/ and results/ when either exists (what you
have run), else from the committed benchmarks/runs and benchmarks/ (a fresh clone), and says which. The
committed inputs' report goes to reports/ (tracked: the committed report); any other's to results/report/
(ignored), so a report of your runs never replaces the committed one. "Where the time went" shows make train's
run, or the one --run names (docs/design.md#which-run-the-report-calls-the-main-run).

    python report.py [--runs runs] [--results results] [--out DIR] [--run NAME]
    python report.py --advise RUN_FOLDER          # what to try next for one run (no report written)
"""

import argparse
import shutil
import sys
import tempfile
from datetime import date
from pathlib import Path
from typing import TYPE_CHECKING

from trainscope.advice import advisor
from trainscope.core.paths import ROOT
from trainscope.core.record_view import RunView
from trainscope.core.records import read_record, write_json_atomic, write_text_atomic

if TYPE_CHECKING:
    from trainscope.report.sections import Collected
    from trainscope.report.writer import ReportWriter

COMMITTED = (ROOT / "benchmarks" / "runs", ROOT / "benchmarks")


def write_section(report: "ReportWriter", found: "Collected", experiment) -> None:
    """One section. A comparison or results file of another shape (an older trainscope's, a hand-edited one)
    skips the section with its reason, checked before the section runs; an error inside a section is a bug
    in trainscope and ends the report with its traceback."""
    why = experiment.unreadable(found)
    if why is None:
        headline = experiment.headline(found) if experiment.headline else None
        report.answer(
            experiment.title,
            headline or (experiment.missing() if experiment.headline else "(no headline declared: see its section)"),
            experiment.machines(found) if headline or not experiment.headline else None,
        )
        if experiment.question:
            answers = experiment.answer(found) if experiment.answer else None
            report.question(experiment.question, experiment.title, answers or experiment.missing())
        experiment.section(report, found)
        return
    found.skipped.append(f"section {experiment.name}: {why}")
    print(f"warning: skipped section {experiment.name}: {why}", file=sys.stderr)
    report.answer(experiment.title, f"(skipped: {why})")
    report.begin(experiment.title, True, "")
    report.text(f"(skipped: {why})")


def build(runs: Path, results: Path, out: Path, source_line: str = "", main_run: str | None = None) -> "ReportWriter":
    # deferred: the report's modules load torch and every experiment's, which --help and --advise need none of
    from trainscope.core import provenance
    from trainscope.experiments import REGISTRY, SECTIONS
    from trainscope.report import sections
    from trainscope.report.book import Book
    from trainscope.report.writer import ReportWriter

    found = sections.collect(runs, results, REGISTRY)  # sections read inputs of experiments without one too
    found.asked_run = main_run
    if main_run is not None and sections.named_run(found, main_run) is None:
        print(f"error: --run {main_run}: no complete run of that name or folder under {runs}", file=sys.stderr)
        sys.exit(2)
    for line in found.skipped:
        print(f"warning: skipped {line}", file=sys.stderr)
    # before anything is written: the tree as it was; every path in it the project's own (sections.shown_path)
    block = provenance.collect(inputs=found.inputs, command=sections.shown_text(provenance.launch_command()))
    block["inputs"] = [{**entry, "path": sections.shown_path(entry["path"])} for entry in block["inputs"]]
    out.parent.mkdir(parents=True, exist_ok=True)
    # Built beside the old report (a hidden folder the tree ignores) and swapped in at the end: a failure
    # leaves the old one whole.
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.building-", dir=out.parent))
    try:
        book = Book(staging / "report.pdf")
        report = ReportWriter(staging, book)
        report.title(
            "trainscope report",
            f"Built {date.today().isoformat()} from {sections.shown_path(runs)} and "
            f"{sections.shown_path(results)}{source_line}: "
            f"{len(found.inputs)} input files, listed with their sha256 in inputs.json.",
        )
        report.answers_page()
        for experiment in SECTIONS:
            write_section(report, found, experiment)
        if found.skipped:
            report.begin("Skipped inputs", True, "")
            for line in found.skipped:
                report.text(f"- {sections.shown_text(line)}")
        report.appendix(provenance.markdown(block, machine_label="report built on") + measured_on(found))
        report.close()
        write_text_atomic(staging / "report.md", "\n".join(report.markdown) + "\n")
        write_json_atomic(
            staging / "inputs.json",
            {
                "provenance": block,
                "skipped": [sections.shown_text(line) for line in found.skipped],
                "machines": {m.text: [sections.shown_path(p) for p in paths] for m, paths in found.machines.items()},
                "runs": {k: sorted(v) for k, v in found.runs.items()},
                "folders": {k: [f.name for f in folders] for k, folders in found.folders.items()},
                "results": {k: v is not None for k, v in found.results.items()},
            },
        )
        if out.exists():
            shutil.rmtree(out)
        staging.rename(out)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    for run_name in log_figures_to_wandb(report, out):
        print(f"logged the report's figures to W&B run {run_name}")
    return report


def measured_on(found: "Collected") -> list[str]:
    """The provenance's lines naming every machine whose records or results this report read, with how many."""
    lines = []
    for machine, paths in found.machines.items():
        records = sum(Path(p).name == "record.json" for p in paths)
        files = len(paths) - records
        counts = [f"{records} run record{'s' * (records != 1)}"] * bool(records) + [
            f"{files} results or comparison file{'s' * (files != 1)}"
        ] * bool(files)
        lines.append(f"- measured on: {machine.text} ({', '.join(counts)})")
    return lines or ["- measured on: no input names its machine"]


def log_figures_to_wandb(report: "ReportWriter", out: Path) -> list[str]:
    """Add each figure to the W&B runs it shows, for runs that used W&B (offline ones stay offline)."""
    by_run = {}
    for name, records in report.figure_runs.items():
        for view in map(RunView, records):
            if "wandb" in view.trackers:
                by_run.setdefault(view.path, (view, []))[1].append(name)
    logged = []
    for path, (view, names) in by_run.items():
        previous = sorted(Path(path).glob("wandb/*run-*"))
        if not previous:
            continue
        import wandb

        run_id = previous[-1].name.rsplit("-", 1)[-1]
        run = wandb.init(
            project="trainscope",
            id=run_id,
            resume="allow",
            dir=path,
            mode=view.trackers["wandb"]["mode"],
            settings=wandb.Settings(x_disable_meta=True, disable_git=True, save_code=False, silent=True),
        )
        run.log({f"report/{name}": wandb.Image(str(out / f"{name}.png")) for name in names})
        run.finish()
        logged.append(view.name)
    return logged


def advise(run: str) -> None:
    """Print the ranked suggestions for one run (its folder or its record.json)."""
    folder = Path(run).parent if run.endswith(".json") else Path(run)
    try:
        record = read_record(folder)
        if RunView(record).status != "complete":
            raise ValueError(
                f"{folder / 'record.json'}: status {RunView(record).status!r}; advice needs a complete run"
            )
    except ValueError as error:
        print(f"error: {' '.join(str(error).split())}", file=sys.stderr)
        sys.exit(2)
    print(
        f"What to try next for {RunView(record).name} (ranked; 'at most' from the measured shares, 'estimate' with "
        "its interval and what it assumes; every figure from the record, none from this machine):"
    )
    print("\n".join(advisor.lines(advisor.advise(record))))


def inputs(args, parser) -> tuple[Path, Path, str]:
    """Where the report reads from: what was asked; else runs/ and results/ when one exists; else the
    committed benchmarks (a fresh clone)."""
    if args.runs or args.results:
        runs, results = Path(args.runs or "runs"), Path(args.results or "results")
        if not runs.is_dir() and not results.is_dir():
            parser.error(f"neither {runs} nor {results} exists: run experiments first (make experiments)")
        return runs, results, ""
    if Path("runs").is_dir() or Path("results").is_dir():
        return Path("runs"), Path("results"), " (your runs)"
    from trainscope.report import sections  # deferred: it loads torch

    shown = [sections.shown_path(path) for path in COMMITTED]
    print(f"No runs/ or results/ here yet: building the committed report from {shown[0]} and {shown[1]}.")
    return *COMMITTED, " (the committed benchmarks: no runs/ or results/ here yet)"


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--runs", default=None, help="run records (default: runs/, or benchmarks/runs on a fresh clone)"
    )
    parser.add_argument(
        "--results",
        default=None,
        help="sweep and benchmark results (default: results/, or benchmarks/ on a fresh clone)",
    )
    parser.add_argument(
        "--out",
        default=None,
        help="output folder, replaced (default: reports/ for the committed benchmarks, else results/report/)",
    )
    parser.add_argument(
        "--run",
        metavar="NAME",
        help="the run 'where the time went' shows, by its name or folder (default: make train's newest run, else "
        "make profile's)",
    )
    parser.add_argument("--advise", metavar="RUN", help="print what to try next for one run (its folder) and stop")
    args = parser.parse_args(argv)
    if args.advise:
        return advise(args.advise)
    runs, results, source = inputs(args, parser)
    out = Path(args.out) if args.out else default_out(runs, results)
    build(runs, results, out, source, args.run)
    print(f"wrote {out / 'report.md'} and {out / 'report.pdf'}")


def default_out(runs: Path, results: Path) -> Path:
    """reports/ (tracked) for the committed inputs' report, results/report/ (ignored) for any other."""
    committed = all(Path(given).resolve() == path.resolve() for given, path in zip((runs, results), COMMITTED))
    return Path("reports") if committed else Path("results") / "report"


if __name__ == "__main__":
    sys.exit(main())
