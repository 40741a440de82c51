"""Start-up of a training process, before any data or model: what the launcher gave it, its CPU
threads, seeds, TF32, the run folder, and then the Accelerator.

Every script that trains calls `start` first, so all of them run under the same conditions
(the same thread budget above all: `accelerate launch` alone would give each process one thread).
"""

import contextlib
import os
import shutil
import socket
import time
import uuid
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from pathlib import Path

import torch
from accelerate import Accelerator, DataLoaderConfiguration, PartialState
from accelerate.utils import (
    DDPCommunicationHookType,
    DistributedDataParallelKwargs,
    DistributedType,
    FullyShardedDataParallelPlugin,
    ProjectConfiguration,
    TorchDynamoPlugin,
    broadcast_object_list,
    gather_object,
    parse_flag_from_env,
    set_seed,
)

from trainscope.core import environment, precision
from trainscope.core.errors import UserError
from trainscope.core.liveness import PeerWatch
from trainscope.core.record_view import option_words
from trainscope.run import checkpoints, overrides, trackers
from trainscope.run.options import RunOptions
from trainscope.run.overrides import eager_random_numbers

FIXED_S, FIXED_SHARE = 1.0, 0.02  # trainscope's own work's budget on a warm cache: max(1 s, 2% of the run)


@dataclass
class OwnCost:
    """What trainscope's own work cost the run, seconds, each part timed at the events that bound it: start-up (the
    prediction, the run's attach and opening), after the loop (what the summary measures), writing (the record's
    writes; its last, which carries these figures, not among them). `began`: the run's start."""

    began: float = field(default_factory=time.perf_counter)
    start_s: float = 0.0
    after_loop_s: float = 0.0
    writing_s: float = 0.0
    nested_s: float = 0.0  # seconds of the blocks timed so far, nested ones included once

    @contextlib.contextmanager
    def timing(self, part: str | None):
        """Add the block's seconds to `part` (None: to none, what the run asked for: a checkpoint loaded to resume),
        less the blocks timed inside it (the record's writes are writing's)."""
        began, nested = time.perf_counter(), self.nested_s
        try:
            yield
        finally:
            spent = time.perf_counter() - began
            if part is not None:
                setattr(self, part, getattr(self, part) + spent - (self.nested_s - nested))
            self.nested_s = nested + spent

    def block(self) -> dict:
        """The record's `instrument.cost_s`: each part, their total, the run's wall time so far and the share."""
        total, run = self.start_s + self.after_loop_s + self.writing_s, time.perf_counter() - self.began
        parts = {"start_s": self.start_s, "after_loop_s": self.after_loop_s, "writing_s": self.writing_s}
        return {**parts, "total_s": total, "run_s": run, "budget_s": max(FIXED_S, FIXED_SHARE * run)}


@dataclass
class Startup:
    """What start-up found and decided, for the rest of the run."""

    state: PartialState
    settings: RunOptions  # the run's options: train.py's Settings (which extend them), or trainscope.Run's
    threads: dict
    run_dir: Path
    # what start-up found for the record's environment: the CPU fallback of a multi-process launch without a usable
    # GPU and the process group's set-up (train.py's start-up; the classifier adds its sequence limit)
    facts: dict = field(default_factory=dict)
    watch: PeerWatch | None = None  # peers' heartbeats and errors through the launcher's store (several processes)
    resume_from: Path | None = None  # the checkpoint --resume continues from, chosen and checked at start
    checkpoints_skipped: list = field(default_factory=list)  # newer checkpoints found unusable ({checkpoint, problem})
    cost: OwnCost = field(default_factory=OwnCost)  # what trainscope's own work has cost the run so far


def configure_process(settings) -> dict:
    """Threads and tokenizer parallelism of a process that measures speed; returns the thread facts. On an
    accelerator (one this launch will use) --threads auto keeps a core for each DataLoader worker."""
    # tokenizers' own threads would fight DataLoader workers for the same cores
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    accelerator = environment.accelerator_available() and not parse_flag_from_env("ACCELERATE_USE_CPU")
    return environment.apply_thread_budget(settings.threads, workers=settings.num_workers, accelerator=accelerator)


def start(settings, exists: str) -> Startup:
    """train.py's start-up (through trainscope.classifier.start), `settings` its Settings: the CPU fallback of a
    multi-process launch, the process group, the peers' watch, threads, seed, TF32, the run folder (`exists`: what to
    do where it exists already, in train.py's words)."""
    fallback = cpu_fallback()
    state, group = open_process_group(settings, cpu=parse_flag_from_env("ACCELERATE_USE_CPU"))
    watch = PeerWatch.start(state)  # from here a rank that fails is named by its peers, with its error
    environment.refuse_independent_runs(state.num_processes)
    threads = configure_process(settings)
    set_seed(settings.seed)
    precision.enforce_tf32(settings.tf32)
    facts = {"cpu_fallback": fallback, "process_group": group or None}
    names, writes = (settings.model, settings.dataset), not settings.predict
    return open_run_folder(settings, state, names, exists, threads=threads, facts=facts, watch=watch, writes=writes)


