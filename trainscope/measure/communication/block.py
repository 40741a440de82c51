"""The summary's communication block, combined across ranks from every rank's measurements, and its lines in the
end-of-run table. Per step the rank whose exposed time is least arrived last at the all-reduce: its exposed time is
the communication's, every other rank's excess its wait for that rank. Only durations on each rank's own clock are
compared, so ranks on different hosts compare correctly.
"""

import statistics

from trainscope.core.communication_view import hidden_share, resolved
from trainscope.measure.communication.agreement import (
    by_iteration,
    ddp_agreement,
    median_interval,
    spread_of,
    trace_agreement,
    trace_figures,
)
from trainscope.measure.communication.measured import METHOD, bus_bandwidth_gbs

# A rank is a straggler when it is the last to arrive in most steps and the others wait more than this share of
# a step for it.
STRAGGLER_SHARE = 0.10


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
        **layout_figures(first),
        **transfer_figures(ranks, first, world),
    }
    rows = step_rows(ids, ranks)
    block.update({**ddp_figures(ranks), **trace_figures(ranks)})
    if not first["measured"] or not rows:
        block["agreement"] = {}
        why = "--measure-communication off" if not first["measured"] else "no steady step measured on every rank"
        return {"measured": False, "reason": why, **block}
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
    block["agreement"] = {"ddp": ddp_agreement(ranks), "trace": trace_agreement(ranks)}
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


def layout_figures(rank: dict) -> dict:
    """What DDP sends: one all-reduce per bucket per synchronizing step (the rebuilt buckets: steady steps)."""
    buckets = rank.get("buckets")
    steps, micro = rank.get("optimizer_steps") or 0, rank.get("micro_batches") or 0
    if not buckets:
        unknown = ("buckets", "allreduces_per_optimizer_step", "allreduces_per_micro_batch", "allreduce_bytes_per_step")
        return {"gradient_bytes": rank["gradient_bytes"], **dict.fromkeys(unknown)}
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


def ddp_figures(ranks: list[dict]) -> dict:
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
            + (  # both instruments on the iterations DDP sampled: the pairs the verdict judged
                f"; on the iterations it sampled ({ddp['iterations'][0]}-{ddp['iterations'][-1]}) exposed "
                f"{ms(ddp['ddp_exposed_s'])} ms against trainscope's {ms(ddp['exposed_s'])} ms"
                if ddp and ddp.get("exposed_s") is not None
                else ""
            )
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
