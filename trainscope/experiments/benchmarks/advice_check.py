"""The advisor's estimates (trainscope.advice.estimates) against what the change then measures, on five loops:
train.py's default, examples/causal_lm.py, examples/plain_loop.py, a CNN (tests/public_loops/mnist.py) and a LoRA
model (tests/public_loops/peft_lora.py). Each loop's top estimates are applied against the loop as it was in
alternating pairs: steady samples/s, the median ratio and its interval beside the estimate.

    python -m trainscope.experiments.benchmarks.advice_check [--pairs 5] [--loops train,causal_lm] [--changes 1]

Writes benchmarks/advice_check.{json,md}.
How it works: docs/tune.md#estimates-against-what-the-change-measures-make-bench-advice."""

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from trainscope.advice import estimates
from trainscope.core.paths import ROOT
from trainscope.core.record_view import RunView
from trainscope.core.records import read_record
from trainscope.experiments.benchmarks import short_run
from trainscope.measure import bench
from trainscope.report.document import Bullets, Heading, Paragraph, markdown
from trainscope.report.tables import Table
from trainscope.run import overrides

OUT = ROOT / "benchmarks" / "advice_check"
QUIET_LOAD = 1.2  # the 1-minute load average under which the machine counts as quiet (2 cores: one spare)


@dataclass
class Loop:
    """A loop as its script runs it: the command for a run named `name` into `out` with a doubled batch or not, the
    folder its record lands in, and how the threads change reaches it (None: the loop sets its own)."""

    name: str
    what: str
    command: object  # (out: Path, name: str, batch_factor: int) -> list[str]
    folder: object  # (name: str) -> str
    threads_by: str | None = "env"  # "env": OMP_NUM_THREADS; "flag": train.py's --threads; None: not applicable
    notes: list = field(default_factory=list)


PY = sys.executable


def _public_loop(module: str, args: list[str], batch: int):
    """One of tests/public_loops as a script: its main() in a fresh interpreter, its truth files in the scratch."""

    def command(out: Path, name: str, factor: int) -> list[str]:
        argv = ["--output-dir", str(out), "--truth", str(out / f"{name}.truth"), *args, "--batch-size",
                str(batch * factor)]  # fmt: skip
        return [PY, "-c", f"import sys; sys.path.insert(0, 'tests'); from public_loops import {module}; "
                f"{module}.main({argv!r})"]  # fmt: skip

    return command


# fmt: off
LOOPS = {
    "train": Loop(
        "train", "train.py's default (MiniLM-L6 on the embedded tweets; 800 samples, 14 steps)",
        lambda out, name, factor: [PY, "train.py", *short_run(samples=800, steps=14, warmup=2, log_every=7),
                                   "--per-device-batch-size", str(32 * factor), "--output-dir", str(out), "--run-name",
                                   name, "--overwrite"],
        lambda name: name, threads_by="flag",
    ),
    "causal_lm": Loop(
        "causal_lm", "examples/causal_lm.py (the embedded tiny GPT-2, 24 steps of 8 x 128 tokens)",
        lambda out, name, factor: [PY, "examples/causal_lm.py", "--steps", "24", "--batch-size", str(8 * factor),
                                   "--output-dir", str(out), "--run-name", name, "--overwrite"],
        lambda name: name, threads_by=None,  # threads="auto": the loop sets its share of the cores itself
    ),
    "plain": Loop(
        "plain", "examples/plain_loop.py (an MLP on synthetic data, 5000 steps of 64)",
        lambda out, name, factor: [PY, "examples/plain_loop.py", "--steps", "5000", "--batch-size", str(64 * factor),
                                   "--log-every", "500", "--output-dir", str(out), "--run-name", name],
        lambda name: name,
    ),
    "cnn": Loop(
        "cnn",
        "pytorch/examples' mnist CNN (tests/public_loops/mnist.py: 9600 random images, 2 epochs of batches of 32)",
        _public_loop("mnist", ["--rows", "9600", "--epochs", "2"], 32),
        lambda name: "mnist",
    ),
    "lora": Loop(
        "lora",
        "PEFT's LoRA causal LM (tests/public_loops/peft_lora.py: a tiny Llama, 2000 rows of 128 tokens, batches of 2)",
        _public_loop("peft_lora", ["--rows", "2000", "--lengths", "128"], 2),
        lambda name: "peft_lora",
    ),
}
# fmt: on


@dataclass(frozen=True)
class Change:
    """A change the estimates name: its label, the estimate's name in the record, how a run applies it."""

    label: str
    precision: str | None = None
    threads: int | None = None
    batch_factor: int = 1


