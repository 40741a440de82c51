"""make gpu-check's verdicts hold their claims: a planted result that breaks a claim is not confirmed (FSDP2's layers
sharded, each rank's share of the parameters, its collectives; a falling loss read from enough logged losses), a
speed ratio of single runs is an observation, and the bf16 compression hook runs over gloo (2 CPU processes)."""

import json
import socket
import types
from pathlib import Path

import bf16_gloo_ranks
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing

from trainscope.core.errors import UserError
from trainscope.gpu import goals as gpu_goals
from trainscope.gpu import plan as gpu_check_plan
from trainscope.gpu import results as gpu_check_report
from trainscope.measure.communication import measured as communication


def free_port() -> str:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return str(probe.getsockname()[1])


def test_gloo_all_reduces_bf16_and_ddps_bf16_hook_runs_over_it(tmp_path):
    """The one-GPU plan skipped the bf16 hook because "gloo cannot all-reduce bf16": torch 2.13's gloo all-reduces,
    reduce-scatters and all-gathers bf16 between 2 processes, and DDP's gradients through torch's own
    bf16_compress_hook over gloo are the ranks' mean to bf16's precision, the same on both ranks."""
    out = tmp_path / "bf16.json"
    torch.multiprocessing.spawn(bf16_gloo_ranks.rank, args=(2, free_port(), str(out)), nprocs=2)
    found = json.loads(out.read_text())
    assert found["dtype"] == "torch.bfloat16" and found["all_reduce"] == [4.0] * 4  # 1.5 + 2.5
    assert found["reduce_scatter"] == [1.0, 3.0] and found["all_gather"] == [0.0, 10.0, 1.0, 11.0]
    assert found["grads_equal"] and found["grad_error"] < 0.05


@pytest.fixture
def one_rank_gloo():
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_a_refused_bf16_hook_says_why_ddp_refuses_it(one_rank_gloo):
    """DDP's own guard takes the bf16 hook only from a CUDA (NCCL 2.10+) or XPU build of torch, whatever the backend:
    on this CPU build the run ends in one line that says so, not that gloo cannot all-reduce bf16 (it can)."""
    settings = types.SimpleNamespace(ddp_comm_hook="bf16", measure_communication="auto", communication_samples=2)
    accelerator = types.SimpleNamespace(
        num_processes=2, device=torch.device("cpu"), state=types.SimpleNamespace(backend="gloo")
    )
    ddp = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 2))
    with pytest.raises(UserError) as refused:
        communication.build(settings, accelerator, ddp)
    assert "CUDA 11+ and NCCL 2.10+ or XPU and XCCL" in str(refused.value) and "+cpu" in str(refused.value)
    assert "gloo" not in str(refused.value)


def test_the_one_gpu_plan_runs_the_bf16_hook_over_gloo(capsys):
    from trainscope.gpu import check as gpu_check

    (step,) = [step for step in gpu_check_plan.plan(gpus=1) if step["name"] == "ddp-comm-hook-bf16"]
    assert not step.get("skipped") and step["shared_gpu"] and step["env"] == {"TRAINSCOPE_DISTRIBUTED_BACKEND": "gloo"}
    gpu_check.main(["--dry-run", "--gpus", "1"])
    (line,) = [line for line in capsys.readouterr().out.splitlines() if line.startswith("ddp-comm-hook-bf16 ")]
    assert "TRAINSCOPE_DISTRIBUTED_BACKEND=gloo " in line and "--ddp-comm-hook bf16" in line


# ---------------------------------------------------------------- planted results


def fsdp_rank(**changes) -> dict:
    """One rank's FSDP2 facts (the record's summary.fsdp) of a 2-rank RoBERTa-base run that sharded as planned."""
    rank = {
        "sharded_modules": {"RobertaForSequenceClassification": 1, "Embedding": 1, "RobertaLayer": 12},
        "parameters": 124_647_170,
        "local_parameters": 62_323_585,
        "collectives": {"all_gathers": 520, "reduce_scatters": 260},
    }
    return {**rank, **changes}


def fsdp2_result(**changes) -> dict:
    """What run_step keeps of a 2-process FSDP2 run on one GPU over gloo that did what its goals ask."""
    result = {
        "name": "fsdp2",
        "seconds": 90.0,
        "exit": 0,
        "shared_gpu": True,
        "status": "complete",
        "world_size": 2,
        "distributed_type": "FSDP",
        "backend": "gloo",
        "device": "cuda:0",
        "precision": "bf16",
        "losses": [[2 * k, 0.72 - 0.005 * k] for k in range(1, 11)],
        "fsdp_wrap": ["RobertaLayer"],
        "fsdp": [fsdp_rank(), fsdp_rank()],
    }
    return {**result, **changes}


