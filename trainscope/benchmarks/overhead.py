"""What stage timing costs: train.py's timed loop against a bare loop over the same steps.

Both are launched by the README's command (`accelerate launch`, pinned to one process: on a multi-GPU
host a launch without a config runs on every GPU, and the bare loop would print one rank's samples/s
against train.py's global figure), get trainscope's thread budget and are built by the same builders
with the same model, data, seed, batch size and optimizer steps. The
bare loop has no timer, no per-stage memory reads, no log lines and no progress bar: it is what a
user writes without trainscope. Rounds alternate the order (bare, timed, then timed, bare, ...) and
the result per timing clock is the median of per-round ratios of steady-state training samples/s
(warm-up steps excluded in both) with their range and a verdict. On CUDA a third arm reads the
per-stage allocator peaks at every step (--memory-every 1), to show what they cost (`--modes` picks the
arms). A target is said met or not only with at least bench.MIN_PAIRS rounds (`meets_target` is null below).

    python -m trainscope.benchmarks.overhead [--pairs 5] [--modes events sync memory-every-step] [train.py flags]

Writes benchmarks/timing_overhead.{json,md}.
"""

import contextlib
import json
import tempfile
import time
from pathlib import Path

import torch

from trainscope import bench, launching
from trainscope.record_view import RunView
from trainscope.records import read_record
from trainscope.tables import Table, num

ROOT = launching.ROOT
DEFAULT_TRAIN_ARGS = [
    "--max-train-samples",
    "1280",
    "--per-device-batch-size",
    "16",
    "--max-seq-length",
    "64",
    "--max-steps",
    "40",
    "--timing-warmup-steps",
    "5",
    "--max-eval-samples",
    "32",
    "--max-test-samples",
    "32",
    "--report-to",
    "none",
]
TARGETS = {"host": 0.02, "events": 0.01, "sync": 0.03, "memory-every-step": 0.01}
MEMORY_ARM = "memory-every-step"


def bare_loop(argv: list[str]) -> None:
    """The loop a user writes without instrumentation; prints steady-state samples/s as JSON."""
    import torch.nn.functional as F
    from accelerate import Accelerator, DataLoaderConfiguration
    from accelerate.utils import set_seed

    from trainscope import startup
    from trainscope.data import build_dataloaders, load_classification_data
    from trainscope.modeling import build_model, build_optimizer, build_scheduler, build_tokenizer
    from trainscope.settings import parse_settings

    (settings,) = parse_settings(argv=argv)
    startup.configure_process(settings)
    set_seed(settings.seed)
    tokenizer = build_tokenizer(settings)
    data = load_classification_data(settings, tokenizer, contextlib.nullcontext)
    model, _ = build_model(settings, data.label_names, tokenizer)
    on_cuda = torch.cuda.is_available()
    accelerator = Accelerator(
        dataloader_config=DataLoaderConfiguration(
            use_seedable_sampler=True, data_seed=settings.seed, non_blocking=on_cuda
        )
    )
    train_loader, _, _ = build_dataloaders(data, tokenizer, settings, pin_memory=on_cuda)
    optimizer = build_optimizer(model, settings, accelerator.device)
    scheduler = build_scheduler(
        settings, optimizer, settings.max_steps, int(settings.warmup_fraction * settings.max_steps)
    )
    model, optimizer, train_loader, scheduler = accelerator.prepare(model, optimizer, train_loader, scheduler)
    model.train()
    samples, step, started = 0, 0, None
    batches = iter(train_loader)
    while step < settings.max_steps:
        batch = next(batches)
        labels = batch.pop("labels")
        logits = model(**batch).logits
        loss = F.cross_entropy(logits.float(), labels)
        accelerator.backward(loss)
        accelerator.clip_grad_norm_(model.parameters(), settings.max_grad_norm)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        step += 1
        if step == settings.timing_warmup_steps:
            if on_cuda:
                torch.cuda.synchronize()
            started = time.perf_counter()
        elif started is not None:
            samples += labels.shape[0]
    if on_cuda:
        torch.cuda.synchronize()
    print(json.dumps({"samples_per_s": samples / (time.perf_counter() - started), "threads": torch.get_num_threads()}))


