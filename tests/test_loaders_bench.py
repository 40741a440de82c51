"""loaders_bench.py: the pass timer against a known per-item cost, the summary, and the make target."""

import json
import time

import pytest
import torch
from conftest import cpu_env, run_command

import loaders_bench
from trainscope.experiments.loaders import sweep as loader_sweep

ITEM_S = 0.02
ITEMS = 100


class SleepyDataset(torch.utils.data.Dataset):
    """Each item costs a known ITEM_S seconds of waiting (not CPU), like reading from slow storage."""

    def __len__(self):
        return ITEMS

    def __getitem__(self, index):
        time.sleep(ITEM_S)
        return index


def collate(items):
    return {"labels": torch.tensor(items)}


def one_pass(workers: int) -> dict:
    loader = torch.utils.data.DataLoader(SleepyDataset(), batch_size=10, num_workers=workers, collate_fn=collate)
    return loaders_bench.time_passes(loader)[0]


def test_pass_time_matches_the_known_cost_and_two_workers_nearly_halve_it():
    expected = ITEMS * ITEM_S  # 2 s of waiting: scheduler noise is a few percent of it
    serial = one_pass(0)
    assert serial["batches"] == 10 and serial["samples"] == ITEMS
    assert expected <= serial["pass_s"] < expected * 1.25
    parallel = one_pass(2)
    # the steady rate (after the first batch, which pays the workers' start-up) nearly doubles
    assert parallel["steady_batches_per_s"] > 1.6 * serial["steady_batches_per_s"]
    assert parallel["first_batch_s"] > serial["first_batch_s"]


def test_summary_finds_best_knee_speedup_and_a_verdict_against_the_default():
    rows = []
    for workers, seconds in ((0, 10.0), (1, 5.2), (2, 4.1), (3, 4.0), (4, 4.05)):
        for repeat, jitter in enumerate((0.0, 0.1, -0.1, 0.05, -0.05)):
            rows.append(
                {
                    "mode": "pretokenized",
                    "batch_size": 32,
                    "pin_memory": False,
                    "persistent_workers": False,
                    "prefetch_factor": 2,
                    "num_workers": workers,
                    "repeat": repeat,
                    "pass": 0,
                    "pass_s": seconds + jitter,
                    "first_batch_s": 0.1,
                    "samples_per_s": 1.0,
                    "batches_per_s": 1.0,
                }
            )
    summary = loader_sweep.summarize(rows, knee_tolerance=0.05)
    assert len(summary["settings"]) == 5
    three = next(s for s in summary["settings"] if s["num_workers"] == 3)
    assert (three["median"], three["min"], three["max"]) == (4.0, 3.9, 4.1)
    (curve,) = summary["curves"].values()
    assert curve["best_workers"] == 3 and curve["knee_workers"] == 2  # 4.1 is within 5% of 4.0
    assert curve["best_speedup_over_default"] == pytest.approx(2.5)
    assert curve["flags"].startswith("--num-workers 2 ")
    against = curve["knee_against_default"]
    assert (
        against["pairs"] == 5 and against["verdict"] == "faster" and against["median_ratio"] == pytest.approx(10 / 4.1)
    )


def test_in_training_knee_counts_points_of_step_time():
    rows = []
    for workers, share in ((0, 0.004), (1, 0.003), (2, 0.002), (3, 0.10), (4, 0.001)):
        rows.append(
            {
                "mode": "in-training",
                "batch_size": 32,
                "pin_memory": False,
                "persistent_workers": False,
                "prefetch_factor": 2,
                "num_workers": workers,
                "repeat": 0,
                "pass": 0,
                "data_share": share,
                "step_s": 1.0,
            }
        )
    (curve,) = loader_sweep.summarize(rows, knee_tolerance=0.05)["curves"].values()
    # 0.4% of step time is within 5 points of the lowest 0.1%: more workers cannot buy anything
    assert curve["best_workers"] == 4 and curve["knee_workers"] == 0
    assert curve["flags"].startswith("--num-workers 0 ")
    (curve,) = loader_sweep.summarize(
        [{**r, "data_share": r["data_share"] + (0.3 if r["num_workers"] == 0 else 0)} for r in rows],
        knee_tolerance=0.05,
    )["curves"].values()
    assert curve["knee_workers"] == 1  # a loader-bound default (30%) is not within 5 points of 0.1%


