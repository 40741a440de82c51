"""What trainscope costs a script's whole run: the script with trainscope against the same script without it, both
launched as a user launches them, in alternating rounds after uncounted warm-up rounds. Each launch is timed from
the launch to the exit and, inside, by torch's global optimizer-step hook (`--clock`); from each round come
trainscope's per-step cost and its fixed cost, judged against targets stated before measuring, and a direct figure
(its own calls timed) that must agree with the per-step cost.

How it works: docs/benchmarks.md#in-the-code-the-whole-run-verdict-trainscopeexperimentsbenchmarkswhole_runpy."""

import json
import re
import runpy
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from trainscope.core import launching
from trainscope.measure import bench
from trainscope.report.document import Paragraph
from trainscope.report.tables import Table, spread_cell

FIXED_S, FIXED_SHARE = 1.0, 0.02  # the fixed cost's budget: max(1 s, 2% of the run's wall time without trainscope)
STEP_TARGET = 0.03  # the per-step cost's target: 3% of the step
CHECKABLE_WIDTH = 0.10  # an interval wider than 10 points of the step checks no direct figure (undecided)
BASELINE = "without trainscope"
DIRECT = "direct"


@dataclass(frozen=True)
class Script:
    """A kind of script measured with and without trainscope: the launcher as a user types it, each arm's program (a
    script and its flags, or `-m` and a module), the steps the steady step leaves out, and the direct figure's child
    (its last line JSON with `us_per_step`). Arms marked in `records` get a run folder: `--output-dir`, `--run-name`."""

    name: str
    what: str
    launcher: list
    arms: dict  # label -> program; the first is the baseline, without trainscope
    warmup: int
    direct: list | None = None
    records: tuple = ()
    env: dict = field(default_factory=dict)


# ---------------------------------------------------------------- the step clock (the child side)


def clocked(stamps: str, program: list[str]) -> None:
    """`program` run as `python` runs it, each optimizer step stamped by torch's global step hook; at its end (a
    clean exit or not) the stamps of the optimizer that stepped most, and torch's threads, written to `stamps`."""
    import torch
    from torch.optim.optimizer import register_optimizer_step_post_hook

    seen: dict = {}
    handle = register_optimizer_step_post_hook(
        lambda optimizer, args, kwargs: seen.setdefault(id(optimizer), []).append(time.perf_counter())
    )
    try:
        if program[0] == "-m":
            sys.argv = program[1:]
            runpy.run_module(program[1], run_name="__main__", alter_sys=True)
        else:
            sys.argv = list(program)
            sys.path.insert(0, str(Path(program[0]).resolve().parent))  # as `python script.py` puts it first
            runpy.run_path(program[0], run_name="__main__")
    finally:
        handle.remove()
        found = max(seen.values(), key=len, default=[])
        Path(stamps).write_text(json.dumps({"stamps": found, "threads": torch.get_num_threads()}))


def steady_step(stamps: list[float], warmup: int) -> float:
    """The mean interval of the steps after the first `warmup` ones."""
    if len(stamps) <= warmup:
        raise SystemExit(f"error: {len(stamps)} optimizer steps leave none after the {warmup} warm-up steps to time")
    return (stamps[-1] - stamps[warmup - 1 if warmup else 0]) / (len(stamps) - max(warmup, 1))


# ---------------------------------------------------------------- the runs (the parent side)


def launcher(scratch: Path, clock: Callable[[], float] = time.perf_counter) -> Callable[[Script, str, int], dict]:
    """The runner of real launches: one arm of a script in round `index`, timed by `clock` from the launch to the
    exit, its steps by the step clock; the direct figure's child as it prints it."""

    def run(script: Script, label: str, index: int) -> dict:
        env = launching.training_env(extra=script.env)
        if label == DIRECT:
            result = launching.run_captured([*script.launcher, *script.direct], env)
            check(result, f"{script.name}'s direct figure")
            return json.loads(result.stdout.strip().splitlines()[-1])
        name = re.sub(r"[^\w.-]+", "_", f"{script.name}-{label}-{index}")  # each launch's own run folder and stamps
        stamps, program = scratch / f"{name}.json", list(script.arms[label])
        if label in script.records:
            program += ["--output-dir", str(scratch), "--run-name", name]
        command = [*script.launcher, "-m", __name__, "--clock", str(stamps), *program]
        began = clock()
        result = launching.run_captured(command, env)
        wall = clock() - began
        check(result, f"{script.name} ({label})")
        found = json.loads(stamps.read_text())
        return {
            "wall_s": wall,
            "steps": len(found["stamps"]),
            "step_s": steady_step(found["stamps"], script.warmup),
            "threads": found["threads"],
        }

    return run