@pytest.mark.parametrize(
    "changes,missed",
    [
        ({}, None),
        (
            {"fsdp": [fsdp_rank(sharded_modules={"RobertaForSequenceClassification": 1})] * 2},
            "NOT met: each layer class of its wrap list sharded on every rank (RobertaLayer not sharded",
        ),
        (
            {"fsdp": [fsdp_rank(), fsdp_rank(local_parameters=124_647_170)]},
            "each rank holds 1/world of the parameters (its local shards, within 10%) (50.0%, 100.0% of 125 M",
        ),
        (
            {"fsdp": [fsdp_rank(), fsdp_rank(collectives={"all_gathers": 520, "reduce_scatters": 0})]},
            "FSDP2's all-gathers and reduce-scatters ran on every rank (520 all-gathers, 260 reduce-scatters; "
            "520 all-gathers, 0 reduce-scatters)",
        ),
        (
            {"fsdp": [fsdp_rank(collectives=None)] * 2},
            "not measured: FSDP2's all-gathers and reduce-scatters ran on every rank",
        ),
        (  # a torch that keeps FSDP2's groups elsewhere: the record says why, and so does the page
            {"fsdp": [fsdp_rank(collectives=None, collectives_not_counted="torch 2.99 keeps them elsewhere")] * 2},
            "not measured: FSDP2's all-gathers and reduce-scatters ran on every rank (not counted: torch 2.99 keeps",
        ),
        ({"fsdp": None}, "not measured: each layer class of its wrap list sharded on every rank; each rank"),
        ({"fsdp_wrap": None}, "not measured: each layer class of its wrap list sharded on every rank"),
    ],
)
def test_fsdp2_is_confirmed_only_where_its_record_shows_the_layers_sharded_and_the_collectives_run(changes, missed):
    """fsdp2's "confirms" promised each layer sharded and the collectives between the ranks, but its goals read only
    a complete record on CUDA with FSDP, gloo and a falling loss: a run that sharded the root alone was confirmed.
    Its goals now read the record's sharding: every class of the wrap list sharded on every rank, each rank's local
    shards about 1/world of the parameters, FSDP2's all-gathers and reduce-scatters counted on every rank."""
    (step,) = [step for step in gpu_check_plan.plan(gpus=1) if step["name"] == "fsdp2"]
    result = fsdp2_result(**changes)
    results = {"fsdp2": result}
    assert gpu_check_report.confirmed(step, result, results, gpus=1) is (missed is None)
    text = gpu_check_report.goals_text(gpu_check_report.judge_check(step, result, results, 1))
    assert text == "all 9 met" if missed is None else missed in text
    assert (
        "the layers of its wrap list sharded" in step["confirms"]
        and "all-gathers and reduce-scatters" in (step["confirms"])
    )


@pytest.mark.parametrize(
    "losses,met,read",
    [
        ([0.70, 0.69, 0.68, 0.60], None, "4 logged losses: at least 8 judge a trend"),
        ([0.75 - 0.01 * k for k in range(10)], True, "mean 0.73 -> 0.68 over 10 logged steps"),
        ([0.70, 0.69, 0.71, 0.70, 0.70, 0.72, 0.70, 0.71, 0.73, 0.71], False, "mean 0.7 -> 0.714 over 10"),
        ([0.7] * 9 + [float("inf")], False, "not finite"),
    ],
)
def test_a_falling_loss_is_read_from_enough_logged_losses(losses, met, read):
    """A shared GPU's check logged four losses and "falling" compared the last with the first (two noisy batches):
    it now reads the later half's mean against the earlier half's over at least 8 logged losses, and fewer are not a
    trend (not measured). The plan logs each multi-process check's loss 10 times."""
    result = fsdp2_result(losses=[[2 * k, loss] for k, loss in enumerate(losses, 1)])
    (step,) = [step for step in gpu_check_plan.plan(gpus=1) if step["name"] == "fsdp2"]
    (judged,) = [g for g in gpu_check_report.judge_check(step, result, {}, 1) if "falling" in g["goal"]]
    assert judged["met"] is met and judged["read"].startswith(read)
    assert gpu_check_report.confirmed(step, result, {"fsdp2": result}, 1) is (met is True)
    for gpus in (1, 2):
        for planned in gpu_check_plan.plan(gpus=gpus):
            if planned.get("processes", 1) > 1:
                steps, every = (
                    int(planned["args"][planned["args"].index(f) + 1]) for f in ("--max-steps", "--log-every")
                )
                assert steps // every >= gpu_goals.MIN_LOGGED_LOSSES, planned["name"]


