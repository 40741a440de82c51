"""The one benchmark harness: alternating rounds, a stated test with an effect size, equivalence, provenance.

How it works: docs/trust.md#in-the-code-the-one-benchmark-harness-trainscopemeasurebenchpy.
"""

import argparse
import functools
import itertools
import math
import statistics
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

from trainscope.core import provenance
from trainscope.core.records import write_json_atomic, write_text_atomic

MIN_PAIRS = 5
MIN_DECIDABLE = 4  # the fewest pairs whose exact two-sided p-value (2/70 = 0.029) can pass ALPHA (min_rounds)
ALPHA = 0.05
MIN_EFFECT = 0.03  # a speed ratio within 3% of 1 is no change worth acting on, however significant
METHOD = f"two-sided Mann-Whitney U, alpha {ALPHA}, minimum effect {MIN_EFFECT:.0%}"
EXACT_LIMIT = 200_000  # combinations enumerated for the exact p-value; beyond: the normal approximation


def round_order(names: list[str], round_index: int) -> list[str]:
    """Arms in order on even rounds, reversed on odd ones (ABBA over two rounds of two arms)."""
    return list(names) if round_index % 2 == 0 else list(reversed(names))


def alternate(
    arms: dict[str, Callable[[int], dict]], rounds: int, log: Callable[[str], None] = print, first_round: int = 0
) -> list[dict]:
    """Run every arm (called with the round index, returning a dict of measurements) once per round, alternating
    the order; returns one {arm: result} per round."""
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
    return ", ".join(
        f"{k} {v:.4g}" for k, v in result.items() if isinstance(v, (int, float)) and not isinstance(v, bool)
    )


# ---------------------------------------------------------------- the test


def mann_whitney_p(x: list[float], y: list[float]) -> float:
    """Two-sided p-value of the Mann-Whitney U test of x against y: exact over the pooled mid-ranks' assignments
    up to EXACT_LIMIT of them, else the normal approximation with a tie correction."""
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
        if len(set(ranks)) == n + m:  # no ties: the null distribution depends on n and m only (cached)
            return _exact_p(n, m, round(observed))
        sums = [sum(c) for c in itertools.combinations(ranks, n)]
        return sum(abs(s - expected) >= distance for s in sums) / len(sums)
    ties = sum(c**3 - c for c in Counter(ranks).values())
    variance = n * m / 12 * ((n + m + 1) - ties / ((n + m) * (n + m - 1)))
    z = distance / math.sqrt(variance) if variance > 0 else 0.0
    return math.erfc(z / math.sqrt(2))


