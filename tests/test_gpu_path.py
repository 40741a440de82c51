"""The GPU path's logic, checked on the CPU: launch plans (one process without a config), the compile
set-up, per-loop memory, the batch-size search (halving, one process, in its own process), DDP workers
binding their GPU, and make gpu-check's plan without a GPU."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import compare_dp
from conftest import ROOT, cpu_env, run_command
from trainscope import launching


@pytest.mark.parametrize("config,gpus,runnable,on_cpu", [
    ("ddp", 1, False, False), ("ddp", 2, True, False), ("ddp", 0, True, True), ("ddp_fp16", 1, False, False),
    ("single_gpu", 1, True, False), ("cpu", 4, True, True), ("fsdp", 8, True, False),
])
def test_runs_are_planned_from_the_devices_present(config, gpus, runnable, on_cpu):
    plan = launching.plan(config, gpus=gpus)
    assert (plan.runnable, plan.on_cpu) == (runnable, on_cpu)
    if not runnable:
        assert plan.reason == f"needs 2 GPUs (one per process), {gpus} present"


def test_a_planned_run_that_fails_fails_the_experiment(tmp_path):
    completed = run_command([sys.executable, "-m", "trainscope.experiments", "matrix", "--runs", str(tmp_path / "m"),
                             "--rounds", "1", "--variants", "cpu", "--", "--model", "embedded:tiny-bert",
                             "--dataset", str(tmp_path / "missing.csv")], env=cpu_env())
    assert completed.returncode == 1
    assert completed.stderr.strip().splitlines()[-1].startswith("error: cpu-r0 (cpu ) failed:")


def test_compile_uses_dynamic_shapes_whatever_the_launcher_exports(monkeypatch, tmp_path):
    """accelerate launch exports ACCELERATE_DYNAMO_USE_DYNAMIC=False: every new padded length would recompile."""
    from accelerate.state import AcceleratorState

    from trainscope import startup
    from trainscope.settings import parse_settings

    monkeypatch.setenv("ACCELERATE_DYNAMO_USE_DYNAMIC", "False")
    monkeypatch.setenv("ACCELERATE_DYNAMO_BACKEND", "no")
    tf32 = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32  # start-up enforces --tf32
    try:
        for flags, dynamic in (([], True), (["--pad-to-max-length"], False)):
            (settings,) = parse_settings(argv=["--compile", "--report-to", "none", *flags])
            launch = startup.Startup(state=None, settings=settings, threads={}, run_dir=tmp_path,
                                    requested_max_seq_length=128, model_sequence_limit=512)
            launch.state = type("State", (), {"device": torch.device("cpu")})()
            accelerator = startup.build_accelerator(settings, launch)
            assert accelerator.state.dynamo_plugin.dynamic is dynamic
            assert accelerator.state.dynamo_plugin.backend.value.lower() == "inductor"
            AcceleratorState._reset_state(reset_partial_state=True)
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = tf32


class CountingProbe:
    device = "cuda:0"

    def __init__(self):
        self.resets, self.reads = 0, 0

    def reset(self):
        self.resets += 1

    def read(self):
        self.reads += 1
        return 3 * 1024**3, 4 * 1024**3


def test_each_loop_starts_from_a_reset_peak():
    """compare_dp.py: a loop's peak is its own, not the one of the loop the same process ran before."""
    probe = CountingProbe()
    clock = compare_dp.StepClock(warmup=0, devices=[torch.device("cpu")], probes=[probe])
    assert probe.resets == 1 and probe.reads == 0
    clock.step(torch.tensor(1.0))
    assert list(clock.finish()["peak_memory_gib"].values()) == [3.0]


def test_the_batch_size_search_runs_in_a_child_launched_with_the_config():
    command = [launching.ACCELERATE, "launch", "--config_file", str(ROOT / "accelerate_configs" / "cpu.yaml"), "-m",
               "trainscope.experiments", "find-batch", "--start", "8", "--", "--model", "embedded:tiny-bert",
               "--max-seq-length", "32", "--report-to", "none"]
    completed = run_command(command, env=cpu_env())
    assert completed.returncode == 0, completed.stderr[-3000:]
    assert json.loads(completed.stdout.strip().splitlines()[-1]) == {"largest_batch": 8}  # a CPU never runs out


