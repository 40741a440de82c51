"""The report, built from records that tiny CPU runs of the make targets produce, and rebuilt from the
committed inputs."""

import json
import re
import shlex
import shutil
import statistics
import subprocess
import sys
from datetime import date
from pathlib import Path
from types import SimpleNamespace

import pytest
from conftest import ROOT, cpu_env, driven_in_process, run_command, run_in_process
from test_report_pdf import check_report, glance_titles, question_titles

import report
from trainscope.core import provenance
from trainscope.core.record_view import RunView
from trainscope.experiments import REGISTRY, SECTIONS
from trainscope.report import sections

TINY = (
    "--model embedded:tiny-bert --max-train-samples 256 --max-eval-samples 64 --max-test-samples 64 "
    "--per-device-batch-size 16 --learning-rate 3e-3 --report-to none --log-every 2 --threads 1"
)


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    root = tmp_path_factory.mktemp("experiments")
    runs, results, out = root / "runs", root / "results", root / "reports"
    common = [
        f"RUNS={runs}",
        f"RESULTS={results}",
        f"EXP_ARGS={TINY}",
        f"SPEED_ARGS={TINY} --max-steps 6",
        f"AMP_ARGS={TINY} --max-steps 6",
        "ROUNDS=1",
    ]
    # a driver's own launches are tested by make sweep-workers (test_loaders_bench.py), the configs' by
    # test_launches.py and make report's by its fresh-clone rebuild below: here the runs are forked
    for target in (["amp-compare"], ["profile", "PROFILE_BF16=off"], ["matrix", "MATRIX_VARIANTS=cpu cpu+ckpt"]):
        completed = driven_in_process([*target, *common])
        assert completed.returncode == 0, f"make {target}: {completed.stderr[-3000:]}"
    completed = driven_in_process(["report", f"REPORT_ARGS=--out {out}", *common])
    assert completed.returncode == 0, f"make report: {completed.stderr[-3000:]}"
    return runs, results, out


def test_every_section_is_there_or_names_its_make_target(built):
    runs, _, out = built
    text = (out / "report.md").read_text()
    for experiment in SECTIONS:  # every declared experiment has its section, in the registry's order
        assert f"## {experiment.title}" in text
    headings = [line[3:] for line in text.splitlines() if line.startswith("## ")]
    assert headings[: len(SECTIONS) + 2] == ["The assignment's questions, answered", "At a glance"] + [
        e.title for e in SECTIONS
    ]
    glance = text.split("## At a glance")[1].split("\n## ")[0]  # one answer per section, grouped by machine
    rows = [line.split(" | ")[0][2:] for line in glance.splitlines() if line.startswith("| ")]
    assert sorted(row for row in rows if row != "experiment") == sorted(e.title for e in SECTIONS)
    assert "takes the most" in glance.split("| Where the time went |")[1].splitlines()[0]  # its headline
    not_measured = glance.split("**Not measured (not run yet, or skipped): what each experiment found**")[1]
    assert "| What DDP communication costs | Not run yet: `make ddp-cost` produces it. |" in not_measured
    for target in (
        "make sweep-workers",
        "make compare-dp",
        "make batch-sweep",
        "make ckpt-compare",
        "make ddp-cost",
        "make bench-compile",
    ):
        assert f"Not run yet: `{target}` produces it." in text
    for name in ("time_breakdown", "matrix"):
        assert (out / f"{name}.png").stat().st_size > 1000 and (out / f"{name}.pdf").exists()
    assert not list(out.parent.glob(".reports.building*"))


def test_the_time_breakdown_comes_from_the_run_without_the_profiler(built):
    runs, _, out = built
    text = (out / "report.md").read_text()
    assert (
        "From run `default-r0` (make profile's run; `--run NAME` picks another), which ran without the profiler."
        in text
    )
    pie_part = text.split("## Where the time went")[1].split("## ")[0]
    assert "profiler_on" not in pie_part.split("Top operators")[0]  # the pie's run did not profile
    assert "Top operators by self time" in pie_part and "Profiler overhead on the traced steps" in pie_part
    # the gap to this machine's measured matmul peak: the unprofiled run's share, the profiled run's floor and gap
    assert "Each run against this machine's measured matmul peak" in pie_part and "| default-r0 | fp32 |" in pie_part
    assert "Where the gap to the measured fp32 matmul peak went (profiled-r0" in pie_part
    assert "| matmuls on real tokens at the measured peak (floor) |" in pie_part
    assert "| padding positions (their matmuls) |" in pie_part and (out / "peak_gap_default.png").exists()


def test_warnings_are_printed_beside_the_figures_they_concern(built):
    _, _, out = built
    text = (out / "report.md").read_text()
    matrix_part = text.split("## Configs and switches side by side")[1].split("## ")[0]
    assert "Warnings for these figures" in matrix_part and "cpu+ckpt-r0: [few_steady_steps]" in matrix_part


def tabular_rows(tex: str):
    """(column spec, [cells per row]) of every tabular in a LaTeX string."""
    tables = []
    for spec, body in re.findall(r"\\begin\{tabular\}\{([^}]*)\}(.*?)\\end\{tabular\}", tex, re.S):
        rows = [line for line in body.splitlines() if line.strip().endswith(r"\\")]
        tables.append((spec, [len(re.split(r"(?<!\\)&", row)) for row in rows]))
    return tables


def test_latex_tables_parse_as_tables(built):
    _, _, out = built
    for path in out.glob("*.tex"):
        tex = path.read_text()
        assert tex.count(r"\begin{table}") == tex.count(r"\end{table}") == 1, path.name
        for spec, cells in tabular_rows(tex):
            assert cells and all(n == len(spec) for n in cells), (path.name, spec, cells)
        assert "_" not in re.sub(r"\\_|\\label\{[^}]*\}", "", tex), path.name  # every underscore escaped


