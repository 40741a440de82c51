"""The report's "Optimization" section: the advisor's ranked suggestions for the report's main run, what
`make tune` (trainscope.tune) measured when it tried them -- judged again from its runs' records by today's
rules (trainscope.tune_judge.rejudged) -- and what `make tune-confirm` measured on the full job."""

from pathlib import Path

from trainscope import advisor, bench, changes, reporting
from trainscope.experiments import tune_confirm
from trainscope.experiments.base import Experiment
from trainscope.record_view import RunView
from trainscope.records import read_steps
from trainscope.reporting import Headline
from trainscope.tables import Table
from trainscope.tune_judge import METRICS, NONE_KEPT, change_of, final_text, final_trial, rejudged


def advice_record(found: reporting.Collected) -> dict | None:
    """The run the advisor reads here: make tune's own advice run where make tune's result and that run are among the
    inputs (its suggestions are the ones make tune tried, on the machine it tuned on), else the report's main run."""
    tune = found.comparisons.get("tune") or {}
    advice = found.runs.get("tune", {}).get(tune.get("advice_run") or "")
    return advice or reporting.pick_breakdown_run(found)


def section(report, found: reporting.Collected) -> None:
    record = advice_record(found)
    if not report.begin(EXPERIMENT.title, record, "Not run yet: `make profile` produces the main run."):
        return
    view = RunView(record)
    report.text(
        f"From run `{view.name}` (`python report.py --advise {view.path}`): each 'at most' is Amdahl's law "
        "on the measured share the change would shrink; an 'estimate' states its factor. `make tune` tries "
        "them and keeps what is faster with a result shown the same."
    )
    report.code("\n".join(advisor.lines(advisor.advise(record)[:6])))
    tune = found.comparisons.get("tune")
    if tune:
        if tune.get("history"):
            report.text(tune["history"])
        report.table(tune_table(tune))
        if equivalence_table(tune).rows:
            report.table(equivalence_table(tune))
        report.text(f"Final command: `{tune['final_command']}`. {final_text(final_trial(tune['trials']))}")
        report.text(tune.get("method", ""))
    confirm, why = readable_confirm(found)
    if confirm:
        report.table(tune_confirm.confirm_table(confirm))
        report.text(
            "Result over the paired seeds (every metric): "
            f"{confirm['comparisons'][tune_confirm.TUNED]['equivalence']['text']}."
        )
    else:
        report.text(
            "On the full job: `make tune-confirm` measures make tune's final command against make train's "
            + (f"(its result here is skipped: {why})." if why else "(not among these inputs).")
        )


def sources(found: reporting.Collected) -> list[tuple[str, dict]]:
    """The advisor's run, make tune's runs and make tune-confirm's, each labelled by what it is."""
    main = advice_record(found)
    tuned = [(f"make {name}", r) for name in ("tune", "tune-confirm") for r in found.runs.get(name, {}).values()]
    if main is None or any(main is record for _, record in tuned):  # make tune's advice run is among its runs
        return tuned
    return [(f"main run {RunView(main).name}", main), *tuned]


def _ratio_cell(ratio: dict | None) -> str:
    if not ratio:
        return "-"
    return (
        f"{ratio['median_ratio']:.3f} ({ratio['min_ratio']:.3f}-{ratio['max_ratio']:.3f}, p {ratio['p_value']:.2g} raw)"
    )


def headline(found: reporting.Collected) -> Headline | None:
    """What `make tune` kept and how much faster it is (the section's final trial, in its words); before
    `make tune`, the advisor's first suggestion."""
    record = advice_record(found)
    if record is None:
        return None
    tune = found.comparisons.get("tune")
    if tune:
        final = final_trial(tune["trials"])
        if final is None:
            return Headline(NONE_KEPT, "nothing kept")
        return Headline(
            f"{final['name']} ({change_of(final)}): {bench.ratio_text(final['speed'])} on the same work, "
            f"result {final['result']}" + confirmed_text(found),
            f"{final['verdict']}, kept",
        )
    suggestions = advisor.advise(record)
    if not suggestions:
        return Headline(advisor.lines([])[0], "nothing to try")
    return Headline(
        f"first suggestion: {suggestions[0].change} -- {suggestions[0].gain_text()}",
        f"not tried yet: `{EXPERIMENT.target}` tries it",
    )


def readable_confirm(found: reporting.Collected) -> tuple[dict | None, str | None]:
    """(make tune-confirm's comparison, None) where it can be read; else (None, why it is skipped or None)."""
    confirm, why = found.comparisons.get("tune-confirm"), tune_confirm.EXPERIMENT.unreadable(found)
    return (confirm, None) if confirm and why is None else (None, why)


