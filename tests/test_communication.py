"""What DDP communication costs, measured in the run (CPU, gloo, 2 processes)."""

import pytest

from conftest import ONE_THREAD, ROOT, TINY, assert_ok, launch, read_record, read_steps
from trainscope import communication

DDP = ROOT / "accelerate_configs" / "ddp.yaml"
DELAY_S = 0.1  # long enough to stand clear of scheduling noise on a loaded 2-core machine
ARGS = [*TINY, *ONE_THREAD, "--max-train-samples", "512", "--max-steps", "16", "--log-every", "1",
        "--communication-samples", "5"]
WRAPPER = '''import os, sys, time
sys.path.insert(0, {root!r})
{patch}
import train
train.main(sys.argv[1:])
'''
SLEEPY_HOOK = '''import torch.distributed.algorithms.ddp_comm_hooks.default_hooks as hooks
plain = hooks.allreduce_hook
def allreduce_hook(state, bucket):
    time.sleep({delay})  # a slow interconnect: every bucket's all-reduce starts late
    return plain(state, bucket)
hooks.allreduce_hook = allreduce_hook'''
SLOW_RANK = '''import trainscope.modeling as modeling
build = modeling.build_model
def build_model(*args, **kwargs):
    model, facts = build(*args, **kwargs)
    if os.environ["RANK"] == "1":
        model.register_forward_pre_hook(lambda *_: time.sleep({delay}))  # rank 1 computes slower
    return model, facts
modeling.build_model = build_model'''


@pytest.fixture(scope="module")
def ddp_runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("communication")
    runs = root / "runs"
    scripts = {}
    for name, patch in (("sleepy", SLEEPY_HOOK), ("straggler", SLOW_RANK)):
        scripts[name] = root / f"{name}.py"
        scripts[name].write_text(WRAPPER.format(root=str(ROOT), patch=patch.format(delay=DELAY_S)))
    plans = {"default": ("train.py", []), "off": ("train.py", ["--measure-communication", "off"]),
             "sleepy": (scripts["sleepy"], []), "straggler": (scripts["straggler"], ["--ddp-static-graph"]),
             "flags": ("train.py", ["--ddp-bucket-cap-mb", "100", "--ddp-gradient-as-bucket-view",
                                    "--ddp-comm-hook", "fp16", "--gradient-accumulation-steps", "2",
                                    "--max-train-samples", "1024"])}
    for name, (script, extra) in plans.items():
        assert_ok(launch(str(script), [*ARGS, *extra, "--output-dir", str(runs), "--run-name", name], config=DDP))
    return runs


def block(runs, name):
    return read_record(runs / name)["summary"]["communication"]


def test_every_multi_process_run_has_a_communication_block(ddp_runs):
    default = block(ddp_runs, "default")
    assert default["measured"] and default["world_size"] == 2 and default["calibration_samples"] == 5
    assert [row["rank"] for row in default["per_rank"]] == [0, 1]
    assert default["total_allreduce_s"] > 0 and 0 <= default["overlap"] <= 1
    assert default["gradient_bytes"] == read_record(ddp_runs / "default")["summary"]["communication"]["gradient_bytes"] > 0
    assert default["per_rank"][0]["ddp_logging"]["backward_comm_s"] > 0  # DDP's own statistics, beside ours
    # the stage table is as before: backward still holds what it waits for
    assert read_record(ddp_runs / "default")["summary"]["timing"]["across_ranks"]["run"]["seconds"]["backward"]["median"] > 0


def test_calibration_steps_do_not_change_what_is_learned(ddp_runs):
    with_calibration, without = read_steps(ddp_runs / "default"), read_steps(ddp_runs / "off")
    assert [line["loss"] for line in with_calibration] == pytest.approx([line["loss"] for line in without], rel=1e-6)
    assert read_record(ddp_runs / "default")["summary"]["test"] == pytest.approx(read_record(ddp_runs / "off")["summary"]["test"])
    assert block(ddp_runs, "off")["measured"] is False


def test_a_hook_that_sleeps_per_bucket_shows_up_as_exposed_communication(ddp_runs):
    extra = block(ddp_runs, "sleepy")["exposed_s"] - block(ddp_runs, "default")["exposed_s"]
    per_step = block(ddp_runs, "sleepy")["allreduces_per_optimizer_step"]  # buckets per step in the steady state
    assert extra == pytest.approx(DELAY_S * round(per_step), rel=0.2)