def test_the_amp_table_shows_what_the_records_hold():
    """Checked on the committed report: its AMP runs are real ones (fp32 and bf16 on machine B's CPU, five rounds),
    each cell the median of the arm's rounds as its records hold them."""
    runs, out = ROOT / "benchmarks" / "runs", ROOT / "reports"
    rounds = [json.loads(p.read_text())["summary"] for p in sorted((runs / "amp").glob("bf16-r*/record.json"))]
    row = next(line for line in (out / "amp_amp.tex").read_text().splitlines() if line.startswith("bf16 &"))
    cells = [c.strip().rstrip("\\").strip() for c in row.split("&")]
    assert cells[1] == "bf16" and len(rounds) == 5
    assert float(cells[3]) == pytest.approx(statistics.median(r["test"]["accuracy"] for r in rounds), abs=6e-5)
    assert float(cells[4]) == pytest.approx(
        statistics.median(r["throughput"]["samples_per_s"] for r in rounds), abs=0.06
    )


def test_make_amp_compare_writes_whole_runs_in_rounds_and_one_round_gives_no_verdict(built):
    runs, _, out = built
    comparison = json.loads((runs / "amp" / "comparison.json").read_text())
    assert comparison["rounds"] == 1 and comparison["arms"]["bf16"]["runs"] == ["bf16-r0"]
    assert comparison["comparisons"]["bf16"]["speed"]["verdict"] == "too few pairs"
    assert "speed_by_interval" not in comparison["comparisons"]["bf16"]
    section = (out / "report.md").read_text().split("## Mixed precision vs FP32")[1].split("\n## ")[0]
    assert "Verdict: too few pairs." in section and "interval" not in section
    assert "(1 alternating round of whole runs" in section and "too few pairs for a verdict" in section


def test_the_matrix_reports_each_variant_against_the_first(built):
    runs, _, out = built
    comparison = json.loads((runs / "matrix" / "comparison.json").read_text())
    assert comparison["baseline"] == "cpu" and comparison["arms"]["cpu+ckpt"]["flags"] == ["--gradient-checkpointing"]
    assert comparison["comparisons"]["cpu+ckpt"]["speed"]["pairs"] == 1
    assert comparison["comparisons"]["cpu+ckpt"]["speed"]["verdict"] == "too few pairs"
    assert "cpu -> cpu+ckpt" in (out / "attribution.tex").read_text()
    assert comparison["provenance"]["command"].startswith("python -m trainscope.experiments matrix")


def test_inputs_json_lists_every_input_with_its_digest(built):
    runs, _, out = built
    inputs = json.loads((out / "inputs.json").read_text())["provenance"]["inputs"]
    recorded = {entry["path"]: entry["sha256"] for entry in inputs}
    record = runs / "matrix" / "cpu+ckpt-r0" / "record.json"
    assert recorded[str(record)] == provenance.sha256(record)
    assert str(runs / "matrix" / "comparison.json") in recorded
    assert len(recorded) == len(list(runs.rglob("record.json"))) * 2 + len(list(runs.rglob("comparison.json")))


def test_the_pdf_renders(built):
    import pypdfium2

    _, _, out = built
    document = pypdfium2.PdfDocument(str(out / "report.pdf"))
    assert len(document) >= 3
    image = document[0].render(scale=1).to_pil()
    darkest, lightest = image.convert("L").getextrema()
    assert image.size[0] > 500 and lightest - darkest > 100  # not a blank page


def test_bad_records_are_skipped_with_their_reason_and_the_report_goes_on(built, tmp_path):
    runs, _, _ = built
    partial = tmp_path / "runs"
    shutil.copytree(runs / "matrix", partial / "matrix")
    broken = {
        "broken": "{not json",
        "foreign": '{"something": "else"}',
        "future": '{"schema_version": 7}',
        "stringly": '{"schema_version": "2"}',
        "hollow": '{"schema_version": 2, "status": "complete", "run_name": "h", "settings": {}, "environment": {}}',
    }
    for name, content in broken.items():
        (partial / "matrix" / name).mkdir()
        (partial / "matrix" / name / "record.json").write_text(content)
    with open(partial / "matrix" / "cpu+ckpt-r0" / "steps.jsonl", "a") as handle:
        handle.write('{"step": 99, "lo')  # a killed run's last line
    out = tmp_path / "reports"
    completed = run_in_process(
        ["--runs", str(partial), "--results", str(tmp_path / "none"), "--out", str(out)], main=report.main
    )
    assert completed.returncode == 0, completed.stderr
    text = (out / "report.md").read_text()
    skipped = text.split("## Skipped inputs")[1]
    for name in broken:
        assert f"{name}/record.json" in skipped and f"{name}/record.json" in completed.stderr
    assert "schema_version 7 is not one this trainscope reads" in skipped and "lacks summary" in skipped
    assert "steps.jsonl:" in skipped
    assert "## Configs and switches side by side" in text and (out / "matrix.tex").exists()
    assert "Traceback" not in completed.stderr


def test_a_results_file_of_another_shape_skips_its_section_and_the_report_goes_on(built, tmp_path):
    runs, _, _ = built
    results = tmp_path / "results"
    (results / "compare_dp").mkdir(parents=True)
    (results / "compare_dp" / "compare_dp.json").write_text(json.dumps({"machine": {"device_name": "cpu"}}))
    out = tmp_path / "reports"
    completed = run_in_process(["--runs", str(runs), "--results", str(results), "--out", str(out)], main=report.main)
    assert completed.returncode == 0, completed.stderr
    text = (out / "report.md").read_text()
    assert (
        "section data_parallel: its inputs lack benchmark, compare, results, comparison, code_changes, "
        "projection" in text.split("## Skipped inputs")[1]
    )
    assert "(skipped: its inputs lack" in text.split("## DataParallel vs DDP")[1].split("## ")[0]
    assert "## Configs and switches side by side" in text
    assert "Traceback" not in completed.stderr


