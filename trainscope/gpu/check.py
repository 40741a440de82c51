"""make gpu-check: what only a GPU can show, checked on the GPUs present, within a time budget.

How it works: docs/gpu.md#in-the-code-how-make-gpu-check-runs-trainscopegpucheckpy.
"""

import argparse
import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

from trainscope.core import launching, provenance
from trainscope.core.errors import UserError, exit_with
from trainscope.core.paths import ROOT
from trainscope.core.precision import planted_overflow_run
from trainscope.core.record_view import RunView
from trainscope.core.records import RECORD_FILE, STEPS_FILE, read_record, read_steps, write_text_atomic
from trainscope.gpu import estimates
from trainscope.gpu.driver import cuda_torch_command, driver_version, nvidia_smi, torch_check
from trainscope.gpu.goals import verdicts
from trainscope.gpu.plan import plan
from trainscope.gpu.results import markdown, outcome, unmet
from trainscope.measure import bench


def device_slug(name: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


SCALER_PLANTED = (3, 7, 11)


def scaler_check() -> dict:
    """fp16 on CUDA: a real GradScaler, the fused AdamW and planted inf gradients; the skips counted. Run by
    `--scaler-check` in a process of its own (the plan's `scaler` check)."""

    planted = set(SCALER_PLANTED)
    try:
        skips, _ = planted_overflow_run(torch.device("cuda"), planted)
    except Exception as error:  # a broken CUDA path is a finding, not a reason to lose the other checks
        return {"planted": len(planted), "counted": None, "ok": False, "error": " ".join(str(error).split())}
    return {"planted": len(planted), "counted": skips.total(), "ok": skips.total() == len(planted)}


# ---------------------------------------------------------------- running the plan

OUTPUT_TAIL_CHARS = 4000


def check_env() -> dict:
    """Every check's environment: a training's, with faulthandler on (a crash prints the Python stack)."""
    return launching.training_env(extra={"PYTHONFAULTHANDLER": "1"})


def output_tail(result: subprocess.CompletedProcess) -> str:
    """The end of a failed check's output: stderr's (the traceback, or faulthandler's stack) after stdout's."""
    text = "\n".join(part.strip() for part in (result.stdout or "", result.stderr or "") if part and part.strip())
    return text[-OUTPUT_TAIL_CHARS:]


def keep_records(source: Path, kept: Path | None) -> list[str]:
    """Copy every run record (record.json, steps.jsonl) under `source` to `kept`, keeping the folders below source."""
    if kept is None or not source.exists():
        return []
    copied = []
    for path in sorted([*source.rglob(RECORD_FILE), *source.rglob(STEPS_FILE)]):
        target = kept / path.relative_to(source)
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(path, target)
        copied.append(str(target))
    return copied


def run_step(step: dict, scratch: Path, timeout: float | None = None, kept: Path | None = None) -> dict:
    """One check, launched with `timeout` (its process tree is killed past it): its exit and figures; the records of
    its runs copied under `kept`/<check>, and on a failure the tail of its output."""
    base = {"name": step["name"], "estimate_s": step.get("estimate_s"), "timeout_s": timeout}
    if step.get("shared_gpu"):
        base["shared_gpu"] = True
    if step.get("skipped"):
        return {**base, "seconds": 0.0, "skipped": step["skipped"]}
    started = time.monotonic()
    out = scratch / step["name"]
    env = {**check_env(), **(step.get("env") or {})}
    if "command" in step:
        result = launching.run_captured([part.replace("{out}", str(out)) for part in step["command"]], env, timeout)
        figures = {"exit": result.returncode}
        for path in out.glob("*.json") if out.exists() else []:  # results, not the records of the runs under it
            figures[path.stem] = json.loads(path.read_text())
    else:
        result = launching.run_training(
            [*step["args"], "--output-dir", str(out), "--run-name", step["name"]],
            step["config"],
            env=env,
            echo=False,
            timeout=timeout,
        )
        figures = {"exit": result.returncode}
        if result.returncode == 0:
            figures.update(run_figures(out / step["name"]))
    if result.returncode != 0:
        figures.update(error=launching.failure_reason(result), output_tail=output_tail(result))
    figures["records"] = keep_records(out, kept / step["name"] if kept else None)
    return {**base, "seconds": time.monotonic() - started, **figures}


def run_figures(run_dir: Path) -> dict:
    """What the results keep of one run: its summary's figures, what its goals read (the record's status, world
    size, distributed type, backend and device, its logged losses, its trace, FSDP2's sharding) and its prediction's
    notes."""
    view = RunView(read_record(run_dir))
    profile = view.profile or {}
    return dict(
        status=view.status,
        world_size=view.world_size,
        distributed_type=view.env.get("distributed_type"),
        backend=view.backend,
        device=view.device,
        losses=[[line["step"], line["loss"]] for line in read_steps(run_dir, []) if line.get("loss") is not None],
        profile={
            "directory": profile.get("directory"),
            "window": profile.get("window"),
            "communication_calls": ((profile.get("breakdown") or {}).get("calls") or {}).get("communication"),
        }
        if profile
        else None,
        throughput=view.throughput,
        mfu=view.mfu,
        memory=view.memory,
        compile=view.compile,
        timing=view.summary.get("timing"),
        memory_snapshot=view.summary.get("memory_snapshot"),
        communication=view.communication,
        fsdp=view.summary.get("fsdp"),  # each rank's sharded modules, parameters and collectives
        end_state=view.summary.get("end_state"),  # each rank's parameters' checksum and loss scaler after training
        fsdp_wrap=(view.record.get("model") or {}).get("fsdp_wrap"),
        precision=view.precision,
        warnings=view.warnings,
        measured_peak=view.summary.get("measured_peak"),
        prediction_notes=(view.record.get("prediction") or {}).get("notes"),
    )


def process_age_s() -> float:
    """Seconds since this process started (/proc's start time against the uptime); 0 where they cannot be read."""
    try:
        started = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])  # field 22, after the name
        uptime = float(Path("/proc/uptime").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 0.0
    return max(0.0, uptime - started / os.sysconf("SC_CLK_TCK"))


class Interrupted(Exception):
    """SIGINT or SIGTERM while the checks ran."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


@contextlib.contextmanager
def stop_on_signals():
    """SIGINT and SIGTERM raise Interrupted in the main thread (run_captured then kills the running launch)."""

    def interrupt(signum, frame):
        raise Interrupted(signum)

    previous = {signum: signal.signal(signum, interrupt) for signum in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def not_started(step: dict, expected: float, left: float, budget_s: float) -> dict | None:
    """The result of a check that does not start: skipped by the plan, or its `expected` seconds over the `left`
    seconds of the budget; None for one that starts."""
    if step.get("skipped"):
        reason = step["skipped"]
    elif expected > left:
        reason = f"over the budget (estimated {expected:.0f} s, {max(left, 0):.0f} s of the {budget_s:.0f} s left)"
    else:
        return None
    return {"name": step["name"], "estimate_s": step["estimate_s"], "seconds": 0.0, "skipped": reason}


def run_within(step: dict, left: float, runner: Callable[[dict, float], dict]) -> dict:
    """One check run for min(its timeout, the `left` seconds of the budget): a timeout the budget brought forward
    is said (`budget_cut`), not counted as the check's failure."""
    result = runner(step, min(step["timeout_s"], left))
    if left < step["timeout_s"] and result.get("exit", 0) != 0 and "timed out" in str(result.get("error")):
        result["budget_cut"] = (
            f"stopped where the budget ended ({left:.0f} s were left of its {step['timeout_s']:.0f} s timeout)"
        )
    return result


def execute(
    steps: list[dict],
    report: dict,
    write: Callable[[dict], None],
    budget_s: float,
    runner: Callable[[dict, float], dict],
    clock: Callable[[], float] = time.monotonic,
    started: float | None = None,
) -> dict:
    """Run the checks in order within `budget_s` seconds from `started`, calling `write(report)` after each;
    `runner(step, timeout)` returns a check's result. How the budget is spent and an interruption kept:
    docs/gpu.md#in-the-code-how-make-gpu-check-runs-trainscopegpucheckpy."""
    started = clock() if started is None else started
    report.update(status="running", budget_s=budget_s, checks=[], not_run=[step["name"] for step in steps])
    current, paid = None, set()
    try:
        with stop_on_signals():
            write(report)
            for index, step in enumerate(steps):
                current = step["name"]
                left = budget_s - (clock() - started)
                estimates.first_costs(steps[index:], paid)
                expected = estimates.scaled(step["estimate_s"], report["checks"])
                result = not_started(step, expected, left, budget_s) or run_within(step, left, runner)
                if not result.get("skipped"):
                    paid |= set(estimates.cold_costs(step))
                    result.update(estimate_s=step["estimate_s"], expected_s=expected)
                report["checks"].append(result)
                report["not_run"].remove(step["name"])
                report["seconds"] = clock() - started
                write(report)
    except Interrupted as stop:
        report.update(
            status="interrupted", interrupted={"signal": str(stop), "during": current}, seconds=clock() - started
        )
        write(report)
        raise
    report.update(status="complete", seconds=clock() - started)
    write(report)
    return report


def shown_command(step: dict) -> str:
    """The check's command as it runs: its environment's own variables first (a shared GPU's backend)."""
    command = step.get("command") or launching.train_command(step["args"], step["config"])
    return " ".join([*(f"{name}={value}" for name, value in (step.get("env") or {}).items()), *command])


def print_plan(
    steps: list[dict], gpus: int, budget_s: float, only: list[str] | None = None, run: list[dict] | None = None
) -> None:
    """Every check with its command, estimate and timeout; the total; each part with its estimate, its default budget
    and the session it takes; the checks of `run` (those a run would run: default all) over `budget_s`."""
    for step in steps:
        command = shown_command(step)
        if step.get("skipped"):
            print(f"{step['name']}: skipped ({step['skipped']})")
        else:
            print(
                f"{step['name']} (estimate {step['estimate_s']:.0f} s: {step['estimate']}; timeout "
                f"{step['timeout_s']:.0f} s): {command}"
            )
        print(f"    confirms: {step['confirms']}")
    cut, run = estimates.parts(steps), steps if run is None else run
    total = estimates.planned_seconds(steps)
    print(
        f"total estimated for {gpus} GPU{'s' if gpus > 1 else ''}: {total:.0f} s ({total / 60:.1f} min) in "
        f"{len(cut)} part{'s' if len(cut) > 1 else ''}; estimates from the launch and step times measured on one H200 "
        "and assumed ones (MEASURED_* and ASSUMED_* in trainscope/gpu/estimates.py)"
    )
    overhead, limit = estimates.session_overhead_s(), estimates.part_limit_s()
    print(
        f"each part one command, its default budget its estimate and {estimates.MARGIN - 1:.0%}, at most "
        f"{limit:.0f} s: a command's {estimates.COMMAND_S:.0f} s less its set-up ({estimates.ASSUMED_COMMAND_SETUP_S:.0f}"
        f" s, assumed), a session's {estimates.SESSION_S:.0f} s less the machine's start, make setup and the transfers "
        f"({overhead:.0f} s, assumed):"
    )
    for part in cut:
        number, names = part[0].get("part", 1), [step["name"] for step in part if not step.get("skipped")]
        command = f"--only {' '.join(names)}" if only else f"--part {number}"  # --only takes no --part
        budget = estimates.default_budget(part)
        print(
            f"  part {number}: estimate {estimates.planned_seconds(part):.0f} s, budget {budget:.0f} s, a session of "
            f"{budget + overhead:.0f} s ({', '.join(names)}): python -m trainscope.gpu.check {command}"
        )
    left, over = budget_s, []
    for step in run:
        if step.get("skipped"):
            continue
        if step["estimate_s"] > left:
            over.append(step["name"])
        else:
            left -= step["estimate_s"]
    if over:
        print(f"over a budget of {budget_s:.0f} s by these estimates (skipped when run): {', '.join(over)}")


def parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--out", default=str(ROOT / "benchmarks" / "gpu"), help="results folder (default benchmarks/gpu)"
    )
    parser.add_argument(
        "--budget",
        type=float,
        default=None,
        help=f"seconds for the checks it runs (default: their estimate and {estimates.MARGIN - 1:.0%}%); a check "
        "whose estimate does not fit in what is left is skipped, and no launch runs past it",
    )
    parser.add_argument(
        "--part",
        type=int,
        default=None,
        help=f"run part K of the plan, cut into parts of one command each, at most {estimates.part_limit_s():.0f} s "
        "(the dry run lists them; default: the whole plan where it is one part, else part 1); results in "
        "<device>.partK.*",
    )
    parser.add_argument(
        "--dry-run",
        action="store_true",
        help="print the checks, their commands, estimates and timeouts, the total and the parts; run nothing",
    )
    parser.add_argument(
        "--gpus",
        type=int,
        default=None,
        help="with --dry-run: plan for this many GPUs (default: the GPUs present, or one)",
    )
    parser.add_argument(
        "--only",
        nargs="+",
        default=None,
        metavar="NAME",
        help="run only these checks of the plan, those the one-GPU plan leaves out to fit one session included; "
        "results in <device>.only.*",
    )
    parser.add_argument(
        "--rewrite",
        default=None,
        metavar="JSON",
        help="write a results file's Markdown again from its JSON by this code (the goals and wording of today, "
        "judged on the figures it holds; the JSON is left as it is); runs nothing",
    )
    parser.add_argument("--torch-check", action="store_true", help=argparse.SUPPRESS)  # make setup's check
    parser.add_argument("--scaler-check", action="store_true", help=argparse.SUPPRESS)  # the scaler check's process
    return parser


