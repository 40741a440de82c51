"""make tune: run the baseline, ask the advisor, try its suggestions, keep what is measurably faster.

    python -m trainscope.tune --runs runs/tune [--budget 2400] [--seeds 3] [--min-rounds 3] [--max-rounds 6] \\
        [--max-suggestions 3] [--config C] -- [train.py flags: the baseline command]

1. The baseline (the README's main command with the given flags) runs once; the advisor reads its record
   (trainscope.advisor). It runs again with `--seeds` - 1 other seeds (the data held fixed with --data-seed):
   the seed-to-seed spread of validation accuracy and loss, what "the same result" is judged against.
2. The suggestions that are flags or a config, top first, are tried against the baseline in alternating
   rounds (baseline and every undecided trial in each round, the order reversed every other round), the same
   seed and steps. Each trial is judged on the *same work*: its timed wall time with the training part scaled
   to the baseline's real (non-padding) tokens, so a change to what a step holds (accumulation, batch size,
   length grouping) is neither favoured nor punished by it. The test (trainscope.bench): two-sided Mann-Whitney
   U against the baseline's runs, p-values Holm-corrected for the number of trials, alpha 0.05, and a minimum
   effect of 3%. Rounds start at --min-rounds and are added, up to --max-rounds, while a trial is undecided,
   as Chromium's Pinpoint adds runs while its answer is unknown; a decided trial leaves the rounds.
3. A trial is kept when it is faster and its validation accuracy and loss lie within the seed-to-seed spread of
   the baseline's: inside the 95% prediction interval of one more seed, mean +- t(n-1) s sqrt(1 + 1/n) over the
   seeds (the same result); two or more kept ones are then tried together against the baseline.
4. The budget (seconds) decides how many suggestions are tried and how many rounds run: what does not fit
   is listed as not tried, a trial still undecided when the budget ends is "within noise".
Writes <runs>/comparison.{json,md} with provenance; the report's Optimization section shows it.
"""

import argparse
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from trainscope import advisor, bench, launching
from trainscope.experiments.base import Arm, ExperimentFailed, run_arm, split_args
from trainscope.experiments.optimization import final_text, final_trial, tune_table
from trainscope.records import read_record

MIN_ROUNDS, MAX_ROUNDS = 3, 6


@dataclass
class Trial:
    """One arm against the baseline and what its rounds measured."""

    name: str
    arm: Arm
    suggestion: object = None          # the advisor's Suggestion (None for the kept ones together)
    runs: list = field(default_factory=list)  # headline figures, one per round it took part in
    rounds: list = field(default_factory=list)  # indices of those rounds
    decided: bool = False


def work_seconds(run: dict, reference_tokens: float) -> float:
    """A run's timed wall time for the same work as the baseline: evaluation as measured, training scaled to
    the baseline's real tokens (the identity when a change leaves what a step holds alone)."""
    return run["eval_s"] + run["train_wall_s"] * reference_tokens / run["train_tokens"]


def judge_all(trials: list[Trial], baseline_runs: list[dict]) -> dict[str, dict]:
    """Every trial against the baseline on the same work, Holm-corrected over the trials: {name: comparison}."""
    reference = statistics.median(r["train_tokens"] for r in baseline_runs)
    base = [work_seconds(r, reference) for r in baseline_runs]
    raw = {t.name: bench.mann_whitney_p(base, [work_seconds(r, reference) for r in t.runs]) for t in trials}
    adjusted = dict(zip(raw, bench.holm(list(raw.values()))))
    judged = {}
    for t in trials:
        mine = [work_seconds(r, reference) for r in t.runs]
        paired = [baseline_runs[i] for i in t.rounds]  # the baseline runs of the rounds this trial took part in
        comparison = bench.compare_samples([work_seconds(r, reference) for r in paired], mine, higher_is_better=False,
                                           min_pairs=bench.MIN_DECIDABLE, p_value=adjusted[t.name])
        comparison.update(p_raw=raw[t.name], p_value=adjusted[t.name], correction=f"Holm over {len(trials)} trial(s)")
        judged[t.name] = comparison
    return judged


