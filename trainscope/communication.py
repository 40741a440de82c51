"""What DDP communication costs, measured on every synchronizing step of every rank at the events that bound it,
on any backend, and checked in the same run against DDP's own logger and, with --profile, the profiler's trace.

DDP all-reduces gradient buckets during backward: part of the all-reduce hides behind the rest of backward,
part is exposed (backward waits for it). trainscope times each step with its own clock -- `time.perf_counter`
on a CPU, CUDA events on the compute stream on a GPU (`trainscope.timing`'s clocks), the same events DDP's
reducer stamps for its logger (torch/csrc/distributed/c10d/reducer.cpp):

* `compute_end`: the last parameter gradient of the step has been taken by DDP's reducer. A post-hook on every
  parameter's gradient accumulator (its AccumulateGrad node), registered after the reducer's own hook on the
  same node, fires once the reducer has copied the gradient into its bucket (mark_variable_ready) and, for the
  last one, launched the last bucket's all-reduce: where DDP records `backward_compute_end` (in the autograd
  callback that its last mark_variable_ready queues). A per-step countdown over the parameters marks it once
  (one CUDA event per step, not one per parameter); a step in which not every parameter produced a gradient
  (unused parameters) is not measured, and the next step counts the parameters that did.
* `window_start`: the last gradient of DDP's first bucket produced (a post-accumulate-grad hook on each of its
  parameters, which runs inside AccumulateGrad, before the reducer's hook): DDP copies it in and launches that
  bucket's all-reduce next (`backward_comm_start`, stamped before the launch). A stamp after the launch would be
  late by whatever the communication thread takes from a busy core first. The bucket layout is read once, after
  DDP rebuilds its buckets in gradient order (iteration 2, 3 with static_graph).
* `comm_end`: right after `accelerator.backward` returns: DDP's finalize_backward has waited for every bucket
  and copied the averages into `.grad` (`backward_comm_end`). On a GPU the reducer's wait makes the compute
  stream wait for the communication stream, so an event recorded then completes only after the all-reduces.

    exposed = comm_end - compute_end                                   (what backward waits for beyond compute)
    overlap = (compute_end - window_start) / (comm_end - window_start) (the window's share beside compute)

Both are physical by construction (exposed >= 0, overlap in [0, 1]); a step whose clocks say otherwise is
counted as unmeasured, never clamped. Nothing here is a DDP communication hook: the reducer keeps its built-in
C++ all-reduce unless --ddp-comm-hook asks for compression (DDP's own logger then names the hook).

Across ranks, per step: the rank whose exposed time is least arrived last at the all-reduce, and its exposed
time is the communication's exposure; every other rank's excess is its wait for that rank (a straggler, when one
rank is the last in most steps and the others wait more than STRAGGLER_SHARE of a step for it). Only durations
measured on each rank's own clock are compared, so ranks on different hosts are compared correctly.

**Transfer**: after the training loop, outside every timed figure, each of DDP's buckets is all-reduced alone
through DDP's own path (`reducer._run_comm_hook`: the built-in all-reduce, or the registered hook), after a
barrier, --communication-samples times; per bucket and repetition the shortest across ranks (the last to
arrive), the median over repetitions, summed over buckets. hidden share = 1 - exposed / transfer. Under a
compression hook the bare collective of the same elements in fp16/bf16 is timed as well, and the bus bandwidth
(2(N-1)/N x bytes / time, the NCCL tests' definition) comes from it: the link's, not the hook's compress and
decompress.

**Instruments beside it**, paired with trainscope's figures on the same steps, and judged by `agreement`:

* DDP's logger (`_get_ddp_logging_data()`): backward_comm_time - backward_compute_comm_overlap_time per rank
  for each iteration it samples (1-10, then every 100th), read in the next iteration's forward. DDP counts an
  iteration in each forward that will synchronize (grad enabled, not under no_sync): evaluation and the
  no_sync micro-batches of gradient accumulation do not move it, so its iteration k is this process's k-th
  synchronizing step.
* the profiler's trace (--profile): per traced step, on a GPU the time NCCL's last kernel runs past backward's
  last compute kernel on the device's own timestamps, on a CPU the `backward` span's time after its last autograd
  operation, taken on any thread; and the collectives' time, each counted once (`from_trace`).

DDP's logger brackets the same reducer events as trainscope's hooks: its agreement is an implementation check,
held to what pairing the same events resolves (SAME_EVENTS_TOLERANCE_S); the trace and the planted delays of the
tests are the independent instruments (time_tolerance: a share of the quantity, at least the clock's floor).
"""

import contextlib
import functools
import math
import statistics
import time

import torch

from trainscope.errors import UserError
from trainscope.record_view import hidden_share, resolved
from trainscope.timing import EventClock, HostClock, synchronizer