def confirmed_text(found: reporting.Collected) -> str:
    """'; on the full job (make tune-confirm): ...' from the confirm's own comparison, or nothing without one."""
    confirm, _ = readable_confirm(found)
    if confirm is None:
        return ""
    against = confirm["comparisons"][tune_confirm.TUNED]
    return (
        f"; on the full job (make tune-confirm): training samples/s {bench.ratio_text(against['speed'])}, "
        f"{against['speed']['verdict']}, result {against['equivalence']['verdict']}"
    )


def _speed_cell(speed: dict) -> str:
    if not speed.get("pairs"):
        return "-"
    return (
        f"{speed['median_ratio']:.3f} ({speed['min_ratio']:.3f}-{speed['max_ratio']:.3f}), "
        f"{speed['n_baseline']}/{speed['n_trial']} runs, p {speed['p_raw']:.2g} raw, {speed['p_value']:.2g} Holm"
    )


def tune_table(result: dict) -> Table:
    """Each trial against the baseline runs of its own rounds: its predicted gain, the speed on the same work
    (n baseline / n trial, raw and Holm p), the verdict, the training-only and evaluation-only ratios, the result."""
    tests = (result.get("design") or {}).get("tests", "?")
    rows = [
        [
            t["name"],
            change_of(t),
            t.get("kind") or "-",
            t.get("gain_text") or "-",
            _speed_cell(t["speed"]),
            t["verdict"],
            _ratio_cell(t.get("training")),
            _ratio_cell(t.get("evaluation")),
            result_cell(t),
        ]
        for t in result["trials"]
    ]
    return Table(
        f"make tune: each suggestion (the exact ones first, then the others on top of the kept exact ones), "
        f"then the kept ones together, against the baseline runs of its own rounds (Holm over {tests} test{'s' * (tests != 1)}, "
        "one look)",
        [
            "trial",
            "change",
            "kind",
            "predicted",
            "speed (same work)",
            "verdict",
            "training only",
            "evaluation only",
            "result",
        ],
        rows,
        "tune",
        align="llllrlrrl",
    )


def result_cell(trial: dict) -> str:
    """The result as the trial's kind is judged: exact or not (an exact change), the equivalence verdict (a numeric
    one, or a training one on the full job), or what the full job needs (a training one on a proxy)."""
    if trial.get("kind") == changes.EXACT and trial.get("exactness"):
        return trial["exactness"]["verdict"]
    if trial.get("kind") == changes.TRAINING and trial["result"].startswith("not decided here"):
        return "full job only"
    return (trial.get("equivalence") or {}).get("verdict", trial["result"])


def equivalence_table(result: dict) -> Table:
    """Each trial's paired differences (trial minus baseline, same seed) with their 90% interval, against the
    margins stated before measuring."""
    rows = []
    for t in result["trials"]:
        if t.get("kind") == changes.EXACT:  # judged by its own runs' numbers (the result column), not by seeds
            continue
        equivalence = t.get("equivalence") or {}
        for metric in METRICS:
            entry = (equivalence.get("metrics") or {}).get(metric)
            if entry is None:
                continue
            interval = entry["interval"]
            rows.append(
                [
                    t["name"],
                    metric.replace("_", " "),
                    f"{entry['mean']:+.4f}",
                    f"[{interval[0]:+.4f}, {interval[1]:+.4f}]" if interval else "- (one seed)",
                    f"+-{entry['margin']:g}",
                    str(entry["n"]),
                    entry["verdict"]
                    + (
                        f" ({entry['needed']} seeds would show it {entry.get('shows') or 'decided'})"
                        if entry.get("needed")
                        else ""
                    ),
                ]
            )
    return Table(
        "make tune: the same result? Paired differences (trial minus baseline, same seed), 90% interval, "
        "two one-sided tests",
        ["trial", "metric", "mean difference", "90% interval", "margin", "seeds", "verdict"],
        rows,
        "tune_result",
        align="llrrrrl",
    )


def rejudged_with_steps(comparison: dict, records: dict) -> dict:
    """`rejudged` with each record's step lines beside it (an exact trial is judged by its step losses)."""
    return rejudged(
        comparison,
        {
            name: {**record, "steps": read_steps(Path(record["path"]), problems=[])} if record.get("path") else record
            for name, record in records.items()
        },
    )


EXPERIMENT = Experiment(
    name="tune",
    title="Optimization: what to try next",
    target="make tune",
    folder="tune",
    section=section,
    headline=headline,
    needs=("experiment", "trials", "final_command", "summary"),
    rejudge=rejudged_with_steps,
    sources=sources,
    one_machine=False,
)
