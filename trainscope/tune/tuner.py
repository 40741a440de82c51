"""The world `trainscope tune` measures, behind a runner and a clock (a test passes simulated ones).

How it works: docs/tune.md#in-the-code-how-trainscope-tune-runs-trainscopetune.
"""

import dataclasses
import functools
import operator
import time
from collections.abc import Callable

from trainscope.advice import changes
from trainscope.advice.design import Design
from trainscope.advice.judge import TOGETHER, final_trial, in_family, judged_in_phases, measure
from trainscope.core.errors import UserError
from trainscope.measure import bench
from trainscope.tune.command import Change


@dataclasses.dataclass(frozen=True)
class Arm:
    name: str
    change: Change = Change()


Runner = Callable[[Arm, int, int], dict]  # (arm, round index, seed) -> the run's figures (judge.run_figures)


class TrialFailed(Exception):
    """A trial's run failed, or its record shows its change did not take: that trial stops, the others go on."""


@dataclasses.dataclass
class Trial:
    """One arm against its baseline: a suggestion, or the kept ones of a phase together (suggestion None)."""

    name: str
    arm: Arm
    suggestion: object = None
    kind: str = changes.NUMERIC
    phase: str = "other"  # "exact" (tried first, stacked) or "other" (on top of the stack)
    own: Change = Change()  # the change alone, without the stack's


class Tuner:
    """Runs arms in alternating rounds within the budget; `exact_pair` is what an exact change's fp32 pair adds."""

    def __init__(
        self,
        runner: Runner,
        budget_s: float,
        clock: Callable[[], float] = time.monotonic,
        log: Callable[[str], None] = print,
        exact_pair: Change = Change(mixed_precision="no"),
    ):
        self.runner, self.budget_s, self.clock, self.log, self.exact_pair = runner, budget_s, clock, log, exact_pair
        self.started = clock()
        self.run_s: dict[str, float] = {}
        self.failed: dict[str, str] = {}  # trial -> why it stopped

    def remaining(self) -> float:
        return self.budget_s - (self.clock() - self.started)

    def run(self, arm: Arm, round_index: int, seed: int, label: str | None = None) -> dict:
        began = self.clock()
        result = self.runner(arm, round_index, seed)
        self.run_s[arm.name] = self.clock() - began
        losses = result.get("step_losses") or [[None, None]]
        self.log(
            f"{label or f'round {round_index + 1} {arm.name}'} (seed {seed}): training {result['train_wall_s']:.1f} s"
            f", evaluation {result['eval_s']:.1f} s, last logged loss {losses[-1][1]:.4g} (step {losses[-1][0]}); "
            f"{self.remaining():.0f} s of the budget left"
        )
        return result

    def rounds(self, design: Design, arms: list[Arm], indices: range, measured: dict) -> None:
        """Every arm once per round, alternating the order, with the round's seed; a round the budget cannot hold
        (by the arms' last run times) is not started. A trial that fails stops; the baseline (first) failing ends
        the tuning."""
        for index in indices:
            arms = [arm for arm in arms if arm.name not in self.failed]
            if len(arms) < 2:  # every trial of these rounds stopped: nothing to compare the baseline with
                return
            cost = sum(self.run_s.get(a.name, self.run_s.get("baseline", self.run_s.get("advice", 0.0))) for a in arms)
            if cost > self.remaining():
                self.log(
                    f"budget: round {index + 1} (about {cost:.0f} s) does not fit the {self.remaining():.0f} s "
                    "left; the trials of these rounds are not judged"
                )
                return
            for arm in bench.round_order(arms, index):
                try:
                    measured[arm.name][index] = self.run(arm, index, design.seed_of(index))
                except TrialFailed as failure:
                    if arm is arms[0]:
                        raise UserError(f"the command as it is ({arm.name}, round {index + 1}): {failure}") from None
                    self.failed[arm.name] = str(failure)
                    self.log(f"{arm.name}: {failure}; not tried further")

    def decide(
        self, design: Design, baseline: Arm, exact: list[Trial], others: list[Trial]
    ) -> tuple[dict[str, dict], list[tuple[Trial, dict, dict]]]:
        """The whole decision: the exact trials' phase against the baseline, judged on its own (the stack is built
        on those verdicts), then the other trials' phase on top of the stack and against it, judged in the whole
        family. (judgement by trial, [(trial, its runs by round, its baseline's runs by round)] for every trial
        judged, the kept ones together included)."""
        ran, measures, start, stack = [], {}, 0, Change()
        if exact:
            measured, measures, together = self.phase(design, baseline, exact, 0, {})
            judged = in_family(design, measures)
            ran = [(t, measured[t.name], measured[baseline.name]) for t in [*exact, together] if t and t.name in judged]
            start = design.rounds * (2 if together else 1)
            chosen = final_trial([{"name": t.name, "phase": t.phase, **judged[t.name]} for t, _, _ in ran])
            stack = next((t.own for t, _, _ in ran if chosen and t.name == chosen["name"]), Change())
        if others:
            base = dataclasses.replace(baseline, name="stacked", change=baseline.change | stack)
            base = base if stack != Change() else baseline
            others = [
                dataclasses.replace(t, arm=dataclasses.replace(t.arm, change=base.change | t.own)) for t in others
            ]
            measured, phase, together = self.phase(design, base, others, start, measures)
            measures = {**measures, **phase}
            ran += [(t, measured[t.name], measured[base.name]) for t in [*others, together] if t and t.name in phase]
        exact_names = {t.name for t, _, _ in ran if t.phase == changes.EXACT}
        return judged_in_phases(design, measures, exact_names), ran

    def phase(
        self, design: Design, baseline: Arm, trials: list[Trial], first_round: int, earlier: dict
    ) -> tuple[dict, dict, Trial | None]:
        """One phase: R rounds of its baseline and its trials from `first_round`, the judgement (in the family with
        the `earlier` phases' measures), and with two or more kept R rounds of the kept ones together. (measured
        by arm, the measures of its trials that did not fail, the together trial or None)."""
        measured = {baseline.name: {}, **{t.name: {} for t in trials}}
        exact = trials[0].phase == changes.EXACT
        checked = self.fp32_pairs(design, [baseline, *(t.arm for t in trials)]) if exact else {}
        arms = [baseline, *(t.arm for t in trials if t.name not in self.failed)]
        self.rounds(design, arms, range(first_round, first_round + design.rounds), measured)
        mine = [t for t in trials if t.name not in self.failed]
        measures = {
            t.name: measure(design, measured[baseline.name], measured[t.name], t.kind, self.pair(checked, baseline, t))
            for t in mine
        }
        judged = in_family(design, {**earlier, **measures})  # each trial measured once for both stages
        kept = [t for t in mine if judged[t.name]["keep"]]
        if len(kept) < 2:
            return measured, measures, None
        own = functools.reduce(operator.or_, (t.own for t in kept), Change())
        name = TOGETHER[trials[0].phase]
        together = Trial(name, Arm(name, baseline.change | own), None, own.kind, trials[0].phase, own)
        measured[name] = {}
        start = first_round + design.rounds
        if exact:
            checked.update(self.fp32_pairs(design, [together.arm]))
        self.rounds(design, [baseline, together.arm], range(start, start + design.rounds), measured)
        if name not in self.failed:
            measures[name] = measure(
                design, measured[baseline.name], measured[name], together.kind, self.pair(checked, baseline, together)
            )
        return measured, measures, together

    def fp32_pairs(self, design: Design, arms: list[Arm]) -> dict[str, list[dict]]:
        """Where the rounds run at another precision than fp32: one fp32 run of each arm (mixed precision and TF32
        off, the first round's seed), by arm, for the exact changes' judgement; {} where the rounds are fp32."""
        if not design.exact_check:
            return {}
        found = {}
        for arm in arms:
            pair = Arm(f"{arm.name}-fp32", arm.change | self.exact_pair)
            try:
                found[arm.name] = [self.run(pair, 0, design.seed_of(0), f"exactness pair {arm.name} (fp32)")]
            except TrialFailed as failure:  # the baseline's (first of several): no exact change can be shown exact
                for other in arms[1:] if arm is arms[0] and len(arms) > 1 else [arm]:
                    self.failed.setdefault(other.name, f"no fp32 pair to show it exact: {failure}")
                if arm is arms[0] and len(arms) > 1:
                    return {}
        return found

    @staticmethod
    def pair(checked: dict[str, list[dict]], baseline: Arm, trial: Trial) -> tuple[list[dict], list[dict]] | None:
        return (checked[baseline.name], checked.get(trial.name, [])) if baseline.name in checked else None