METHOD = "direct"  # per step, at the events that bound it (schema 4); schema 3 records hold a two-pass estimate
# A rank is a straggler when it is the last to arrive in most steps and the others wait more than this share of
# a step for it.
STRAGGLER_SHARE = 0.10
# DDP's runtime logger samples iterations 1-10 and then every DDP_SAMPLE_RATE-th (torch's default).
DDP_ALWAYS_SAMPLED, DDP_SAMPLE_RATE = 10, 100
# Agreement between two instruments, stated before measuring: the 95% interval of the median paired difference
# must lie within +-max(TOLERANCE_SHARE x the quantity, the clock's floor) for the exposed time and within
# +-OVERLAP_TOLERANCE for the overlap share. The floor is what the clock can resolve between independent instruments:
# on the host a descheduled thread moves a stamp by milliseconds on a busy CPU; CUDA events are stamped by the device
# (about a microsecond apart), and a GPU's exposed all-reduce over NVLink is a millisecond or two, so a 15 ms floor
# there would make any two instruments agree.
CONFIDENCE = 0.95
TOLERANCE_SHARE, OVERLAP_TOLERANCE = 0.30, 0.10
TOLERANCE_FLOOR_S = {"host": 0.015, "cuda events": 0.0005}
# DDP's logger stamps the same reducer events as trainscope's hooks (the last gradient taken, finalize's end): their
# agreement checks the implementation, not the quantity, so it is held to what pairing the same events resolves: the
# Python hook's delay after the reducer's C++ one (0.3 ms at most over the committed CPU runs), not TOLERANCE_SHARE.
# The independent instruments are the planted delays (tests) and the profiler's trace.
SAME_EVENTS_TOLERANCE_S = {"host": 0.003, "cuda events": 0.0002}
# On a GPU each timed transfer sample is this many back-to-back collectives between two CUDA events, averaged (as
# nccl-tests times its iterations): one collective between host clocks adds its launch and synchronization.
TRANSFER_ITERATIONS = 10
# All-reduce bus bandwidth (GB/s, per GPU) and per-hop latency (us) that NCCL reaches in practice;
# assumptions for projections (compare_dp.py), set beside the bandwidth measured here (make ddp-cost).
INTERCONNECTS = {
    "nvlink": {"bandwidth_gbs": 350.0, "latency_us": 5.0, "what": "NVLink 4 / NVSwitch (H100 SXM node)"},
    "pcie": {"bandwidth_gbs": 20.0, "latency_us": 10.0, "what": "PCIe Gen4 x16 through the host, no NVLink"},
    "infiniband": {"bandwidth_gbs": 45.0, "latency_us": 8.0, "what": "InfiniBand NDR 400 Gb/s between nodes"},
}
WIRE = {"fp16": torch.float16, "bf16": torch.bfloat16}


def ring_allreduce_seconds(gradient_bytes: float, gpus: int, bandwidth_gbs: float, latency_us: float) -> float:
    """Ring all-reduce time: 2(N-1) steps, each moving 1/N of the buffer over one link.

    T = 2(N-1)/N * S / B + 2(N-1) * alpha   (Patarasuk & Yuan 2009; the NCCL performance notes
    define bus bandwidth the same way). One GPU communicates nothing.
    """
    if gpus <= 1:
        return 0.0
    return 2 * (gpus - 1) / gpus * gradient_bytes / (bandwidth_gbs * 1e9) + 2 * (gpus - 1) * latency_us * 1e-6


def bus_bandwidth_gbs(size_bytes: float, world: int, seconds: float) -> float | None:
    """All-reduce bus bandwidth: 2(N-1)/N x bytes / time (the NCCL tests' busbw, comparable across world sizes)."""
    return 2 * (world - 1) / world * size_bytes / seconds / 1e9 if seconds and seconds > 0 else None


def unwrap_ddp(model):
    """The DistributedDataParallel module of a prepared model, or None. `accelerator.prepare` with --compile
    wraps DDP in torch.compile's OptimizedModule (the DDP module is its `_orig_mod`)."""
    inner = getattr(model, "_orig_mod", model)
    return inner if isinstance(inner, torch.nn.parallel.DistributedDataParallel) else None


def ddp_samples(iteration: int) -> bool:
    """Whether DDP's logger records this iteration (reducer.cpp should_collect_runtime_stats)."""
    return iteration >= 1 and (iteration <= DDP_ALWAYS_SAMPLED or iteration % DDP_SAMPLE_RATE == 0)


class NoCommunication:
    """Single-process runs, FSDP: nothing to measure."""

    def settings_in_effect(self) -> dict | None:
        return None

    def backward(self, synchronizing: bool):
        return contextlib.nullcontext()

    def step_ended(self, step: int, phase: str, paused=None) -> None:
        pass

    def take_interval(self) -> float | None:
        return None

    def rank_summary(self, counts: dict, trace: dict | None = None, final: bool = False) -> dict | None:
        return None


def build(settings, accelerator, model, clock=None):
    """The communication measurement for this run (a do-nothing one where there is nothing to measure)."""
    ddp = unwrap_ddp(model)
    if ddp is None or accelerator.num_processes < 2:
        return NoCommunication()
    if settings.ddp_comm_hook == "bf16" and accelerator.state.backend not in ("nccl", "xccl"):
        raise UserError(
            f"--ddp-comm-hook bf16 needs NCCL (CUDA) or XCCL; {accelerator.state.backend} cannot "
            "all-reduce bf16: use fp16 or none"
        )
    return Communication(settings, accelerator, ddp, settings.measure_communication != "off", clock)


class BackwardStamps:
    """One synchronizing backward's marks: a countdown over the parameters' gradient hooks marks the end of compute
    when the last one fires and the window's start when the last of the first bucket's fires (one mark each: one
    CUDA event each on a GPU); `finish` marks the end of communication right after backward returns."""

    def __init__(self, clock, parameters: int):
        self.clock = clock
        self.expected = parameters  # gradients per step: every trainable parameter, until a step says otherwise
        self.first_bucket: frozenset | None = None  # parameter indices DDP all-reduces first, once known
        self.armed = False
        self.fired, self.first_left, self.compute_end, self.window_start = 0, None, None, None

    def arm(self) -> None:
        self.armed, self.fired = True, 0
        self.first_left = len(self.first_bucket) if self.first_bucket else None
        self.compute_end = self.window_start = None

    def gradient_produced(self, index: int) -> None:
        """A gradient of the first bucket accumulated (before the reducer copies it in)."""
        if self.armed and self.first_left and index in self.first_bucket:
            self.first_left -= 1
            if self.first_left == 0:
                self.window_start = self.clock.mark()

    def gradient_taken(self, index: int) -> None:
        """A gradient taken by DDP's reducer (after it copied it into its bucket, launching the bucket if full)."""
        if not self.armed:  # a no_sync micro-batch, evaluation, or measuring off
            return
        self.fired += 1
        if self.fired == self.expected:
            self.compute_end = self.clock.mark()

    def finish(self) -> dict | None:
        """The step's marks, or None when not every expected gradient arrived exactly once."""
        comm_end = self.clock.mark()
        self.armed = False
        if self.fired != self.expected or self.compute_end is None:
            if self.fired:
                self.expected = self.fired  # unused parameters: the next step counts what this one produced
            return None
        return {"compute_end": self.compute_end, "window_start": self.window_start, "comm_end": comm_end}


