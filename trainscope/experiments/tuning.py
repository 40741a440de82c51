"""make tune: run the baseline, ask the advisor, try its suggestions, keep what is measurably faster with a result
shown to be the same -- each change judged by what can decide it.

How it works: docs/tune.md#in-the-code-how-make-tune-runs-trainscopeexperimentstuningpy.
"""

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

from trainscope.advice import advisor, changes
from trainscope.advice.design import ACCURACY_MARGIN, LOSS_MARGIN, ROUNDS, Design, method_text
from trainscope.advice.judge import (
    TOGETHER,
    final_choice,
    final_trial,
    in_family,
    judged_in_phases,
    measure,
    merge_flags,
    run_figures,
    trial_verdicts,
)
from trainscope.core import launching
from trainscope.core.launching import split_args
from trainscope.core.record_view import RunView
from trainscope.core.records import read_record, read_steps
from trainscope.experiments.base import Arm, ExperimentFailed, run_arm
from trainscope.experiments.optimization import equivalence_table, tune_table
from trainscope.measure import bench, machine_kinds

__all__ = ["merge_flags", "tune", "main"]

Runner = Callable[[Arm, int, list[str]], dict]  # (arm, round index, extra train.py flags) -> the run's figures


@dataclass
class Trial:
    """One arm against its baseline: a suggestion, or the kept ones of a phase together (suggestion None)."""

    name: str
    arm: Arm
    suggestion: object = None
    kind: str = changes.NUMERIC
    phase: str = "other"  # "exact" (tried first, stacked) or "other" (on top of the stack)
    own_flags: list = field(default_factory=list)  # the change's flags, without the stack's


