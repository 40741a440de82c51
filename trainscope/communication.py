"""What DDP communication costs, measured inside the run on every rank, on any backend, and checked in the
same run against DDP's own logger and, with --profile, the profiler's trace.

DDP all-reduces gradient buckets during backward, so part of the all-reduce hides behind the rest of
backward and part is exposed: backward waits for it. A few **calibration steps** (spread over the steady
phase) measure it on the step's own last micro-batch, run twice:

1. **unsynced**, under `no_sync()` (no all-reduce), with the stage timer paused and the random state forked:
   forward + backward, timed after a barrier, so it is this rank's compute alone. Its gradients are then
   all-reduced **bucket by bucket**, in DDP's own buckets and through its communication hook (the reducer's
   own replay, as DDP's join() does it), each timed alone after a barrier: the copy into the bucket
   buffer stays outside the window. These gradients are then dropped; the accumulated ones are put back.
2. **synced**, the real step: DDP's forward and backward, timed after a barrier, with the same dropout
   masks (the random state was restored), so the step learns exactly what it would have learned.

Per calibration sample, with compute_r = rank r's unsynced time:

exposed_r  = synced_r - max over ranks(compute)   (the slowest rank's compute is what every rank waits for)
wait_r     = max over ranks(compute) - compute_r  (a fast rank's wait for the slow one: not communication)
transfer   = the bucket collectives' summed time, shortest across ranks (total_allreduce_s): what the
             communication itself takes; exposed > transfer gets a warning in the record, never a clamp
window     = from DDP's first bucket launch (the hook's first call) to the end of the synced pass
overlap    = 1 - exposed / window: the share of the communication window hidden behind backward, as
             measured (DDP's logger defines its overlap over the same window)

Medians over samples (and over ranks) with their spread go into the summary's `communication` block, beside
the same figures from independent instruments:

* **DDP's logger** (`_get_ddp_logging_data()`): per sampled iteration, backward communication time (first
  bucket launched to the end of finalize_backward) and its overlap with compute (first launch to the end of
  backward compute); DDP's exposed time = comm - overlap. DDP samples iterations 1-10 and then every 100th:
  the warm-up iterations are left out, and per iteration the rank with the least exposed time is taken (on
  the other ranks it holds the wait for that one). A disagreement with trainscope's figure beyond the
  stated tolerance is a warning in the record (trainscope.health), never a silent correction.
* **The profiler's trace** (`--profile`): per traced step, the time the `backward` stage spent after its last
  autograd operation (waiting for all-reduces and DDP's copies), and the collectives' summed time
  (`gloo:all_reduce` spans, `nccl*AllReduce*` kernels).

Bus bandwidth is 2(N-1)/N x the bytes actually sent (fp16/bf16 with a compression hook) / the transfer time.
"""

import contextlib
import functools
import statistics
import time

import torch

from trainscope.errors import UserError
from trainscope.timing import synchronizer

STRAGGLER_FACTOR = 1.10
# DDP's runtime logger samples iterations 1-10 and then every DDP_SAMPLE_RATE-th (torch's default).
DDP_ALWAYS_SAMPLED, DDP_SAMPLE_RATE = 10, 100
# All-reduce bus bandwidth (GB/s, per GPU) and per-hop latency (us) that NCCL reaches in practice;
# assumptions for projections (compare_dp.py), set beside the bandwidth measured here (make ddp-cost).
INTERCONNECTS = {
    "nvlink": {"bandwidth_gbs": 350.0, "latency_us": 5.0, "what": "NVLink 4 / NVSwitch (H100 SXM node)"},
    "pcie": {"bandwidth_gbs": 20.0, "latency_us": 10.0, "what": "PCIe Gen4 x16 through the host, no NVLink"},
    "infiniband": {"bandwidth_gbs": 45.0, "latency_us": 8.0, "what": "InfiniBand NDR 400 Gb/s between nodes"},
}


def ring_allreduce_seconds(gradient_bytes: float, gpus: int, bandwidth_gbs: float, latency_us: float) -> float:
    """Ring all-reduce time: 2(N-1) steps, each moving 1/N of the buffer over one link.

    T = 2(N-1)/N * S / B + 2(N-1) * alpha   (Patarasuk & Yuan 2009; the NCCL performance notes
    define bus bandwidth the same way). One GPU communicates nothing.
    """
    if gpus <= 1:
        return 0.0
    return 2 * (gpus - 1) / gpus * gradient_bytes / (bandwidth_gbs * 1e9) + 2 * (gpus - 1) * latency_us * 1e-6


