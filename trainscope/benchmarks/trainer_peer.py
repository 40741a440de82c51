"""train.py against the HF transformers.Trainer: same model, data, batch size, precision and steps.

Both are built from the same builders (tokenizer, tokenized splits, model) and run as fresh
processes, interleaved (Trainer, train.py, Trainer, ...). Each reports steady-state training
samples/s over the same optimizer steps (the first --timing-warmup-steps excluded, no evaluation):
train.py from its run record, the Trainer through a callback that starts the clock at the end of
the warm-up steps and stops it after the last. The result is the median of per-pair ratios
train.py / Trainer (above 1: train.py is faster).

    python -m trainscope.benchmarks.trainer_peer [--pairs 5] [--precision bf16] [train.py flags]

Writes benchmarks/trainer_peer.{json,md}.
"""

import argparse
import contextlib
import json
import os
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
DEFAULT_ARGS = ["--max-train-samples", "1600", "--per-device-batch-size", "32", "--max-steps", "30",
                "--timing-warmup-steps", "5", "--max-eval-samples", "32", "--max-test-samples", "32",
                "--report-to", "none", "--log-every", "10"]
CONFIG_FOR = {("cpu", "fp32"): "cpu", ("cuda", "fp32"): "single_gpu", ("cuda", "bf16"): "bf16",
              ("cuda", "fp16"): "fp16", ("cpu", "bf16"): "bf16"}


def trainer_loop(argv: list[str], precision: str) -> None:
    """Fine-tune with transformers.Trainer; print steady-state samples/s as JSON."""
    from transformers import Trainer, TrainerCallback, TrainingArguments

    from trainscope.data import build_collator, load_classification_data
    from trainscope.modeling import build_model, build_tokenizer
    from trainscope.settings import parse_settings

    (settings,) = parse_settings(argv=argv)
    tokenizer = build_tokenizer(settings)
    data = load_classification_data(settings, tokenizer, contextlib.nullcontext)
    torch.manual_seed(settings.seed)
    model, _ = build_model(settings, data.label_names, tokenizer)
    synchronize = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)

    class SteadyClock(TrainerCallback):
        started = finished = None

        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == settings.timing_warmup_steps:
                synchronize()
                self.started = time.perf_counter()
            if state.global_step == settings.max_steps:
                synchronize()
                self.finished = time.perf_counter()

    clock = SteadyClock()
    with tempfile.TemporaryDirectory() as scratch:
        arguments = TrainingArguments(
            output_dir=scratch, per_device_train_batch_size=settings.per_device_batch_size,
            max_steps=settings.max_steps, learning_rate=settings.learning_rate, weight_decay=settings.weight_decay,
            lr_scheduler_type=settings.lr_scheduler, warmup_steps=int(settings.warmup_fraction * settings.max_steps),
            max_grad_norm=settings.max_grad_norm or 0.0, logging_steps=settings.log_every, report_to=[],
            save_strategy="no", eval_strategy="no", dataloader_num_workers=settings.num_workers,
            dataloader_pin_memory=torch.cuda.is_available(), seed=settings.seed, optim="adamw_torch_fused",
            bf16=precision == "bf16", fp16=precision == "fp16", tf32=settings.tf32 if torch.cuda.is_available() else None,
            disable_tqdm=True, use_cpu=not torch.cuda.is_available(),
        )
        trainer = Trainer(model=model, args=arguments, train_dataset=data.train,
                          data_collator=build_collator(tokenizer, settings), callbacks=[clock])
        trainer.train()
    samples = (settings.max_steps - settings.timing_warmup_steps) * settings.per_device_batch_size
    print(json.dumps({"samples_per_s": samples / (clock.finished - clock.started)}))


def run_trainer(train_args: list[str], precision: str) -> float:
    command = [sys.executable, "-m", "trainscope.benchmarks.trainer_peer", "--trainer", "--precision", precision,
               *train_args]
    result = subprocess.run(command, check=True, capture_output=True, text=True, cwd=ROOT)
    return json.loads(result.stdout.strip().splitlines()[-1])["samples_per_s"]