class Tuner:
    """Runs arms in alternating rounds within the budget: the world make tune measures, behind a runner and a clock
    (a test passes simulated ones), apart from the decision (trainscope.advice.judge.judge)."""

    def __init__(
        self,
        runner: Runner,
        budget_s: float,
        clock: Callable[[], float] = time.monotonic,
        log: Callable[[str], None] = print,
    ):
        self.runner, self.budget_s, self.clock, self.log = runner, budget_s, clock, log
        self.started = clock()
        self.run_s: dict[str, float] = {}

    def remaining(self) -> float:
        return self.budget_s - (self.clock() - self.started)

    def run(self, arm: Arm, round_index: int, extra: list[str], label: str | None = None) -> dict:
        began = self.clock()
        result = self.runner(arm, round_index, list(extra))
        self.run_s[arm.name] = self.clock() - began
        label = label or f"round {round_index + 1} {arm.name}"
        self.log(
            f"{label} (seed {result.get('seed')}): wall {result['wall_s']:.1f} s "
            f"(training {result['train_wall_s']:.1f} s for {result['train_tokens']} tokens, evaluation "
            f"{result['eval_s']:.1f} s), validation accuracy {result['validation_accuracy']}; "
            f"{self.remaining():.0f} s of the budget left"
        )
        return result

    def rounds(self, design: Design, arms: list[Arm], indices: range, measured: dict) -> None:
        """Every arm once per round, alternating the order, with the round's seed; a round the budget cannot hold
        (by the arms' last run times) is not started."""
        for index in indices:
            cost = sum(
                self.run_s.get(arm.name, self.run_s.get("baseline", self.run_s.get("advice", 0.0))) for arm in arms
            )
            if cost > self.remaining():
                self.log(
                    f"budget: round {index + 1} (about {cost:.0f} s) does not fit the {self.remaining():.0f} s "
                    "left; the trials of these rounds are not judged"
                )
                return
            for arm in bench.round_order(arms, index):
                measured[arm.name][index] = self.run(arm, index, design.flags(index))

    def decide(
        self, design: Design, baseline: Arm, exact: list[Trial], others: list[Trial]
    ) -> tuple[dict[str, dict], list[tuple[Trial, dict, dict]]]:
        """The whole decision: the exact trials' phase against the baseline, judged on its own (the stack is built
        on those verdicts), then the other trials' phase on top of the stack and against it, judged in the whole
        family. (judgement by trial, [(trial, its runs by round, its baseline's runs by round)] for every trial run,
        the kept ones together included)."""
        ran, measures, start, stack = [], {}, 0, []
        if exact:
            measured, measures, together = self.phase(design, baseline, exact, 0, {})
            judged = in_family(design, measures)
            ran = [(t, measured[t.name], measured[baseline.name]) for t in exact + ([together] if together else [])]
            start = design.rounds * (2 if together else 1)
            stack = (
                final_trial(
                    [{"name": t.name, "phase": t.phase, "flags": t.own_flags, **judged[t.name]} for t, _, _ in ran]
                )
                or {}
            ).get("flags", [])
        if others:
            base = replace(baseline, name="stacked", flags=baseline.flags + stack) if stack else baseline
            others = [replace(t, arm=replace(t.arm, flags=base.flags + t.own_flags)) for t in others]
            measured, phase, together = self.phase(design, base, others, start, measures)
            measures = {**measures, **phase}
            ran += [(t, measured[t.name], measured[base.name]) for t in others + ([together] if together else [])]
        exact_names = {t.name for t, _, _ in ran if t.phase == changes.EXACT}
        return judged_in_phases(design, measures, exact_names), ran

    def phase(
        self, design: Design, baseline: Arm, trials: list[Trial], first_round: int, earlier: dict
    ) -> tuple[dict, dict, Trial | None]:
        """One phase: R rounds of its baseline and its trials from `first_round`, the judgement (in the family with
        the `earlier` phases' measures), and with two or more kept R rounds of the kept ones together. (measured
        by arm, the measures of its trials, the together trial or None)."""
        measured = {baseline.name: {}, **{t.name: {} for t in trials}}
        exact = trials[0].phase == changes.EXACT
        checked = self.fp32_pairs(design, [baseline, *(t.arm for t in trials)]) if exact else {}
        self.rounds(
            design, [baseline, *(t.arm for t in trials)], range(first_round, first_round + design.rounds), measured
        )
        measures = {
            t.name: measure(
                design, measured[baseline.name], measured[t.name], t.kind, self.pair(checked, baseline, t.arm)
            )
            for t in trials
        }
        judged = in_family(design, {**earlier, **measures})  # each trial measured once for both stages
        kept = [t for t in trials if judged[t.name]["keep"]]
        if len(kept) < 2:
            return measured, measures, None
        name = TOGETHER[trials[0].phase]
        own = [f for t in kept for f in t.own_flags]
        together = Trial(
            name,
            Arm(
                name,
                next((t.arm.config for t in kept if t.arm.config), baseline.config),
                baseline.flags + own,
                launcher=baseline.launcher,
                script=baseline.script,
            ),
            kind=max((t.kind for t in kept), key=changes.KINDS.index),
            phase=trials[0].phase,
            own_flags=own,
        )
        measured[name] = {}
        start = first_round + design.rounds
        if exact:
            checked.update(self.fp32_pairs(design, [together.arm]))
        self.rounds(design, [baseline, together.arm], range(start, start + design.rounds), measured)
        measures[name] = measure(
            design, measured[baseline.name], measured[name], together.kind, self.pair(checked, baseline, together.arm)
        )
        return measured, measures, together

    def fp32_pairs(self, design: Design, arms: list[Arm]) -> dict[str, list[dict]]:
        """Where the rounds run at another precision than fp32: one fp32 run of each arm (mixed precision and TF32
        off, the first round's seed), by arm, for the exact changes' judgement; {} where the rounds are fp32."""
        if not design.exact_check:
            return {}
        return {
            arm.name: [
                self.run(
                    replace(arm, name=f"{arm.name}-fp32", mixed_precision="no"),
                    0,
                    design.check_flags(),
                    f"exactness pair {arm.name} (fp32)",
                )
            ]
            for arm in arms
        }

    @staticmethod
    def pair(checked: dict[str, list[dict]], baseline: Arm, trial: Arm) -> tuple[list[dict], list[dict]] | None:
        return (checked[baseline.name], checked[trial.name]) if baseline.name in checked else None


def kind_of(suggestion) -> str:
    return changes.kind_of(suggestion.flags, suggestion.config)


def plan_cost(exact: int, other: int, rounds: int, fp32_pairs: bool = False) -> int:
    """Runs make tune's phases take: R rounds of a baseline and the phase's k trials, and for k >= 2 R rounds of the
    baseline and the kept ones together -- for the exact phase, then the others; with `fp32_pairs` (rounds at
    another precision) one fp32 run of the exact phase's baseline, of each exact trial and of the kept ones
    together."""
    pairs = (1 + exact + (1 if exact > 1 else 0)) if fp32_pairs and exact else 0
    return pairs + sum(rounds * (1 + k) + (2 * rounds if k > 1 else 0) for k in (exact, other) if k)


