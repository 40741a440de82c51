"""torch.profiler over a window of steps (its traces, top operators and where the gap to the peak goes), and CUDA
memory snapshots over a window of steps. How to read them: docs/timing.md#the-profiler.
"""

import contextlib
import os
import pickle
from pathlib import Path

import torch
from torch.profiler import record_function

from trainscope.core.precision import autocast_dtype
from trainscope.measure import gap, peak
from trainscope.measure.communication.agreement import from_trace
from trainscope.measure.layers import longest_module_list
from trainscope.measure.memory import is_sharded
from trainscope.measure.timing import STAGES

TOP_OPERATORS = 15
# kineto's levels: VERBOSE 0 ... ERROR 3, STAGE 4, USDT 5; 6 keeps every one of them off stderr
KINETO_QUIET = 6


class NoProfiler:
    """The do-nothing stand-in when --profile is off: the loop calls it the same way."""

    enabled = False
    top_operators: list = []
    breakdown = None
    communication = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def step(self):
        pass


class StepProfiler:
    """torch.profiler with a wait / warm-up / active schedule over optimizer steps."""

    enabled = True

    def __init__(self, directory: Path, device: torch.device, wait: int, warmup: int, active: int, rank: int = 0):
        self.directory = Path(directory)
        self.device = device
        self.rank = rank
        self.top_operators: list[dict] = []
        self.breakdown: dict | None = None  # self time per category and the matmuls' FLOPs (trainscope.measure.gap)
        self.communication = None  # what the trace says of DDP's all-reduces (communication.agreement.from_trace)
        self.window = {"first_step": wait + warmup + 1, "last_step": wait + warmup + active}
        self.profiler = torch.profiler.profile(
            activities=_activities(device),
            schedule=torch.profiler.schedule(wait=wait, warmup=warmup, active=active, repeat=1),
            on_trace_ready=self._trace_ready,
            record_shapes=True,
            profile_memory=True,
            with_flops=True,  # the matmuls' FLOPs, from their shapes: the floor of the gap to the measured peak
            with_stack=False,
        )

    def __enter__(self):
        self.directory.mkdir(parents=True, exist_ok=True)
        self.profiler.__enter__()
        return self

    def __exit__(self, *exc):
        return self.profiler.__exit__(*exc)

    def step(self):
        self.profiler.step()

    def _trace_ready(self, profiler):
        torch.profiler.tensorboard_trace_handler(str(self.directory), worker_name=f"rank{self.rank}")(profiler)
        self.top_operators = top_operators(profiler.key_averages(), self.device)
        self.breakdown = gap.categorize(profiler.events(), self.device.type == "cuda", STAGES)

        found = from_trace(profiler.events())  # per traced `backward` span, in order
        self.communication = {**self.window, **found} if found else None


def top_operators(averages, device: torch.device, limit: int = TOP_OPERATORS) -> list[dict]:
    """The operators with the most self time on the device (CUDA) or on the CPU, in seconds. Device events (kernels,
    copies, memsets) are left out: their time is already their operator's self device time."""
    on_device, rows = device.type == "cuda", []
    for event in averages:
        if str(getattr(event, "device_type", "CPU")).endswith("CPU"):
            cpu_s = event.self_cpu_time_total / 1e6
            device_s = event.self_device_time_total / 1e6 if on_device else None
            rows.append({"name": event.key, "calls": event.count, "self_cpu_s": cpu_s, "self_device_s": device_s})
    key = "self_device_s" if on_device else "self_cpu_s"
    # the stage labels (record_function spans) and the step markers are not operators
    rows = [r for r in rows if not r["name"].startswith("ProfilerStep") and r["name"] not in STAGES]
    return sorted(rows, key=lambda r: r[key] or 0.0, reverse=True)[:limit]


def build_profiler(settings, run_dir: Path, device: torch.device, rank: int):
    if not settings.profile:
        return NoProfiler()
    return StepProfiler(
        run_dir / "profile", device, settings.profile_wait, settings.profile_warmup, settings.profile_active, rank
    )


