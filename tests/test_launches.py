"""train.py launched exactly as the README says, under every shipped config and launcher (subprocesses)."""

import math
import statistics
import sys

import pytest
import torch
from conftest import (
    ACCELERATE,
    CONFIGS,
    ROOT,
    TINY,
    assert_ok,
    config_processes,
    cpu_env,
    launch,
    launch_forked,
    read_record,
    read_steps,
    run_in_forked_ranks,
    run_script_forked,
)

from trainscope.core.environment import usable_cores
from trainscope.core.records import SCHEMA_VERSION

EXPECTED_PRECISION = {"fp16": "fp32", "ddp_fp16": "fp32", "bf16": "bf16", "fsdp": "bf16"}


# Launched for real: cpu.yaml (make train's one-process command) and ddp.yaml (torchrun's ranks). The other configs
# differ from one of these only in what the launcher reads from them: they run forked from the test worker's fork
# server with what Accelerate's own launcher code prepares from the yaml (conftest.launch_forked): one process
# (fp16, bf16, single_gpu) as `python` would run it, several (ddp_fp16, fsdp) by torch's elastic agent with the
# launcher's arguments and environment, the ranks forked.
LAUNCHED = {"cpu", "ddp"}


@pytest.fixture(scope="module")
def config_runs(tmp_path_factory):
    """Each shipped config by its documented command, as on a laptop without a GPU: no ACCELERATE_USE_CPU
    (multi-process configs fall back to DDP over gloo on their own; fsdp.yaml with TRAINSCOPE_FSDP_ON_CPU=1, as
    FSDP2 over gloo, the path an FSDP run on GPUs takes); tests read the records."""
    cache = {}
    laptop = {k: v for k, v in cpu_env().items() if k != "ACCELERATE_USE_CPU"}

    def run(stem: str):
        if stem not in cache:
            config = ROOT / "accelerate_configs" / f"{stem}.yaml"
            runs = tmp_path_factory.mktemp(stem)
            args = [*TINY, "--output-dir", str(runs), "--run-name", "r"]
            if stem == "bf16":  # 4 steps: bf16 is emulated, many times slower, on a CPU without native bf16
                args += ["--max-steps", "4"]
            env = {**laptop, "TRAINSCOPE_FSDP_ON_CPU": "1"} if stem == "fsdp" else laptop
            if stem in LAUNCHED:
                result = launch("train.py", args, config=config, env=env)
            else:
                command = [ACCELERATE, "launch", "--config_file", str(config), str(ROOT / "train.py"), *args]
                result = launch_forked(command, env, timeout=600)
            cache[stem] = (result, runs / "r")
        return cache[stem]

    return run


def check_record(run_dir, world_size):
    record = read_record(run_dir)
    assert record["status"] == "complete" and record["schema_version"] == SCHEMA_VERSION
    summary = record["summary"]
    assert summary["world_size"] == world_size == record["environment"]["world_size"]
    assert sorted(r["rank"] for r in summary["timing"]["per_rank"]) == list(range(world_size))
    assert summary["throughput"]["samples_per_s"] > 0 and summary["throughput"]["tokens_per_s"] > 0
    assert summary["optimizer_steps"] == record["plan"]["optimizer_steps"]
    assert record["environment"]["timing_mode"] == "host"
    assert read_steps(run_dir)[-1]["step"] == summary["optimizer_steps"]
    return record


@pytest.mark.parametrize("config", CONFIGS, ids=[c.stem for c in CONFIGS])
def test_every_config_launches_as_documented(config, config_runs):
    result, run_dir = config_runs(config.stem)
    assert_ok(result)
    world_size = config_processes(config)
    record = check_record(run_dir, world_size)
    env = record["environment"]
    assert env["effective_precision"] == EXPECTED_PRECISION.get(config.stem, "fp32")
    # the launcher's OMP_NUM_THREADS does not decide: each process gets its share of the usable cores
    assert env["threads"]["threads_source"] == "auto"
    assert env["torch_threads"] == env["threads"]["thread_budget"] == usable_cores() // world_size
    if config.stem in LAUNCHED:  # a forked process's parent is the fork server
        command = record["provenance"]["command"]
        assert command.startswith("accelerate launch --config_file") and f"{config.stem}.yaml" in command
    if config.stem in ("fp16", "ddp_fp16"):  # said when the run starts, and recorded
        assert "warning [fp16_unavailable]: fp16 was requested but cpu" in result.stdout + result.stderr
        assert "fp16_unavailable" in [w["code"] for w in record["warnings"]]
    if config.stem == "bf16" and env["cpu_native_bf16"] is False:
        assert "bf16_emulated" in [w["code"] for w in record["warnings"]]
    if world_size > 1:  # a GPU config on a machine without a GPU: real DDP (or FSDP2) over gloo, and said so
        assert (
            env["distributed_type"] == ("FSDP" if config.stem == "fsdp" else "MULTI_CPU") and env["backend"] == "gloo"
        )
        assert env["cpu_fallback"]["processes"] == world_size and "ran_on_cpu" in [
            w["code"] for w in record["warnings"]
        ]
        assert (result.stdout + result.stderr).count("warning [ran_on_cpu]") == 2  # at the start and in the table
        if config.stem != "fsdp":  # measured, and DDP's own logger read (its private _get_ddp_logging_data)
            communication = record["summary"]["communication"]
            assert communication["measured"] is True and communication["agreement"]["ddp"]["pairs"] > 0
        # what each rank holds after training: DDP's ranks the same parameters (FSDP2's hold their own shards)
        checksums = [rank["parameter_checksum"] for rank in record["summary"]["end_state"]]
        assert len(checksums) == world_size and len(set(checksums)) == (world_size if config.stem == "fsdp" else 1)
    else:
        assert env["cpu_fallback"] is None