def precision_result(name: str, samples_per_s: float) -> dict:
    return {
        "name": f"precision-{name}",
        "seconds": 30.0,
        "exit": 0,
        "status": "complete",
        "precision": name,
        "throughput": {"samples_per_s": samples_per_s, "tokens_per_s": 1.0, "tflops_per_device": 1.0},
    }


def test_a_speed_ratio_of_single_runs_is_an_observation_not_a_verdict():
    """bf16 over TF32 >= 1.0 (and bf16 over fp32 >= 1.3) judged two single host-bound runs with no allowance for
    noise: bf16 planted slower than TF32 and fp32 now fails no check and confirms what each run confirms (the
    precision in effect); the ratios are listed as observations, one run each, with no verdict."""
    steps = [step for step in gpu_check_plan.plan(gpus=1) if step["name"].startswith("precision-")]
    checks = [precision_result(name, speed) for name, speed in (("fp32", 500.0), ("tf32", 600.0), ("bf16", 450.0))]
    checks.append(precision_result("fp16", 700.0))
    report = {
        "device": "NVIDIA H200",
        "driver": None,
        "gpus": 1,
        "budget_s": 600.0,
        "seconds": 120.0,
        "status": "complete",
        "checks": checks,
        "not_run": [],
        "plan": steps,
    }
    assert gpu_check_report.unmet(report) == []
    results = {c["name"]: c for c in checks}
    assert all(gpu_check_report.confirmed(step, results[step["name"]], results, 1) for step in steps)
    assert not any("bf16_over" in goal for step in steps for goal, _ in gpu_check_report.goals_of(step))
    lines = gpu_check_report.markdown(report)
    at = lines.index("## Observations (one run each: no noise measured, so no verdict)")
    assert lines[at + 2].startswith("- bf16_over_fp32 (precision-bf16): 0.9 (")
    assert lines[at + 3].startswith("- bf16_over_tf32 (precision-tf32): 0.75 (")
    assert not any("bf16_over" in line for line in lines[:at])


# ---------------------------------------------------------------- goals a run that did not do its job fails

H200_RUN = Path(__file__).resolve().parent.parent / "benchmarks" / "gpu" / "h200-2026-11-28"


def planned(name: str, gpus: int = 1) -> dict:
    return next(step for step in gpu_check_plan.plan(gpus=gpus) if step["name"] == name)


def h200_result(name: str, run: str = "run1", **changes) -> dict:
    """What the 2026-11-28 H200 run kept of `name`, with `changes` (a rank's end state: its record came before it)."""
    found = next(c for c in json.loads((H200_RUN / f"{run}.json").read_text())["checks"] if c["name"] == name)
    return {**found, **changes}


def rank_end(checksum=8123.25, scale=None, growth=None) -> dict:
    return {"parameter_checksum": checksum, "loss_scale": scale, "scaler_growth": growth}


def judged(step: dict, result: dict, results: dict | None = None) -> dict:
    results = {result["name"]: result, **(results or {})}
    return {g["goal"]: g for g in gpu_check_report.judge_check(step, result, results, 1)}


@pytest.mark.parametrize("name", ["ddp-communication-memory", "ddp-fp16", "ddp-comm-hook-fp16", "ddp-comm-hook-bf16"])
def test_a_ddp_whose_ranks_end_with_different_parameters_is_not_confirmed(name):
    """The four fp32 DDP checks train the same trajectory and a DDP that never averaged its gradients still has a
    finite, falling loss: every DDP check now reads each rank's parameter checksum after training (the record's
    end_state) and confirms only where they are the same. The H200's figures, with the end state planted."""
    step, same = planned(name), [rank_end(scale=65536.0, growth=20)] * 2
    result = h200_result(name, "run2" if name == "ddp-comm-hook-bf16" else "run1", end_state=same)
    (goal,) = [g for g in judged(step, result).values() if g["goal"].startswith("every rank ends with the same")]
    assert goal["met"] is True and gpu_check_report.confirmed(step, result, {name: result}, 1)
    apart = {**result, "end_state": [rank_end(8123.25, 65536.0, 20), rank_end(8123.5, 65536.0, 20)]}
    assert judged(step, apart)[goal["goal"]]["met"] is False and not gpu_check_report.confirmed(step, apart, {}, 1)
    before = h200_result(name, "run2" if name == "ddp-comm-hook-bf16" else "run1")  # its record had no end state
    assert judged(step, before)[goal["goal"]]["met"] is None
    assert "same_parameters" not in planned("fsdp2")["goals"]  # FSDP2's ranks hold their own shards