def step_times(clock, marks: dict) -> dict:
    """Exposed time, window and overlap of one step from its marks; a step whose clocks run backwards is unmeasured."""
    exposed = clock.elapsed(marks["compute_end"], marks["comm_end"])
    window = overlap = None
    if marks["window_start"] is not None:
        window = clock.elapsed(marks["window_start"], marks["comm_end"])
        beside = clock.elapsed(marks["window_start"], marks["compute_end"])
        overlap = beside / window if window > 0 and 0 <= beside <= window else None
    if exposed < 0:
        return {"exposed_s": None, "window_s": None, "overlap": None, "unphysical": True}
    return {"exposed_s": exposed, "window_s": window, "overlap": overlap}


class Communication:
    def __init__(self, settings, accelerator, ddp, measure: bool, clock=None):
        self.accelerator, self.ddp, self.measure = accelerator, ddp, measure
        self.kind = settings.ddp_comm_hook
        self.repetitions = settings.communication_samples
        device = accelerator.device
        self.synchronize = synchronizer(device) or (lambda: None)
        self.clock = clock or (EventClock(device) if device.type == "cuda" else HostClock())
        self.clock_name = "cuda events" if isinstance(self.clock, EventClock) else "host"
        if self.kind != "none":  # DDP's own compression hook, as the user asked; nothing wraps it
            from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

            hook = {"fp16": default_hooks.fp16_compress_hook, "bf16": default_hooks.bf16_compress_hook}[self.kind]
            ddp.register_comm_hook(state=None, hook=hook)
        self.parameters = [p for p in ddp.parameters() if p.requires_grad]
        self.gradient_bytes = sum(p.numel() * p.element_size() for p in self.parameters)
        self.stamps = BackwardStamps(self.clock, len(self.parameters))
        self.handles = []
        if measure:
            for index, parameter in enumerate(self.parameters):
                # The node's post-hooks run in order of registration: the reducer's (added when DDP was built) first.
                accumulator = torch.autograd.graph.get_gradient_edge(parameter).node
                self.handles.append(accumulator.register_hook(functools.partial(self._gradient_taken, index)))
        self.synchronized = 0  # synchronizing backward passes in this process: DDP's iteration count
        self.current: dict | None = None  # the latest backward's marks, until step_ended names its step
        self.pending: list[tuple[dict, dict]] = []  # steps whose device events have not completed yet
        self.steps: list[dict] = []
        self.ddp_iterations: list[dict] = []
        self.layout: list[dict] | None = None  # DDP's buckets once rebuilt: parameters, numel, element size
        self._interval: list[float] = []

    def _gradient_taken(self, index: int, grad_inputs, grad_outputs) -> None:
        self.stamps.gradient_taken(index)

    def _watch_first_bucket(self) -> None:
        """Hooks on the first bucket's parameters for the window's start, once the layout is known."""
        first = self.layout[0]["parameters"] if self.layout else []
        for index in first:
            hook = functools.partial(lambda i, parameter: self.stamps.gradient_produced(i), index)
            self.handles.append(self.parameters[index].register_post_accumulate_grad_hook(hook))
        self.stamps.first_bucket = frozenset(first) or None

    def settings_in_effect(self) -> dict:
        """The DDP settings read back from the wrapped model (what really reached DDP), with DDP's own name for its
        communication hook (None: the reducer's built-in all-reduce)."""
        return {
            "bucket_cap_mb": self.ddp.bucket_bytes_cap / 2**20,
            "gradient_as_bucket_view": self.ddp.gradient_as_bucket_view,
            "static_graph": self.ddp.static_graph,
            "find_unused_parameters": self.ddp.find_unused_parameters,
            "comm_hook": self.kind,
            "comm_hook_in_ddp": (ddp_logging(self.ddp) or {}).get("comm_hook"),
            "measure_communication": self.measure,
            "transfer_repetitions": self.repetitions if self.measure else 0,
        }

    @contextlib.contextmanager
    def backward(self, synchronizing: bool):
        """Around `accelerator.backward`: a synchronizing pass is DDP's next iteration, measured when asked."""
        if not synchronizing:
            yield
            return
        self.synchronized += 1
        measured = self.measure
        if measured:
            self.stamps.arm()
        marks = None
        try:
            yield
        finally:
            if measured:
                marks = self.stamps.finish()
        self.current = {"iteration": self.synchronized, "marks": marks}

    def step_ended(self, step: int, phase: str, paused=None) -> None:
        """After optimizer step `step` (its phase: warmup, steady, snapshot): file the step's marks, resolve what the
        device has finished (never waiting), read DDP's logger and, once, DDP's rebuilt buckets (`paused`: the
        timer's pause, so the read stays out of every timed figure)."""
        if self.current is not None:
            entry = {"step": step, "iteration": self.current["iteration"], "phase": phase}
            if self.current["marks"] is not None:
                self.pending.append((entry, self.current["marks"]))
            else:
                self.steps.append({**entry, "exposed_s": None, "window_s": None, "overlap": None})
            self.current = None
        self._resolve(block=False)
        self._read_ddp_logger()
        if (
            self.measure
            and self.layout is None
            and (getattr(self.ddp, "_has_rebuilt_buckets", False) or self.synchronized >= 3)
        ):
            with paused() if paused is not None else contextlib.nullcontext():
                self.layout = self._read_buckets()
            self._watch_first_bucket()

    def _resolve(self, block: bool) -> None:
        while self.pending:
            entry, marks = self.pending[0]
            present = [m for m in marks.values() if m is not None]
            if not all(self.clock.ready(m) for m in present):
                if not block:
                    return
                for m in present:
                    self.clock.wait(m)
            self.pending.pop(0)
            times = step_times(self.clock, marks)
            self.steps.append({**entry, **times})
            if times["exposed_s"] is not None:
                self._interval.append(times["exposed_s"])

    def take_interval(self) -> float | None:
        """This rank's exposed communication summed over the steps since the last call (a step line's figure); the
        step line is a sync point already, so the device's events are waited for."""
        if not self.measure:
            return None
        self._resolve(block=True)
        total, self._interval = sum(self._interval), []
        return total

    def _read_ddp_logger(self) -> None:
        """DDP records iteration k's figures in the forward of iteration k + 1: read them once that forward ran."""
        previous = self.synchronized - 1
        if not ddp_samples(previous) or any(d["iteration"] == previous for d in self.ddp_iterations[-1:]):
            return
        data = ddp_logging(self.ddp)
        if data and data.get("iteration") == previous and data.get("comm_s"):
            self.ddp_iterations.append(
                {
                    "iteration": previous,
                    "exposed_s": data["comm_s"] - data["overlap_s"],
                    "comm_s": data["comm_s"],
                    "overlap": data["overlap_s"] / data["comm_s"],
                }
            )

    def _read_buckets(self, buckets=None) -> list[dict]:
        """DDP's buckets in launch order: which parameters, how many elements of which size. The reducer lends them
        with zero-filled buffers (what DDP's join() replays); the buffers are dropped at once."""
        index = {id(p): i for i, p in enumerate(self.parameters)}
        layout = []
        for bucket in buckets if buckets is not None else self.ddp.reducer._get_zeros_like_grad_buckets():
            buffer = bucket.buffer()
            layout.append(
                {
                    "parameters": [index[id(p)] for p in bucket.parameters() if id(p) in index],
                    "numel": buffer.numel(),
                    "element_size": buffer.element_size(),
                }
            )
        return layout

    def barrier(self) -> None:
        self.synchronize()
        torch.distributed.barrier()

    def _timed(self, collective) -> float:
        device_clock = self.clock if self.clock_name == "cuda events" else None
        return time_collective(collective, self.barrier, self.synchronize, device_clock, TRANSFER_ITERATIONS)

    def time_transfer(self) -> dict:
        """Each bucket all-reduced alone through DDP's own path, after a barrier, `repetitions` times (a collective:
        every rank calls it at the same point, after the training loop). Under a compression hook, also the bare
        collective of the same elements in the wire precision, for the link's bandwidth."""
        started = time.perf_counter()
        buckets = self.ddp.reducer._get_zeros_like_grad_buckets()
        self.layout = self._read_buckets(buckets)  # the final layout, whenever the buckets were rebuilt
        bucket_s, collective_s = [], [] if self.kind != "none" else None
        for bucket in buckets:
            bucket_s.append(
                [self._timed(lambda: self.ddp.reducer._run_comm_hook(bucket).wait()) for _ in range(self.repetitions)]  # noqa: B023 (called at once)
            )
            if collective_s is not None:
                wire = torch.zeros(bucket.buffer().numel(), dtype=WIRE[self.kind], device=bucket.buffer().device)
                collective_s.append(
                    [
                        self._timed(lambda: torch.distributed.all_reduce(wire, group=self.ddp.process_group))  # noqa: B023 (called at once)
                        for _ in range(self.repetitions)
                    ]
                )
                del wire
        del buckets
        timed = (
            "each bucket through DDP's built-in all-reduce"
            if self.kind == "none"
            else f"each bucket through the {self.kind} compression hook (compress, all-reduce, decompress); the bus "
            f"bandwidth from the bare all-reduce of the same elements in {self.kind}"
        )
        return {
            "bucket_s": bucket_s,
            "collective_s": collective_s,
            "repetitions": self.repetitions,
            "timed": timed,
            "measurement_s": time.perf_counter() - started,
        }

    def rank_summary(self, counts: dict, trace: dict | None = None, final: bool = False) -> dict:
        """This rank's measurements; `counts` are the loop's {phase: {optimizer_steps, micro_batches}}. `final`: the
        run ended with every rank here, so the transfer is timed now (a collective)."""
        self._resolve(block=True)
        transfer = self.time_transfer() if final and self.measure else None
        wire = WIRE[self.kind].itemsize if self.kind in WIRE else None
        buckets = (
            [
                {
                    "numel": b["numel"],
                    "bytes": b["numel"] * (wire or b["element_size"]),
                    "parameters": len(b["parameters"]),
                }
                for b in self.layout
            ]
            if self.layout
            else None
        )
        return {
            "method": METHOD,
            "measured": self.measure,
            "clock": self.clock_name,
            "comm_hook": self.kind,
            "gradient_bytes": self.gradient_bytes,
            "buckets": buckets,
            "optimizer_steps": sum(c["optimizer_steps"] for c in counts.values()),
            "micro_batches": sum(c["micro_batches"] for c in counts.values()),
            "steps": self.steps,
            "ddp_iterations": self.ddp_iterations,
            "transfer": transfer,
            "trace": trace,
        }


