"""make tune's decision, pure: the design stated before anything is measured, the judgement of measured
rounds by it, the final choice and its words.

`judge(design, measured)` takes the design and the headline figures of every run by arm and round, and
nothing else: no clock, no launcher, no file. make tune (trainscope.tune) calls it on the runs it launched,
the report (trainscope.experiments.optimization) on the runs a committed make tune left, and the tests on
simulated runs thousands of times, so the error rates the README states are those of the code that decides.

The design (a fixed number of rounds: one look, no optional stopping):

* **rounds**: R alternating rounds per trial. Round r runs the baseline and the trial with seed S + r and the
  data seed held (`--data-seed`), so each round is one speed pair and one paired result; each trial is judged
  once, after its R rounds, against the baseline runs of *its own* rounds. A trial the budget cut short is
  not judged. With one look there is no alpha to spend over looks: the error rate is the test's own.
* **the family**: the k trials and, when k >= 2, the kept ones tried together (with their own R rounds and
  their own baseline runs): k + 1 tests, Holm-corrected together (Holm 1979). Before the kept trial has run
  its p-value counts as 1, so a trial kept then stays kept when the family is judged again with it.
* **speed**: the project's test (trainscope.bench: two-sided Mann-Whitney U, alpha 0.05, minimum effect 3%) on
  the same work: each run's evaluation as measured plus its training scaled to the baseline's real tokens.
  Beside it, not in the family, the training-only and evaluation-only ratios with their raw p-values.
* **same result**: Schuirmann's two one-sided tests (trainscope.bench.equivalence) of the paired differences
  (trial minus baseline, same seed) of validation and test accuracy and loss, against margins stated up front
  (default +-0.01 accuracy, +-0.02 loss). "same" needs every metric's 90% interval inside its margin (an
  intersection-union test: no correction is due, Berger & Hsu 1996); "changed" when any interval lies wholly
  outside; else "undecided", with the seeds that would decide it. A trial is kept only when faster *and* same.
"""

import math
import re
import statistics
from dataclasses import asdict, dataclass

from trainscope import bench, launching
from trainscope.record_view import RunView

ROUNDS = 6  # 6 against 6: smallest p 2/924 = 0.0022, below Holm's first threshold for up to 23 tests
ACCURACY_MARGIN = 0.01  # one point of accuracy
# Mean cross-entropy is -mean log p(true label): a shift of 0.02 nats scales the geometric-mean probability the
# model gives the right label by e^0.02, about 2% -- as small a change in what is learned as one point of accuracy
# at the 60-70% this task reaches.
LOSS_MARGIN = 0.02
METRICS = ("validation_accuracy", "test_accuracy", "validation_loss", "test_loss")


