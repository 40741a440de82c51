"""make tune: run the baseline, ask the advisor, try its suggestions, keep what is measurably faster with a result
shown to be the same.

    python -m trainscope.tune --runs runs/tune [--budget 2400] [--rounds 6] [--accuracy-margin 0.01] \\
        [--loss-margin 0.02] [--max-suggestions 3] [--config C] -- [train.py flags: the baseline command]

1. The baseline (the README's main command with the given flags) runs once: the advisor reads its record
   (trainscope.advisor). This run is also the warm-up; it belongs to no round.
2. The design is fixed before anything is measured, and printed (trainscope.tune_judge.Design): the
   suggestions the budget holds (k, at most --max-suggestions), --rounds R rounds per trial, the test, the
   family Holm corrects over (the k trials and, with k >= 2, the kept ones together) and the margins of "the
   same result".
3. R alternating rounds: round r runs the baseline and every trial with seed S + r (S: the baseline's seed; the
   data held by --data-seed), the order reversed every other round. After the last round, and only then, each
   trial is judged against the baseline runs of its own rounds (trainscope.tune_judge.judge): speed on the same
   work by the project's test, Holm-corrected over the family; the result by two one-sided tests on the paired
   seeds. Kept: faster and the same result.
4. Two or more kept: the kept ones together run R more rounds (the same seeds, new baseline runs) and are judged
   in the same family. Its flags and config are the final command; else the fastest kept trial; else the
   baseline stands.
5. The budget (seconds) decides how many suggestions are tried, before anything is measured; a round that
   would overrun it is not started, and a trial left with fewer than R rounds is not judged.
Writes <runs>/comparison.{json,md} with provenance; the report's Optimization section shows it. What make tune
keeps is measured on a short proxy of the job; `make tune-confirm` measures it on the full job.
"""

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from trainscope import advisor, bench, launching
from trainscope.experiments.base import Arm, ExperimentFailed, run_arm, split_args
from trainscope.experiments.optimization import equivalence_table, tune_table
from trainscope.records import read_record
from trainscope.tune_judge import (ACCURACY_MARGIN, LOSS_MARGIN, ROUNDS, Design, final_choice, in_family, measure,
                                   merge_flags, method_text)

__all__ = ["merge_flags", "tune", "main"]

Runner = Callable[[Arm, int, list[str]], dict]  # (arm, round index, extra train.py flags) -> the run's headline figures


@dataclass
class Trial:
    """One arm against the baseline: a suggestion, or the kept ones together (suggestion None)."""

    name: str
    arm: Arm
    suggestion: object = None


class Tuner:
    """Runs arms in alternating rounds within the budget: the world make tune measures, behind a runner and a clock
    (a test passes simulated ones), apart from the decision (trainscope.tune_judge.judge)."""

    def __init__(self, runner: Runner, budget_s: float, clock: Callable[[], float] = time.monotonic,
                 log: Callable[[str], None] = print):
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
        self.log(f"{label} (seed {result.get('seed')}): wall {result['wall_s']:.1f} s "
                 f"(training {result['train_wall_s']:.1f} s for {result['train_tokens']} tokens, evaluation "
                 f"{result['eval_s']:.1f} s), validation accuracy {result['validation_accuracy']}; "
                 f"{self.remaining():.0f} s of the budget left")
        return result

    def rounds(self, design: Design, arms: list[Arm], indices: range, measured: dict) -> None:
        """Every arm once per round, alternating the order, with the round's seed; a round the budget cannot hold
        (by the arms' last run times) is not started."""
        for index in indices:
            cost = sum(self.run_s.get(arm.name, self.run_s.get("baseline", self.run_s.get("advice", 0.0)))
                       for arm in arms)
            if cost > self.remaining():
                self.log(f"budget: round {index + 1} (about {cost:.0f} s) does not fit the {self.remaining():.0f} s "
                         "left; the trials of these rounds are not judged")
                return
            for arm in bench.round_order(arms, index):
                measured[arm.name][index] = self.run(arm, index, design.flags(index))

    def decide(self, design: Design, baseline: Arm, trials: list[Trial]) -> tuple[dict, dict, Trial | None]:
        """The whole decision: R rounds of the baseline and the trials, the judgement, and with two or more kept
        R rounds of the kept ones together, judged in the same family. (measured, judged, the together trial)."""
        measured = {"baseline": {}, **{t.name: {} for t in trials}}
        self.rounds(design, [baseline, *(t.arm for t in trials)], range(design.rounds), measured)
        measures = {t.name: measure(design, measured["baseline"], measured[t.name]) for t in trials}
        judged = in_family(design, measures)  # = judge(design, measured), each trial measured once for both stages
        kept = [t for t in trials if judged[t.name]["keep"]]
        if len(kept) < 2:
            return measured, judged, None
        together = Trial("kept", Arm("kept", next((t.arm.config for t in kept if t.arm.config), baseline.config),
                                     [f for t in kept for f in t.arm.flags], launcher=baseline.launcher,
                                     script=baseline.script))
        measured["kept"] = {}
        self.rounds(design, [baseline, together.arm], range(design.rounds, 2 * design.rounds), measured)
        measures["kept"] = measure(design, measured["baseline"], measured["kept"])
        return measured, in_family(design, measures), together


