"""The one benchmark harness: alternating rounds, pair ratios, a verdict against noise, provenance.

Every comparison trainscope publishes (bench-overhead, bench-trainer, the loader sweep, compare_dp.py,
the experiments, make tune) runs its arms through `alternate`, reduces each pair to a ratio and
judges the ratios with `verdict`:

* rounds alternate the order of the arms (A B, then B A, ...: ABBA over two rounds), so a machine
  that drifts slower or faster during the benchmark hits every arm alike;
* each round gives one ratio per compared pair of arms (e.g. candidate speed / baseline speed);
* the verdict comes from the spread of those ratios, not from their median: *faster* when every
  ratio is above 1, *slower* when every ratio is below 1, *within noise* when they straddle 1.
  With fewer than `MIN_PAIRS` pairs there is no verdict ("too few pairs").

Results files are written by `write_results`: JSON and Markdown with the provenance header
(commit, dirty tree, exact command, date, machine, threads, packages) and redaction applied by the
record layer.
"""

import statistics
import time
from collections.abc import Callable
from pathlib import Path

from trainscope import provenance
from trainscope.records import write_json_atomic, write_text_atomic

MIN_PAIRS = 5
VERDICTS = ("faster", "slower", "within noise", "too few pairs")


def round_order(names: list[str], round_index: int) -> list[str]:
    """Arms in order on even rounds, reversed on odd ones (ABBA over two rounds of two arms)."""
    return list(names) if round_index % 2 == 0 else list(reversed(names))


def alternate(arms: dict[str, Callable[[int], dict]], rounds: int, log: Callable[[str], None] = print) -> list[dict]:
    """Run every arm once per round, alternating the order; returns one {arm: result} per round.

    An arm is called with the round index and returns a dict of measurements (e.g. samples_per_s).
    """
    if rounds < 1:
        raise ValueError("rounds must be at least 1")
    results = []
    for index in range(rounds):
        measured = {}
        for name in round_order(list(arms), index):
            started = time.perf_counter()
            measured[name] = arms[name](index)
            log(f"round {index + 1}/{rounds} {name}: " + _brief(measured[name])
                + f" ({time.perf_counter() - started:.0f} s)")
        results.append(measured)
    return results


def _brief(result: dict) -> str:
    return ", ".join(f"{k} {v:.4g}" for k, v in result.items() if isinstance(v, (int, float)) and not isinstance(v, bool))


def pair_ratios(rounds: list[dict], candidate: str, baseline: str, metric: str) -> list[float]:
    """candidate[metric] / baseline[metric] in every round."""
    return [r[candidate][metric] / r[baseline][metric] for r in rounds]


def verdict(ratios: list[float], min_pairs: int = MIN_PAIRS) -> str:
    """faster / slower / within noise from the spread of pair ratios (higher ratio = better)."""
    if len(ratios) < min_pairs:
        return "too few pairs"
    if min(ratios) > 1:
        return "faster"
    if max(ratios) < 1:
        return "slower"
    return "within noise"


def compare(ratios: list[float], min_pairs: int = MIN_PAIRS) -> dict:
    """Median with min-max of the pair ratios, and the verdict they support."""
    return {"pairs": len(ratios), "ratios": ratios, "median_ratio": statistics.median(ratios),
            "min_ratio": min(ratios), "max_ratio": max(ratios), "verdict": verdict(ratios, min_pairs)}


def spread(values: list[float]) -> dict:
    """Median with min and max of repeated measurements of one arm."""
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}


def ratio_text(comparison: dict) -> str:
    """'1.0037 (0.9940-1.0160, 5 pairs)': the median pair ratio with its range."""
    return (f"{comparison['median_ratio']:.4f} ({comparison['min_ratio']:.4f}-{comparison['max_ratio']:.4f}, "
            f"{comparison['pairs']} pairs)")


def describe(comparison: dict) -> str:
    """'1.0037 (0.9940-1.0160, 5 pairs): within noise' for the console."""
    return f"{ratio_text(comparison)}: {comparison['verdict']}"


def write_results(stem: Path, report: dict, markdown_lines: list[str], inputs: list[Path] = ()) -> list[Path]:
    """stem.json (report + provenance) and stem.md (provenance header + the given lines), atomically."""
    stem = Path(stem)
    report = {**report, "provenance": provenance.collect(inputs=inputs)}
    write_json_atomic(stem.with_suffix(".json"), report)
    text = "\n".join([*markdown_lines, "", *provenance.markdown(report["provenance"])]) + "\n"
    write_text_atomic(stem.with_suffix(".md"), text)
    return [stem.with_suffix(".json"), stem.with_suffix(".md")]
