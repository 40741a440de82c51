import dataclasses

import pytest

from trainscope.environment import launcher_world_size, refuse_independent_runs
from trainscope.errors import UserError
from trainscope.settings import Settings, parse_settings
from trainscope.trackers import flat_config, wandb_mode


def test_every_flag_has_help(capsys):
    with pytest.raises(SystemExit) as exit_info:
        parse_settings(argv=["--help"])
    assert exit_info.value.code == 0
    text = capsys.readouterr().out
    for field in dataclasses.fields(Settings):
        assert f"--{field.name.replace('_', '-')}" in text
        assert field.metadata.get("help"), f"{field.name} has no help"


def test_dashes_and_underscores_both_work():
    (a,) = parse_settings(argv=["--per-device-batch-size", "8", "--lora"])
    (b,) = parse_settings(argv=["--per_device_batch_size", "8", "--lora"])
    assert a == b and a.per_device_batch_size == 8 and a.lora


@pytest.mark.parametrize("argv,message", [
    (["--no-such-flag", "1"], "unknown argument"),
    (["--per-device-batch-size", "0"], "per-device-batch-size must be a positive integer"),
    (["--per-device-batch-size", "-4"], "per-device-batch-size must be a positive integer"),
    (["--num-workers", "-1"], "num-workers must be 0 or more"),
    (["--prefetch-factor", "4"], "prefetch-factor needs --num-workers"),
    (["--resume"], "--resume needs --run-name"),
    (["--timing", "sometimes"], "invalid choice"),
    (["--test-fraction", "0.7"], "test-fraction must be between"),
    (["--run-name", "../escape"], "plain directory name"),
])
def test_bad_settings_exit_2_with_one_line(capsys, argv, message):
    with pytest.raises(SystemExit) as exit_info:
        parse_settings(argv=argv)
    assert exit_info.value.code == 2
    error_line = capsys.readouterr().err.strip().splitlines()[-1]
    assert message in error_line


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
