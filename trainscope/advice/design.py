"""make tune's design, stated before anything is measured (Design), and the method in the words the result states.

How it works: docs/tune.md#in-the-code-how-make-tune-decides-trainscopeadvicejudgepy.
"""

from dataclasses import asdict, dataclass

from trainscope.advice import changes
from trainscope.measure import bench

ROUNDS = 6  # 6 against 6: smallest p 2/924 = 0.0022, below Holm's first threshold for up to 23 tests
ACCURACY_MARGIN = 0.01  # one point of accuracy
# Mean cross-entropy is -mean log p(true label): a shift of 0.02 nats scales the geometric-mean probability the
# model gives the right label by e^0.02, about 2% -- as small a change in what is learned as one point of accuracy
# at the 60-70% this task reaches.
LOSS_MARGIN = 0.02


@dataclass(frozen=True)
class Design:
    """What make tune decides by, fixed before it measures (printed first, written into the result)."""

    rounds: int = ROUNDS  # alternating rounds per trial, one seed each; one look after the last
    trials: int = 1  # suggestions tried (k); with two or more of a kind the kept ones together too
    accuracy_margin: float = ACCURACY_MARGIN
    loss_margin: float = LOSS_MARGIN
    seed: int = 42  # round r runs seed + r (the kept ones' rounds: the same seeds again)
    data_seed: int | None = 42  # held in every run: the same data split and subsets (None: a loop's own data)
    alpha: float = bench.ALPHA
    min_effect: float = bench.MIN_EFFECT
    exact: int = 0  # of the trials, the exact changes (trainscope.advice.changes): tried first
    precision: str = "fp32"  # the precision the advice run had in effect
    tolerance: float = changes.EXACT_TOLERANCE  # exact changes are judged in fp32 (trainscope.advice.changes)

    @property
    def exact_check(self) -> bool:
        """Whether exact changes need their own fp32 pair: the rounds run at another precision."""
        return self.precision != changes.EXACT_PRECISION

    @property
    def tests(self) -> int:
        """The family Holm corrects over: the trials, and the kept ones together for each kind (exact, the others)
        of which there can be two kept (at least 1: a design without trials has nothing to correct)."""
        other = self.trials - self.exact
        return max(1, self.trials + (1 if self.exact > 1 else 0) + (1 if other > 1 else 0))

    @property
    def reachable(self) -> bool:
        """Whether R against R can pass Holm's first threshold, alpha / tests, at all."""
        return bench.smallest_p(self.rounds) < self.alpha / self.tests

    @property
    def boundary(self) -> str:
        return (
            f"fixed: one look after {self.rounds} rounds per trial (no interim looks, no alpha spent on them); "
            f"Holm over {self.tests} test(s): the smallest p must be below {self.alpha:g}/{self.tests} = "
            f"{self.alpha / self.tests:.4g}"
        )

    @property
    def size(self) -> float:
        """The exact rate at which one trial that changes nothing is called faster or slower at the first threshold
        (trainscope.measure.bench.rejection_rate: 6 against 6 at 0.05, 0.0411)."""
        return bench.rejection_rate(self.rounds, self.rounds, self.alpha / self.tests)

    def seed_of(self, round_index: int) -> int:
        return self.seed + round_index % self.rounds

    def flags(self, round_index: int) -> list[str]:
        """The train.py flags of round `round_index`: its seed, the data seed held."""
        return ["--seed", str(self.seed_of(round_index)), "--data-seed", str(self.data_seed)]

    def margin(self, metric: str) -> float:
        return self.accuracy_margin if metric.endswith("accuracy") else self.loss_margin

    def to_dict(self) -> dict:
        return {
            **asdict(self),
            "tests": self.tests,
            "boundary": self.boundary,
            "test": bench.METHOD,
            "equivalence": equivalence_method(self),
            "exactness": exactness_method(self),
            "min_rounds": bench.min_rounds(self.alpha / self.tests),
        }

    @classmethod
    def from_dict(cls, values: dict) -> "Design":
        return cls(**{k: values[k] for k in cls.__dataclass_fields__ if k in values})

    def lines(self) -> list[str]:
        """The design as make tune prints it before measuring."""
        out = [
            f"design: {self.trials} trial(s), {self.rounds} alternating rounds each (seeds {self.seed}-"
            f"{self.seed + self.rounds - 1}{'' if self.data_seed is None else f', data seed {self.data_seed}'}); "
            f"speed: {bench.METHOD} on the same work, "
            f"against the baseline runs of the trial's own rounds; boundary: {self.boundary}"
        ]
        if self.exact:
            out.append(f"exact changes ({self.exact}, tried first and stacked): {exactness_method(self)}")
        if self.trials > self.exact:
            out.append(
                f"same result of the others: {equivalence_method(self)}; a training change is 'same' only "
                "from the full job"
            )
        if not self.reachable:
            out.append(
                f"note: {self.rounds} against {self.rounds} rounds give p >= {bench.smallest_p(self.rounds):.4g}, "
                f"which cannot pass {self.alpha:g}/{self.tests}: no speed verdict is possible (at least "
                f"{bench.min_rounds(self.alpha / self.tests)} rounds are)"
            )
        return out


def equivalence_method(design: Design) -> str:
    return (
        f"two one-sided tests (alpha {bench.EQUIVALENCE_ALPHA:g} each: the 90% t interval of the paired "
        f"differences, trial minus baseline on the same seed) inside +-{design.accuracy_margin:g} for validation "
        f"and test accuracy and +-{design.loss_margin:g} for their losses; changed: a metric's one-sided test "
        f"beyond its margin passing Holm over the metrics; else undecided"
    )


def exactness_method(design: Design) -> str:
    pairs = (
        f"one fp32 pair per change (the rounds run in {design.precision}, whose rounding would hide a wrong random "
        f"draw), seed {design.seed}"
        if design.exact_check
        else "every pair of the rounds (same seed, fp32)"
    )
    return (
        f"kept when faster and {pairs} agrees: each logged loss (the mean of the steps since the line before) and "
        f"the final losses within {design.tolerance:.2g} relative, the accuracies within {design.tolerance:.2g} "
        "(fp32's exactness tolerance, stated before measuring); a disagreement is 'not exact', a defect, never kept"
    )


def method_text(design: Design, rounds: str | None = None, boundary: str | None = None) -> str:
    exact = f" Exact changes, tried first and stacked: {exactness_method(design)}." if design.exact else ""
    return (
        f"Speed on the same work (training scaled to the baseline's real tokens, evaluation as measured); test: "
        f"{bench.METHOD}; each trial against the baseline runs of its own {rounds or f'{design.rounds} rounds'}; "
        f"boundary: {boundary or design.boundary}.{exact} Same result: {equivalence_method(design)}; a training "
        "change only on the full job. Kept: faster and same."
    )