@dataclass(frozen=True)
class Design:
    """What make tune decides by, fixed before it measures (printed first, written into the result)."""

    rounds: int = ROUNDS              # alternating rounds per trial, one seed each; one look after the last
    trials: int = 1                   # suggestions tried (k); with k >= 2 the kept ones together are a test too
    accuracy_margin: float = ACCURACY_MARGIN
    loss_margin: float = LOSS_MARGIN
    seed: int = 42                    # round r runs seed + r (the kept ones' rounds: the same seeds again)
    data_seed: int = 42               # held in every run: the same data split and subsets
    alpha: float = bench.ALPHA
    min_effect: float = bench.MIN_EFFECT

    @property
    def tests(self) -> int:
        """The family Holm corrects over: the trials, and the kept ones together where there can be two kept."""
        return self.trials + (1 if self.trials > 1 else 0)

    @property
    def reachable(self) -> bool:
        """Whether R against R can pass Holm's first threshold, alpha / tests, at all."""
        return bench.smallest_p(self.rounds) < self.alpha / self.tests

    @property
    def boundary(self) -> str:
        return (f"fixed: one look after {self.rounds} rounds per trial (no interim looks, no alpha spent on them); "
                f"Holm over {self.tests} test(s): the smallest p must be below {self.alpha:g}/{self.tests} = "
                f"{self.alpha / self.tests:.4g}")

    def seed_of(self, round_index: int) -> int:
        return self.seed + round_index % self.rounds

    def flags(self, round_index: int) -> list[str]:
        """The train.py flags of round `round_index`: its seed, the data seed held."""
        return ["--seed", str(self.seed_of(round_index)), "--data-seed", str(self.data_seed)]

    def margin(self, metric: str) -> float:
        return self.accuracy_margin if metric.endswith("accuracy") else self.loss_margin

    def to_dict(self) -> dict:
        return {**asdict(self), "tests": self.tests, "boundary": self.boundary, "test": bench.METHOD,
                "equivalence": equivalence_method(self), "min_rounds": bench.min_rounds(self.alpha / self.tests)}

    @classmethod
    def from_dict(cls, values: dict) -> "Design":
        return cls(**{k: values[k] for k in cls.__dataclass_fields__ if k in values})

    def lines(self) -> list[str]:
        """The design as make tune prints it before measuring."""
        out = [f"design: {self.trials} trial(s), {self.rounds} alternating rounds each (seeds {self.seed}-"
               f"{self.seed + self.rounds - 1}, data seed {self.data_seed}); speed: {bench.METHOD} on the same work, "
               f"against the baseline runs of the trial's own rounds; boundary: {self.boundary}",
               f"same result: {equivalence_method(self)}"]
        if not self.reachable:
            out.append(f"note: {self.rounds} against {self.rounds} rounds give p >= {bench.smallest_p(self.rounds):.4g}, "
                       f"which cannot pass {self.alpha:g}/{self.tests}: no speed verdict is possible (at least "
                       f"{bench.min_rounds(self.alpha / self.tests)} rounds are)")
        return out


def equivalence_method(design: Design) -> str:
    return (f"two one-sided tests (alpha {bench.EQUIVALENCE_ALPHA:g} each: the 90% t interval of the paired "
            f"differences, trial minus baseline on the same seed) inside +-{design.accuracy_margin:g} for validation "
            f"and test accuracy and +-{design.loss_margin:g} for their losses; wholly outside: changed; else undecided")


def work_seconds(run: dict, reference_tokens: float) -> float:
    """A run's timed wall time for the same work as the baseline: evaluation as measured, training scaled to
    the baseline's real tokens (the identity when a change leaves what a step holds alone)."""
    return run["eval_s"] + training_seconds(run, reference_tokens)


def training_seconds(run: dict, reference_tokens: float) -> float:
    return run["train_wall_s"] * reference_tokens / run["train_tokens"]


def ratio(baseline: list[float], candidate: list[float]) -> dict:
    """Seconds of two arms over the same rounds: the per-round speed ratios (baseline over candidate) with their
    range and the raw Mann-Whitney p (descriptive: not in the family)."""
    compared = bench.compare_samples(baseline, candidate, higher_is_better=False, min_pairs=bench.MIN_DECIDABLE)
    return {k: compared[k] for k in ("pairs", "median_ratio", "min_ratio", "max_ratio", "p_value")}


# ---------------------------------------------------------------- the judgement


def judge(design: Design, measured: dict[str, dict[int, dict]]) -> dict[str, dict]:
    """Every trial of `measured` judged by `design`: {trial: judgement}.

    `measured` maps "baseline" and each trial to {round index: headline figures of that run}
    (trainscope.record_view.RunView.headline). A trial is compared with the baseline runs of the rounds it ran
    in, and judged only when it has all `design.rounds` of them; the family's p-values are Holm-corrected with
    the tests not (yet) run counted as 1.
    """
    return in_family(design, {name: measure(design, measured["baseline"], runs)
                              for name, runs in measured.items() if name != "baseline"})