def test_the_sweep_is_read_through_its_view_and_the_script_stays_its_lesson():
    """Readers ask LoaderSweepView, which reads a partial results file (no summary yet) as empty; loaders_bench.py
    keeps to the sweep itself, its other parts in trainscope.experiments.loaders.sweep."""
    from pathlib import Path

    from trainscope.core.results_view import LoaderSweepView
    from trainscope.experiments.loaders.results import knees

    partial = LoaderSweepView({"machine": {"device_name": "cpu"}})
    assert (partial.settings_summary, partial.curves, partial.rows, partial.repeats) == ([], {}, [], None)
    assert knees({"machine": {}}) == []
    curve = {"knee_workers": 0, "knee_against_default": {"verdict": "faster"}}
    assert knees({"summary": {"curves": {"c": curve}}}) == [("c", curve, {"verdict": "faster"})]
    assert len(Path(loaders_bench.__file__).read_text().splitlines()) <= 220


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--workers", "-1"], "must be 0 or more"),
        (["--workers", "0", "500"], "not a sane DataLoader setting"),
        (["--modes", "telepathy"], "unknown mode"),
        (["--repeats", "0"], "at least 1"),
        (["--knee-tolerance", "-0.1"], "--knee-tolerance must be at least 0"),
    ],
)
def test_bad_input_exits_2(argv, message, capsys, tmp_path):
    with pytest.raises(SystemExit) as exit_info:
        loaders_bench.main([*argv, "--results-dir", str(tmp_path / "out")])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err.strip().splitlines()[-1]
    assert not (tmp_path / "out").exists()


def test_make_sweep_workers_writes_results_and_plot(tmp_path):
    results = tmp_path / "loaders"
    # 6 batches and 2 + 6 in-training steps: the in-training mode goes on into a second epoch
    result = run_command(
        [
            "make",
            "-s",
            "sweep-workers",
            "WORKERS=0 1",
            "REPEATS=2",
            "LOADER_MODES=pretokenized on-the-fly in-training",
            f"SWEEP_ARGS=--results-dir {results} --model embedded:tiny-bert --max-train-samples 96 --threads 1 "
            "--per-device-batch-size 16 --train-steps 6",
        ],
        env=cpu_env(),
    )
    assert result.returncode == 0, result.stderr[-3000:]
    for suffix in ("json", "csv", "png", "pdf"):
        assert (results / f"loaders.{suffix}").stat().st_size > 0
    report = json.loads((results / "loaders.json").read_text())
    # one row per setting and repeat: 3 modes x 2 worker counts x 2 repeats, the second repeat in reverse order
    assert len(report["rows"]) == 12
    order = [(r["mode"], r["num_workers"]) for r in report["rows"]]
    assert order[6:] == order[:6][::-1] and set(order) == {
        (m, w) for m in ("pretokenized", "on-the-fly", "in-training") for w in (0, 1)
    }
    passes = [r for r in report["rows"] if r["mode"] != "in-training"]
    assert all(r["batches"] == 6 and r["samples"] == 96 for r in passes)
    assert all(0 <= r["data_share"] <= 1 for r in report["rows"] if r["mode"] == "in-training")
    assert report["machine"]["usable_cores"] >= 1 and report["pytorch_default_num_workers"] == 0
    assert report["machine"]["torch_threads"] == 1  # the sweep runs with the --threads it was given
    assert report["provenance"]["commit"] and (results / "loaders.md").read_text().count("## Provenance") == 1
    assert "num_workers=0" in result.stdout and "use: --num-workers" in result.stdout