def check(result, what: str) -> None:
    if result.returncode != 0:
        raise SystemExit(f"error: {what} failed: {launching.failure_reason(result)}")


def measure(script: Script, rounds: int, warm_rounds: int, run, log=print, on_round=None) -> dict:
    """`warm_rounds` of the arms not counted, then `rounds` alternating rounds of the arms and the direct figure's
    child (`run(script, label, index)`: a launcher or a simulation); `on_round(figures)` after each counted round."""
    arms = {label: (lambda index, label=label: run(script, label, index)) for label in script.arms}
    if script.direct:
        arms[DIRECT] = lambda index: run(script, DIRECT, index)
    if warm_rounds:
        bench.alternate({label: arms[label] for label in script.arms}, warm_rounds, log=log, first_round=-warm_rounds)
    measured = []
    for index in range(rounds):
        measured += bench.alternate(arms, 1, log=log, first_round=index)
        if on_round is not None:
            on_round(figures(script, measured))
    return figures(script, measured)


# ---------------------------------------------------------------- the verdicts


def agreement(direct: float | None, cost: dict) -> str:
    """The direct per-step figure against the rounds' interval of the per-step cost: "agree" inside it, "below" or
    "above" outside it (the check fails either way: one of the two figures misses something), "undecided" where the
    interval is wider than CHECKABLE_WIDTH or there are too few rounds, "none" without a direct figure."""
    if direct is None:
        return "none"
    interval = cost["interval"]
    if cost["n"] < bench.MIN_PAIRS or interval["high"] - interval["low"] > CHECKABLE_WIDTH:
        return "undecided"
    return "below" if direct < interval["low"] else "above" if direct > interval["high"] else "agree"


def launches(runs: list[dict]) -> dict:
    """An arm's launches in short: wall time and steady step (median, min-max), steps and threads seen."""
    return {**{key: bench.spread([r[key] for r in runs]) for key in ("wall_s", "step_s")},
            **{key: sorted({r[key] for r in runs}) for key in ("steps", "threads")}}  # fmt: skip


def figures(script: Script, rounds: list[dict]) -> dict:
    """Each arm with trainscope against the baseline over the rounds: the whole run's ratio and verdict, the fixed
    and per-step costs with their intervals and targets, the direct figure and its agreement."""
    base = [r[BASELINE] for r in rounds]
    bare_wall, bare_step = (statistics.median(b[key] for b in base) for key in ("wall_s", "step_s"))
    direct_us = [r[DIRECT]["us_per_step"] for r in rounds if DIRECT in r]
    direct = statistics.median(direct_us) * 1e-6 / bare_step if direct_us else None
    budget = max(FIXED_S, FIXED_SHARE * bare_wall)
    arms = {}
    for label in list(script.arms)[1:]:
        pairs = [(r[label], b) for r, b in zip(rounds, base)]
        per_step = bench.spread_and_interval([x["step_s"] / b["step_s"] - 1 for x, b in pairs])
        fixed = bench.spread_and_interval(
            [x["wall_s"] - b["wall_s"] - x["steps"] * (x["step_s"] - b["step_s"]) for x, b in pairs]
        )
        arms[label] = {
            "whole_run": bench.compare_samples([b["wall_s"] for b in base], [x["wall_s"] for x, _ in pairs], False),
            "added_s": bench.spread_and_interval([x["wall_s"] - b["wall_s"] for x, b in pairs]),
            "fixed_s": fixed, "fixed_budget_s": budget, "fixed_met": bench.within(fixed["interval"], budget),
            "per_step": per_step, "step_target": STEP_TARGET, "step_met": bench.within(per_step["interval"], STEP_TARGET),
            "agreement": agreement(direct, per_step),
            **launches([x for x, _ in pairs]),
        }  # fmt: skip
    return {
        "script": script.name,
        "what": script.what,
        "arms_run": {label: list(program) for label, program in script.arms.items()},
        "warmup_steps": script.warmup,
        "rounds": rounds,
        "baseline": launches(base),
        "direct": {"us_per_step": bench.spread(direct_us), "share": direct} if direct_us else None,
        "arms": arms,
    }


def exit_if_failed(scripts: list[dict]) -> None:
    """Exits 1 naming the checks that failed: a direct figure outside the rounds' interval of the per-step cost."""
    failed = [
        f"{found['script']} ({label}): the direct figure {found['direct']['share']:+.2%} lies {arm['agreement']} the "
        f"rounds' interval of the per-step cost ({arm['per_step']['interval']['low']:+.2%} to "
        f"{arm['per_step']['interval']['high']:+.2%}): one of the two misses a cost"
        for found in scripts
        for label, arm in found["arms"].items()
        if arm["agreement"] in ("below", "above")
    ]
    if failed:
        print("error: " + "; ".join(failed), file=sys.stderr)
        raise SystemExit(1)


