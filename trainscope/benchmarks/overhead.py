"""What stage timing costs: train.py's timed loop against a bare loop over the same steps.

Both run as fresh processes with the same model, data, seed, batch size and optimizer steps,
built by the same builders. The bare loop has no timer, no per-stage memory reads, no log lines
and no progress bar: it is what a user would write without trainscope. Runs alternate
(bare, timed, bare, timed, ...) so drift on a noisy machine hits both alike; the result is the
median of the per-pair ratios of steady-state training samples/s (warm-up steps excluded in both).

    python -m trainscope.benchmarks.overhead [--pairs 5] [--modes events sync] [train.py flags]

Writes benchmarks/timing_overhead.json and .md.
"""

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import date
from pathlib import Path

import torch

from trainscope import environment
from trainscope.records import write_json_atomic

ROOT = Path(__file__).resolve().parents[2]
DEFAULT_TRAIN_ARGS = ["--max-train-samples", "1280", "--per-device-batch-size", "16", "--max-seq-length", "64",
                      "--max-steps", "40", "--timing-warmup-steps", "5", "--max-eval-samples", "32",
                      "--max-test-samples", "32", "--report-to", "none"]
TARGETS = {"host": 0.02, "events": 0.01, "sync": 0.03}


def bare_loop(argv: list[str]) -> None:
    """The loop a user writes without instrumentation; prints steady-state samples/s as JSON."""
    import contextlib

    import torch.nn.functional as F
    from accelerate import Accelerator, DataLoaderConfiguration
    from accelerate.utils import set_seed

    from trainscope.data import build_dataloaders, load_classification_data
    from trainscope.modeling import build_model, build_optimizer, build_tokenizer
    from trainscope.settings import parse_settings
    from transformers import get_scheduler

    (settings,) = parse_settings(argv=argv)
    set_seed(settings.seed)
    tokenizer = build_tokenizer(settings)
    data = load_classification_data(settings, tokenizer, contextlib.nullcontext)
    model, _ = build_model(settings, data.label_names, tokenizer)
    on_cuda = torch.cuda.is_available()
    accelerator = Accelerator(dataloader_config=DataLoaderConfiguration(
        use_seedable_sampler=True, data_seed=settings.seed, non_blocking=on_cuda))
    train_loader, _, _ = build_dataloaders(data, tokenizer, settings, pin_memory=on_cuda)
    optimizer = build_optimizer(model, settings, accelerator.device)
    scheduler = get_scheduler(settings.lr_scheduler, optimizer,
                              num_warmup_steps=int(settings.warmup_fraction * settings.max_steps),
                              num_training_steps=settings.max_steps)
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
    print(json.dumps({"samples_per_s": samples / (time.perf_counter() - started)}))


def timed_run(train_args: list[str], mode: str, output_dir: Path, name: str) -> float:
    command = [sys.executable, str(ROOT / "train.py"), *train_args, "--timing", mode,
               "--output-dir", str(output_dir), "--run-name", name]
    subprocess.run(command, check=True, capture_output=True, text=True, cwd=ROOT)
    record = json.loads((output_dir / name / "record.json").read_text())
    return record["summary"]["throughput"]["samples_per_s"]


def bare_run(train_args: list[str]) -> float:
    command = [sys.executable, "-m", "trainscope.benchmarks.overhead", "--bare", *train_args]
    result = subprocess.run(command, check=True, capture_output=True, text=True, cwd=ROOT)
    return json.loads(result.stdout.strip().splitlines()[-1])["samples_per_s"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pairs", type=int, default=5, help="bare/timed pairs per timing mode (default 5)")
    parser.add_argument("--modes", nargs="+", default=None, choices=["events", "sync"],
                        help="timing modes to measure (default: both on a GPU, the host clock on a CPU)")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "timing_overhead"),
                        help="results path without suffix (default benchmarks/timing_overhead)")
    parser.add_argument("--bare", action="store_true", help=argparse.SUPPRESS)
    args, train_args = parser.parse_known_args()
    if args.bare:
        return bare_loop(train_args)
    if args.pairs < 1:
        parser.error("--pairs must be at least 1")
    train_args = [*DEFAULT_TRAIN_ARGS, *train_args]
    on_gpu = torch.cuda.is_available()
    modes = args.modes or (["events", "sync"] if on_gpu else ["events"])
    results = {}
    with tempfile.TemporaryDirectory() as scratch:
        for mode in modes:
            label = mode if on_gpu else "host"
            pairs = []
            for i in range(args.pairs):
                bare = bare_run(train_args)
                timed = timed_run(train_args, mode, Path(scratch), f"{mode}-{i}")
                pairs.append({"bare_samples_per_s": bare, "timed_samples_per_s": timed, "ratio": timed / bare})
                print(f"{label} pair {i + 1}/{args.pairs}: bare {bare:.2f}, timed {timed:.2f} samples/s, "
                      f"ratio {timed / bare:.4f}", flush=True)
            ratio = statistics.median(p["ratio"] for p in pairs)
            results[label] = {
                "pairs": pairs, "median_ratio": ratio, "overhead": 1 - ratio,
                "median_bare_samples_per_s": statistics.median(p["bare_samples_per_s"] for p in pairs),
                "median_timed_samples_per_s": statistics.median(p["timed_samples_per_s"] for p in pairs),
                "target_overhead": TARGETS[label], "meets_target": 1 - ratio <= TARGETS[label],
            }
    device = torch.device("cuda" if on_gpu else "cpu")
    report = {
        "benchmark": "timing_overhead", "benchmark_version": 1, "date": date.today().isoformat(),
        "machine": {"device_name": environment.device_name(device), "usable_cores": environment.usable_cores(),
                    "torch": torch.__version__, "packages": environment.package_versions()},
        "train_args": train_args, "results": results,
    }
    out = Path(args.out)
    write_json_atomic(out.with_suffix(".json"), report)
    out.with_suffix(".md").write_text(markdown(report, on_gpu))
    print(out.with_suffix(".md").read_text())


def markdown(report: dict, on_gpu: bool) -> str:
    machine = report["machine"]
    lines = [
        "# Stage-timing overhead",
        "",
        f"{report['date']}, {machine['device_name']}, {machine['usable_cores']} usable cores, torch {machine['torch']}.",
        f"train.py flags: `{' '.join(report['train_args'])}`",
        "",
        "| timing clock | bare samples/s (median) | train.py samples/s (median) | median ratio | overhead | target |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for label, r in report["results"].items():
        lines.append(f"| {label} | {r['median_bare_samples_per_s']:.2f} | {r['median_timed_samples_per_s']:.2f} | "
                     f"{r['median_ratio']:.4f} | {r['overhead']:+.2%} | <= {r['target_overhead']:.0%} "
                     f"{'met' if r['meets_target'] else 'NOT met'} |")
    if not on_gpu:
        lines += ["", "GPU (events <= 1%, sync <= 3%): not measured on GPU."]
    lines += ["", "Ratios are per bare/timed pair run back to back; a ratio above 1 means the two are within noise."]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
