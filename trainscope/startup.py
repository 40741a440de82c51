"""Start-up of a training process, before any data or model: what the launcher gave it, its CPU
threads, seeds, TF32, the model's sequence limit, the run folder, and then the Accelerator.

Every script that trains calls `start` first, so all of them run under the same conditions
(the same thread budget above all: `accelerate launch` alone would give each process one thread).
"""

import dataclasses
import math
import os
import shutil
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

from accelerate import Accelerator, DataLoaderConfiguration, PartialState
from accelerate.utils import (DDPCommunicationHookType, DistributedDataParallelKwargs, ProjectConfiguration,
                              TorchDynamoPlugin, broadcast_object_list, parse_flag_from_env, set_seed)

from trainscope import environment, modeling, precision, trackers
from trainscope.errors import UserError
from trainscope.settings import Settings


@dataclass
class Startup:
    """What start-up found and decided, for the rest of the run."""

    state: PartialState
    settings: Settings       # with --max-seq-length clamped to the model's limit
    threads: dict
    run_dir: Path
    requested_max_seq_length: int
    model_sequence_limit: int | None
    cpu_fallback: dict | None = None  # a multi-process launch without a usable GPU, run over gloo on the CPU

    def environment_facts(self) -> dict:
        return {"requested_max_seq_length": self.requested_max_seq_length,
                "model_sequence_limit": self.model_sequence_limit, "cpu_fallback": self.cpu_fallback}


def configure_process(settings: Settings) -> dict:
    """Threads and tokenizer parallelism of a process that measures speed; returns the thread facts."""
    # tokenizers' own threads would fight DataLoader workers for the same cores
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    return environment.apply_thread_budget(settings.threads)


def start(settings: Settings) -> Startup:
    fallback = cpu_fallback()
    state = PartialState(cpu=parse_flag_from_env("ACCELERATE_USE_CPU"))  # as Accelerator() reads it
    environment.refuse_independent_runs(state.num_processes)
    threads = configure_process(settings)
    set_seed(settings.seed)
    precision.enforce_tf32(settings.tf32)
    requested = settings.max_seq_length
    limit = modeling.sequence_limit(settings)
    if limit is not None and requested > limit:  # said by the max_seq_length_clamped warning when the run opens
        settings = dataclasses.replace(settings, max_seq_length=limit)
    run_dir = resolve_run_dir(settings, state)
    return Startup(state, settings, threads, run_dir, requested, limit, fallback)


def cpu_fallback(environ=None) -> dict | None:
    """A multi-process launch (a GPU config such as ddp_fp16.yaml, or a plain torchrun) on a machine without a
    usable accelerator runs as DDP over gloo on the CPU, as ACCELERATE_USE_CPU=1 would make it, instead of N
    separate runs. Sets ACCELERATE_USE_CPU for this process (Accelerate reads it) and returns what ran instead.
    An ACCELERATE_USE_CPU the user set is theirs to keep (multi-process `accelerate launch` sets none)."""
    environ = os.environ if environ is None else environ
    processes = environment.launcher_world_size(environ)
    if processes < 2 or "ACCELERATE_USE_CPU" in environ or environment.accelerator_available():
        return None
    environ["ACCELERATE_USE_CPU"] = "1"
    return {"processes": processes, "requested_precision": environ.get("ACCELERATE_MIXED_PRECISION", "no"),
            "fsdp_requested": environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true",
            "reason": "no usable GPU or other accelerator"}