def time_collective(collective, barrier, synchronize, clock=None, iterations: int = TRANSFER_ITERATIONS) -> float:
    """Seconds of one `collective()` after `barrier()`. On the host: one call between synchronizations. With a device
    clock (CUDA events, trainscope.timing.EventClock): one warm-up call, then `iterations` calls back to back between
    two events on the compute stream (each call's wait makes that stream wait for the communication stream),
    averaged: launches queue behind the device's work instead of being timed."""
    barrier()
    if clock is None:
        started = time.perf_counter()
        collective()
        synchronize()
        return time.perf_counter() - started
    collective()  # queued before the start event: the first timed launch waits behind it, not the device for it
    start = clock.mark()
    for _ in range(iterations):
        collective()
    end = clock.mark()
    clock.wait(end)
    return clock.elapsed(start, end) / iterations


def ddp_logging(ddp) -> dict | None:
    """DDP's own runtime figures of its latest sampled iteration (nanoseconds in DDP, seconds here)."""
    try:
        data = ddp._get_ddp_logging_data()
    except (AttributeError, RuntimeError):
        return None
    keys = {
        "backward_comm_time": "comm_s",
        "backward_compute_comm_overlap_time": "overlap_s",
        "backward_compute_time": "backward_compute_s",
        "forward_compute_time": "forward_compute_s",
    }
    facts = {ours: data[theirs] / 1e9 for theirs, ours in keys.items() if theirs in data}
    facts["iteration"] = data.get("iteration")
    facts["comm_hook"] = data.get("comm_hook") or None
    return facts


