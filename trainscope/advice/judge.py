"""make tune's decision, pure: the judgement of measured rounds by the design stated before anything is measured.

How it works: docs/tune.md#in-the-code-how-make-tune-decides-trainscopeadvicejudgepy.
"""

import math
import shlex
import statistics

from trainscope.advice import changes
from trainscope.advice.design import Design
from trainscope.core import launching
from trainscope.core.record_view import RunView
from trainscope.measure import bench

# The result's metrics; a loop without evaluation scores has its training loss's log (trainscope tune's figures).
METRICS = ("validation_accuracy", "test_accuracy", "validation_loss", "test_loss", "log_train_loss")


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


def judge(
    design: Design,
    measured: dict[str, dict[int, dict]],
    kinds: dict[str, str] | None = None,
    against: dict[str, str] | None = None,
) -> dict[str, dict]:
    """Every trial of `measured` judged by `design`: {trial: judgement}.

    `measured` maps each arm (the baselines and the trials) to {round index: its run's figures}
    (`run_figures`); `kinds` gives each trial's kind (trainscope.advice.changes; default numeric) and `against` its
    baseline arm (default "baseline"). A trial is compared with the baseline runs of the rounds it ran in, and
    judged only when it has all `design.rounds` of them; the family's p-values are Holm-corrected with the tests
    not (yet) run counted as 1.
    """
    kinds, against = kinds or {}, against or {}
    baselines = {"baseline", *against.values()}
    return in_family(
        design,
        {
            name: measure(design, measured[against.get(name, "baseline")], runs, kinds.get(name, changes.NUMERIC))
            for name, runs in measured.items()
            if name not in baselines
        },
    )


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
            speed["verdict"] = (
                f"not judged: {speed['pairs']} of {design.rounds} rounds (the budget ended)"
                if speed["pairs"]
                else "not run (the budget ended)"
            )
        else:
            speed["verdict"] = bench.verdict(
                speed["median_ratio"], p, speed["pairs"], bench.MIN_DECIDABLE, design.alpha, design.min_effect
            )
        entry["verdict"] = speed["verdict"]
        entry["keep"] = entry["verdict"] == "faster" and entry["same_result"] is True
    return judged


def judged_in_phases(design: Design, measures: dict[str, dict], exact: set[str]) -> dict[str, dict]:
    """The family judged as make tune judges it: the exact trials first, on their own (the others counted as p = 1),
    and those verdicts kept -- the stack was built on them; then every other trial with the whole family."""
    first = in_family(design, {n: m for n, m in measures.items() if n in exact}) if exact else {}
    return {**in_family(design, measures), **first}


def measure(
    design: Design,
    baseline: dict[int, dict],
    trial: dict[int, dict],
    kind: str = changes.NUMERIC,
    fp32_pair: tuple[list[dict], list[dict]] | None = None,
) -> dict:
    """One trial against the baseline runs of its own rounds, before the family: speed on the same work (raw p),
    the training-only and evaluation-only ratios, and the result as its kind is judged (`exactness` for an exact
    change -- on its fp32 pair, (baseline runs, trial runs), where the rounds ran at another precision --,
    `equivalent` for a numeric one and for a training one on the full job; a training one on a proxy is not
    decided, `training_text` says what would decide it)."""
    rounds = sorted(r for r in trial if r in baseline)
    base, mine = [baseline[r] for r in rounds], [trial[r] for r in rounds]
    entry = {
        "kind": kind,
        "rounds": rounds,
        "complete": len(rounds) >= design.rounds,
        "equivalence": equivalent(design, base, mine),
    }
    if kind == changes.EXACT:
        pair = (fp32_pair or ([], [])) if design.exact_check else (base, mine)
        entry["exactness"] = exactness(design, *pair)
        entry["same_result"] = {"exact": True, "not exact": False}.get(entry["exactness"]["verdict"])
        entry["result"] = entry["exactness"]["text"]
    elif kind == changes.TRAINING and not all(full_job(r) for r in mine):
        entry["same_result"] = None
        entry["result"] = training_text(entry["equivalence"], base, mine)
    else:
        entry["same_result"] = {"same": True, "changed": False}.get(entry["equivalence"]["verdict"])
        entry["result"] = entry["equivalence"]["text"]
    if not rounds:
        entry["speed"] = {"pairs": 0, "n_baseline": 0, "n_trial": 0, "p_raw": 1.0, "test": bench.METHOD}
        entry["training"] = entry["evaluation"] = None
        return entry
    reference = statistics.median(r["train_tokens"] for r in base)
    speed = bench.compare_samples(
        [work_seconds(r, reference) for r in base],
        [work_seconds(r, reference) for r in mine],
        higher_is_better=False,
        min_pairs=bench.MIN_DECIDABLE,
    )
    speed.update(p_raw=speed["p_value"], n_baseline=len(base), n_trial=len(mine), rounds=rounds)
    entry["speed"] = speed
    entry["training"] = ratio(
        [training_seconds(r, reference) for r in base], [training_seconds(r, reference) for r in mine]
    )
    evaluated = all(r["eval_s"] > 0 for r in base + mine)  # a loop that does not evaluate has no ratio
    entry["evaluation"] = ratio([r["eval_s"] for r in base], [r["eval_s"] for r in mine]) if evaluated else None
    entry["tokens_per_run"] = statistics.median(r["train_tokens"] for r in mine)
    return entry


