"""compare_dp.py: the three loops train the same thing, DDP really is two processes, the diffs and the
projection say what they should."""

import json

import pytest

import compare_dp
from conftest import cpu_env, run_command
from trainscope.settings import parse_settings

TINY = ["--model", "embedded:tiny-bert", "--max-train-samples", "320"]


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    results = tmp_path_factory.mktemp("compare") / "out"
    completed = run_command(["make", "-s", "compare-dp", f"DP_ARGS={' '.join(TINY)} --steps 8 --results-dir {results}"],
                            env=cpu_env())
    assert completed.returncode == 0, completed.stderr[-3000:]
    return results, json.loads((results / "compare_dp.json").read_text())


def test_single_and_data_parallel_loops_give_the_same_losses():
    settings, compare = parse_settings(compare_dp.CompareSettings, argv=[*TINY, "--steps", "6"])
    fresh_model, dataset, collate = compare_dp.prepare_inputs(settings, compare)
    single = compare_dp.run_variant(compare_dp.single_device, settings, compare, fresh_model, dataset, collate)
    # On a CPU nn.DataParallel has no devices to scatter to and runs the module as is: the loop itself
    # can still be checked for computing the same thing.
    passthrough = compare_dp.run_variant(compare_dp.data_parallel, settings, compare, fresh_model, dataset,
                                         collate, min_gpus=0)
    assert len(single["losses"]) == 6
    assert passthrough["losses"] == pytest.approx(single["losses"], abs=1e-6)


def test_data_parallel_is_refused_without_two_gpus():
    with pytest.raises(compare_dp.NotMeasurable, match="at least 2 CUDA devices"):
        compare_dp.data_parallel(None, None, None, 32, 1e-3, 0)


def test_make_compare_dp_runs_ddp_on_two_processes_with_the_same_losses(made):
    results, report = made
    ddp, single = report["results"]["ddp"], report["results"]["single"]
    assert ddp["world_size"] == 2 and ddp["backend"] == "gloo" and len(ddp["per_rank_wall_s"]) == 2
    assert len(ddp["losses"]) == len(single["losses"]) == 8
    assert ddp["losses"] == pytest.approx(single["losses"], abs=1e-4)
    assert report["comparison"]["ddp"]["max_abs_loss_difference"] < 1e-4
    assert report["results"]["data_parallel"]["status"] == "not measurable here"
    for name in ("compare_dp.json", "compare_dp.md", "compare_dp.tex", "compare_dp.png", "compare_dp.pdf",
                 "single_device_to_data_parallel.diff", "single_device_to_distributed_data_parallel.diff"):
        assert (results / name).stat().st_size > 0
    tex = (results / "compare_dp.tex").read_text()
    assert tex.count(r"\begin{tabular}") == tex.count(r"\end{tabular}") == 1


def test_diffs_hold_the_lines_that_matter(made):
    _, report = made
    dp, ddp = report["code_changes"]
    added_dp = [l for l in dp["diff"].splitlines() if l.startswith("+")]
    added_ddp = [l for l in ddp["diff"].splitlines() if l.startswith("+")]
    assert any("torch.nn.DataParallel(" in l for l in added_dp)
    assert any("DistributedDataParallel(" in l for l in added_ddp)
    assert any("DistributedSampler(" in l for l in added_ddp)
    assert any("init_process_group(" in l for l in added_ddp)
    assert any("global_batch // world" in l for l in added_ddp)
    assert 0 < dp["changed_lines"] < ddp["changed_lines"] < 40


def test_projection_arithmetic():
    # one GPU: no communication, the measured step itself
    (one,) = compare_dp.project_ddp(0.1, 500e6, 32, [1], bandwidth_gbs=100, latency_us=10, overlap=0)
    assert one["step_s"] == 0.1 and one["efficiency"] == 1.0 and one["samples_per_s"] == pytest.approx(320)
    # 4 GPUs, 400 MB at 100 GB/s, 10 us: 2*3/4*0.4/100 + 6*10e-6 = 0.006 + 0.00006
    assert compare_dp.ring_allreduce_seconds(400e6, 4, 100, 10) == pytest.approx(0.00606)
    (four,) = compare_dp.project_ddp(0.1, 400e6, 32, [4], 100, 10, overlap=0.5)
    assert four["step_s"] == pytest.approx(0.1 + 0.5 * 0.00606)
    assert four["efficiency"] == pytest.approx(0.1 / four["step_s"])
    assert four["samples_per_s"] == pytest.approx(4 * 32 / four["step_s"])


def test_projection_in_the_report_starts_from_the_measured_step(made):
    _, report = made
    step = report["results"]["single"]["step_s"]
    for preset in report["projection"]["interconnects"].values():
        first = preset["rows"][0]
        assert first["gpus"] == 1 and first["step_s"] == pytest.approx(step)
        assert all(a["efficiency"] >= b["efficiency"] for a, b in zip(preset["rows"], preset["rows"][1:]))


def test_bad_input_exits_2(tmp_path):
    completed = run_command([compare_dp.sys.executable, str(compare_dp.ROOT / "compare_dp.py"), *TINY,
                             "--global-batch-size", "33", "--results-dir", str(tmp_path / "x")])
    assert completed.returncode == 2 and "does not split over 2 DDP processes" in completed.stderr
    assert not (tmp_path / "x").exists()
