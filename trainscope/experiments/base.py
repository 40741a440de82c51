"""What every experiment shares: its declaration (docs/design.md#how-to-add), arms with the same seed, data, steps and
launcher in alternating rounds (trainscope.measure.bench), each compared with the first (the baseline), and its
results file. A config this machine cannot run is skipped with its reason; a planned run that fails stops it."""

import argparse
import shlex
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from trainscope.core import launching
from trainscope.core.record_view import RunView
from trainscope.core.records import read_record
from trainscope.core.results_view import machines_text
from trainscope.measure import bench
from trainscope.report import sections
from trainscope.report.document import Heading, Paragraph, markdown
from trainscope.report.sections import Headline
from trainscope.report.tables import Table, num, ranged


class ExperimentFailed(Exception):
    """A planned run failed: the experiment stops and says which and why."""


@dataclass(frozen=True)
class Experiment:
    """One experiment, declared once: how it runs and what the report shows of it (docs/design.md)."""

    name: str  # its subcommand (`python -m trainscope.experiments NAME`) and key
    title: str  # its report section's heading
    target: str  # the make target that produces its inputs (named where they are missing)
    section: Callable  # (ReportWriter, sections.Collected) -> writes its section
    folder: str | None = None  # its runs' folder under --runs (train.py runs)
    results: str | None = None  # its results file under --results (scripts that write their own)
    arguments: Callable[[argparse.ArgumentParser], None] | None = None  # its options (None: no subcommand)
    run: Callable | None = None  # (args, train_args) -> runs it, writes <runs>/<folder>/comparison.{json,md}
    help: str = ""
    needs: tuple[str, ...] = ("experiment", "baseline", "arms", "comparisons", "rounds")  # keys its input holds
    # found -> its answer on the first page (sections.Headline, or {Machine: Headline} where several machines
    # measured it and one_machine is False), None when its inputs are missing
    headline: Callable | None = None
    rejudge: Callable | None = None  # (comparison, its runs' records) -> judged by today's rules (sections.rejudged)
    sources: Callable | None = None  # found -> [(label, record or results file)] its section shows (and names)
    one_machine: bool = True  # its section compares its sources: several machines skip it with that reason
    # results may also be kept in <folder>_<suffix>/ beside its own (one per machine or command: the committed
    # tune_amx/), read where their comparison.json names it; its section shows each under its machine
    kept_beside: bool = False
    question: str | None = None  # the assignment's question its section answers (the first page asks it)
    answer: Callable | None = None  # found -> [sections.Answer] (one per machine), or None when not run

    def missing(self) -> str:
        return f"Not run yet: `{self.target}` produces it."

    def unreadable(self, found) -> str | None:
        """Why this experiment's comparison or results file cannot feed its section (an older trainscope's or a
        hand-edited one), or None."""
        source = found.results.get(self.name) if self.results else found.comparisons.get(self.name)
        return self.lacking(source) or self._several(self.machines(found))

    def unreadable_folder(self, folder) -> str | None:
        """Why one folder of its results (a sections.Folder: its own, or one kept beside it) cannot feed its
        section, or None: as `unreadable`, from that folder's comparison and runs alone."""
        return self.lacking(folder.comparison) or self._several(sections.machines(folder.runs.items()))

    def lacking(self, source) -> str | None:
        """'its inputs lack ...': the keys a comparison or results file of another shape lacks, or None."""
        if source is None:
            return None
        lacking = [key for key in self.needs if key not in source] if isinstance(source, dict) else ["an object"]
        return f"its inputs lack {', '.join(lacking)}" if lacking else None

    def _several(self, machines: dict) -> str | None:
        if self.one_machine and len(machines) > 1:
            return (
                f"its runs come from {machines_text(machines)}; a comparison needs them all from one machine "
                f"(run `{self.target}` there)"
            )
        return None

    def machines(self, found) -> dict:
        """{Machine: the labels of the sources it measured} of everything the section shows."""
        if self.sources is not None:
            return sections.machines(self.sources(found))
        sources = list(found.runs.get(self.name, {}).items()) if self.folder else []
        if self.results and isinstance(found.results.get(self.name), dict):
            sources.append((self.results, found.results[self.name]))
        return sections.machines(sources)