def select_part(steps: list[dict], part: int | None) -> tuple[list[dict], int | None]:
    """The checks a run runs, and their part: the one asked for; without one, the whole plan where it is one part,
    else its first part (no command may run past estimates.PART_LIMIT_S: the plan splits itself)."""
    cut = estimates.parts(steps)
    if part is None:
        return (steps, None) if len(cut) == 1 else (cut[0], 1)
    if not 1 <= part <= len(cut):
        raise UserError(f"--part {part}: the plan has {len(cut)} part(s) on this machine (--dry-run lists them)")
    return cut[part - 1], part


def write_scaler_check(out: Path) -> None:
    """The scaler check, in the process the plan launched for it: its result to out/scaler.json and stdout."""
    found = scaler_check()
    out.mkdir(parents=True, exist_ok=True)
    (out / "scaler.json").write_text(json.dumps(found))
    print(json.dumps(found))


def dry_run(gpus_asked: int | None, part: int | None, budget: float | None, only: list[str] | None = None) -> None:
    """The plan for `gpus_asked` GPUs (default: those present, or one), printed; nothing run."""
    gpus = gpus_asked or launching.cuda_devices() or 1
    if gpus_asked is None and not launching.cuda_devices():
        print("no CUDA device here: planned as for one GPU (--gpus N plans for N)")
    try:
        steps = plan(gpus, only)
        selected, _ = select_part(steps, part)
    except UserError as error:
        exit_with(error, code=2)
    print_plan(steps if part is None else selected, gpus, budget or estimates.default_budget(selected), only, selected)