def test_a_bug_in_a_section_ends_the_report_instead_of_passing_for_a_foreign_input(built, tmp_path, monkeypatch):
    import dataclasses

    runs, results, _ = built

    def broken(report_writer, found):
        raise KeyError("a bug in trainscope")

    from trainscope.experiments import registry

    monkeypatch.setattr(
        registry,
        "SECTIONS",
        [dataclasses.replace(e, section=broken) if e.name == "matrix" else e for e in registry.SECTIONS],
    )
    with pytest.raises(KeyError, match="a bug in trainscope"):
        report.build(runs, results, tmp_path / "reports")
    assert not (tmp_path / "reports").exists() and not list(tmp_path.glob(".reports.building*"))


def test_report_without_inputs_is_refused(tmp_path):
    with pytest.raises(SystemExit) as exit_info:
        report.main(["--runs", str(tmp_path / "a"), "--results", str(tmp_path / "b"), "--out", str(tmp_path / "c")])
    assert exit_info.value.code == 2
    assert not (tmp_path / "c").exists()


@pytest.fixture(scope="module")
def fresh_clone(tmp_path_factory):
    """`git clone ... && python report.py` (make report's command): no runs/ or results/ there, so the committed
    benchmarks, built by the committed code; (the clone, the command's result, the committed LaTeX tables)."""
    clone = tmp_path_factory.mktemp("fresh") / "clone"
    subprocess.run(["git", "clone", "-q", str(ROOT), str(clone)], check=True)
    committed = {p.name: p.read_text() for p in (clone / "reports").glob("*.tex")}
    completed = run_command([sys.executable, "report.py"], cwd=clone, env=cpu_env())
    assert completed.returncode == 0, completed.stderr[-3000:]
    return clone, completed, committed


def test_make_report_on_a_fresh_clone_rebuilds_the_committed_report_with_a_clean_tree(fresh_clone):
    """Every LaTeX table comes out as committed, the PDF reads cleanly (test_report_pdf), and provenance says the
    tree was clean (the report's scratch folder is ignored).
    (make report runs `python report.py` without --runs or --results unless they are given: checked below.)"""
    clone, completed, committed = fresh_clone
    assert completed.stdout.splitlines()[0].startswith("No runs/ or results/ here yet: building the committed report")
    rebuilt = {p.name: p.read_text() for p in (clone / "reports").glob("*.tex")}
    assert committed and rebuilt == committed
    inputs = json.loads((clone / "reports" / "inputs.json").read_text())
    assert inputs["provenance"]["dirty"] is False and inputs["provenance"]["changed"] == []
    assert "Not run yet" not in (clone / "reports" / "report.md").read_text()
    titles = glance_titles((clone / "reports" / "report.md").read_text())
    assert set(titles) == {e.title for e in SECTIONS}  # a section that answers once per machine has several rows
    markdown = (clone / "reports" / "report.md").read_text()
    check_report(clone / "reports" / "report.pdf", titles, question_titles(markdown))  # as a person reads it
    status = subprocess.run(
        ["git", "status", "--porcelain", "--untracked-files=all"], cwd=clone, capture_output=True, text=True
    ).stdout.splitlines()
    assert status and all(line[3:].startswith("reports/") for line in status)  # only the report's own outputs


def test_make_report_after_make_train_on_a_fresh_clone_leaves_every_tracked_file_unchanged(fresh_clone):
    """A newcomer's `make train` then `make report`: with runs/ present the report is of those runs, written to
    results/report/ (ignored); reports/ and every other tracked file stay as they were."""
    clone = fresh_clone[0]

    def tree() -> tuple:
        status = subprocess.run(
            ["git", "status", "--porcelain"], cwd=clone, capture_output=True, text=True, check=True
        ).stdout
        return status, {p.name: p.read_bytes() for p in (clone / "reports").iterdir() if p.is_file()}

    before = tree()
    shutil.copytree(ROOT / "benchmarks" / "runs" / "make-train", clone / "runs" / "make-train")  # make train's record
    try:
        completed = run_command([sys.executable, "report.py"], cwd=clone, env=cpu_env())
        assert completed.returncode == 0, completed.stderr[-3000:]
        assert (clone / "results" / "report" / "report.md").exists()
        assert tree() == before  # runs/ and results/ are ignored; nothing tracked changed
    finally:
        shutil.rmtree(clone / "runs", ignore_errors=True)
        shutil.rmtree(clone / "results", ignore_errors=True)


# ---------------------------------------------------------------- the committed inputs: the fresh clone's report


@pytest.fixture(scope="module")
def committed(fresh_clone):
    """The report of the committed benchmarks as `make report` builds it on a fresh clone; its folder."""
    return fresh_clone[0] / "reports"


A_AVX2, B_AVX512_BF16, C_AMX = (
    "AMD EPYC, AVX2, bf16 emulated, 2 cores",
    "AMD EPYC, AVX512-BF16, 2 cores",
    "Intel Xeon, AVX512-BF16 + AMX, 2 cores",
)


