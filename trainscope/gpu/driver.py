"""The NVIDIA driver and the torch that can see it: the driver's version and CUDA version (nvidia-smi), and where a
driver answers but this torch cannot use the GPU, why and which torch build to install (make setup's warning, make
gpu-check's refusal)."""

import os
import re
import subprocess
import sys
from pathlib import Path

import torch

from trainscope.core.paths import ROOT


def nvidia_smi(*args: str) -> str | None:
    """nvidia-smi's output, or None where it does not answer (no NVIDIA driver here)."""
    try:
        result = subprocess.run(["nvidia-smi", *args], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.SubprocessError):
        return None
    return result.stdout if result.returncode == 0 else None


def driver_version() -> str | None:
    out = nvidia_smi("--query-gpu=driver_version", "--format=csv,noheader")
    return out.strip().splitlines()[0] if out and out.strip() else None


def driver_cuda_version(smi_output: str | None) -> tuple[int, int] | None:
    """The newest CUDA the driver runs: the `CUDA Version: 12.8` of nvidia-smi's header."""
    found = re.search(r"CUDA Version:\s*(\d+)\.(\d+)", smi_output or "")
    return (int(found.group(1)), int(found.group(2))) if found else None


# The CUDA builds of torch on download.pytorch.org/whl/<tag>: those of torch 2.9, assumed for this torch too
# (pytorch.org/get-started/locally lists the current ones).
TORCH_CUDA_BUILDS = ((12, 6), (12, 8), (13, 0))


def cuda_wheel_tag(driver_cuda: tuple[int, int]) -> str | None:
    """The newest CUDA build of torch that the driver runs (a driver runs CUDA runtimes up to the version
    nvidia-smi states): e.g. cu128 for a driver of CUDA 12.9; None where the driver is older than every build."""
    fitting = [build for build in TORCH_CUDA_BUILDS if build <= driver_cuda]
    return f"cu{fitting[-1][0]}{fitting[-1][1]}" if fitting else None


def python_shown() -> str:
    """This interpreter as a user types it: .venv/bin/python inside the repository."""
    python = Path(sys.executable)
    return str(python.relative_to(ROOT) if python.is_relative_to(ROOT) else python)


def cuda_torch_command(
    smi_output: str | None,
    torch_version: str = torch.__version__,
    torch_cuda: str | None = torch.version.cuda,
    environ=None,
) -> str | None:
    """Where the NVIDIA driver answers (`smi_output`: nvidia-smi's output, None without a driver) and this torch
    cannot use the GPU: why, and which torch to install, as one sentence. None where there is no driver, the
    GPU is usable, or CUDA_VISIBLE_DEVICES hides every GPU on purpose (as `make test` does).

    The build: the newest of TORCH_CUDA_BUILDS not newer than the CUDA version the driver states (`cu128` for a
    driver of CUDA 12.9); a driver older than every build is to be updated first."""
    environ = os.environ if environ is None else environ
    hidden = environ.get("CUDA_VISIBLE_DEVICES", "x").strip() in ("", "-1")
    if smi_output is None or hidden or torch.cuda.is_available():
        return None
    driver_cuda = driver_cuda_version(smi_output)
    driver = f"CUDA {driver_cuda[0]}.{driver_cuda[1]}" if driver_cuda else "no CUDA version stated"
    built_for = tuple(int(part) for part in torch_cuda.split(".")[:2]) if torch_cuda else None
    if built_for is not None and (driver_cuda is None or built_for <= driver_cuda):
        return (
            f"the NVIDIA driver answers (nvidia-smi: {driver}) but torch {torch_version} (built for CUDA "
            f"{torch_cuda}) cannot use the GPU: check CUDA_VISIBLE_DEVICES and the GPU's device files "
            "(/dev/nvidia*) in this container"
        )
    tag = cuda_wheel_tag(driver_cuda) if driver_cuda else None
    advice = ""
    if tag is None:
        (major, minor), tag = TORCH_CUDA_BUILDS[0], "cu{}{}".format(*TORCH_CUDA_BUILDS[0])
        advice = f"update the NVIDIA driver to one of CUDA {major}.{minor} or later, then "
    what = "is a CPU-only build" if built_for is None else f"is built for CUDA {torch_cuda}, newer than the driver"
    return (
        f"the NVIDIA driver answers (nvidia-smi: {driver}) but torch {torch_version} {what}: {advice}install "
        f"the CUDA build: {python_shown()} -m pip install torch=={torch_version.split('+')[0]}+{tag} "
        f"--index-url https://download.pytorch.org/whl/{tag}"
    )


def torch_check() -> None:
    """make setup's check: a warning, since CPU work still runs with this torch."""
    missing = cuda_torch_command(nvidia_smi())
    if missing:
        print(f"warning: {missing} (make gpu-check refuses to run until then)", file=sys.stderr)