def unwrap_ddp(model):
    """The DistributedDataParallel module of a prepared model, or None. `accelerator.prepare` with --compile
    wraps DDP in torch.compile's OptimizedModule (the DDP module is its `_orig_mod`)."""
    inner = getattr(model, "_orig_mod", model)
    return inner if isinstance(inner, torch.nn.parallel.DistributedDataParallel) else None


class NoCommunication:
    """Single-process runs, FSDP: nothing to measure."""

    def settings_in_effect(self) -> dict | None:
        return None

    def calibration_for(self, step: int):
        return None

    def step_ended(self, step: int) -> None:
        pass

    def rank_summary(self, counts: dict, trace: dict | None = None) -> dict | None:
        return None


def build(settings, accelerator, model, total_steps: int):
    """The communication measurement for this run (a do-nothing one where there is nothing to measure).
    With --measure-communication off the hook still counts all-reduces (and compresses, if asked), but
    no calibration step runs."""
    ddp = unwrap_ddp(model)
    if ddp is None or accelerator.num_processes < 2:
        return NoCommunication()
    if settings.ddp_comm_hook == "bf16" and accelerator.state.backend not in ("nccl", "xccl"):
        raise UserError(f"--ddp-comm-hook bf16 needs NCCL (CUDA) or XCCL; {accelerator.state.backend} cannot "
                        "all-reduce bf16: use fp16 or none")
    return Communication(settings, accelerator, ddp, settings.measure_communication != "off", total_steps)


class BucketHook:
    """Wraps the DDP communication hook (`hook` is what DDP gets): counts DDP's all-reduces and the bytes they
    send (2 per element with a fp16/bf16 compression hook). The calibration's replays are not counted."""

    WIRE = {"fp16": torch.float16, "bf16": torch.bfloat16}

    def __init__(self, kind: str):
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        self.kind = kind
        inner = {"none": default_hooks.allreduce_hook, "fp16": default_hooks.fp16_compress_hook,
                 "bf16": default_hooks.bf16_compress_hook}[kind]
        self.calls, self.bytes_sent, self.counting = 0, 0, True
        self.first_call_at = None  # when DDP launched the first bucket since `first_call_at` was cleared

        @functools.wraps(inner)  # DDP reads the hook's name (bf16 support checks, its logging)
        def hook(state, bucket):
            if self.counting:
                if self.first_call_at is None:
                    self.first_call_at = time.perf_counter()
                buffer = bucket.buffer()
                self.calls += 1
                self.bytes_sent += buffer.numel() * self.wire_dtype(buffer.dtype).itemsize
            return inner(state, bucket)

        self.hook = hook

    def wire_dtype(self, dtype: torch.dtype) -> torch.dtype:
        return self.WIRE.get(self.kind, dtype)


