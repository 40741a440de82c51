"""The one benchmark harness: alternating rounds, a stated test with an effect size, provenance.

Every comparison trainscope publishes (bench-overhead, bench-trainer, the loader sweep, compare_dp.py,
the experiments, make tune) runs its arms through `alternate` and judges them with `compare_samples`:

* rounds alternate the order of the arms (A B, then B A, ...: ABBA over two rounds), so a machine
  that drifts slower or faster during the benchmark hits every arm alike;
* the verdict comes from a stated test, as Google Benchmark's compare.py decides: a two-sided
  Mann-Whitney U test of the two arms' measurements (exact permutation distribution of the rank sum,
  ties as mid-ranks), at ALPHA = 0.05, *and* a minimum effect (asv's idea of a factor): the median of
  the per-round speed ratios must be at least 1 + MIN_EFFECT (faster) or at most 1 / (1 + MIN_EFFECT)
  (slower). Anything else is *within noise*. With fewer than `MIN_PAIRS` rounds: *too few pairs*
  (4 against 4 is the fewest whose best p-value, 0.029, can pass 0.05; 5 are asked).
* several trials against one baseline (make tune) correct their p-values for their number (Holm 1979)
  before judging, and `make tune` adds rounds while a trial is undecided, as Chromium's Pinpoint adds
  runs while its answer is unknown.

Results files are written by `write_results`: JSON and Markdown with the provenance header
(commit, dirty tree, exact command, date, machine, threads, packages) and redaction applied by the
record layer.
"""

import argparse
import itertools
import math
import statistics
import time
from collections.abc import Callable
from pathlib import Path

from trainscope import provenance
from trainscope.records import write_json_atomic, write_text_atomic

MIN_PAIRS = 5
MIN_DECIDABLE = 4  # the fewest pairs whose exact two-sided p-value (2/70 = 0.029) can pass ALPHA
ALPHA = 0.05
MIN_EFFECT = 0.03  # a speed ratio within 3% of 1 is no change worth acting on, however significant
METHOD = f"two-sided Mann-Whitney U, alpha {ALPHA}, minimum effect {MIN_EFFECT:.0%}"
EXACT_LIMIT = 200_000  # combinations enumerated for the exact p-value; beyond: the normal approximation


def round_order(names: list[str], round_index: int) -> list[str]:
    """Arms in order on even rounds, reversed on odd ones (ABBA over two rounds of two arms)."""
    return list(names) if round_index % 2 == 0 else list(reversed(names))


def alternate(arms: dict[str, Callable[[int], dict]], rounds: int, log: Callable[[str], None] = print,
              first_round: int = 0) -> list[dict]:
    """Run every arm once per round, alternating the order; returns one {arm: result} per round.

    An arm is called with the round index and returns a dict of measurements (e.g. samples_per_s).
    """
    if rounds < 1:
        raise ValueError("rounds must be at least 1")
    results = []
    for index in range(first_round, first_round + rounds):
        measured = {}
        for name in round_order(list(arms), index):
            started = time.perf_counter()
            measured[name] = arms[name](index)
            log(f"round {index + 1} {name}: " + _brief(measured[name]) + f" ({time.perf_counter() - started:.0f} s)")
        results.append(measured)
    return results


def _brief(result: dict) -> str:
    return ", ".join(f"{k} {v:.4g}" for k, v in result.items() if isinstance(v, (int, float)) and not isinstance(v, bool))


# ---------------------------------------------------------------- the test


def mann_whitney_p(x: list[float], y: list[float]) -> float:
    """Two-sided p-value of the Mann-Whitney U test (Wilcoxon rank-sum) for samples x and y.

    Exact: the rank sum of x under every assignment of the pooled mid-ranks to the two samples
    (ties keep their mid-ranks), when there are at most EXACT_LIMIT assignments; else the normal
    approximation with a tie correction. p = P(|W - E W| >= |w - E W|) under the null hypothesis that
    both samples come from one distribution.
    """
    n, m = len(x), len(y)
    if n == 0 or m == 0:
        return 1.0
    pooled = sorted((v, i) for i, v in enumerate(list(x) + list(y)))
    ranks = [0.0] * (n + m)
    i = 0
    while i < n + m:
        j = i
        while j + 1 < n + m and pooled[j + 1][0] == pooled[i][0]:
            j += 1
        for k in range(i, j + 1):
            ranks[pooled[k][1]] = (i + j) / 2 + 1
        i = j + 1
    observed, expected = sum(ranks[:n]), n * (n + m + 1) / 2
    distance = abs(observed - expected) - 1e-9
    if math.comb(n + m, n) <= EXACT_LIMIT:
        sums = [sum(c) for c in itertools.combinations(ranks, n)]
        return sum(abs(s - expected) >= distance for s in sums) / len(sums)
    ties = sum(c ** 3 - c for c in _tie_counts(ranks))
    variance = n * m / 12 * ((n + m + 1) - ties / ((n + m) * (n + m - 1)))
    z = distance / math.sqrt(variance) if variance > 0 else 0.0
    return math.erfc(z / math.sqrt(2))


def _tie_counts(ranks: list[float]) -> list[int]:
    counts = {}
    for r in ranks:
        counts[r] = counts.get(r, 0) + 1
    return [c for c in counts.values() if c > 1]