def test_a_slower_rank_is_named_the_straggler_with_about_its_delay(ddp_runs):
    found = block(ddp_runs, "straggler")
    (straggler,) = found["stragglers"]
    assert straggler["rank"] == 1 and straggler["excess_s"] == pytest.approx(DELAY_S, rel=0.2)
    waits = {row["rank"]: row["wait_s"] for row in found["per_rank"]}
    assert waits[0] > waits[1]  # the fast rank waits at the all-reduce for the slow one
    assert "straggler: rank 1" in " ".join(communication.table_lines(found))


def test_ddp_flags_reach_ddp_and_accumulation_halves_the_all_reduces(ddp_runs):
    in_effect = read_record(ddp_runs / "flags")["environment"]["ddp"]  # read back from the wrapped model
    assert in_effect["bucket_cap_mb"] == 100 and in_effect["gradient_as_bucket_view"] is True
    assert in_effect["comm_hook"] == "fp16" and in_effect["static_graph"] is False
    assert read_record(ddp_runs / "straggler")["environment"]["ddp"]["static_graph"] is True
    accumulated = block(ddp_runs, "flags")["allreduces_per_micro_batch"]
    plain = block(ddp_runs, "default")["allreduces_per_micro_batch"]
    assert accumulated / plain == pytest.approx(0.5, abs=0.1)  # no_sync skips every other micro-batch's all-reduce


def test_calibration_steps_are_spread_over_the_steady_phase_two_apart():
    assert communication.schedule(2, 24, 3) == [4, 11, 17]  # the steps before (3, 10, 16) are the references
    assert communication.schedule(2, 6, 3) == [4]
    assert communication.schedule(2, 3, 3) == []  # no steady step to serve as a reference
    assert communication.schedule(0, 100, 0) == []


def planted_rank(rank, compute, allreduce, synced=0.030, unsynced=0.020):
    return {"rank": rank, "timing": {"run": {"wall_s": 10.0}}, "communication": {
        "measured": True, "compute_s": compute, "exposed_s": synced - unsynced, "synced_backward_s": synced,
        "unsynced_backward_s": unsynced, "allreduce_s": allreduce[1], "gradient_bytes": 100e6,
        "allreduce_calls": 10, "allreduce_bytes": 1e9, "allreduces_per_optimizer_step": 1.0,
        "allreduces_per_micro_batch": 1.0, "ddp_logging": None,
        "samples": {"allreduce_s": allreduce, "compute_s": [compute] * 3, "synced_backward_s": [synced] * 3,
                    "unsynced_backward_s": [unsynced] * 3}}}


def test_transfer_is_the_shortest_collective_across_ranks_and_the_rest_is_wait():
    ranks = [planted_rank(0, 0.100, [0.060, 0.050, 0.055]), planted_rank(1, 0.140, [0.020, 0.021, 0.019])]
    combined = communication.combine(ranks, {"step_s": 0.2})
    assert combined["total_allreduce_s"] == pytest.approx(0.020)
    # per calibration: rank 0 waited 0.060-0.020, 0.050-0.021, 0.055-0.019; the median wait is 0.036
    assert combined["per_rank"][0]["wait_s"] == pytest.approx(0.036) and combined["per_rank"][1]["wait_s"] == 0
    assert combined["exposed_s"] == pytest.approx(0.010) and combined["exposed_share"] == pytest.approx(0.05)
    assert combined["overlap"] == pytest.approx(0.5)
    assert combined["bus_bandwidth_gbs"] == pytest.approx(2 * 1 / 2 * 100e6 / 0.020 / 1e9)
    (straggler,) = combined["stragglers"]
    assert straggler["rank"] == 1 and straggler["excess_s"] == pytest.approx(0.040)  # against the other rank's 0.100


def test_no_straggler_within_ten_percent():
    ranks = [planted_rank(0, 0.100, [0.02] * 3), planted_rank(1, 0.108, [0.02] * 3)]
    assert communication.combine(ranks, {"step_s": 0.2})["stragglers"] == []
