"""The one entry through which trainscope's own code runs a training: the README's command,
`accelerate launch [--config_file accelerate_configs/<config>.yaml] train.py [flags]` (one process without a
config: `accelerate_launch`), so that benchmarks, experiments and `make tune` measure what a user runs. `plan` says
whether a config can run on the devices present (a 2-process DDP config on one GPU is skipped with its reason)."""

import os
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import yaml

from trainscope.core.paths import ROOT

TRAIN_SCRIPT = ROOT / "train.py"
CONFIGS = ROOT / "accelerate_configs"
PYTHON = sys.executable
ACCELERATE = str(Path(sys.executable).parent / "accelerate")


def config_path(name: str) -> Path:
    """accelerate_configs/<name>.yaml (a path is taken as it is)."""
    path = Path(name)
    return path if path.suffix in (".yaml", ".yml") else CONFIGS / f"{name}.yaml"


def config_argument(name: str) -> str:
    """`--config_file accelerate_configs/<name>.yaml` as a user types it (relative to the repository)."""
    path = config_path(name)
    return f"--config_file {path.relative_to(ROOT) if path.is_relative_to(ROOT) else path}"


def config_facts(config: Path | None) -> dict:
    """What a config asks for: processes, distributed type, precision, CPU only."""
    values = yaml.safe_load(Path(config).read_text()) if config else {}
    return {
        "num_processes": int(values.get("num_processes", 1)),
        "distributed_type": values.get("distributed_type", "NO"),
        "mixed_precision": values.get("mixed_precision", "no"),
        "use_cpu": bool(values.get("use_cpu", False)),
    }


def cuda_devices() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


@dataclass
class Plan:
    config: str
    runnable: bool
    reason: str | None = None
    on_cpu: bool = False  # runs with ACCELERATE_USE_CPU=1


def plan(config: str, gpus: int | None = None) -> Plan:
    """Can `config` run on this machine, and how? Without GPUs every config runs on the CPU (DDP over
    gloo); with GPUs, a config needs as many of them as it has processes."""
    gpus = cuda_devices() if gpus is None else gpus
    facts = config_facts(config_path(config))
    if gpus == 0 or facts["use_cpu"]:
        return Plan(config, True, on_cpu=True)
    if facts["num_processes"] > gpus:
        return Plan(config, False, f"needs {facts['num_processes']} GPUs (one per process), {gpus} present")
    return Plan(config, True)


def accelerate_launch(config: str | None = None, mixed_precision: str | None = None) -> list[str]:
    """`accelerate launch --config_file <config>`, or `accelerate launch --num_processes 1` without one.

    With no config and no default config, accelerate 1.15 starts one process per visible GPU
    (`_validate_launch_command` in accelerate/commands/launch.py): a run meant as one process would
    turn into DDP on a multi-GPU host and report a global figure next to a single process's. `mixed_precision`
    overrides the config's (the launcher's own flag wins over its config file)."""
    return [
        ACCELERATE,
        "launch",
        *(["--config_file", str(config_path(config))] if config else ["--num_processes", "1"]),
        *(["--mixed_precision", mixed_precision] if mixed_precision else []),
    ]


def split_args(argv: list[str]) -> tuple[list[str], list[str]]:
    """(our flags, train.py flags) of a command that launches training: everything after `--` goes to train.py."""
    return (argv[: argv.index("--")], argv[argv.index("--") + 1 :]) if "--" in argv else (argv, [])


def train_command(
    train_args: list[str],
    config: str | None = None,
    launcher: str = "accelerate",
    script: Path = TRAIN_SCRIPT,
    mixed_precision: str | None = None,
) -> list[str]:
    """The documented command; `script` is train.py unless a caller runs a wrapper of it (tests do)."""
    if launcher == "python":
        return [PYTHON, str(script), *train_args]
    return [*accelerate_launch(config, mixed_precision), str(script), *train_args]


def training_env(on_cpu: bool | None = None, extra: dict | None = None) -> dict:
    """The environment of a launched training: ACCELERATE_USE_CPU=1 where it must run on the CPU."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", **(extra or {})}
    if on_cpu if on_cpu is not None else cuda_devices() == 0:
        env["ACCELERATE_USE_CPU"] = "1"
    return env


def run_training(
    train_args: list[str],
    config: str | None = None,
    launcher: str = "accelerate",
    env: dict | None = None,
    timeout: float | None = None,
    echo: bool = True,
    script: Path = TRAIN_SCRIPT,
    mixed_precision: str | None = None,
) -> subprocess.CompletedProcess:
    """Run train.py by the documented command; output captured. On timeout the whole launch
    (launcher and workers) is killed."""
    command = train_command(train_args, config, launcher, script, mixed_precision)
    if echo:
        print("$ " + " ".join(Path(command[0]).name if i == 0 else part for i, part in enumerate(command)), flush=True)
    return run_captured(command, env if env is not None else training_env(), timeout)


def train_in_this_process(train_args: list[str]) -> int:
    """train.py's main() run in this (one-process, launcher-free) process, as `python train.py [flags]` runs it, and
    its exit code: for several short runs in one process without paying the imports again (the predictor's
    first-use calibration, trainscope.predict.calibration). Accelerate's process-wide state is reset after each run."""
    import runpy

    from accelerate.state import AcceleratorState

    main = runpy.run_path(str(TRAIN_SCRIPT), run_name="trainscope_train")["main"]
    try:
        main(train_args)
        return 0
    except SystemExit as exit_:
        return exit_.code if isinstance(exit_.code, int) else 1
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)


def run_captured(
    command: list[str], env: dict, timeout: float | None = None, cwd: Path = ROOT
) -> subprocess.CompletedProcess:
    """Run `command` in a session of its own (in `cwd`: the project's folder unless said), output captured. Past
    `timeout` the whole launch is killed and the result ends in `error: timed out after N s`. An exception while
    waiting (Ctrl-C's KeyboardInterrupt, a signal handler's exception) kills it too before going on: in its own
    session the launch never sees the terminal's Ctrl-C and would run on, orphaned."""
    process = subprocess.Popen(
        command, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        stdout, stderr = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_tree(process.pid)
        stdout, stderr = process.communicate()
        return subprocess.CompletedProcess(
            command, -signal.SIGKILL, stdout, stderr + f"\nerror: timed out after {timeout:.0f} s"
        )
    except BaseException:
        kill_tree(process.pid)
        process.communicate()
        raise
    return subprocess.CompletedProcess(command, process.returncode, stdout, stderr)


def kill_tree(pid: int) -> None:
    """SIGKILL a launch and every process under it: torchrun starts its workers in sessions of their own,
    so killing the launcher's process group leaves them running."""
    import psutil

    try:
        root = psutil.Process(pid)
        processes = [*root.children(recursive=True), root]
    except psutil.NoSuchProcess:
        return
    for process in processes:
        try:
            process.send_signal(signal.SIGKILL)
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(processes, timeout=10)


def failure_reason(result: subprocess.CompletedProcess) -> str:
    """The run's own `error:` line, else the last line of its output."""
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    if errors:
        return errors[-1][len("error: ") :]
    lines = [line for line in result.stderr.strip().splitlines() if line.strip()]
    return lines[-1] if lines else f"exit status {result.returncode}"