def attach(options: RunOptions, accelerator: Accelerator, model_name: str, exists: str) -> Startup:
    """Start-up for a loop whose Accelerator already exists (trainscope.Run): the peers' watch, the threads (changed
    only when `threads` says so: `launcher` keeps what the process has), the run folder. Seeds, TF32 and the process
    group stay the loop's own."""
    state = PartialState()  # the Accelerator's (a shared state)
    watch = PeerWatch.start(state)
    environment.refuse_independent_runs(state.num_processes)
    threads = environment.apply_thread_budget(options.threads, workers=0, accelerator=accelerator.device.type != "cpu")
    return open_run_folder(options, state, (model_name,), exists, threads=threads, watch=watch)


def open_run_folder(options: RunOptions, state: PartialState, names: tuple, exists: str, writes=True, **facts):
    """The run folder, named alike on every process (on several machines first checked to be one they share, for
    checkpoints), and with --resume the checkpoint to continue: what `start` and `attach` both end with. `names`: what
    a run folder's default name begins with (the model's, the dataset's); `writes`: False where the run writes
    nothing (train.py --predict)."""
    options = overrides.settings(options)  # what `trainscope tune` set from outside the script (its seed set here)
    refuse_unshared_checkpoints(options, state)
    run_dir = resolve_run_dir(options, state, names, exists, writes)
    started = Startup(state, options, run_dir=run_dir, **facts)
    if options.resume:
        started.resume_from, started.checkpoints_skipped = choose_checkpoint(run_dir, state)
    return started


# The process group's backend where Accelerate's own choice (NCCL on CUDA, gloo on CPU processes) is not wanted:
# "gloo" lets several processes share one GPU (docs/gpu.md#what-make-gpu-check-does).
BACKEND_ENV = "TRAINSCOPE_DISTRIBUTED_BACKEND"
BACKENDS = ("gloo", "nccl")


def process_group_options(settings: RunOptions, cpu: bool, environ=None) -> dict:
    """What `init_process_group` is given (through PartialState, which creates the group before the Accelerator):
    the --distributed-timeout, the backend where TRAINSCOPE_DISTRIBUTED_BACKEND names one, and on CUDA over NCCL the
    rank's own GPU as `device_id`, which binds the NCCL communicator to it at once instead of guessing at the first
    collective (over gloo no GPU is bound: processes may share one). Nothing for a single process (no group)."""
    environ = os.environ if environ is None else environ
    if environment.launcher_world_size(environ) < 2:
        return {}
    options = {"timeout": timedelta(seconds=settings.distributed_timeout)}
    backend = environ.get(BACKEND_ENV, "").strip().lower() or None
    if backend is not None:
        if backend not in BACKENDS:
            raise UserError(f"{BACKEND_ENV}={environ[BACKEND_ENV]}: one of {', '.join(BACKENDS)}, or unset")
        options["backend"] = backend
    if not cpu and _cuda() and backend in (None, "nccl"):
        # the GPU Accelerate puts this process on (PartialState.set_device: local rank modulo the GPUs it sees), so
        # a launch that shows each process only its own GPU binds cuda:0, not the out-of-range cuda:LOCAL_RANK
        local_rank = int(environ.get("LOCAL_RANK", "0") or 0)
        options["device_id"] = torch.device("cuda", local_rank % torch.cuda.device_count())
    return options


def _cuda() -> bool:
    return torch.cuda.is_available()


# With NCCL, a collective that outlives the timeout is caught by the watchdog thread, which in torchrun's
# workers (it exports TORCH_NCCL_ASYNC_ERROR_HANDLING=1) or by default (3) tears the process down without a
# Python exception: no record would say so. 2 aborts the communicator only, and the error reaches the
# training thread as an exception at its next collective or wait, where the run records `failed`. Another
# value than torchrun's own 1 (0 or 3) is the user's and is kept.
NCCL_ERROR_HANDLING = "2"
LAUNCHER_NCCL_ERROR_HANDLING = ("", "1")


