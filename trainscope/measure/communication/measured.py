"""What DDP communication costs, measured in the run: on every synchronizing step of every rank at the events that
bound it, on any backend, and the buckets' transfer timed alone after the loop.

How it works: docs/ddp.md#in-the-code-how-the-communication-is-measured-trainscopemeasurecommunicationmeasuredpy.
"""

import contextlib
import functools
import time

import torch

from trainscope.core.errors import UserError
from trainscope.core.precision import DTYPES, HALF
from trainscope.measure.timing import EventClock, HostClock, synchronizer

METHOD = "direct"  # per step, at the events that bound it (schema 4); schema 3 records hold a two-pass estimate
# DDP's runtime logger samples iterations 1-10 and then every DDP_SAMPLE_RATE-th (torch's default).
DDP_ALWAYS_SAMPLED, DDP_SAMPLE_RATE = 10, 100
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


def ring_allreduce_seconds(gradient_bytes: float, gpus: int, bandwidth_gbs: float, latency_us: float) -> float:
    """Ring all-reduce time, 2(N-1) steps each moving 1/N of the buffer over one link (Patarasuk & Yuan 2009):
    T = 2(N-1)/N * S / B + 2(N-1) * alpha. One GPU communicates nothing."""
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
        self.last_index = None  # the parameter whose gradient was taken last in the latest pass

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
        self.last_index = index
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


# synchronizing passes in a row whose last gradient came from the bucket DDP reduces last, before the gradient hooks
# are cut to that bucket's parameters
CUT_AFTER = 3


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
        self.kind = getattr(settings, "ddp_comm_hook", "none")  # train.py's flag; a loop registers its own hook
        self.repetitions = settings.communication_samples
        device = accelerator.device
        self.synchronize = synchronizer(device) or (lambda: None)
        self.clock = clock or (EventClock(device) if device.type == "cuda" else HostClock())
        self.clock_name = "cuda events" if isinstance(self.clock, EventClock) else "host"
        if self.kind != "none":  # DDP's own compression hook, as the user asked; nothing wraps it
            from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

            hook = {"fp16": default_hooks.fp16_compress_hook, "bf16": default_hooks.bf16_compress_hook}[self.kind]
            try:
                ddp.register_comm_hook(state=None, hook=hook)
            except TypeError as error:  # DDP's own guard, which checks torch's build (gloo all-reduces bf16)
                raise UserError(
                    f"--ddp-comm-hook {self.kind}: {error}, and this torch ({torch.__version__}) is not such a "
                    "build: use fp16 or none"
                ) from None
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
        # the gradient hooks cut to the bucket DDP reduces last, once CUT_AFTER passes in a row took their last
        # gradient from it: {hooks_before, hooks_after, iteration} or {reason} (never cut)
        self.hooks_cut: dict | None = None
        self._last_in_last_bucket = 0
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
        rebuilt = getattr(self.ddp, "_has_rebuilt_buckets", False) or self.synchronized >= 3
        if self.measure and self.layout is None and rebuilt:
            with paused() if paused is not None else contextlib.nullcontext():
                self.layout = self._read_buckets()
            self._watch_first_bucket()
        elif self.measure and self.layout and self.hooks_cut is None:
            self._consider_the_cut()

    def _consider_the_cut(self) -> None:
        """The gradient hooks cut to the bucket DDP reduces last after CUT_AFTER passes in a row took their last
        gradient from it; one pass that did not keeps every hook (docs/ddp.md#in-the-code-how-the-communication-is-measured-trainscopemeasurecommunicationmeasuredpy)."""
        if len(self.layout) < 2:
            self.hooks_cut = {"reason": "one bucket: every parameter is in the last"}
            return
        last = set(self.layout[-1]["parameters"])
        if self.stamps.last_index is None or self.stamps.fired != self.stamps.expected:
            return  # an unmeasured pass: no evidence either way
        if self.stamps.last_index not in last:
            self.hooks_cut = {"reason": f"iteration {self.synchronized}: the last gradient was not the last bucket's"}
            return
        self._last_in_last_bucket += 1
        if self._last_in_last_bucket < CUT_AFTER:
            return
        taken, others = self.handles[: len(self.parameters)], self.handles[len(self.parameters) :]
        for index, handle in enumerate(taken):
            if index not in last:
                handle.remove()
        self.handles = [h for i, h in enumerate(taken) if i in last] + others
        self.stamps.expected = len(last)
        self.hooks_cut = {"hooks_before": len(taken), "hooks_after": len(last), "iteration": self.synchronized}

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
            comm, overlap = data["comm_s"], data["overlap_s"]
            entry = {"iteration": previous, "exposed_s": comm - overlap, "comm_s": comm, "overlap": overlap / comm}
            self.ddp_iterations.append(entry)

    def _read_buckets(self, buckets=None) -> list[dict]:
        """DDP's buckets in launch order: which parameters, how many elements of which size. The reducer lends them
        with zero-filled buffers (what DDP's join() replays); the buffers are dropped at once."""
        index = {id(p): i for i, p in enumerate(self.parameters)}
        layout = []
        for bucket in buckets if buckets is not None else self.ddp.reducer._get_zeros_like_grad_buckets():
            buffer, parameters = bucket.buffer(), [index[id(p)] for p in bucket.parameters() if id(p) in index]
            layout.append({"parameters": parameters, "numel": buffer.numel(), "element_size": buffer.element_size()})
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
        repeated = lambda collective: [self._timed(collective) for _ in range(self.repetitions)]
        for bucket in buckets:
            bucket_s.append(repeated(lambda: self.ddp.reducer._run_comm_hook(bucket).wait()))  # noqa: B023 (called at once)
            if collective_s is not None:
                wire = torch.zeros(bucket.buffer().numel(), dtype=DTYPES[self.kind], device=bucket.buffer().device)
                collective_s.append(repeated(lambda: torch.distributed.all_reduce(wire, group=self.ddp.process_group)))  # noqa: B023 (called at once)
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
        wire = DTYPES[self.kind].itemsize if self.kind in HALF else None
        buckets = None
        if self.layout:
            size = lambda b: b["numel"] * (wire or b["element_size"])
            buckets = [{"numel": b["numel"], "bytes": size(b), "parameters": len(b["parameters"])} for b in self.layout]
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
            "hooks_cut": self.hooks_cut,
        }


def time_collective(collective, barrier, synchronize, clock=None, iterations: int = TRANSFER_ITERATIONS) -> float:
    """Seconds of one `collective()` after `barrier()`: on the host one call between synchronizations; with CUDA
    events one warm-up call, then the mean of `iterations` calls back to back between two events on the compute
    stream (each call's wait makes it wait for the communication stream)."""
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
