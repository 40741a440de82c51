"""scipy.stats' answers to the statistics trainscope.measure.bench computes by hand, written to tests/data/scipy_reference.json
for tests/test_bench.py to compare against to 1e-10.

    uv pip install --python .venv/bin/python scipy && .venv/bin/python tests/scipy_reference.py

scipy is not one of trainscope's dependencies: installed in the venv, evaluate and transformers import it in every
training process (`import evaluate` 3.7 s without it, 4.9 s with it on machine B), so the statistics stay by hand and
scipy's answers are stored with its version. Cases come from fixed seeds.
"""

import itertools
import json
import math
import random
from datetime import datetime, timezone
from pathlib import Path

import numpy as np
import scipy
from scipy import stats

OUT = Path(__file__).parent / "data" / "scipy_reference.json"
T_DEGREES = [*range(1, 31), 100, 1000]
EXACT_LIMIT = 200_000  # trainscope.measure.bench.EXACT_LIMIT: above it the normal approximation


def t_cases() -> dict:
    values = [-40.0, -6.0, -2.5, -1.0, -0.3, -1e-3, 0.0, 1e-3, 0.3, 1.0, 1.7, 2.5, 6.0, 40.0]
    probabilities = [0.001, 0.025, 0.05, 0.2, 0.5, 0.6, 0.9, 0.95, 0.975, 0.99, 0.999]
    # df 1 is the Cauchy distribution: scipy 1.17's t.cdf is off there for |t| < 1e-6 (scipy/scipy#25667), cauchy's
    # is not
    cdf = [[t, df, float(stats.cauchy.cdf(t) if df == 1 else stats.t.cdf(t, df))] for df in T_DEGREES for t in values]
    pdf = [[t, df, float(stats.t.pdf(t, df))] for df in T_DEGREES for t in (-8.0, -2.0, -0.5, 0.0, 0.5, 1.3, 3.0)]
    ppf = [[p, df, float(stats.t.ppf(p, df))] for df in T_DEGREES for p in probabilities]
    return {"t_cdf": cdf, "t_pdf": pdf, "t_quantile": ppf}


def exact_with_ties(x, y) -> float:
    """P(|W - E W| >= |w - E W|) over every assignment of the pooled mid-ranks (scipy.stats.permutation_test's
    enumeration; the statistic is the two-sided distance, as bench's: scipy's own two-sided p doubles a tail)."""
    n, m = len(x), len(y)
    ranks = stats.rankdata(list(x) + list(y))
    expected = n * (n + m + 1) / 2
    return float(
        stats.permutation_test(
            (ranks[:n], ranks[n:]),
            lambda a, b, axis: np.abs(a.sum(axis=axis) - expected),
            permutation_type="independent",
            alternative="greater",
            n_resamples=np.inf,
            vectorized=True,
        ).pvalue
    )


def mann_whitney_cases() -> list:
    rng = random.Random(3)
    cases = []
    for _ in range(200):  # small, no ties: scipy's exact null distribution
        n, m = rng.randint(1, 9), rng.randint(1, 9)
        x, y = [rng.random() for _ in range(n)], [rng.random() + rng.choice([0, 0.3, 1]) for _ in range(m)]
        cases.append(["exact", x, y, float(stats.mannwhitneyu(x, y, alternative="two-sided", method="exact").pvalue)])
    tied = [([1, 2, 2, 3], [2, 3, 3, 4, 4]), ([1, 1, 2], [1, 2, 2]), ([5, 5, 5, 6, 7, 7], [6, 6, 8, 8, 9, 9])]
    tied += [
        ([rng.choice([1, 2, 2.5, 3, 4]) for _ in range(n)], [rng.choice([1, 3, 3, 5, 6]) for _ in range(m)])
        for n, m in [(2, 2), (3, 5), (6, 6), (4, 8), (9, 9)]
    ]
    cases += [["ties", list(x), list(y), exact_with_ties(x, y)] for x, y in tied]
    for n, m, draw in [(11, 11, rng.random), (40, 40, lambda: rng.randint(0, 12)), (25, 60, rng.random)]:
        assert math.comb(n + m, n) > EXACT_LIMIT
        for shift in (0, 0.2, 3):
            x, y = [draw() for _ in range(n)], [draw() + shift for _ in range(m)]
            found = stats.mannwhitneyu(x, y, use_continuity=False, alternative="two-sided", method="asymptotic")
            cases.append(["normal", x, y, float(found.pvalue)])
    return cases


def rejection_cases() -> list:
    """The exact size of the two-sided rank test at a level: the share of every arrangement whose scipy p is below."""
    cases = []
    for n, m in [(2, 2), (3, 4), (4, 4), (5, 5), (4, 7), (6, 6)]:
        x = np.array(list(itertools.combinations(range(n + m), n)), dtype=float)
        y = np.array([[r for r in range(n + m) if r not in row] for row in x.astype(int).tolist()], dtype=float)
        p = stats.mannwhitneyu(x, y, alternative="two-sided", method="exact", axis=1).pvalue
        cases += [[n, m, level, float(np.mean(p < level))] for level in (0.05, 0.05 / 4, 0.05 / 7, 0.2)]
    return cases


def equivalence_cases(margin: float = 0.01, alpha: float = 0.05) -> list:
    """Schuirmann's two one-sided tests as scipy's one-sample t tests: the (1 - 2 alpha) interval of the mean, the
    one-sided p against the margin on the mean's side, both one-sided tests' larger p."""
    rng = random.Random(5)
    cases = []
    for _ in range(200):
        n = rng.choice([2, 3, 4, 6, 10, 30])
        d = [rng.gauss(rng.uniform(-0.04, 0.04), rng.uniform(0.001, 0.02)) for _ in range(n)]
        interval = stats.ttest_1samp(d, 0.0).confidence_interval(1 - 2 * alpha)
        mean = sum(d) / n
        beyond = stats.ttest_1samp(d, math.copysign(margin, mean), alternative="greater" if mean > 0 else "less")
        above = stats.ttest_1samp(d, -margin, alternative="greater").pvalue
        below = stats.ttest_1samp(d, margin, alternative="less").pvalue
        cases.append([d, [float(interval.low), float(interval.high)], float(beyond.pvalue), float(max(above, below))])
    return cases


def main() -> None:
    reference = {
        "scipy": scipy.__version__,
        "numpy": np.__version__,
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "command": "python tests/scipy_reference.py",
        **t_cases(),
        "mann_whitney": mann_whitney_cases(),
        "rejection_rate": rejection_cases(),
        "equivalence": {"margin": 0.01, "alpha": 0.05, "cases": equivalence_cases()},
    }
    OUT.parent.mkdir(exist_ok=True)
    OUT.write_text(json.dumps(reference, indent=1) + "\n")
    print(f"wrote {OUT} (scipy {scipy.__version__})")


if __name__ == "__main__":
    main()
