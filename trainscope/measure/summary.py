"""Pure functions that turn per-rank measurements into a run summary. No torch, no I/O."""

import statistics

from trainscope.measure.timing import ALL_STAGES, CATEGORIES


def across_ranks(values: list[float]) -> dict:
    """Median and max over ranks: the median is the typical rank, the max the one everybody waits for."""
    return {"median": statistics.median(values), "max": max(values)}


def combine_ranks(per_rank: list[dict], phase: str) -> dict:
    """Median/max across ranks of wall, stage seconds, stage shares and categories for one phase."""
    tables = [rank["timing"][phase] for rank in per_rank]
    return {
        "wall_s": across_ranks([t["wall_s"] for t in tables]),
        "seconds": {s: across_ranks([t["seconds"][s] for t in tables]) for s in ALL_STAGES},
        "shares": {s: across_ranks([t["shares"][s] for t in tables]) for s in ALL_STAGES},
        "category_seconds": {c: across_ranks([t["category_seconds"][c] for t in tables]) for c in CATEGORIES},
    }


def throughput(per_rank: list[dict], phase: str) -> dict:
    """Global training samples/s and tokens/s of a phase: all ranks' samples over the slowest rank's
    training time (its wall time less evaluation, which trains nothing)."""
    wall = max(rank["timing"][phase]["wall_s"] - rank["timing"][phase]["seconds"]["eval"] for rank in per_rank)
    total = lambda key: sum(rank["counts"][phase].get(key) or 0 for rank in per_rank)
    samples, flops, padded, squares, real_squares = map(
        total, ("samples", "flops", "padded_tokens", "padded_squares", "squares")
    )
    steps = per_rank[0]["counts"][phase]["optimizer_steps"]
    tokens = total("tokens") or None  # a loop whose batches hold no tokens (trainscope.Run on any model) counts none
    return {
        "samples": samples,
        "tokens": tokens,
        "padded_tokens": padded or None,  # positions the kernels processed, padding included
        "padded_squares": squares or None,  # sum of batch x padded length^2: the attention term of the FLOPs
        "squares": real_squares or None,  # sum of each sequence's real length^2: the same on real tokens
        "flops": flops or None,  # the model FLOPs counted (PaLM) on the positions the kernels processed
        "optimizer_steps": steps,
        "train_wall_s": wall,
        "samples_per_s": samples / wall if wall > 0 else None,
        "tokens_per_s": tokens / wall if wall > 0 and tokens else None,
        "step_s": wall / steps if steps else None,
        # model FLOPs (PaLM formula, padded tokens) per device per second
        "tflops_per_device": flops / wall / len(per_rank) / 1e12 if wall > 0 and flops else None,
    }


def memory_across_ranks(per_rank: list[dict]) -> dict:
    keys = sorted({k for rank in per_rank for k, v in rank["memory"].items() if isinstance(v, (int, float))})
    return {k: across_ranks([rank["memory"][k] for rank in per_rank if k in rank["memory"]]) for k in keys}


# ---------------------------------------------------------------- the device's busy time and idle share

# The stages of a training step (evaluation is kept out, as in `throughput`).
STEP_STAGES = ("data", "forward", "backward", "optimizer")
# Idle above this share of each step, and the run is host-bound: the device waits for the host (the advisor's
# host_bound rule speaks).
HOST_BOUND_IDLE = 0.30
# The stages' device time can exceed the steps' wall time only by what the two clocks cannot resolve, stated before
# measuring: 1% of the wall time (the device's and the host's clock rates, the wall's edges at a synchronize) plus
# 2 us per event span (CUDA events stamp to about 0.5 us). Beyond it the figures disagree: warning
# device_busy_above_wall, and no idle share is given (never clamped).
CLOCK_RATE_TOLERANCE = 0.01
EVENT_SPAN_TOLERANCE_S = 2e-6
EVENT_SPANS_BASIS = (
    "the device time between each training stage's begin and end CUDA events (data, forward, backward, optimizer), "
    "steady steps, per optimizer step: an upper bound on the device's busy time on the stages' work, since a span "
    "also holds the device's gaps between kernels (where the host is slower than the device, a span is the host's "
    "time); so the idle share, 1 - that / the step's host wall time, is a lower bound (the loop's bookkeeping "
    "kernels outside the stages, a few token counts a micro-batch, are counted idle)"
)
DEVICE_TIME_KEYS = tuple(
    "basis phase threshold steps step_wall_s stage_spans_s busy_at_most_s idle_share_at_least tolerance_s over_wall "
    "kernel_estimate kernel_estimate_reason host_bound host_bound_by reason".split()
)
KERNEL_ESTIMATE_BASIS = (
    "an estimate: forward and backward as one encoder layer's kernel time (profiled apart at the run's shapes, "
    "summary.measured_peak.run_shapes.layer) x the layers x the micro-batches of a step (the embeddings, head and "
    "loss left out; at most the two stages' spans), plus the data and optimizer stages' event spans (upper bounds) "
    "and the exposed communication"
)