def run_train_py(train_args: list[str], config: str, output_dir: Path, name: str) -> dict:
    accelerate = str(Path(sys.executable).parent / "accelerate")
    command = [accelerate, "launch", "--config_file", str(ROOT / "accelerate_configs" / f"{config}.yaml"),
               str(ROOT / "train.py"), *train_args, "--output-dir", str(output_dir), "--run-name", name]
    env = {**os.environ, "ACCELERATE_USE_CPU": "1"} if not torch.cuda.is_available() else None
    subprocess.run(command, check=True, capture_output=True, text=True, cwd=ROOT, env=env)
    record = json.loads((output_dir / name / "record.json").read_text())
    return {"samples_per_s": record["summary"]["throughput"]["samples_per_s"],
            "effective_precision": record["environment"]["effective_precision"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pairs", type=int, default=5, help="Trainer/train.py pairs (default 5)")
    parser.add_argument("--precision", default="fp32", choices=["fp32", "bf16", "fp16"],
                        help="precision of both (train.py gets the matching Accelerate config)")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "trainer_peer"),
                        help="results path without suffix (default benchmarks/trainer_peer)")
    parser.add_argument("--trainer", action="store_true", help=argparse.SUPPRESS)
    args, train_args = parser.parse_known_args()
    if args.trainer:
        return trainer_loop(train_args, args.precision)
    if args.pairs < 1:
        parser.error("--pairs must be at least 1")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if (device.type, args.precision) not in CONFIG_FOR:
        parser.error(f"{args.precision} cannot run on {device.type}")
    config = CONFIG_FOR[(device.type, args.precision)]
    train_args = [*DEFAULT_ARGS, *train_args]
    pairs = []
    with tempfile.TemporaryDirectory() as scratch:
        for i in range(args.pairs):
            trainer = run_trainer(train_args, args.precision)
            ours = run_train_py(train_args, config, Path(scratch), f"peer-{i}")
            pairs.append({"trainer_samples_per_s": trainer, "train_py_samples_per_s": ours["samples_per_s"],
                          "ratio": ours["samples_per_s"] / trainer})
            print(f"pair {i + 1}/{args.pairs}: Trainer {trainer:.2f}, train.py {ours['samples_per_s']:.2f} samples/s, "
                  f"ratio {pairs[-1]['ratio']:.4f}", flush=True)
    ratio = statistics.median(p["ratio"] for p in pairs)
    report = {
        "benchmark": "trainer_peer", "benchmark_version": 1, "date": date.today().isoformat(),
        "machine": {"device_name": environment.device_name(device), "usable_cores": environment.usable_cores(),
                    "torch": torch.__version__, "packages": environment.package_versions()},
        "precision": args.precision, "effective_precision": ours["effective_precision"],
        "accelerate_config": config, "train_args": train_args, "pairs": pairs,
        "median_ratio": ratio, "target": 1.0, "meets_target": ratio >= 1.0,
        "median_trainer_samples_per_s": statistics.median(p["trainer_samples_per_s"] for p in pairs),
        "median_train_py_samples_per_s": statistics.median(p["train_py_samples_per_s"] for p in pairs),
    }
    out = Path(args.out)
    write_json_atomic(out.with_suffix(".json"), report)
    out.with_suffix(".md").write_text(markdown(report, device))
    print(out.with_suffix(".md").read_text())


def markdown(report: dict, device: torch.device) -> str:
    machine = report["machine"]
    lines = ["# train.py against transformers.Trainer", "",
             f"{report['date']}, {machine['device_name']}, {machine['usable_cores']} usable cores, torch "
             f"{machine['torch']}, transformers {machine['packages']['transformers']}, precision "
             f"{report['effective_precision']} (config {report['accelerate_config']}).",
             f"Flags: `{' '.join(report['train_args'])}`", "",
             "| pair | Trainer samples/s | train.py samples/s | ratio |", "|---:|---:|---:|---:|"]
    for i, pair in enumerate(report["pairs"], 1):
        lines.append(f"| {i} | {pair['trainer_samples_per_s']:.2f} | {pair['train_py_samples_per_s']:.2f} | "
                     f"{pair['ratio']:.4f} |")
    lines += ["", f"Median ratio train.py / Trainer: **{report['median_ratio']:.4f}** (target >= 1.0: "
              f"{'met' if report['meets_target'] else 'NOT met'})."]
    if device.type == "cpu":
        lines += ["", "GPU: not measured on GPU."]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