def in_family(design: Design, measures: dict[str, dict]) -> dict[str, dict]:
    """The trials' measures (`measure`) judged together: Holm over the design's tests, the tests not run counted
    as p = 1; a trial without all its rounds is not judged. {trial: judgement}."""
    trials = list(measures)
    if len(trials) > design.tests:
        raise ValueError(f"{len(trials)} trials measured, the design has {design.tests} test(s)")
    judged = {name: {**entry, "speed": dict(entry["speed"])} for name, entry in measures.items()}
    family = [judged[n]["speed"]["p_raw"] if judged[n]["complete"] else 1.0 for n in trials]
    adjusted = bench.holm(family + [1.0] * (design.tests - len(trials)))
    for name, p in zip(trials, adjusted):
        entry = judged[name]
        speed = entry["speed"]
        speed.update(p_value=p, correction=f"Holm over {design.tests} test(s)", looks=1, boundary=design.boundary)
        if not entry["complete"]:
            speed["verdict"] = (f"not judged: {speed['pairs']} of {design.rounds} rounds (the budget ended)"
                                if speed["pairs"] else "not run (the budget ended)")
        else:
            speed["verdict"] = bench.verdict(speed["median_ratio"], p, speed["pairs"], bench.MIN_DECIDABLE,
                                             design.alpha, design.min_effect)
        entry["verdict"] = speed["verdict"]
        entry["keep"] = entry["verdict"] == "faster" and entry["same_result"] is True
    return judged


def measure(design: Design, baseline: dict[int, dict], trial: dict[int, dict]) -> dict:
    """One trial against the baseline runs of its own rounds, before the family: speed on the same work (raw p),
    the training-only and evaluation-only ratios, the result's equivalence."""
    rounds = sorted(r for r in trial if r in baseline)
    base, mine = [baseline[r] for r in rounds], [trial[r] for r in rounds]
    entry = {"rounds": rounds, "complete": len(rounds) >= design.rounds,
             "equivalence": equivalent(design, base, mine)}
    entry["same_result"] = {"same": True, "changed": False}.get(entry["equivalence"]["verdict"])
    entry["result"] = entry["equivalence"]["text"]
    if not rounds:
        entry["speed"] = {"pairs": 0, "n_baseline": 0, "n_trial": 0, "p_raw": 1.0, "test": bench.METHOD}
        entry["training"] = entry["evaluation"] = None
        return entry
    reference = statistics.median(r["train_tokens"] for r in base)
    speed = bench.compare_samples([work_seconds(r, reference) for r in base], [work_seconds(r, reference) for r in mine],
                                  higher_is_better=False, min_pairs=bench.MIN_DECIDABLE)
    speed.update(p_raw=speed["p_value"], n_baseline=len(base), n_trial=len(mine), rounds=rounds)
    entry["speed"] = speed
    entry["training"] = ratio([training_seconds(r, reference) for r in base], [training_seconds(r, reference) for r in mine])
    entry["evaluation"] = ratio([r["eval_s"] for r in base], [r["eval_s"] for r in mine])
    entry["tokens_per_run"] = statistics.median(r["train_tokens"] for r in mine)
    return entry


def equivalent(design: Design, baseline: list[dict], trial: list[dict]) -> dict:
    """The paired differences (trial minus baseline, same round and seed) of every result metric against its
    margin (trainscope.bench.equivalence). Runs that repeat a seed are averaged per seed first: the seed is the
    unit, so repeats of one seed are one pair. The verdict: "changed" if any metric is, "same" if all are, else
    "undecided"."""
    paired = [(b, t) for b, t in zip(baseline, trial) if b.get("seed") is not None and b.get("seed") == t.get("seed")]
    seeds = sorted({b["seed"] for b, _ in paired})
    metrics = {}
    for metric in METRICS:
        by_seed = {}
        for b, t in paired:
            if b.get(metric) is not None and t.get(metric) is not None:
                by_seed.setdefault(b["seed"], []).append(t[metric] - b[metric])
        if by_seed:
            metrics[metric] = bench.equivalence([statistics.fmean(d) for d in by_seed.values()], design.margin(metric))
    verdicts = [m["verdict"] for m in metrics.values()]
    verdict = ("changed" if "changed" in verdicts else "same" if verdicts and all(v == "same" for v in verdicts)
               else "undecided")
    result = {"verdict": verdict, "seeds": seeds, "pairs": len(paired), "unpaired": len(baseline) - len(paired),
              "metrics": metrics, "margins": {"accuracy": design.accuracy_margin, "loss": design.loss_margin}}
    result["text"] = equivalence_text(result, trial)
    return result


def _signed(value: float) -> str:
    return f"{value:+.4f}"


