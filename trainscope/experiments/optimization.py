"""The report's "Optimization" section: the advisor's ranked suggestions for the report's main run, and
what `make tune` (trainscope.tune) measured when it tried them."""

from trainscope import advisor, bench, reporting
from trainscope.experiments.base import Experiment
from trainscope.record_view import RunView
from trainscope.reporting import Headline
from trainscope.tables import Table


def section(report, found: reporting.Collected) -> None:
    record = reporting.pick_breakdown_run(found)
    if not report.begin(EXPERIMENT.title, record, "Not run yet: `make profile` produces the main run."):
        return
    view = RunView(record)
    report.text(f"From run `{view.name}` (`python report.py --advise {view.path}`): each 'at most' is Amdahl's law "
                "on the measured share the change would shrink; an 'estimate' states its factor. `make tune` tries "
                "them and keeps what is faster.")
    report.code("\n".join(advisor.lines(advisor.advise(record)[:6])))
    tune = found.comparisons.get("tune")
    if tune:
        report.table(tune_table(tune))
        report.text(f"Final command: `{tune['final_command']}`. {final_text(final_trial(tune['trials']))}")
        report.text(tune.get("method", ""))


def final_trial(trials: list[dict]) -> dict | None:
    """What `make tune` keeps: the kept changes tried together where that trial is itself kept, else the
    fastest trial that was faster with the same result (None: the baseline stands)."""
    kept = [t for t in trials if t["verdict"] == "faster" and t["same_result"]]
    if trials and trials[-1]["name"] == "kept" and trials[-1] in kept:
        return trials[-1]
    return max(kept, key=lambda t: t["speed"]["median_ratio"], default=None)


NONE_KEPT = "No suggestion was faster on the same work with the same result: the baseline stands"


def final_text(final: dict | None) -> str:
    if final is None:
        return f"{NONE_KEPT}; the rejected trials above are the evidence."
    return (f"Best: {final['name']} ({change_of(final)}), {bench.describe(final['speed'])} on the same work with the "
            "same result.")


def headline(found: reporting.Collected) -> Headline | None:
    """What `make tune` kept and how much faster it is (the section's final trial, in its words); before
    `make tune`, the advisor's first suggestion."""
    record = reporting.pick_breakdown_run(found)
    if record is None:
        return None
    tune = found.comparisons.get("tune")
    if tune:
        final = final_trial(tune["trials"])
        if final is None:
            return Headline(NONE_KEPT, "nothing kept")
        return Headline(f"{final['name']} ({change_of(final)}): {bench.ratio_text(final['speed'])} on the same work "
                        "with the same result", f"{final['verdict']}, kept")
    suggestions = advisor.advise(record)
    if not suggestions:
        return Headline(advisor.lines([])[0], "nothing to try")
    return Headline(f"first suggestion: {suggestions[0].change} -- {suggestions[0].gain_text()}",
                    f"not tried yet: `{EXPERIMENT.target}` tries it")


def change_of(trial: dict) -> str:
    """A trial's change as a user types it: the config it launches with, then its flags."""
    parts = ([f"config {trial['config']}"] if trial.get("config") else []) + ([" ".join(trial["flags"])] if trial["flags"] else [])
    return ", ".join(parts)


def tune_table(result: dict) -> Table:
    """Each trial against the baseline: its predicted gain, the measured speed, the verdict, pairs, result."""
    rows = [[t["name"], change_of(t), t.get("gain_text") or "-", bench.ratio_text(t["speed"]), t["verdict"], t["result"]]
            for t in result["trials"]]
    return Table("make tune: each suggestion against the baseline, then the kept ones together",
                 ["trial", "change", "predicted", "speed (same work)", "verdict", "result"], rows, "tune",
                 align="lllrll")


EXPERIMENT = Experiment(name="tune", title="Optimization: what to try next", target="make tune", folder="tune",
                        section=section, headline=headline, needs=("experiment", "trials", "final_command", "summary"))