# ---------------------------------------------------------------- the page


VERDICT = {True: "met", False: "**NOT met**", None: "undecided"}
AGREEMENT = {"agree": "agree", "below": "**DISAGREE** (below)", "above": "**DISAGREE** (above)",
             "undecided": "undecided (interval too wide)", "none": "no direct figure"}  # fmt: skip


def tables(found: list[dict]) -> list:
    """The verdict of every script measured: the whole run's table, then the steady step's."""
    whole, steady = [], []
    for script in found:
        base, direct = script["baseline"], script["direct"]
        for label, arm in script["arms"].items():
            fixed, step, name = arm["fixed_s"], arm["per_step"], f"{script['script']}: {label}"
            whole.append([
                name, spread_cell(base["wall_s"], 1), spread_cell(arm["wall_s"], 1),
                f"{bench.ratio_text(arm['whole_run'])}: {arm['whole_run']['verdict']}",
                f"{fixed['median']:+.2f} ({fixed['interval']['low']:+.2f} to {fixed['interval']['high']:+.2f})",
                f"<= {arm['fixed_budget_s']:.2f} s: {VERDICT[arm['fixed_met']]}",
            ])  # fmt: skip
            steady.append([
                name, *(spread_cell({k: v * 1e3 for k, v in s["step_s"].items() if k != "n"}) for s in (base, arm)),
                f"{step['median']:+.2%} ({step['interval']['low']:+.2%} to {step['interval']['high']:+.2%})",
                f"<= {arm['step_target']:.0%}: {VERDICT[arm['step_met']]}",
                f"{direct['share']:+.2%} ({direct['us_per_step']['median']:.0f} us)" if direct else "n/a",
                AGREEMENT[arm["agreement"]],
            ])  # fmt: skip
    headers = ["script: arm", "without trainscope", "with"]
    return [
        Table("The whole run, from the launch to the exit (seconds)", [*headers, "ratio without / with: verdict",
              "fixed cost (interval)", "fixed cost's budget"], whole, "whole_run", align="lrrlrl"),
        Table("The steady step (milliseconds)", [*headers, "per-step cost (interval)", "target",
              "direct figure (diagnostic)", "direct figure against the interval"], steady, "whole_run_steps",
              align="lrrrlrl"),
    ]  # fmt: skip


def method(found: list[dict], warm_rounds: int) -> Paragraph:
    rounds = sorted({len(script["rounds"]) for script in found})
    confidence = sorted({f"{a['per_step']['interval']['confidence']:.1%}" for s in found for a in s["arms"].values()})
    return Paragraph(
        f"Each script launched as its user launches it, with trainscope and without, in {', '.join(map(str, rounds))} "
        f"alternating rounds after {warm_rounds} warm-up round(s) not counted (the caches warm); the wall time from the "
        "launch to the exit, measured from outside; the steady step the mean interval of the optimizer's steps after "
        "the script's warm-up steps, stamped by torch's global step hook in both arms. Per round, the per-step cost is "
        "the ratio of the steady steps less 1, the fixed cost the wall time trainscope added less its steady steps' "
        "share (steps x the step's difference: start-up, warm-up, what runs after the loop, the record). Targets "
        f"stated before measuring: fixed cost <= max({FIXED_S:.0f} s, {FIXED_SHARE:.0%} of the wall time without), "
        f"per-step cost <= {STEP_TARGET:.0%}, each judged on the median's distribution-free interval "
        f"({', '.join(confidence)}): met when its upper end is within, NOT met when its lower end is above, else "
        f"undecided; the whole run's verdict: {bench.METHOD}. The direct figure, the instruments' own calls timed "
        "around near-empty steps, is a diagnostic: it must lie inside the per-step cost's interval (an interval wider "
        f"than {CHECKABLE_WIDTH:.0%} checks nothing); outside it on either side the check fails."
    )


def main(argv=None) -> None:
    """The step clock's child: `--clock <file> <script or -m module> [args]` (the program's own flags left to it)."""
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] in (["-h"], ["--help"]):
        return print(__doc__)
    if len(argv) < 3 or argv[0] != "--clock":
        raise SystemExit("usage: python -m trainscope.experiments.benchmarks.whole_run --clock FILE SCRIPT [ARGS]")
    clocked(argv[1], argv[2:])


if __name__ == "__main__":
    main()