REWRITTEN = (
    "This file was written again from {json} by `python -m trainscope.gpu.check --rewrite` (the report code of a "
    "later commit): its goals, verdicts and wording are that code's, judged on the figures the run recorded, which "
    "are as measured; the run's own verdicts are in the JSON."
)


def rewrite(json_path: Path) -> Path:
    """A results file's Markdown written again from its JSON (left as it is) by this module's report code."""
    report = json.loads(Path(json_path).read_text())
    lines = markdown(report, note=REWRITTEN.format(json=Path(json_path).name))
    text = "\n".join([*lines, "", *provenance.markdown(report["provenance"])]) + "\n"
    target = Path(json_path).with_suffix(".md")
    write_text_atomic(target, text)
    return target


def new_report(name: str, gpus: int, part: int | None, steps: list[dict]) -> dict:
    """The results file before any check: the device, the driver, this torch and its CUDA, the plan and what its
    estimates rest on."""
    return {
        "benchmark": "gpu_check",
        "benchmark_version": 5,  # 5: goals named by each check, estimates charged and scaled as checks run
        "budget_from": "the command's start",
        "device": name,
        "driver": driver_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "gpus": gpus,
        "part": part,
        "plan": steps,
        "estimates": {
            "measured_launch_s": estimates.MEASURED_LAUNCH_S,
            "measured_process_group_s": estimates.MEASURED_PROCESS_GROUP_S,
            "measured_step_s": estimates.MEASURED_STEP_S,
            "measured_shared_step_s": estimates.MEASURED_SHARED_STEP_S,
            "measured_compile_s": estimates.MEASURED_COMPILE_S,
            "assumed_step_s": estimates.ASSUMED_STEP_S,
            "assumed_session_overhead_s": estimates.session_overhead_s(),
            "planned_s": estimates.planned_seconds(steps),
        },
    }


