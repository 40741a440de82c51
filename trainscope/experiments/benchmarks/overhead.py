"""What stage timing costs: train.py's timed loop against a bare loop over the same steps.

Both launched by the README's command on one process, in alternating rounds; the bare loop is train.py's run less
its instruments, and both time the same steady window.

    python -m trainscope.experiments.benchmarks.overhead [--pairs 5] [--modes events sync memory-every-step] [train.py flags]

Writes benchmarks/timing_overhead.{json,md}.
How it works: docs/benchmarks.md#in-the-code-how-make-bench-overhead-compares-trainscopeexperimentsbenchmarksoverheadpy.
"""

import argparse
import dataclasses
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from trainscope.core import launching
from trainscope.core.paths import ROOT
from trainscope.core.record_view import RunView
from trainscope.core.records import read_record
from trainscope.measure import bench
from trainscope.measure.timing import synchronizer
from trainscope.report.tables import Table, num
from trainscope.workload.settings import parse_settings

# The embedded tiny model (2 layers, hidden 32): steps of a few milliseconds, the host-bound regime of a small model on a
# GPU, where the instruments' own host work is the largest share of a step it can be. One thread: that regime's host is
# one Python thread, and a pool of two on ops this small adds only its wake-ups, which spread samples/s in either arm
# (as measured: docs/benchmarks.md#committed-results).
DEFAULT_TRAIN_ARGS = [
    "--threads",
    "1",
    "--model",
    "embedded:tiny-bert",
    "--max-train-samples",
    "16000",
    "--per-device-batch-size",
    "16",
    "--max-seq-length",
    "64",
    "--max-steps",
    "1000",
    "--timing-warmup-steps",
    "20",
    "--max-eval-samples",
    "32",
    "--max-test-samples",
    "32",
    "--report-to",
    "none",
]
TARGETS = {"host": 0.03, "events": 0.01, "sync": 0.03, "memory-every-step": 0.01}
MEMORY_ARM = "memory-every-step"
ALONE = "instruments-alone"  # the direct measurement: trainscope.Run's calls around empty steps


BARE_REFUSES = {  # work train.py does inside its loop that a loop without trainscope has no part of
    "save_every": "--save-every (checkpoints inside the timed window)",
    "resume": "--resume (a continued run)",
    "predict": "--predict (nothing is trained)",
}


def bare_loop(argv: list[str]) -> None:
    """train.py's run without its instruments (see the module's docstring: what both arms share, what only train.py
    does): train.py's own start-up, set-up (trainscope.classifier.build_training) and step
    (trainscope.workload.step.train_step), unmeasured; prints the steady window's training samples/s, samples and
    optimizer steps as JSON."""
    from trainscope import classifier as task  # deferred: it loads transformers' models and datasets

    (settings,) = parse_settings(argv=argv)
    refused = [flag for name, flag in BARE_REFUSES.items() if getattr(settings, name)]
    if refused:
        raise SystemExit(f"error: the bare loop has no counterpart of {', '.join(refused)}: leave it out")
    with tempfile.TemporaryDirectory() as scratch:  # start() names a run folder; the bare loop writes none
        started = task.start(dataclasses.replace(settings, output_dir=scratch, run_name="bare", overwrite=False))
        settings = started.settings  # --max-seq-length clamped to the model's limit, as train.py's
        tokenizer = task.build_tokenizer(settings)
        data = task.load_classification_data(settings, tokenizer, started.state.main_process_first)
        training = task.build_training(settings, started, tokenizer, data)
        accelerator, model, plan = training.accelerator, training.model, training.plan
        if settings.timing_warmup_steps >= plan["optimizer_steps"]:
            raise SystemExit(
                f"error: --timing-warmup-steps {settings.timing_warmup_steps} leaves none of the "
                f"{plan['optimizer_steps']} optimizer steps to time"
            )
        metric = task.load_metric()
        synchronize = synchronizer(accelerator.device)

        def now() -> float:  # as train.py's phase boundaries: the device's work done, then the host clock
            if synchronize is not None:
                synchronize()
            return time.perf_counter()

        warmup, total = settings.timing_warmup_steps, plan["optimizer_steps"]
        step, samples, evaluation_s = 0, 0, 0.0
        window_started = now() if warmup == 0 else None

        def evaluate(loader) -> None:
            nonlocal evaluation_s
            began = now()
            task.evaluate_split(model, loader, accelerator, metric)
            if window_started is not None:  # train.py times it as `eval` and takes it out of the steady phase
                evaluation_s += now() - began

        model.train()
        for epoch in range(plan["epochs"]):
            training.train_loader.set_epoch(epoch)
            batches = iter(training.train_loader)
            while step < total:
                batch = next(batches, None)
                if batch is None:
                    break
                in_window = window_started is not None
                _, labels = task.train_step(
                    accelerator, model, batch, training.optimizer, training.scheduler, task.unmeasured,
                    settings.max_grad_norm,
                )  # fmt: skip
                if in_window:
                    samples += labels.shape[0]
                if accelerator.sync_gradients:
                    step += 1
                    if step == warmup:
                        window_started = now()
            evaluate(training.validation_loader)
            if step >= total:
                break
        evaluate(training.test_loader)
        wall = now() - window_started - evaluation_s
    print(
        json.dumps(
            {
                "samples_per_s": samples / wall,
                "threads": torch.get_num_threads(),
                "samples": samples,
                "optimizer_steps": total - warmup,
                "train_wall_s": wall,
            }
        )
    )