def seed_spread(runs: list[dict]) -> dict | None:
    """Validation accuracy and loss across the baseline's seeds, and the 95% prediction interval of one more seed's
    (trainscope.bench.prediction_interval): what "the same result" is judged against."""
    values = [(r["validation_accuracy"], r["validation_loss"]) for r in runs if r["validation_loss"] is not None]
    if len(values) < 2:
        return None
    accuracy, loss = map(list, zip(*values))
    return {"seeds": [r["seed"] for r in runs], "validation_accuracy": bench.spread(accuracy),
            "validation_loss": bench.spread(loss), "accuracy_interval": bench.prediction_interval(accuracy),
            "loss_interval": bench.prediction_interval(loss)}


def same_result(trial_runs: list[dict], baseline_runs: list[dict], spread: dict | None) -> tuple[bool | None, str]:
    """Whether the trial learned the same as the baseline: its median validation accuracy and loss inside the
    95% prediction interval of one more baseline seed (None when no spread was measured)."""
    if spread is None:
        return None, "unknown: no seed spread measured (--seeds 1 or the budget)"
    accuracy = statistics.median(r["validation_accuracy"] for r in trial_runs)
    loss = statistics.median(r["validation_loss"] for r in trial_runs)
    (a_low, a_high), (l_low, l_high) = spread["accuracy_interval"], spread["loss_interval"]
    same = a_low <= accuracy <= a_high and l_low <= loss <= l_high
    text = (f"validation accuracy {accuracy:.4f} in [{a_low:.4f}, {a_high:.4f}], loss {loss:.4f} in "
            f"[{l_low:.4f}, {l_high:.4f}]" if same else
            f"validation accuracy {accuracy:.4f} against [{a_low:.4f}, {a_high:.4f}], loss {loss:.4f} against "
            f"[{l_low:.4f}, {l_high:.4f}]")
    return same, ("same" if same else "changed") + f" ({text}: the seeds' 95% prediction interval)"


class Tuner:
    """Runs the rounds: the baseline and the undecided trials, alternating, within the budget."""

    def __init__(self, args, train_args: list[str], started: float):
        self.args, self.train_args, self.started = args, train_args, started
        self.runs = Path(args.runs)
        self.baseline = Arm("baseline", args.config, [], launcher=args.launcher, script=Path(args.script))
        self.baseline_runs: list[dict] = []
        self.run_s: dict[str, float] = {}

    def remaining(self) -> float:
        return self.args.budget - (time.monotonic() - self.started)

    def run(self, arm: Arm, round_index: int, extra: list[str] = ()) -> dict:
        began = time.monotonic()
        result = run_arm(arm, self.train_args, self.runs, round_index, list(extra))
        self.run_s[arm.name] = time.monotonic() - began
        print(f"round {round_index + 1} {arm.name}: wall {result['wall_s']:.1f} s (training {result['train_wall_s']:.1f} s "
              f"for {result['train_tokens']} tokens, evaluation {result['eval_s']:.1f} s), validation loss "
              f"{result['validation_loss']:.4f}; {self.remaining():.0f} s of the budget left", flush=True)
        return result

    def rounds(self, trials: list[Trial], first_round: int) -> dict[str, dict]:
        """Rounds until every trial is decided, the cap is reached or the next round would overrun the budget.
        Round indices go on from `first_round` (the baseline's runs of earlier rounds are kept)."""
        index = first_round
        judged = {}
        while True:
            live = [t for t in trials if not t.decided]
            done = index - first_round
            cost = sum(self.run_s.get(t.name, self.run_s["baseline"]) for t in live) + self.run_s["baseline"]
            if not live or done >= self.args.max_rounds or (done >= self.args.min_rounds and cost > self.remaining()):
                return judged or judge_all(trials, self.baseline_runs)
            arms = {"baseline": None, **{t.name: t for t in live}}
            for name in bench.round_order(list(arms), index):
                if name == "baseline":
                    if len(self.baseline_runs) <= index:
                        self.baseline_runs.append(self.run(self.baseline, index))
                else:
                    arms[name].runs.append(self.run(arms[name].arm, index))
                    arms[name].rounds.append(index)
            index += 1
            judged = judge_all(trials, self.baseline_runs)
            for t in live:
                t.decided = judged[t.name]["verdict"] in ("faster", "slower")


