"""What the run really ran on: versions, device, topology, CPU threads and the precision in effect."""

import math
import os
import platform
from importlib import metadata
from pathlib import Path

import torch

from trainscope.core import precision
from trainscope.core.errors import UserError

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
            f"accelerate_configs/ddp.yaml {script_name()}"
        )


def script_name() -> str:
    """The script this process runs, as its user launched it (train.py, or their own)."""
    import sys

    script = sys.argv[0] if sys.argv and sys.argv[0] not in ("", "-c", "-m") else ""
    return script.rsplit("/", 1)[-1] if script.endswith(".py") else "your_script.py"


def accelerator_available() -> bool:
    """Whether this torch can use a GPU or another accelerator (what Accelerate would pick over the CPU)."""
    accelerator = getattr(torch, "accelerator", None)
    if accelerator is not None and hasattr(accelerator, "is_available"):
        return bool(accelerator.is_available())
    return torch.cuda.is_available()


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    if device.type == "cpu":
        return cpu_model_name()
    return device.type


def cpu_model_name(cpuinfo: Path = Path("/proc/cpuinfo")) -> str:
    """x86's `model name`; on ARM, where /proc/cpuinfo has none, the implementer and part codes (which name the core
    design, e.g. 0x41 0xd40 for Arm Neoverse V1); else what the platform says."""
    fields = {}
    try:
        for line in cpuinfo.read_text().splitlines():
            if ":" in line:
                name, value = (part.strip() for part in line.split(":", 1))
                fields.setdefault(name, value)
    except OSError:
        pass
    if fields.get("model name"):
        return fields["model name"]
    if fields.get("CPU implementer") and fields.get("CPU part"):
        return f"ARM CPU implementer {fields['CPU implementer']} part {fields['CPU part']}"
    return platform.processor() or platform.machine() or "cpu"


def cgroup_cpu_limit(path: Path = Path("/sys/fs/cgroup/cpu.max")) -> float | None:
    """The container's CPU quota in cores (cgroup v2 `cpu.max`: "<quota> <period>"), None when unlimited."""
    try:
        quota, period = path.read_text().split()[:2]
    except (OSError, ValueError):
        return None
    return None if quota == "max" else int(quota) / int(period)


