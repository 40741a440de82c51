"""The report's "Optimization" section: the advisor's ranked suggestions for the report's main run, what `make tune`
measured when it tried them (judged again by today's rules: trainscope.advice.rejudge) and what `make tune-confirm`
(trainscope tune --confirm) measured on the full job -- a tune result, or an older two-arm comparison
(`confirm_table`). Each machine's results stand apart, grouped under a heading naming it where there are several."""

import re
from dataclasses import dataclass, field
from pathlib import Path

from trainscope.advice import advisor, changes
from trainscope.advice.judge import METRICS, NONE_KEPT, change_of, final_text, final_trial
from trainscope.advice.rejudge import rejudged
from trainscope.core.record_view import RunView
from trainscope.core.records import read_steps
from trainscope.core.results_view import Machine, results_machine
from trainscope.experiments.base import Experiment
from trainscope.measure import bench
from trainscope.report import sections
from trainscope.report.sections import Folder, Headline
from trainscope.report.tables import Table


@dataclass
class OnMachine:
    """What one machine measured: its make tune results and its make tune-confirm results (sections.Folder each)."""

    machine: Machine | None
    tunes: list = field(default_factory=list)
    confirms: list = field(default_factory=list)

    @property
    def heading(self) -> str:
        return f"Measured on {self.machine.text}" if self.machine else "Measured on a machine its inputs do not name"


def on_machines(found: sections.Collected) -> list[OnMachine]:
    """make tune's and make tune-confirm's results grouped by machine, in the order of their folders (make tune's
    first: its declared folder, then those kept beside it by name)."""
    groups: dict = {}
    for experiment, kind in ((EXPERIMENT, "tunes"), (CONFIRM, "confirms")):
        for folder in sections.folders_of(found, experiment):
            machines = sections.machines(folder.runs.items())  # its runs' one machine, else its provenance's
            machine = next(iter(machines)) if len(machines) == 1 else results_machine(folder.comparison)
            getattr(groups.setdefault(machine, OnMachine(machine)), kind).append(folder)
    return list(groups.values())


def advice_run(folder: Folder) -> dict | None:
    """make tune's own advice run in its folder (the run whose suggestions it tried, on the machine it tuned on)."""
    return folder.runs.get((folder.comparison or {}).get("advice_run") or "")


def main_run(found: sections.Collected, groups: list[OnMachine]) -> dict | None:
    """The run the advisor reads where no make tune result brings its own advice run: the report's main run."""
    if any(advice_run(folder) for group in groups for folder in group.tunes):
        return None
    return sections.pick_breakdown_run(found)


def label(folder: Folder, target: str) -> str:
    """'make tune', or 'make tune (tune_amx/)' for a folder kept beside the declared one."""
    return f"{target} ({folder.name}/)" if folder.kept else target


def group_sources(group: OnMachine) -> list[tuple[str, dict]]:
    return [
        (label(folder, target), record)
        for target, folders in (("make tune", group.tunes), ("make tune-confirm", group.confirms))
        for folder in folders
        for record in folder.runs.values()
    ]


# the trials table's columns
COLUMNS = ["trial", "change", "kind", "predicted", "speed (same work)", "verdict", "training only",
           "evaluation only", "result"]  # fmt: skip


def section(report, found: sections.Collected) -> None:
    groups = on_machines(found)
    main = main_run(found, groups)
    if not report.begin(EXPERIMENT.title, groups or main, "Not run yet: `make profile` produces the main run."):
        return
    if main is not None:
        advice(report, main)
    several = len(groups) > 1
    if several:
        report.text(
            f"`make tune` and `make tune-confirm` on each of the {len(groups)} machines among these inputs, each "
            "under its own heading: their figures are not comparable with each other."
        )
    for group in groups:
        if several:
            labels = list(dict.fromkeys(name for name, _ in group_sources(group)))
            report.part(group.heading, {group.machine: labels} if group.machine else {})
        for folder in group.tunes:
            tune_part(report, found, folder)
        for folder in group.confirms:
            confirm_part(report, found, folder, group)
    if not any(group.confirms for group in groups):
        report.text(
            "On the full job: `make tune-confirm` measures make tune's final command against make train's "
            "(not among these inputs)."
        )