def plan_trials(suggestions: list, run_s: float, remaining_s: float, seeds: int, min_rounds: int,
                most: int) -> tuple[list, list]:
    """How many suggestions the budget holds at the least: the extra seeds, `min_rounds` rounds of baseline
    and trials (round 0's baseline already ran), and for two or more the kept ones together; more rounds
    are added later only while the budget lasts."""
    candidates = [s for s in suggestions if s.flags or s.config][:most]
    for k in range(len(candidates), 0, -1):
        cost = ((seeds - 1) + min_rounds * (1 + k) - 1 + (min_rounds * 2 if k > 1 else 0)) * run_s
        if cost <= remaining_s:
            return candidates[:k], candidates[k:]
    return [], candidates


def tune(args, train_args: list[str]) -> dict:
    started = time.monotonic()
    tuner = Tuner(args, train_args, started)
    tuner.baseline_runs.append(tuner.run(tuner.baseline, 0))  # the advice comes from it; round 0's baseline
    suggestions = advisor.advise(read_record(tuner.runs / tuner.baseline_runs[0]["run"]))
    tried, untried = plan_trials(suggestions, tuner.run_s["baseline"], tuner.remaining(), args.seeds,
                                 args.min_rounds, args.max_suggestions)
    seed = tuner.baseline_runs[0]["seed"]
    seeds = [tuner.baseline_runs[0]] + [
        tuner.run(Arm(f"seed{seed + i}", args.config, [], launcher=args.launcher, script=Path(args.script)), 0,
                  ["--seed", str(seed + i), "--data-seed", str(seed)]) for i in range(1, args.seeds)]
    spread = seed_spread(seeds)
    print(f"baseline run took {tuner.run_s['baseline']:.0f} s; trying {len(tried)} suggestion(s) within the "
          f"{args.budget:.0f} s budget", flush=True)
    trials = [Trial(f"s{i + 1}", trial_arm(f"s{i + 1}", s, args), s) for i, s in enumerate(tried)]
    judged = tuner.rounds(trials, 0) if trials else {}
    results = [trial_result(t, judged[t.name], tuner.baseline_runs, spread) for t in trials]
    kept = [r for r in results if r["verdict"] == "faster" and r["same_result"]]
    if len(kept) > 1:
        together = Trial("kept", Arm("kept", next((r["config"] for r in kept if r["config"]), args.config),
                                     [f for r in kept for f in r["flags"]], launcher=args.launcher,
                                     script=Path(args.script)))
        judged = tuner.rounds([together], len(tuner.baseline_runs))
        results.append(trial_result(together, judged["kept"], [tuner.baseline_runs[i] for i in together.rounds], spread))
    return summarize(args, train_args, suggestions, results, untried, spread, time.monotonic() - started)


def trial_arm(name: str, suggestion, args) -> Arm:
    return Arm(name, suggestion.config or args.config, list(suggestion.flags), launcher=args.launcher,
               script=Path(args.script))


def trial_result(trial: Trial, speed: dict, baseline_runs: list[dict], spread: dict | None) -> dict:
    same, text = same_result(trial.runs, baseline_runs, spread)
    s = trial.suggestion
    return {"name": trial.name, "rule": s.rule if s else "together",
            "change": s.change if s else "the kept suggestions together", "flags": trial.arm.flags,
            "config": trial.arm.config, "gain": s.gain if s else None, "gain_kind": s.gain_kind if s else None,
            "gain_text": s.gain_text() if s else None, "changes_result": s.changes_result if s else None,
            "runs": [r["run"] for r in trial.runs], "pairs": len(trial.runs), "speed": speed,
            "verdict": speed["verdict"], "same_result": same, "result": text,
            "tokens_per_run": statistics.median(r["train_tokens"] for r in trial.runs)}


def merge_flags(base: list[str], extra: list[str]) -> list[str]:
    """`base` with `extra` applied: a flag given in `extra` replaces its earlier value in `base`."""
    def pairs(flags):
        out, i = [], 0
        while i < len(flags):
            takes_value = i + 1 < len(flags) and not flags[i + 1].startswith("--")
            out.append(flags[i:i + 2] if takes_value else flags[i:i + 1])
            i += 2 if takes_value else 1
        return out
    overridden = {pair[0] for pair in pairs(extra)}
    return [f for pair in pairs(base) if pair[0] not in overridden for f in pair] + list(extra)