@dataclass
class Arm:
    name: str
    config: str | None
    flags: list = field(default_factory=list)
    skipped: str | None = None  # why this arm cannot run here
    mixed_precision: str | None = None  # --mixed_precision over the config's (make tune's final precision)


def planned_arm(name: str, config: str, flags: list[str]) -> Arm:
    """An arm of `config`, skipped with the reason when this machine cannot run the config."""
    plan = launching.plan(config)
    return Arm(name, config, list(flags), None if plan.runnable else plan.reason)


# ---------------------------------------------------------------- running arms in rounds


def run_arm(arm: Arm, train_args: list[str], runs: Path, round_index: int, extra: list[str] = ()) -> dict:
    """One train.py run of an arm; its record's headline figures."""
    name = f"{arm.name}-r{round_index}"
    on_cpu = launching.plan(arm.config).on_cpu if arm.config else None
    result = launching.run_training(
        [*train_args, *arm.flags, *extra, "--output-dir", str(runs), "--run-name", name, "--overwrite"],
        config=arm.config,
        env=launching.training_env(on_cpu),
        mixed_precision=arm.mixed_precision,
    )
    if result.returncode != 0:
        raise ExperimentFailed(
            f"{name} ({arm.config or 'no config'} {' '.join(arm.flags)}) failed: {launching.failure_reason(result)}"
        )
    return RunView(read_record(runs / name)).headline()


def run_rounds(arms: list[Arm], train_args: list[str], runs: Path, rounds: int) -> dict:
    """Every runnable arm once per round, alternating order; the figures of each run, by arm."""
    runnable = [arm for arm in arms if arm.skipped is None]
    measured = bench.alternate(
        {arm.name: (lambda i, arm=arm: run_arm(arm, train_args, runs, i)) for arm in runnable}, rounds
    )
    return {arm.name: [r[arm.name] for r in measured] for arm in runnable}


ARM_FIGURES = ("samples_per_s", "tokens_per_s", "step_s", "peak_memory_gib", "test_accuracy", "validation_accuracy")


def summarize(arms: list[Arm], results: dict, baseline: str) -> dict:
    """Per arm: spreads of its figures; per other arm: speed against the baseline with a verdict."""
    summary = {"baseline": baseline, "arms": {}, "comparisons": {}}
    for arm in arms:
        entry = {"config": arm.config, "flags": arm.flags}
        if arm.skipped:
            summary["arms"][arm.name] = {**entry, "status": "skipped", "reason": arm.skipped}
            continue
        rows = results[arm.name]
        entry.update(
            status="complete",
            runs=[r["run"] for r in rows],
            precision=rows[0]["precision"],
            world_size=rows[0]["world_size"],
            memory_kind=rows[0]["memory_kind"],
            warnings=sorted({w for r in rows for w in r["warnings"]}),
        )
        for metric in ARM_FIGURES:
            values = [r[metric] for r in rows if r[metric] is not None]
            entry[metric] = bench.spread(values) if values else None
        summary["arms"][arm.name] = entry
    if baseline in results:
        for name, rows in results.items():
            if name != baseline:
                base = results[baseline]
                summary["comparisons"][name] = {
                    "speed": bench.compare_samples(
                        [b["samples_per_s"] for b in base], [r["samples_per_s"] for r in rows]
                    ),
                    "memory_ratio": bench.spread(
                        [r["peak_memory_gib"] / b["peak_memory_gib"] for r, b in zip(rows, base)]
                    ),
                }
    return summary


def arm_table(comparison: dict, title: str, label: str) -> Table:
    """An experiment's table: every arm's samples/s and step time (median, min-max over rounds), its speed
    against the baseline with the verdict, and its peak memory."""
    rows = []
    for r in sections.arm_rows(comparison):
        what = f"{r['config']} {r['flags']}".strip()
        if r["status"] != "complete":
            rows.append([r["arm"], what, f"skipped: {r['reason']}", "", "", "", ""])
            continue
        rows.append(
            [
                r["arm"],
                what,
                ranged(r["samples_per_s"], r["samples_per_s_range"], 1),
                ranged(r["step_s"], r["step_s_range"], 3),
                *speed_cells(r),
                num(r["peak_memory_gib"]),
            ]
        )
    return Table(
        title,
        ["arm", "config + flags", "samples/s", "s/step", "speed vs baseline", "verdict", "peak GiB"],
        rows,
        label,
        align="llrrrlr",
    )


