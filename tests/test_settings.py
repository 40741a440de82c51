import dataclasses
import subprocess
import sys

import pytest
import torch

from trainscope.core import environment
from trainscope.core.environment import launcher_world_size, refuse_independent_runs
from trainscope.core.errors import UserError, exit_with, first_to_report
from trainscope.run.trackers import flat_config, wandb_mode
from trainscope.workload.settings import Settings, parse_settings


def test_every_flag_has_help(capsys):
    with pytest.raises(SystemExit) as exit_info:
        parse_settings(argv=["--help"])
    assert exit_info.value.code == 0
    text = capsys.readouterr().out
    for field in dataclasses.fields(Settings):
        assert f"--{field.name.replace('_', '-')}" in text
        assert field.metadata.get("help"), f"{field.name} has no help"
    # --threads says how it relates to what the launcher sets
    assert "OMP_NUM_THREADS" in text and "--num_cpu_threads_per_process" in text


def test_dashes_and_underscores_both_work():
    (a,) = parse_settings(argv=["--per-device-batch-size", "8", "--lora"])
    (b,) = parse_settings(argv=["--per_device_batch_size", "8", "--lora"])
    assert a == b and a.per_device_batch_size == 8 and a.lora


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--no-such-flag", "1"], "unknown argument"),
        (["--per-device-batch-size", "0"], "per-device-batch-size must be a positive integer"),
        (["--per-device-batch-size", "-4"], "per-device-batch-size must be a positive integer"),
        (["--num-workers", "-1"], "num-workers must be 0 or more"),
        (["--prefetch-factor", "4"], "prefetch-factor needs --num-workers"),
        (["--resume"], "--resume needs --run-name"),
        (["--timing", "sometimes"], "invalid choice"),
        (["--test-fraction", "0.7"], "test-fraction must be between"),
        (["--run-name", "../escape"], "plain directory name"),
        (["--learning-rate", "nan"], "--learning-rate must be a finite number"),
        (["--max-grad-norm", "inf"], "--max-grad-norm must be a finite number"),
        (["--warmup-fraction", "1.0"], "--warmup-fraction must be in [0, 1)"),
        (["--ddp-bucket-cap-mb", "0"], "--ddp-bucket-cap-mb must be positive"),
        (["--threads", "0"], "--threads takes auto, launcher or a positive number"),
        (["--memory-every", "0"], "--memory-every must be a positive integer"),
        (
            ["--ddp-static-graph", "--gradient-accumulation-steps", "2"],
            "--ddp-static-graph with --gradient-accumulation",
        ),
        (["--hidden-dropout", "1"], "--hidden-dropout must be in [0, 1)"),
        (["--attention-dropout", "nan"], "--attention-dropout must be a finite number"),
        (["--optimizer-implementation", "magic"], "invalid choice"),
    ],
)
def test_bad_settings_exit_2_with_one_line(capsys, argv, message):
    with pytest.raises(SystemExit) as exit_info:
        parse_settings(argv=argv)
    assert exit_info.value.code == 2
    error_line = capsys.readouterr().err.strip().splitlines()[-1]
    assert message in error_line


@pytest.mark.parametrize(
    "changes,message",
    [
        ({"per_device_batch_size": 0}, "--per-device-batch-size must be a positive integer, got 0"),
        ({"distributed_timeout": -5}, "--distributed-timeout must be a positive integer, got -5"),
        ({"num_workers": -1}, "--num-workers must be 0 or more, got -1"),
        ({"profile_warmup": -2}, "--profile-warmup must be 0 or more, got -2"),
        ({"profile_active": 0}, "--profile-active must be at least 1, got 0"),
        ({"test_fraction": float("nan")}, "--test-fraction must be a finite number, got nan"),
        ({"learning_rate": 0.0}, "--learning-rate must be positive, got 0.0"),
        ({"weight_decay": -0.5}, "--weight-decay must be 0 or more, got -0.5"),
        ({"max_grad_norm": -1.0}, "--max-grad-norm must be 0 (off) or more, got -1.0"),
        ({"ddp_bucket_cap_mb": 0.0}, "--ddp-bucket-cap-mb must be positive, got 0.0"),
        ({"lora_dropout": 1.0}, "--lora-dropout must be in [0, 1), got 1.0"),
        ({"warmup_fraction": -0.1}, "--warmup-fraction must be in [0, 1), got -0.1"),
        ({"validation_fraction": 0.5}, "--validation-fraction must be between 0 and 0.5, got 0.5"),
        ({"threads": "0"}, "--threads takes auto, launcher or a positive number, got '0'"),
        # several broken at once: the first in the order of the checks is the one said
        ({"learning_rate": float("inf"), "eval_batch_size": 0}, "--eval-batch-size must be a positive integer, got 0"),
        ({"learning_rate": 0.0, "profile_wait": -1}, "--profile-wait must be 0 or more, got -1"),
        ({"warmup_fraction": float("nan")}, "--warmup-fraction must be a finite number, got nan"),
        ({"hidden_dropout": 2.0, "weight_decay": -1.0}, "--weight-decay must be 0 or more, got -1.0"),
    ],
)
def test_each_numeric_bound_is_refused_with_its_own_whole_line(changes, message):
    with pytest.raises(UserError) as error:
        dataclasses.replace(Settings(), **changes).validate()
    assert str(error.value) == message


def test_max_grad_norm_zero_turns_clipping_off():
    (settings,) = parse_settings(argv=["--max-grad-norm", "0"])
    assert settings.max_grad_norm is None