class Communication:
    def __init__(self, settings, accelerator, ddp, measure: bool, total_steps: int):
        self.accelerator, self.ddp, self.measure = accelerator, ddp, measure
        self.world, self.warmup = accelerator.num_processes, settings.timing_warmup_steps
        self.synchronize = synchronizer(accelerator.device) or (lambda: None)
        self.hook = BucketHook(settings.ddp_comm_hook)
        ddp.register_comm_hook(state=None, hook=self.hook.hook)
        self.parameters = [p for p in ddp.parameters() if p.requires_grad]
        self.gradient_bytes = sum(p.numel() * p.element_size() for p in self.parameters)
        self.calibration_steps = schedule(settings.timing_warmup_steps, total_steps,
                                          settings.communication_samples) if measure else []
        self.samples: list[dict] = []  # one per calibration: unsynced_s, synced_s, transfer_s, bucket_s
        self.ddp_iterations: dict[int, dict] = {}  # DDP's own per-iteration figures, steady iterations

    def settings_in_effect(self) -> dict:
        """The DDP settings read back from the wrapped model (what really reached DDP)."""
        return {"bucket_cap_mb": self.ddp.bucket_bytes_cap / 2**20, "gradient_as_bucket_view": self.ddp.gradient_as_bucket_view,
                "static_graph": self.ddp.static_graph, "find_unused_parameters": self.ddp.find_unused_parameters,
                "comm_hook": self.hook.kind, "measure_communication": self.measure,
                "calibration_steps": self.calibration_steps}

    def calibration_for(self, step: int):
        return Calibration(self) if step in self.calibration_steps else None

    def barrier(self) -> None:
        self.synchronize()
        torch.distributed.barrier()

    def time_buckets(self) -> list[float]:
        """Each of DDP's buckets, filled with this rank's gradients, through the registered communication hook
        (DDP's own, compression included) as DDP's reducer runs it, one at a time after a barrier: the copy
        into the bucket stays outside the window. The buckets and the replay are the reducer's own
        (`_get_zeros_like_grad_buckets`, `_run_comm_hook`, what DDP's join() uses)."""
        seconds = []
        self.hook.counting = False
        try:
            for bucket in self.ddp.reducer._get_zeros_like_grad_buckets():
                grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in bucket.parameters()]
                bucket.buffer().copy_(torch.cat([g.reshape(-1) for g in grads]))
                del grads
                self.barrier()
                started = time.perf_counter()
                self.ddp.reducer._run_comm_hook(bucket).wait()
                self.synchronize()
                seconds.append(time.perf_counter() - started)
        finally:
            self.hook.counting = True
        return seconds

    def step_ended(self, step: int) -> None:
        """DDP's logger records iteration k's figures in the forward of iteration k + 1: read them once that
        forward has run, for the iterations DDP samples, after the warm-up."""
        iteration = step - 1
        if iteration <= self.warmup or not (iteration <= DDP_ALWAYS_SAMPLED or iteration % DDP_SAMPLE_RATE == 0):
            return
        data = ddp_logging(self.ddp)
        if data and data.get("iteration") == iteration and data.get("comm_s"):
            self.ddp_iterations[iteration] = data

    def rank_summary(self, counts: dict, trace: dict | None = None) -> dict:
        """This rank's measurements; `counts` are the loop's {phase: {optimizer_steps, micro_batches}}."""
        steps = sum(c["optimizer_steps"] for c in counts.values())
        micro_batches = sum(c["micro_batches"] for c in counts.values())
        return {"measured": bool(self.samples), "gradient_bytes": self.gradient_bytes, "allreduce_calls": self.hook.calls,
                "allreduce_bytes": self.hook.bytes_sent, "buckets": len(self.samples[0]["bucket_s"]) if self.samples else None,
                "allreduces_per_optimizer_step": self.hook.calls / steps if steps > 0 else None,
                "allreduces_per_micro_batch": self.hook.calls / micro_batches if micro_batches > 0 else None,
                "samples": self.samples, "ddp_iterations": self.ddp_iterations, "trace": trace}


def schedule(warmup: int, total: int, samples: int) -> list[int]:
    """Calibration steps spread over the steady phase, at least two apart (the first two steady steps are left
    to DDP's bucket rebuild and the allocator)."""
    first = warmup + 2
    steps = []
    for i in range(max(0, samples)):
        step = first + round((total - first) * i / max(1, samples))
        if first <= step <= total and (not steps or step >= steps[-1] + 2):
            steps.append(step)
    return steps


class Calibration:
    """One calibration sample: the unsynced pass (train_step runs it with the stage timer paused), then the
    synced pass timed around the real step's forward and backward."""

    def __init__(self, communication: Communication):
        self.communication = communication
        self.sample = {}

    def unsynced_pass(self, forward_backward) -> None:
        """Run `forward_backward` without DDP's all-reduce on the same micro-batch, time it and the bucket
        collectives of its gradients, then put the gradients and the random state back as they were."""
        c = self.communication
        kept = [p.grad for p in c.parameters]  # the accumulated gradients of earlier micro-batches
        for p in c.parameters:
            p.grad = None
        device = c.accelerator.device
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            c.barrier()
            started = time.perf_counter()
            with c.ddp.no_sync():
                forward_backward()
            c.synchronize()
            self.sample["unsynced_s"] = time.perf_counter() - started
        self.sample["bucket_s"] = c.time_buckets()
        self.sample["transfer_s"] = sum(self.sample["bucket_s"])
        for p, grad in zip(c.parameters, kept):
            p.grad = grad
        c.barrier()  # every rank starts the synced pass together

    @contextlib.contextmanager
    def synced_pass(self):
        """Around the real step's forward and backward: DDP's all-reduces and what backward waits for. The
        communication window runs from DDP's first bucket launch (the hook's first call) to the pass's end."""
        c = self.communication
        c.hook.first_call_at = None
        started = time.perf_counter()
        yield
        c.synchronize()
        ended = time.perf_counter()
        self.sample["synced_s"] = ended - started
        self.sample["window_s"] = ended - c.hook.first_call_at if c.hook.first_call_at is not None else None
        c.samples.append(self.sample)


def ddp_logging(ddp) -> dict | None:
    """DDP's own runtime figures of its latest sampled iteration (nanoseconds in DDP, seconds here)."""
    try:
        data = ddp._get_ddp_logging_data()
    except (AttributeError, RuntimeError):
        return None
    keys = {"backward_comm_time": "comm_s", "backward_compute_comm_overlap_time": "overlap_s",
            "backward_compute_time": "backward_compute_s", "forward_compute_time": "forward_compute_s"}
    facts = {ours: data[theirs] / 1e9 for theirs, ours in keys.items() if theirs in data}
    facts["iteration"] = data.get("iteration")
    return facts