def run_figures(record: dict, steps: list[dict] | None = None) -> dict:
    """What make tune judges a run by: its record's headline figures (trainscope.core.record_view.RunView.headline),
    its epochs, and the loss of each logged step (the mean over the steps since the line before, so every step's
    loss is in one) from its step lines."""
    view = RunView(record)
    return {
        **view.headline(),
        "epochs": view.setting("epochs"),
        "step_losses": [[line["step"], line["loss"]] for line in steps or [] if line.get("loss") is not None],
    }


def full_job(run: dict) -> bool:
    """Whether a run trained its whole job: every step of its epochs (not a --max-steps proxy)."""
    steps, epoch = run.get("optimizer_steps"), run.get("steps_per_epoch")
    return bool(steps and epoch and steps >= epoch * (run.get("epochs") or 1))


def _pairs(baseline: list[dict], trial: list[dict]) -> list[tuple[dict, dict]]:
    return [(b, t) for b, t in zip(baseline, trial) if b.get("seed") is not None and b.get("seed") == t.get("seed")]


def exactness(design: Design, baseline: list[dict], trial: list[dict]) -> dict:
    """An exact change's paired runs (same round and seed) compared number by number: each logged step's loss and
    the final losses relative to the baseline's, the accuracies as they are, against the design's tolerance
    (trainscope.advice.changes.exact_difference; the runs are fp32 ones). "exact" when every pair agrees throughout, "not
    exact" at the first number beyond it (or steps logged in one run and not the other), "undecided" without a pair
    whose step losses both runs logged."""
    tolerance, counted, worst, found = design.tolerance, {"losses": 0, "metrics": 0}, None, None
    paired = [(b, t) for b, t in _pairs(baseline, trial) if b.get("step_losses") and t.get("step_losses")]
    for b, t in paired:
        mine, theirs = dict(map(tuple, t["step_losses"])), dict(map(tuple, b["step_losses"]))
        if set(mine) != set(theirs):
            found = found or {
                "seed": b["seed"],
                "what": "logged steps",
                "baseline": sorted(theirs),
                "trial": sorted(mine),
                "difference": math.inf,
            }
            continue
        numbers = [(f"step {step} loss", theirs[step], mine[step], True, "losses") for step in sorted(theirs)]
        numbers += [
            (metric.replace("_", " "), b[metric], t[metric], metric.endswith("loss"), "metrics")
            for metric in METRICS
            if b.get(metric) is not None and t.get(metric) is not None
        ]
        for what, ours, yours, relative, kind in numbers:
            difference = changes.exact_difference(ours, yours, relative)
            counted[kind] += 1
            entry = {
                "seed": b["seed"],
                "what": what,
                "baseline": ours,
                "trial": yours,
                "difference": difference,
                "relative": relative,
            }
            if worst is None or difference > worst["difference"]:
                worst = entry
            if difference > tolerance and found is None:
                found = entry
    verdict = "not exact" if found else "exact" if paired else "undecided"
    result = {
        "verdict": verdict,
        "pairs": len(paired),
        "numbers": counted["losses"] + counted["metrics"],
        "logged_losses": counted["losses"],
        "final_metrics": counted["metrics"],
        "tolerance": tolerance,
        "precision": changes.EXACT_PRECISION,
        "rounds_precision": design.precision,
        "largest": worst,
        "first_beyond": found,
        "pair_runs": [[b.get("run"), t.get("run")] for b, t in paired],
    }
    result["text"] = exactness_text(result)
    return result


