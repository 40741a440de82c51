"""What DDP communication costs, measured in the run (CPU, gloo, 2 processes) and checked against DDP's own
logger and the profiler's trace."""

import statistics
import types

import pytest
import torch

from conftest import ONE_THREAD, ROOT, TINY, assert_ok, launch, read_record, read_steps
from trainscope import communication, health

DDP = ROOT / "accelerate_configs" / "ddp.yaml"
DELAY_S = 0.1  # long enough to stand clear of scheduling noise on a loaded 2-core machine
# Several buckets (DDP closes a bucket once it reaches the cap: 50 kB splits the tiny model's layers), so some
# communication can hide behind backward.
ARGS = [*TINY, *ONE_THREAD, "--max-train-samples", "512", "--max-steps", "16", "--log-every", "1",
        "--communication-samples", "5", "--ddp-bucket-cap-mb", "0.05"]
WRAPPER = '''import os, sys, time
sys.path.insert(0, {root!r})
{patch}
import train
train.main(sys.argv[1:])
'''
# A slow link: every bucket's all-reduce completes DELAY_S late, on the communication thread (backward goes on).
SLOW_LINK = '''import torch.distributed.algorithms.ddp_comm_hooks.default_hooks as hooks
plain = hooks.allreduce_hook
def allreduce_hook(state, bucket):
    def late(future):
        time.sleep({delay})
        return future.value()
    return plain(state, bucket).then(late)
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
    for name, patch in (("slow_link", SLOW_LINK), ("straggler", SLOW_RANK)):
        scripts[name] = root / f"{name}.py"
        scripts[name].write_text(WRAPPER.format(root=str(ROOT), patch=patch.format(delay=DELAY_S)))
    # "off" is also profiled: the trace and DDP's logger stand without trainscope's calibration
    plans = {"default": ("train.py", []),
             "off": ("train.py", ["--measure-communication", "off", "--profile", "--profile-wait", "4",
                                  "--profile-active", "4"]),
             "slow_link": (scripts["slow_link"], []), "straggler": (scripts["straggler"], ["--ddp-static-graph"]),
             "flags": ("train.py", ["--ddp-bucket-cap-mb", "100", "--ddp-gradient-as-bucket-view",
                                    "--ddp-comm-hook", "fp16", "--gradient-accumulation-steps", "2",
                                    "--max-train-samples", "1024"])}
    for name, (script, extra) in plans.items():
        assert_ok(launch(str(script), [*ARGS, *extra, "--output-dir", str(runs), "--run-name", name], config=DDP))
    return runs


def block(runs, name):
    return read_record(runs / name)["summary"]["communication"]


def test_every_multi_process_run_measures_its_communication_with_ddps_own_figures_beside(ddp_runs):
    default = block(ddp_runs, "default")
    assert default["measured"] and default["world_size"] == 2 and default["calibration_samples"] == 5
    assert [row["rank"] for row in default["per_rank"]] == [0, 1] and default["buckets"] >= 2
    # DDP's logger, read for its steady iterations only (the timing warm-up is 2 steps; it samples 1-10)
    assert default["ddp_iterations"] and min(default["ddp_iterations"]) > 2 and max(default["ddp_iterations"]) <= 10
    assert default["ddp_exposed_s"] > 0 and default["ddp_comm_s"] >= default["ddp_exposed_s"]
    # the two instruments agree within the stated tolerance: no disagreement warning
    codes = [w["code"] for w in read_record(ddp_runs / "default")["warnings"]]
    assert "comm_instruments_disagree" not in codes, (default["exposed_s"], default["ddp_exposed_s"])
    # calibrating costs time outside the timed figures, and the stage table is as before
    assert default["measurement_s"] > 0
    assert read_record(ddp_runs / "default")["summary"]["timing"]["across_ranks"]["run"]["seconds"]["backward"]["median"] > 0


def test_calibration_steps_do_not_change_what_is_learned(ddp_runs):
    with_calibration, without = read_steps(ddp_runs / "default"), read_steps(ddp_runs / "off")
    assert [line["loss"] for line in with_calibration] == pytest.approx([line["loss"] for line in without], rel=1e-6)
    assert read_record(ddp_runs / "default")["summary"]["test"] == pytest.approx(read_record(ddp_runs / "off")["summary"]["test"])
    assert block(ddp_runs, "off")["measured"] is False and block(ddp_runs, "off")["ddp_exposed_s"] > 0


def test_a_slow_link_raises_the_transfer_by_its_delay_per_bucket_and_exposes_at_least_the_last_one(ddp_runs):
    slow, default = block(ddp_runs, "slow_link"), block(ddp_runs, "default")
    buckets = slow["buckets"]
    # the replay of DDP's buckets runs one at a time: each adds its delay
    assert slow["total_allreduce_s"] - default["total_allreduce_s"] == pytest.approx(DELAY_S * buckets, rel=0.2)
    # backward can hide the early buckets' delays, never the last one's
    extra = slow["exposed_s"] - default["exposed_s"]
    assert 0.8 * DELAY_S <= extra <= 1.2 * DELAY_S * buckets
    assert slow["total_allreduce_s"] >= slow["exposed_s"]  # by measurement: nothing is clamped
    assert slow["ddp_exposed_s"] - default["ddp_exposed_s"] >= 0.8 * DELAY_S  # DDP's own logger sees it too


def test_a_slower_rank_is_named_the_straggler_and_its_wait_is_not_counted_as_communication(ddp_runs):
    found = block(ddp_runs, "straggler")
    (straggler,) = found["stragglers"]
    assert straggler["rank"] == 1 and straggler["excess_s"] == pytest.approx(DELAY_S, rel=0.2)
    waits = {row["rank"]: row["wait_s"] for row in found["per_rank"]}
    assert waits[0] == pytest.approx(DELAY_S, rel=0.2) and waits[1] == 0
    # the fast rank's exposed communication holds no wait: both ranks' agree within a quarter of the delay
    exposed = {row["rank"]: row["exposed_s"] for row in found["per_rank"]}
    assert abs(exposed[0] - exposed[1]) < DELAY_S / 4
    assert "straggler: rank 1" in " ".join(communication.table_lines(found))


def test_the_profiler_trace_is_a_third_instrument_of_the_same_steps(ddp_runs):
    found = block(ddp_runs, "off")  # profiled, without trainscope's calibration
    assert found["measured"] is False and found["trace_steps"] == 4 and found["trace_allreduce_s"] > 0
    # the trace's wait after backward's last operation is DDP's comm - overlap, seen from outside DDP, and the
    # two agree as the record's warning defines agreement
    assert health.instruments_agree(found["trace_exposed_s"], found["ddp_exposed_s"]), found
    assert "profiler trace: exposed" in " ".join(communication.table_lines(found))


def test_ddp_flags_reach_ddp_compression_halves_the_bytes_and_accumulation_the_all_reduces(ddp_runs):
    in_effect = read_record(ddp_runs / "flags")["environment"]["ddp"]  # read back from the wrapped model
    assert in_effect["bucket_cap_mb"] == 100 and in_effect["gradient_as_bucket_view"] is True
    assert in_effect["comm_hook"] == "fp16" and in_effect["static_graph"] is False
    assert read_record(ddp_runs / "straggler")["environment"]["ddp"]["static_graph"] is True
    flags = block(ddp_runs, "flags")
    assert flags["buckets"] == 1
    assert flags["allreduces_per_micro_batch"] == pytest.approx(0.5, abs=0.1)  # no_sync on every other micro-batch
    # fp16 on the wire: half the gradient bytes per all-reduce, and the bus bandwidth is computed from them
    per_call = flags["allreduce_bytes_per_step"] / flags["allreduces_per_optimizer_step"]
    assert per_call == pytest.approx(flags["gradient_bytes"] / 2, rel=0.01)
    world = flags["world_size"]
    assert flags["bus_bandwidth_gbs"] == pytest.approx(
        2 * (world - 1) / world * flags["allreduce_bytes_per_step"] / flags["total_allreduce_s"] / 1e9)


def test_calibration_steps_are_spread_over_the_steady_phase_two_apart():
    assert communication.schedule(2, 24, 3) == [4, 11, 17]
    assert communication.schedule(2, 6, 3) == [4]
    assert communication.schedule(2, 3, 3) == []  # too few steady steps
    assert communication.schedule(0, 100, 0) == []


# ---------------------------------------------------------------- the arithmetic, on planted measurements


def planted_rank(rank, unsynced, synced, transfer, window=0.5, iterations=None, sent=50e6):
    samples = [{"unsynced_s": u, "synced_s": s, "transfer_s": t, "window_s": window, "bucket_s": [t]}
               for u, s, t in zip(unsynced, synced, transfer)]
    return {"rank": rank, "measurement_s": 1.0, "timing": {"run": {"wall_s": 10.0}}, "communication": {
        "measured": True, "gradient_bytes": 100e6, "allreduce_calls": 10, "allreduce_bytes": 10 * sent, "buckets": 1,
        "allreduces_per_optimizer_step": 1.0, "allreduces_per_micro_batch": 1.0, "samples": samples,
        "ddp_iterations": iterations or {}, "trace": None}}


def test_exposed_is_the_synced_pass_less_the_slowest_ranks_compute_and_the_rest_is_wait():
    ranks = [planted_rank(0, [0.100, 0.100, 0.100], [0.190, 0.195, 0.185], [0.030, 0.020, 0.025]),
             planted_rank(1, [0.150, 0.160, 0.140], [0.190, 0.195, 0.185], [0.022, 0.028, 0.021])]
    combined = communication.combine(ranks, {"step_s": 0.4})
    # per sample: slowest compute 0.150 / 0.160 / 0.140, so exposed 0.040 / 0.035 / 0.045 on both ranks
    assert combined["exposed_s"] == pytest.approx(0.040) and combined["exposed_share"] == pytest.approx(0.1)
    rows = {row["rank"]: row for row in combined["per_rank"]}
    assert rows[0]["wait_s"] == pytest.approx(0.050) and rows[1]["wait_s"] == 0  # 0.150-0.100, 0.160-0.100, ...
    assert combined["total_allreduce_s"] == pytest.approx(0.021)  # per sample the shortest: 0.022, 0.020, 0.021
    assert combined["overlap"] == pytest.approx(1 - 0.040 / 0.5)  # of the communication window
    (straggler,) = combined["stragglers"]
    assert straggler["rank"] == 1 and straggler["excess_s"] == pytest.approx(0.050)
    assert combined["measurement_s"] == 1.0


def test_bus_bandwidth_counts_the_bytes_sent_not_the_gradient_bytes():
    half = [planted_rank(r, [0.1] * 3, [0.2] * 3, [0.02] * 3, sent=50e6) for r in (0, 1)]  # fp16 on the wire
    full = [planted_rank(r, [0.1] * 3, [0.2] * 3, [0.02] * 3, sent=100e6) for r in (0, 1)]
    fp16, fp32 = (communication.combine(ranks, {"step_s": 0.4}) for ranks in (half, full))
    assert fp16["bus_bandwidth_gbs"] == pytest.approx(2 * 1 / 2 * 50e6 / 0.02 / 1e9) == pytest.approx(2.5)
    assert fp16["bus_bandwidth_gbs"] == pytest.approx(fp32["bus_bandwidth_gbs"] / 2)


def test_ddps_exposed_time_is_its_comm_less_overlap_on_the_rank_that_did_not_wait():
    iterations = lambda comm, overlap: {i: {"comm_s": comm, "overlap_s": overlap} for i in (3, 4, 5)}  # noqa: E731
    ranks = [planted_rank(0, [0.1] * 3, [0.2] * 3, [0.02] * 3, iterations=iterations(0.50, 0.40)),  # waited 0.06
             planted_rank(1, [0.1] * 3, [0.2] * 3, [0.02] * 3, iterations=iterations(0.45, 0.41))]
    combined = communication.combine(ranks, {"step_s": 0.4})
    assert combined["ddp_exposed_s"] == pytest.approx(0.04) and combined["ddp_iterations"] == [3, 4, 5]
    assert combined["ddp_overlap"] == pytest.approx(0.41 / 0.45)


def test_a_planted_disagreement_between_the_instruments_is_a_warning():
    def warned(ours, ddp):
        record = {"summary": {"communication": {"measured": True, "exposed_s": ours, "ddp_exposed_s": ddp,
                                                "total_allreduce_s": 1.0}}}
        return [w["code"] for w in health.check(record)]

    assert "comm_instruments_disagree" in warned(0.250, 0.015)  # the old method's 15 ms against DDP's 250 ms
    assert health.instruments_agree(0.0134, 0.0081) and not health.instruments_agree(0.040, 0.010)
    assert "comm_instruments_disagree" not in warned(0.093, 0.061)
    assert "comm_exposed_above_total" in warned(1.2, 1.1)
    # the profiler trace is held to DDP's figure the same way, with or without trainscope's calibration
    def trace_warned(trace, ddp):
        record = {"summary": {"communication": {"measured": False, "trace_exposed_s": trace, "ddp_exposed_s": ddp}}}
        return [w["message"] for w in health.check(record) if w["code"] == "comm_instruments_disagree"]

    assert "250.0 ms by the profiler trace against 15.0 ms by DDP" in " ".join(trace_warned(0.250, 0.015))
    assert trace_warned(0.093, 0.061) == []


def test_the_trace_reads_the_wait_after_backwards_last_operation_and_the_collectives():
    def event(name, start, end, thread=1):
        return types.SimpleNamespace(name=name, thread=thread, time_range=types.SimpleNamespace(start=start, end=end))

    events = [event("backward", 0, 10_000), event("autograd::engine::evaluate_function: AddmmBackward0", 100, 7_000),
              event("gloo:all_reduce", 3_000, 9_500, thread=2), event("backward", 20_000, 31_000),
              event("autograd::engine::evaluate_function: AddmmBackward0", 20_100, 28_000),
              event("gloo:all_reduce", 26_000, 30_500, thread=2), event("gloo:all_reduce", 40_000, 41_000, thread=2)]
    found = communication.from_trace(events)  # microseconds in, seconds out; the third collective is no step's
    assert found["steps"] == 2 and found["exposed_s"] == pytest.approx(statistics.median([0.003, 0.003]))
    assert found["allreduce_s"] == pytest.approx(statistics.median([0.0065, 0.0045]))


def test_a_compiled_ddp_model_is_measured_like_the_plain_one(tmp_path):
    """accelerate.prepare compiles after wrapping in DDP: the OptimizedModule's _orig_mod is the DDP module.
    (Only a 2-GPU run exercises the compiled path end to end: make gpu-check lists it.)"""
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    torch.distributed.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        ddp = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 2))
        compiled = torch.compile(ddp)  # compiles lazily: nothing runs here
        assert communication.unwrap_ddp(compiled) is ddp and communication.unwrap_ddp(ddp) is ddp
        settings = types.SimpleNamespace(ddp_comm_hook="fp16", measure_communication="auto", timing_warmup_steps=2,
                                         communication_samples=3)
        accelerator = types.SimpleNamespace(num_processes=2, device=torch.device("cpu"),
                                            state=types.SimpleNamespace(backend="gloo"))
        measured = communication.build(settings, accelerator, compiled, 20)
        assert isinstance(measured, communication.Communication) and measured.settings_in_effect()["comm_hook"] == "fp16"
        assert measured.ddp is ddp
    finally:
        torch.distributed.destroy_process_group()