def test_every_committed_machines_make_tune_and_tune_confirm_are_shown_under_its_machine(committed):
    """benchmarks/runs holds make tune and make tune-confirm of three machines (tune/ and tune_confirm/ of A,
    tune_avx512bf16/ and tune_confirm_avx512bf16/ of B, tune_amx/, tune_confirm_amx/ and tune_confirm_grouped/ of
    C): the Optimization section shows each under a heading naming its machine, in the order of make tune's folders,
    each table titled with its machine and written to its own .tex; the first page answers for each machine in its
    machine's group, and the PDF still reads as a person reads it."""
    text = (committed / "report.md").read_text()
    section = text.split("## Optimization: what to try next")[1].split("\n## ")[0]
    parts = {part.split("\n")[0]: part for part in section.split("\n### ")[1:]}
    assert list(parts) == [f"Measured on {machine}" for machine in (A_AVX2, C_AMX, B_AVX512_BF16)]
    shown = {
        A_AVX2: ["tune/advice-r0`", "| e1 | --unpad |", "1.198 (1.090-1.390)", "tune_confirm/`", "| 1.450x |"],
        # B: --unpad kept at 1.383x, bf16 on top of it 1.589x; on the full job 2.572x make train's samples/s
        B_AVX512_BF16: [
            "tune_avx512bf16/advice-r0`",
            "| e1 | --unpad |",
            "1.383 (1.279-1.445)",
            "| s1 | config bf16, --unpad |",
            "1.589 (1.504-1.663)",
            "tune_confirm_avx512bf16/`",
            "| 2.572x |",
        ],
        C_AMX: ["tune_amx/advice-r0`", "| s1 | config bf16 |", "1.882 (1.811-1.927)", "| 1.614x |", "| 2.671x |"],
    }
    for machine, figures in shown.items():
        mine = parts[f"Measured on {machine}"]
        assert all(figure in mine for figure in figures), (machine, [f for f in figures if f not in mine])
        assert "**In short:** " in mine.split("\n\n")[1]  # its machine's answer opens its part
        titles = [line for line in mine.splitlines() if line.startswith("**") and "(LaTeX: `" in line]
        assert titles and all(f"(measured on {machine})** (LaTeX: `" in line for line in titles)
    for name in (
        "tune",
        "tune_confirm",
        "tune_avx512bf16",
        "tune_confirm_avx512bf16",
        "tune_amx",
        "tune_confirm_grouped",
    ):
        assert (committed / f"{name}.tex").exists(), name
    assert "2.572" not in parts[f"Measured on {A_AVX2}"] + parts[f"Measured on {C_AMX}"]
    glance = text.split("## At a glance")[1].split("\n## ")[0]
    groups = {part.split(": what each")[0]: part for part in glance.split("\n**")[1:]}
    for machine, figure in ((A_AVX2, "1.1982"), (B_AVX512_BF16, "2.5716"), (C_AMX, "1.8820")):
        row = next(line for line in groups[f"Measured on {machine}"].splitlines() if line.startswith("| Optimization"))
        assert figure in row, (machine, row)
    check_report(committed / "report.pdf", glance_titles(text), question_titles(text))


def test_the_report_names_paths_relative_to_the_project_never_the_building_machines_folders(committed):
    """Built from the committed inputs by their absolute paths (as on a fresh clone): the report, its tables and
    inputs.json name them relative to the project; the project's absolute path (the clone's) appears nowhere."""
    text = (committed / "report.md").read_text()
    assert text.splitlines()[2].startswith(f"Built {date.today().isoformat()} from benchmarks/runs and benchmarks (")
    assert "(`python report.py --advise benchmarks/runs/tune/advice-r0`)" in text
    for path in [committed / "report.md", committed / "inputs.json", *committed.glob("*.tex")]:
        assert str(committed.parent) not in path.read_text(), path.name
    inputs = json.loads((committed / "inputs.json").read_text())
    assert {"path": "benchmarks/runs/tune_avx512bf16/comparison.json"} in [
        {"path": entry["path"]} for entry in inputs["provenance"]["inputs"]
    ]


def test_paths_are_shown_relative_to_the_project_where_they_lie_inside_it(tmp_path):
    assert sections.shown_path(ROOT / "benchmarks" / "runs") == "benchmarks/runs"
    assert sections.shown_path(ROOT) == "."
    assert sections.shown_path(tmp_path / "runs") == str(tmp_path / "runs")  # outside: as given
    assert sections.shown_path("runs/tune") == "runs/tune"  # relative: as typed
    line = f"{ROOT}/benchmarks/runs/x/record.json: status 'running'; python {ROOT}/report.py --runs {ROOT}"
    assert sections.shown_text(line) == "benchmarks/runs/x/record.json: status 'running'; python report.py --runs ."
    assert sections.shown_text(f"/elsewhere{ROOT}/x {ROOT}-old/x") == f"/elsewhere{ROOT}/x {ROOT}-old/x"


def test_an_experiments_results_kept_beside_its_folder_are_read_as_its_own(tmp_path):
    """<runs>/tune_confirm_<suffix>/ whose comparison.json names tune-confirm is make tune-confirm's too (each of its
    folders with its own runs, judged again); a folder of that prefix naming another experiment is not, nor is
    make tune-confirm's own folder make tune's (tune_confirm/ starts with tune_)."""
    from trainscope.experiments import optimization

    source = ROOT / "benchmarks" / "runs" / "tune_confirm"
    for name in ("tune_confirm", "tune_confirm_b", "tune_confirm_other"):
        shutil.copytree(source, tmp_path / name)
    other = tmp_path / "tune_confirm_other" / "comparison.json"
    other.write_text(json.dumps({**json.loads(other.read_text()), "experiment": "matrix"}))
    found = sections.collect(tmp_path, tmp_path / "none", [optimization.EXPERIMENT, optimization.CONFIRM])
    folders = {name: [f.name for f in kept] for name, kept in found.folders.items()}
    assert folders == {"tune-confirm": ["tune_confirm", "tune_confirm_b"]}
    declared, beside = found.folders["tune-confirm"]
    assert found.runs["tune-confirm"] is declared.runs and found.comparisons["tune-confirm"] is declared.comparison
    assert sorted(beside.runs) == sorted(declared.runs) and beside.kept and not declared.kept
    assert {r["path"] for r in beside.runs.values()} == {str(tmp_path / "tune_confirm_b" / n) for n in beside.runs}
    assert len(found.other_runs) == len(declared.runs)  # the other experiment's folder: other runs
    assert str(tmp_path / "tune_confirm_b" / "comparison.json") in map(str, found.inputs)


def test_figures_go_to_the_wandb_run_that_used_it(tmp_path, monkeypatch):
    """A run that logged to W&B (offline), then the report of it: its figures go to that run (both in this
    process: neither the launcher nor the imports are what this is about; the run is named, its record's command
    being this process's, not train.py's)."""
    runs = tmp_path / "runs"
    monkeypatch.setenv("WANDB_MODE", "offline")
    completed = run_in_process(
        [*TINY.split()[:-4], "--report-to", "wandb", "--output-dir", str(runs), "--run-name", "default"]
    )
    assert completed.returncode == 0, completed.stderr[-2000:]
    completed = run_in_process(
        ["--runs", str(runs), "--results", str(tmp_path / "none"), "--out", str(tmp_path / "out"), "--run", "default"],
        main=report.main,
    )
    assert completed.returncode == 0, completed.stderr[-2000:]
    assert "logged the report's figures to W&B run default" in completed.stdout
    images = [p for p in (runs / "default" / "wandb").rglob("*.png") if "media" in p.parts]
    assert images and any("time_breakdown" in image.name for image in images)