def holm(p_values: list[float]) -> list[float]:
    """Holm's step-down adjustment of several p-values tested together (Holm 1979): the k-th smallest is
    multiplied by (m - k + 1), and adjusted values never decrease in that order."""
    order = sorted(range(len(p_values)), key=p_values.__getitem__)
    adjusted, running = [0.0] * len(p_values), 0.0
    for rank, index in enumerate(order):
        running = max(running, min(1.0, (len(p_values) - rank) * p_values[index]))
        adjusted[index] = running
    return adjusted


def verdict(median_ratio: float, p_value: float, pairs: int, min_pairs: int = MIN_PAIRS,
            alpha: float = ALPHA, min_effect: float = MIN_EFFECT) -> str:
    """faster / slower / within noise / too few pairs, from the test and the effect (higher ratio = faster)."""
    if pairs < min_pairs:
        return "too few pairs"
    if p_value < alpha and median_ratio >= 1 + min_effect:
        return "faster"
    if p_value < alpha and median_ratio <= 1 / (1 + min_effect):
        return "slower"
    return "within noise"


def compare_samples(baseline: list[float], candidate: list[float], higher_is_better: bool = True,
                    min_pairs: int = MIN_PAIRS, p_value: float | None = None) -> dict:
    """The candidate arm against the baseline: per-round speed ratios (candidate over baseline, inverted
    for times), their median with min-max, the test's p-value (or a corrected one passed in) and the
    verdict they support."""
    pairs = min(len(baseline), len(candidate))
    ratios = [(c / b if higher_is_better else b / c) for b, c in zip(baseline, candidate)]
    p = mann_whitney_p(list(baseline), list(candidate)) if p_value is None else p_value
    median = statistics.median(ratios)
    return {"pairs": pairs, "ratios": ratios, "median_ratio": median, "min_ratio": min(ratios),
            "max_ratio": max(ratios), "p_value": p, "test": METHOD,
            "verdict": verdict(median, p, pairs, min_pairs)}


def compare_rounds(rounds: list[dict], candidate: str, baseline: str, metric: str, higher_is_better: bool = True,
                   min_pairs: int = MIN_PAIRS) -> dict:
    """`compare_samples` of one metric of two arms measured in the same alternating rounds."""
    return compare_samples([r[baseline][metric] for r in rounds], [r[candidate][metric] for r in rounds],
                           higher_is_better, min_pairs)


# Student's t, two-sided 95% (0.975 quantile), by degrees of freedom (standard tables); 1.96 beyond 30.
T_975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262, 10: 2.228,
         12: 2.179, 15: 2.131, 20: 2.086, 30: 2.042}


def t_975(df: int) -> float:
    """The two-sided 95% Student's t quantile for `df` degrees of freedom (the next smaller tabled df: wider)."""
    if df < 1:
        raise ValueError("a t quantile needs at least one degree of freedom")
    return 1.96 if df > 30 else T_975[max(d for d in T_975 if d <= df)]


def prediction_interval(values: list[float]) -> tuple[float, float]:
    """The 95% prediction interval of one more measurement like `values` (normal, unknown variance):
    mean +- t(n-1) * s * sqrt(1 + 1/n). Where a new value falls outside it, it is not like the others."""
    n, mean = len(values), statistics.fmean(values)
    half = t_975(n - 1) * statistics.stdev(values) * math.sqrt(1 + 1 / n)
    return mean - half, mean + half


def spread(values: list[float]) -> dict:
    """Median with min and max of repeated measurements of one arm."""
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}


def ratio_text(comparison: dict) -> str:
    """'1.0037 (0.9940-1.0160, 5 pairs, p 0.69)': the median pair ratio with its range and the test's p."""
    p = comparison.get("p_value")
    return (f"{comparison['median_ratio']:.4f} ({comparison['min_ratio']:.4f}-{comparison['max_ratio']:.4f}, "
            f"{comparison['pairs']} pairs" + (f", p {p:.2g}" if p is not None else "") + ")")


def describe(comparison: dict) -> str:
    """'1.0037 (0.9940-1.0160, 5 pairs, p 0.69): within noise' for the console."""
    return f"{ratio_text(comparison)}: {comparison['verdict']}"


def write_results(stem: Path, report: dict, markdown_lines: list[str], inputs: list[Path] = ()) -> list[Path]:
    """stem.json (report + provenance) and stem.md (provenance header + the given lines), atomically."""
    stem = Path(stem)
    report = {**report, "provenance": provenance.collect(inputs=inputs)}
    write_json_atomic(stem.with_suffix(".json"), report)
    text = "\n".join([*markdown_lines, "", *provenance.markdown(report["provenance"])]) + "\n"
    write_text_atomic(stem.with_suffix(".md"), text)
    return [stem.with_suffix(".json"), stem.with_suffix(".md")]


def publish(stem: Path, report: dict, markdown_lines: list[str]) -> None:
    """Write a benchmark's results files and show them: the paths, then the Markdown."""
    for path in write_results(Path(stem), report, markdown_lines):
        print(f"wrote {path}")
    print(Path(stem).with_suffix(".md").read_text())


def driver_parser(description: str, default_out: Path, child_flag: str) -> argparse.ArgumentParser:
    """The options every benchmark driver has: --pairs, --out, and the hidden flag its child process runs with."""
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pairs", type=int, default=MIN_PAIRS, help=f"alternating rounds (default {MIN_PAIRS})")
    parser.add_argument("--out", default=str(default_out), help=f"results path without suffix (default {default_out})")
    parser.add_argument(child_flag, action="store_true", help=argparse.SUPPRESS)
    return parser