def exactness_text(result: dict) -> str:
    """'exact over 6 pairs: ...' / 'not exact: ...' / 'undecided: ...'."""
    tolerance = f"{result.get('precision', 'fp32')}'s exactness tolerance {result['tolerance']:.2g}"
    if result["verdict"] == "undecided":
        return "undecided: no pair of runs with their step losses logged to compare"
    if result["verdict"] == "exact":
        worst = result["largest"]
        largest = (
            "all identical"
            if not worst or worst["difference"] == 0
            else f"largest difference {worst['difference']:.2g} ({worst['what']}, seed {worst['seed']})"
        )
        counted = (
            f"{result['logged_losses']} logged losses (each the mean of the steps since the line before) and "
            f"{result['final_metrics']} final metrics"
            if "logged_losses" in result
            else f"{result['numbers']} logged losses and final metrics"
        )
        pairs = f"{result['pairs']} fp32 pair(s)" if result.get("rounds_precision", "fp32") != "fp32" else None
        return f"exact over {pairs or str(result['pairs']) + ' pair(s)'}: {counted} each within {tolerance}, {largest}"
    found = result["first_beyond"]
    if found["what"] == "logged steps":
        said = f"seed {found['seed']} logged steps {found['trial']} against the baseline's {found['baseline']}"
    else:
        said = (
            f"seed {found['seed']}, {found['what']} {found['trial']:.6g} against the baseline's "
            f"{found['baseline']:.6g} ({'relative ' if found['relative'] else ''}difference "
            f"{found['difference']:.2g}, beyond {tolerance})"
        )
    return f"not exact: {said}: the change alters the computation -- a defect to report, never kept"


def equivalent(design: Design, baseline: list[dict], trial: list[dict]) -> dict:
    """The paired differences (trial minus baseline, same round and seed) of every result metric against its
    margin (trainscope.measure.bench.equivalence). Runs that repeat a seed are averaged per seed first: the seed is the
    unit, so repeats of one seed are one pair. The verdict: "same" if every metric is (intersection-union: no
    correction); "changed" if a metric's one-sided test beyond its margin passes Holm over the metrics; else
    "undecided"."""
    paired = _pairs(baseline, trial)
    seeds = sorted({b["seed"] for b, _ in paired})
    metrics = {}
    for metric in METRICS:
        by_seed = {}
        for b, t in paired:
            if b.get(metric) is not None and t.get(metric) is not None:
                by_seed.setdefault(b["seed"], []).append(t[metric] - b[metric])
        if by_seed:
            metrics[metric] = bench.equivalence([statistics.fmean(d) for d in by_seed.values()], design.margin(metric))
    for entry, p in zip(metrics.values(), bench.holm([m["p_changed"] for m in metrics.values()])):
        entry["p_changed_holm"] = p
        if entry["verdict"] == "changed" and p >= design.alpha:  # beyond its margin alone, not over the metrics
            mean, sd, margin = entry["mean"], entry["sd"], entry["margin"]
            entry.update(verdict="undecided", shows="changed", needed=bench.pairs_to_show(mean, sd, margin))
    verdicts = [m["verdict"] for m in metrics.values()]
    verdict = (
        "changed"
        if "changed" in verdicts
        else "same"
        if verdicts and all(v == "same" for v in verdicts)
        else "undecided"
    )
    result = {
        "verdict": verdict,
        "seeds": seeds,
        "pairs": len(paired),
        "unpaired": len(baseline) - len(paired),
        "metrics": metrics,
        "margins": {"accuracy": design.accuracy_margin, "loss": design.loss_margin},
        "correction": f"changed: Holm over {len(metrics)} metric(s)",
    }
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


def power_of_same(metrics: dict, n: int) -> float | None:
    """How often n seeds call a change that alters nothing "same", at the measured SDs taken as true: at most the
    least of the metrics' own chances (trainscope.measure.bench.equivalence_chances at a true difference of 0)."""
    chances = [bench.equivalence_chances(n, 0.0, m["sd"], m["margin"])[0] for m in metrics.values() if m.get("sd")]
    return min(chances) if chances else None


