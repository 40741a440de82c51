"""Pure functions that turn per-rank measurements into a run summary. No torch, no I/O."""

import statistics

from trainscope.timing import ALL_STAGES, CATEGORIES


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
    samples = sum(rank["counts"][phase]["samples"] for rank in per_rank)
    tokens = sum(rank["counts"][phase]["tokens"] for rank in per_rank)
    flops = sum(rank["counts"][phase].get("flops") or 0 for rank in per_rank)
    padded = sum(rank["counts"][phase].get("padded_tokens") or 0 for rank in per_rank)
    squares = sum(rank["counts"][phase].get("padded_squares") or 0 for rank in per_rank)
    real_squares = sum(rank["counts"][phase].get("squares") or 0 for rank in per_rank)
    steps = per_rank[0]["counts"][phase]["optimizer_steps"]
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
        "tokens_per_s": tokens / wall if wall > 0 else None,
        "step_s": wall / steps if steps else None,
        # model FLOPs (PaLM formula, padded tokens) per device per second
        "tflops_per_device": flops / wall / len(per_rank) / 1e12 if wall > 0 and flops else None,
    }


def memory_across_ranks(per_rank: list[dict]) -> dict:
    keys = sorted({k for rank in per_rank for k, v in rank["memory"].items() if isinstance(v, (int, float))})
    return {k: across_ranks([rank["memory"][k] for rank in per_rank if k in rank["memory"]]) for k in keys}
