"""make tune: run the baseline, ask the advisor, try its suggestions, keep what is measurably faster.

    python -m trainscope.tune --runs runs/tune [--budget 1200] [--rounds 3] [--max-suggestions 3] \\
        [--config C] -- [train.py flags: the baseline command]

1. The baseline (the README's main command with the given flags) runs once; the advisor reads its
   record (trainscope.advisor).
2. The suggestions that are flags or a config, top first, are tried one at a time: rounds (3 by
   default, a verdict needs at least 3 pairs here, against 5 for published benchmarks) of
   [baseline, suggestion 1, suggestion 2, ...] in alternating order, the same seed and steps. For
   each: the bound the advisor predicted, the measured speed-up of the whole timed run (training and
   evaluation: baseline wall / trial wall, median with min-max over rounds), the verdict, and whether
   the training result stayed the same (validation loss within TOLERANCE of the baseline's).
3. A suggestion is kept when it is faster outside noise and its result stayed the same; two or more
   kept ones are then tried together against the baseline the same way.
4. The budget (seconds) decides how many suggestions are tried: what does not fit is listed as not tried.
Writes <runs>/comparison.{json,md} with provenance; the report's Optimization section shows it.
"""

import argparse
import statistics
import sys
import time
from pathlib import Path

from trainscope import advisor, bench, launching
from trainscope.experiments import Arm, ExperimentFailed, run_arm
from trainscope.records import read_record

TOLERANCE = 0.05  # validation loss, absolute: the same result within run-to-run noise of these short runs
MIN_PAIRS = 3  # tune spends its budget on more trials: a verdict from 3 alternating pairs (the harness asks 5)


def trial_arm(name: str, suggestion_flags: list, config: str | None, args) -> Arm:
    return Arm(name, config, list(suggestion_flags), launcher=args.launcher, script=Path(args.script))


def measure(arms: list[Arm], train_args: list[str], runs: Path, rounds: int, first: dict | None = None) -> list[dict]:
    """Rounds of every arm, alternating order; each round: {arm: headline figures}. `first`: the baseline's
    figures for round 0, from the run made just before it (the baseline comes first in round 0 anyway)."""
    def run(arm, i):
        return first if (first is not None and arm.name == "baseline" and i == 0) else run_arm(arm, train_args, runs, i)
    return bench.alternate({arm.name: (lambda i, arm=arm: run(arm, i)) for arm in arms}, rounds)


def judge(rounds: list[dict], name: str) -> dict:
    """The trial against the baseline: speed of the whole timed run, and whether it learned the same."""
    speed = bench.compare([r["baseline"]["wall_s"] / r[name]["wall_s"] for r in rounds], MIN_PAIRS)
    throughput = bench.compare([r[name]["samples_per_s"] / r["baseline"]["samples_per_s"] for r in rounds], MIN_PAIRS)
    deltas = [r[name]["validation_loss"] - r["baseline"]["validation_loss"] for r in rounds
              if r[name]["validation_loss"] is not None and r["baseline"]["validation_loss"] is not None]
    same = bool(deltas) and abs(statistics.median(deltas)) <= TOLERANCE
    return {"speed": speed, "training_throughput": throughput, "validation_loss_delta": bench.spread(deltas) if deltas else None,
            "same_result": same, "speed_text": bench.ratio_text(speed), "verdict": speed["verdict"],
            "result": ("same (validation loss within %.2f)" % TOLERANCE) if same else "changed"}


def plan_trials(suggestions: list, run_s: float, remaining_s: float, rounds: int, most: int) -> tuple[list, list]:
    """How many suggestions fit the budget: rounds of baseline + k trials (round 0's baseline already ran),
    then, for two or more, the kept ones together."""
    candidates = [s for s in suggestions if s.flags or s.config][:most]
    for k in range(len(candidates), 0, -1):
        cost = (rounds * (1 + k) - 1) * run_s + (rounds * 2 * run_s if k > 1 else 0)
        if cost <= remaining_s:
            return candidates[:k], candidates[k:]
    return [], candidates


