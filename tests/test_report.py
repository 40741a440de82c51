"""The whole report, built from records that tiny CPU runs of the make targets produce."""

import json
import sys
import re
import shutil

import pytest

import report
from conftest import ROOT, cpu_env, run_command
from trainscope import reporting

TINY = ("--model embedded:tiny-bert --max-train-samples 256 --max-eval-samples 64 --max-test-samples 64 "
        "--per-device-batch-size 16 --learning-rate 3e-3 --report-to none --log-every 2")
FIGURES = ["time_breakdown", "loaders", "amp_loss", "compare_dp", "ckpt", "batch", "matrix"]
TABLES = ["time_breakdown", "loaders", "amp", "compare_dp", "ckpt", "batch", "matrix", "attribution"]


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    root = tmp_path_factory.mktemp("experiments")
    runs, results, out = root / "runs", root / "results", root / "reports"
    common = [f"RUNS={runs}", f"RESULTS={results}", f"EXP_ARGS={TINY}"]
    targets = [["profile", "amp-compare", "ckpt-compare"], ["batch-sweep", "BATCH_SIZES=8 16"],
               ["matrix", "MATRIX_VARIANTS=cpu ddp cpu+ckpt"],
               ["sweep-workers", "WORKERS=0 1", "REPEATS=2", "SWEEP_ARGS=--model embedded:tiny-bert "
                "--max-train-samples 128"],
               ["compare-dp", "DP_ARGS=--model embedded:tiny-bert --max-train-samples 256 --steps 4"],
               ["report", f"REPORT_ARGS=--out {out}"]]
    for target in targets:
        completed = run_command(["make", "-s", *target, *common], env=cpu_env(), timeout=900)
        assert completed.returncode == 0, f"make {target}: {completed.stderr[-3000:]}"
    return runs, results, out


def test_every_expected_file_exists(built):
    _, _, out = built
    for name in FIGURES:
        for suffix in ("png", "pdf"):
            assert (out / f"{name}.{suffix}").stat().st_size > 1000, name
    for name in TABLES:
        assert (out / f"{name}.tex").exists(), name
    text = (out / "report.md").read_text()
    assert "Not run yet" not in text
    for heading in ("Where the time went", "DataLoader num_workers", "Mixed precision vs FP32",
                    "DataParallel vs DDP", "Activation checkpointing", "Batch size", "Configs and switches"):
        assert f"## {heading}" in text
    assert not list(out.parent.glob(".reports.building"))


def tabular_rows(tex: str):
    """(column spec, [cells per row]) of every tabular in a LaTeX string."""
    tables = []
    for spec, body in re.findall(r"\\begin\{tabular\}\{([^}]*)\}(.*?)\\end\{tabular\}", tex, re.S):
        rows = [line for line in body.splitlines() if line.strip().endswith(r"\\")]
        tables.append((spec, [len(re.split(r"(?<!\\)&", row)) for row in rows]))
    return tables


def test_latex_tables_parse_as_tables(built):
    _, _, out = built
    for name in TABLES:
        tex = (out / f"{name}.tex").read_text()
        for environment in ("table", "tabular"):
            assert tex.count(rf"\begin{{{environment}}}") == tex.count(rf"\end{{{environment}}}") == 1, name
        assert tex.index(r"\toprule") < tex.index(r"\midrule") < tex.index(r"\bottomrule")
        (spec, cells), = tabular_rows(tex)
        assert cells and all(count == len(spec) for count in cells), (name, spec, cells)
        assert "_" not in re.sub(r"\\_|\\label\{[^}]*\}", "", tex), f"unescaped _ in {name}"


def test_pie_shares_sum_to_100_percent(built):
    runs, _, out = built
    record = json.loads((runs / "profile" / "default" / "record.json").read_text())
    breakdown = reporting.time_breakdown(record)
    assert sum(c["percent"] for c in breakdown["categories"]) == pytest.approx(100.0)
    assert sum(s["percent"] for s in breakdown["stages"]) == pytest.approx(100.0)
    tex = (out / "time_breakdown.tex").read_text()
    categories = [float(m) for m in re.findall(r"^(?!\s*stage)[a-z+ ]+ & [\d.]+ & ([\d.]+)\\%", tex, re.M)][:5]
    assert len(categories) == 5 and sum(categories) == pytest.approx(100.0, abs=0.3)