def run_checks(steps: list[dict], report: dict, budget: float, stem: Path, started: float) -> None:
    """Run the plan's checks into `report`, written to stem.{json,md} after each and each outcome printed; one
    `error:` line (and a non-zero exit) for an interruption or a failed check."""
    kept = stem.with_name(stem.name + ".runs")
    shown = []

    def write(current: dict) -> None:
        by_name = {c["name"]: c for c in current["checks"]}
        current["verdicts"] = verdicts(by_name)
        current["scaler"] = (by_name.get("scaler") or {}).get("scaler")
        # write_results replaces the stem's suffix: <device>.part1 would write <device>.json over the whole plan's
        bench.write_results(stem.with_name(stem.name + ".json"), current, markdown(current))
        for check in current["checks"][len(shown) :]:  # what finished since the last write, as the file says it
            print(f"  {check['name']}: {outcome(check)} ({check['seconds']:.0f} s)", flush=True)
            shown.append(check["name"])

    with tempfile.TemporaryDirectory() as scratch:

        def runner(step: dict, timeout: float) -> dict:
            print(f"{step['name']} (estimate {step['estimate_s']:.0f} s, timeout {timeout:.0f} s)", flush=True)
            return run_step(step, Path(scratch), timeout, kept)

        try:
            execute(steps, report, write, budget, runner, started=started)
        except Interrupted as stop:
            done = len([c for c in report["checks"] if not c.get("skipped")])
            exit_with(
                UserError(
                    f"{stop} during {report['interrupted']['during']}, which was stopped (its launch "
                    f"killed); the {done} checks that finished are in {stem}.json and .md"
                ),
                code=128 + stop.signum,
            )
    failed = [
        c["name"]
        for c in report["checks"]
        if not c.get("skipped") and not c.get("budget_cut") and c.get("exit", 0) != 0
    ]
    if report.get("scaler") is not None and not report["scaler"].get("ok") and "scaler" not in failed:
        failed.append("scaler")
    missed = [name for name in unmet(report) if name not in failed]
    print(f"wrote {stem}.json and {stem}.md")
    if failed or missed:
        said = ([f"{', '.join(failed)} failed"] if failed else []) + (
            [f"{', '.join(missed)} did not meet {'its' if len(missed) == 1 else 'their'} goals"] if missed else []
        )
        exit_with(UserError(f"{'; '.join(said)}: see {stem}.md"), code=1)