@pytest.mark.parametrize("experiment", [e for e in REGISTRY if e.run is not None and e.target], ids=lambda e: e.name)
def test_each_experiments_make_target_runs_its_declaration_into_its_folder(experiment):
    """The Makefile line and the declaration agree: the target runs the experiment's subcommand, writing under
    its folder, so the report finds what the target made."""
    completed = run_command(["make", "-n", experiment.target.split()[-1], "RUNS=R"], env=cpu_env())
    command = " ".join(completed.stdout.replace("\\\n", " ").split())
    assert completed.returncode == 0
    assert f"-m trainscope.experiments {experiment.name} " in command and f"--runs R/{experiment.folder} " in command


def test_make_tune_confirm_is_trainscope_tune_confirm_into_the_folder_the_report_reads():
    from trainscope.experiments import optimization

    completed = run_command(["make", "-n", "tune-confirm", "RUNS=R"], env=cpu_env())
    command = " ".join(completed.stdout.replace("\\\n", " ").split())
    assert completed.returncode == 0
    assert f"-m trainscope tune --runs R/{optimization.CONFIRM.folder} --confirm R/tune/comparison.json " in command


def test_make_report_passes_no_inputs_unless_asked():
    plain = run_command(["make", "-n", "report"], env=cpu_env()).stdout
    assert "report.py" in plain and "--runs" not in plain and "--results" not in plain
    asked = run_command(["make", "-n", "report", "RUNS=r", "RESULTS=s"], env=cpu_env()).stdout
    assert "--runs r" in asked and "--results s" in asked


def test_make_asks_torch_for_a_gpu_only_where_the_machine_shows_one(tmp_path):
    """Every make call reads HAS_GPU: without a GPU's device files or nvidia-smi it imports no torch (a PY that
    leaves a mark when run is never run); where they are, torch's answer decides the CPU subset."""
    mark = tmp_path / "asked"
    fake = tmp_path / "python"
    fake.write_text(f"#!/bin/sh\ntouch {mark}\necho 1\n")
    fake.chmod(0o755)
    plain = run_command(["make", "-n", "train", "GPU_SIGNS=", f"PY={fake}"], env=cpu_env())
    assert plain.returncode == 0 and not mark.exists() and "--max-train-samples 4000" in plain.stdout
    shown = run_command(["make", "-n", "train", "GPU_SIGNS=/dev/nvidiactl", f"PY={fake}"], env=cpu_env())
    assert shown.returncode == 0 and mark.exists() and "--max-train-samples" not in shown.stdout


@pytest.mark.parametrize("system_torch", [True, False], ids=["system-torch", "no-system-torch"])
def test_make_setup_isolates_the_venv_unless_the_system_python_has_torch(tmp_path, system_torch):
    """A system Python whose torch can be reused gives a venv that sees the system's packages; any other gives an
    isolated one (the system's other packages would change what every process imports). Planted Pythons log
    what make asks of them; the venv's is a stand-in that answers every step."""
    log, venv = tmp_path / "log", tmp_path / "venv"
    system = tmp_path / "python3"
    system.write_text(
        "#!/bin/sh\n"
        f'echo "$@" >> {log}\n'
        f'if [ "$1" = -c ]; then exit {0 if system_torch else 1}; fi\n'
        f'mkdir -p {venv}/bin && printf "#!/bin/sh\\necho /nonexistent\\n" > {venv}/bin/python && chmod +x {venv}/bin/python\n'
    )
    system.chmod(0o755)
    made = run_command(["make", "-s", "-B", "setup", f"PYTHON={system}", f"VENV={venv}", "GPU_SIGNS="], env=cpu_env())
    assert made.returncode == 0, made.stderr
    (created,) = [line for line in log.read_text().splitlines() if line.startswith("-m venv")]
    # without pip: uv installs (the venv's pip is put there only where uv cannot be had)
    assert created == f"-m venv --without-pip {'--system-site-packages ' if system_torch else ''}{venv}"


def test_a_failing_run_of_make_train_ends_in_its_own_line_without_the_launchers_traceback():
    """make train's launcher (`$(LAUNCH)`) is Accelerate's with --quiet: a one-process run that fails ends in the
    run's own `error:` line and a non-zero exit, not also in the launcher's CalledProcessError traceback. (A planted
    failing program stands in for train.py.)"""
    probe = 'probe: ; @$(LAUNCH) --no_python sh -c "echo error: planted >&2; exit 3"'
    made = run_command(["make", "-s", "--eval", probe, "probe"], env=cpu_env())
    assert made.returncode != 0 and "error: planted" in made.stderr
    assert "Traceback" not in made.stderr and "CalledProcessError" not in made.stderr


def test_make_writes_bytecode_whatever_the_callers_environment_says():
    """No package is compiled at set-up: the first process that imports a module writes its bytecode into the venv,
    as Python does by default, also where the caller set PYTHONDONTWRITEBYTECODE (every launched process would
    otherwise compile torch and transformers again)."""
    env = {**cpu_env(), "PYTHONDONTWRITEBYTECODE": "1"}
    probe = 'probe: ; @$(PY) -c "import sys; print(sys.dont_write_bytecode)"'
    made = run_command(["make", "-s", "--eval", probe, "probe"], env=env)
    assert made.returncode == 0, made.stderr
    assert made.stdout.strip() == "False"
    assert "compileall" not in run_command(["make", "-n", "-B", "setup", "test"], env=cpu_env()).stdout