class MemorySnapshot:
    """The CUDA allocator history over the `steps` optimizer steps after step `after_step` (the end of the timing
    warm-up), taken into memory, pickled to `path` by `finish` after the timed loop (docs/timing.md#the-memory-snapshot).
    `backend` is torch.cuda.memory (a stand-in in tests)."""

    def __init__(self, path: Path, after_step: int, steps: int, backend=None):
        self.path = Path(path)
        self.start_after, self.steps = after_step, steps
        self.backend = backend if backend is not None else torch.cuda.memory
        self.window = None
        self._recording = False
        self._taken = None

    def covers(self, step: int) -> bool:
        return self.start_after < step <= self.start_after + self.steps

    def step_finished(self, step: int) -> None:
        if step == self.start_after and self.window is None:
            # Python frames only: with C++ frames (the default "all") _snapshot() symbolizes every one of them, which
            # takes minutes against seconds (pytorch.org/docs/stable/torch_cuda_memory.html)
            self.backend._record_memory_history(max_entries=100_000, stacks="python")
            self._recording = True
            self.window = {"first_step": step + 1, "last_step": None}
        elif self._recording and step == self.start_after + self.steps:
            self._take(step)

    def finish(self, last_step: int) -> dict | None:
        """Stop recording if the run ended inside the window, and write the snapshot (after the timed loop)."""
        if self._recording:
            self._take(last_step)
        if self._taken is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with open(self.path, "wb") as handle:
                pickle.dump(self._taken, handle)  # what torch.cuda.memory._dump_snapshot writes
            self._taken = None
        return {**self.window, "path": str(self.path)} if self.window and self.window["last_step"] else None

    def _take(self, step: int) -> None:
        self._taken = self.backend._snapshot()
        self.backend._record_memory_history(enabled=None)
        self._recording = False
        self.window["last_step"] = step


class NoSnapshot:
    """The do-nothing stand-in without --memory-snapshot or off CUDA."""

    window = None

    def covers(self, step: int) -> bool:
        return False

    def step_finished(self, step: int) -> None:
        pass

    def finish(self, last_step: int) -> None:
        return None


def build_memory_snapshot(settings, run_dir: Path, device: torch.device, rank: int):
    if not (settings.memory_snapshot and device.type == "cuda"):
        return NoSnapshot()
    return MemorySnapshot(
        run_dir / "memory" / f"snapshot_rank{rank}.pickle", settings.timing_warmup_steps, settings.memory_snapshot_steps
    )


@contextlib.contextmanager
def quiet_kineto():
    """kineto's start and stop lines kept off stderr for a probe no one asked for. kineto reads its level once, at the
    process's first profiler: this quiets it only if this is the first; a level the user set stays."""
    if "KINETO_LOG_LEVEL" in os.environ:
        yield
        return
    os.environ["KINETO_LOG_LEVEL"] = str(KINETO_QUIET)
    try:
        yield
    finally:
        os.environ.pop("KINETO_LOG_LEVEL", None)


def layer_breakdown(model, batch: int, length: int, precision_name: str, device: torch.device) -> dict | None:
    """One encoder layer's forward and backward at the run's shapes, profiled apart in training mode and the run's
    precision (self time per category: trainscope.measure.gap.categorize): where a run's time goes without --profile.
    A copy of the layer, a private generator, the random state forked: the run is untouched. None when the model has
    no repeated block that takes hidden states alone (or it fails on them)."""
    import copy

    layer = (longest_module_list(model) or [None])[0]  # the first of its repeated blocks
    width = next((m.in_features for m in layer.modules() if isinstance(m, torch.nn.Linear)), None) if layer else None
    if width is None or any(is_sharded(p) for p in layer.parameters()):  # FSDP2: a copy would gather its shards
        return None
    dtype = autocast_dtype(precision_name)

    def profiled() -> dict:  # its tensors are freed when it returns
        generator = torch.Generator(device=device).manual_seed(0)
        hidden = torch.randn(batch, length, width, device=device, generator=generator, requires_grad=True)
        probe = copy.deepcopy(layer).to(device).train()

        def step():
            with (
                record_function("forward"),
                torch.autocast(device.type, dtype=dtype) if dtype else contextlib.nullcontext(),
            ):
                out = probe(hidden)
                out = out[0] if isinstance(out, tuple) else out
            with record_function("backward"):
                out.float().sum().backward()

        step()  # warm-up: kernels chosen, memory allocated
        with quiet_kineto(), torch.profiler.profile(activities=_activities(device), with_flops=True) as profiler:
            step()
            peak.synchronize(device)
        return gap.categorize(profiler.events(), device.type == "cuda", ("forward", "backward"))

    try:
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            found = profiled()
    except (RuntimeError, TypeError, ValueError):  # a block that wants more than hidden states (or FSDP shards)
        return None
    finally:
        if device.type == "cuda":
            torch.cuda.empty_cache()  # the copy's blocks back to the device
    return {**found, "batch": batch, "length": length, "width": width, "precision": precision_name}


def _activities(device: torch.device) -> list:
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    return activities


def operator_rows(top_operators: list[dict]) -> list[dict]:
    """The profiler's top operators with their self time in milliseconds (device time on CUDA, else CPU)."""
    seconds = lambda op: op["self_device_s"] if op["self_device_s"] is not None else op["self_cpu_s"]
    return [{"name": op["name"], "calls": op["calls"], "milliseconds": seconds(op) * 1e3} for op in top_operators]
