"""Shared helpers: launch the scripts exactly as the README does, on the tiny model, on the CPU."""

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
CONFIGS = sorted((ROOT / "accelerate_configs").glob("*.yaml"))
ACCELERATE = str(Path(sys.executable).parent / "accelerate")
# A few seconds a run: 2-layer BERT of width 32, small slices of the embedded tweets.
TINY = [
    "--model", "embedded:tiny-bert", "--max-train-samples", "256", "--max-eval-samples", "64",
    "--max-test-samples", "64", "--per-device-batch-size", "16", "--learning-rate", "3e-3",
    "--report-to", "none", "--log-every", "2",
]


def cpu_env(**extra) -> dict:
    env = {**os.environ, "ACCELERATE_USE_CPU": "1", "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false"}
    env.update(extra)
    return env


def config_processes(config: Path) -> int:
    return int(yaml.safe_load(config.read_text()).get("num_processes", 1)) if config.exists() else 1


def launch(script: str, args: list[str], config: Path | None = None, env: dict | None = None,
           cwd: Path = ROOT, timeout: int = 600, launcher: str = "accelerate") -> subprocess.CompletedProcess:
    """`accelerate launch [--config_file X] script args`, `python script args` or torchrun."""
    if launcher == "accelerate":
        command = [ACCELERATE, "launch"] + (["--config_file", str(config)] if config else [])
        command += ["--num_cpu_threads_per_process", "1"] if config and config_processes(config) > 1 else []
    elif launcher == "python":
        command = [sys.executable]
    else:
        command = [str(Path(sys.executable).parent / "torchrun"), "--nproc_per_node", "2"]
    command += [str(ROOT / script), *args]
    return run_command(command, cwd=cwd, env=env or cpu_env(), timeout=timeout)


def run_command(command: list[str], cwd: Path = ROOT, env: dict | None = None, timeout: int = 600):
    """subprocess.run that, on timeout, kills the launcher's whole process group, workers included."""
    process = subprocess.Popen(command, cwd=cwd, env=env or cpu_env(), stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        stdout, stderr = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        stdout, stderr = process.communicate()
        raise AssertionError(f"timed out after {timeout}s: {' '.join(command)}\n{stderr[-3000:]}") from None
    return subprocess.CompletedProcess(command, process.returncode, stdout, stderr)


def read_record(run_dir: Path) -> dict:
    return json.loads((run_dir / "record.json").read_text())


def read_steps(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "steps.jsonl").read_text().splitlines()]


def assert_ok(result: subprocess.CompletedProcess) -> None:
    assert result.returncode == 0, f"exit {result.returncode}\n{result.stdout[-3000:]}\n{result.stderr[-5000:]}"


@pytest.fixture
def runs(tmp_path) -> Path:
    return tmp_path / "runs"