# ---------------------------------------------------------------- across ranks (pure)


def combine(per_rank: list[dict], throughput: dict) -> dict | None:
    """The summary's communication block from every rank's measurements."""
    ranks = [r.get("communication") for r in per_rank]
    if not ranks or ranks[0] is None:
        return None
    counts = {k: ranks[0].get(k) for k in ("allreduces_per_optimizer_step", "allreduces_per_micro_batch")}
    samples = min(len(r["samples"]) for r in ranks)
    if samples == 0:  # DDP's own figures and the trace's stand without a calibration
        return {"measured": False, "reason": "no calibration step ran (--measure-communication off, or too few "
                "steady steps)", **counts, **ddp_figures(ranks), **trace_figures(ranks)}
    step_s = throughput.get("step_s") or 0.0
    per_sample = [sample_figures([r["samples"][i] for r in ranks]) for i in range(samples)]
    rows = [rank_row(per_rank[index]["rank"], [s["ranks"][index] for s in per_sample], step_s)
            for index in range(len(ranks))]
    exposed = statistics.median(row["exposed_s"] for row in rows)
    transfer = statistics.median(s["transfer_s"] for s in per_sample)
    windows = [r["window_s"] for s in per_sample for r in s["ranks"] if r["window_s"]]
    window = statistics.median(windows) if windows else None
    first = ranks[0]
    calls = max(1, first["allreduce_calls"])
    bytes_per_step = first["allreduce_bytes"] / calls * first["allreduces_per_optimizer_step"]
    world = len(ranks)
    return {
        "measured": True, "world_size": world, "calibration_samples": samples, "per_rank": rows,
        "exposed_s": exposed, "exposed_share": exposed / step_s if step_s else None,
        "exposed_spread": spread_of([e for s in per_sample for e in s["exposed"]]),
        "total_allreduce_s": transfer, "total_spread": spread_of([s["transfer_s"] for s in per_sample]),
        "window_s": window, "overlap": 1 - exposed / window if window else None,
        "compute_s": statistics.median(row["compute_s"] for row in rows),
        "gradient_bytes": first["gradient_bytes"], "allreduce_bytes_per_step": bytes_per_step,
        "buckets": first.get("buckets"),
        "bus_bandwidth_gbs": 2 * (world - 1) / world * bytes_per_step / transfer / 1e9 if transfer else None,
        **counts, "stragglers": stragglers(rows),
        **ddp_figures(ranks), **trace_figures(ranks),
        "measurement_s": max(r.get("measurement_s") or 0.0 for r in per_rank),
    }


def sample_figures(ranks: list[dict]) -> dict:
    """One calibration sample across ranks: each rank's compute, wait and exposed time, and the transfer."""
    slowest = max(r["unsynced_s"] for r in ranks)
    rows = [{"compute_s": r["unsynced_s"], "wait_s": slowest - r["unsynced_s"], "exposed_s": r["synced_s"] - slowest,
             "synced_s": r["synced_s"], "window_s": r.get("window_s")} for r in ranks]
    return {"ranks": rows, "exposed": [row["exposed_s"] for row in rows],
            "transfer_s": min(r["transfer_s"] for r in ranks)}


def rank_row(rank: int, samples: list[dict], step_s: float) -> dict:
    median = lambda key: statistics.median(s[key] for s in samples)  # noqa: E731
    exposed = median("exposed_s")
    return {"rank": rank, "compute_s": median("compute_s"), "wait_s": median("wait_s"), "exposed_s": exposed,
            "exposed_share": exposed / step_s if step_s else None, "synced_s": median("synced_s")}


def spread_of(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}


def stragglers(rows: list[dict]) -> list[dict]:
    """Ranks computing more than 10% above the median rank, with their delay against the median of the others."""
    median_compute = statistics.median(r["compute_s"] for r in rows)
    return [{"rank": row["rank"], "compute_s": row["compute_s"],
             "excess_s": row["compute_s"] - statistics.median(r["compute_s"] for r in rows if r is not row)}
            for row in rows if median_compute and row["compute_s"] > STRAGGLER_FACTOR * median_compute]


