"""torch.profiler over a window of steps, and CUDA memory snapshots, behind one object.

The trace handler writes `*.pt.trace.json` files: TensorBoard's profiler plugin reads the folder
(`tensorboard --logdir runs/<run>/profile`) and each file opens as a Chrome trace in
chrome://tracing or https://ui.perfetto.dev. The timer labels every stage with
`record_function(<stage>)`, so the trace shows data / forward / backward / optimizer / eval spans.
"""

import contextlib
from pathlib import Path

import torch

from trainscope.timing import STAGES

TOP_OPERATORS = 15


class NoProfiler:
    """The do-nothing stand-in when --profile is off: the loop calls it the same way."""

    enabled = False
    top_operators: list = []

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def step(self):
        pass

    def save_memory_snapshot(self):
        return None


class StepProfiler:
    """torch.profiler with a wait / warm-up / active schedule over optimizer steps."""

    enabled = True

    def __init__(self, directory: Path, device: torch.device, wait: int, warmup: int, active: int,
                 memory_snapshot: bool = False, rank: int = 0):
        self.directory = Path(directory)
        self.device = device
        self.rank = rank
        self.top_operators: list[dict] = []
        self.memory_snapshot = memory_snapshot and device.type == "cuda"
        activities = [torch.profiler.ProfilerActivity.CPU]
        if device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        self.profiler = torch.profiler.profile(
            activities=activities,
            schedule=torch.profiler.schedule(wait=wait, warmup=warmup, active=active, repeat=1),
            on_trace_ready=self._trace_ready,
            record_shapes=True,
            profile_memory=True,
            with_stack=False,
        )

    def __enter__(self):
        self.directory.mkdir(parents=True, exist_ok=True)
        if self.memory_snapshot:
            torch.cuda.memory._record_memory_history(max_entries=100_000)
        self.profiler.__enter__()
        return self

    def __exit__(self, *exc):
        return self.profiler.__exit__(*exc)

    def step(self):
        self.profiler.step()

    def _trace_ready(self, profiler):
        torch.profiler.tensorboard_trace_handler(str(self.directory), worker_name=f"rank{self.rank}")(profiler)
        self.top_operators = top_operators(profiler.key_averages(), self.device)

    def save_memory_snapshot(self) -> Path | None:
        """Write the CUDA allocator history (open it at https://pytorch.org/memory_viz)."""
        if not self.memory_snapshot:
            return None
        path = self.directory / f"memory_snapshot_rank{self.rank}.pickle"
        torch.cuda.memory._dump_snapshot(str(path))
        torch.cuda.memory._record_memory_history(enabled=None)
        return path


def top_operators(averages, device: torch.device, limit: int = TOP_OPERATORS) -> list[dict]:
    """The operators with the most self time on the device (CUDA) or on the CPU, in seconds."""
    on_device = device.type == "cuda"
    rows = []
    for event in averages:
        device_us = getattr(event, "self_device_time_total", None)
        if device_us is None:
            device_us = getattr(event, "self_cuda_time_total", 0)
        rows.append({
            "name": event.key,
            "calls": event.count,
            "self_cpu_s": event.self_cpu_time_total / 1e6,
            "self_device_s": device_us / 1e6 if on_device else None,
        })
    key = "self_device_s" if on_device else "self_cpu_s"
    # the stage labels (record_function spans) and the step markers are not operators
    rows = [r for r in rows if not r["name"].startswith("ProfilerStep") and r["name"] not in STAGES]
    return sorted(rows, key=lambda r: r[key] or 0.0, reverse=True)[:limit]


def build_profiler(settings, run_dir: Path, device: torch.device, rank: int):
    if not settings.profile:
        return NoProfiler()
    return StepProfiler(run_dir / "profile", device, settings.profile_wait, settings.profile_warmup,
                        settings.profile_active, settings.memory_snapshot, rank)


@contextlib.contextmanager
def labelled(stage: str):
    with torch.profiler.record_function(stage):
        yield