def speed_cells(row: dict) -> list[str]:
    speed = row.get("speed")
    return [bench.ratio_text(speed), speed["verdict"]] if speed else ["baseline", ""]


def verdicts_text(verdicts: dict[str, str]) -> str:
    """One arm's verdict as it is; several grouped by verdict: 'slower: ckpt, compile; within noise: ddp'."""
    if len(verdicts) == 1:
        return next(iter(verdicts.values()))
    grouped: dict[str, list[str]] = {}
    for name, verdict in verdicts.items():
        grouped.setdefault(verdict, []).append(name)
    return "; ".join(f"{verdict}: {', '.join(names)}" for verdict, names in grouped.items())


def arms_headline(comparison: dict | None, runs: dict | None = None, said=lambda name, against: "") -> Headline | None:
    """An experiment's answer: every arm's speed against the baseline as its table gives it (bench.ratio_text),
    with what `said(name, against)` adds, and the verdicts; None when it has not been run."""
    if not (comparison and (runs is None or runs)):
        return None
    compared = {name: against for name, against in comparison["comparisons"].items() if against.get("speed")}
    if not compared:
        return Headline(f"only the baseline `{comparison['baseline']}` ran", "nothing compared")
    return Headline(
        f"speed against `{comparison['baseline']}`: "
        + "; ".join(
            f"`{name}` {bench.ratio_text(against['speed'])}{said(name, against)}" for name, against in compared.items()
        ),
        verdicts_text({name: against["speed"]["verdict"] for name, against in compared.items()}),
    )


def errors(rows: list[dict], metric: str) -> list[list[float]]:
    """Error bars (median to min, median to max) of a metric for matplotlib."""
    return [[r[metric] - r[f"{metric}_range"][0] for r in rows], [r[f"{metric}_range"][1] - r[metric] for r in rows]]


def write(runs: Path, experiment: str, summary: dict, train_args: list[str], rounds: int) -> None:
    report = {"experiment": experiment, "rounds": rounds, "train_args": train_args, **summary}
    page = [
        Heading(f"Experiment: {experiment}"),
        Paragraph(
            f"train.py flags: `{shlex.join(train_args)}`; {rounds} alternating round(s); each arm against the "
            f"baseline arm ({bench.METHOD})."
        ),
        arm_table(summary, f"Experiment: {experiment}", experiment),
    ]
    bench.write_results(runs / "comparison", report, markdown(page))


def experiment(runs: Path, name: str, arms: list[Arm], train_args: list[str], rounds: int) -> dict:
    """Run the arms in alternating rounds, summarize them against the first and write comparison.{json,md}."""
    for arm in arms:
        if arm.skipped:
            print(f"skipped {arm.name}: {arm.skipped}", flush=True)
    results = run_rounds(arms, train_args, runs, rounds)
    summary = summarize(arms, results, arms[0].name)
    write(runs, name, summary, train_args, rounds)
    print((runs / "comparison.md").read_text())
    return summary


def fixed_arms(name: str, arms: dict[str, list[str]]) -> Callable:
    """The run of an experiment whose arms are fixed flags on one config (the first arm is the baseline)."""

    def run(args, train_args: list[str]) -> dict:
        planned = [planned_arm(arm, args.config, flags) for arm, flags in arms.items()]
        return experiment(Path(args.runs), name, planned, train_args, args.rounds)

    return run


def runs_option(parser: argparse.ArgumentParser, rounds: int | None = 5, config: str | None = "cpu") -> None:
    """The options every experiment of train.py runs has: --runs, and --rounds / --config where it takes them."""
    parser.add_argument("--runs", required=True, help="where the runs and comparison.{json,md} go")
    if rounds:
        parser.add_argument("--rounds", type=int, default=rounds, help=f"alternating rounds (default {rounds})")
    if config:
        parser.add_argument("--config", default=config, help=f"Accelerate config name or path (default {config})")
