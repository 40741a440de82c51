"""Stage timing: `with timer("forward"): ...`, charging every second of a run to exactly one stage.

How it works: docs/timing.md#in-the-code-the-stage-timer-trainscopemeasuretimingpy.
"""

import time
from collections import defaultdict, deque
from contextlib import contextmanager

import torch

from trainscope.core.paths import GIB
from trainscope.measure.memory import CudaMemoryProbe

STAGES = ("data", "forward", "backward", "optimizer", "eval")
ALL_STAGES = (*STAGES, "other")
# The five categories a breakdown is often asked in (data loading, forward, loss and backward, evaluation, other),
# derived exactly from the stages.
CATEGORIES = {
    "data loading": ("data",),
    "forward": ("forward",),
    "loss+backward": ("backward",),
    "evaluation": ("eval",),
    "other": ("optimizer", "other"),
}
# warmup: the first --timing-warmup-steps; snapshot: steps a CUDA memory snapshot records (slower, kept apart);
# steady: the rest, where throughput comes from.
PHASES = ("warmup", "steady", "snapshot")


class HostClock:
    """perf_counter marks, optionally after a device synchronize (the `sync` mode): read at once."""

    immediate = True

    def __init__(self, synchronize=None):
        self.synchronize = synchronize

    def mark(self):
        if self.synchronize is not None:
            self.synchronize()
        return time.perf_counter()

    @staticmethod
    def elapsed(start, end) -> float:
        return end - start

    @staticmethod
    def ready(mark) -> bool:
        return True

    @staticmethod
    def wait(mark) -> None:
        pass


class EventClock:
    """Device events recorded on the current stream; elapsed times read once they completed."""

    immediate = False

    def __init__(self, device: torch.device):
        self.device = device

    def mark(self):
        event = torch.Event(device=self.device, enable_timing=True)
        event.record()
        return event

    @staticmethod
    def elapsed(start, end) -> float:
        return start.elapsed_time(end) / 1000.0  # milliseconds -> seconds

    @staticmethod
    def ready(mark) -> bool:
        return mark.query()

    @staticmethod
    def wait(mark) -> None:
        mark.synchronize()


def synchronizer(device: torch.device):
    """The device's synchronize function, or None where work is synchronous (CPU)."""
    if device.type == "cpu":
        return None
    module = getattr(torch, device.type)
    return lambda: module.synchronize(device)


def make_clock(mode: str, device: torch.device):
    """Returns (clock, effective mode). A CPU always gets the host clock: nothing is asynchronous."""
    if mode not in ("sync", "events"):
        raise ValueError(f"unknown timing mode {mode!r}: use 'sync' or 'events'")
    if device.type == "cpu":
        return HostClock(), "host"
    if mode == "sync":
        return HostClock(synchronizer(device)), "sync"
    return EventClock(device), "events"


class Nvtx:
    """NVTX ranges on CUDA (visible in Nsight Systems); a do-nothing stand-in elsewhere."""

    def __init__(self, device: torch.device, push=None, pop=None):
        enabled = device.type == "cuda" or push is not None
        self.push = (push or torch.cuda.nvtx.range_push) if enabled else (lambda name: None)
        self.pop = (pop or torch.cuda.nvtx.range_pop) if enabled else (lambda: None)