def metric_text(metric: str, entry: dict) -> str:
    """'validation accuracy +0.0017, 90% [-0.0090, +0.0123] against +-0.01'."""
    name = metric.replace("_", " ")
    if entry["interval"] is None:
        return f"{name} {_signed(entry['mean'])} from one seed (no interval)" if entry["mean"] is not None else name
    low, high = entry["interval"]
    return f"{name} {_signed(entry['mean'])}, 90% [{_signed(low)}, {_signed(high)}] against +-{entry['margin']:g}"


def equivalence_text(result: dict, trial_runs: list[dict]) -> str:
    """The verdict with the metric that decided it, and for "undecided" what would decide it."""
    metrics, verdict, n = result["metrics"], result["verdict"], len(result["seeds"])
    if not metrics:
        return "undecided: no result metric measured on paired seeds"
    if verdict == "same":
        widest = max(metrics, key=lambda m: max(abs(v) for v in metrics[m]["interval"]) / metrics[m]["margin"])
        return f"same over {n} seeds: every 90% interval inside its margin (widest: {metric_text(widest, metrics[widest])})"
    if verdict == "changed":
        name = next(m for m in metrics if metrics[m]["verdict"] == "changed")
        return f"changed over {n} seeds: {metric_text(name, metrics[name])}" + _steps_text(trial_runs, changed=True)
    open_ = [m for m in metrics if metrics[m]["verdict"] == "undecided"]
    if n < 2:  # no interval: show the metric furthest from zero for its margin
        name = max(open_, key=lambda m: abs(metrics[m]["mean"]) / metrics[m]["margin"])
        return (f"undecided: one seed ({metric_text(name, metrics[name])}), no spread to test; make tune runs seed "
                f"S + r in round r" + _steps_text(trial_runs))
    name = max(open_, key=lambda m: math.inf if metrics[m]["needed"] is None else metrics[m]["needed"])
    entry = metrics[name]
    if entry["needed"] is None:
        why = "more seeds would not show it at the observed difference"
    else:
        why = (f"about {entry['needed']} seeds ({max(0, entry['needed'] - n)} more; --rounds {entry['needed']}) "
               f"would show it at this SD with 80% power")
    return f"undecided over {n} seeds: {metric_text(name, entry)}; {why}" + _steps_text(trial_runs)


def _steps_text(trial_runs: list[dict], changed: bool = False) -> str:
    """For runs that stop inside their first epoch: how many more steps make one (the arms of a change to the
    order train on different samples until then, so a change shown on them may not hold for the whole job)."""
    done, epoch = next(((r.get("optimizer_steps"), r.get("steps_per_epoch")) for r in trial_runs), (None, None))
    if not (done and epoch and done < epoch):
        return ""
    if changed:
        return (f" -- on runs of {done} of an epoch's {epoch} steps, where a change to the order trains on other "
                "samples; make tune-confirm judges the full job")
    return (f"; or train longer: these runs stop after {done} of an epoch's {epoch} steps ({epoch - done} more for "
            "one epoch; make tune-confirm judges the full job)")


# ---------------------------------------------------------------- the choice and its words


def final_trial(trials: list[dict]) -> dict | None:
    """What `make tune` keeps: the kept changes tried together where that trial is itself kept, else the
    fastest trial that was faster with the same result (None: the baseline stands)."""
    kept = [t for t in trials if t["verdict"] == "faster" and t["same_result"] is True]
    if trials and trials[-1]["name"] == "kept" and trials[-1] in kept:
        return trials[-1]
    return max(kept, key=lambda t: t["speed"]["median_ratio"], default=None)


NONE_KEPT = "No suggestion was faster on the same work with a result shown the same: the baseline stands"


def final_text(final: dict | None) -> str:
    if final is None:
        return f"{NONE_KEPT}; the trials above are the evidence."
    return (f"Best: {final['name']} ({change_of(final)}), {bench.describe(final['speed'])} on the same work, "
            f"{final['speed']['n_baseline']} baseline / {final['speed']['n_trial']} trial runs; result {final['result']}.")


def change_of(trial: dict) -> str:
    """A trial's change as a user types it: the config it launches with, then its flags."""
    parts = ([f"config {trial['config']}"] if trial.get("config") else []) + ([" ".join(trial["flags"])] if trial["flags"] else [])
    return ", ".join(parts)


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


