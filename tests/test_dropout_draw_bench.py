"""make bench-dropout-draw end to end at a small size (its committed figures come from the full-size command): both
arms timed, the loop's masks checked against torch's, provenance; a planted wrong draw is recorded as different
work, with no speed verdict."""

import json
import sys

import pytest
import torch
from conftest import run_in_process

from trainscope.experiments.benchmarks import dropout_draw
from trainscope.measure import bench
from trainscope.workload import dropout_draws

SMALL = ["--elements", "100000", "--pairs", "3"]


def run(tmp_path, monkeypatch, *extra: str):
    out = tmp_path / "dropout_draw"
    monkeypatch.setattr(sys, "argv", ["dropout_draw.py", *SMALL, "--out", str(out), *extra])
    completed = run_in_process([], main=lambda _: dropout_draw.main())
    return completed, json.loads(out.with_suffix(".json").read_text()), out.with_suffix(".md").read_text()


def test_times_both_arms_after_checking_they_draw_the_same(tmp_path, monkeypatch):
    generator = torch.get_rng_state()
    completed, report, text = run(tmp_path, monkeypatch)
    assert completed.returncode == 0, completed.stderr[-3000:]
    assert torch.equal(torch.get_rng_state(), generator)  # the generator left as found
    assert report["threads"] == 1 == report["provenance"]["machine"]["torch_threads"]
    assert len(report["rounds"]) == 3 and report["arms"]["torch"]["ns_per_element"]["min"] > 0
    provenance = report["provenance"]
    assert provenance["commit"] and provenance["command"] and provenance["date"]
    assert provenance["machine"]["cpu"] and report["cpu"]["model"] == provenance["machine"]["cpu"]
    assert report["dropout_draws"]["status"] == dropout_draws.status(torch.device("cpu"))
    assert f"CPU: {report['cpu']['model']}" in text and "torch threads: 1" in text
    assert "1 torch threads in the measuring process" in text  # the provenance footer's machine line
    if not dropout_draws.drawn_here(torch.float32, torch.device("cpu")):
        assert set(report["arms"]) == {"torch"} and report["comparison"] is None and report["check"] is None
        assert "not used here" in report["status"] and "Status: the loop is not used here" in text
        return
    assert report["check"] == {
        "seed": 0,
        "elements": 100000,
        "same_mask": True,
        "differing_elements": 0,
        "same_generator_state": True,
        "same_work": True,
    }
    assert report["arms"]["loop"]["ns_per_element"]["min"] > 0
    assert [list(r) for r in report["rounds"]] == [bench.round_order(["loop", "torch"], i) for i in range(3)]
    comparison = report["comparison"]
    assert comparison["test"] == bench.METHOD and comparison["verdict"] == "too few pairs"  # 3 pairs decide nothing
    ratios = [r["torch"]["ns_per_element"] / r["loop"]["ns_per_element"] for r in report["rounds"]]
    assert comparison["ratios"] == pytest.approx(ratios)  # torch / loop: above 1 is the loop faster
    assert "masks **equal**" in text and "torch / loop" in text


def test_a_loop_that_draws_other_masks_gets_no_speed_verdict(tmp_path, monkeypatch):
    if not dropout_draws.drawn_here(torch.float32, torch.device("cpu")):
        pytest.skip("the loop is not used on this machine: there is no loop arm to plant a wrong draw in")
    real = dropout_draws._fill

    def wrong(*args):
        mask = real(*args)
        mask[0] = 1 - mask[0]  # one element flipped; the generator state as the loop leaves it
        return mask

    monkeypatch.setattr(dropout_draws, "_fill", wrong)
    completed, report, text = run(tmp_path, monkeypatch)
    assert completed.returncode == 1 and "not the same work" in completed.stderr
    check = report["check"]
    assert check["same_mask"] is False and check["differing_elements"] == 1 and check["same_work"] is False
    assert check["same_generator_state"] is True
    assert report["comparison"] is None and "no speed verdict" in report["status"]
    assert "masks **DIFFER** (1 of 100,000 elements)" in text and "No speed verdict" in text
    assert "faster" not in text and "too few pairs" not in text and "within noise" not in text


def test_where_the_loop_is_not_used_only_torch_is_timed(tmp_path, monkeypatch):
    monkeypatch.setattr(dropout_draws, "drawn_here", lambda dtype, device: False)
    completed, report, text = run(tmp_path, monkeypatch)
    assert completed.returncode == 0, completed.stderr[-3000:]
    assert set(report["arms"]) == {"torch"} and [list(r) for r in report["rounds"]] == [["torch"]] * 3
    assert report["arms"]["torch"]["ns_per_element"]["min"] > 0
    assert report["check"] is None and report["comparison"] is None
    assert report["dropout_draws"]["drawn_here"] is False
    assert "Status: the loop is not used here for float32" in text and "torch / loop" not in text