def test_gpu_check_without_a_gpu_says_so_in_one_line_and_writes_nothing(tmp_path):
    completed = run_command([sys.executable, "-m", "trainscope.gpu_check", "--out", str(tmp_path / "gpu")], env=cpu_env())
    assert completed.returncode == 0
    assert completed.stdout.strip().splitlines() == [completed.stdout.strip()]
    assert "no usable CUDA device" in completed.stdout and "nothing written" in completed.stdout
    assert not (tmp_path / "gpu").exists()


def test_gpu_check_plans_every_check_by_the_documented_commands():
    from trainscope import gpu_check

    steps = gpu_check.plan(gpus=2)
    names = [step["name"] for step in steps]
    assert names == ["timing-events", "timing-sync", "precision-fp32", "precision-tf32", "precision-bf16",
                     "precision-fp16", "compile-bf16", "memory-snapshot", "batch-search", "overhead", "loaders",
                     "compare-dp", "ddp-compile", "ddp-communication-memory"]
    configs = {step["name"]: step.get("config") for step in steps}
    assert configs["precision-bf16"] == "bf16" and configs["precision-fp16"] == "fp16"
    assert gpu_check.device_slug("NVIDIA H100 80GB HBM3") == "nvidia-h100-80gb-hbm3"
    assert gpu_check.verdicts({"precision-fp32": {"throughput": {"samples_per_s": 100}},
                               "precision-tf32": {"throughput": {"samples_per_s": 250}},
                               "precision-bf16": {"throughput": {"samples_per_s": 400}}})["bf16_over_fp32"] == 4.0


def test_gpu_check_adds_the_batch_search_the_memory_snapshot_and_two_gpu_ddp_runs():
    """What the plan runs for each new check, and that a 2-GPU check is skipped with its reason on one GPU.
    The checks themselves need a GPU: not measured on GPU."""
    from trainscope import gpu_check

    by_name = {step["name"]: step for step in gpu_check.plan(gpus=1)}
    search = by_name["batch-search"]["command"]
    experiments_flags, train_flags = search[:search.index("--")], search[search.index("--") + 1:]
    assert experiments_flags[1:4] == ["-m", "trainscope.experiments", "batch-sweep"]
    config = experiments_flags[experiments_flags.index("--config") + 1]
    assert launching.config_facts(launching.config_path(config))["num_processes"] == 1  # the search refuses more
    assert int(experiments_flags[experiments_flags.index("--search-from") + 1]) > 0
    assert "--runs" in experiments_flags and "--model" in train_flags
    snapshot = by_name["memory-snapshot"]
    assert snapshot["config"] == "single_gpu" and {"--memory-snapshot", "--max-steps"} <= set(snapshot["args"])
    assert snapshot["args"][snapshot["args"].index("--max-steps") + 1] == "20"
    assert by_name["ddp-compile"]["config"] == "ddp" and "--compile" in by_name["ddp-compile"]["args"]
    assert by_name["ddp-communication-memory"]["config"] == "ddp"
    for name in ("ddp-compile", "ddp-communication-memory"):
        assert by_name[name]["skipped"].startswith("needs 2 GPUs")
    assert not [name for name, step in by_name.items() if step.get("skipped") and not name.startswith("ddp-")]
    assert not [step for step in gpu_check.plan(gpus=2) if step.get("skipped")]
    assert all(step["confirms"] for step in by_name.values())  # what only a GPU run will confirm, per check
    checks = [gpu_check.run_step(step, Path("/nonexistent")) for step in by_name.values() if step.get("skipped")]
    report = {"device": "NVIDIA H100 80GB HBM3", "driver": None, "seconds": 0.0, "checks": checks, "verdicts": {},
              "scaler": {"planted": 3, "counted": 3}, "plan": list(by_name.values())}
    lines = gpu_check.markdown(report)
    assert "| ddp-compile | 0 | skipped: needs 2 GPUs (one per process), 1 present |" in lines
    assert f"- batch-search: {by_name['batch-search']['confirms']}" in lines


def test_gpu_check_dry_run_lists_what_only_a_gpu_run_confirms(capsys, monkeypatch):
    from trainscope import gpu_check

    monkeypatch.setattr(launching, "cuda_devices", lambda: 1)
    gpu_check.main(["--dry-run"])
    out = capsys.readouterr().out
    assert out.count("confirms: ") == len(gpu_check.plan(gpus=1)) + 1  # every check, and the in-process scaler check
    assert "ddp-compile: skipped (needs 2 GPUs" in out and "--memory-snapshot" in out and "--search-from" in out