def ddp_figures(ranks: list[dict]) -> dict:
    """DDP's own exposed communication (comm - overlap) over the steady iterations every rank sampled: per
    iteration the least over ranks (the others hold the wait for that one), then the median."""
    common = set.intersection(*(set(r.get("ddp_iterations") or {}) for r in ranks))
    if not common:
        return {"ddp_exposed_s": None, "ddp_iterations": []}
    exposed, comm, overlap = [], [], []
    for iteration in sorted(common):
        figures = [r["ddp_iterations"][iteration] for r in ranks]
        least = min(figures, key=lambda f: f["comm_s"] - f["overlap_s"])
        exposed.append(least["comm_s"] - least["overlap_s"])
        comm.append(least["comm_s"])
        overlap.append(least["overlap_s"] / least["comm_s"] if least["comm_s"] else 0.0)
    return {"ddp_exposed_s": statistics.median(exposed), "ddp_exposed_spread": spread_of(exposed),
            "ddp_comm_s": statistics.median(comm), "ddp_overlap": statistics.median(overlap),
            "ddp_iterations": sorted(common)}


def trace_figures(ranks: list[dict]) -> dict:
    """The profiler trace's figures, when the run was profiled: the wait after backward's last operation on the
    rank that waited least (on the others it holds the wait for that one, as in DDP's figures), the
    collectives' time as the median over ranks."""
    traces = [r.get("trace") for r in ranks if r.get("trace")]
    if not traces:
        return {}
    exposed = [t["exposed_s"] for t in traces if t.get("exposed_s") is not None]
    return {"trace_exposed_s": min(exposed) if exposed else None,
            "trace_allreduce_s": statistics.median(t["allreduce_s"] for t in traces), "trace_steps": traces[0].get("steps")}


def from_trace(events) -> dict | None:
    """Communication figures of a profiler trace (torch.profiler FunctionEvents): per `backward` stage span,
    the time after its last autograd operation (what backward waited for: all-reduces and DDP's copies)
    and the summed duration of the collectives that overlap it; medians over the traced steps."""
    spans = [e for e in events if e.name == "backward"]
    if not spans:
        return None
    autograd = [e for e in events if e.name.startswith("autograd::engine::evaluate_function")]
    collectives = [e for e in events if e.name.startswith(("gloo:all_reduce", "nccl:all_reduce"))
                   or ("nccl" in e.name.lower() and "allreduce" in e.name.lower().replace("_", ""))]
    exposed, allreduce = [], []
    for span in spans:
        start, end = span.time_range.start, span.time_range.end
        inside = [e.time_range.end for e in autograd if start <= e.time_range.start <= end and e.thread == span.thread]
        if inside:
            exposed.append((end - max(inside)) / 1e6)
        allreduce.append(sum(min(e.time_range.end, end) - max(e.time_range.start, start) for e in collectives
                             if e.time_range.start < end and e.time_range.end > start) / 1e6)
    return {"steps": len(spans), "exposed_s": statistics.median(exposed) if exposed else None,
            "allreduce_s": statistics.median(allreduce)}


def table_lines(block: dict | None) -> list[str]:
    """The end-of-run table's communication lines."""
    if not block:
        return []
    if not block.get("measured"):
        return [f"communication: not measured ({block.get('reason')})", *instrument_lines(block)]
    line = (f"communication: exposed {block['exposed_s'] * 1e3:.1f} ms per step"
            + (f" ({block['exposed_share']:.1%} of the step)" if block["exposed_share"] is not None else "")
            + f", the buckets' all-reduces alone {block['total_allreduce_s'] * 1e3:.1f} ms"
            + (f", overlap {block['overlap']:.0%} of the {block['window_s'] * 1e3:.0f} ms communication window"
               if block["overlap"] is not None else "")
            + f", {block['allreduces_per_optimizer_step']:.1f} all-reduces per step")
    lines = [line]
    lines += instrument_lines(block)
    lines += [f"straggler: rank {s['rank']} computes {s['excess_s'] * 1e3:.1f} ms per step above the median rank"
              for s in block["stragglers"]]
    return lines


def instrument_lines(block: dict) -> list[str]:
    """DDP's own logger and the trace, beside trainscope's figures (or alone, with measuring off)."""
    lines = []
    if block.get("ddp_exposed_s") is not None:
        lines.append(f"  DDP's own logger: exposed {block['ddp_exposed_s'] * 1e3:.1f} ms, overlap "
                     f"{block['ddp_overlap']:.0%} of its {block['ddp_comm_s'] * 1e3:.0f} ms window (steady iterations "
                     f"{block['ddp_iterations']})")
    if block.get("trace_exposed_s") is not None:
        lines.append(f"  profiler trace: exposed {block['trace_exposed_s'] * 1e3:.1f} ms, collectives "
                     f"{block['trace_allreduce_s'] * 1e3:.1f} ms per traced step")
    return lines