def advice(report, record: dict) -> None:
    """The advisor's ranked suggestions for one run, with the command that prints them."""
    view = RunView(record)
    report.text(
        f"From run `{view.name}` (`python report.py --advise {sections.shown_path(view.path or view.name)}`): "
        "each 'at most' is Amdahl's law on the measured share the change would shrink; an 'estimate' states its "
        "factor. `make tune` tries them and keeps what is faster with a result shown the same."
    )
    report.code("\n".join(advisor.lines(advisor.advise(record)[:6])))


def unreadable(found: sections.Collected, experiment: Experiment, folder: Folder) -> str | None:
    """Why a folder's result is skipped (listed with the report's skipped inputs), or None."""
    why = experiment.unreadable_folder(folder)
    if why and folder.kept:
        found.skipped.append(f"{sections.shown_path(folder.path)}: {why}")
    return why


def tune_part(report, found: sections.Collected, folder: Folder) -> None:
    """One make tune result: the advisor on its advice run, its trials, their results, its final command."""
    why = unreadable(found, EXPERIMENT, folder)
    if why:
        report.text(f"`make tune` in `{sections.shown_path(folder.path)}/`: (skipped: {why})")
        return
    record, tune = advice_run(folder), folder.comparison
    if record is not None:
        advice(report, record)
    if tune is None:
        return
    if tune.get("history"):
        report.text(tune["history"])
    trial_tables(report, tune, table_label(folder))
    report.text(f"Final command: `{tune['final_command']}`. {final_text(final_trial(tune['trials']))}")
    report.text(tune.get("method", ""))


def trial_tables(report, result: dict, name: str) -> None:
    """A tune result's trials (tune_table) and, where any was judged on seeds, their paired differences."""
    report.table(tune_table(result, name))
    if equivalence_table(result).rows:
        report.table(equivalence_table(result, f"{name}_result"))


def confirm_part(report, found: sections.Collected, folder: Folder, group: OnMachine) -> None:
    """One make tune-confirm result: its table and the result over its paired seeds."""
    where = f"`make tune-confirm` in `{sections.shown_path(folder.path)}/`"
    confirm = folder.comparison
    why = unreadable(found, reader(confirm), folder)
    if why or confirm is None:
        report.text(
            f"On the full job: {where} measures make tune's final command against make train's (its result "
            f"here is skipped: {why or 'no comparison.json'})."
        )
        return
    of_tune = any(confirms(confirm, tune.comparison) for tune in group.tunes if tune.comparison)
    report.text(
        f"{where}: "
        + ("make tune's final command above" if of_tune else tuned_what(confirm))
        + " against make train's, on make train's full job."
    )
    if by_tune(confirm):
        trial_tables(report, confirm, table_label(folder))
        report.text(f"{confirm['summary']} {confirm.get('method', '')}")
        return
    report.table(confirm_table(confirm, table_label(folder)))
    report.text(f"Result over the paired seeds (every metric): {confirm['comparisons'][TUNED]['equivalence']['text']}.")


def table_label(folder: Folder) -> str:
    """A table's label (its .tex file's name): its folder's, tune.tex, tune_amx.tex, tune_confirm_grouped.tex."""
    return re.sub(r"[^A-Za-z0-9_-]", "_", folder.name)


def confirms(confirm: dict, tune: dict) -> bool:
    """Whether a make tune-confirm result measured this make tune's final command: its one trial is make tune's
    final trial's change, or (an older result) its tuned arm runs make tune's final config and flags (the --tuned-on
    note aside)."""
    if by_tune(confirm):
        final = final_trial(tune.get("trials") or [])
        return final is not None and [t["own_flags"] for t in confirm["trials"]] == [final["flags"]]
    arm = ((confirm.get("arms") or {}).get(TUNED) or {}) if isinstance(confirm, dict) else {}
    flags = list(arm.get("flags") or [])
    if "--tuned-on" in flags:
        del flags[flags.index("--tuned-on") : flags.index("--tuned-on") + 2]
    return arm.get("config") == tune.get("final_config") and flags == list(tune.get("final_flags") or [])