def instruments_alone(argv: list[str]) -> None:
    """The second instrument, direct: trainscope.Run's own time per optimizer step, its calls around steps that do
    next to nothing (batches of train.py's shape already in memory, a forward of a 5-weight model and an optimizer
    step with no gradients, so that its forward and step hooks run), over --max-steps steps with train.py's
    --log-every and --threads; prints microseconds per step as JSON. What train.py's instruments add to a step (with
    those two calls' microsecond: an upper bound), without taking the difference of two noisy totals."""
    import torch
    from accelerate import Accelerator

    from trainscope.instrument import Run  # deferred: it loads accelerate and torch's distributed modules

    (settings,) = parse_settings(argv=argv)
    if settings.threads.isdigit():
        torch.set_num_threads(int(settings.threads))
    accelerator = Accelerator()
    model = accelerator.prepare(torch.nn.Linear(4, 1))
    # torch's own SGD, not Accelerate's wrapper: AcceleratedOptimizer.step asks importlib for lomo_optim twice a call
    # (accelerate 1.15's is_lomo_available, uncached: about 160 us on machine B), which the bare loop pays as train.py
    # does; what is timed here is trainscope's own work (its step hook), not Accelerate's
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    steps, shape = settings.max_steps or 1000, (settings.per_device_batch_size, settings.max_seq_length)
    mask = torch.ones(shape, dtype=torch.long)
    mask[: shape[0] // 2, shape[1] // 2 :] = 0  # half the sequences padded, as a classifier's batches are
    batch = {"input_ids": torch.zeros(shape, dtype=torch.long), "attention_mask": mask}
    features = torch.zeros(1, 4)
    with tempfile.TemporaryDirectory() as scratch:
        run = Run(accelerator, model, optimizer, steps=steps, name="alone", output_dir=scratch, flops=0,
                  log_every=settings.log_every, threads="launcher")  # fmt: skip
        with run:
            began = time.perf_counter()
            for each in run.data([batch] * steps):
                with run.stage("forward"):
                    loss = model(features).sum()  # the forward pre-hook's call (a 5-weight model: about a microsecond)
                with run.stage("backward"):
                    pass
                with run.stage("optimizer"):
                    optimizer.step()  # the step hook's call, which ends the step (SGD without gradients: a no-op)
                run.count_micro_batch(each, loss)
            elapsed = time.perf_counter() - began
    print(json.dumps({"us_per_step": elapsed / steps * 1e6, "threads": torch.get_num_threads(), "steps": steps}))


def child_run(flag: str, what: str, train_args: list[str]) -> dict:
    """This module as a child by the README's launcher (`--bare`: the bare loop, `--alone`: the instruments alone);
    the JSON its last line prints."""
    command = [*launching.accelerate_launch(), "-m", "trainscope.experiments.benchmarks.overhead", flag, *train_args]
    result = launching.run_captured(command, launching.training_env())
    if result.returncode != 0:
        raise SystemExit(f"error: {what} failed: {launching.failure_reason(result)}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def alone_run(train_args: list[str]) -> dict:
    return child_run("--alone", "the instruments alone", train_args)


def bare_run(train_args: list[str]) -> dict:
    return child_run("--bare", "the bare loop", train_args)


def timed_run(train_args: list[str], output_dir: Path, name: str) -> dict:
    result = launching.run_training([*train_args, "--output-dir", str(output_dir), "--run-name", name], echo=False)
    if result.returncode != 0:
        raise SystemExit(f"error: train.py failed: {launching.failure_reason(result)}")
    view = RunView(read_record(output_dir / name))
    return {"samples_per_s": view.samples_per_s, "threads": view.torch_threads}


def measure(train_args: list[str], modes: list[str], pairs: int, scratch: Path, on_round=None) -> dict:
    """Alternating rounds of the arms; `on_round(figures)` after every round with the figures so far (so a time limit
    that kills the benchmark keeps the rounds that finished)."""
    on_gpu = torch.cuda.is_available()
    arms = {"bare": lambda i: bare_run(train_args)}
    if ALONE in modes:
        arms[ALONE] = lambda i: alone_run(train_args)
    clocks = [mode for mode in modes if mode not in (MEMORY_ARM, ALONE)] or ["events"]
    for mode in [mode for mode in modes if mode not in (MEMORY_ARM, ALONE)]:
        label = mode if on_gpu else "host"
        arms[label] = lambda i, mode=mode, label=label: timed_run(
            [*train_args, "--timing", mode], scratch, f"{label}-{i}"
        )
    if on_gpu and MEMORY_ARM in modes:
        arms[MEMORY_ARM] = lambda i: timed_run(
            [*train_args, "--timing", clocks[0], "--memory-every", "1"], scratch, f"memory-{i}"
        )
    rounds = []
    for index in range(pairs):
        rounds += bench.alternate(arms, 1, first_round=index)
        if on_round is not None and index + 1 < pairs:
            on_round({**figures(rounds, arms), "rounds_planned": pairs})
    return figures(rounds, arms)


# The paired rounds must resolve the overhead to this: their interval's upper end at most 5% (stated before
# measuring), else the verdict is "undecided" and more rounds are wanted.
RESOLUTION = 0.05


def overhead_interval(ratios: list[float]) -> dict:
    """The overhead (1 - the median of train.py / bare ratios) with its distribution-free interval (bench.median_interval
    over the rounds' ratios)."""
    interval = bench.median_interval(ratios)
    return {"low": 1 - interval["high"], "high": 1 - interval["low"], "confidence": interval["confidence"]}


def judged(overhead: dict, target: float) -> bool | None:
    """Met when the interval's upper end is at most the target, not met when its lower end is above it, else None."""
    if overhead["high"] <= target:
        return True
    if overhead["low"] > target:
        return False
    return None


def figures(rounds: list[dict], arms: dict) -> dict:
    """Every arm against the bare loop over the rounds so far: the median overhead, its interval and the verdict the
    interval supports; the direct figure, and whether the rounds' interval holds it."""
    results = {}
    for label in [a for a in arms if a not in ("bare", ALONE)]:
        comparison = bench.compare_rounds(rounds, label, "bare", "samples_per_s")
        interval = overhead_interval(comparison["ratios"])
        decided = comparison["pairs"] >= bench.MIN_PAIRS  # below it a median of ratios is no figure to judge
        results[label] = {
            **comparison,
            "overhead": 1 - comparison["median_ratio"],
            "overhead_interval": interval,
            "resolved": interval["high"] <= RESOLUTION,
            "target_overhead": TARGETS[label],
            "meets_target": judged(interval, TARGETS[label]) if decided else None,
            "samples_per_s": bench.spread([r[label]["samples_per_s"] for r in rounds]),
        }
    alone = [r[ALONE]["us_per_step"] for r in rounds if ALONE in r]
    direct = None
    if alone:
        bare_step_s = [r["bare"]["optimizer_steps"] / r["bare"]["train_wall_s"] for r in rounds]  # steps per second
        # the instruments' share of a bare step: their own time per step x the bare loop's steps per second
        overhead = statistics.median(alone) * 1e-6 * statistics.median(bare_step_s)
        target = TARGETS["host"] if not torch.cuda.is_available() else TARGETS["events"]
        # the check, stated before measuring: the paired rounds' interval holds the direct figure; an interval wider
        # than twice RESOLUTION cannot check it (undecided)
        first = next(iter(results.values()), None)
        interval = first["overhead_interval"] if first else None
        checkable = interval is not None and interval["high"] - interval["low"] <= 2 * RESOLUTION
        direct = {
            "us_per_step": bench.spread(alone),
            "overhead": overhead,
            "target_overhead": target,
            "meets_target": overhead <= target if len(alone) >= bench.MIN_PAIRS else None,
            "rounds_interval": interval,
            "agrees": (interval["low"] <= overhead <= interval["high"]) if checkable else None,
        }
    return {
        "rounds": rounds,
        "direct": direct,
        "bare_samples_per_s": bench.spread([r["bare"]["samples_per_s"] for r in rounds]),
        "threads": sorted({r[a]["threads"] for r in rounds for a in arms if a in r}),
        "results": results,
    }


def verdict_text(result: dict) -> str:
    """The target and what the interval says of it."""
    target = f"<= {result['target_overhead']:.0%}"
    if result["pairs"] < bench.MIN_PAIRS:
        return f"{target}: not judged (too few pairs)"
    return f"{target}: " + {True: "met", False: "NOT met", None: "undecided"}[result["meets_target"]]


def markdown(report: dict) -> list[str]:
    table = Table(
        "train.py against a bare loop",
        [
            "timing clock",
            "bare samples/s (median)",
            "train.py samples/s (median)",
            "ratio train.py / bare",
            "overhead (median)",
            "overhead's interval",
            "target, judged on the interval",
        ],
        [
            [
                label,
                num(report["bare_samples_per_s"]["median"]),
                num(r["samples_per_s"]["median"]),
                bench.ratio_text(r),
                f"{r['overhead']:+.2%}",
                f"{r['overhead_interval']['low']:+.2%} to {r['overhead_interval']['high']:+.2%} "
                f"({r['overhead_interval']['confidence']:.1%})",
                verdict_text(r),
            ]
            for label, r in report["results"].items()
        ],
        "timing_overhead",
        align="lrrrrll",
    )
    lines = [
        "# Stage-timing overhead",
        "",
        *([f"Status: {report['status']}.", ""] if report.get("status") else []),
        f"train.py flags: `{' '.join(report['train_args'])}`; both arms by "
        f"`accelerate launch --num_processes 1`; {len(report['rounds'])} alternating rounds; torch threads per process: "
        f"{', '.join(map(str, report['threads']))}.",
        "",
        "The bare loop is train.py's run less its instruments: the same start-up, set-up "
        "(trainscope.classifier.build_training), step (trainscope.workload.step.train_step: accumulation, clipping, "
        "fp32 loss) and evaluations; both time the steps after the warm-up steps, evaluation taken out.",
        "",
        *table.markdown_lines(),
        "",
        "The overhead's interval is the median ratio's distribution-free interval (order statistics of the rounds' "
        "ratios, at the confidence shown): the target is met when the interval's upper end is within it, not met "
        "when its lower end is above it, undecided otherwise; the rounds resolve the overhead when the upper end is "
        f"within {RESOLUTION:.0%}.",
    ]
    direct = report.get("direct")
    if direct:
        spread = direct["us_per_step"]
        interval = direct.get("rounds_interval")
        agreement = {
            True: "the rounds' interval holds it: they agree",
            False: "the rounds' interval does NOT hold it (warning: one of the two figures is wrong)",
            None: "the rounds' interval is too wide to check it (undecided)",
        }[direct["agrees"]]
        lines += [
            "",
            f"Measured directly (the second instrument: trainscope.Run's own calls around near-empty steps of the same "
            f"batch shape, --log-every and threads, one run a round): {spread['median']:.1f} us per optimizer step "
            f"({spread['min']:.1f}-{spread['max']:.1f}), {direct['overhead']:.2%} of the bare loop's median step: "
            f"target <= {direct['target_overhead']:.0%} "
            + {True: "met", False: "NOT met", None: "not judged (too few rounds)"}[direct["meets_target"]]
            + (
                f"; the paired rounds' interval {interval['low']:+.2%} to {interval['high']:+.2%}: {agreement}"
                if interval
                else ""
            )
            + ".",
        ]
    if not torch.cuda.is_available():
        lines += ["", "GPU (events <= 1%, sync <= 3%, per-stage memory statistics every step): not measured on GPU."]
    return lines


def main() -> None:
    parser = bench.driver_parser(__doc__, ROOT / "benchmarks" / "timing_overhead", "--bare")
    parser.add_argument("--alone", action="store_true", help=argparse.SUPPRESS)  # a child: the instruments alone
    parser.add_argument(
        "--modes",
        nargs="+",
        default=None,
        choices=["events", "sync", MEMORY_ARM, ALONE],
        help="arms to measure against the bare loop: timing clocks, and on a GPU the per-stage "
        f"memory statistics read every step ({MEMORY_ARM}, with the first clock given), and {ALONE}: the "
        "instruments' own time around empty steps, the direct figure (default: all four on a GPU, the host clock "
        f"and {ALONE} on a CPU)",
    )
    args, train_args = parser.parse_known_args()
    if args.bare:
        return bare_loop(train_args)
    if args.alone:
        return instruments_alone(train_args)
    if args.pairs < 1:
        parser.error("--pairs must be at least 1")
    train_args = [*DEFAULT_TRAIN_ARGS, *train_args]
    modes = args.modes or (["events", "sync", MEMORY_ARM, ALONE] if torch.cuda.is_available() else ["events", ALONE])
    header = {
        "benchmark": "timing_overhead",
        "benchmark_version": 4,
        "train_args": train_args,
    }  # 4: verdicts from the median's interval; the bare loop runs train.py's set-up and step

    def partial(found: dict) -> None:  # the rounds so far, replaced by the next round's and the final results
        report = {**header, **found, "status": f"partial: {len(found['rounds'])} of {args.pairs} rounds"}
        bench.write_results(Path(args.out), report, markdown(report))

    with tempfile.TemporaryDirectory() as scratch:
        report = {**header, **measure(train_args, modes, args.pairs, Path(scratch), on_round=partial)}
    bench.publish(Path(args.out), report, markdown(report))


if __name__ == "__main__":
    main()