class StageTimer:
    """Times stages and the run's wall clock, kept apart from any formatting: `start()`, `with timer("data"): ...`,
    `set_phase("steady")` after the warm-up steps, `stop()`, `summary()`. Misuse raises: a stage inside a stage, an
    unknown stage, timing outside start()/stop()."""

    def __init__(
        self,
        clock=None,
        device: torch.device | None = None,
        memory=None,
        profiler_labels: bool = False,
        nvtx: Nvtx | None = None,
    ):
        self.clock = clock or HostClock()
        self.immediate = getattr(self.clock, "immediate", False)  # a host clock's stages are charged as they end
        self.device = device or torch.device("cpu")
        self._synchronize = synchronizer(self.device)
        # per-stage allocator peaks: a probe with reset() and read() -> (allocated, reserved) bytes;
        # by default CUDA's, none elsewhere; False: none
        if memory is None:
            memory = CudaMemoryProbe(self.device) if self.device.type == "cuda" else False
        self.memory = memory or None
        self.sample_memory = self.memory is not None  # switched per step by the caller (--memory-every)
        self.profiler_labels = profiler_labels  # record_function(<stage>) spans for torch.profiler
        self.nvtx = nvtx or Nvtx(self.device)
        self.phase = PHASES[0]
        self.stage_seconds = {phase: defaultdict(float) for phase in PHASES}
        self.stage_calls = {phase: defaultdict(int) for phase in PHASES}
        self.wall_seconds = {phase: 0.0 for phase in PHASES}
        self.peak_allocated_bytes = defaultdict(int)  # per stage, max over the sampled steps (CUDA only)
        self.peak_reserved_bytes = defaultdict(int)
        self.run_peak_allocated_bytes = 0
        self.run_peak_reserved_bytes = 0
        self.paused_seconds = 0.0
        self.paused_peak_allocated_bytes = 0
        self._interval = defaultdict(float)
        self._interval_started = None
        self._pending = deque()
        self._active = None
        self._phase_started = None
        self._running = False

    # ---- wall clock
    def _host_now(self) -> float:
        # Boundaries of the wall clock are the one place the events mode waits for the device.
        if self._synchronize is not None:
            self._synchronize()
        return time.perf_counter()

    def start(self):
        if self._running:
            raise RuntimeError("timer already started")
        self._running = True
        self._phase_started = self._interval_started = self._host_now()

    def set_phase(self, phase: str):
        if phase not in PHASES:
            raise ValueError(f"unknown phase {phase!r}: one of {PHASES}")
        if not self._running:
            raise RuntimeError("set_phase() outside start()/stop()")
        if phase == self.phase:
            return
        now = self._host_now()
        self.flush()
        self.wall_seconds[self.phase] += now - self._phase_started
        self.phase, self._phase_started = phase, now

    def stop(self):
        if not self._running:
            raise RuntimeError("stop() without start()")
        if self._active is not None:
            raise RuntimeError(f"stop() inside stage {self._active!r}")
        now = self._host_now()
        self.flush()
        self.wall_seconds[self.phase] += now - self._phase_started
        self._running = False
        self._fold_run_peak()

    @property
    def running(self) -> bool:
        return self._running

    def restore(self, state: dict):
        """Add the totals of an earlier, checkpointed part of the same run (see `state_dict`)."""
        for phase in PHASES:
            self.wall_seconds[phase] += state["wall_seconds"].get(phase, 0.0)
            for stage, seconds in state["stage_seconds"].get(phase, {}).items():
                self.stage_seconds[phase][stage] += seconds
            for stage, calls in state["stage_calls"].get(phase, {}).items():
                self.stage_calls[phase][stage] += calls
        self.phase = state["phase"]

    def state_dict(self) -> dict:
        """Totals so far, with the running phase's wall time up to now (flushes pending events)."""
        now = self._host_now()
        self.flush()
        wall = dict(self.wall_seconds)
        if self._running:
            wall[self.phase] += now - self._phase_started
        return {
            "phase": self.phase,
            "wall_seconds": wall,
            "stage_seconds": {p: dict(s) for p, s in self.stage_seconds.items()},
            "stage_calls": {p: dict(c) for p, c in self.stage_calls.items()},
        }

    @contextmanager
    def paused(self):
        """Time that belongs to no figure (a measurement's own work): the phase's and the step line's wall clocks skip
        it, and on CUDA its allocations stay out of the run's peak (`paused_peak_allocated_bytes`); the peak counter is
        folded into the run's and reset on entry, or the pause would read the backward's peak before it."""
        if self._active is not None:
            raise RuntimeError(f"paused() inside stage {self._active!r}")
        if not self._running:
            raise RuntimeError("paused() outside start()/stop()")
        began = self._host_now()
        self.flush()
        self._fold_run_peak()
        if self.memory is not None:
            self.memory.reset()
        try:
            yield
        finally:
            if self.memory is not None:
                self.paused_peak_allocated_bytes = max(self.paused_peak_allocated_bytes, self.memory.read()[0])
                self.memory.reset()  # the run's own peak goes on from here, without the pause's allocations
            elapsed = self._host_now() - began
            self._phase_started += elapsed
            self._interval_started += elapsed
            self.paused_seconds += elapsed

    # ---- stages
    def __call__(self, stage: str, after=None) -> "Stage":
        """`with timer(stage):`; `after()` is called when the stage has ended (a FLOPs count closed with it)."""
        if stage not in STAGES:
            raise ValueError(f"unknown stage {stage!r}: one of {STAGES} ('other' is what is left)")
        if not self._running:
            raise RuntimeError(f"stage {stage!r} timed outside start()/stop()")
        if self._active is not None:
            raise RuntimeError(f"stage {stage!r} started inside stage {self._active!r}: stages do not nest")
        return Stage(self, stage, after)

    def set_memory_sampling(self, on: bool):
        """Sample per-stage peaks from now on (or stop). Switching on first folds the peak of the
        unsampled steps since the last reset into the whole-run peak (one read)."""
        if self.memory is None:
            return
        if on and not self.sample_memory:
            self._fold_run_peak()
        self.sample_memory = on

    def _fold_run_peak(self):
        if self.memory is not None:
            allocated, reserved = self.memory.read()
            self.run_peak_allocated_bytes = max(self.run_peak_allocated_bytes, allocated)
            self.run_peak_reserved_bytes = max(self.run_peak_reserved_bytes, reserved)

    def _record_memory(self, stage: str, allocated: int, reserved: int):
        self.peak_allocated_bytes[stage] = max(self.peak_allocated_bytes[stage], allocated)
        self.peak_reserved_bytes[stage] = max(self.peak_reserved_bytes[stage], reserved)
        self.run_peak_allocated_bytes = max(self.run_peak_allocated_bytes, allocated)
        self.run_peak_reserved_bytes = max(self.run_peak_reserved_bytes, reserved)

    def _charge(self, phase: str, stage: str, seconds: float) -> None:
        self.stage_seconds[phase][stage] += seconds
        self.stage_calls[phase][stage] += 1
        self._interval[stage] += seconds

    def _resolve(self, block: bool):
        while self._pending:
            phase, stage, begin, end = self._pending[0]
            if not self.clock.ready(end):
                if not block:
                    return
                self.clock.wait(end)
            self._pending.popleft()
            self._charge(phase, stage, self.clock.elapsed(begin, end))

    def flush(self):
        """Resolve every pending stage, waiting for the device if it has to (log steps, end of run)."""
        self._resolve(block=True)

    def take_interval(self) -> dict:
        """{stage_s: stage seconds, wall_s: wall seconds} since the last call (or start), from this one
        clock; for per-step log lines. Flushes first."""
        now = self._host_now()
        self.flush()
        interval = {
            "stage_s": {stage: self._interval.get(stage, 0.0) for stage in STAGES},
            "wall_s": now - self._interval_started,
        }
        self._interval.clear()
        self._interval_started = now
        return interval

    # ---- results
    def summary(self) -> dict:
        """Seconds and shares per stage for each phase and for the whole run; shares sum to 1."""
        if self._running:
            raise RuntimeError("summary() before stop()")
        phases = {phase: stage_table(self.stage_seconds[phase], self.wall_seconds[phase]) for phase in PHASES}
        total = defaultdict(float)
        for phase in PHASES:
            for stage in STAGES:
                total[stage] += self.stage_seconds[phase][stage]
        phases["run"] = stage_table(total, sum(self.wall_seconds.values()))
        return phases

    def memory_summary(self) -> dict:
        """Per-stage and whole-run device memory peaks in GiB (empty without a probe, as on a CPU)."""
        if self.memory is None:
            return {}
        return {
            "stage_peak_allocated_gib": {s: b / GIB for s, b in self.peak_allocated_bytes.items()},
            "stage_peak_reserved_gib": {s: b / GIB for s, b in self.peak_reserved_bytes.items()},
            "max_allocated_gib": self.run_peak_allocated_bytes / GIB,
            "max_reserved_gib": self.run_peak_reserved_bytes / GIB,
            "measurement_peak_allocated_gib": self.paused_peak_allocated_bytes / GIB,
        }