def candidates(view: RunView) -> list[tuple[Change, estimates.Estimate]]:
    """Every change the record estimates (precision, thread counts, twice the batch), its estimate beside it, the
    largest first; an estimate the record cannot give is kept with its reason (never tried)."""
    found = [
        (Change(f"{target} autocast", precision=target), estimates.guarded(estimates.precision, view, target))
        for target in estimates.precisions(view)
        if target in ("bf16", "fp16")
    ]
    found += [
        (Change(f"{count} thread(s)", threads=count), estimates.guarded(estimates.threads, view, count))
        for count in estimates.thread_counts(view)
    ]
    found.append((Change("twice the batch", batch_factor=2), estimates.guarded(estimates.batch, view)))
    return sorted(found, key=lambda pair: -(pair[1].gain or 0.0))


def applicable(loop: Loop, change: Change) -> str | None:
    """Why `loop` cannot take `change`, or None."""
    if change.threads is not None and loop.threads_by is None:
        return "the loop sets its own threads (trainscope.Run(threads='auto'))"
    return None


def run_once(loop: Loop, change: Change | None, out: Path, name: str, cache: Path, time_model=False) -> dict:
    """One run of `loop` (with `change` applied) in a fresh interpreter; its record's steady figures."""
    change = change or Change("as it is")
    # this checkout's trainscope first, whatever the environment's path file points at
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    env = {**os.environ, "TRAINSCOPE_CACHE_DIR": str(cache), "PYTHONUNBUFFERED": "1", "PYTHONPATH": path}
    env.pop("ACCELERATE_MIXED_PRECISION", None)
    if time_model:  # the advice run: its estimates read the model timed alone after the loop
        env[overrides.TIME_MODEL] = "1"
    if change.precision:
        env["ACCELERATE_MIXED_PRECISION"] = change.precision  # as `accelerate launch --mixed_precision` sets it
    command = loop.command(out, name, change.batch_factor)
    if change.threads is not None:
        if loop.threads_by == "flag":
            command += ["--threads", str(change.threads)]
        else:
            env["OMP_NUM_THREADS"] = str(change.threads)
    shutil.rmtree(out / loop.folder(name), ignore_errors=True)
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"error: {loop.name} ({change.label}) failed: {done.stderr.strip().splitlines()[-1:]}")
    record = read_record(out / loop.folder(name))
    view = RunView(record)
    return {
        "samples_per_s": view.samples_per_s,
        "precision": view.precision,
        "threads": view.torch_threads,
        "micro_batch_samples": view.micro_batch_samples,
        "record": record,
    }


def check_loop(loop: Loop, pairs: int, changes: int, scratch: Path, log) -> dict:
    """The advice run, its estimates, then each of the top `changes` applicable changes against the loop as it was
    in `pairs` alternating pairs."""
    cache = scratch / "cache"  # this benchmark's own: the advice run's model timing happens now, on this machine
    advice = run_once(loop, None, scratch, f"{loop.name}-advice", cache, time_model=True)
    view = RunView(advice["record"])  # kept in the results: its estimates can be made again from it
    ranked = candidates(view)
    shown = [{"change": c.label, **_estimate_dict(e), "not_applied": applicable(loop, c)} for c, e in ranked]
    tried = [(c, e) for c, e in ranked if e.gain is not None and applicable(loop, c) is None][:changes]
    results = []
    for change, estimate in tried:
        arms = {
            "as it is": lambda index: _figures(run_once(loop, None, scratch, f"{loop.name}-base", cache)),
            change.label: lambda index, change=change: _figures(
                run_once(loop, change, scratch, f"{loop.name}-changed", cache)
            ),
        }
        rounds = bench.alternate(arms, pairs, log=lambda line: log(f"{loop.name}: {line}"))
        comparison = bench.compare_rounds(rounds, change.label, "as it is", "samples_per_s")
        results.append(
            {
                "change": change.label,
                **_estimate_dict(estimate),
                "measured": comparison,
                "measured_interval": bench.median_interval(comparison["ratios"]),
                "inside": estimate.low <= comparison["median_ratio"] <= estimate.high,
                "rounds": rounds,
            }
        )
    return {"loop": loop.name, "what": loop.what, "advice_run": advice, "estimates": shown, "checked": results}


def _figures(result: dict) -> dict:
    result.pop("record", None)
    return result


def _estimate_dict(estimate: estimates.Estimate) -> dict:
    return {
        "estimate": estimate.gain,
        "low": estimate.low,
        "high": estimate.high,
        "assumes": estimate.assumes,
        "evidence": estimate.evidence,
        "unavailable": estimate.unavailable,
    }


def load_words(load: float | None) -> str:
    return "unknown" if load is None else f"{load:.2f}"


def load_average() -> float | None:
    try:
        return os.getloadavg()[0]
    except OSError:
        return None


def wait_for_quiet(seconds: float, log) -> dict:
    """Wait up to `seconds` for a minute's load average under QUIET_LOAD; what was seen either way."""
    started = time.monotonic()
    while True:
        load = load_average()
        if load is None or load < QUIET_LOAD:
            return {"load_before": load, "quiet": load is not None, "waited_s": time.monotonic() - started}
        if time.monotonic() - started > seconds:
            log(f"the machine did not get quiet (load {load:.2f} after {seconds:.0f} s): measuring anyway")
            return {"load_before": load, "quiet": False, "waited_s": time.monotonic() - started}
        time.sleep(15)


