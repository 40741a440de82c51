"""The benchmark drivers run end to end in CI-sized time (their figures come from `make bench-*`)."""

import json
import sys

from conftest import ROOT, cpu_env, run_command

TINY = ["--model", "embedded:tiny-bert", "--max-train-samples", "256", "--per-device-batch-size", "16",
        "--max-steps", "8", "--timing-warmup-steps", "2"]


def test_trainer_peer_compares_train_py_with_the_hf_trainer(tmp_path):
    out = tmp_path / "peer"
    completed = run_command([sys.executable, "-m", "trainscope.benchmarks.trainer_peer", "--pairs", "1",
                             "--out", str(out), *TINY], env=cpu_env())
    assert completed.returncode == 0, completed.stderr[-3000:]
    report = json.loads(out.with_suffix(".json").read_text())
    (pair,) = report["pairs"]
    assert pair["trainer_samples_per_s"] > 0 and pair["train_py_samples_per_s"] > 0
    assert report["median_ratio"] == pair["train_py_samples_per_s"] / pair["trainer_samples_per_s"]
    assert report["accelerate_config"] == "cpu" and report["effective_precision"] == "fp32"
    assert "not measured on GPU" in out.with_suffix(".md").read_text()


def test_overhead_benchmark_pairs_a_bare_loop_with_train_py(tmp_path):
    out = tmp_path / "overhead"
    completed = run_command([sys.executable, "-m", "trainscope.benchmarks.overhead", "--pairs", "1",
                             "--out", str(out), *TINY], env=cpu_env())
    assert completed.returncode == 0, completed.stderr[-3000:]
    report = json.loads(out.with_suffix(".json").read_text())
    (pair,) = report["results"]["host"]["pairs"]
    assert pair["bare_samples_per_s"] > 0 and pair["timed_samples_per_s"] > 0
    assert report["results"]["host"]["median_ratio"] == pair["ratio"]
    assert report["machine"]["usable_cores"] >= 1