def summarize(args, train_args, suggestions, trials, untried, spread, elapsed) -> dict:
    final = final_trial(trials)
    config = final["config"] if final else args.config
    command = (f"accelerate launch {launching.config_argument(config) + ' ' if config else ''}train.py "
               + " ".join(merge_flags(train_args, final["flags"] if final else [])))
    return {"experiment": "tune", "baseline_args": train_args, "budget_s": args.budget, "elapsed_s": elapsed,
            "min_rounds": args.min_rounds, "max_rounds": args.max_rounds, "method": method_text(spread),
            "seed_spread": spread, "suggestions": [s.to_dict() for s in suggestions], "trials": trials,
            "not_tried": [{"change": s.change, "flags": s.flags, "why": "over the time budget"} for s in untried]
            + [{"change": s.change, "flags": [], "why": "not a flag or config (see the advice)"}
               for s in suggestions if not (s.flags or s.config)],
            "final_flags": final["flags"] if final else [], "final_config": config, "final_command": command,
            "summary": final_text(final)}


def method_text(spread: dict | None) -> str:
    same = (f"validation accuracy and loss inside the 95% prediction interval of one more baseline seed (seeds "
            f"{spread['seeds']}: accuracy [{spread['accuracy_interval'][0]:.4f}, {spread['accuracy_interval'][1]:.4f}], "
            f"loss [{spread['loss_interval'][0]:.4f}, {spread['loss_interval'][1]:.4f}])" if spread else
            "unknown (no seed spread measured)")
    return (f"Speed on the same work (training scaled to the baseline's real tokens, evaluation as measured); "
            f"test: {bench.METHOD}, p-values Holm-corrected over the trials; rounds added while a trial is undecided. "
            f"Same result: {same}.")


def markdown(result: dict) -> list[str]:
    lines = ["# make tune", "", f"Baseline flags: `{' '.join(result['baseline_args'])}`; {result['min_rounds']}-"
             f"{result['max_rounds']} alternating rounds per trial; budget {result['budget_s']:.0f} s, used "
             f"{result['elapsed_s']:.0f} s.", "", result["method"], "", *tune_table(result).markdown_lines(), "",
             result["summary"], "", f"Final command: `{result['final_command']}`", ""]
    lines += [f"- {t['name']}: {t['pairs']} pairs, p {t['speed']['p_raw']:.3g} raw, {t['speed']['p_value']:.3g} "
              f"Holm-adjusted; runs {', '.join(t['runs'])}" for t in result["trials"]]
    lines += [f"- not tried: {n['change']} ({n['why']})" for n in result["not_tried"]]
    return lines


def parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", required=True, help="where the runs and comparison.{json,md} go")
    parser.add_argument("--budget", type=float, default=2400, help="seconds for the whole tuning (default 2400)")
    parser.add_argument("--seeds", type=int, default=3,
                        help="seeds of the baseline for the seed-to-seed spread of its result (default 3; 1: unknown)")
    parser.add_argument("--min-rounds", type=int, default=MIN_ROUNDS, help=f"rounds every trial gets (default {MIN_ROUNDS})")
    parser.add_argument("--max-rounds", type=int, default=MAX_ROUNDS,
                        help=f"rounds at most, added while a trial is undecided (default {MAX_ROUNDS})")
    parser.add_argument("--max-suggestions", type=int, default=3, help="suggestions to try at most (default 3)")
    parser.add_argument("--config", default=None, help="Accelerate config of every run (default: none, as make train)")
    parser.add_argument("--launcher", default="accelerate", choices=["accelerate", "python"], help="how runs are launched")
    parser.add_argument("--script", default=str(launching.TRAIN_SCRIPT), help=argparse.SUPPRESS)
    return parser


def main(argv=None) -> None:
    ours, train_args = split_args(sys.argv[1:] if argv is None else argv)
    args = parser().parse_args(ours)
    if args.budget <= 0 or args.seeds < 1 or args.max_suggestions < 1 or not 1 <= args.min_rounds <= args.max_rounds:
        parser().error("--budget must be positive, --seeds and --max-suggestions at least 1, and "
                       "1 <= --min-rounds <= --max-rounds")
    try:
        result = tune(args, train_args)
    except ExperimentFailed as error:
        print(f"error: {error}", file=sys.stderr)
        sys.exit(1)
    bench.write_results(Path(args.runs) / "comparison", result, markdown(result))
    print((Path(args.runs) / "comparison.md").read_text())


if __name__ == "__main__":
    main()