def table(results: list[dict]) -> Table:
    rows = []
    for loop in results:
        for checked in loop["checked"]:
            measured, interval = checked["measured"], checked["measured_interval"]
            rows.append(
                [
                    loop["loop"],
                    checked["change"],
                    f"{checked['estimate']:.2f}",
                    f"{checked['low']:.2f}-{checked['high']:.2f}",
                    f"{measured['median_ratio']:.2f} ({interval['low']:.2f}-{interval['high']:.2f})",
                    measured["verdict"],
                    "yes" if checked["inside"] else "no",
                ]
            )
    return Table(
        "The advisor's estimates against what the change measured (steady samples/s, changed over as it is)",
        ["loop", "change", "estimate", "interval", "measured: median pair ratio (its interval)", "verdict", "inside"],
        rows,
        "advice_check",
        "llrrrll",
    )


def page(report: dict) -> list:
    results, conditions = report["loops"], report["conditions"]
    inside = sum(1 for loop in results if loop["checked"] and loop["checked"][0]["inside"])

    def said(shown: dict) -> str:
        found = (
            f"{shown['estimate']:.2f} ({shown['low']:.2f}-{shown['high']:.2f})"
            if shown["estimate"] is not None
            else f"unavailable: {shown['unavailable']}"
        )
        return f"{shown['change']}: {found}" + (
            f"; not applied: {shown['not_applied']}" if shown["not_applied"] else ""
        )

    every = [block for loop in results for block in (
        Paragraph(f"{loop['loop']} ({loop['what']}):"), Bullets([said(shown) for shown in loop["estimates"]]))]  # fmt: skip
    return [
        Heading("The advisor's estimates against what the change measures (make bench-advice)"),
        Paragraph(
            f"Machine: {report['machine']}; 1-minute load average before: {load_words(conditions['load_before'])} "
            f"({'quiet' if conditions['quiet'] else 'not quiet'}: under {QUIET_LOAD} counts as quiet), at the end "
            f"{load_words(conditions['load_after'])} (this benchmark's own runs keep both cores busy). "
            f"{report['pairs']} alternating pairs per change; the measured ratio is the median of the pairs' changed / "
            "as-it-is steady samples/s, its interval the distribution-free one of the median (with 5 pairs: their "
            "min-max, 93.75%)."
        ),
        table(results),
        Paragraph(f"Inside the estimate's interval: {inside} of {len(results)} loops (on each loop's top estimate)."),
        Paragraph("Every estimate, each loop's advice run (the tried ones first):"),
        *every,
        Paragraph("Misses and their cause:" if report.get("misses") else ""),
        Bullets(report.get("misses") or []),
    ]


def main(argv=None) -> None:
    parser = bench.driver_parser(__doc__, OUT, "--child")
    parser.add_argument("--loops", default=",".join(LOOPS), help=f"comma-separated, of {', '.join(LOOPS)}")
    parser.add_argument("--changes", type=int, default=1, help="top estimates tried per loop (default 1)")
    parser.add_argument("--wait-quiet", type=float, default=120.0, help="seconds to wait for a quiet machine")
    parser.add_argument("--misses", default=None, help="a JSON file of {loop: cause} naming the misses' causes")
    args = parser.parse_args(argv)
    names = [n for n in args.loops.split(",") if n]
    unknown = [n for n in names if n not in LOOPS]
    if unknown:
        parser.error(f"unknown loop(s) {unknown}: choose from {', '.join(LOOPS)}")
    conditions = wait_for_quiet(args.wait_quiet, print)
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="advice-check-") as scratch:
        results = [check_loop(LOOPS[n], args.pairs, args.changes, Path(scratch), print) for n in names]
    conditions.update(load_after=load_average(), seconds=time.monotonic() - started)
    misses = json.loads(Path(args.misses).read_text()) if args.misses else {}
    report = {
        "machine": machine_words(),
        "pairs": args.pairs,
        "conditions": conditions,
        "loops": results,
        "misses": [f"{loop}: {cause}" for loop, cause in misses.items()],
        "method": f"{bench.METHOD}; inside: the median pair ratio within the estimate's interval",
    }
    bench.publish(Path(args.out), report, markdown(page(report)))


def machine_words() -> str:
    from trainscope.core import environment, precision  # deferred: the CPU's flags read /proc

    flags = sorted(precision.cpu_flags() & {"avx512_bf16", "amx_bf16", "avx512_fp16"})
    cores = environment.usable_cores()
    return f"{environment.cpu_model_name()}, {cores} usable cores, bf16 flags: {', '.join(flags) or 'none'}"


if __name__ == "__main__":
    main()