def machine_busy_seconds() -> float | None:
    """The busy CPU seconds of the whole machine since boot (/proc/stat: user, nice, system, irq, softirq, steal), or
    None where it cannot be read: with this process's own CPU time, what other processes took over an interval."""
    try:
        fields = [int(v) for v in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    except (OSError, ValueError, IndexError):
        return None
    return (sum(fields[:3]) + sum(fields[5:8])) / os.sysconf("SC_CLK_TCK")


def usable_cores() -> int:
    """Cores this process may run on: its CPU affinity, capped by a container CPU quota."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:
        cores = os.cpu_count() or 1
    limit = cgroup_cpu_limit()
    return max(1, min(cores, math.ceil(limit))) if limit else cores


def local_processes(environ=None) -> int:
    """Processes of this launch on this node (torchrun and accelerate launch export LOCAL_WORLD_SIZE)."""
    environ = os.environ if environ is None else environ
    value = environ.get("LOCAL_WORLD_SIZE", "")
    return int(value) if value.isdigit() and int(value) > 0 else 1


def machine_count(environ=None) -> int:
    """Machines (nodes) in this launch, the same on every rank: torchrun's node count GROUP_WORLD_SIZE
    (accelerate launch runs torchrun), else processes / processes per node (Accelerate sets WORLD_SIZE and
    LOCAL_WORLD_SIZE for MPI launches), else 1."""
    environ = os.environ if environ is None else environ
    nodes = environ.get("GROUP_WORLD_SIZE", "")
    if nodes.isdigit() and int(nodes) > 0:
        return int(nodes)
    world, local = environ.get("WORLD_SIZE", ""), environ.get("LOCAL_WORLD_SIZE", "")
    if world.isdigit() and local.isdigit() and int(local) > 0:
        return max(1, math.ceil(int(world) / int(local)))
    return 1


def apply_thread_budget(setting: str, environ=None, workers: int = 0, accelerator: bool = False) -> dict:
    """Set this process's intra-op threads from --threads and say what was set and why.

    auto: usable cores / local processes (the budget); on an accelerator less the process's DataLoader `workers`
    (keeping one thread): there the device computes, and a worker that shares a core with an intra-op thread slows
    the loading it is there to hide; on a CPU the threads are the compute, and workers trade cores with it (the
    advisor weighs that); a number: that many (source user); launcher: keep what OMP_NUM_THREADS gave torch
    (source launcher).
    """
    environ = os.environ if environ is None else environ
    cores, processes = usable_cores(), local_processes(environ)
    share = max(1, cores // processes)
    kept = min(workers, share - 1) if accelerator else 0
    budget = share - kept
    if setting == "launcher":
        source = "launcher"
    else:
        source = "auto" if setting == "auto" else "user"
        torch.set_num_threads(budget if setting == "auto" else int(setting))
    return {
        "torch_threads": torch.get_num_threads(),
        "threads_source": source,
        "thread_budget": budget,
        "usable_cores": cores,
        "local_processes": processes,
        "omp_num_threads": environ.get("OMP_NUM_THREADS"),
        "kept_for_workers": kept,
    }


def cpu_capability() -> str:
    """The widest vector ISA torch's CPU kernels use here (e.g. AVX2, AVX512, SVE256), plus native bf16 units."""
    capability = torch.backends.cpu.get_cpu_capability()
    native = sorted(precision.NATIVE_BF16_FLAGS & precision.cpu_flags())
    return capability + (f" + {', '.join(native)}" if native else ", no native bf16")


def package_versions() -> dict:
    versions = {}
    for name in PACKAGES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = None
    return versions


def describe(accelerator, effective: str, threads: dict) -> dict:
    """The environment block of a run record (provenance is a block of its own)."""
    state = accelerator.state
    return {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "packages": package_versions(),
        "device": str(accelerator.device),
        "device_name": device_name(accelerator.device),
        "device_count": torch.cuda.device_count() if torch.cuda.is_available() else 0,
        "cuda": torch.version.cuda,
        "cpu_capability": cpu_capability(),
        "cpu_native_bf16": precision.cpu_native_bf16(),
        "usable_cores": threads["usable_cores"],
        "torch_threads": threads["torch_threads"],
        "threads": threads,
        "world_size": accelerator.num_processes,
        "num_machines": machine_count(),
        "distributed_type": str(state.distributed_type).split(".")[-1],
        "backend": state.backend,
        "requested_precision": accelerator.mixed_precision,
        "effective_precision": effective,
        "tf32_in_effect": precision.tf32_in_effect() and accelerator.device.type == "cuda",  # TF32 is CUDA's
        "fsdp_requested": os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true",
        "device_memory_gib": device_memory_gib(accelerator.device),
        **(precision.cuda_precision_facts() if accelerator.device.type == "cuda" else {}),
    }


def device_memory_gib(device: torch.device) -> float | None:
    """Total memory of a CUDA device (None elsewhere): what "memory near the limit" is measured against."""
    if device.type != "cuda":
        return None
    return torch.cuda.get_device_properties(device).total_memory / 1024**3


def compile_stats() -> dict:
    """torch.compile so far in this process: distinct graphs compiled and seconds spent compiling."""
    import torch._dynamo.utils as dynamo_utils  # deferred: dynamo loads sympy; most runs compile nothing

    return {
        "graphs": int(dynamo_utils.counters["stats"]["unique_graphs"]),
        "compile_s": float(dynamo_utils.calculate_time_spent().get("total_wall_time", 0.0)),
    }


def compiled_with(accelerator, model) -> dict | None:
    """How the model trains compiled, read from the objects: by the Accelerator's dynamo plugin ({dynamic: the
    plugin's}) or by the loop's own torch.compile ({dynamic: None, unknown}); None where it runs eagerly."""
    plugin = getattr(accelerator.state, "dynamo_plugin", None)
    if plugin is not None and str(getattr(plugin.backend, "value", plugin.backend)).lower() != "no":
        return {"dynamic": plugin.dynamic}
    while model is not None:  # DDP, FSDP or Accelerate's wrappers around the loop's compiled module
        if type(model).__name__ == "OptimizedModule":  # torch._dynamo's, checked by name: importing it loads sympy
            return {"dynamic": None}
        model = getattr(model, "module", None)
    return None