def one_time_s(record: dict) -> dict[str, float]:
    """What the advice run spent, by its record, on set-up a later run on this machine finds cached: the predictor's
    first-use calibration and the matmul peak's measurement. The budget is planned in runs without them (the first
    run on a new machine would otherwise count them once for every planned run)."""
    found = {}
    calibration = (record.get("prediction") or {}).get("calibration") or {}
    if calibration.get("state") == "first use" and calibration.get("seconds"):
        found["the predictor's calibration"] = float(calibration["seconds"])
    peak = (record.get("environment") or {}).get("machine_peak") or {}
    if peak.get("from_cache") is False and peak.get("seconds"):
        found["the matmul peak"] = float(peak["seconds"])
    return found


def plan_trials(
    suggestions: list, run_s: float, remaining_s: float, rounds: int, most: int, fp32_pairs: bool = False
) -> tuple[list, list]:
    """How many suggestions the budget holds, decided before measuring, in runs of the advice run's length: the
    exact ones first, then the numeric, then the training ones (the advisor's order within each); a suggestion
    this build cannot run, or with nothing to run, is never planned. (tried, over the budget)."""
    candidates = sorted(
        (s for s in suggestions if (s.flags or s.config) and not changes.unavailable(s.flags, s.config)),
        key=lambda s: changes.KINDS.index(kind_of(s)),
    )[:most]
    for k in range(len(candidates), 0, -1):
        exact = sum(kind_of(s) == changes.EXACT for s in candidates[:k])
        if plan_cost(exact, k - exact, rounds, fp32_pairs) * run_s <= remaining_s:
            return candidates[:k], candidates[k:]
    return [], candidates


def tuning_figures(runs: Path, figures: dict) -> dict:
    """A run's figures with what make tune judges beside the headline: its step losses and epochs (read from its
    folder where it has one)."""
    folder = runs / figures["run"]
    if not (folder / "record.json").exists():
        return figures
    return {**figures, **run_figures(read_record(folder), read_steps(folder))}


def tune(
    args,
    train_args: list[str],
    runner: Runner | None = None,
    clock: Callable[[], float] = time.monotonic,
    log: Callable[[str], None] = print,
) -> dict:
    runs = Path(args.runs)
    runner = runner or (lambda arm, index, extra: tuning_figures(runs, run_arm(arm, train_args, runs, index, extra)))
    tuner = Tuner(runner, args.budget, clock, lambda line: log(line) or sys.stdout.flush())
    arm = lambda name, config=args.config, flags=(): Arm(
        name,
        config,
        list(flags),
        launcher=args.launcher,  # noqa: E731
        script=Path(args.script),
    )
    first = tuner.run(arm("advice"), 0, [], "advice run")  # the advice comes from it; in no round (the warm-up)
    record = read_record(runs / first["run"])
    view = RunView(record)
    suggestions = advisor.advise(record)
    one_time = one_time_s(record)
    spent_once = sum(one_time.values())
    run_s = max(tuner.run_s["advice"] - spent_once, 0.0)
    precision = effective_precision(view)
    tried, untried = plan_trials(
        suggestions,
        run_s,
        tuner.remaining(),
        args.rounds,
        args.max_suggestions,
        fp32_pairs=precision != changes.EXACT_PRECISION,
    )
    exact_tried = [s for s in tried if kind_of(s) == changes.EXACT]
    design = Design(
        rounds=args.rounds,
        trials=len(tried),
        exact=len(exact_tried),
        accuracy_margin=args.accuracy_margin,
        loss_margin=args.loss_margin,
        seed=first["seed"],
        data_seed=first["data_seed"],
        precision=precision,
        tolerance=changes.EXACT_TOLERANCE,
    )
    tuned_on = machine_kinds.machine_kind(view) if record else None
    setup = (
        f" ({spent_once:.0f} s of it this machine's one-time set-up: "
        + ", ".join(f"{name} {seconds:.0f} s" for name, seconds in one_time.items())
        + f"; planned at {run_s:.0f} s a run)"
        if one_time
        else ""
    )
    log(
        f"advice run took {tuner.run_s['advice']:.0f} s{setup}; {len(suggestions)} suggestion(s), trying {len(tried)} "
        f"within the {args.budget:.0f} s budget" + (f" on {tuned_on}" if tuned_on else "")
    )
    for line in design.lines():
        log(line)
    exact, others = build_trials(tried, arm, args.config, log)
    judged, ran = tuner.decide(design, arm("baseline"), exact, others)
    results = [trial_result(t, judged[t.name], mine, base) for t, mine, base in ran]
    for r in results:
        log(f"{r['name']}: {verdict_line(r)}")
    return summarize(
        args, train_args, design, first, suggestions, results, tried, untried, clock() - tuner.started, tuned_on
    )


