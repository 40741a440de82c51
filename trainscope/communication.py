"""What DDP communication costs, measured inside the run on every rank, on any backend.

DDP all-reduces gradient buckets during backward, so part of the all-reduce hides behind the rest of
backward and part is exposed: backward waits for it. trainscope measures the exposed part directly:

* **calibration steps** (a few, spread over the steady phase): the step's last backward runs under
  `no_sync()` (no all-reduce), timed, and the gradients are then all-reduced once, timed on their
  own, the same way DDP's default hook does it (divide by the world size, sum). The update is the
  one DDP would have made (the same elementwise arithmetic), so the run's result does not change.
* **reference steps** (the step before each calibration step): a normal backward with DDP's
  all-reduce, timed.

exposed communication = median(synced backward) - median(unsynced backward), per rank
total communication   = the calibration all-reduce's transfer time: its shortest duration across
                        ranks (a rank that arrives early waits for the others; its excess is wait)
overlap               = 1 - exposed / total

Per rank also: compute (forward + unsynced backward) with a straggler flag (> 10% above the median
rank), the wait at the collective, gradient bytes, and all-reduce calls counted by a communication
hook that wraps DDP's own (plain, fp16 or bf16 compression). DDP's own statistics
(`_get_ddp_logging_data`: average backward compute, communication and their overlap, sampled by
DDP on early iterations and then 1 in 100) are recorded beside them as a cross-check. Timing points
synchronize the device, only on calibration and reference steps.
"""

import contextlib
import functools
import statistics
import time

import torch

from trainscope.errors import UserError
from trainscope.timing import synchronizer

STRAGGLER_FACTOR = 1.10
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


class NoCommunication:
    """Single-process runs, FSDP, or --measure-communication off: nothing to measure."""

    reason = None

    def settings_in_effect(self) -> dict | None:
        return None

    def calibration_for(self, step: int, phase: str):
        return None

    def rank_summary(self, counts: dict) -> dict | None:
        return None


def build(settings, accelerator, model, total_steps: int):
    """The communication measurement for this run (a do-nothing one where there is nothing to measure).
    With --measure-communication off the hook still counts all-reduces (and compresses, if asked), but
    no calibration step runs."""
    ddp = model if isinstance(model, torch.nn.parallel.DistributedDataParallel) else None
    if ddp is None or accelerator.num_processes < 2:
        return NoCommunication()
    if settings.ddp_comm_hook == "bf16" and accelerator.state.backend not in ("nccl", "xccl"):
        raise UserError(f"--ddp-comm-hook bf16 needs NCCL (CUDA) or XCCL; {accelerator.state.backend} cannot "
                        "all-reduce bf16: use fp16 or none")
    return Communication(settings, accelerator, ddp, settings.measure_communication != "off", total_steps)


class HookCounter:
    """Counts the all-reduces and bytes of the DDP communication hook it wraps (`hook` is what DDP gets)."""

    def __init__(self, kind: str):
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        self.kind = kind
        inner = {"none": default_hooks.allreduce_hook, "fp16": default_hooks.fp16_compress_hook,
                 "bf16": default_hooks.bf16_compress_hook}[kind]
        element_bytes = 2 if kind in ("fp16", "bf16") else None
        self.calls = 0
        self.bytes = 0

        @functools.wraps(inner)  # DDP reads the hook's name (bf16 support checks, its logging)
        def hook(state, bucket):
            buffer = bucket.buffer()
            self.calls += 1
            self.bytes += buffer.numel() * (element_bytes or buffer.element_size())
            return inner(state, bucket)

        self.hook = hook


