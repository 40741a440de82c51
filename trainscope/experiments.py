"""Experiments made of train.py runs: the batch-size sweep and the config/switch matrix.

    python -m trainscope.experiments batch-sweep --config accelerate_configs/cpu.yaml --runs runs/batch \\
        --batch-sizes 8 16 32 64 -- [train.py flags]
    python -m trainscope.experiments matrix --runs runs/matrix --variants cpu bf16 ddp cpu+ckpt -- [train.py flags]

Every variant is a real `accelerate launch ... train.py` run with the same seed and steps, writing
its own run record; the report reads those records.
"""

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import torch

from trainscope.records import now_iso, write_json_atomic

ROOT = Path(__file__).resolve().parent.parent
SWITCHES = {"ckpt": ["--gradient-checkpointing"], "compile": ["--compile"], "lora": ["--lora"],
            "events": ["--timing", "events"], "sync": ["--timing", "sync"], "tf32": ["--tf32"]}
SMALL_EVAL = ["--max-eval-samples", "64", "--max-test-samples", "64"]


def launch_train(config: Path, train_args: list[str], runs: Path, name: str) -> subprocess.CompletedProcess:
    accelerate = str(Path(sys.executable).parent / "accelerate")
    command = [accelerate, "launch", "--config_file", str(config), str(ROOT / "train.py"), *train_args,
               "--output-dir", str(runs), "--run-name", name, "--overwrite"]
    env = {**os.environ}
    if not torch.cuda.is_available():
        env["ACCELERATE_USE_CPU"] = "1"
    print("$ " + " ".join(command[1:]), flush=True)
    return subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True)


def failure_reason(result: subprocess.CompletedProcess) -> str:
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    return errors[-1][len("error: "):] if errors else (result.stderr.strip().splitlines() or ["failed"])[-1]


# ---------------------------------------------------------------- batch size


def largest_fitting_batch(train_args: list[str], start: int) -> int:
    """The largest batch (halving from `start`) for which two training steps fit in device memory.

    Accelerate's find_executable_batch_size retries the function with half the batch on every
    out-of-memory error.
    """
    import contextlib

    from accelerate import Accelerator
    from accelerate.utils import find_executable_batch_size
    from transformers import get_scheduler

    from trainscope.data import build_dataloaders, load_classification_data
    from trainscope.loop import train_step
    from trainscope.modeling import build_model, build_optimizer, build_tokenizer
    from trainscope.settings import parse_settings
    from trainscope.timing import StageTimer

    (settings,) = parse_settings(argv=train_args)
    tokenizer = build_tokenizer(settings)
    data = load_classification_data(settings, tokenizer, contextlib.nullcontext)
    accelerator = Accelerator()

    @find_executable_batch_size(starting_batch_size=start)
    def two_steps(batch_size):
        accelerator.free_memory()
        settings.per_device_batch_size = batch_size
        model, _ = build_model(settings, data.label_names, tokenizer)
        train_loader, _, _ = build_dataloaders(data, tokenizer, settings)
        optimizer = build_optimizer(model, settings, accelerator.device)
        scheduler = get_scheduler("constant", optimizer)
        model, optimizer, train_loader, scheduler = accelerator.prepare(model, optimizer, train_loader, scheduler)
        timer = StageTimer(device=accelerator.device, track_memory=False)
        timer.start()
        for _, batch in zip(range(2), train_loader):
            train_step(accelerator, model, batch, optimizer, scheduler, timer, settings.max_grad_norm)
        timer.stop()
        del model, optimizer, train_loader, scheduler
        return batch_size

    return two_steps()


def recommend(rows: list[dict], effective_batch: int) -> dict:
    """Fastest batch overall, and the fastest that keeps the user's effective batch with accumulation."""
    fitted = [r for r in rows if r["status"] == "complete"]
    if not fitted:
        return {}
    fastest = max(fitted, key=lambda r: r["samples_per_s"])
    dividing = [r for r in fitted if effective_batch % r["batch_size"] == 0]
    keep = max(dividing, key=lambda r: r["samples_per_s"]) if dividing else None
    result = {"fastest_batch_size": fastest["batch_size"], "fastest_samples_per_s": fastest["samples_per_s"],
              "largest_swept_that_fits": max(r["batch_size"] for r in fitted), "effective_batch": effective_batch}
    if keep:
        accumulation = effective_batch // keep["batch_size"]
        result.update(keep_effective_batch_size=keep["batch_size"], gradient_accumulation_steps=accumulation,
                      flags=f"--per-device-batch-size {keep['batch_size']} --gradient-accumulation-steps {accumulation}")
    return result