def test_make_setup_passes_pips_own_settings_on_to_uv(tmp_path):
    """uv reads none of pip's files: the index, extra indexes, find-links and constraints pip would use (its config
    file and PIP_* variables, a variable before the file) reach uv's command line, with pip's rule of the best match
    over every index."""
    conf = tmp_path / "pip.conf"
    conf.write_text(
        "[global]\nindex-url = https://mirror.example/simple\n"
        "extra-index-url = file:///srv/a/simple\n    file:///srv/b/simple\n"
        "find-links = /srv/wheels\nconstraint = /srv/constraints.txt\ntimeout = 60\n"
    )
    env = {k: v for k, v in cpu_env().items() if not k.startswith("PIP_")}
    env.update(PIP_CONFIG_FILE=str(conf), PIP_FIND_LINKS="/srv/env-wheels")
    show = "show: ; @$(UV_SETTINGS)"
    made = run_command(["make", "-s", "--eval", show, "show"], env=env)
    assert made.returncode == 0, made.stderr
    assert shlex.split(made.stdout) == [
        "--index-strategy",
        "unsafe-best-match",
        "--index-url",
        "https://mirror.example/simple",
        "--extra-index-url",
        "file:///srv/a/simple",
        "--extra-index-url",
        "file:///srv/b/simple",
        "--find-links",
        "/srv/env-wheels",
        "--constraint",
        "/srv/constraints.txt",
    ]


def test_a_committed_comparison_is_judged_again_by_todays_test_from_its_runs_records():
    from trainscope.report.sections import rejudged

    speeds = {"base": [10.0, 10.2, 9.9, 10.1, 10.0], "new": [10.2, 10.4, 10.1, 10.3, 10.2]}  # 2%: all pairs above 1
    records = {
        f"{arm}-r{i}": {"summary": {"throughput": {"samples_per_s": v}}}
        for arm, values in speeds.items()
        for i, v in enumerate(values)
    }
    old = {
        "baseline": "base",
        "arms": {arm: {"status": "complete", "runs": [f"{arm}-r{i}" for i in range(5)]} for arm in speeds},
        "comparisons": {"new": {"speed": {"verdict": "faster", "median_ratio": 1.02}}},
    }  # the old sign rule's
    speed = rejudged(old, records)["comparisons"]["new"]["speed"]
    assert speed["verdict"] == "within noise" and speed["test"].startswith("two-sided Mann-Whitney U")  # under 3%
    partial = {k: v for k, v in records.items() if k != "new-r4"}  # a run missing: the written verdict stands
    kept = {"baseline": "base", "arms": old["arms"], "comparisons": {"new": {"speed": {"verdict": "faster"}}}}
    assert rejudged(kept, partial)["comparisons"]["new"]["speed"] == {"verdict": "faster"}


# ---------------------------------------------------------------- the machine of every figure

EPYC = {
    "device": "cpu",
    "device_name": "AMD EPYC",
    "device_count": 0,
    "cpu_capability": "AVX2, no native bf16",
    "cpu_native_bf16": False,
    "usable_cores": 2,
}
XEON = {
    "device": "cpu",
    "device_name": "Intel(R) Xeon(R) Processor",
    "device_count": 0,
    "cpu_capability": "AVX512 + amx_bf16, avx512_bf16",
    "cpu_native_bf16": True,
    "usable_cores": 2,
    "cpu_bf16": {"flags": ["amx_bf16", "avx512_bf16"], "native_by_flags": True},
}


def on_machine(record: dict, environment: dict) -> dict:
    """A record as another machine would have written it: its environment's machine keys and its provenance's."""
    host = {
        "device_name": environment["device_name"],
        "device_count": environment["device_count"],
        "cpu": environment.get("cpu", environment["device_name"]),
        "cpu_capability": environment["cpu_capability"],
        "usable_cores": environment["usable_cores"],
    }
    env = {k: v for k, v in {**record.get("environment", {}), **environment}.items() if k != "cpu"}
    if "cpu_bf16" not in environment:
        env.pop("cpu_bf16", None)
    return {
        **record,
        "environment": env,
        "provenance": {
            **record.get("provenance", {}),
            "machine": {**record.get("provenance", {}).get("machine", {}), **host},
        },
    }


@pytest.mark.parametrize(
    "environment, text",
    [
        (EPYC, "AMD EPYC, AVX2, bf16 emulated, 2 cores"),
        (XEON, "Intel Xeon, AVX512-BF16 + AMX, 2 cores"),
        ({**XEON, "cpu_bf16": None}, "Intel Xeon, AVX512-BF16 + AMX, 2 cores"),  # schema 2: the flags in the capability
        (
            {
                **EPYC,
                "device_name": "Intel(R) Xeon(R) Gold 6338 CPU @ 2.00GHz",
                "cpu_capability": "AVX512, no native bf16",
                "usable_cores": 16,
            },
            "Intel Xeon Gold 6338 @ 2.00GHz, AVX512, bf16 emulated, 16 cores",
        ),
        (
            {**EPYC, "device_name": "ARM CPU implementer 0x41 part 0xd40", "cpu_capability": "SVE256 + bf16, svebf16"},
            "ARM CPU implementer 0x41 part 0xd40, SVE256 + SVE-BF16, 2 cores",
        ),
        (
            {
                **XEON,
                "device": "cuda:0",
                "device_name": "NVIDIA H200",
                "device_count": 1,
                "usable_cores": 16,
                "cpu": "Intel(R) Xeon(R) Processor",
            },
            "NVIDIA H200 (host Intel Xeon, AVX512-BF16 + AMX, 16 cores)",
        ),
    ],
)
def test_a_records_machine_is_its_cpu_model_and_isa_class_or_its_gpu(environment, text):
    from trainscope.core.record_view import RunView
    from trainscope.core.results_view import results_machine

    record = on_machine({"run_name": "r"}, environment)
    assert RunView(record).machine.text == text
    assert results_machine({"provenance": record["provenance"]}) == RunView(record).machine  # a results file's too