def open_process_group(settings: RunOptions, cpu: bool, environ=None) -> tuple[PartialState, dict]:
    """Accelerate's process state, its group opened with our options; returns it and what the record says of it."""
    environ = os.environ if environ is None else environ
    options = process_group_options(settings, cpu, environ)
    if "device_id" in options and environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING", "") in LAUNCHER_NCCL_ERROR_HANDLING:
        environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] = NCCL_ERROR_HANDLING
    state = PartialState(cpu=cpu, **options)  # as Accelerator() reads it; the Accelerator reuses this group
    shared = share_device(state)
    facts = {}
    if options:
        facts = {
            "timeout_s": settings.distributed_timeout,
            "device_id": str(options["device_id"]) if "device_id" in options else None,
            "nccl_async_error_handling": environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING")
            if "device_id" in options
            else None,
            "shared_device": shared,
        }
    return state, facts


def share_device(state: PartialState) -> dict | None:
    """Where processes share a GPU, the state's local process index made the index of the GPU it runs on; returns
    the launcher's local rank and that device, or None where each process has the GPU of its local rank. Why:
    docs/gpu.md#what-make-gpu-check-does (Accelerate names cuda:<local rank> in its barriers and DDP's device_ids)."""
    device = state.device
    if device is None or device.type != "cuda" or device.index in (None, state.local_process_index):
        return None
    local_rank = state.local_process_index
    state.local_process_index = device.index  # the shared state: every PartialState, and the AcceleratorState after
    return {"local_rank": local_rank, "device": str(device)}


def refuse_unshared_checkpoints(settings: RunOptions, state: PartialState, environ=None) -> None:
    """On several machines, checkpoints need --output-dir on a filesystem they all share: each rank writes its
    part of one folder, and --resume reads every part. Checked at start: the main process writes a marker that
    every rank must see. Every rank refuses alike (before any other step that could make them disagree)."""
    if environment.machine_count(environ) < 2 or state.num_processes < 2:
        return
    if not (settings.save_every or settings.save_on_interrupt or settings.resume):
        return
    output = Path(settings.output_dir)
    shared = [f".trainscope-shared-{uuid.uuid4().hex}", str(output.absolute())]
    broadcast_object_list(shared)  # the main process's marker, and its folder as it names it
    marker, created = output / shared[0], not output.exists()
    if state.is_main_process:
        output.mkdir(parents=True, exist_ok=True)
        marker.touch()
    state.wait_for_everyone()
    seen = gather_object([(state.process_index, socket.gethostname(), _appears(marker))])
    state.wait_for_everyone()
    if state.is_main_process:
        marker.unlink(missing_ok=True)
        if created:
            with contextlib.suppress(OSError):
                output.rmdir()
    blind = [f"rank {rank} on {host}" for rank, host, sees in seen if not sees]
    if blind:
        flags = "/".join(
            option_words(name) for name in ("save_every", "save_on_interrupt", "resume") if getattr(settings, name)
        )
        raise UserError(
            f"{flags} on several machines needs --output-dir on a filesystem they all share: "
            f"{', '.join(blind)} cannot see {shared[1]} as the main process writes it (each machine "
            "would keep only its own part of a checkpoint)"
        )


SHARED_WAIT_S = 5.0  # a network filesystem may show another machine's new file a moment late


def _appears(path: Path) -> bool:
    deadline = time.monotonic() + SHARED_WAIT_S
    while not path.exists():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.2)
    return True


def choose_checkpoint(run_dir: Path, state: PartialState) -> tuple[Path, list]:
    """The checkpoint --resume continues from, checked on every rank before any data or model is loaded;
    the newer ones found unusable are said, and removed once every rank has chosen."""
    directory, skipped = checkpoints.choose(run_dir, state.num_processes)
    state.wait_for_everyone()
    if state.is_main_process:
        checkpoints.remove_unusable(run_dir, skipped)
    return directory, skipped


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
    fsdp = environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true"
    return {
        "processes": processes,
        "requested_precision": environ.get("ACCELERATE_MIXED_PRECISION", "no"),
        "fsdp_requested": fsdp,
        "fsdp_on_cpu": fsdp and environ.get(FSDP_ON_CPU) == "1",
        "reason": "no usable GPU or other accelerator",
    }


# Set to 1: an FSDP config's run on CPU processes is FSDP2 over gloo, not DDP (docs/gpu.md#fsdp2-without-a-gpu).
FSDP_ON_CPU = "TRAINSCOPE_FSDP_ON_CPU"


def force_fsdp_on_cpu(accelerator: Accelerator) -> None:
    """The Accelerator's state made an FSDP one, its plugin read from the launcher's environment as Accelerate reads
    it, the run's precision on it (AcceleratorState.__init__'s FSDP branch, which a CPU state skips)."""
    plugin = FullyShardedDataParallelPlugin()
    if accelerator.state.mixed_precision != "no":
        plugin.set_mixed_precision(accelerator.state.mixed_precision)
    accelerator.state.distributed_type = DistributedType.FSDP
    accelerator.state.fsdp_plugin = plugin
    PartialState._shared_state["distributed_type"] = DistributedType.FSDP  # as AcceleratorState.__init__ mirrors it