def device_time(
    per_rank: list[dict],
    phase: str,
    mode: str,
    run_shapes: dict | None = None,
    recomputed: bool = False,
    communication: dict | None = None,
) -> dict:
    """How busy the device was in each training step of `phase` (median over ranks): the CUDA events' bound, the
    kernel estimate and the host-bound verdict (docs/timing.md#the-devices-idle-share); every figure None, with the
    reason, without device events."""
    block = dict.fromkeys(DEVICE_TIME_KEYS) | {"basis": EVENT_SPANS_BASIS, "phase": phase, "over_wall": []}
    block["threshold"] = HOST_BOUND_IDLE
    if mode != "events":
        why = (
            "host clocks (work on a CPU is synchronous: the host's time is the device's)"
            if mode == "host"
            else "--timing sync (the host clock after a synchronize at every stage boundary: the device never runs "
            "ahead, so its idle time is not seen; --timing events measures it)"
        )
        return {**block, "reason": f"not applicable: {why}"}
    ranks = []
    for rank in per_rank:
        table, counts = rank["timing"][phase], rank["counts"][phase]
        steps = counts.get("optimizer_steps") or 0
        if not steps or table["wall_s"] - table["seconds"]["eval"] <= 0:
            continue
        spans = {stage: table["seconds"][stage] / steps for stage in STEP_STAGES}
        wall = (table["wall_s"] - table["seconds"]["eval"]) / steps  # the training step, as `throughput`'s
        micro_batches = (counts.get("micro_batches") or steps) / steps
        busy = sum(spans.values())
        tolerance = CLOCK_RATE_TOLERANCE * wall + EVENT_SPAN_TOLERANCE_S * len(STEP_STAGES) * micro_batches
        ranks.append(
            {"rank": rank.get("rank"), "steps": steps, "spans": spans, "wall": wall, "busy": busy, "tol": tolerance}
        )
    if not ranks:
        return {**block, "reason": f"no optimizer steps in the {phase} phase"}
    over = [
        {"rank": r["rank"], "busy_s": r["busy"], "wall_s": r["wall"], "tolerance_s": r["tol"]}
        for r in ranks
        if r["busy"] > r["wall"] + r["tol"]
    ]
    median = lambda key: statistics.median(r[key] for r in ranks)
    spans = {stage: statistics.median(r["spans"][stage] for r in ranks) for stage in STEP_STAGES}
    wall, busy = median("wall"), median("busy")
    block.update(steps=ranks[0]["steps"], step_wall_s=wall, stage_spans_s=spans, busy_at_most_s=busy, over_wall=over)
    block["tolerance_s"] = median("tol")
    if over:
        return {**block, "reason": "the stages' device time is above the steps' wall time beyond the tolerance"}
    # within the tolerance the two clocks agree: a busy time that reads a hair above the wall is the whole wall
    block["idle_share_at_least"] = statistics.median(max(0.0, 1.0 - r["busy"] / r["wall"]) for r in ranks)
    micro_batches = (per_rank[0]["counts"][phase].get("micro_batches") or ranks[0]["steps"]) / ranks[0]["steps"]
    estimate, why = kernel_estimate(spans, wall, micro_batches, run_shapes, recomputed, len(per_rank), communication)
    block["kernel_estimate"], block["kernel_estimate_reason"] = estimate, why
    if block["idle_share_at_least"] > HOST_BOUND_IDLE:
        block["host_bound"], block["host_bound_by"] = True, "event spans"
    elif estimate is not None:
        block["host_bound"] = estimate["idle_share"] > HOST_BOUND_IDLE
        block["host_bound_by"] = "kernel estimate"
    return block


def kernel_estimate(
    spans: dict,
    wall: float,
    micro_batches: float,
    run_shapes: dict | None,
    recomputed: bool,
    processes: int,
    communication: dict | None,
) -> tuple[dict | None, str | None]:
    """The step's device time estimated from kernel times (KERNEL_ESTIMATE_BASIS) and its idle share; (None, why)
    where it cannot be told."""
    layer = (run_shapes or {}).get("layer") or {}
    layers = (run_shapes or {}).get("layers")
    if not layer.get("window_s") or not layers:
        return None, "no encoder layer profiled at the run's shapes (summary.measured_peak.run_shapes.layer)"
    if layer.get("basis") != "self device time":
        return None, f"the layer's profile holds {layer.get('basis')}, not device time"
    if recomputed:
        return None, "activation checkpointing recomputes the forward in backward: not in the layer's profile"
    exposed = 0.0
    if processes > 1:
        block = communication or {}
        if not (block.get("measured") and block.get("exposed_resolved") and block.get("exposed_s") is not None):
            return None, (
                "several processes: the backward's span holds the wait for the all-reduce, whose exposed time is "
                "not resolved"
            )
        exposed = block["exposed_s"]
    layer_s = layer["window_s"]
    compute_spans = spans["forward"] + spans["backward"]
    forward_backward = min(layers * layer_s * micro_batches + exposed, compute_spans)
    busy = forward_backward + spans["data"] + spans["optimizer"]
    return {
        "basis": KERNEL_ESTIMATE_BASIS,
        "busy_s": busy,
        "idle_share": max(0.0, 1.0 - busy / wall) if wall > 0 else None,
        "forward_backward_s": forward_backward,
        "layer_s": layer_s,
        "layers": layers,
        "micro_batches_per_step": micro_batches,
        "exposed_communication_s": exposed,
    }, None