def launched_processes(command: list[str], monkeypatch, gpus: int) -> tuple[bool, int]:
    """What `accelerate launch` makes of `command` on a host with `gpus` CUDA devices and no default config:
    (multi-GPU?, processes), decided by accelerate's own launch validation (nothing is started)."""
    import accelerate.commands.launch as accelerate_launch

    assert command[:2] == [launching.ACCELERATE, "launch"]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: gpus > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    monkeypatch.setattr(accelerate_launch, "default_config_file", "/nonexistent/default_config.yaml")
    args, _, _ = accelerate_launch._validate_launch_command(accelerate_launch.launch_command_parser().parse_args(command[2:]))
    return bool(args.multi_gpu), args.num_processes


def test_both_arms_of_the_overhead_benchmark_are_pinned_to_one_process(monkeypatch, tmp_path):
    """Without a config `accelerate launch` starts one process per visible GPU; the bare loop then prints one
    rank's samples/s while train.py reports the global figure, and their ratio is off by the GPU count.
    Both arms' command lines are recorded (nothing is launched) and put to accelerate's launch validation on
    a faked 4-GPU host. Only a GPU run confirms the measured ratio itself: not measured on GPU."""
    from trainscope.benchmarks import overhead

    launched = []

    def recording_run_captured(command, env, timeout=None):
        launched.append(command)
        stdout = json.dumps({"samples_per_s": 100.0, "threads": 1}) if "--bare" in command else ""
        return subprocess.CompletedProcess(command, 0, stdout, "")

    monkeypatch.setattr(launching, "run_captured", recording_run_captured)
    monkeypatch.setattr(overhead, "read_record", lambda run: {"summary": {"throughput": {"samples_per_s": 99.0}},
                                                              "environment": {"torch_threads": 1}})
    overhead.measure(["--max-steps", "8"], ["events"], pairs=1, scratch=tmp_path)
    bare = [c for c in launched if "--bare" in c]
    timed = [c for c in launched if str(launching.TRAIN_SCRIPT) in c]
    assert len(bare) == 1 and len(timed) == 1 and len(launched) == 2
    for command in launched:
        assert launched_processes(command, monkeypatch, gpus=4) == (False, 1)


def planted_out_of_memory(fits_up_to: int, tried: list[int]):
    """A trial that records its batch size and runs out of device memory above `fits_up_to`, as CUDA says it."""
    def trial(batch_size: int) -> None:
        tried.append(batch_size)
        if batch_size > fits_up_to:
            raise torch.OutOfMemoryError("CUDA out of memory. planted")
    return trial


@pytest.mark.parametrize("start,fits_up_to,tried", [
    (4096, 1000, [4096, 2048, 1024, 512]), (64, 64, [64]), (48, 13, [48, 24, 12]), (8, 1, [8, 4, 2, 1]),
])
def test_the_batch_size_search_tries_only_halvings_and_lands_on_the_largest_that_fits(start, fits_up_to, tried):
    """Accelerate's own reduction multiplies by 0.9 (from 4096: 3686, 3317, ...). What a real CUDA
    out-of-memory error does to the allocator between tries is for a GPU run to show."""
    from trainscope import batch_search

    sizes = []
    assert batch_search.search(planted_out_of_memory(fits_up_to, sizes), start) == tried[-1]
    assert sizes == tried


def test_the_batch_size_search_lets_errors_other_than_out_of_memory_through():
    from trainscope import batch_search

    sizes = []

    def broken(batch_size):
        sizes.append(batch_size)
        raise RuntimeError("a bug in the trial, not a full device")

    with pytest.raises(RuntimeError, match="a bug in the trial"):
        batch_search.search(broken, 64)
    assert sizes == [64]