# ---------------------------------------------------------------- statistics (pure)


def median_interval(values: list[float], confidence: float = CONFIDENCE) -> tuple[float, float] | None:
    """Distribution-free confidence interval of the median: the order statistics x(j), x(n+1-j) with the largest j
    for which P(Binomial(n, 1/2) <= j - 1) <= (1 - confidence) / 2 (Conover, Practical Nonparametric Statistics,
    3rd ed., 1999, section 3.2). None with fewer values than any such interval needs (6 for 95%)."""
    ordered = sorted(values)
    n = len(ordered)
    alpha, below, j = (1 - confidence) / 2, 0.0, 0
    while j < n // 2:
        below += math.comb(n, j) / 2**n  # P(B <= j)
        if below > alpha:
            break
        j += 1
    return (ordered[j - 1], ordered[n - j]) if j >= 1 else None


def agreement(differences: list[float], tolerance: float) -> dict:
    """An equivalence verdict on paired differences (instrument minus reference), tolerance stated beforehand:
    `agree` when the interval of their median lies within +-tolerance, `disagree` when it lies wholly outside,
    `undecided` otherwise (too few pairs, or a spread wider than the tolerance allows to tell)."""
    interval = median_interval(differences)
    if interval is None:
        verdict = "undecided"
    elif -tolerance <= interval[0] and interval[1] <= tolerance:
        verdict = "agree"
    elif interval[0] > tolerance or interval[1] < -tolerance:
        verdict = "disagree"
    else:
        verdict = "undecided"
    return {
        "pairs": len(differences),
        "median_difference": statistics.median(differences) if differences else None,
        "interval": list(interval) if interval else None,
        "tolerance": tolerance,
        "verdict": verdict,
    }


def time_tolerance(quantity: float, clock: str = "host") -> float:
    """Two independent instruments of an exposed time: TOLERANCE_SHARE of it, at least the clock's floor."""
    return max(TOLERANCE_SHARE * abs(quantity), TOLERANCE_FLOOR_S.get(clock, TOLERANCE_FLOOR_S["host"]))


def same_events_tolerance(clock: str = "host") -> float:
    """Two instruments of the same events (DDP's logger and trainscope's hooks): what pairing them resolves."""
    return SAME_EVENTS_TOLERANCE_S.get(clock, SAME_EVENTS_TOLERANCE_S["host"])


def spread_of(values: list[float]) -> dict | None:
    return (
        {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}
        if values
        else None
    )


# ---------------------------------------------------------------- across ranks (pure)


def combine(per_rank: list[dict], throughput: dict) -> dict | None:
    """The summary's communication block from every rank's measurements."""
    ranks = [r.get("communication") for r in per_rank]
    if not ranks or ranks[0] is None:
        return None
    ids = [r["rank"] for r in per_rank]
    world, first = len(ranks), ranks[0]
    step_s = throughput.get("step_s") or None
    block = {
        "method": METHOD,
        "world_size": world,
        "clock": first["clock"],
        "comm_hook": first["comm_hook"],
        **layout_figures(first, world),
        **transfer_figures(ranks, first, world),
    }
    rows = step_rows(ids, ranks)
    block.update({**ddp_figures(ids, ranks), **trace_figures(ids, ranks)})
    if not first["measured"] or not rows:
        block["agreement"] = {}
        return {
            "measured": False,
            "reason": (
                "--measure-communication off" if not first["measured"] else "no steady step measured on every rank"
            ),
            **block,
        }
    exposures = [row["exposed_s"] for row in rows]
    exposed = statistics.median(exposures)
    interval = median_interval(exposures)
    clear = resolved(exposed, interval)
    overlaps = [row["overlap"] for row in rows if row["overlap"] is not None]
    windows = [row["window_s"] for row in rows if row["window_s"] is not None]
    transfer = block.get("transfer_s")
    hidden = hidden_share(exposed, interval, transfer)
    block.update(
        {
            "measured": True,
            "steps": len(rows),
            "unmeasured_steps": unmeasured(ranks),
            "exposed_s": exposed,
            "exposed_interval": list(interval) if interval else None,
            "exposed_resolved": clear,
            "exposed_spread": spread_of(exposures),
            "exposed_share": exposed / step_s if clear and step_s else None,
            "overlap": statistics.median(overlaps) if overlaps else None,
            "overlap_spread": spread_of(overlaps),
            "window_s": statistics.median(windows) if windows else None,
            "hidden_share": hidden,
            "per_rank": rank_rows(ids, ranks, rows),
            "stragglers": stragglers(ids, rows, step_s),
        }
    )
    block["slowest_rank"] = max(block["per_rank"], key=lambda r: r["exposed_s"])["rank"]
    block["agreement"] = {"ddp": ddp_agreement(ids, ranks), "trace": trace_agreement(ids, ranks)}
    return block


def measured_steps(rank: dict, phases=("steady",)) -> dict:
    return {e["step"]: e for e in rank["steps"] if e.get("exposed_s") is not None and e["phase"] in phases}


def unmeasured(ranks: list[dict]) -> int:
    """Synchronizing steps some rank could not measure (unused parameters, or clocks that ran backwards)."""
    return max(sum(1 for e in r["steps"] if e.get("exposed_s") is None) for r in ranks)