def equivalence_text(result: dict, trial_runs: list[dict]) -> str:
    """The verdict with the metric that decided it, and for "undecided" what would decide it and the power the
    seeds run had."""
    metrics, verdict, n = result["metrics"], result["verdict"], len(result["seeds"])
    if not metrics:
        return "undecided: no result metric measured on paired seeds"
    if verdict == "same":
        widest = max(metrics, key=lambda m: max(abs(v) for v in metrics[m]["interval"]) / metrics[m]["margin"])
        return f"same over {n} seeds: every 90% interval inside its margin (widest: {metric_text(widest, metrics[widest])})"
    if verdict == "changed":
        name = min(
            (m for m in metrics if metrics[m]["verdict"] == "changed"), key=lambda m: metrics[m]["p_changed_holm"]
        )
        entry = metrics[name]
        return (
            f"changed over {n} seeds: {metric_text(name, entry)} (one-sided p {entry['p_changed']:.2g}, "
            f"{entry['p_changed_holm']:.2g} Holm over {len(metrics)} metrics)" + _steps_text(trial_runs, changed=True)
        )
    open_ = [m for m in metrics if metrics[m]["verdict"] == "undecided"]
    if n < 2:  # no interval: show the metric furthest from zero for its margin
        name = max(open_, key=lambda m: abs(metrics[m]["mean"]) / metrics[m]["margin"])
        return (
            f"undecided: one seed ({metric_text(name, metrics[name])}), no spread to test; make tune runs seed "
            f"S + r in round r" + _steps_text(trial_runs)
        )
    beyond = [m for m in open_ if abs(metrics[m]["mean"]) >= metrics[m]["margin"]]
    if beyond:  # the difference itself is at or past the margin: seeds can only show it changed
        name = max(beyond, key=lambda m: abs(metrics[m]["mean"]) / metrics[m]["margin"])
        entry = metrics[name]
        why = "more seeds would show it changed" + (
            f" (about {entry['needed']} at this difference and SD with 80% power, Holm aside; --rounds "
            f"{entry['needed']})"
            if entry["shows"] == "changed" and entry["needed"]
            else ""
        )
    else:
        name = max(open_, key=lambda m: math.inf if metrics[m]["needed"] is None else metrics[m]["needed"])
        entry = metrics[name]
        why = (
            f"about {entry['needed']} seeds ({max(0, entry['needed'] - n)} more; --rounds {entry['needed']}) would "
            f"show it same at this difference and SD with 80% power"
            if entry["needed"] is not None
            else "more than 1000 seeds would be needed to show it same at this difference and SD"
        )
    power = power_of_same(metrics, n)
    said = (
        f"; at these SDs {n} seeds call a change that alters nothing 'same' at most {power:.1%} of the time"
        if power is not None
        else ""
    )
    return f"undecided over {n} seeds: {metric_text(name, entry)}; {why}{said}" + _steps_text(trial_runs)


def full_job_seconds(run: dict) -> float:
    """A proxy run's estimate of its full job on this machine: its start-up as measured, its training at its step
    time for every step of its epochs, its evaluation as measured once per epoch."""
    steps, epoch, epochs = run.get("optimizer_steps"), run.get("steps_per_epoch"), run.get("epochs") or 1
    if not (steps and epoch and run.get("train_wall_s") is not None):
        return run["wall_s"]
    start = max(0.0, run["wall_s"] - run["train_wall_s"] - run["eval_s"])
    return start + run["train_wall_s"] * epoch * epochs / steps + run["eval_s"] * epochs


def _duration(seconds: float) -> str:
    return f"{seconds / 3600:.1f} h" if seconds >= 5400 else f"{seconds / 60:.0f} min"


def training_text(equivalence: dict, baseline: list[dict], trial: list[dict]) -> str:
    """A training change on a proxy: not decided here. The seeds the full job needs to show a change that alters
    nothing "same" with 80% power, at the seed noise measured here (the paired differences' SD of the metric that
    needs the most; the baseline's own SD across seeds beside it), and how long that takes on this machine."""
    done, epoch = next(((r.get("optimizer_steps"), r.get("steps_per_epoch")) for r in trial), (None, None))
    where = f"these runs stop after {done} of an epoch's {epoch} steps" if done and epoch else "these runs are a proxy"
    head = f"not decided here: a training change is 'same' only from the full job ({where})"
    metrics = {m: e for m, e in equivalence["metrics"].items() if e.get("sd")}
    if not metrics:
        return f"{head}; no seed noise measured (fewer than 2 paired seeds)"
    needed = {m: bench.pairs_to_show(0.0, e["sd"], e["margin"]) for m, e in metrics.items()}
    name = max(needed, key=lambda m: math.inf if needed[m] is None else needed[m])
    entry, seeds = metrics[name], needed[name]
    spread = [b[name] for b in baseline if b.get(name) is not None]
    noise = f"{name.replace('_', ' ')}: paired differences SD {entry['sd']:.4f} over {entry['n']} seeds" + (
        f", the baseline's SD across seeds {statistics.stdev(spread):.4f}" if len(spread) > 1 else ""
    )
    if seeds is None:
        return f"{head}; at the seed noise measured here ({noise}) more than 1000 seeds would be needed"
    pair_s = statistics.median(full_job_seconds(b) for b in baseline) + statistics.median(
        full_job_seconds(t) for t in trial
    )
    return (
        f"{head}; at the seed noise measured here ({noise}) the full job needs about {seeds} seeds for 80% power "
        f"to call a change that alters nothing 'same' within +-{entry['margin']:g} (make tune-confirm --rounds "
        f"{seeds}: about {_duration(seeds * pair_s)} on this machine, {pair_s:.0f} s a pair estimated from these "
        f"runs' step and evaluation times); on these runs: {equivalence['verdict']}"
    )


