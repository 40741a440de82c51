"""A committed make tune's result judged again from its runs' records by today's rules (trainscope.advice.judge),
its final choice made again: what the report shows of a make tune measured under an older rule.
"""

import re
from dataclasses import replace

from trainscope.advice import changes
from trainscope.advice.design import Design, method_text
from trainscope.advice.judge import final_choice, judged_in_phases, measure, run_figures, trial_verdicts

HISTORY = (
    "Measured by an earlier make tune, judged again here from its runs' records by today's rules: its rounds "
    "were added while a trial was undecided (looks at 3 to 6 rounds) and its trials ran on the baseline's seed "
    "only, so these error rates are not those of today's fixed design, and no result can be shown the same "
    "from one seed. Re-run `make tune`."
)


def trial_kind(trial: dict, baseline_config: str | None = None) -> str:
    """A trial's kind as written, else from its own flags and config by today's catalogue (trainscope.advice.changes)."""
    if trial.get("kind"):
        return trial["kind"]
    config = trial.get("config") if trial.get("config") != baseline_config else None
    return changes.kind_of(trial.get("own_flags", trial.get("flags") or []), config)


def rejudged(comparison: dict, records: dict) -> dict:
    """A make tune comparison with every trial judged again by `judge` from its runs' records (when they are all
    there; a record may carry its step lines under "steps"), its final choice made again: a committed result made
    under an older rule reads by today's. A result without a design (an older make tune) gets the design its runs
    allow and says so (`history`); a trial without a kind gets today's catalogue's."""
    trials = comparison.get("trials") if isinstance(comparison, dict) else None
    if not trials or "final_change" in comparison:  # trainscope tune's: judged by today's rules when it ran
        return comparison
    readings = _runs_measured(comparison, records, trials)
    if readings is None:
        return comparison
    measured, kinds, against = readings
    rounds = None
    if "design" in comparison:  # today's exactness tolerance, whatever the result was judged by
        design = replace(Design.from_dict(comparison["design"]), tolerance=changes.EXACT_TOLERANCE)
    else:
        design, rounds, comparison = _with_design_of_its_runs(comparison, trials, measured)
    baselines = set(against.values()) | {"baseline"}
    pairs = _fp32_pairs(trials, records) if design.exact_check else {}
    measures = {
        name: measure(design, measured[against.get(name, "baseline")], runs, kinds[name], pairs.get(name))
        for name, runs in measured.items()
        if name not in baselines
    }
    judged = judged_in_phases(design, measures, {t["name"] for t in trials if t.get("phase") == changes.EXACT})
    for entry in judged.values():
        entry["speed"]["boundary"] = comparison["design"]["boundary"]
    comparison = {
        **comparison,
        "trials": [{**t, **trial_verdicts(judged[t["name"]])} for t in trials],
        "method": method_text(design, rounds, comparison["design"]["boundary"]),
    }
    comparison.update(
        final_choice(
            comparison["trials"],
            comparison.get("baseline_args", []),
            comparison.get("baseline_config"),
            comparison.get("tuned_on"),
        )
    )
    return comparison


def _runs_measured(comparison: dict, records: dict, trials: list[dict]) -> tuple | None:
    """(figures of each trial's and baseline's runs by round: {name: {round: figures}}, each trial's kind, the
    baseline each trial ran against), or None when a run's name is not of the form name-rN or its record is not
    there."""
    measured, kinds, against = {"baseline": {}}, {}, {}
    for trial in trials:
        mine = measured.setdefault(trial["name"], {})
        kinds[trial["name"]] = trial_kind(trial, comparison.get("baseline_config"))
        runs = trial.get("runs", [])
        for run, base in zip(
            runs, trial.get("baseline_runs") or [re.sub(r".*-r(\d+)$", r"baseline-r\1", r) for r in runs]
        ):
            found, of_base = re.fullmatch(r"(.+)-r(\d+)", run), re.fullmatch(r"(.+)-r(\d+)", base)
            if not found or not of_base or run not in records or base not in records:
                return None
            index = int(found.group(2))
            against[trial["name"]] = of_base.group(1)
            mine[index] = run_figures(records[run], records[run].get("steps"))
            measured.setdefault(of_base.group(1), {})[index] = run_figures(records[base], records[base].get("steps"))
    return measured, kinds, against


def _fp32_pairs(trials: list[dict], records: dict) -> dict[str, tuple[list[dict], list[dict]]]:
    """The exact trials' fp32 pairs (make tune's runs at another precision) from their records, by trial."""
    pairs = {}
    for trial in trials:
        names = (trial.get("exactness") or {}).get("pair_runs") or []
        if names and all(b in records and t in records for b, t in names):
            figures = lambda run: run_figures(records[run], records[run].get("steps"))  # noqa: E731
            pairs[trial["name"]] = ([figures(b) for b, _ in names], [figures(t) for _, t in names])
    return pairs


def _with_design_of_its_runs(comparison: dict, trials: list[dict], measured: dict) -> tuple:
    """An older make tune's result (no design) judged at the rounds each trial took: the design's R is the fewest, so
    every trial is judged. (design, the rounds as the method says them, the comparison with the design and its
    `history`)."""
    first = measured["baseline"][min(measured["baseline"])]
    design = Design(
        rounds=min(len(t.get("runs", [])) for t in trials) or 1,
        trials=sum(t["name"] != "kept" for t in trials),
        seed=first["seed"] or 42,
        data_seed=first.get("data_seed") or first["seed"] or 42,
    )
    rounds = "rounds (" + ", ".join(f"{t['name']} {len(t.get('runs', []))}" for t in trials) + ")"
    boundary = (
        f"none held: looks after 3 to 6 rounds when measured, judged here once at the rounds each took; "
        f"Holm over {design.tests} test(s)"
    )
    comparison = {**comparison, "design": {**design.to_dict(), "boundary": boundary}, "history": HISTORY}
    return design, rounds, comparison