def test_the_search_child_halves_from_its_start(monkeypatch, capsys):
    """`python -m trainscope.experiments find-batch` (what largest_fitting_batch launches) in this process, on
    the tiny model, its training step replaced by one that runs out of memory above 10 samples."""
    import os

    from accelerate.state import AcceleratorState

    from trainscope import experiments, loop

    sizes = []
    out_of_memory = planted_out_of_memory(10, sizes)
    monkeypatch.setattr(loop, "train_step", lambda accelerator, model, batch, *rest: out_of_memory(len(batch["labels"])))
    threads, environ = torch.get_num_threads(), dict(os.environ)
    try:
        experiments.main(["find-batch", "--start", "64", "--", "--model", "embedded:tiny-bert", "--max-seq-length",
                          "16", "--report-to", "none", "--threads", "1"])
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)
        torch.set_num_threads(threads)
        os.environ.clear()
        os.environ.update(environ)
    assert sizes == [64, 32, 16, 8, 8]  # the fitting size trains both steps
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1]) == {"largest_batch": 8}


def test_the_batch_size_search_refuses_a_multi_process_config_before_launching_anything(monkeypatch, capsys, tmp_path):
    """An out-of-memory error on one rank sends it back to rebuild while the other ranks wait in an
    all-reduce: the search would hang. The hang itself needs 2 GPUs to show: not measured on GPU."""
    from trainscope import experiments

    launched = []
    monkeypatch.setattr(launching, "cuda_devices", lambda: 2)
    monkeypatch.setattr(launching, "run_captured", lambda command, *a, **k: launched.append(command)
                        or subprocess.CompletedProcess(command, 1, "", "error: launched"))
    with pytest.raises(SystemExit) as exited:
        experiments.main(["batch-sweep", "--config", "ddp", "--runs", str(tmp_path / "batch"), "--search-from", "64",
                          "--", "--model", "embedded:tiny-bert", "--report-to", "none"])
    assert exited.value.code == 1 and launched == []
    errors = capsys.readouterr().err.strip().splitlines()
    assert len(errors) == 1 and errors[0].startswith("error: the batch-size search runs one process")


class Stop(Exception):
    """Ends a loop at the first call a test was waiting for."""


def test_each_ddp_worker_binds_its_own_gpu_before_it_joins_the_process_group(monkeypatch):
    """compare_dp.py's DDP worker of local rank 1 on a faked CUDA host: it makes cuda:1 its current device,
    then starts NCCL bound to it. Unbound, every rank's current device is cuda:0 (barrier() warns, CUDA
    contexts land on GPU 0). That NCCL really forms its communicator on each rank's GPU: not measured on GPU."""
    calls = []
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: calls.append(("set_device", device)))

    def init_process_group(*args, **kwargs):
        calls.append(("init_process_group", args, kwargs))
        raise Stop

    monkeypatch.setattr(torch.distributed, "init_process_group", init_process_group)
    with pytest.raises(Stop):
        compare_dp.distributed_data_parallel(None, None, None, 32, 1e-3, 0, 0)
    cuda1 = torch.device("cuda", 1)
    assert calls == [("set_device", cuda1), ("init_process_group", (), {"backend": "nccl", "device_id": cuda1})]


def test_a_worker_on_the_cpu_binds_nothing_and_uses_gloo(monkeypatch):
    calls = []
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: calls.append(device))
    assert compare_dp.worker_device(1, cuda_available=False) == torch.device("cpu")
    compare_dp.bind(torch.device("cpu"))
    assert calls == []
    assert compare_dp.process_group_arguments(torch.device("cpu")) == {"backend": "gloo"}
    assert compare_dp.worker_device(3, cuda_available=True) == torch.device("cuda", 3)


def test_the_parent_hands_its_cached_gpu_memory_back_before_the_ddp_workers_start(monkeypatch):
    """The parent ran DataParallel over every GPU; its allocator keeps those blocks cached while the DDP
    workers (other processes) need the memory. The order is checked with stand-ins; how much memory the
    workers really get back: not measured on GPU."""
    import gc

    calls = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(gc, "collect", lambda *a: calls.append("gc.collect") or 0)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: calls.append("empty_cache"))

    def run_captured(command, env, timeout=None):
        calls.append("launch")
        result_file = command[command.index("--result-file") + 1]
        with open(result_file, "w") as out:
            json.dump({"world_size": 2}, out)
        return subprocess.CompletedProcess(command, 0, "", "")

    monkeypatch.setattr(launching, "run_captured", run_captured)
    assert compare_dp.launch_ddp(2, [], 32) == {"world_size": 2}
    assert calls == ["gc.collect", "empty_cache", "launch"]