def test_ddp_fp16_reads_the_loss_scaler_on_each_rank():
    """ddp-fp16's "the loss scaler on every rank" read no scaler: it now reads each rank's GradScaler state after
    training, and a rank without one, or in another state (another skip history), is not confirmed."""
    step = planned("ddp-fp16")
    goal = "a loss scaler on every rank, each in the same state (its scale and growth tracker, read after training)"
    cases = {
        "met": ([rank_end(scale=65536.0, growth=20)] * 2, True),
        "a rank without a scaler": ([rank_end(scale=65536.0, growth=20), rank_end()], False),
        "another skip history": ([rank_end(scale=65536.0, growth=20), rank_end(scale=32768.0, growth=12)], False),
        "no scaler at all": ([rank_end()] * 2, False),
    }
    for case, (ends, met) in cases.items():
        result = h200_result("ddp-fp16", end_state=ends)
        assert judged(step, result)[goal]["met"] is met, case
        assert gpu_check_report.confirmed(step, result, {"ddp-fp16": result}, 1) is met, case


def test_unpad_is_held_to_every_logged_loss_not_the_first_one():
    """unpad's goal was its first loss within 5% of the padded run's: predictions that stay uniform (ln 3 = 1.0986)
    pass it against the padded run's 1.155. Every logged loss is now held to 1% of the padded run's at the same step:
    the H200's run is 0.13% off at most, uniform predictions 2.4-4.9%."""
    step, padded = planned("unpad-bf16"), h200_result("precision-bf16", "run2")
    goal = next(text for text, _ in gpu_check_report.goals_of(step) if text.startswith("each of its logged losses"))
    measured = h200_result("unpad-bf16", "run2")
    found = judged(step, measured, {"precision-bf16": padded})[goal]
    assert found["met"] is True and found["read"].startswith("at most 0.13% off over 5 logged steps")
    uniform = {**measured, "losses": [[at, 1.0986] for at, _ in padded["losses"]]}
    assert judged(step, uniform, {"precision-bf16": padded})[goal]["met"] is False
    first_only = {**measured, "losses": [[10, 1.0986], *padded["losses"][1:]]}  # within 5% at its first step alone
    assert judged(step, first_only, {"precision-bf16": padded})[goal]["met"] is False
    fewer = {**measured, "losses": measured["losses"][:2]}
    assert judged(step, fewer, {"precision-bf16": padded})[goal]["met"] is None


def test_ddp_profile_compares_with_the_trace_over_nccl_and_says_it_has_no_second_instrument_over_gloo():
    """ddp-profile's one goal was "the trace is written"; its trace comparison found 0 pairs (gloo has no NCCL
    kernels). Over gloo it says it has no second instrument and holds the trace to its window's steps and DDP's
    all-reduces among its operators; over NCCL to the trace's agreement with trainscope's exposed time."""
    shared = planned("ddp-profile")
    (text, _) = [g for g in gpu_check_report.goals_of(shared) if g[0].startswith("the trace")][0]
    assert "no second instrument over gloo" in text and "no second instrument over gloo" in shared["confirms"]
    ends = [rank_end()] * 2
    profile = {"directory": "profile", "window": {"first_step": 4, "last_step": 6}, "communication_calls": 312}
    result = h200_result("ddp-profile", end_state=ends, profile=profile)  # the H200's own trace steps: [4, 5, 6]
    assert judged(shared, result)[text]["met"] is True and gpu_check_report.confirmed(shared, result, {}, 1)
    no_collectives = {**result, "profile": {**profile, "communication_calls": 0}}
    assert judged(shared, no_collectives)[text]["met"] is False
    short = {**result, "communication": {**result["communication"], "trace_steps": [4]}}
    assert judged(shared, short)[text]["met"] is False
    nccl = planned("ddp-profile", gpus=2)
    (text, _) = [g for g in gpu_check_report.goals_of(nccl) if g[0].startswith("the trace")][0]
    assert "agrees with trainscope's" in text
    undecided = {**result, "backend": "nccl"}  # the H200's trace: 0 pairs
    assert judged(nccl, undecided)[text]["met"] is False
    agreed = {"pairs": 3, "verdict": "agree"}
    agreeing = {**undecided, "communication": {**result["communication"], "agreement": {"trace": agreed}}}
    assert judged(nccl, agreeing)[text]["met"] is True