def batch_sweep(args, train_args: list[str]) -> dict:
    runs = Path(args.runs)
    from trainscope.settings import parse_settings

    (user,) = parse_settings(argv=train_args)
    effective = user.per_device_batch_size * user.gradient_accumulation_steps
    largest = None
    if torch.cuda.is_available() and args.search_from:
        largest = largest_fitting_batch([*train_args, *SMALL_EVAL], args.search_from)
        print(f"largest batch that fits (find_executable_batch_size from {args.search_from}): {largest}")
    rows = []
    for batch_size in sorted(args.batch_sizes):
        if largest is not None and batch_size > largest:
            rows.append({"batch_size": batch_size, "status": "does not fit",
                         "reason": f"above the largest batch that fits ({largest})"})
            continue
        steps = ["--max-steps", str(args.steps), "--timing-warmup-steps", "2", "--per-device-batch-size",
                 str(batch_size), "--gradient-accumulation-steps", "1", "--log-every", str(args.steps)]
        result = launch_train(Path(args.config), [*train_args, *SMALL_EVAL, *steps], runs, f"bs{batch_size}")
        if result.returncode != 0:
            reason = failure_reason(result)
            rows.append({"batch_size": batch_size, "status": "out of memory" if "out of memory" in reason
                         else "failed", "reason": reason})
            if "out of memory" in reason:
                break
            continue
        summary = json.loads((runs / f"bs{batch_size}" / "record.json").read_text())["summary"]
        memory = summary["memory"]
        rows.append({"batch_size": batch_size, "status": "complete", "run": f"bs{batch_size}",
                     "samples_per_s": summary["throughput"]["samples_per_s"],
                     "step_s": summary["throughput"]["step_s"],
                     "peak_memory_gib": (memory.get("max_allocated_gib") or memory["peak_rss_gib"])["max"],
                     "memory_kind": "max_allocated" if "max_allocated_gib" in memory else "peak_rss"})
        print(f"batch {batch_size}: {rows[-1]['samples_per_s']:.1f} samples/s, "
              f"{rows[-1]['peak_memory_gib']:.2f} GiB ({rows[-1]['memory_kind']})", flush=True)
    sweep = {"experiment": "batch_sweep", "created": now_iso(), "config": args.config, "train_args": train_args,
             "largest_fitting_batch": largest,
             "largest_search": ("find_executable_batch_size" if largest is not None else
                                "no device-memory limit to search on a CPU: the largest swept batch stands"),
             "rows": rows, "recommendation": recommend(rows, effective)}
    write_json_atomic(runs / "sweep.json", sweep)
    print(json.dumps(sweep["recommendation"], indent=2))
    return sweep


# ---------------------------------------------------------------- matrix


def parse_variant(variant: str) -> tuple[str, list[str]]:
    """'bf16+ckpt+compile' -> ('bf16', ['--gradient-checkpointing', '--compile'])."""
    config, *switches = variant.split("+")
    unknown = [s for s in switches if s not in SWITCHES]
    if unknown:
        raise SystemExit(f"error: unknown switch(es) {unknown} in {variant!r}: choose from {', '.join(SWITCHES)}")
    if not (ROOT / "accelerate_configs" / f"{config}.yaml").exists():
        raise SystemExit(f"error: no accelerate_configs/{config}.yaml for variant {variant!r}")
    return config, [flag for s in switches for flag in SWITCHES[s]]


def matrix(args, train_args: list[str]) -> dict:
    runs = Path(args.runs)
    plans = [(variant, *parse_variant(variant)) for variant in args.variants]
    outcome = []
    for variant, config, flags in plans:
        result = launch_train(ROOT / "accelerate_configs" / f"{config}.yaml", [*train_args, *flags], runs, variant)
        status = "complete" if result.returncode == 0 else "failed"
        outcome.append({"variant": variant, "config": config, "flags": flags, "status": status,
                        **({} if status == "complete" else {"reason": failure_reason(result)})})
        print(f"{variant}: {status}", flush=True)
    summary = {"experiment": "matrix", "created": now_iso(), "train_args": train_args, "variants": outcome}
    write_json_atomic(runs / "matrix.json", summary)
    return summary


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    batch = commands.add_parser("batch-sweep", help="throughput and memory against batch size")
    batch.add_argument("--config", default=str(ROOT / "accelerate_configs" / "cpu.yaml"), help="Accelerate config")
    batch.add_argument("--runs", default="runs/batch", help="where the runs and sweep.json go")
    batch.add_argument("--batch-sizes", type=int, nargs="+", default=[8, 16, 32, 64, 128], help="batch sizes")
    batch.add_argument("--steps", type=int, default=8, help="optimizer steps per batch size (2 of them warm-up)")
    batch.add_argument("--search-from", type=int, default=4096,
                       help="on a GPU, find the largest batch that fits by halving from this (0: skip)")
    grid = commands.add_parser("matrix", help="train.py under each config and switch")
    grid.add_argument("--runs", default="runs/matrix", help="where the runs and matrix.json go")
    grid.add_argument("--variants", nargs="+", required=True,
                      help=f"config[+switch...], switches: {', '.join(SWITCHES)} (e.g. bf16+ckpt)")
    argv = sys.argv[1:] if argv is None else argv
    ours, train_args = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    args = parser.parse_args(ours)
    if args.command == "batch-sweep":
        if any(b < 1 for b in args.batch_sizes) or args.steps < 3:
            parser.error("batch sizes must be positive and --steps at least 3")
        batch_sweep(args, train_args)
    else:
        for variant in args.variants:
            parse_variant(variant)
        matrix(args, train_args)


if __name__ == "__main__":
    main()