def plan_cost(exact: int, other: int, rounds: int, fp32_pairs: bool = False) -> int:
    """Runs the phases take: R rounds of a baseline and the phase's k trials, and for k >= 2 R rounds of the baseline
    and the kept ones together -- for the exact phase, then the others; with `fp32_pairs` (rounds at another
    precision) one fp32 run of the exact phase's baseline, of each exact trial and of the kept ones together."""
    pairs = (1 + exact + (1 if exact > 1 else 0)) if fp32_pairs and exact else 0
    return pairs + sum(rounds * (1 + k) + (2 * rounds if k > 1 else 0) for k in (exact, other) if k)


def plan_trials(
    trials: list[Trial], run_s: float, remaining_s: float, rounds: int, most: int, fp32_pairs: bool = False
) -> tuple[list, list]:
    """How many trials the budget holds, decided before measuring, in runs of the advice run's length: the exact
    ones first, then the numeric, then the training ones (the advisor's order within each), `most` at most.
    (tried, the others)."""
    ordered = sorted(trials, key=lambda t: changes.KINDS.index(t.kind))
    candidates = ordered[:most]
    for k in range(len(candidates), 0, -1):
        exact = sum(t.kind == changes.EXACT for t in candidates[:k])
        if plan_cost(exact, k - exact, rounds, fp32_pairs) * run_s <= remaining_s:
            return candidates[:k], ordered[k:]
    return [], ordered