def step_rows(ids: list[int], ranks: list[dict]) -> list[dict]:
    """Per steady step measured on every rank: the exposure (least over ranks: that rank arrived last), which rank
    carried it, its window and overlap, and every rank's wait for it."""
    per_rank = [measured_steps(r) for r in ranks]
    rows = []
    for step in sorted(set.intersection(*(set(s) for s in per_rank))):
        entries = [s[step] for s in per_rank]
        carrier = min(range(len(entries)), key=lambda i: entries[i]["exposed_s"])
        least = entries[carrier]["exposed_s"]
        rows.append(
            {
                "step": step,
                "exposed_s": least,
                "carrier": ids[carrier],
                "window_s": entries[carrier]["window_s"],
                "overlap": entries[carrier]["overlap"],
                "waits": [e["exposed_s"] - least for e in entries],
            }
        )
    return rows


def rank_rows(ids: list[int], ranks: list[dict], rows: list[dict]) -> list[dict]:
    """Per rank: its own exposed time over its steady steps (median, min, max: wait for stragglers included), and
    its median wait for the last rank to arrive over the steps every rank measured."""
    out = []
    for index, (rank, measured) in enumerate(zip(ids, ranks)):
        own = [e["exposed_s"] for e in measured_steps(measured).values()]
        overlaps = [e["overlap"] for e in measured_steps(measured).values() if e["overlap"] is not None]
        out.append(
            {
                "rank": rank,
                "exposed_s": statistics.median(own),
                "exposed_min": min(own),
                "exposed_max": max(own),
                "steps": len(own),
                "wait_s": statistics.median(row["waits"][index] for row in rows),
                "overlap": statistics.median(overlaps) if overlaps else None,
            }
        )
    return out


def stragglers(ids: list[int], rows: list[dict], step_s: float | None) -> list[dict]:
    """Ranks the others waited for: last to arrive in most steps, with the others' median wait for them above
    STRAGGLER_SHARE of a step (that wait is not communication)."""
    found = []
    for index, rank in enumerate(ids if len(ids) > 1 else []):
        carried = [row for row in rows if row["carrier"] == rank]
        if 2 * len(carried) <= len(rows) or not step_s:
            continue
        excess = statistics.median(
            statistics.median(w for i, w in enumerate(row["waits"]) if i != index) for row in carried
        )
        if excess > STRAGGLER_SHARE * step_s:
            found.append({"rank": rank, "excess_s": excess, "steps_last": len(carried)})
    return found


def layout_figures(rank: dict, world: int) -> dict:
    """What DDP sends: one all-reduce per bucket per synchronizing step (the rebuilt buckets: steady steps)."""
    buckets = rank.get("buckets")
    steps, micro = rank.get("optimizer_steps") or 0, rank.get("micro_batches") or 0
    if not buckets:
        return {
            "gradient_bytes": rank["gradient_bytes"],
            "buckets": None,
            "allreduces_per_optimizer_step": None,
            "allreduces_per_micro_batch": None,
            "allreduce_bytes_per_step": None,
        }
    return {
        "gradient_bytes": rank["gradient_bytes"],
        "buckets": len(buckets),
        "bucket_bytes": [b["bytes"] for b in buckets],
        "allreduces_per_optimizer_step": float(len(buckets)),
        "allreduces_per_micro_batch": len(buckets) * steps / micro if micro else None,
        "allreduce_bytes_per_step": float(sum(b["bytes"] for b in buckets)),
    }


def shortest_then_median(per_rank: list[list[list[float]]]) -> list[float]:
    """Per bucket: per repetition the shortest across ranks (the last to arrive saw the collective alone), then
    the median over repetitions."""
    return [
        statistics.median(min(rank[b][r] for rank in per_rank) for r in range(len(per_rank[0][b])))
        for b in range(len(per_rank[0]))
    ]


def transfer_figures(ranks: list[dict], first: dict, world: int) -> dict:
    timed = [r.get("transfer") for r in ranks]
    if not all(timed) or not timed[0]["bucket_s"]:
        return {"transfer_s": None}
    buckets = shortest_then_median([t["bucket_s"] for t in timed])
    collective = shortest_then_median([t["collective_s"] for t in timed]) if timed[0]["collective_s"] else None
    transfer = sum(buckets)
    size = sum(b["bytes"] for b in first["buckets"]) if first.get("buckets") else None
    seconds = sum(collective) if collective else transfer
    return {
        "transfer_s": transfer,
        "transfer_bucket_s": buckets,
        "collective_s": seconds,
        "transfer_timed": timed[0]["timed"],
        "transfer_repetitions": timed[0]["repetitions"],
        "bus_bandwidth_gbs": bus_bandwidth_gbs(size, world, seconds) if size else None,
        "measurement_s": max(t["measurement_s"] for t in timed),
    }


def by_iteration(rank: dict) -> dict:
    return {d["iteration"]: d for d in rank.get("ddp_iterations") or []}


def ddp_figures(ids: list[int], ranks: list[dict]) -> dict:
    """DDP's own exposed time (comm - overlap) over the steady iterations every rank sampled: per iteration the
    least over ranks (the others hold the wait for that one), then the median."""
    phase = {e["iteration"]: e["phase"] for e in ranks[0]["steps"]}
    common = set.intersection(*(set(by_iteration(r)) for r in ranks))
    steady = sorted(i for i in common if phase.get(i) == "steady")
    if not steady:
        return {"ddp_exposed_s": None, "ddp_iterations": []}
    least = [min((by_iteration(r)[i] for r in ranks), key=lambda d: d["exposed_s"]) for i in steady]
    return {
        "ddp_exposed_s": statistics.median(d["exposed_s"] for d in least),
        "ddp_exposed_spread": spread_of([d["exposed_s"] for d in least]),
        "ddp_comm_s": statistics.median(d["comm_s"] for d in least),
        "ddp_overlap": statistics.median(d["overlap"] for d in least),
        "ddp_iterations": steady,
    }