def planted_two_machines(runs: Path, copy: Path) -> Path:
    """The built runs copied, make profile's on a Xeon with AMX, make matrix's and make amp-compare's on an AVX2 EPYC."""
    shutil.copytree(runs, copy)
    for folder, environment in (("profile", XEON), ("matrix", EPYC), ("amp", EPYC)):
        for path in (copy / folder).rglob("record.json"):
            path.write_text(json.dumps(on_machine(json.loads(path.read_text()), environment)))
        comparison = copy / folder / "comparison.json"
        comparison.write_text(json.dumps(on_machine(json.loads(comparison.read_text()), environment)))
    return copy


def test_every_section_figure_and_first_page_group_names_its_machine(built, tmp_path):
    """Records of two planted machines: the first page groups the answers by machine, each section opens with its
    machine and every figure's caption and table's title repeat it, and the provenance lists both."""
    from test_report_pdf import drawn_words, squeeze

    runs = planted_two_machines(built[0], tmp_path / "runs")
    out = tmp_path / "reports"
    report.build(runs, tmp_path / "none", out)
    text = (out / "report.md").read_text()
    xeon, epyc = "Intel Xeon, AVX512-BF16 + AMX, 2 cores", "AMD EPYC, AVX2, bf16 emulated, 2 cores"
    glance = text.split("## At a glance")[1].split("\n## ")[0]
    groups = {
        part.split(": what each")[0]: [line.split(" | ")[0][2:] for line in part.splitlines() if line.startswith("| ")][
            1:
        ]
        for part in glance.split("\n**")[1:]
    }
    assert list(groups) == [f"Measured on {xeon}", f"Measured on {epyc}", "Not measured (not run yet, or skipped)"]
    assert groups[f"Measured on {xeon}"] == ["Where the time went", "Optimization: what to try next"]
    assert groups[f"Measured on {epyc}"] == ["Mixed precision vs FP32", "Configs and switches side by side"]
    time_went = text.split("## Where the time went")[1].split("\n## ")[0]
    matrix = text.split("## Configs and switches side by side")[1].split("\n## ")[0]
    assert time_went.strip().startswith(f"**Measured on:** {xeon}.") and matrix.strip().startswith(
        f"**Measured on:** {epyc}."
    )
    assert f"*Stage time per step for each variant (measured on {epyc})*" in matrix
    assert f"(measured on {epyc})** (LaTeX: `matrix.tex`)" in matrix and epyc in (out / "matrix.tex").read_text()
    assert f"*Share of wall time per category (measured on {xeon})*" in time_went
    provenance = text.split("## Provenance")[1]
    assert f"- measured on: {xeon} (" in provenance and f"- measured on: {epyc} (" in provenance
    assert "- report built on: " in provenance
    assert set(json.loads((out / "inputs.json").read_text())["machines"]) == {xeon, epyc}
    # in the PDF, the caption under the matrix figure names the machine
    words = drawn_words(out / "report.pdf")
    pages = {w.page for w in words if w.text == "Stage"}
    assert any(
        squeeze(f"Stage time per step for each variant (measured on {epyc})")
        in squeeze(" ".join(w.text for w in words if w.page == page))
        for page in pages
    )


def test_a_comparison_whose_runs_come_from_two_machines_is_refused(built, tmp_path):
    runs = planted_two_machines(built[0], tmp_path / "runs")
    moved = runs / "matrix" / "cpu+ckpt-r0" / "record.json"
    moved.write_text(json.dumps(on_machine(json.loads(moved.read_text()), XEON)))
    out = tmp_path / "reports"
    report.build(runs, tmp_path / "none", out)
    text = (out / "report.md").read_text()
    matrix = text.split("## Configs and switches side by side")[1].split("\n## ")[0]
    assert "(skipped: its runs come from 2 machines, whose figures are not comparable with each other:" in matrix
    assert "Intel Xeon, AVX512-BF16 + AMX, 2 cores (cpu+ckpt-r0)" in matrix and "samples/s" not in matrix
    assert not (out / "matrix.tex").exists()


def test_compare_dp_and_the_matrix_are_set_side_by_side_only_from_one_machine():
    from trainscope.core.record_view import RunView
    from trainscope.experiments.data_parallel import results as data_parallel

    class Said:
        def __init__(self):
            self.lines = []

        def text(self, line):
            self.lines.append(line)

    result = json.loads((ROOT / "benchmarks" / "compare_dp" / "compare_dp.json").read_text())
    result = on_machine(result, EPYC)
    matrix = {"baseline": "cpu", "comparisons": {"ddp": {"speed": bench_speed()}}}
    for environment, shown in ((EPYC, True), (XEON, False)):
        record = on_machine({"run_name": "ddp-r0"}, environment)
        said = Said()
        data_parallel.reconcile_with_matrix(said, result, matrix, {RunView(record).machine: ["ddp-r0"]})
        assert ("The same question twice" in said.lines[0]) is shown, said.lines
        assert ("not set beside this one" in said.lines[0]) is not shown


def bench_speed() -> dict:
    from trainscope.measure import bench

    return bench.compare_samples([10.0, 10.1, 9.9, 10.0, 10.2], [10.3, 10.4, 10.2, 10.3, 10.5])


# ---------------------------------------------------------------- mixed precision: whole runs, alternating rounds


def test_the_amp_comparison_judges_whole_runs_never_the_intervals_of_one(tmp_path):
    """Machine A's committed make amp-compare (kept as amp_avx2) ran one round (one run per arm): its 10 logged
    intervals are not 10 pairs, so the report says too few pairs and gives no verdict."""
    from trainscope.experiments import amp

    shutil.copytree(ROOT / "benchmarks" / "runs" / "amp_avx2", tmp_path / "amp")
    found = sections.collect(tmp_path, tmp_path / "none", [amp.EXPERIMENT])
    answer = amp.headline(found)
    assert answer.verdict == "too few pairs" and "interval" not in answer.text
    assert "`bf16` 0.05" in answer.text and "1 pairs" in answer.text and "warned: bf16_emulated" in answer.text


