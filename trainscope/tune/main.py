"""trainscope tune -- <your training command>: what makes your training faster with the same result, tried.

How it works: docs/tune.md.
"""

import argparse
import json
import math
import os
import shutil
import statistics
import sys
import time
from pathlib import Path

from trainscope.advice import advisor, changes
from trainscope.advice.design import ACCURACY_MARGIN, LOSS_MARGIN, ROUNDS, Design, method_text
from trainscope.advice.judge import METRICS, exactness, final_text, final_trial, run_figures, trial_verdicts
from trainscope.core import launching
from trainscope.core.errors import UserError
from trainscope.core.record_view import RunView
from trainscope.core.records import read_record, read_steps
from trainscope.experiments.optimization import equivalence_table, tune_table
from trainscope.measure import bench, machine_kinds
from trainscope.report.document import Bullets, Heading, Paragraph, markdown
from trainscope.run import overrides
from trainscope.tune.command import Change, Command, not_applied, outside
from trainscope.tune.tuner import Arm, Trial, TrialFailed, Tuner, plan_cost, plan_trials

BUDGET_S = 600  # about 10 minutes: a 2-core CPU's tuning of a short loop


class Launcher:
    """The runner of real runs: the command with an arm's change and the round's seed, its record read back (each
    run at most ten times the longest so far, 10 minutes at least, before it is stopped)."""

    def __init__(self, command: Command, runs: Path):
        self.command, self.runs, self.longest = command, runs, None

    def __call__(self, arm: Arm, round_index: int, seed: int) -> dict:
        name, began = f"{arm.name}-r{round_index}", time.monotonic()
        argv, env = self.command.applied(arm.change)
        env = {**os.environ, "PYTHONUNBUFFERED": "1", **env, overrides.OUTPUT: str(self.runs / name)}
        env[overrides.SEED] = str(seed)
        if arm.name == "advice":  # its record's estimates read the model timed alone after the loop
            env[overrides.TIME_MODEL] = "1"
        timeout = max(600.0, 10 * self.longest) if self.longest else None
        shutil.rmtree(self.runs / name, ignore_errors=True)  # no earlier tuning's record read as this run's
        result = launching.run_captured(argv, env, timeout, cwd=Path.cwd())
        self.longest = max(self.longest or 0.0, time.monotonic() - began)
        if result.returncode != 0:
            raise TrialFailed(f"{name} failed: {launching.failure_reason(result)}")
        if not (self.runs / name / "record.json").exists():
            raise TrialFailed(f"{name} wrote no trainscope record: its loop needs trainscope.Run or TrainscopeCallback")
        record = read_record(self.runs / name)
        why = not_applied(arm.change, RunView(record))
        if why:
            raise TrialFailed(f"not applied from outside the script: {why}")
        return {**figures(record, read_steps(self.runs / name)), "seed": seed}  # a loop's record has no seed setting