def ddp_agreement(ids: list[int], ranks: list[dict]) -> dict:
    """trainscope's exposed time and overlap against DDP's logger on exactly the iterations DDP sampled (warm-up
    ones too: both instruments saw the same iteration): per iteration the median over ranks of the per-rank
    difference, judged by `agreement` with the tolerance scaled by DDP's exposure (its least rank per iteration)."""
    ours = [{e["iteration"]: e for e in r["steps"] if e.get("exposed_s") is not None} for r in ranks]
    theirs = [by_iteration(r) for r in ranks]
    paired = sorted(set.intersection(*(set(o) & set(t) for o, t in zip(ours, theirs))))
    if not paired:
        return {"pairs": 0, "verdict": "undecided", "iterations": []}
    differences = [
        statistics.median(o[i]["exposed_s"] - t[i]["exposed_s"] for o, t in zip(ours, theirs)) for i in paired
    ]
    # DDP's exposure (least over ranks: the others' excess is wait, not communication), beside the verdict
    quantity = statistics.median(min(t[i]["exposed_s"] for t in theirs) for i in paired)
    result = {
        **agreement(differences, same_events_tolerance(ranks[0].get("clock", "host"))),
        "iterations": paired,
        "ddp_exposed_s": quantity,
        "instrument": "the same reducer events: an implementation check",
    }
    windows = [i for i in paired if all(o[i]["overlap"] is not None for o in ours)]
    if windows:
        result["overlap"] = agreement(
            [statistics.median(o[i]["overlap"] - t[i]["overlap"] for o, t in zip(ours, theirs)) for i in windows],
            OVERLAP_TOLERANCE,
        )
    return result


def trace_steps(trace: dict) -> dict:
    """step -> the trace's figures for the last `backward` span of that step (one span per micro-batch)."""
    spans, first, last = len(trace["exposed_s"]), trace.get("first_step"), trace.get("last_step")
    if not first or not last or spans % (last - first + 1):
        return {}
    per_step = spans // (last - first + 1)
    return {
        first + i: {
            "exposed_s": trace["exposed_s"][(i + 1) * per_step - 1],
            "allreduce_s": trace["allreduce_s"][(i + 1) * per_step - 1],
        }
        for i in range(last - first + 1)
    }


def trace_figures(ids: list[int], ranks: list[dict]) -> dict:
    """The profiler trace's figures, when the run was profiled: per traced step the least wait after backward's
    last operation over ranks (the others hold the wait for that one), the collectives' time as the median over
    ranks; medians over the traced steps."""
    traces = [trace_steps(r["trace"]) if r.get("trace") else {} for r in ranks]
    common = sorted(set.intersection(*(set(t) for t in traces))) if all(traces) else []
    exposed = [
        min(t[s]["exposed_s"] for t in traces) for s in common if all(t[s]["exposed_s"] is not None for t in traces)
    ]
    if not common:
        return {}
    return {
        "trace_exposed_s": statistics.median(exposed) if exposed else None,
        "trace_allreduce_s": statistics.median(statistics.median(t[s]["allreduce_s"] for t in traces) for s in common),
        "trace_steps": common,
    }


def trace_agreement(ids: list[int], ranks: list[dict]) -> dict | None:
    """The trace's exposed time against trainscope's on the same traced steps, by the same rule as DDP's logger."""
    traces = [trace_steps(r["trace"]) if r.get("trace") else {} for r in ranks]
    if not all(traces):
        return None
    ours = [{e["step"]: e for e in r["steps"] if e.get("exposed_s") is not None} for r in ranks]
    paired = sorted(
        s
        for s in set.intersection(*(set(t) for t in traces))
        if all(s in o and t[s]["exposed_s"] is not None for o, t in zip(ours, traces))
    )
    if not paired:
        return {"pairs": 0, "verdict": "undecided", "steps": []}
    differences = [
        statistics.median(t[s]["exposed_s"] - o[s]["exposed_s"] for o, t in zip(ours, traces)) for s in paired
    ]
    quantity = statistics.median(min(o[s]["exposed_s"] for o in ours) for s in paired)
    return {**agreement(differences, time_tolerance(quantity, ranks[0].get("clock", "host"))), "steps": paired}


def _device_kernel(event) -> bool:
    return str(getattr(event, "device_type", "CPU")).endswith("CUDA")


def from_trace(events) -> dict | None:
    """Communication figures of a profiler trace (torch.profiler FunctionEvents), per `backward` stage span in order.

    With device kernels in the trace (CUDA): the kernels launched by the operators inside the span (the launching
    operator found by the kernel's correlation id), on the device's own timestamps. The collectives' time is their
    NCCL kernels' (the host's `nccl:all_reduce` operator is their launch, not more communication), and the exposed
    time runs from the end of the last compute kernel that started before the last collective did (backward's last
    gradient: the last bucket's all-reduce waits for it) to the end of that collective; 0 where compute ran past it
    (nothing waited). The copies of the averaged gradients after it are not compute it waits for. On the host (gloo): the time after the span's last autograd operation on any
    thread (CUDA backward runs on the autograd engine's device thread, not the span's) and the collectives' summed
    duration inside the span. An exposed time that comes out negative (the span ending before its own operations) is
    no time: None, counted in `unphysical`, never clamped to 0."""
    events = list(events)
    spans = sorted((e for e in events if e.name == "backward"), key=lambda e: e.time_range.start)
    if not spans:
        return None
    kernels = [e for e in events if _device_kernel(e)]
    if kernels:
        return _from_device_kernels(spans, events, kernels)
    autograd = [e for e in events if e.name.startswith("autograd::engine::evaluate_function")]
    collectives = [
        e
        for e in events
        if e.name.startswith(("gloo:all_reduce", "nccl:all_reduce"))
        or ("nccl" in e.name.lower() and "allreduce" in e.name.lower().replace("_", ""))
    ]
    exposed, allreduce, unphysical = [], [], 0
    for span in spans:
        start, end = span.time_range.start, span.time_range.end
        inside = [e.time_range.end for e in autograd if start <= e.time_range.start <= end]
        waited = (end - max(inside)) / 1e6 if inside else None
        if waited is not None and waited < 0:
            waited, unphysical = None, unphysical + 1
        exposed.append(waited)
        allreduce.append(
            sum(
                min(e.time_range.end, end) - max(e.time_range.start, start)
                for e in collectives
                if e.time_range.start < end and e.time_range.end > start
            )
            / 1e6
        )
    return {
        "spans": len(spans),
        "exposed_s": exposed,
        "allreduce_s": allreduce,
        "basis": "host",
        "unphysical": unphysical,
    }