def tune(args, train_args: list[str]) -> dict:
    runs, started = Path(args.runs), time.monotonic()
    baseline = trial_arm("baseline", [], args.config, args)
    first = run_arm(baseline, train_args, runs, 0)  # advice comes from it; it is also round 0's baseline
    run_s = time.monotonic() - started
    suggestions = advisor.advise(read_record(runs / first["run"]))
    tried, untried = plan_trials(suggestions, run_s, args.budget - run_s, args.rounds, args.max_suggestions)
    print(f"baseline run took {run_s:.0f} s; trying {len(tried)} suggestion(s) within the {args.budget:.0f} s budget",
          flush=True)
    arms = [baseline] + [trial_arm(f"s{i + 1}", s.flags, s.config or args.config, args) for i, s in enumerate(tried)]
    rounds = measure(arms, train_args, runs, args.rounds, first) if tried else []
    trials = [{"name": f"s{i + 1}", "rule": s.rule, "change": s.change, "flags": s.flags, "config": s.config,
               "bound": s.bound, "changes_result": s.changes_result, **judge(rounds, f"s{i + 1}")}
              for i, s in enumerate(tried)]
    kept = [t for t in trials if t["verdict"] == "faster" and t["same_result"]]
    if len(kept) > 1:
        together = trial_arm("kept", [f for t in kept for f in t["flags"]], args.config, args)
        combined = measure([baseline, together], train_args, runs, args.rounds)
        trials.append({"name": "kept", "rule": "together", "change": "the kept suggestions together",
                       "flags": together.flags, "config": args.config, "bound": None, **judge(combined, "kept")})
    final_flags = trials[-1]["flags"] if len(kept) > 1 and trials[-1]["verdict"] == "faster" else (
        max(kept, key=lambda t: t["speed"]["median_ratio"])["flags"] if kept else [])
    return summarize(args, train_args, suggestions, trials, untried, final_flags, time.monotonic() - started)


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


def summarize(args, train_args, suggestions, trials, untried, final_flags, elapsed) -> dict:
    config = f"--config_file accelerate_configs/{args.config}.yaml " if args.config else ""
    command = f"launch {config}train.py " + " ".join(merge_flags(train_args, final_flags))
    best = max((t for t in trials if t["verdict"] == "faster" and t["same_result"]),
               key=lambda t: t["speed"]["median_ratio"], default=None)
    text = (f"Best: {best['name']} ({' '.join(best['flags'])}) {best['speed_text']}, faster outside noise with the same "
            "result." if best else "No suggestion was faster outside noise with the same result: the baseline stands; "
            "the rejected trials above are the evidence.")
    return {"experiment": "tune", "baseline_args": train_args, "budget_s": args.budget, "elapsed_s": elapsed,
            "rounds": args.rounds, "tolerance": TOLERANCE, "suggestions": [s.to_dict() for s in suggestions],
            "trials": trials, "not_tried": [{"change": s.change, "flags": s.flags, "why": "over the time budget"}
                                             for s in untried]
            + [{"change": s.change, "flags": [], "why": "not a flag or config (see the advice)"}
               for s in suggestions if not (s.flags or s.config)],
            "final_flags": final_flags, "final_command": f"accelerate {command}", "summary": text}


def markdown(result: dict) -> list[str]:
    lines = ["# make tune", "", f"Baseline flags: `{' '.join(result['baseline_args'])}`; {result['rounds']} alternating "
             f"rounds; budget {result['budget_s']:.0f} s, used {result['elapsed_s']:.0f} s; same result = validation "
             f"loss within {result['tolerance']} of the baseline's.", "",
             "| trial | flags | predicted bound | speed, whole run (median, min-max) | verdict | result |",
             "|---|---|---:|---:|---|---|"]
    for t in result["trials"]:
        lines.append(f"| {t['name']}: {t['change']} | `{' '.join(t['flags'])}` | "
                     f"{'%.2fx' % t['bound'] if t.get('bound') else '-'} | {t['speed_text']} | {t['verdict']} | {t['result']} |")
    lines += ["", result["summary"], "", f"Final command: `{result['final_command']}`", ""]
    lines += [f"- not tried: {n['change']} ({n['why']})" for n in result["not_tried"]]
    return lines


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", required=True, help="where the runs and comparison.{json,md} go")
    parser.add_argument("--budget", type=float, default=1200, help="seconds for the whole tuning (default 1200)")
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds per trial (default 3)")
    parser.add_argument("--max-suggestions", type=int, default=3, help="suggestions to try at most (default 3)")
    parser.add_argument("--config", default=None, help="Accelerate config of every run (default: none, as make train)")
    parser.add_argument("--launcher", default="accelerate", choices=["accelerate", "python"], help="how runs are launched")
    parser.add_argument("--script", default=str(launching.TRAIN_SCRIPT), help=argparse.SUPPRESS)
    argv = sys.argv[1:] if argv is None else argv
    ours, train_args = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    args = parser.parse_args(ours)
    if args.budget <= 0 or args.rounds < 1 or args.max_suggestions < 1:
        parser.error("--budget must be positive, --rounds and --max-suggestions at least 1")
    try:
        result = tune(args, train_args)
    except ExperimentFailed as error:
        print(f"error: {error}", file=sys.stderr)
        sys.exit(1)
    bench.write_results(Path(args.runs) / "comparison", result, markdown(result))
    print((Path(args.runs) / "comparison.md").read_text())


if __name__ == "__main__":
    main()