def test_a_folder_named_as_an_experiments_deeper_down_holds_other_runs_not_the_experiments(tmp_path):
    """<runs>/amp/<run> are make amp-compare's runs; <runs>/elsewhere/amp/<run> of the same names are other runs,
    which neither replace nor join them."""
    from trainscope.experiments import amp

    shutil.copytree(ROOT / "benchmarks" / "runs" / "amp", tmp_path / "amp")
    shutil.copytree(ROOT / "benchmarks" / "runs" / "amp", tmp_path / "elsewhere" / "amp")
    found = sections.collect(tmp_path, tmp_path / "none", [amp.EXPERIMENT])
    names = sorted(p.parent.name for p in (tmp_path / "amp").glob("*/record.json"))
    assert sorted(found.runs["amp"]) == names and len(found.other_runs) == len(names) > 0
    assert {r["path"] for r in found.runs["amp"].values()} == {str(tmp_path / "amp" / n) for n in names}


def test_make_amp_compare_runs_alternating_rounds_sized_for_emulated_bf16_on_a_cpu():
    command = " ".join(run_command(["make", "-n", "amp-compare", "RUNS=R", "HAS_GPU="], env=cpu_env()).stdout.split())
    assert "-m trainscope.experiments amp --runs R/amp --configs cpu bf16 --rounds 5 --" in command
    assert "--per-device-batch-size 8" in command and "--max-steps 12" in command and "--max-eval-samples 64" in command


def test_a_report_of_your_runs_never_replaces_the_committed_report(tmp_path, monkeypatch):
    """make report after make train reads runs/: its report goes to results/report/ (ignored), and the tracked
    reports/ -- the committed inputs' report -- is left as it is; the committed inputs, named or found on a fresh
    clone, still build into reports/."""
    assert report.default_out(*report.COMMITTED) == Path("reports")
    monkeypatch.chdir(ROOT)
    assert report.default_out(Path("benchmarks/runs"), Path("benchmarks")) == Path("reports")  # make report RUNS=...
    monkeypatch.chdir(tmp_path)
    (tmp_path / "runs").mkdir()
    runs, results, source = report.inputs(SimpleNamespace(runs=None, results=None), parser=None)
    assert (runs, results, source) == (Path("runs"), Path("results"), " (your runs)")
    assert report.default_out(runs, results) == Path("results") / "report"
    ignored = subprocess.run(
        ["git", "check-ignore", "-q", "results/report/report.md"], cwd=ROOT, capture_output=True
    ).returncode
    assert ignored == 0 and "/results/" in (ROOT / ".gitignore").read_text().split()


def test_the_main_run_is_make_trains_not_the_newest(tmp_path):
    """make train, then make train-lm, then make report: "where the time went" on page one is make train's run,
    named with why it was chosen, not train-lm's newer one; --run picks another. Both runs are real (tiny, in this
    process), each recording as its command the one its make target launches."""
    import runpy
    import time

    from trainscope.experiments import profile

    runs = tmp_path / "runs"
    train_args = [*shlex.split(TINY), "--max-steps", "2", "--output-dir", str(runs), "--run-name", "trained"]
    lm_args = ["--steps", "2", "--seq-length", "32", "--batch-size", "4", "--max-texts", "300", "--log-every", "1"]
    lm_args += ["--output-dir", str(runs), "--run-name", "lm"]
    lm_main = runpy.run_path(str(ROOT / "examples" / "causal_lm.py"), run_name="causal_lm")["main"]
    for target, args, main in (("train", train_args, None), ("train-lm", lm_args, lm_main)):
        time.sleep(1.1 * (target == "train-lm"))  # a record's finish time has whole seconds: train-lm's is newer
        planned = run_command(["make", "-n", target, f"ARGS={shlex.join(args)}"], env=cpu_env()).stdout
        (command,) = [shlex.split(line) for line in planned.splitlines() if " launch " in line]
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(sys, "orig_argv", command)
            completed = run_in_process(args, main=main)
        assert completed.returncode == 0, completed.stderr[-3000:]
    found = sections.collect(runs, tmp_path / "none", REGISTRY)
    assert [RunView(r).script for r in found.top_runs] == ["causal_lm.py", "train.py"]  # folders in name order
    assert RunView(found.top_runs[0]).finished > RunView(found.top_runs[1]).finished  # train-lm's is the newest
    assert "(run `trained`, make train's newest run, profiler off)" in profile.headline(found).text
    found.asked_run = "lm"
    assert "(run `lm`, named by --run, profiler off)" in profile.headline(found).text


QUESTIONS = {  # the assignment's questions, each answered on the first page by the section that measured it
    "Where does a training step's time go?": "Where the time went",
    "How many DataLoader workers (num_workers)?": "DataLoader num_workers",
    "Mixed precision against FP32: faster, and at what cost?": "Mixed precision vs FP32",
    "DataParallel against DistributedDataParallel?": "DataParallel vs DDP",
    "What does DDP's gradient communication cost, and can a setting hide it?": "What DDP communication costs",
}


def test_the_first_page_answers_each_question_of_the_assignment_in_sentences(committed):
    """Page 1 of the committed report: each question with an answer in words (no "pairs, p" notation to decode:
    'times as fast as', 'alternating pairs'), the machine that measured it and the section it comes from;
    mixed precision answered first from a machine where it means something (native bf16 or a GPU), the emulated
    CPU last and said as such; DataParallel said as what it needs."""
    text = (committed / "report.md").read_text()
    table = text.split("## The assignment's questions, answered")[1].split("\n## ")[0]
    rows = {line.split(" (section: ")[0][2:]: line for line in table.splitlines() if "(section: " in line}
    assert set(rows) == set(QUESTIONS)
    for question, section in QUESTIONS.items():
        assert f"(section: {section})" in rows[question] and "measured on " in rows[question]
        assert "Not run yet" not in rows[question] and " pairs, p " not in rows[question]
    amp = rows["Mixed precision against FP32: faster, and at what cost?"].split(" | ")[1]
    assert not amp.startswith("Where bf16 is emulated") and "AVX512-BF16" in amp.split("(measured on")[1]
    assert "times as fast as fp32" in amp and "alternating pairs" in amp
    assert "needs a machine with 2 GPUs" in rows["DataParallel against DistributedDataParallel?"]