def bare_run(train_args: list[str]) -> dict:
    command = [*launching.accelerate_launch(), "-m", "trainscope.benchmarks.overhead", "--bare", *train_args]
    result = launching.run_captured(command, launching.training_env())
    if result.returncode != 0:
        raise SystemExit(f"error: the bare loop failed: {launching.failure_reason(result)}")
    return json.loads(result.stdout.strip().splitlines()[-1])


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
    clocks = [mode for mode in modes if mode != MEMORY_ARM] or ["events"]
    for mode in [mode for mode in modes if mode != MEMORY_ARM]:
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


def figures(rounds: list[dict], arms: dict) -> dict:
    """Every arm against the bare loop over the rounds so far."""
    results = {}
    for label in [a for a in arms if a != "bare"]:
        comparison = bench.compare_rounds(rounds, label, "bare", "samples_per_s")
        overhead = 1 - comparison["median_ratio"]
        decided = comparison["pairs"] >= bench.MIN_PAIRS  # below it a median of ratios is no figure to judge
        results[label] = {
            **comparison,
            "overhead": overhead,
            "target_overhead": TARGETS[label],
            "meets_target": (overhead <= TARGETS[label]) if decided else None,
            "samples_per_s": bench.spread([r[label]["samples_per_s"] for r in rounds]),
        }
    return {
        "rounds": rounds,
        "bare_samples_per_s": bench.spread([r["bare"]["samples_per_s"] for r in rounds]),
        "threads": sorted({r[a]["threads"] for r in rounds for a in arms}),
        "results": results,
    }


def markdown(report: dict) -> list[str]:
    table = Table(
        "train.py against a bare loop",
        [
            "timing clock",
            "bare samples/s (median)",
            "train.py samples/s (median)",
            "ratio train.py / bare",
            "verdict",
            "overhead (median)",
            "target",
        ],
        [
            [
                label,
                num(report["bare_samples_per_s"]["median"]),
                num(r["samples_per_s"]["median"]),
                bench.ratio_text(r),
                r["verdict"],
                f"{r['overhead']:+.2%}",
                f"<= {r['target_overhead']:.0%} "
                + {True: "met", False: "NOT met", None: "not judged (too few pairs)"}[r["meets_target"]],
            ]
            for label, r in report["results"].items()
        ],
        "timing_overhead",
        align="lrrrlrl",
    )
    lines = [
        "# Stage-timing overhead",
        "",
        *([f"Status: {report['status']}.", ""] if report.get("status") else []),
        f"train.py flags: `{' '.join(report['train_args'])}`; both arms by "
        f"`accelerate launch --num_processes 1`; {len(report['rounds'])} alternating rounds; torch threads per process: "
        f"{', '.join(map(str, report['threads']))}; verdicts: {bench.METHOD}.",
        "",
        *table.markdown_lines(),
        "",
        "Within noise, timing costs less than this machine's run-to-run noise can show; 1 - the lowest ratio "
        "bounds what it can cost.",
    ]
    if not torch.cuda.is_available():
        lines += ["", "GPU (events <= 1%, sync <= 3%, per-stage memory statistics every step): not measured on GPU."]
    return lines


def main() -> None:
    parser = bench.driver_parser(__doc__, ROOT / "benchmarks" / "timing_overhead", "--bare")
    parser.add_argument(
        "--modes",
        nargs="+",
        default=None,
        choices=["events", "sync", MEMORY_ARM],
        help="arms to measure against the bare loop: timing clocks, and on a GPU the per-stage "
        f"memory statistics read every step ({MEMORY_ARM}, with the first clock given) "
        "(default: all three on a GPU, the host clock on a CPU)",
    )
    args, train_args = parser.parse_known_args()
    if args.bare:
        return bare_loop(train_args)
    if args.pairs < 1:
        parser.error("--pairs must be at least 1")
    train_args = [*DEFAULT_TRAIN_ARGS, *train_args]
    modes = args.modes or (["events", "sync", MEMORY_ARM] if torch.cuda.is_available() else ["events"])
    header = {"benchmark": "timing_overhead", "benchmark_version": 2, "train_args": train_args}

    def partial(found: dict) -> None:  # the rounds so far, replaced by the next round's and the final results
        report = {**header, **found, "status": f"partial: {len(found['rounds'])} of {args.pairs} rounds"}
        bench.write_results(Path(args.out), report, markdown(report))

    with tempfile.TemporaryDirectory() as scratch:
        report = {**header, **measure(train_args, modes, args.pairs, Path(scratch), on_round=partial)}
    bench.publish(Path(args.out), report, markdown(report))


if __name__ == "__main__":
    main()
