"""The benchmark drivers run end to end in CI-sized time (their figures come from `make bench-*`)."""

import importlib
import json
import sys

from conftest import fork_launches, run_in_process

from trainscope import bench
from trainscope.benchmarks import trainer_peer

TINY = [
    "--model",
    "embedded:tiny-bert",
    "--max-train-samples",
    "256",
    "--per-device-batch-size",
    "16",
    "--max-steps",
    "8",
    "--timing-warmup-steps",
    "2",
    "--threads",
    "1",
]


def one_round_of(module: str, out, monkeypatch) -> dict:
    """`python -m trainscope.benchmarks.<module> --pairs 1` on the tiny model, the driver in this process; its arms
    (one process each, by `accelerate launch` or `python`) run forked from this process with the command and
    environment their launcher gives them (conftest.fork_launches); its results file."""
    fork_launches(monkeypatch)
    driver = importlib.import_module(f"trainscope.benchmarks.{module}")
    monkeypatch.setattr(sys, "argv", [f"{module}.py", "--pairs", "1", "--out", str(out), *TINY])
    completed = run_in_process([], main=lambda _: driver.main())
    assert completed.returncode == 0, completed.stderr[-3000:]
    return json.loads(out.with_suffix(".json").read_text())


def test_trainer_peer_runs_the_same_batches_by_each_launcher(tmp_path, monkeypatch):
    out = tmp_path / "peer"
    report = one_round_of("trainer_peer", out, monkeypatch)
    (round_,) = report["rounds"]
    assert set(round_) == {"trainer", "accelerate", "python"}
    assert report["same_batches"] is True  # the Trainer saw train.py's batches, step for step
    # every arm ran with the same threads, the Trainer included
    assert {arm["threads"][0] for arm in report["arms"].values()} == {1}
    ratio = report["comparisons"]["accelerate_over_trainer"]
    assert ratio["verdict"] == "too few pairs" and ratio["test"] == bench.METHOD  # one round decides nothing
    assert report["provenance"]["commit"] and "not measured on GPU" in out.with_suffix(".md").read_text()


def test_overhead_benchmark_pairs_a_bare_loop_with_train_py(tmp_path, monkeypatch):
    report = one_round_of("overhead", tmp_path / "overhead", monkeypatch)
    (round_,) = report["rounds"]
    assert round_["bare"]["samples_per_s"] > 0 and round_["host"]["samples_per_s"] > 0
    assert round_["bare"]["threads"] == round_["host"]["threads"]
    host = report["results"]["host"]
    assert host["verdict"] == "too few pairs" and host["target_overhead"] == 0.02 and "p_value" in host
    assert host["meets_target"] is None and "not judged (too few pairs)" in (tmp_path / "overhead.md").read_text()


def test_same_batches_catches_a_trainer_that_saw_other_batches():
    accelerate = {"tokens_at": {"5": 900, "10": 1800}}
    same = [{"accelerate": accelerate, "trainer": {"tokens_at": {"5": 900, "10": 1800, "2": 300}}}]
    shifted = [{"accelerate": accelerate, "trainer": {"tokens_at": {"5": 900, "10": 1795}}}]
    missing = [{"accelerate": accelerate, "trainer": {"tokens_at": {"5": 900}}}]
    assert trainer_peer.same_batches(same) and not trainer_peer.same_batches(shifted)
    assert not trainer_peer.same_batches(missing)