@functools.lru_cache(maxsize=None)
def _rank_sum_counts(n: int, m: int) -> tuple[int, ...]:
    """How many n-subsets of the ranks 1..n+m have each rank sum, from the smallest, n(n+1)/2, upwards (the exact
    null distribution without ties), by dynamic programming."""
    top = sum(range(m + 1, n + m + 1))
    ways = [[0] * (top + 1) for _ in range(n + 1)]  # ways[j][s]: j ranks chosen so far, summing to s
    ways[0][0] = 1
    for rank in range(1, n + m + 1):
        for j in range(min(rank, n), 0, -1):
            row, below = ways[j], ways[j - 1]
            for s in range(top, rank - 1, -1):
                row[s] += below[s - rank]
    return tuple(ways[n][n * (n + 1) // 2 :])


@functools.lru_cache(maxsize=None)
def _exact_p(n: int, m: int, rank_sum: int) -> float:
    """Two-sided exact p of an integer rank sum of n against m without ties (`_rank_sum_counts`)."""
    expected, low = n * (n + m + 1) / 2, n * (n + 1) // 2
    distance = abs(rank_sum - expected) - 1e-9
    tail = sum(c for s, c in enumerate(_rank_sum_counts(n, m), low) if abs(s - expected) >= distance)
    return tail / math.comb(n + m, n)


def smallest_p(n: int, m: int | None = None) -> float:
    """The smallest two-sided exact Mann-Whitney p-value of n against m measurements (m = n by default)."""
    return 2 / math.comb(n + (n if m is None else m), n)


def min_rounds(level: float) -> int:
    """The fewest alternating rounds (n against n) whose smallest exact p-value is below `level` (4 for 0.05)."""
    n = 1
    while smallest_p(n) >= level:
        n += 1
    return n


def holm(p_values: list[float]) -> list[float]:
    """Holm's step-down adjustment of several p-values tested together (Holm 1979): the k-th smallest is
    multiplied by (m - k + 1), and adjusted values never decrease in that order."""
    order = sorted(range(len(p_values)), key=p_values.__getitem__)
    adjusted, running = [0.0] * len(p_values), 0.0
    for rank, index in enumerate(order):
        running = max(running, min(1.0, (len(p_values) - rank) * p_values[index]))
        adjusted[index] = running
    return adjusted


def verdict(
    median_ratio: float,
    p_value: float,
    pairs: int,
    min_pairs: int = MIN_PAIRS,
    alpha: float = ALPHA,
    min_effect: float = MIN_EFFECT,
) -> str:
    """faster / slower / within noise / too few pairs, from the test and the effect (higher ratio = faster)."""
    if pairs < min_pairs:
        return "too few pairs"
    if p_value < alpha and median_ratio >= 1 + min_effect:
        return "faster"
    if p_value < alpha and median_ratio <= 1 / (1 + min_effect):
        return "slower"
    return "within noise"


def compare_samples(
    baseline: list[float],
    candidate: list[float],
    higher_is_better: bool = True,
    min_pairs: int = MIN_PAIRS,
    p_value: float | None = None,
) -> dict:
    """The candidate arm against the baseline: per-round speed ratios (candidate over baseline, inverted
    for times), their median with min-max, the test's p-value (or a corrected one passed in) and the
    verdict they support."""
    pairs = min(len(baseline), len(candidate))
    ratios = [(c / b if higher_is_better else b / c) for b, c in zip(baseline, candidate)]
    p = mann_whitney_p(list(baseline), list(candidate)) if p_value is None else p_value
    median = statistics.median(ratios)
    return {
        "pairs": pairs,
        "ratios": ratios,
        "median_ratio": median,
        "min_ratio": min(ratios),
        "max_ratio": max(ratios),
        "p_value": p,
        "test": METHOD,
        "verdict": verdict(median, p, pairs, min_pairs),
    }


def compare_rounds(
    rounds: list[dict],
    candidate: str,
    baseline: str,
    metric: str,
    higher_is_better: bool = True,
    min_pairs: int = MIN_PAIRS,
) -> dict:
    """`compare_samples` of one metric of two arms measured in the same alternating rounds."""
    return compare_samples(
        [r[baseline][metric] for r in rounds], [r[candidate][metric] for r in rounds], higher_is_better, min_pairs
    )


# ---------------------------------------------------------------- Student's t and equivalence


def t_cdf(t: float, df: int) -> float:
    """P(T <= t) for Student's t with an integer number of degrees of freedom, exactly, by the finite series of
    Abramowitz & Stegun 26.7.3 (theta = atan(t / sqrt(df)); odd df: the arctangent series, even df: the sine series)."""
    if df < 1 or int(df) != df:
        raise ValueError("Student's t here needs a whole number of degrees of freedom, at least 1")
    theta = math.atan(abs(t) / math.sqrt(df))
    cos2, sin = math.cos(theta) ** 2, math.sin(theta)
    if df % 2:  # A = 2/pi (theta + sin cos (1 + 2/3 cos^2 + 2*4/(3*5) cos^4 + ...)), df - 2 powers in all
        term, total = 1.0, 1.0 if df > 1 else 0.0
        for k in range(1, (df - 1) // 2):
            term *= cos2 * (2 * k) / (2 * k + 1)
            total += term
        inside = 2 / math.pi * (theta + sin * math.cos(theta) * total)
    else:  # A = sin (1 + 1/2 cos^2 + 1*3/(2*4) cos^4 + ...), up to cos^(df - 2)
        term, total = 1.0, 1.0
        for k in range(1, df // 2):
            term *= cos2 * (2 * k - 1) / (2 * k)
            total += term
        inside = sin * total
    return 0.5 + math.copysign(inside / 2, t)


def t_pdf(t: float, df: int) -> float:
    """Student's t density: Gamma((df + 1) / 2) / (sqrt(df pi) Gamma(df / 2)) (1 + t^2 / df)^(-(df + 1) / 2)."""
    log_scale = math.lgamma((df + 1) / 2) - math.lgamma(df / 2) - 0.5 * math.log(df * math.pi)
    return math.exp(log_scale - (df + 1) / 2 * math.log1p(t * t / df))


@functools.lru_cache(maxsize=4096)
def t_quantile(p: float, df: int) -> float:
    """The Student's t quantile: the t with P(T <= t) = p, to 1e-12, by Newton's method on `t_cdf` from the
    normal quantile with its first Cornish-Fisher term (z + (z^3 + z) / 4 df, Abramowitz & Stegun 26.7.5), kept
    inside a bracket that bisection narrows where a Newton step would leave it."""
    if not 0 < p < 1:
        raise ValueError("a quantile needs 0 < p < 1")
    if p < 0.5:
        return -t_quantile(1 - p, df)
    if p == 0.5:
        return 0.0
    z = statistics.NormalDist().inv_cdf(p)
    low, high = 0.0, 1.0
    while t_cdf(high, df) < p:
        low, high = high, 2 * high
    t = min(max(z + (z**3 + z) / (4 * df), low), high)
    for _ in range(200):
        error = t_cdf(t, df) - p
        if error == 0 or high - low < 1e-12 * t:
            break
        low, high = (t, high) if error < 0 else (low, t)
        step = t - error / t_pdf(t, df)
        t = step if low < step < high else (low + high) / 2
    return t


EQUIVALENCE_ALPHA = 0.05  # each one-sided test: a 90% confidence interval inside the margin
EQUIVALENCE_POWER = 0.8  # the power the seeds needed are sized for


def equivalence(
    differences: list[float], margin: float, alpha: float = EQUIVALENCE_ALPHA, power: float | None = EQUIVALENCE_POWER
) -> dict:
    """Two one-sided tests (Schuirmann 1987) of paired differences against +-margin: "same" where the (1 - 2 alpha)
    t interval of the mean lies inside (-margin, +margin), "changed" where wholly outside it (`p_changed`: that
    one-sided p, for Holm), else "undecided" with `needed`, the pairs that would show `shows` at `power`
    (`pairs_to_show`; None with power None)."""
    n = len(differences)
    result = {"n": n, "margin": margin, "alpha": alpha, "confidence": 1 - 2 * alpha, "mean": None, "sd": None}
    result |= {"interval": None, "verdict": "undecided", "needed": None, "shows": None, "p_changed": 1.0}
    if n == 0:
        return result
    mean = math.fsum(differences) / n
    result["mean"] = mean
    if n < 2:
        return result
    sd = math.sqrt(math.fsum((d - mean) ** 2 for d in differences) / (n - 1))
    half = t_quantile(1 - alpha, n - 1) * sd / math.sqrt(n)
    low, high = mean - half, mean + half
    result.update(sd=sd, interval=[low, high], p_changed=changed_p(mean, sd, n, margin))
    if -margin < low and high < margin:
        result["verdict"] = "same"
    elif low > margin or high < -margin:
        result["verdict"] = "changed"
    else:
        result["shows"] = "same" if abs(mean) < margin else "changed" if abs(mean) > margin else None
        result["needed"] = pairs_to_show(mean, sd, margin, alpha, power) if power is not None else None
    return result


def changed_p(mean: float, sd: float, n: int, margin: float) -> float:
    """The one-sided p-value of "the difference lies beyond the margin on the side the mean is on":
    P(T_{n-1} >= (|mean| - margin) / (sd / sqrt n)). Below alpha exactly where `equivalence`'s interval lies wholly
    outside the margin."""
    if sd == 0:
        return 0.0 if abs(mean) > margin else 1.0
    return 1.0 - t_cdf((abs(mean) - margin) / (sd / math.sqrt(n)), n - 1)


def equivalence_chances(
    n: int, mean: float, sd: float, margin: float, alpha: float = EQUIVALENCE_ALPHA
) -> tuple[float, float]:
    """(P("same"), P("changed")): how often `equivalence` answers each for n normal paired differences of this mean
    and SD: for each u = s / sd (chi density, n - 1 degrees of freedom; Simpson's rule over u) the interval lies
    inside, or wholly outside, the margin with a normal probability."""
    return _chance(n, mean, sd, margin, alpha, "same"), _chance(n, mean, sd, margin, alpha, "changed")


def _chance(n: int, mean: float, sd: float, margin: float, alpha: float, answer: str) -> float:
    if n < 2:
        return 0.0
    if sd == 0:
        return float(abs(mean) < margin if answer == "same" else abs(mean) > margin)
    t, se, root2 = t_quantile(1 - alpha, n - 1), sd / math.sqrt(n), math.sqrt(2)
    total = 0.0
    for u, weight in _chi_grid(n - 1):
        half = t * se * u
        if answer == "same" and half >= margin:  # the interval is wider than the margin from here on
            break
        if weight < 1e-14:
            continue
        if answer == "same":  # P(-margin + half < mean-hat < margin - half)
            inside = (
                math.erfc(-(margin - half - mean) / se / root2) - math.erfc(-(-margin + half - mean) / se / root2)
            ) / 2
            total += weight * max(0.0, inside)
        else:  # P(mean-hat > margin + half) + P(mean-hat < -margin - half)
            total += (
                weight
                * (math.erfc((margin + half - mean) / se / root2) + math.erfc((margin + half + mean) / se / root2))
                / 2
            )
    return min(1.0, total)


@functools.lru_cache(maxsize=2048)
def _chi_grid(k: int, intervals: int = 240) -> tuple[tuple[float, float], ...]:
    """Simpson's nodes and weights (density included) of u = s / sd for k degrees of freedom: the chi density
    2 (k/2)^(k/2) / Gamma(k/2) u^(k-1) exp(-k u^2 / 2), over its mean +- 9 SDs (about 1 / sqrt(2k) each; few
    degrees of freedom: a long right tail)."""
    width = 9 / math.sqrt(2 * k)
    low, high = max(0.0, 1 - width), 1 + width + (6 if k < 8 else 0)
    log_scale = math.log(2) + k / 2 * math.log(k / 2) - math.lgamma(k / 2)
    step, grid = (high - low) / intervals, []
    for i in range(intervals + 1):
        u = low + i * step
        density = (
            (math.exp(log_scale) if k == 1 else 0.0)
            if u <= 0
            else math.exp(log_scale + (k - 1) * math.log(u) - k * u * u / 2)
        )
        grid.append((u, (1 if i in (0, intervals) else 4 if i % 2 else 2) * step / 3 * density))
    return tuple(grid)


def pairs_to_show(
    mean: float,
    sd: float,
    margin: float,
    alpha: float = EQUIVALENCE_ALPHA,
    power: float = EQUIVALENCE_POWER,
    most: int = 1000,
) -> int | None:
    """The fewest pairs that show a true difference `mean` "same" (|mean| < margin) or "changed" (|mean| > margin)
    with probability `power` by the exact chances (`equivalence_chances`), from a shifted-t approximation's start;
    None where |mean| = margin or more than `most` would be needed."""
    if abs(mean) == margin or sd < 0:
        return None
    goal = 0 if abs(mean) < margin else 1
    enough = lambda n: _chance(n, mean, sd, margin, alpha, ("same", "changed")[goal]) >= power  # noqa: E731
    if sd == 0:
        return 2

    def approximate(n: int) -> float:
        t, scale = t_quantile(1 - alpha, n - 1), math.sqrt(n) / sd
        if goal == 0:
            return 1 - t_cdf(t - (margin - abs(mean)) * scale, n - 1) - t_cdf(t - (margin + abs(mean)) * scale, n - 1)
        return t_cdf((abs(mean) - margin) * scale - t, n - 1)

    if approximate(most) < power and not enough(most):
        return None
    low, high = 1, most
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (low, middle) if middle > 1 and approximate(middle) >= power else (middle, high)
    n = high
    while n > 2 and enough(n - 1):
        n -= 1
    while n < most and not enough(n):
        n += 1
    return n if enough(n) else None


def rejection_rate(n: int, m: int, level: float) -> float:
    """The exact size of the two-sided Mann-Whitney test of n against m untied measurements at `level`: the share
    of the equally likely rank arrangements whose p-value is below it."""
    low = n * (n + 1) // 2
    counts = _rank_sum_counts(n, m)
    return sum(c for s, c in enumerate(counts, low) if _exact_p(n, m, s) < level) / math.comb(n + m, n)


def median_interval(values: list[float], confidence: float = 0.95) -> dict:
    """A distribution-free interval for the median of `values` from order statistics, the narrowest whose confidence
    is at least `confidence` (or [min, max] with the confidence it has): {low, high, confidence, n}."""
    ordered, n = sorted(values), len(values)

    def covers(k: int) -> float:  # 1 - 2 P(Binomial(n, 1/2) <= k - 1)
        return 1 - 2 * sum(math.comb(n, i) for i in range(k)) / 2**n

    k = max([c for c in range(1, (n + 1) // 2 + 1) if covers(c) >= confidence], default=1)
    return {"low": ordered[k - 1], "high": ordered[n - k], "confidence": covers(k), "n": n}


def spread(values: list[float]) -> dict:
    """Median with min and max of repeated measurements of one arm."""
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}


def spread_and_interval(values: list[float]) -> dict:
    """`spread` with the median's distribution-free interval (`interval`: `median_interval`)."""
    return {**spread(values), "interval": median_interval(values)}


def within(interval: dict, bound: float) -> bool | None:
    """A target judged on a median's interval (`median_interval`), stated before measuring: True (met) when its upper
    end is at most `bound`, False (NOT met) when its lower end is above it, None (undecided) otherwise or from fewer
    than MIN_PAIRS values."""
    if interval["n"] < MIN_PAIRS:
        return None
    return True if interval["high"] <= bound else False if interval["low"] > bound else None


def ratio_text(comparison: dict) -> str:
    """'1.0037 (0.9940-1.0160, 5 pairs, p 0.69)': the median pair ratio with its range and the test's p."""
    p = comparison.get("p_value")
    return (
        f"{comparison['median_ratio']:.4f} ({comparison['min_ratio']:.4f}-{comparison['max_ratio']:.4f}, "
        f"{comparison['pairs']} pairs" + (f", p {p:.2g}" if p is not None else "") + ")"
    )


def describe(comparison: dict) -> str:
    """'1.0037 (0.9940-1.0160, 5 pairs, p 0.69): within noise' for the console."""
    return f"{ratio_text(comparison)}: {comparison['verdict']}"


def write_results(stem: Path, report: dict, markdown_lines: list[str], inputs: list[Path] = ()) -> list[Path]:
    """<stem>.json (report + provenance) and <stem>.md (provenance header + the given lines), atomically."""
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


def driver_parser(
    description: str, default_out: Path, child_flag: str, pairs: int = MIN_PAIRS
) -> argparse.ArgumentParser:
    """The options every benchmark driver has: --pairs, --out, and the hidden flag its child process runs with."""
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pairs", type=int, default=pairs, help=f"alternating rounds (default {pairs})")
    parser.add_argument("--out", default=str(default_out), help=f"results path without suffix (default {default_out})")
    parser.add_argument(child_flag, action="store_true", help=argparse.SUPPRESS)
    return parser