def test_independent_single_process_runs_are_refused():
    assert launcher_world_size({"WORLD_SIZE": "2"}) == 2
    with pytest.raises(UserError, match="2 independent single-process runs"):
        refuse_independent_runs(1, {"WORLD_SIZE": "2", "RANK": "0"})
    refuse_independent_runs(2, {"WORLD_SIZE": "2"})  # a real process group
    refuse_independent_runs(1, {})  # a plain single process


def test_wandb_goes_offline_without_key_or_network():
    assert wandb_mode({"WANDB_MODE": "disabled"}) == "disabled"
    assert wandb_mode({"WANDB_DISABLED": "true"}) == "disabled"
    # a key but no route to the server (an unroutable address): offline, never blocking
    assert wandb_mode({"WANDB_API_KEY": "k" * 40, "WANDB_BASE_URL": "https://127.0.0.1:9"}) == "offline"


def test_tracker_config_is_flat_scalars():
    assert flat_config({"a": None, "b": ["x", "y"], "c": 3}) == {"a": "none", "b": "x,y", "c": 3}


def test_thread_budget_is_usable_cores_over_local_processes():
    saved = torch.get_num_threads()
    try:
        cores = environment.usable_cores()
        facts = environment.apply_thread_budget("auto", {"LOCAL_WORLD_SIZE": "2", "OMP_NUM_THREADS": "1"})
        assert facts["thread_budget"] == max(1, cores // 2) == torch.get_num_threads()
        assert facts["threads_source"] == "auto" and facts["omp_num_threads"] == "1"
        assert environment.apply_thread_budget("1", {})["threads_source"] == "user" and torch.get_num_threads() == 1
        torch.set_num_threads(cores)
        kept = environment.apply_thread_budget("launcher", {})
        assert kept["torch_threads"] == cores and kept["threads_source"] == "launcher"
    finally:
        torch.set_num_threads(saved)


def test_a_container_cpu_quota_caps_the_usable_cores(tmp_path):
    (tmp_path / "cpu.max").write_text("150000 100000\n")
    assert environment.cgroup_cpu_limit(tmp_path / "cpu.max") == 1.5
    (tmp_path / "cpu.max").write_text("max 100000\n")
    assert environment.cgroup_cpu_limit(tmp_path / "cpu.max") is None
    assert environment.cgroup_cpu_limit(tmp_path / "missing") is None


def test_each_rank_reports_its_first_error_once_per_distinct_message(tmp_path, monkeypatch):
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    launch = {"WORLD_SIZE": "2", "TORCHELASTIC_RUN_ID": "run-a"}
    assert first_to_report("same validation error", {**launch, "RANK": "0"})
    assert not first_to_report("same validation error", {**launch, "RANK": "1"})  # already printed
    assert first_to_report("rank 1 ran out of memory", {**launch, "RANK": "1"})  # a different error is printed
    assert first_to_report("same validation error", {**launch, "RANK": "0", "TORCHELASTIC_RUN_ID": "run-b"})
    assert first_to_report("single process", {})


def test_exit_with_names_the_rank_in_a_multi_process_launch(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    with pytest.raises(SystemExit) as exit_info:
        exit_with(
            UserError("bad https://u:secret@h/x.csv"), 2, {"WORLD_SIZE": "2", "RANK": "1", "TORCHELASTIC_RUN_ID": "x"}
        )
    assert exit_info.value.code == 2
    assert capsys.readouterr().err == "error: (rank 1) bad https://h/x.csv\n"


def test_console_output_is_redacted_tracebacks_included():
    code = (
        "from trainscope.core.errors import redacted_output\n"
        "with redacted_output():\n"
        "    print('reading https://user:hunter2@host/data.csv?token=abc')\n"
        "    raise RuntimeError('cannot open https://user:hunter2@host/data.csv')\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 1 and "RuntimeError: cannot open https://host/data.csv" in result.stderr
    assert "hunter2" not in result.stdout + result.stderr and "token=abc" not in result.stdout


def test_help_reads_as_written_with_dashes_bare_switches_and_groups():
    """train.py --help: its docstring's examples line by line, each flag by its dashed name (in the usage line too),
    a boolean as a bare switch, the flags grouped as Settings is."""
    import train
    from trainscope.workload.settings import SECTIONS, build_parser

    text = build_parser(description=train.__doc__).format_help()
    assert "\n  --max-train-samples MAX_TRAIN_SAMPLES" in text and "--max_train_samples" not in text
    assert "\n  --lora " in text and "[LORA]" not in text and "LORA\n" not in text
    for line in train.__doc__.splitlines():  # the examples as written, not folded into a paragraph
        if line.strip().startswith(("python train.py", "accelerate launch")):
            assert line.rstrip() in text
    positions = [text.index(f"\n{title}:\n") for title in SECTIONS.values()]
    assert positions == sorted(positions)
    (parsed,) = parse_settings(argv=["--lora", "false", "--unpad"])  # a switch still takes an explicit value
    assert not parsed.lora and parsed.unpad


def test_a_cpu_run_of_the_whole_corpus_says_so_first(capsys):
    from types import SimpleNamespace

    from trainscope import classifier

    state = SimpleNamespace(device=torch.device("cpu"), is_main_process=True)
    started = SimpleNamespace(state=state)
    classifier.announce(Settings(), started, 30526, {"time": {"run_s": 1800.0}})
    line = capsys.readouterr().out.strip()
    assert line.startswith("training on all 30,526 rows on a CPU (about 30 min predicted)") and "4000" in line
    classifier.announce(Settings(max_train_samples=4000), started, 4000, None)
    assert capsys.readouterr().out == ""