def plan_trials(suggestions: list, run_s: float, remaining_s: float, rounds: int, most: int) -> tuple[list, list]:
    """How many suggestions the budget holds, decided before measuring: R rounds of the baseline and k trials, and
    for k >= 2 R rounds of the baseline and the kept ones together, in runs of the advice run's length."""
    candidates = [s for s in suggestions if s.flags or s.config][:most]
    for k in range(len(candidates), 0, -1):
        if (rounds * (1 + k) + (2 * rounds if k > 1 else 0)) * run_s <= remaining_s:
            return candidates[:k], candidates[k:]
    return [], candidates


def tune(args, train_args: list[str], runner: Runner | None = None, clock: Callable[[], float] = time.monotonic,
         log: Callable[[str], None] = print) -> dict:
    runs = Path(args.runs)
    runner = runner or (lambda arm, index, extra: run_arm(arm, train_args, runs, index, extra))
    tuner = Tuner(runner, args.budget, clock, lambda line: log(line) or sys.stdout.flush())
    arm = lambda name, config=args.config, flags=(): Arm(name, config, list(flags), launcher=args.launcher,  # noqa: E731
                                                         script=Path(args.script))
    first = tuner.run(arm("advice"), 0, [], "advice run")  # the advice comes from it; in no round (the warm-up)
    suggestions = advisor.advise(read_record(runs / first["run"]))
    tried, untried = plan_trials(suggestions, tuner.run_s["advice"], tuner.remaining(), args.rounds,
                                 args.max_suggestions)
    design = Design(rounds=args.rounds, trials=len(tried), accuracy_margin=args.accuracy_margin,
                    loss_margin=args.loss_margin, seed=first["seed"], data_seed=first["data_seed"])
    log(f"advice run took {tuner.run_s['advice']:.0f} s; {len(suggestions)} suggestion(s), trying {len(tried)} within "
        f"the {args.budget:.0f} s budget")
    for line in design.lines():
        log(line)
    trials = [Trial(f"s{i + 1}", arm(f"s{i + 1}", s.config or args.config, s.flags), s) for i, s in enumerate(tried)]
    measured, judged, together = tuner.decide(design, arm("baseline"), trials) if trials else ({}, {}, None)
    results = [trial_result(t, judged[t.name], measured[t.name]) for t in trials + ([together] if together else [])]
    for r in results:
        log(f"{r['name']}: {verdict_line(r)}")
    return summarize(args, train_args, design, first, suggestions, results, tried, untried,
                     clock() - tuner.started)


def trial_result(trial: Trial, judged: dict, runs: dict[int, dict]) -> dict:
    s = trial.suggestion
    return {"name": trial.name, "rule": s.rule if s else "together",
            "change": s.change if s else "the kept suggestions together", "flags": trial.arm.flags,
            "config": trial.arm.config, "gain": s.gain if s else None, "gain_kind": s.gain_kind if s else None,
            "gain_text": s.gain_text() if s else None, "changes_result": s.changes_result if s else None,
            "runs": [runs[i]["run"] for i in sorted(runs)], "speed": judged["speed"], "training": judged["training"],
            "evaluation": judged["evaluation"], "verdict": judged["verdict"], "equivalence": judged["equivalence"],
            "same_result": judged["same_result"], "result": judged["result"], "rounds": judged["rounds"],
            "pairs": judged["speed"]["pairs"],
            "tokens_per_run": statistics.median(r["train_tokens"] for r in runs.values()) if runs else None}