def main(argv=None, started: float | None = None) -> None:
    """The command line; `started`: the time.monotonic() the budget counts from (the command's start; default now)."""
    args = parser().parse_args(argv)
    if args.budget is not None and args.budget <= 0:
        parser().error("--budget must be positive")
    if args.gpus is not None and (not args.dry_run or args.gpus < 1):
        parser().error(
            "--gpus plans for that many GPUs (at least 1) with --dry-run; a real check uses the GPUs present"
        )
    if args.torch_check:
        return torch_check()
    if args.scaler_check:
        return write_scaler_check(Path(args.out))
    if args.rewrite:
        return print(f"wrote {rewrite(Path(args.rewrite))}")
    if args.only and args.part:
        parser().error("--only runs the checks it names: no --part with it")
    if args.dry_run:
        return dry_run(args.gpus, args.part, args.budget, args.only)
    started = time.monotonic() if started is None else started
    if not torch.cuda.is_available():
        missing = cuda_torch_command(nvidia_smi())
        if missing:
            exit_with(UserError(missing), code=1)
        print(
            f"gpu-check: no usable CUDA device for this torch ({torch.__version__}): nothing measured, nothing written"
        )
        return
    # the device's name and count without a CUDA context in this process (the properties need none)
    name, gpus = torch.cuda.get_device_name(0), launching.cuda_devices()
    try:
        planned = plan(gpus, args.only)
        steps, part = select_part(planned, args.part)
    except UserError as error:
        exit_with(error, code=2)
    budget = args.budget or estimates.default_budget(steps)
    suffix = ".only" if args.only else f".part{part}" if part else ""
    stem = Path(args.out) / (device_slug(name) + suffix)
    cut = estimates.parts(planned)
    if args.part is None and len(cut) > 1:
        rest = [[step["name"] for step in later if not step.get("skipped")] for later in cut[1:]]
        commands = [f"--only {' '.join(names)}" if args.only else f"--part {k}" for k, names in enumerate(rest, 2)]
        print(f"gpu-check: the plan is {len(cut)} parts, one command each: part 1 now; then, each in a session of "
              f"its own: {'; '.join(f'python -m trainscope.gpu.check {c}' for c in commands)}")  # fmt: skip
    print(
        f"gpu-check: {len(steps)} checks on {gpus} x {name}, budget {budget:.0f} s; results after every check "
        f"in {stem}.md",
        flush=True,
    )
    run_checks(steps, new_report(name, gpus, part, steps), budget, stem, started)


if __name__ == "__main__":
    main(started=time.monotonic() - process_age_s())  # the budget is the command's: its start and imports count