class Stage:
    """One `with timer(stage):`, a plain context manager (a generator's costs several times as much a call, every
    stage of every step). A host clock's seconds are charged when the stage ends; device events wait in the timer's
    queue until they complete."""

    __slots__ = ("timer", "stage", "after", "sampling", "label", "begin")

    def __init__(self, timer: StageTimer, stage: str, after=None):
        self.timer, self.stage, self.after = timer, stage, after

    def __enter__(self):
        timer, stage = self.timer, self.stage
        timer._active = stage
        self.sampling = timer.memory is not None and timer.sample_memory
        if self.sampling:
            timer.memory.reset()
        timer.nvtx.push(stage)
        self.label = torch.profiler.record_function(stage) if timer.profiler_labels else None
        self.begin = timer.clock.mark()
        if self.label is not None:
            self.label.__enter__()
        return self

    def __exit__(self, *exc) -> bool:
        timer, stage = self.timer, self.stage
        if self.label is not None:
            self.label.__exit__(*exc)
        end = timer.clock.mark()
        timer.nvtx.pop()
        if self.sampling:
            timer._record_memory(stage, *timer.memory.read())
        timer._active = None
        if timer.immediate:
            timer._charge(timer.phase, stage, end - self.begin)
        else:
            timer._pending.append((timer.phase, stage, self.begin, end))
            timer._resolve(block=False)
        if self.after is not None:
            self.after()
        return False


def stage_table(stage_seconds: dict, wall_seconds: float) -> dict:
    """{wall_s, seconds: {stage: s, other: s}, shares: {stage: fraction}, categories: {...}}: `other` is wall less
    the stages, shares are of wall time (all zero for an empty wall)."""
    seconds = {stage: float(stage_seconds.get(stage, 0.0)) for stage in STAGES}
    seconds["other"] = wall_seconds - sum(seconds.values())
    shares = {stage: (value / wall_seconds if wall_seconds > 0 else 0.0) for stage, value in seconds.items()}
    categories = {name: sum(seconds[s] for s in stages) for name, stages in CATEGORIES.items()}
    return {"wall_s": wall_seconds, "seconds": seconds, "shares": shares, "category_seconds": categories}
