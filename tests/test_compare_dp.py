"""compare_dp.py: the three loops train the same thing on equal hardware budgets, DDP really is two
processes timed by its slowest rank, warm-up stays out of the timed window, the projection never
passes a CPU step off as GPU compute."""

import json
import time
from types import SimpleNamespace

import pytest
import torch
from conftest import TOKEN, cpu_env, driven_in_process, leaks

import compare_dp
from trainscope.core.environment import usable_cores
from trainscope.experiments.data_parallel import loops as dp_compare
from trainscope.measure.communication.measured import ring_allreduce_seconds
from trainscope.workload.settings import parse_settings

TINY = ["--model", "embedded:tiny-bert", "--max-train-samples", "320"]


@pytest.fixture(scope="module")
def made(tmp_path_factory, served):
    """make compare-dp on a dataset URL that carries credentials (tests/conftest.py's local server): the run that
    the tests below read, and the one that shows no secret reaches the console or the results. Its own command
    (`make -n`) runs in this process, its torchrun launch forked (conftest.fork_launches): the launch of DDP ranks
    is tested in test_launches.py and test_multinode.py."""
    results = tmp_path_factory.mktemp("compare") / "out"
    dataset = f"--dataset {served}/data.csv?token={TOKEN}"
    target = ["compare-dp", "ROUNDS=1", f"DP_ARGS={' '.join(TINY)} {dataset} --steps 6 --results-dir {results}"]
    completed = driven_in_process(target, env=cpu_env())
    assert completed.returncode == 0, completed.stderr[-3000:]
    return results, json.loads((results / "compare_dp.json").read_text()), completed


def test_the_data_parallel_loop_differs_from_the_single_device_loop_only_in_its_wrapping():
    """DataParallel cannot run on a CPU (it would pass the module through): what this machine can check is that
    its loop is the single-device loop plus the wrapper, and that its clock watches every GPU it scatters to."""
    diff = dp_compare.code_diff(compare_dp.single_device, compare_dp.data_parallel)
    added = [line[1:] for line in diff["diff"].splitlines() if line.startswith("+") and not line.startswith("+++")]
    assert diff["changed_lines"] <= 12
    assert any("torch.nn.DataParallel(" in line for line in added)
    assert all(
        any(word in line for word in ("DataParallel", "min_gpus", "device", "devices_of", "NotMeasurable"))
        for line in added
        if line.strip() not in (")", "]")  # the formatter closes a wrapped call on a line of its own
    )
    wrapped = SimpleNamespace(device_ids=[0, 1, 2], parameters=lambda: iter([torch.zeros(1)]))
    assert compare_dp.devices_of(wrapped) == [torch.device("cuda", i) for i in (0, 1, 2)]
    assert compare_dp.devices_of(torch.nn.Linear(2, 2)) == [torch.device("cpu")]


def test_warmup_steps_stay_outside_the_timed_window():
    clock = compare_dp.StepClock(warmup=2, devices=[torch.device("cpu")])
    for step in range(5):
        time.sleep(0.3 if step < 2 else 0.01)  # slow lazy set-up in the first steps
        clock.step(torch.tensor(float(step)))
    result = clock.finish()
    assert result["losses"] == [2.0, 3.0, 4.0] and result["wall_s"] < 0.25


def test_data_parallel_is_refused_without_two_gpus():
    with pytest.raises(compare_dp.NotMeasurable, match="at least 2 CUDA devices"):
        compare_dp.data_parallel(None, None, None, 32, 1e-3, 0, 0)


@pytest.mark.parametrize(
    "batch,processes,expected",
    [(32, 2, 32), (32, 3, 33), (32, 5, 30), (32, 6, 30), (32, 7, 35), (2, 4, 4), (33, 2, 34)],
)
def test_a_global_batch_that_does_not_divide_becomes_the_nearest_multiple(batch, processes, expected):
    assert dp_compare.divisible_batch(batch, processes) == expected