def test_fsdp_yaml_trains_as_fsdp2_over_gloo_on_cpu_processes_where_asked(config_runs):
    """fsdp.yaml by its documented command on a machine without a GPU, TRAINSCOPE_FSDP_ON_CPU=1: Accelerate's own
    FSDP2 prepare with the plugin its launcher reads from the yaml (the layers sharded one by one with fully_shard,
    the optimizer's parameters swapped), torch's FSDP2 collectives over gloo between the 2 ranks, and train.py's
    loop with every measuring instrument attached -- the path an FSDP run on GPUs takes (tests/test_gpu_path.py
    checks the prepare itself). Before, the prepare died in fully_shard ("Invariant encountered")."""
    _, run_dir = config_runs("fsdp")
    record = read_record(run_dir)
    env = record["environment"]
    assert env["distributed_type"] == "FSDP" and env["backend"] == "gloo" and env["cpu_fallback"]["fsdp_on_cpu"]
    assert record["model"]["fsdp_wrap"] == ["BertLayer"]  # the layer, not the embeddings _no_split_modules names
    # each rank's sharding as the prepared model holds it, and FSDP2's collectives counted where it issues them
    ranks = record["summary"]["fsdp"]
    assert len(ranks) == 2 and all(rank["sharded_modules"]["BertLayer"] == 2 for rank in ranks)
    assert all(abs(rank["local_parameters"] / rank["parameters"] - 1 / 2) < 0.05 for rank in ranks)
    assert all(min(rank["collectives"].values()) > 0 for rank in ranks)
    (warning,) = [w for w in record["warnings"] if w["code"] == "ran_on_cpu"]
    assert "it ran as FSDP2 over gloo on the CPU" in warning["message"]
    losses = [line["loss"] for line in read_steps(run_dir)]
    assert all(math.isfinite(loss) for loss in losses) and record["summary"]["test"]["accuracy"] is not None


def test_cpu_and_bf16_configs_train_with_the_same_threads(config_runs):
    """The AMP comparison compares precisions, not thread counts (accelerate launch gives cpu.yaml the
    physical cores and bf16.yaml one thread)."""
    threads = [read_record(config_runs(stem)[1])["environment"]["torch_threads"] for stem in ("cpu", "bf16")]
    assert threads[0] == threads[1] == usable_cores()


def test_ranks_combine_into_median_and_max(config_runs):
    record = read_record(config_runs("ddp")[1])
    per_rank = record["summary"]["timing"]["per_rank"]
    combined = record["summary"]["timing"]["across_ranks"]["run"]
    for stage in ("forward", "backward", "data"):
        values = [r["timing"]["run"]["seconds"][stage] for r in per_rank]
        assert combined["seconds"][stage] == {
            "median": pytest.approx(statistics.median(values)),
            "max": pytest.approx(max(values)),
        }


def test_a_plain_python_launch_uses_every_usable_core(runs):
    """`python train.py`, forked from the test worker's fork server with the command and environment it would start
    with (no launcher's variables). (`accelerate launch`, which exports OMP_NUM_THREADS=1, is every config's test
    above.)"""
    command = [sys.executable, str(ROOT / "train.py"), *TINY, "--output-dir", str(runs), "--run-name", "plain"]
    threads = torch.get_num_threads()
    try:  # this process's torch on every core first: a child forked from it would hang in its first parallel region
        torch.set_num_threads(usable_cores())
        torch.ones(256, 256) @ torch.ones(256, 256)
    finally:
        torch.set_num_threads(threads)
    result = run_script_forked(command, cpu_env(), timeout=120)
    assert_ok(result)
    record = check_record(runs / "plain", 1)
    assert record["environment"]["torch_threads"] == usable_cores()
    assert record["provenance"]["command"].split()[0] == "python"


def test_the_missions_command_on_a_machine_without_a_gpu(config_runs):
    """`accelerate launch --config_file accelerate_configs/ddp_fp16.yaml train.py`: world size 2, fp32, both said."""
    record = read_record(config_runs("ddp_fp16")[1])
    assert record["environment"]["cpu_fallback"]["requested_precision"] == "fp16"
    assert {"ran_on_cpu", "fp16_unavailable"} <= {w["code"] for w in record["warnings"]}


def test_a_launch_that_would_train_n_times_over_is_refused(runs, capfd):
    """Two ranks under torch's elastic agent (torchrun's) on a CPU-only machine fall back to DDP over gloo; told not
    to (ACCELERATE_USE_CPU=false), Accelerate would make N independent single-process runs: refused. (The ranks are
    forked, run_in_forked_ranks: what they are told is the subject, not the launcher.)"""
    code = run_in_forked_ranks([*TINY, "--output-dir", str(runs)], ACCELERATE_USE_CPU="false")
    assert code == 1  # torchrun's status when its workers fail; each worker exited 2
    errors = [line for line in "".join(capfd.readouterr()).splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "independent single-process runs" in errors[0]  # once, not once per rank
    assert not runs.exists() or not any(runs.iterdir())


def test_an_unknown_config_file_fails_before_anything_runs(runs):
    result = launch("train.py", [*TINY, "--output-dir", str(runs)], config=ROOT / "accelerate_configs" / "nope.yaml")
    assert result.returncode == 1
    assert "nope.yaml` does not exist" in result.stderr.strip().splitlines()[-1]  # accelerate's own last line
    assert not runs.exists()