def resolve_run_dir(settings: Settings, state: PartialState) -> Path:
    """runs/<run-name>, named the same on every process, checked (not created) before any work."""
    name = settings.run_name
    if name is None:
        stamp = [datetime.now().strftime("%Y%m%d-%H%M%S")]
        broadcast_object_list(stamp)  # the main process's clock names the run for everybody
        model = settings.model.rstrip("/").split("/")[-1].split(":")[-1]
        dataset = settings.dataset.rstrip("/").split("/")[-1].split(":")[-1].split(".")[0].split("?")[0]
        precision_name = os.environ.get("ACCELERATE_MIXED_PRECISION", "no").replace("no", "fp32")
        name = f"{model}-{dataset}-{precision_name}-{state.num_processes}p-{stamp[0]}"
    run_dir = Path(settings.output_dir) / name
    if settings.predict:  # nothing is written: an existing run of the same name is no obstacle
        return run_dir
    if settings.resume:
        if not (run_dir / "checkpoints").is_dir() or not any((run_dir / "checkpoints").iterdir()):
            raise UserError(f"--resume: {run_dir} has no checkpoint (was it run with --save-every?)")
    elif run_dir.exists():
        if not settings.overwrite:
            raise UserError(f"{run_dir} already exists: pass --overwrite, --resume or another --run-name")
        state.wait_for_everyone()
        if state.is_main_process:
            shutil.rmtree(run_dir)
    return run_dir


def ddp_kwargs(settings: Settings) -> DistributedDataParallelKwargs:
    """The DDP flags of --ddp-*; the compression hook is registered by trainscope.communication."""
    options = {"gradient_as_bucket_view": settings.ddp_gradient_as_bucket_view,
               "static_graph": settings.ddp_static_graph,
               "find_unused_parameters": settings.ddp_find_unused_parameters,
               "comm_hook": DDPCommunicationHookType.NO}
    if settings.ddp_bucket_cap_mb is not None:
        options["bucket_cap_mb"] = settings.ddp_bucket_cap_mb
    return DistributedDataParallelKwargs(**options)


def build_accelerator(settings: Settings, started: Startup) -> Accelerator:
    """The Accelerator for this run; topology and precision come from the launch's config."""
    on_cuda = started.state.device.type == "cuda"
    accelerator = Accelerator(
        gradient_accumulation_steps=settings.gradient_accumulation_steps,
        log_with=trackers.trackers_for(settings.report_to) or None,
        project_config=ProjectConfiguration(project_dir=str(started.run_dir),
                                            logging_dir=str(started.run_dir / "tensorboard")),
        dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True, data_seed=settings.seed,
                                                  non_blocking=pin_memory(settings, on_cuda)),
        # dynamic shapes: with dynamic padding every new sequence length would recompile otherwise
        # (accelerate launch exports dynamic=False); one fixed shape with --pad-to-max-length
        dynamo_plugin=TorchDynamoPlugin(backend="inductor", dynamic=not settings.pad_to_max_length)
        if settings.compile else None,
        kwargs_handlers=[ddp_kwargs(settings)],
    )
    precision.enforce_tf32(settings.tf32)  # Accelerate's dynamo set-up turns TF32 on for fp32 CUDA runs
    return accelerator


def pin_memory(settings: Settings, on_cuda: bool) -> bool:
    return on_cuda if settings.pin_memory is None else settings.pin_memory


def plan_steps(settings: Settings, train_rows: int, processes: int) -> dict:
    """Optimizer steps, steps per epoch, epochs and the global batch of a run (pure)."""
    batches = math.ceil(train_rows / settings.per_device_batch_size)
    if batches < processes:
        raise UserError(
            f"{train_rows} training rows make {batches} batches of {settings.per_device_batch_size}, "
            f"fewer than the {processes} processes: lower --per-device-batch-size or use more data"
        )
    steps_per_epoch = math.ceil(math.ceil(train_rows / (settings.per_device_batch_size * processes))
                                / settings.gradient_accumulation_steps)
    total = settings.max_steps or settings.epochs * steps_per_epoch
    return {"optimizer_steps": total, "steps_per_epoch": steps_per_epoch,
            "epochs": math.ceil(total / steps_per_epoch),
            "global_batch_size": settings.per_device_batch_size * processes * settings.gradient_accumulation_steps}


def device_loader_options(settings: Settings, accelerator) -> dict:
    """build_dataloaders' keyword arguments for this device and precision: pinned host memory on CUDA,
    sequences padded to multiples of 8 (tensor-core shapes) in mixed precision on CUDA."""
    on_cuda = accelerator.device.type == "cuda"
    return {"pin_memory": pin_memory(settings, on_cuda),
            "pad_to_multiple_of": 8 if on_cuda and accelerator.mixed_precision in ("fp16", "bf16") else None}