def _steps_text(trial_runs: list[dict], changed: bool = False) -> str:
    """For runs that stop inside their first epoch: how many more steps make one (the arms of a change to the
    order train on different samples until then, so a change shown on them may not hold for the whole job)."""
    done, epoch = next(((r.get("optimizer_steps"), r.get("steps_per_epoch")) for r in trial_runs), (None, None))
    if not (done and epoch and done < epoch):
        return ""
    if changed:
        return (
            f" -- on runs of {done} of an epoch's {epoch} steps, where a change to the order trains on other "
            "samples; make tune-confirm judges the full job"
        )
    return (
        f"; or train longer: these runs stop after {done} of an epoch's {epoch} steps ({epoch - done} more for "
        "one epoch; make tune-confirm judges the full job)"
    )


# ---------------------------------------------------------------- the choice and its words


TOGETHER = {changes.EXACT: "exact", "other": "kept"}  # the kept ones of a phase tried together


def final_trial(trials: list[dict]) -> dict | None:
    """What `make tune` keeps: of the last phase that kept something (the others run on top of the exact stack, so
    their flags hold it), the kept ones tried together where that trial is itself kept, else the fastest trial
    that was faster with the same result (exact); None: the baseline stands."""
    kept = [t for t in trials if t["verdict"] == "faster" and t["same_result"] is True]
    for phase in ("other", changes.EXACT):
        mine = [t for t in kept if t.get("phase", "other") == phase]
        together = next((t for t in mine if t["name"] == TOGETHER[phase]), None)
        if together or mine:
            return together or max(mine, key=lambda t: t["speed"]["median_ratio"])
    return None


NONE_KEPT = "No suggestion was faster on the same work with a result shown the same: the baseline stands"


def final_text(final: dict | None) -> str:
    if final is None:
        return f"{NONE_KEPT}; the trials above are the evidence."
    return (
        f"Best: {final['name']} ({change_of(final)}), {bench.describe(final['speed'])} on the same work, "
        f"{final['speed']['n_baseline']} baseline / {final['speed']['n_trial']} trial runs; result {final['result']}."
    )


def change_of(trial: dict) -> str:
    """A trial's change as a user types it: the config it launches with, then its flags."""
    parts = ([f"config {trial['config']}"] if trial.get("config") else []) + (
        [" ".join(trial["flags"])] if trial["flags"] else []
    )
    return ", ".join(parts)


def merge_flags(base: list[str], extra: list[str]) -> list[str]:
    """`base` with `extra` applied: a flag given in `extra` replaces its earlier value in `base`."""

    def pairs(flags):
        out, i = [], 0
        while i < len(flags):
            takes_value = i + 1 < len(flags) and not flags[i + 1].startswith("--")
            out.append(flags[i : i + 2] if takes_value else flags[i : i + 1])
            i += 2 if takes_value else 1
        return out

    overridden = {pair[0] for pair in pairs(extra)}
    return [f for pair in pairs(base) if pair[0] not in overridden for f in pair] + list(extra)


def final_choice(
    trials: list[dict], baseline_args: list[str], baseline_config: str | None, tuned_on: str | None = None
) -> dict:
    """The kept trial, its flags and config, the command to use (naming the machine it was tuned on, `tuned_on`:
    train.py warns before its first step on a machine of another kind) and the sentence that says so."""
    final = final_trial(trials)
    config = final["config"] if final else baseline_config
    flags = merge_flags(baseline_args, final["flags"] if final else [])
    command = f"accelerate launch {launching.config_argument(config) + ' ' if config else ''}train.py " + shlex.join(
        flags + (["--tuned-on", tuned_on] if tuned_on else [])
    )
    return {
        "final_flags": final["flags"] if final else [],
        "final_config": config,
        "final_command": command,
        "tuned_on": tuned_on,
        "summary": final_text(final),
    }


def trial_verdicts(judgement: dict) -> dict:
    """What a trial's entry in the result takes from its judgement."""
    return {
        "kind": judgement["kind"],
        "speed": judgement["speed"],
        "training": judgement["training"],
        "evaluation": judgement["evaluation"],
        "verdict": judgement["verdict"],
        "equivalence": judgement["equivalence"],
        "exactness": judgement.get("exactness"),
        "same_result": judgement["same_result"],
        "result": judgement["result"],
        "rounds": judgement["rounds"],
        "pairs": judgement["speed"]["pairs"],
    }