class Communication:
    def __init__(self, settings, accelerator, ddp, measure: bool, total_steps: int):
        self.accelerator, self.ddp, self.measure = accelerator, ddp, measure
        self.world = accelerator.num_processes
        self.synchronize = synchronizer(accelerator.device) or (lambda: None)
        self.hook = HookCounter(settings.ddp_comm_hook)
        ddp.register_comm_hook(state=None, hook=self.hook.hook)
        self.parameters = [p for p in ddp.parameters() if p.requires_grad]
        self.gradient_bytes = sum(p.numel() * p.element_size() for p in self.parameters)
        self.calibration_steps = schedule(settings.timing_warmup_steps, total_steps,
                                          settings.communication_samples) if measure else []
        self.samples = {"synced_backward_s": [], "unsynced_backward_s": [], "allreduce_s": [], "compute_s": []}

    def settings_in_effect(self) -> dict:
        """The DDP settings read back from the wrapped model (what really reached DDP)."""
        return {"bucket_cap_mb": self.ddp.bucket_bytes_cap / 2**20, "gradient_as_bucket_view": self.ddp.gradient_as_bucket_view,
                "static_graph": self.ddp.static_graph, "find_unused_parameters": self.ddp.find_unused_parameters,
                "comm_hook": self.hook.kind, "measure_communication": self.measure,
                "calibration_steps": self.calibration_steps}

    def calibration_for(self, step: int, phase: str):
        if step in self.calibration_steps:
            return Calibration(self, no_sync=True)
        if step + 1 in self.calibration_steps:
            return Calibration(self, no_sync=False)  # the reference step before a calibration step
        return None

    def allreduce_gradients(self) -> None:
        """All-reduce the local gradients once, as DDP's hook would: divide by the world size, then sum
        (in fp16/bf16 with a compression hook)."""
        grads = [p.grad for p in self.parameters if p.grad is not None]
        flat = torch.cat([g.reshape(-1) for g in grads])
        dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}.get(self.hook.kind)
        buffer = flat.to(dtype).div_(self.world) if dtype else flat.div_(self.world)
        torch.distributed.all_reduce(buffer)
        flat = buffer.to(flat.dtype) if dtype else buffer
        offset = 0
        for g in grads:
            g.copy_(flat[offset:offset + g.numel()].view_as(g))
            offset += g.numel()

    def rank_summary(self, counts: dict) -> dict:
        """This rank's measurements; `counts` are the loop's {phase: {optimizer_steps, micro_batches}}."""
        s = self.samples
        calibrated = len(s["unsynced_backward_s"])  # steps whose all-reduce did not go through DDP's hook
        steps = sum(c["optimizer_steps"] for c in counts.values()) - calibrated
        micro_batches = sum(c["micro_batches"] for c in counts.values()) - calibrated
        summary = {"measured": bool(s["unsynced_backward_s"] and s["synced_backward_s"]),
                   "gradient_bytes": self.gradient_bytes, "allreduce_calls": self.hook.calls,
                   "allreduce_bytes": self.hook.bytes,
                   "allreduces_per_optimizer_step": self.hook.calls / steps if steps > 0 else None,
                   "allreduces_per_micro_batch": self.hook.calls / micro_batches if micro_batches > 0 else None,
                   "samples": s, "ddp_logging": ddp_logging(self.ddp)}
        if summary["measured"]:
            synced, unsynced = statistics.median(s["synced_backward_s"]), statistics.median(s["unsynced_backward_s"])
            summary.update(synced_backward_s=synced, unsynced_backward_s=unsynced, exposed_s=max(0.0, synced - unsynced),
                           allreduce_s=statistics.median(s["allreduce_s"]), compute_s=statistics.median(s["compute_s"]))
        return summary


def schedule(warmup: int, total: int, samples: int) -> list[int]:
    """Calibration steps spread over the steady phase, at least two apart: the step before each one is its
    reference (a normal step) and lies in the steady phase too."""
    first = warmup + 2
    steps = []
    for i in range(max(0, samples)):
        step = first + round((total - first) * i / max(1, samples))
        if first <= step <= total and (not steps or step >= steps[-1] + 2):
            steps.append(step)
    return steps


class Calibration:
    """One measured micro-batch: with no_sync and a separate all-reduce (calibration), or as DDP does it
    (reference). DDP decides in the forward whether the backward all-reduces, so `measuring` wraps the
    forward as well as the backward (train_step enters it around both)."""

    def __init__(self, communication: Communication, no_sync: bool):
        self.communication, self.no_sync = communication, no_sync
        self.started = None

    @contextlib.contextmanager
    def measuring(self, model):
        self.communication.synchronize()
        self.started = time.perf_counter()
        with model.no_sync() if self.no_sync else contextlib.nullcontext():
            yield

    def backward(self, accelerator, loss) -> None:
        c = self.communication
        c.synchronize()
        backward_started = time.perf_counter()
        accelerator.backward(loss)
        c.synchronize()
        computed = time.perf_counter()
        if not self.no_sync:
            c.samples["synced_backward_s"].append(computed - backward_started)
            return
        c.allreduce_gradients()  # a plain collective: no_sync only silences DDP's reducer
        c.synchronize()
        c.samples["unsynced_backward_s"].append(computed - backward_started)
        c.samples["allreduce_s"].append(time.perf_counter() - computed)
        c.samples["compute_s"].append(computed - self.started)


def ddp_logging(ddp) -> dict | None:
    """DDP's own averages (nanoseconds in DDP, seconds here), where this torch provides them."""
    try:
        data = ddp._get_ddp_logging_data()
    except (AttributeError, RuntimeError):
        return None
    keys = {"avg_backward_compute_time": "backward_compute_s", "avg_backward_comm_time": "backward_comm_s",
            "avg_backward_compute_comm_overlap_time": "overlap_s", "avg_forward_compute_time": "forward_compute_s"}
    facts = {ours: data[theirs] / 1e9 for theirs, ours in keys.items() if theirs in data}
    facts["bucket_sizes"] = data.get("rebuilt_bucket_sizes") or data.get("bucket_sizes")
    return facts