def verdict_line(trial: dict) -> str:
    """'faster 1.59x (1.51-1.66), 6 baseline / 6 trial runs, 1 look, p 0.0022 raw, 0.0065 Holm over 3; result ...'."""
    speed = trial["speed"]
    if not speed.get("pairs"):
        return f"{trial['verdict']}; result {trial['result']}"
    return (f"{trial['verdict']} {speed['median_ratio']:.3f}x ({speed['min_ratio']:.3f}-{speed['max_ratio']:.3f}) on "
            f"the same work, {speed['n_baseline']} baseline / {speed['n_trial']} trial runs, {speed['looks']} look, "
            f"p {speed['p_raw']:.2g} raw, {speed['p_value']:.2g} {speed['correction']}; result {trial['result']}")


def summarize(args, train_args, design, first, suggestions, trials, tried, untried, elapsed) -> dict:
    return {"experiment": "tune", "baseline_args": train_args, "baseline_config": args.config, "budget_s": args.budget,
            "elapsed_s": elapsed, "advice_run": first["run"], "design": design.to_dict(), "method": method_text(design),
            "suggestions": [s.to_dict() for s in suggestions], "trials": trials,
            "not_tried": not_tried(suggestions, tried, untried, args.max_suggestions),
            **final_choice(trials, train_args, args.config)}


def not_tried(suggestions: list, tried: list, untried: list, most: int) -> list[dict]:
    """Every suggestion no trial tried, with why: the budget, --max-suggestions, or no flag or config to try
    (`tried` and `untried`: plan_trials' split)."""
    tried_ids, over_budget = {id(s) for s in tried}, {id(s) for s in untried}
    return [{"change": s.change, "flags": s.flags,
             "why": ("not a flag or config (see the advice)" if not (s.flags or s.config) else
                     "over the time budget" if id(s) in over_budget else f"beyond --max-suggestions {most}")}
            for s in suggestions if id(s) not in tried_ids]


def markdown(result: dict) -> list[str]:
    design = result["design"]
    lines = ["# make tune", "", f"Baseline flags: `{' '.join(result['baseline_args'])}`; advice from "
             f"`{result.get('advice_run', '?')}`; budget {result['budget_s']:.0f} s, used {result['elapsed_s']:.0f} s.",
             "", f"Design (fixed before measuring): {design['trials']} trial(s), {design['rounds']} alternating rounds "
             f"each, seeds {design['seed']}-{design['seed'] + design['rounds'] - 1} (data seed {design['data_seed']}); "
             f"test: {design['test']}; boundary: {design['boundary']}; margins: accuracy +-{design['accuracy_margin']:g}, "
             f"loss +-{design['loss_margin']:g}.", "", result["method"], "", *tune_table(result).markdown_lines(), "",
             *equivalence_table(result).markdown_lines(), "", result["summary"], "",
             f"Final command: `{result['final_command']}`", ""]
    lines += [f"- {t['name']}: {verdict_line(t)}; rounds {t['rounds']}; runs {', '.join(t['runs'])}"
              + (f"; changes: {t['changes_result']}" if t.get("changes_result") else "") for t in result["trials"]]
    lines += [f"- not tried: {n['change']} ({n['why']})" for n in result["not_tried"]]
    return lines


def parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", required=True, help="where the runs and comparison.{json,md} go")
    parser.add_argument("--budget", type=float, default=2400,
                        help="seconds for the whole tuning (default 2400); decides how many suggestions are tried")
    parser.add_argument("--rounds", type=int, default=ROUNDS,
                        help=f"alternating rounds per trial, one seed each, judged once after the last (default "
                        f"{ROUNDS}: 6 against 6 can pass Holm over up to 23 tests; 5 over up to 6; 4 over 1 only)")
    parser.add_argument("--accuracy-margin", type=float, default=ACCURACY_MARGIN,
                        help=f"equivalence margin of validation and test accuracy, stated before measuring (default "
                        f"{ACCURACY_MARGIN:g}: one point)")
    parser.add_argument("--loss-margin", type=float, default=LOSS_MARGIN,
                        help=f"equivalence margin of validation and test loss in nats (default {LOSS_MARGIN:g}: the "
                        "right label's geometric-mean probability within about 2%%)")
    parser.add_argument("--max-suggestions", type=int, default=3, help="suggestions to try at most (default 3)")
    parser.add_argument("--config", default=None, help="Accelerate config of every run (default: none, as make train)")
    parser.add_argument("--launcher", default="accelerate", choices=["accelerate", "python"], help="how runs are launched")
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