def resolve_run_dir(options: RunOptions, state: PartialState, names: tuple, exists: str, writes=True) -> Path:
    """runs/<run-name>, named the same on every process, checked (not created) before any work; `names`, `exists`,
    `writes` as `open_run_folder` takes them."""
    name = options.run_name
    if name is None:
        stamp = [datetime.now().strftime("%Y%m%d-%H%M%S")]
        broadcast_object_list(stamp)  # the main process's clock names the run for everybody
        parts = [part.rstrip("/").split("/")[-1].split(":")[-1] for part in names]
        parts[1:] = [part.split(".")[0].split("?")[0] for part in parts[1:]]  # a data file's or URL's stem
        precision_name = os.environ.get("ACCELERATE_MIXED_PRECISION", "no").replace("no", "fp32")
        name = "-".join([*parts, precision_name, f"{state.num_processes}p", stamp[0]])
    run_dir = Path(options.output_dir) / name
    if not writes:  # nothing is written: an existing run of the same name is no obstacle
        return run_dir
    if options.resume:
        if not any((run_dir / "checkpoints").glob("step_*")):
            raise UserError(f"--resume: {run_dir} has no checkpoint (was it run with --save-every, or save_every=?)")
    elif _exists_on_main(run_dir):
        if not options.overwrite:
            raise UserError(f"{run_dir} already exists: {exists}")
        state.wait_for_everyone()
        if state.is_main_process:
            shutil.rmtree(run_dir)
    return run_dir


def _exists_on_main(run_dir: Path) -> bool:
    """Whether the run folder exists, as the main process saw it before any rank went on: a rank that looks later
    would see the folder the main process has made for this very run since."""
    seen = [run_dir.exists()]
    broadcast_object_list(seen)
    return seen[0]


def ddp_kwargs(settings) -> DistributedDataParallelKwargs:
    """The DDP flags of --ddp-*; the compression hook is registered by trainscope.measure.communication.measured."""
    options = {
        "gradient_as_bucket_view": settings.ddp_gradient_as_bucket_view,
        "static_graph": settings.ddp_static_graph,
        "find_unused_parameters": settings.ddp_find_unused_parameters,
        "comm_hook": DDPCommunicationHookType.NO,
    }
    if settings.ddp_bucket_cap_mb is not None:
        options["bucket_cap_mb"] = settings.ddp_bucket_cap_mb
    return DistributedDataParallelKwargs(**options)


def build_accelerator(settings, started: Startup) -> Accelerator:
    """The Accelerator for this run; topology and precision come from the launch's config."""
    on_cuda = started.state.device.type == "cuda"
    accelerator = Accelerator(
        gradient_accumulation_steps=settings.gradient_accumulation_steps,
        log_with=trackers.trackers_for(settings.report_to) or None,
        project_config=ProjectConfiguration(
            project_dir=str(started.run_dir), logging_dir=str(started.run_dir / "tensorboard")
        ),
        dataloader_config=DataLoaderConfiguration(
            use_seedable_sampler=True, data_seed=settings.seed, non_blocking=pin_memory(settings, on_cuda)
        ),
        # dynamic shapes: with dynamic padding every new sequence length would recompile otherwise
        # (accelerate launch exports dynamic=False); one fixed shape with --pad-to-max-length. --compile-mode
        # reduce-overhead: CUDA graphs of the model's forward and backward (the optimizer steps eagerly outside them)
        dynamo_plugin=TorchDynamoPlugin(
            backend="inductor", mode=settings.compile_mode, dynamic=not settings.pad_to_max_length
        )
        if settings.compile
        else None,
        kwargs_handlers=[ddp_kwargs(settings)],
    )
    if (started.facts.get("cpu_fallback") or {}).get("fsdp_on_cpu"):
        force_fsdp_on_cpu(accelerator)
    precision.enforce_tf32(settings.tf32)  # Accelerate's dynamo set-up turns TF32 on for fp32 CUDA runs
    if settings.compile:
        eager_random_numbers()
    return accelerator


def pin_memory(settings, on_cuda: bool) -> bool:
    return on_cuda if settings.pin_memory is None else settings.pin_memory


def device_loader_options(settings, accelerator) -> dict:
    """build_dataloaders' keyword arguments for this device and precision: pinned host memory on CUDA,
    sequences padded to multiples of 8 (tensor-core shapes) in mixed precision on CUDA."""
    on_cuda = accelerator.device.type == "cuda"
    return {
        "pin_memory": pin_memory(settings, on_cuda),
        "pad_to_multiple_of": 8 if on_cuda and accelerator.mixed_precision in ("fp16", "bf16") else None,
    }