def sources(found: sections.Collected) -> list[tuple[str, dict]]:
    """The advisor's run, make tune's runs and make tune-confirm's, each labelled by what it is."""
    groups = on_machines(found)
    tuned = [source for group in groups for source in group_sources(group)]
    main = main_run(found, groups)
    return tuned if main is None else [(f"main run {RunView(main).name}", main), *tuned]


def _ratio_cell(ratio: dict | None) -> str:
    if not ratio:
        return "-"
    return (
        f"{ratio['median_ratio']:.3f} ({ratio['min_ratio']:.3f}-{ratio['max_ratio']:.3f}, p {ratio['p_value']:.2g} raw)"
    )


def headline(found: sections.Collected):
    """What `make tune` kept and how much faster it is (the section's final trial, in its words), with what make
    tune-confirm measured of that command on the same machine; with make tune results from several machines, that
    answer for each machine ({Machine: Headline}: each goes to its machine on the first page and under its machine's
    heading here); before `make tune`, the advisor's first suggestion."""
    groups = on_machines(found)
    tuned = [
        (group, folder)
        for group in groups
        for folder in group.tunes
        if folder.comparison is not None and EXPERIMENT.unreadable_folder(folder) is None
    ]
    if len(tuned) == 1:
        return tune_headline(*tuned[0])
    if tuned:
        answers = {}
        for group, folder in tuned:  # a machine's first make tune (its declared folder first) answers for it
            answers.setdefault(group.machine, tune_headline(group, folder))
        return answers
    record = main_run(found, groups)
    if record is None:
        return None
    suggestions = advisor.advise(record)
    if not suggestions:
        return Headline(advisor.lines([])[0], "nothing to try")
    return Headline(
        f"first suggestion: {suggestions[0].change} -- {suggestions[0].gain_text()}",
        f"not tried yet: `{EXPERIMENT.target}` tries it",
    )


def tune_headline(group: OnMachine, folder: Folder) -> Headline:
    """One make tune result's answer: its final trial in the section's words (its result as its table's column
    gives it: the sentence is under the table), and make tune-confirm's of it."""
    final = final_trial(folder.comparison["trials"])
    if final is None:
        return Headline(NONE_KEPT, "nothing kept")
    return Headline(
        f"{final['name']} ({change_of(final)}): {bench.ratio_text(final['speed'])} on the same work, "
        f"result {result_cell(final)}" + confirmed_text(confirm_of(group, folder)),
        f"{final['verdict']}, kept",
    )


def confirm_of(group: OnMachine, folder: Folder) -> dict | None:
    """The make tune-confirm result on the same machine that measured this make tune's final command, readable."""
    return next(
        (
            c.comparison
            for c in group.confirms
            if c.comparison is not None
            and reader(c.comparison).unreadable_folder(c) is None
            and folder.comparison is not None
            and confirms(c.comparison, folder.comparison)
        ),
        None,
    )


def confirmed_text(confirm: dict | None) -> str:
    """'; on the full job (make tune-confirm): ...' from the confirm's own comparison, or nothing without one."""
    if confirm is None:
        return ""
    if by_tune(confirm):
        trial = confirm["trials"][0]
        speed, verdict, result = trial["speed"], trial["verdict"], result_cell(trial)
    else:
        against = confirm["comparisons"][TUNED]
        speed, verdict, result = against["speed"], against["speed"]["verdict"], against["equivalence"]["verdict"]
    return f"; on the full job (make tune-confirm): training samples/s {bench.ratio_text(speed)}, {verdict}, result {result}"


def _speed_cell(speed: dict) -> str:
    if not speed.get("pairs"):
        return "-"
    return (
        f"{speed['median_ratio']:.3f} ({speed['min_ratio']:.3f}-{speed['max_ratio']:.3f}), "
        f"{speed['n_baseline']}/{speed['n_trial']} runs, p {speed['p_raw']:.2g} raw, {speed['p_value']:.2g} Holm"
    )


