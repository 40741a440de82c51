"""The report, built from records that tiny CPU runs of the make targets produce, and rebuilt from the
committed inputs."""

import json
import re
import shutil
import sys

import pytest

import report
from conftest import ROOT, cpu_env, run_command
from trainscope import provenance

TINY = ("--model embedded:tiny-bert --max-train-samples 256 --max-eval-samples 64 --max-test-samples 64 "
        "--per-device-batch-size 16 --learning-rate 3e-3 --report-to none --log-every 2 --threads 1")


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    root = tmp_path_factory.mktemp("experiments")
    runs, results, out = root / "runs", root / "results", root / "reports"
    common = [f"RUNS={runs}", f"RESULTS={results}", f"EXP_ARGS={TINY}", f"SPEED_ARGS={TINY} --max-steps 6",
              f"AMP_ARGS={TINY} --max-steps 6", "ROUNDS=1"]
    for target in (["profile"], ["matrix", "MATRIX_VARIANTS=cpu cpu+ckpt"],
                   ["report", f"REPORT_ARGS=--out {out}"]):
        completed = run_command(["make", "-s", *target, *common], env=cpu_env(), timeout=900)
        assert completed.returncode == 0, f"make {target}: {completed.stderr[-3000:]}"
    return runs, results, out


def test_every_section_is_there_or_names_its_make_target(built):
    runs, _, out = built
    text = (out / "report.md").read_text()
    for heading in ("Where the time went", "DataLoader num_workers", "Mixed precision vs FP32",
                    "DataParallel vs DDP", "Activation checkpointing", "Batch size", "Configs and switches"):
        assert f"## {heading}" in text
    for target in ("make sweep-workers", "make compare-dp", "make batch-sweep", "make ckpt-compare",
                   "make amp-compare"):
        assert f"Not run yet: `{target}` produces it." in text
    for name in ("time_breakdown", "matrix"):
        assert (out / f"{name}.png").stat().st_size > 1000 and (out / f"{name}.pdf").exists()
    assert not list(out.parent.glob(".reports.building"))


def test_the_time_breakdown_comes_from_the_run_without_the_profiler(built):
    runs, _, out = built
    text = (out / "report.md").read_text()
    assert "From run `default-r0`, which ran without the profiler." in text
    pie_part = text.split("## Where the time went")[1].split("## ")[0]
    assert "profiler_on" not in pie_part  # the pie's run did not profile
    assert "Top operators by self time" in pie_part and "Profiler overhead on the traced steps" in pie_part


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
    """Checked on the committed report: its AMP runs are real ones (fp32 and bf16 on this CPU)."""
    runs, out = ROOT / "benchmarks" / "runs", ROOT / "reports"
    bf16 = json.loads((runs / "amp" / "bf16-r0" / "record.json").read_text())["summary"]
    row = next(line for line in (out / "amp.tex").read_text().splitlines() if line.startswith("bf16 &"))
    cells = [c.strip().rstrip("\\").strip() for c in row.split("&")]
    assert cells[1] == "bf16"
    assert float(cells[3]) == pytest.approx(bf16["test"]["accuracy"], abs=6e-5)
    assert float(cells[4]) == pytest.approx(bf16["throughput"]["samples_per_s"], abs=0.06)


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
    broken = {"broken": "{not json", "foreign": '{"something": "else"}', "future": '{"schema_version": 7}',
              "stringly": '{"schema_version": "2"}',
              "hollow": '{"schema_version": 2, "status": "complete", "run_name": "h", "settings": {}, "environment": {}}'}
    for name, content in broken.items():
        (partial / "matrix" / name).mkdir()
        (partial / "matrix" / name / "record.json").write_text(content)
    with open(partial / "matrix" / "cpu+ckpt-r0" / "steps.jsonl", "a") as handle:
        handle.write('{"step": 99, "lo')  # a killed run's last line
    out = tmp_path / "reports"
    completed = run_command([sys.executable, str(ROOT / "report.py"), "--runs", str(partial), "--results",
                             str(tmp_path / "none"), "--out", str(out)], env=cpu_env())
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
    completed = run_command([sys.executable, str(ROOT / "report.py"), "--runs", str(runs), "--results", str(results),
                             "--out", str(out)], env=cpu_env())
    assert completed.returncode == 0, completed.stderr
    text = (out / "report.md").read_text()
    assert "section dp: its inputs lack what it reads (KeyError: 'hardware')" in text.split("## Skipped inputs")[1]
    assert "## DataParallel vs DDP" not in text and "## Configs and switches side by side" in text
    assert "Traceback" not in completed.stderr


def test_report_without_inputs_is_refused(tmp_path):
    with pytest.raises(SystemExit) as exit_info:
        report.main(["--runs", str(tmp_path / "a"), "--results", str(tmp_path / "b"), "--out", str(tmp_path / "c")])
    assert exit_info.value.code == 2
    assert not (tmp_path / "c").exists()


def test_the_committed_report_is_rebuilt_from_committed_inputs(tmp_path):
    """reports/ holds what `make report RUNS=benchmarks/runs RESULTS=benchmarks` builds on a fresh clone."""
    out = tmp_path / "reports"
    completed = run_command([sys.executable, str(ROOT / "report.py"), "--runs", str(ROOT / "benchmarks" / "runs"),
                             "--results", str(ROOT / "benchmarks"), "--out", str(out)], env=cpu_env())
    assert completed.returncode == 0, completed.stderr[-3000:]
    committed = sorted(p.name for p in (ROOT / "reports").glob("*.tex"))
    assert committed and committed == sorted(p.name for p in out.glob("*.tex"))
    for name in committed:
        assert (out / name).read_text() == (ROOT / "reports" / name).read_text(), name
    assert "Not run yet" not in (out / "report.md").read_text()


def test_figures_go_to_the_wandb_run_that_used_it(tmp_path):
    runs = tmp_path / "runs"
    completed = run_command([sys.executable, str(ROOT / "train.py"), *TINY.split()[:-4], "--report-to", "wandb",
                             "--output-dir", str(runs), "--run-name", "default"], env=cpu_env(WANDB_MODE="offline"))
    assert completed.returncode == 0, completed.stderr[-2000:]
    out = tmp_path / "reports"
    completed = run_command([sys.executable, str(ROOT / "report.py"), "--runs", str(runs), "--results",
                             str(tmp_path / "none"), "--out", str(out)], env=cpu_env(WANDB_MODE="offline"))
    assert completed.returncode == 0, completed.stderr[-2000:]
    assert "logged the report's figures to W&B run default" in completed.stdout
    images = [p for p in (runs / "default" / "wandb").rglob("*.png") if "media" in p.parts]
    assert images and any("time_breakdown" in image.name for image in images)


@pytest.mark.parametrize("target,expected", [
    ("ckpt-compare", "-m trainscope.experiments compare --runs runs/ckpt --config cpu --rounds 5 --arm off= "
                     "--arm on=--gradient-checkpointing --"),
    ("batch-sweep", "-m trainscope.experiments batch-sweep --config cpu --runs runs/batch --batch-sizes 8 16 32 64 128 "
                    "--rounds 5 --"),
    ("amp-compare", "-m trainscope.experiments amp --runs runs/amp --configs cpu bf16 --"),
])
def test_the_experiment_targets_run_the_experiments_module(target, expected):
    """What `make -n` prints: the targets the report tests do not run end to end (they share its code)."""
    completed = run_command(["make", "-n", target], env=cpu_env())
    command = " ".join(completed.stdout.replace("\\\n", " ").split())
    assert completed.returncode == 0 and expected in command, command