def test_make_compare_dp_runs_ddp_on_two_processes_on_the_same_cores(made):
    results, report, _ = made
    ddp, single = report["results"]["ddp"], report["results"]["single"]
    assert ddp["world_size"] == 2 and ddp["backend"] == "gloo"
    (round_,) = ddp["rounds"]
    assert len(round_["per_rank_wall_s"]) == 2 and round_["wall_s"] == max(round_["per_rank_wall_s"])
    # equal hardware: one process with every core as threads against two with half each
    assert single["threads"] == usable_cores() and ddp["threads"] == max(1, usable_cores() // 2)
    assert report["machine"]["hardware"]["ddp_hardware_ratio"] == 1
    # efficiency against the hardware each side had: on GPUs the speed-up over N devices, here the same cores
    gpus = dp_compare.hardware(gpus=4, processes=4, cores=16)
    assert (gpus["ddp_hardware_ratio"], gpus["data_parallel_hardware_ratio"]) == (4, 4)
    planted = dp_compare.compare_results(
        {
            "single": {"status": "measured", "losses": [1.0], "final_loss": 1.0},
            "ddp": {"status": "measured", "losses": [1.0], "final_loss": 1.0},
            "data_parallel": {"status": "skipped"},
        },
        [{"single": {"samples_per_s": 10.0}, "ddp": {"samples_per_s": 30.0}}] * 5,
        {"ddp_hardware_ratio": 4},
    )
    assert planted["ddp"]["scaling_efficiency"] == pytest.approx(0.75)  # 3x on 4 GPUs
    assert len(ddp["losses"]) == len(single["losses"]) == 6
    assert ddp["losses"] == pytest.approx(single["losses"], abs=1e-4)
    assert report["results"]["data_parallel"]["status"] == "not measurable here"
    for name in (
        "compare_dp.json",
        "compare_dp.md",
        "compare_dp.tex",
        "compare_dp.png",
        "compare_dp.pdf",
        "single_device_to_data_parallel.diff",
        "single_device_to_distributed_data_parallel.diff",
    ):
        assert (results / name).stat().st_size > 0
    assert report["provenance"]["command"].startswith("python compare_dp.py")


def test_a_credential_url_reaches_neither_the_console_nor_the_results(made):
    results, _, completed = made
    assert any(results.iterdir()) and leaks(completed.stdout + completed.stderr, results) == []


def test_diffs_hold_the_lines_that_matter(made):
    _, report, _ = made
    dp, ddp = report["code_changes"]
    added_dp = [line for line in dp["diff"].splitlines() if line.startswith("+")]
    added_ddp = [line for line in ddp["diff"].splitlines() if line.startswith("+")]
    assert any("torch.nn.DataParallel(" in line for line in added_dp)
    assert any("DistributedDataParallel(" in line for line in added_ddp)
    assert any("DistributedSampler(" in line for line in added_ddp)
    assert any("init_process_group(" in line for line in added_ddp)
    assert any("global_batch // world" in line for line in added_ddp)
    assert 0 < dp["changed_lines"] < ddp["changed_lines"] < 40


def test_the_projection_assumes_its_compute_out_loud_unless_a_gpu_record_is_given(made, tmp_path):
    _, report, _ = made
    assert report["projection"]["compute_source"] == "assumed" and "ASSUMED" in report["projection"]["assumptions"]
    run = tmp_path / "gpu-run"
    run.mkdir()
    (run / "record.json").write_text(
        json.dumps(
            {
                "schema_version": 2,
                "status": "complete",
                "run_name": "gpu-run",
                "settings": {},
                "plan": {"global_batch_size": 64},
                "environment": {"device_name": "NVIDIA H100 80GB HBM3", "effective_precision": "bf16"},
                "summary": {"world_size": 1, "timing": {}, "memory": {}, "test": {}, "throughput": {"step_s": 0.05}},
            }
        )
    )
    _, compare = parse_settings(dp_compare.CompareSettings, argv=["--gpu-record", str(run / "record.json")])
    projection = dp_compare.projection(compare, {"gradient_bytes": 400e6}, 2)
    assert projection["compute_source"] == "gpu_record" and projection["compute_step_s"] == 0.05
    first = projection["interconnects"]["nvlink"]["rows"][0]
    assert first["gpus"] == 1 and first["step_s"] == 0.05 and first["samples_per_s"] == pytest.approx(64 / 0.05)


def test_projection_arithmetic():
    # one GPU: no communication, the compute step itself
    (one,) = dp_compare.project_ddp(0.1, 500e6, 32, [1], bandwidth_gbs=100, latency_us=10, overlap=0)
    assert one["step_s"] == 0.1 and one["efficiency"] == 1.0 and one["samples_per_s"] == pytest.approx(320)
    # 4 GPUs, 400 MB at 100 GB/s, 10 us: 2*3/4*0.4/100 + 6*10e-6 = 0.006 + 0.00006
    assert ring_allreduce_seconds(400e6, 4, 100, 10) == pytest.approx(0.00606)
    (four,) = dp_compare.project_ddp(0.1, 400e6, 32, [4], 100, 10, overlap=0.5)
    assert four["step_s"] == pytest.approx(0.1 + 0.5 * 0.00606)
    assert four["efficiency"] == pytest.approx(0.1 / four["step_s"])


def test_bad_input_exits_2_and_writes_nothing(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        compare_dp.main([*TINY, "--rounds", "0", "--results-dir", str(tmp_path / "x")])
    assert exit_info.value.code == 2
    assert "--rounds must be at least 1" in capsys.readouterr().err.strip().splitlines()[-1]
    assert not (tmp_path / "x").exists()


def test_the_script_stays_its_lesson():
    """compare_dp.py holds the three loops and its main; launching, analysis and writing live in trainscope."""
    from pathlib import Path

    source = Path(compare_dp.__file__).read_text()
    assert len(source.splitlines()) <= 220
    for loop in ("def single_device(", "def data_parallel(", "def distributed_data_parallel(", "def main("):
        assert loop in source