def final_choice(trials: list[dict], baseline_args: list[str], baseline_config: str | None) -> dict:
    """The kept trial, its flags and config, the command to use and the sentence that says so."""
    final = final_trial(trials)
    config = final["config"] if final else baseline_config
    command = (f"accelerate launch {launching.config_argument(config) + ' ' if config else ''}train.py "
               + " ".join(merge_flags(baseline_args, final["flags"] if final else [])))
    return {"final_flags": final["flags"] if final else [], "final_config": config, "final_command": command,
            "summary": final_text(final)}


def method_text(design: Design, rounds: str | None = None, boundary: str | None = None) -> str:
    return (f"Speed on the same work (training scaled to the baseline's real tokens, evaluation as measured); test: "
            f"{bench.METHOD}; each trial against the baseline runs of its own {rounds or f'{design.rounds} rounds'}; "
            f"boundary: {boundary or design.boundary}. Same result: {equivalence_method(design)}. Kept: faster and same.")


# ---------------------------------------------------------------- a committed make tune, judged again


HISTORY = ("Measured by an earlier make tune, judged again here from its runs' records by today's rules: its rounds "
           "were added while a trial was undecided (looks at 3 to 6 rounds) and its trials ran on the baseline's seed "
           "only, so these error rates are not those of today's fixed design, and no result can be shown the same "
           "from one seed. Re-run `make tune`.")


def rejudged(comparison: dict, records: dict) -> dict:
    """A make tune comparison with every trial judged again by `judge` from its runs' records (when they are all
    there), its final choice made again: a committed result made under an older rule reads by today's. A result
    without a design (an older make tune) gets the design its runs allow and says so (`history`)."""
    trials = comparison.get("trials") if isinstance(comparison, dict) else None
    if not trials:
        return comparison
    measured = {"baseline": {}}
    for trial in trials:
        mine = measured.setdefault(trial["name"], {})
        for run in trial.get("runs", []):
            found = re.fullmatch(r"(.+)-r(\d+)", run)
            base = f"baseline-r{found.group(2)}" if found else None
            if not found or run not in records or base not in records:
                return comparison
            index = int(found.group(2))
            mine[index] = RunView(records[run]).headline()
            measured["baseline"][index] = RunView(records[base]).headline()
    rounds = None
    if "design" in comparison:
        design = Design.from_dict(comparison["design"])
    else:  # judged at the rounds each trial took: the design's R is the fewest, so every trial is judged
        first = measured["baseline"][min(measured["baseline"])]
        design = Design(rounds=min(len(t.get("runs", [])) for t in trials) or 1,
                        trials=sum(t["name"] != "kept" for t in trials), seed=first["seed"] or 42,
                        data_seed=first.get("data_seed") or first["seed"] or 42)
        rounds = "rounds (" + ", ".join(f"{t['name']} {len(t.get('runs', []))}" for t in trials) + ")"
        boundary = (f"none held: looks after 3 to 6 rounds when measured, judged here once at the rounds each took; "
                    f"Holm over {design.tests} test(s)")
        comparison = {**comparison, "design": {**design.to_dict(), "boundary": boundary}, "history": HISTORY}
    judged = judge(design, measured)
    for entry in judged.values():
        entry["speed"]["boundary"] = comparison["design"]["boundary"]
    comparison = {**comparison, "trials": [{**t, **trial_verdicts(judged[t["name"]])} for t in trials],
                  "method": method_text(design, rounds, comparison["design"]["boundary"])}
    comparison.update(final_choice(comparison["trials"], comparison.get("baseline_args", []),
                                   comparison.get("baseline_config")))
    return comparison


def trial_verdicts(judgement: dict) -> dict:
    """What a trial's entry in the result takes from its judgement."""
    return {"speed": judgement["speed"], "training": judgement["training"], "evaluation": judgement["evaluation"],
            "verdict": judgement["verdict"], "equivalence": judgement["equivalence"],
            "same_result": judgement["same_result"], "result": judgement["result"], "rounds": judgement["rounds"],
            "pairs": judgement["speed"]["pairs"]}