def _from_device_kernels(spans, events, kernels) -> dict:
    launchers = {getattr(e, "id", None): e for e in events if not _device_kernel(e)}
    exposed, allreduce = [], []
    for span in spans:
        start, end = span.time_range.start, span.time_range.end
        mine = [
            k
            for k in kernels
            if (launcher := launchers.get(getattr(k, "linked_correlation_id", None))) is not None
            and start <= launcher.time_range.start <= end
        ]
        collectives = [k.time_range for k in mine if "nccl" in k.name.lower()]
        allreduce.append(sum(t.end - t.start for t in collectives) / 1e6)
        last = max(collectives, key=lambda t: t.end, default=None)
        compute = [
            k.time_range.end
            for k in mine
            if "nccl" not in k.name.lower() and last is not None and k.time_range.start < last.start
        ]
        exposed.append(max(0.0, last.end - max(compute)) / 1e6 if last is not None and compute else None)
    return {
        "spans": len(spans),
        "exposed_s": exposed,
        "allreduce_s": allreduce,
        "basis": "device kernels",
        "unphysical": 0,
    }


# ---------------------------------------------------------------- the end-of-run table


def ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f}"


def exposed_text(block: dict) -> str:
    """The exposed time as a physical figure: a resolved median with its interval, else 'not resolved'."""
    interval = block.get("exposed_interval")
    if block.get("exposed_resolved"):
        return (
            f"exposed {ms(block['exposed_s'])} ms per step (95% interval {ms(interval[0])}-{ms(interval[1])} ms"
            + (f", {block['exposed_share']:.1%} of the step" if block.get("exposed_share") is not None else "")
            + ")"
        )
    low, high = interval if interval else (block["exposed_spread"]["min"], block["exposed_spread"]["max"])
    return f"exposed not resolved: between {ms(max(0.0, low))} and {ms(high)} ms per step"


def verdict_text(found: dict | None, unit: str = "ms") -> str:
    if not found or not found.get("pairs"):
        return "not compared (no paired steps)"
    scale, suffix = (1e3, " ms") if unit == "ms" else (100, " points")
    interval = found.get("interval")
    what = {"agree": "agrees", "disagree": "DISAGREES", "undecided": "undecided"}[found["verdict"]]
    return (
        f"{what} (median difference {found['median_difference'] * scale:+.1f}{suffix}"
        + (
            f", 95% interval {interval[0] * scale:+.1f} to {interval[1] * scale:+.1f}"
            if interval
            else ", too few pairs for a 95% interval"
        )
        + f", tolerance +-{found['tolerance'] * scale:.1f}{suffix}, {found['pairs']} pairs)"
    )


def table_lines(block: dict | None) -> list[str]:
    """The end-of-run table's communication lines."""
    if not block:
        return []
    if not block.get("measured"):
        return [f"communication: not measured ({block.get('reason')})", *instrument_lines(block)]
    hook = "DDP's built-in all-reduce" if block["comm_hook"] == "none" else f"the {block['comm_hook']} compression hook"
    lines = [
        f"communication ({block['world_size']} ranks, {hook}, {block['clock']} clock, {block['steps']} steady steps "
        f"measured on every rank): {exposed_text(block)}"
    ]
    parts = []
    if block.get("overlap") is not None:
        parts.append(f"overlap {block['overlap']:.0%} of the {block['window_s'] * 1e3:.0f} ms communication window")
    if block.get("transfer_s") is not None:
        parts.append(
            f"transfer (the buckets' all-reduces alone) {ms(block['transfer_s'])} ms"
            + (
                f", {block['hidden_share']:.0%} of it hidden behind backward"
                if block.get("hidden_share") is not None
                else ", hidden share not resolved"
            )
        )
    if block.get("buckets"):
        parts.append(
            f"{block['buckets']} bucket(s), {block['allreduce_bytes_per_step'] / 1e6:.1f} MB per step"
            + (f", {block['bus_bandwidth_gbs']:.2f} GB/s bus bandwidth" if block.get("bus_bandwidth_gbs") else "")
        )
    if parts:
        lines.append("  " + "; ".join(parts))
    lines.append(
        "  per rank (median, min-max): "
        + ", ".join(
            f"rank {r['rank']} {ms(r['exposed_s'])} ms ({ms(r['exposed_min'])}-{ms(r['exposed_max'])})"
            for r in block["per_rank"]
        )
        + f"; slowest: rank {block['slowest_rank']}"
    )
    lines += instrument_lines(block)
    lines += [
        f"straggler: rank {s['rank']} arrived last in {s['steps_last']} steps; the others waited "
        f"{ms(s['excess_s'])} ms per step for it (not communication)"
        for s in block.get("stragglers") or []
    ]
    return lines


def instrument_lines(block: dict) -> list[str]:
    """DDP's own logger and the trace, beside trainscope's figures (or alone, with measuring off)."""
    lines, agreed = [], block.get("agreement") or {}
    if block.get("ddp_exposed_s") is not None:
        ddp = agreed.get("ddp")
        lines.append(
            f"  DDP's own logger: exposed {ms(block['ddp_exposed_s'])} ms, overlap {block['ddp_overlap']:.0%} of "
            f"its {block['ddp_comm_s'] * 1e3:.0f} ms window (steady iterations {block['ddp_iterations']})"
            + (f"; exposed {verdict_text(ddp)}" if ddp else "")
            + (f"; overlap {verdict_text(ddp['overlap'], unit='points')}" if ddp and ddp.get("overlap") else "")
        )
    if block.get("trace_exposed_s") is not None:
        trace = agreed.get("trace")
        lines.append(
            f"  profiler trace: exposed {ms(block['trace_exposed_s'])} ms, collectives "
            f"{ms(block['trace_allreduce_s'])} ms per traced step" + (f"; {verdict_text(trace)}" if trace else "")
        )
    return lines
