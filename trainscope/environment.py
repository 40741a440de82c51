"""What the run really ran on: versions, device, topology and the precision actually in effect."""

import os
import platform
import subprocess
from importlib import metadata
from pathlib import Path

import torch

from trainscope.errors import UserError

PACKAGES = ("torch", "transformers", "accelerate", "peft", "datasets", "evaluate")
_LAUNCHER_WORLD_SIZE = ("WORLD_SIZE", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "SLURM_NTASKS")


def launcher_world_size(environ=None) -> int:
    """How many processes the launcher (torchrun, mpirun, srun) says it started."""
    environ = os.environ if environ is None else environ
    for name in _LAUNCHER_WORLD_SIZE:
        if environ.get(name, "").isdigit():
            return int(environ[name])
    return 1


def refuse_independent_runs(num_processes: int, environ=None) -> None:
    """Stop a multi-process launch that Accelerate turned into N separate single-process runs.

    Plain `torchrun --nproc_per_node N` on a CPU-only machine does this: every process would train
    the whole model on the whole data, N times over.
    """
    launched = launcher_world_size(environ)
    if launched > 1 and num_processes == 1:
        raise UserError(
            f"{launched} processes were launched but Accelerate set up {launched} independent single-process "
            "runs (no process group); on a CPU use: ACCELERATE_USE_CPU=1 accelerate launch --config_file "
            "accelerate_configs/ddp.yaml train.py"
        )


def effective_precision(accelerator) -> str:
    """The dtype autocast really produces on this device: 'fp16', 'bf16', 'tf32' or 'fp32'.

    Accelerate accepts mixed_precision=fp16 on a CPU and silently runs fp32; a matmul under the same
    autocast context that wraps the model's forward tells the truth.
    """
    a = torch.ones(8, 8, device=accelerator.device)
    with accelerator.autocast():
        dtype = (a @ a).dtype
    if dtype == torch.float16:
        return "fp16"
    if dtype == torch.bfloat16:
        return "bf16"
    if accelerator.device.type == "cuda" and torch.backends.cuda.matmul.allow_tf32:
        return "tf32"
    return "fp32"


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    if device.type == "cpu":
        try:
            for line in Path("/proc/cpuinfo").read_text().splitlines():
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
        except OSError:
            pass
        return platform.processor() or "cpu"
    return device.type


def usable_cores() -> int:
    """Cores this process may run on (its CPU affinity), not the machine's core count."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def package_versions() -> dict:
    versions = {}
    for name in PACKAGES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = None
    return versions


def project_commit() -> str | None:
    try:
        result = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=Path(__file__).parent,
                                capture_output=True, text=True, timeout=5)
        return result.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def describe(accelerator, precision: str) -> dict:
    """The environment block of a run record."""
    state = accelerator.state
    return {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "packages": package_versions(),
        "trainscope_commit": project_commit(),
        "device": str(accelerator.device),
        "device_name": device_name(accelerator.device),
        "device_count": torch.cuda.device_count() if torch.cuda.is_available() else 0,
        "cuda": torch.version.cuda,
        "usable_cores": usable_cores(),
        "torch_threads": torch.get_num_threads(),
        "world_size": accelerator.num_processes,
        "num_machines": int(os.environ.get("ACCELERATE_NUM_MACHINES", os.environ.get("GROUP_WORLD_SIZE", 1)) or 1),
        "distributed_type": str(state.distributed_type).split(".")[-1],
        "backend": state.backend,
        "requested_precision": accelerator.mixed_precision,
        "effective_precision": precision,
        "tf32_matmul": bool(torch.backends.cuda.matmul.allow_tf32),
        "fsdp_requested": os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true",
    }