def test_amp_table_ratios_equal_the_records(built):
    runs, _, out = built
    fp32 = json.loads((runs / "amp" / "cpu" / "record.json").read_text())["summary"]
    bf16 = json.loads((runs / "amp" / "bf16" / "record.json").read_text())["summary"]
    tex = (out / "amp.tex").read_text()
    row = next(line for line in tex.splitlines() if line.startswith("bf16 &"))
    cells = [c.strip().rstrip("\\").strip() for c in row.split("&")]
    assert cells[1] == "bf16"
    assert float(cells[5]) == pytest.approx(bf16["throughput"]["samples_per_s"], abs=0.06)
    assert float(cells[7]) == pytest.approx(bf16["throughput"]["samples_per_s"] / fp32["throughput"]["samples_per_s"],
                                            abs=6e-4)
    assert float(cells[3]) == pytest.approx(bf16["test"]["accuracy"], abs=6e-5)


def test_the_pdf_renders(built):
    import pypdfium2

    _, _, out = built
    document = pypdfium2.PdfDocument(str(out / "report.pdf"))
    assert len(document) >= 3
    image = document[0].render(scale=1).to_pil()
    image.save(out.parent / "page1.png")
    darkest, lightest = image.convert("L").getextrema()
    assert image.size[0] > 500 and lightest - darkest > 100  # not a blank page


def test_missing_experiments_name_their_make_target_and_bad_records_are_skipped(built, tmp_path):
    runs, results, _ = built
    partial = tmp_path / "runs"
    shutil.copytree(runs / "amp", partial / "amp")
    (partial / "amp" / "broken").mkdir()
    (partial / "amp" / "broken" / "record.json").write_text("{not json")
    (partial / "foreign").mkdir()
    (partial / "foreign" / "record.json").write_text('{"something": "else"}')
    out = tmp_path / "reports"
    completed = run_command([sys.executable,
                             str(ROOT / "report.py"), "--runs", str(partial), "--results", str(tmp_path / "none"),
                             "--out", str(out)], env=cpu_env())
    assert completed.returncode == 0, completed.stderr
    assert "broken/record.json" in completed.stderr and "foreign/record.json" in completed.stderr
    text = (out / "report.md").read_text()
    for target in ("make ckpt-compare", "make batch-sweep", "make matrix", "make sweep-workers", "make compare-dp"):
        assert f"Not run yet: `{target}`" in text
    assert "## Mixed precision vs FP32" in text and (out / "amp.tex").exists()


def test_report_without_inputs_is_refused(tmp_path):
    with pytest.raises(SystemExit) as exit_info:
        report.main(["--runs", str(tmp_path / "a"), "--results", str(tmp_path / "b"), "--out", str(tmp_path / "c")])
    assert exit_info.value.code == 2
    assert not (tmp_path / "c").exists()


def test_figures_go_to_the_wandb_run_that_used_it(tmp_path):
    runs = tmp_path / "runs"
    completed = run_command([sys.executable, str(ROOT / "train.py"), *TINY.split()[:-4], "--report-to", "wandb",
                             "--output-dir", str(runs / "profile"), "--run-name", "default"],
                            env=cpu_env(WANDB_MODE="offline"))
    assert completed.returncode == 0, completed.stderr[-2000:]
    out = tmp_path / "reports"
    completed = run_command([sys.executable, str(ROOT / "report.py"), "--runs", str(runs), "--results",
                             str(tmp_path / "none"), "--out", str(out)], env=cpu_env(WANDB_MODE="offline"))
    assert completed.returncode == 0, completed.stderr[-2000:]
    assert "logged the report's figures to W&B run default" in completed.stdout
    images = [p for p in (runs / "profile" / "default" / "wandb").rglob("*.png") if "media" in p.parts]
    assert images and any("time_breakdown" in image.name for image in images)