# ---------------------------------------------------------------- across ranks (pure)


def combine(per_rank: list[dict], throughput: dict) -> dict | None:
    """The summary's communication block from every rank's measurements."""
    ranks = [r.get("communication") for r in per_rank]
    if not ranks or ranks[0] is None:
        return None
    if not all(r.get("measured") for r in ranks):
        return {"measured": False, "reason": "no calibration step ran (--measure-communication off, or too few "
                "steady steps)", "allreduces_per_optimizer_step": ranks[0].get("allreduces_per_optimizer_step"),
                "allreduces_per_micro_batch": ranks[0].get("allreduces_per_micro_batch")}
    world = len(ranks)
    step_s = throughput.get("step_s") or 0.0
    transfers = [min(samples) for samples in zip(*[r["samples"]["allreduce_s"] for r in ranks])]
    total = statistics.median(transfers)
    median_compute = statistics.median(r["compute_s"] for r in ranks)
    rows = []
    for index, r in enumerate(ranks):
        waits = [mine - least for mine, least in zip(r["samples"]["allreduce_s"], transfers)]
        rows.append({"rank": per_rank[index]["rank"], "compute_s": r["compute_s"], "exposed_s": r["exposed_s"],
                     "exposed_share": r["exposed_s"] / step_s if step_s else None,
                     "wait_s": statistics.median(waits), "synced_backward_s": r["synced_backward_s"],
                     "unsynced_backward_s": r["unsynced_backward_s"], "ddp_logging": r["ddp_logging"]})
    exposed = statistics.median(row["exposed_s"] for row in rows)
    bytes_per_step = ranks[0]["allreduce_bytes"] / max(1, ranks[0]["allreduce_calls"]) * ranks[0]["allreduces_per_optimizer_step"]
    # flagged: compute more than 10% above the median rank; its delay: against the median of the other ranks
    stragglers = [{"rank": row["rank"], "compute_s": row["compute_s"],
                   "excess_s": row["compute_s"] - statistics.median(r["compute_s"] for r in rows if r is not row)}
                  for row in rows if median_compute and row["compute_s"] > STRAGGLER_FACTOR * median_compute]
    return {
        "measured": True, "world_size": world, "calibration_samples": len(transfers), "per_rank": rows,
        "exposed_s": exposed, "exposed_share": exposed / step_s if step_s else None,
        "total_allreduce_s": total, "overlap": max(0.0, 1 - exposed / total) if total else None,
        "gradient_bytes": ranks[0]["gradient_bytes"], "allreduce_bytes_per_step": bytes_per_step,
        "bus_bandwidth_gbs": 2 * (world - 1) / world * ranks[0]["gradient_bytes"] / total / 1e9 if total else None,
        "allreduces_per_optimizer_step": ranks[0]["allreduces_per_optimizer_step"],
        "allreduces_per_micro_batch": ranks[0]["allreduces_per_micro_batch"],
        "stragglers": stragglers,
        **measurement_cost(ranks[0], len(transfers), per_rank[0]["timing"]["run"]["wall_s"]),
    }


def measurement_cost(rank: dict, samples: int, wall_s: float) -> dict:
    """What calibration cost: each calibrated backward plus its separate all-reduce against a normal backward."""
    extra = samples * max(0.0, rank["unsynced_backward_s"] + rank["allreduce_s"] - rank["synced_backward_s"])
    return {"measurement_overhead_s": extra, "measurement_overhead_share": extra / wall_s if wall_s else None}


def table_lines(block: dict | None) -> list[str]:
    """The end-of-run table's communication lines."""
    if not block:
        return []
    if not block.get("measured"):
        return [f"communication: not measured ({block.get('reason')})"]
    lines = [f"communication: exposed {block['exposed_s'] * 1e3:.1f} ms per step"
             + (f" ({block['exposed_share']:.1%} of the step)" if block["exposed_share"] is not None else "")
             + f", all-reduce alone {block['total_allreduce_s'] * 1e3:.1f} ms"
             + (f", overlap {block['overlap']:.0%}" if block["overlap"] is not None else "")
             + f", {block['allreduces_per_optimizer_step']:.1f} all-reduces per step"]
    lines += [f"straggler: rank {s['rank']} computes {s['excess_s'] * 1e3:.1f} ms per step above the median rank"
              for s in block["stragglers"]]
    return lines