def tune_table(result: dict, label: str = "tune") -> Table:
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
        COLUMNS,
        rows,
        label,
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


def equivalence_table(result: dict, label: str = "tune_result") -> Table:
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
        label,
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
    kept_beside=True,
)


# ---------------------------------------------------------------- make tune-confirm's results
# a tune result (experiment "tune-confirm"), or an older two-arm comparison on paired seeds (committed tune_confirm*/)
BASELINE, TUNED = "make-train", "make-tune"


def by_tune(comparison) -> bool:
    """Whether a make tune-confirm result is trainscope tune --confirm's (a tune result: its trials)."""
    return isinstance(comparison, dict) and "trials" in comparison


def reader(comparison) -> Experiment:
    """The declaration whose inputs a make tune-confirm result is: a tune result's, or the older comparison's."""
    return EXPERIMENT if by_tune(comparison) else CONFIRM


def rejudged_confirm(comparison: dict, records: dict) -> dict:
    return (rejudged_with_steps if by_tune(comparison) else sections.rejudged)(comparison, records)


def tuned_what(comparison: dict) -> str:
    """What the tuned arm ran: the change trainscope tune --confirm tried, make tune's final command (read from its
    result), or the command stated with --tuned-flags/--tuned-config (the result then names no make tune result)."""
    if by_tune(comparison):
        return comparison["trials"][0]["change"] if comparison.get("trials") else "no change"
    stated = "tune_result" in comparison and comparison["tune_result"] is None
    return "the command stated on its command line" if stated else "make tune's command"


def confirm_table(comparison: dict, label: str = "tune_confirm") -> Table:
    """make train against make tune's command (or a stated one) on the full job: speed, whole-job wall time, test
    accuracy with the equivalence test."""
    arms, against = comparison["arms"], comparison["comparisons"][TUNED]
    equivalence = against.get("equivalence") or {}
    rows = [
        [
            name,
            comparison.get("commands", {}).get(name, ""),
            _ranged(arms[name].get("samples_per_s"), 1),
            _ranged(arms[name].get("test_accuracy"), 4),
        ]
        for name in (BASELINE, TUNED)
    ]
    speed = against["speed"]
    metrics = equivalence.get("metrics", {})
    rows.append(
        [
            "make-tune / make-train",
            f"speed {bench.describe(speed)}; whole job {bench.ratio_text(against['whole_job'])}",
            f"{speed['median_ratio']:.3f}x",
            _equivalence_cell(metrics.get("test_accuracy"), equivalence),
        ]
    )
    return Table(
        f"The full make train job: make train against {tuned_what(comparison)} ({comparison['rounds']} "
        "alternating rounds, paired seeds)",
        ["arm", "command / comparison", "samples/s", "test accuracy"],
        rows,
        label,
        align="llrl",
    )


def _ranged(spread: dict | None, digits: int) -> str:
    if not spread:
        return "-"
    return f"{spread['median']:.{digits}f} ({spread['min']:.{digits}f}-{spread['max']:.{digits}f})"


def _equivalence_cell(entry: dict | None, equivalence: dict) -> str:
    if not entry:
        return "not measured"
    if entry["interval"] is None:
        return f"difference {entry['mean']:+.4f}: one seed, undecided"
    low, high = entry["interval"]
    return (
        f"difference {entry['mean']:+.4f}, 90% [{low:+.4f}, {high:+.4f}] against +-{entry['margin']:g}: "
        f"{entry['verdict']} ({len(equivalence.get('seeds', []))} seeds)"
    )


CONFIRM = Experiment(
    name="tune-confirm",
    title="make tune on the full job",
    target="make tune-confirm",
    folder="tune_confirm",
    section=None,
    needs=("experiment", "arms", "comparisons", "commands"),
    rejudge=rejudged_confirm,
    kept_beside=True,
)