def build_trials(tried: list, arm: Callable[..., Arm], config: str, log: Callable[[str], None]) -> tuple[list, list]:
    """The tried suggestions as trials, each logged: the exact changes (e1, e2, ...: tried first, the others run on
    top of the kept ones) and the others (s1, s2, ...)."""
    exact = [
        Trial(f"e{i + 1}", arm(f"e{i + 1}", config, s.flags), s, changes.EXACT, changes.EXACT, list(s.flags))
        for i, s in enumerate(s for s in tried if kind_of(s) == changes.EXACT)
    ]
    others = [
        Trial(f"s{i + 1}", arm(f"s{i + 1}", s.config or config, s.flags), s, kind_of(s), "other", list(s.flags))
        for i, s in enumerate(s for s in tried if kind_of(s) != changes.EXACT)
    ]
    for t in exact + others:
        log(
            f"{t.name}: {t.suggestion.change} ({changes_text(t)}): {t.kind} -- "
            f"{changes.does(t.own_flags, t.suggestion.config)}"
            + (" (tried first; the others run on top of the kept ones)" if t.kind == changes.EXACT and others else "")
        )
    return exact, others


def changes_text(trial: Trial) -> str:
    config = trial.suggestion.config if trial.suggestion else None
    return ", ".join(
        ([f"config {config}"] if config else []) + ([" ".join(trial.own_flags)] if trial.own_flags else [])
    )


def effective_precision(view: RunView) -> str:
    """The precision the advice run had in effect: fp32, tf32 (where it was on), bf16 or fp16."""
    precision = view.precision if view.precision in ("fp32", "bf16", "fp16") else "fp32"
    return "tf32" if precision == "fp32" and view.tf32_in_effect else precision


def trial_result(trial: Trial, judged: dict, runs: dict[int, dict], baseline: dict[int, dict]) -> dict:
    s = trial.suggestion
    return {
        "name": trial.name,
        "rule": s.rule if s else "together",
        "kind": trial.kind,
        "phase": trial.phase,
        "change": s.change if s else "the kept suggestions together",
        "flags": trial.arm.flags,
        "own_flags": trial.own_flags,
        "config": trial.arm.config,
        "gain": s.gain if s else None,
        "gain_kind": s.gain_kind if s else None,
        "gain_text": s.gain_text() if s else None,
        "changes_result": (s.changes_result if s else None) or changes.does(trial.own_flags),
        "runs": [runs[i]["run"] for i in sorted(runs)],
        "baseline_runs": [baseline[i]["run"] for i in sorted(runs) if i in baseline],
        **trial_verdicts(judged),
        "tokens_per_run": statistics.median(r["train_tokens"] for r in runs.values()) if runs else None,
    }


def verdict_line(trial: dict) -> str:
    """'faster 1.59x (1.51-1.66), 6 baseline / 6 trial runs, 1 look, p 0.0022 raw, 0.0065 Holm over 3; result ...'."""
    speed = trial["speed"]
    if not speed.get("pairs"):
        return f"{trial['verdict']}; result {trial['result']}"
    return (
        f"{trial['verdict']} {speed['median_ratio']:.3f}x ({speed['min_ratio']:.3f}-{speed['max_ratio']:.3f}) on "
        f"the same work, {speed['n_baseline']} baseline / {speed['n_trial']} trial runs, {speed['looks']} look, "
        f"p {speed['p_raw']:.2g} raw, {speed['p_value']:.2g} {speed['correction']}; result {trial['result']}"
    )


def summarize(args, train_args, design, first, suggestions, trials, tried, untried, elapsed, tuned_on=None) -> dict:
    return {
        "experiment": "tune",
        "baseline_args": train_args,
        "baseline_config": args.config,
        "budget_s": args.budget,
        "elapsed_s": elapsed,
        "advice_run": first["run"],
        "design": design.to_dict(),
        "method": method_text(design),
        "suggestions": [s.to_dict() for s in suggestions],
        "trials": trials,
        "not_tried": not_tried(suggestions, tried, untried, args.max_suggestions),
        **final_choice(trials, train_args, args.config, tuned_on),
    }


def not_tried(suggestions: list, tried: list, untried: list, most: int) -> list[dict]:
    """Every suggestion no trial tried, with why: not in this build, the budget, --max-suggestions, or no flag or
    config to try (`tried` and `untried`: plan_trials' split)."""
    tried_ids, over_budget = {id(s) for s in tried}, {id(s) for s in untried}

    def why(s) -> str:
        if not (s.flags or s.config):
            return "not a flag or config (see the advice)"
        return changes.unavailable(s.flags, s.config) or (
            "over the time budget" if id(s) in over_budget else f"beyond --max-suggestions {most}"
        )

    return [
        {"change": s.change, "flags": s.flags, "kind": kind_of(s) if (s.flags or s.config) else None, "why": why(s)}
        for s in suggestions
        if id(s) not in tried_ids
    ]