def figures(record: dict, steps: list[dict]) -> dict:
    """What tune judges a run by (trainscope.advice.judge.run_figures); a loop without token counts has its samples
    as its work, and one without evaluation scores its training loss as its result: the log of the mean of its
    second half's logged losses (so the loss margin is relative)."""
    found = run_figures(record, steps)
    found["train_tokens"] = found["train_tokens"] or found["train_samples"]
    late = [loss for _, loss in found["step_losses"][len(found["step_losses"]) // 2 :]]
    if not any(found.get(metric) is not None for metric in METRICS) and late and statistics.fmean(late) > 0:
        found["log_train_loss"] = math.log(statistics.fmean(late))
    return found


def determinism(design: Design, first: dict, second: dict) -> dict:
    """The probe: two runs of the command as it is on one seed, their step losses compared as an exact change's."""
    probe = exactness(design, [first], [second])
    if probe["verdict"] == "undecided":
        raise UserError(f"{first['run']} logged no step loss to compare: run more steps than trainscope's log_every")
    found = probe["first_beyond"]
    probe["text"] = (
        f"deterministic: two runs of the command as it is on seed {design.seed} agree ({probe['text']})"
        if found is None
        else f"not deterministic: two runs of the command as it is on seed {design.seed} differ ({found['what']} "
        f"{found['trial']:.6g} against {found['baseline']:.6g}): before its run opens the script draws numbers no seed "
        "fixes (a seed from the clock or the system, Python's or numpy's generators); every change is judged by the "
        "equivalence test on the rounds' runs, beyond what they differ by"
    )
    return probe


def candidates(suggestions: list, view: RunView, only: set | None, deterministic: bool) -> tuple[list, list]:
    """(trials to plan, [(suggestion, why not tried)]): each suggestion as a change from outside the script."""
    trials, skipped = [], []
    for s in suggestions:
        if not (s.flags or s.config):
            continue
        change = outside(s, view)
        why = change if isinstance(change, str) else s.unavailable  # or a flag this train.py lacks
        why = why or (only and s.rule.removeprefix("warning:") not in only and "not in --only")
        if why:
            skipped.append((s, why))
            continue
        trials.append(trial_of(s, change, deterministic))
    return trials, skipped


def trial_of(suggestion, change: Change, deterministic: bool) -> Trial:
    """A trial of `change`; on a command whose runs differ on one seed an exact change is judged as a numeric one."""
    kind = change.kind if deterministic or change.kind != changes.EXACT else changes.NUMERIC
    phase = changes.EXACT if kind == changes.EXACT else "other"
    return Trial(suggestion.rule, Arm(suggestion.rule, change), suggestion, kind, phase, change)


def confirmed(path: str) -> Change:
    """--confirm: the change an earlier trainscope tune kept (its comparison.json)."""
    try:
        kept = json.loads(Path(path).read_text())["final_change"]
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise UserError(f"--confirm {path}: not a trainscope tune result ({type(error).__name__})") from None
    if not kept:
        raise UserError(f"--confirm {path}: that tuning kept no change, nothing to confirm")
    return Change(
        **{k: tuple(map(tuple, v)) if k == "env" else tuple(v) if k == "flags" else v for k, v in kept.items()}
    )


def named(tried: list[Trial]) -> tuple[list[Trial], list[Trial]]:
    """The exact trials e1, e2, ... (tried first, the others on top of the kept ones) and the others s1, s2, ..."""
    exact = [t for t in tried if t.phase == changes.EXACT]
    others = [t for t in tried if t.phase != changes.EXACT]
    for prefix, trials in (("e", exact), ("s", others)):
        for i, t in enumerate(trials):
            t.name = f"{prefix}{i + 1}"
            t.arm = Arm(t.name, t.own)
    return exact, others


def probed(tuner: Tuner, args, runs: Path, log) -> tuple[dict, dict, dict]:
    """The command as it is, twice on the first round's seed: (the advice run's figures, its record, the probe)."""
    try:
        first = tuner.run(Arm("advice"), 0, args.seed, "as it is (the advice run)")
        second = tuner.run(Arm("repeat"), 0, args.seed, "as it is again, the same seed")
    except TrialFailed as failure:
        raise UserError(f"the command as it is: {failure}") from None
    probe = determinism(Design(seed=args.seed, tolerance=changes.EXACT_TOLERANCE), first, second)
    log(probe["text"])
    return first, read_record(runs / first["run"]), probe


def to_try(args, record: dict, view: RunView, deterministic: bool, kept: Change | None) -> tuple[list, list, list]:
    """(the suggestions, the trials to plan, [(suggestion, why it is not tried)]): the advice's changes that can be
    made from outside the script, or --confirm's one change (`kept`)."""
    if kept is not None:
        said = advisor.Suggestion("confirm", f"the change {args.confirm} kept", "an earlier tuning", [])
        return [said], [trial_of(said, kept, deterministic)], []
    suggestions = advisor.advise(record, in_loop_terms=False)
    return (suggestions, *candidates(suggestions, view, args.only, deterministic))


def tune(args, command: Command, runner=None, clock=time.monotonic, log=print) -> dict:
    runs = Path(args.runs).resolve()
    kept = confirmed(args.confirm) if args.confirm else None  # a result that cannot be confirmed: said before any run
    tuner = Tuner(runner or Launcher(command, runs), args.budget, clock, log)
    first, record, probe = probed(tuner, args, runs, log)
    view = RunView(record)
    if view.options_as == "flags":  # train.py: its exact changes' fp32 pairs with TF32 off too
        tuner.exact_pair = Change(mixed_precision="no", flags=("--tf32", "false"))
    suggestions, found, skipped = to_try(args, record, view, probe["verdict"] == "exact", kept)
    precision = view.precision if view.precision in ("bf16", "fp16") else "tf32" if view.tf32_in_effect else "fp32"
    run_s = tuner.run_s["repeat"]
    tried, over = plan_trials(found, run_s, tuner.remaining(), args.rounds, args.max_suggestions, precision != "fp32")
    exact, others = named(tried)
    margins = {"accuracy_margin": args.accuracy_margin, "loss_margin": args.loss_margin}
    design = Design(args.rounds, len(tried), **margins, seed=args.seed, data_seed=first["data_seed"], exact=len(exact),
                    precision=precision, tolerance=changes.EXACT_TOLERANCE)  # fmt: skip
    tuned_on = machine_kinds.machine_kind(view) if record else None
    log(
        f"{len(suggestions)} suggestion(s), {len(found)} applicable from outside the script; trying {len(tried)} "
        f"within the {args.budget:.0f} s budget ({tuner.remaining():.0f} s left, {run_s:.0f} s a run)"
        + (f" on {tuned_on}" if tuned_on else "")
    )
    for line in design.lines():
        log(line)
    for t in exact + others:
        log(f"{t.name} ({t.suggestion.rule}): {t.suggestion.change} (`{' '.join(command.words(t.own))}`): {t.kind}")
    not_tried = skipped + [(t.suggestion, "over the time budget or --max-suggestions") for t in over]
    for s, why in not_tried:
        log(f"not tried ({s.rule}): {s.change}: {why}")
    if over and not tried:  # what would hold the first: a budget, or rounds (4 at least: 4 against 4 passes Holm of 1)
        is_exact, fp32 = int(over[0].kind == changes.EXACT), precision != "fp32"
        cost = {r: plan_cost(is_exact, 1 - is_exact, r, fp32) for r in {*range(4, args.rounds + 1), args.rounds}}
        fits = max((r for r in cost if r >= 4 and cost[r] * run_s <= tuner.remaining()), default=None)
        needed = args.budget - tuner.remaining() + cost[args.rounds] * run_s
        log(f"the budget holds no trial: one takes {cost[args.rounds]} runs of about {run_s:.0f} s; --budget "
            f"{math.ceil(needed / 60) * 60:.0f} holds one"
            + (f", or --rounds {fits} ({cost[fits]} runs)" if fits else ""))  # fmt: skip
    judged, ran = tuner.decide(design, Arm("baseline"), exact, others)
    not_tried += [(t.suggestion, tuner.failed[t.name]) for t in tried if t.name in tuner.failed]
    result = {"experiment": "tune-confirm" if args.confirm else "tune", "command": command.text(Change()), "script": command.script,
              "budget_s": args.budget, "elapsed_s": clock() - tuner.started, "advice_run": first["run"],
              "determinism": {k: probe[k] for k in ("verdict", "text", "pair_runs")}, "design": design.to_dict(),
              "method": method_text(design), "suggestions": [s.to_dict() for s in suggestions], "tuned_on": tuned_on,
              "not_tried": [not_tried_entry(s, why) for s, why in not_tried]}  # fmt: skip
    return {**result, **final(command, view, [(t, judged[t.name], mine, base) for t, mine, base in ran], tuned_on)}


def final(command: Command, view: RunView, ran: list, tuned_on: str | None) -> dict:
    """The trials' results and the final choice: the kept trial's whole change (the stack under it included), the
    command to use (on train.py naming the machine: it warns on another kind before its first step)."""
    results = [trial_result(command, t, judged, mine, base) for t, judged, mine, base in ran]
    chosen = final_trial(results)
    change = next((t.arm.change for t, *_ in ran if chosen and t.name == chosen["name"]), Change())
    machine = Change(flags=("--tuned-on", tuned_on) if tuned_on and view.options_as == "flags" else ())
    return {
        "trials": results,
        "final_change": {k: v for k, v in vars(change).items() if v},
        "final_flags": list(change.flags),
        "final_config": None,
        "final_mixed_precision": change.mixed_precision,
        "final_command": command.text(change | machine),
        "summary": final_text(chosen),
    }


def trial_result(command: Command, trial: Trial, judged: dict, runs: dict[int, dict], baseline: dict[int, dict]):
    s = trial.suggestion
    return {
        "name": trial.name,
        "rule": s.rule if s else "together",
        "phase": trial.phase,
        "change": s.change if s else "the kept changes together",
        "flags": command.words(trial.arm.change),
        "own_flags": command.words(trial.own),
        "config": None,
        "gain": s.gain if s else None,
        "gain_kind": s.gain_kind if s else None,
        "gain_text": s.gain_text() if s else None,
        "changes_result": trial.own.does,
        "runs": [runs[i]["run"] for i in sorted(runs)],
        "baseline_runs": [baseline[i]["run"] for i in sorted(runs) if i in baseline],
        **trial_verdicts(judged),
    }


def not_tried_entry(suggestion, why: str) -> dict:
    words = [*suggestion.flags, *([f"config {suggestion.config}"] if suggestion.config else [])]
    return {"change": suggestion.change, "flags": words, "kind": suggestion.kind, "why": why}


def verdict_line(trial: dict) -> str:
    """'faster 1.590x (1.510-1.660) on the same work, 6 baseline / 6 trial runs, 1 look, p ...; result ...'."""
    speed = trial["speed"]
    if not speed.get("pairs"):
        return f"{trial['verdict']}; result {trial['result']}"
    return (
        f"{trial['verdict']} {speed['median_ratio']:.3f}x ({speed['min_ratio']:.3f}-{speed['max_ratio']:.3f}) on "
        f"the same work, {speed['n_baseline']} baseline / {speed['n_trial']} trial runs, {speed['looks']} look, "
        f"p {speed['p_raw']:.2g} raw, {speed['p_value']:.2g} {speed['correction']}; result {trial['result']}"
    )


def page(result: dict) -> list[str]:
    """comparison.md: the command, the probe, the design, each trial against its baseline, the command to use."""
    design, table = result["design"], equivalence_table(result)
    return markdown(
        [
            Heading("trainscope tune"),
            Paragraph(
                f"Command: `{result['command']}`; advice from `{result['advice_run']}`; budget "
                f"{result['budget_s']:.0f} s, used {result['elapsed_s']:.0f} s."
            ),
            Paragraph(result["determinism"]["text"] + "."),
            Paragraph(
                f"Design (fixed before measuring): {design['trials']} trial(s), {design['rounds']} alternating rounds "
                f"each, seeds {design['seed']}-{design['seed'] + design['rounds'] - 1}; test: {design['test']}; "
                f"boundary: {design['boundary']}; margins: accuracy +-{design['accuracy_margin']:g}, loss "
                f"+-{design['loss_margin']:g} (a training loss's log: relative)."
            ),
            Paragraph(result["method"]),
            tune_table(result),
            table if table.rows else None,
            Paragraph(result["summary"]),
            Paragraph(
                f"Command to use: `{result['final_command']}`"
                + (f" (tuned on {result['tuned_on']})" if result.get("tuned_on") else "")
            ),
            Bullets(
                [f"{t['name']} ({t['kind']}): {verdict_line(t)}; runs {', '.join(t['runs'])}" for t in result["trials"]]
                + [f"not tried: {n['change']} (`{' '.join(n['flags'])}`): {n['why']}" for n in result["not_tried"]]
            ),
        ]
    )


def parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="trainscope tune", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
        usage="trainscope tune [options] -- <your training command: accelerate launch ..., python ..., torchrun ...>",
    )  # fmt: skip
    add = parser.add_argument
    add("--runs", default="runs/tune", help="where the runs and comparison.{json,md} go (default runs/tune)")
    add("--budget", type=float, default=BUDGET_S, help=f"seconds for the whole tuning (default {BUDGET_S}); decides "
        "how many changes are tried, in runs as long as the command's second run")  # fmt: skip
    add("--rounds", type=int, default=ROUNDS, help=f"alternating rounds per trial, one seed each (default {ROUNDS}: 6 "
        "against 6 can pass Holm over up to 23 tests; 5 over up to 6; 4 over 1 only)")  # fmt: skip
    add("--seed", type=int, default=42, help="the first round's seed (round r: seed + r), set when each run opens")
    add("--confirm", metavar="COMPARISON_JSON", help="try only the change an earlier trainscope tune kept (its "
        "comparison.json), on this command: e.g. the whole job, against it as it is")  # fmt: skip
    add("--only", type=lambda text: set(text.split(",")), default=None,
        help="try only these of the advisor's rules, comma-separated (as the progress lines name them)")  # fmt: skip
    add("--max-suggestions", type=int, default=4, help="changes to try at most (default 4)")
    add("--accuracy-margin", type=float, default=ACCURACY_MARGIN, help="equivalence margin of validation and test "
        f"accuracy, stated before measuring (default {ACCURACY_MARGIN:g})")  # fmt: skip
    add("--loss-margin", type=float, default=LOSS_MARGIN, help=f"equivalence margin of losses (default {LOSS_MARGIN:g}"
        ": nats of an evaluation loss; of a training loss, its log's difference: about 2%% relative)")  # fmt: skip
    return parser


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    ours, command = launching.split_args(argv)
    if "--" not in argv and argv and not argv[0].startswith("-"):  # a command without its `--`
        parser().exit(2, "error: put `--` before your command: trainscope tune [options] -- <your command>\n")
    args = parser().parse_args(ours)
    if args.budget <= 0 or args.rounds < 1 or args.max_suggestions < 1:
        parser().error("--budget must be positive, --rounds and --max-suggestions at least 1")
    if not (0 < args.accuracy_margin < 1 and args.loss_margin > 0):
        parser().error("--accuracy-margin must be between 0 and 1 and --loss-margin positive")
    try:
        result = tune(args, Command.parse(command), log=lambda line: print(line, flush=True))
    except UserError as error:
        print(f"error: {error}", file=sys.stderr)
        sys.exit(1)
    except KeyboardInterrupt:  # the run in progress was stopped with it (trainscope.core.launching.run_captured)
        print(f"error: interrupted: no result written; the runs so far are in {args.runs}", file=sys.stderr)
        sys.exit(130)
    stem = Path(args.runs) / "comparison"
    bench.write_results(stem, result, page(result))
    for t in result["trials"]:
        print(f"{t['name']} ({t['rule']}): {verdict_line(t)}")
    print(f"{result['summary']}\ncommand to use: {result['final_command']}\ncomparison: {stem}.md")
