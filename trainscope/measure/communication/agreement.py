"""DDP communication's second instruments: DDP's own logger and the profiler's trace, judged against trainscope's
figures on the same steps by `agreement`.

How it works: docs/ddp.md#in-the-code-how-the-communication-is-checked-trainscopemeasurecommunicationagreementpy.
"""

import statistics

from trainscope.measure import bench

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
# Python hook's delay after the reducer's C++ one (its size in the committed CPU runs: docs/benchmarks.md#committed-results),
# not TOLERANCE_SHARE.
# The independent instruments are the planted delays (tests) and the profiler's trace.
SAME_EVENTS_TOLERANCE_S = {"host": 0.003, "cuda events": 0.0002}


# ---------------------------------------------------------------- statistics (pure)


def median_interval(values: list[float], confidence: float = CONFIDENCE) -> tuple[float, float] | None:
    """Distribution-free confidence interval of the median (trainscope.measure.bench.median_interval, Conover 1999,
    3.2); None with fewer values than any such interval needs (6 for 95%)."""
    found = bench.median_interval(values, confidence) if values else None
    return (found["low"], found["high"]) if found and found["confidence"] >= confidence else None


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
    return bench.spread(values) if values else None


# ---------------------------------------------------------------- DDP's logger and the profiler's trace (pure)


def by_iteration(rank: dict) -> dict:
    return {d["iteration"]: d for d in rank.get("ddp_iterations") or []}


def ddp_agreement(ranks: list[dict]) -> dict:
    """trainscope's exposed time and overlap against DDP's logger on exactly the iterations DDP sampled (warm-up
    ones too): one pair per rank and iteration, not a median over ranks (each rank's hooks and its reducer stamp that
    rank's own events; one descheduled rank would move a median over two by half its delay)."""
    ours = [{e["iteration"]: e for e in r["steps"] if e.get("exposed_s") is not None} for r in ranks]
    theirs = [by_iteration(r) for r in ranks]
    paired = sorted(set.intersection(*(set(o) & set(t) for o, t in zip(ours, theirs))))
    if not paired:
        return {"pairs": 0, "verdict": "undecided", "iterations": []}
    differences = [o[i]["exposed_s"] - t[i]["exposed_s"] for i in paired for o, t in zip(ours, theirs)]
    # Each instrument's exposure over the same iterations (least over ranks: the others' excess is wait, not
    # communication), beside the verdict
    least = lambda per_rank: statistics.median(min(r[i]["exposed_s"] for r in per_rank) for i in paired)  # noqa: E731
    result = {
        **agreement(differences, same_events_tolerance(ranks[0].get("clock", "host"))),
        "iterations": paired,
        "exposed_s": least(ours),
        "ddp_exposed_s": least(theirs),
        "instrument": "the same reducer events: an implementation check",
    }
    windows = [i for i in paired if all(o[i]["overlap"] is not None for o in ours)]
    if windows:
        result["overlap"] = agreement(
            [o[i]["overlap"] - t[i]["overlap"] for i in windows for o, t in zip(ours, theirs)],
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


def trace_figures(ranks: list[dict]) -> dict:
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


def trace_agreement(ranks: list[dict]) -> dict | None:
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
    """Communication figures of a profiler trace (torch.profiler FunctionEvents), per `backward` stage span in order:
    {spans, exposed_s, allreduce_s, basis, unphysical}: from the device kernels the span's operators launched on a
    GPU, from its autograd operations on the host (docs/ddp.md, the trace). An exposed time that comes out negative
    is no time: None, counted in `unphysical`, never clamped to 0."""
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