def markdown(result: dict) -> list[str]:
    design = result["design"]
    lines = [
        "# make tune",
        "",
        f"Baseline flags: `{' '.join(result['baseline_args'])}`; advice from "
        f"`{result.get('advice_run', '?')}`; budget {result['budget_s']:.0f} s, used {result['elapsed_s']:.0f} s.",
        "",
        f"Design (fixed before measuring): {design['trials']} trial(s), {design['rounds']} alternating rounds "
        f"each, seeds {design['seed']}-{design['seed'] + design['rounds'] - 1} (data seed {design['data_seed']}); "
        f"test: {design['test']}; boundary: {design['boundary']}; margins: accuracy +-{design['accuracy_margin']:g}, "
        f"loss +-{design['loss_margin']:g}.",
        "",
        result["method"],
        "",
        *tune_table(result).markdown_lines(),
        "",
        *equivalence_lines(result),
        result["summary"],
        "",
        f"Final command: `{result['final_command']}`"
        + (
            f" (tuned on {result['tuned_on']}: a run on a machine of another kind warns)"
            if result.get("tuned_on")
            else ""
        ),
        "",
    ]
    lines += [
        f"- {t['name']} ({t.get('kind', 'numeric')}): {verdict_line(t)}; rounds {t['rounds']}; runs "
        f"{', '.join(t['runs'])}" + (f"; changes: {t['changes_result']}" if t.get("changes_result") else "")
        for t in result["trials"]
    ]
    lines += [
        f"- not tried: {n['change']} ({n['why']}" + (f"; {n['kind']}" if n.get("kind") else "") + ")"
        for n in result["not_tried"]
    ]
    return lines


def equivalence_lines(result: dict) -> list[str]:
    """The paired-seed table where a trial was judged by it (exact changes are judged by their runs' numbers)."""
    table = equivalence_table(result)
    return [*table.markdown_lines(), ""] if table.rows else []


def parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", required=True, help="where the runs and comparison.{json,md} go")
    parser.add_argument(
        "--budget",
        type=float,
        default=2400,
        help="seconds for the whole tuning (default 2400); decides how many suggestions are tried",
    )
    parser.add_argument(
        "--rounds",
        type=int,
        default=ROUNDS,
        help=f"alternating rounds per trial, one seed each, judged once after the last (default "
        f"{ROUNDS}: 6 against 6 can pass Holm over up to 23 tests; 5 over up to 6; 4 over 1 only)",
    )
    parser.add_argument(
        "--accuracy-margin",
        type=float,
        default=ACCURACY_MARGIN,
        help=f"equivalence margin of validation and test accuracy, stated before measuring (default "
        f"{ACCURACY_MARGIN:g}: one point)",
    )
    parser.add_argument(
        "--loss-margin",
        type=float,
        default=LOSS_MARGIN,
        help=f"equivalence margin of validation and test loss in nats (default {LOSS_MARGIN:g}: the "
        "right label's geometric-mean probability within about 2%%)",
    )
    parser.add_argument("--max-suggestions", type=int, default=3, help="suggestions to try at most (default 3)")
    parser.add_argument("--config", default=None, help="Accelerate config of every run (default: none, as make train)")
    parser.add_argument(
        "--launcher", default="accelerate", choices=["accelerate", "python"], help="how runs are launched"
    )
    parser.add_argument("--script", default=str(launching.TRAIN_SCRIPT), help=argparse.SUPPRESS)
    return parser


def main(argv=None) -> None:
    ours, train_args = split_args(sys.argv[1:] if argv is None else argv)
    args = parser().parse_args(ours)
    if args.budget <= 0 or args.rounds < 1 or args.max_suggestions < 1:
        parser().error("--budget must be positive, --rounds and --max-suggestions at least 1")
    if not (0 < args.accuracy_margin < 1 and args.loss_margin > 0):
        parser().error("--accuracy-margin must be between 0 and 1 and --loss-margin positive")
    try:
        result = tune(args, train_args)
    except ExperimentFailed as error:
        print(f"error: {error}", file=sys.stderr)
        sys.exit(1)
    bench.write_results(Path(args.runs) / "comparison", result, markdown(result))
    print((Path(args.runs) / "comparison.md").read_text())


if __name__ == "__main__":
    main()
