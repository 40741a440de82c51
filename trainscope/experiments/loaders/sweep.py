"""What loaders_bench.py needs around its sweep (its flags are in trainscope.experiments.loaders.options): the grid
of DataLoader settings, the on-the-fly and in-training modes' inputs (raw rows with a tokenizing collate; a few real
training steps per setting), the summary with each curve's knee and its verdict against PyTorch's default, and the
writing of the results (JSON, Markdown, CSV, the figure) and the recommendations. The sweep itself (the DataLoader
built for each setting and the timed pass over it) stays in loaders_bench.py."""

import csv
import dataclasses
import io
import itertools
import os
import statistics
import sys
from dataclasses import asdict
from pathlib import Path

import torch

from trainscope.core import environment
from trainscope.core.records import write_text_atomic
from trainscope.core.results_view import LoaderSweepView
from trainscope.experiments.loaders.options import SweepSettings
from trainscope.experiments.loaders.results import PYTORCH_DEFAULT_WORKERS, curve_name, figure, knee_table, knee_verdict
from trainscope.measure import bench
from trainscope.measure.timing import StageTimer, make_clock
from trainscope.report import document
from trainscope.report.document import Heading, Paragraph
from trainscope.report.tables import Table, save_figure
from trainscope.workload.data import labelled_splits
from trainscope.workload.settings import Settings


def device_copier(device: torch.device, non_blocking: bool):
    def to_device(batch):
        return {k: v.to(device, non_blocking=non_blocking) for k, v in batch.items()}

    return to_device


class TokenizingCollator:
    """Collate raw rows by tokenizing them: the on-the-fly mode's per-batch work, done in the workers."""

    def __init__(self, tokenizer, text_columns, label_column, max_length, label_ids):
        self.tokenizer, self.text_columns, self.label_column = tokenizer, text_columns, label_column
        self.max_length, self.label_ids = max_length, label_ids

    def __call__(self, rows):
        texts = [[str(row[c]) for row in rows] for c in self.text_columns]
        batch = self.tokenizer(*texts, truncation=True, max_length=self.max_length, padding=True, return_tensors="pt")
        batch["labels"] = torch.tensor([self.label_ids(row[self.label_column]) for row in rows])
        return dict(batch)


# ---------------------------------------------------------------- the sweep's grid and inputs


def settings_grid(sweep: SweepSettings, settings: Settings):
    batch_sizes = sweep.batch_sizes or [settings.per_device_batch_size]
    for mode, batch_size, pin, persistent, prefetch, workers in itertools.product(
        sweep.modes,
        batch_sizes,
        sweep.pin_memory_values,
        sweep.persistent_workers_values,
        sweep.prefetch_factors,
        sweep.workers,
    ):
        yield {
            "mode": mode,
            "batch_size": batch_size,
            "pin_memory_setting": pin,
            "persistent_workers": persistent == "true",
            "prefetch_factor": prefetch,
            "num_workers": workers,
        }


def raw_training_rows(settings, data):
    """The training split as raw text rows (the same rows as the tokenized split) with a tokenizing collate."""
    from trainscope.workload.modeling import build_tokenizer  # deferred: it loads transformers' models

    train = labelled_splits(settings).subset("train", settings)
    train = train.select_columns([*data.text_columns, data.label_column])
    collate = TokenizingCollator(
        build_tokenizer(settings), data.text_columns, data.label_column, settings.max_seq_length, label_ids=int
    )
    return train, collate


class InTraining:
    """A few real training steps per setting: train.py's model, optimizer and step, timed by stage."""

    def __init__(self, settings, data, tokenizer, device):
        from accelerate import Accelerator, DataLoaderConfiguration

        from trainscope.workload.modeling import (  # deferred: it loads transformers' models
            build_model,
            build_optimizer,
            build_scheduler,
        )

        self.settings = settings
        self.accelerator = Accelerator(dataloader_config=DataLoaderConfiguration(non_blocking=device.type == "cuda"))
        model, _ = build_model(settings, data.label_names, tokenizer)
        optimizer = build_optimizer(model, settings, self.accelerator.device)
        constant = dataclasses.replace(settings, lr_scheduler="constant_with_warmup")
        scheduler = build_scheduler(constant, optimizer, training_steps=1, warmup_steps=0)
        self.model, self.optimizer, self.scheduler = self.accelerator.prepare(model, optimizer, scheduler)

    def measure(self, loader, steps) -> dict:
        """The data stage's share of `steps` steady training steps fed by `loader` (after 2 untimed ones)."""
        from trainscope.workload.step import train_step  # deferred: it loads transformers' models

        loader = self.accelerator.prepare(loader)
        clock, _ = make_clock("sync", self.accelerator.device)
        timer = StageTimer(clock, self.accelerator.device, memory=False)
        batches = endless(loader)
        timer.start()
        for step in range(steps + 2):
            if step == 2:
                timer.set_phase("steady")  # worker start-up and first steps are not the steady state
            with timer("data"):
                batch = next(batches)
            train_step(
                self.accelerator, self.model, batch, self.optimizer, self.scheduler, timer, self.settings.max_grad_norm
            )
        timer.stop()
        steady = timer.summary()["steady"]
        self.accelerator._dataloaders.clear()
        return {
            "data_share": steady["shares"]["data"],
            "data_s": steady["seconds"]["data"],
            "step_s": steady["wall_s"] / steps,
            "first_steps_s": timer.summary()["warmup"]["wall_s"],
        }


def cpu_budget(cores: int, sweep: SweepSettings) -> int:
    """Usable cores per training process; warns where the sweep goes above it, and states PyTorch's default."""
    budget = max(1, cores // sweep.processes_per_node)
    if max(sweep.workers) > budget:
        print(
            f"warning: up to {max(sweep.workers)} workers but {cores} usable cores / "
            f"{sweep.processes_per_node} process(es) = {budget} per training process: above that, workers "
            "compete with each other and with the training process",
            file=sys.stderr,
        )
    print(
        f"PyTorch's DataLoader default is num_workers={PYTORCH_DEFAULT_WORKERS}: batches load in the "
        "training process, one after the other."
    )
    return budget


def pin_memory_of(point: dict, device: torch.device) -> bool:
    """A setting's pin_memory: `auto` pins where there is a CUDA device to copy to."""
    if point["pin_memory_setting"] == "auto":
        return device.type == "cuda"
    return point["pin_memory_setting"] == "true"


def progress(point: dict, row: dict, repeat: int, index: int, sweep: SweepSettings, points: int) -> str:
    metric = "data_share" if point["mode"] == "in-training" else "pass_s"
    return (
        f"[repeat {repeat + 1}/{sweep.repeats}, {index}/{points}] {point['mode']:<12} "
        f"workers={point['num_workers']:<2} batch={point['batch_size']} prefetch={point['prefetch_factor']}: "
        f"{metric} {row[metric]:.4f}"
    )


def build_report(settings, sweep, device, threads: dict, budget: int, dataset_rows: int, rows: list[dict]) -> dict:
    """The results file: the machine, the settings swept, every row and the summary with each curve's knee."""
    return {
        "benchmark": "loaders",
        "benchmark_version": 2,
        "machine": {
            "device": str(device),
            "device_name": environment.device_name(device),
            "usable_cores": threads["usable_cores"],
            "cpu_count": os.cpu_count(),
            "torch_threads": threads["torch_threads"],
            "processes_per_node": sweep.processes_per_node,
            "cpu_budget_per_process": budget,
        },
        "pytorch_default_num_workers": PYTORCH_DEFAULT_WORKERS,
        "settings": asdict(settings),
        "sweep": asdict(sweep),
        "dataset_rows": dataset_rows,
        "rows": rows,
        "summary": summarize(rows, sweep.knee_tolerance),
    }


def endless(loader):
    """Batches from the loader, epoch after epoch. Not itertools.cycle: that replays the same batch
    objects, and the training step takes the labels out of each batch it is given."""
    while True:
        yield from loader


# ---------------------------------------------------------------- summary (pure)


SETTING = ("mode", "batch_size", "pin_memory", "persistent_workers", "prefetch_factor", "num_workers")


def setting_key(row) -> tuple:
    return tuple(row[name] for name in SETTING)


def summarize(rows: list[dict], knee_tolerance: float) -> dict:
    """Per setting: median/min/max of the pass time (or data share); per curve: best, knee, speed-up."""
    groups = {}
    for row in rows:
        if row.get("pass", 0) == 0 or row["mode"] == "in-training":
            groups.setdefault(setting_key(row), []).append(row)
    settings = []
    for key, group in sorted(groups.items(), key=lambda kv: tuple(map(str, kv[0][:5])) + (kv[0][5],)):
        metric = "data_share" if key[0] == "in-training" else "pass_s"
        values = [r[metric] for r in group]
        entry = {
            **dict(zip(SETTING, key)),
            "metric": metric,
            "median": statistics.median(values),
            "min": min(values),
            "max": max(values),
            "repeats": len(values),
        }
        if metric == "pass_s":
            copies = [r["copy_s"] for r in group if r.get("copy_s") is not None]
            entry["median_copy_s"] = statistics.median(copies) if copies else None
            entry["median_first_batch_s"] = statistics.median(r["first_batch_s"] for r in group)
            entry["median_samples_per_s"] = statistics.median(r["samples_per_s"] for r in group)
            entry["median_batches_per_s"] = statistics.median(r["batches_per_s"] for r in group)
        else:
            entry["median_step_s"] = statistics.median(r["step_s"] for r in group)
        settings.append(entry)
    curves = {}
    for entry in settings:
        curves.setdefault(curve_name(entry), []).append(entry)
    summaries = {name: knee(points, knee_tolerance) for name, points in curves.items()}
    for name, curve in summaries.items():
        curve["knee_against_default"] = knee_verdict(rows, name, curve)
    return {"settings": settings, "curves": summaries}


def knee(points: list[dict], tolerance: float) -> dict:
    """Best setting, the fewest workers within `tolerance` of it, and speed-ups over the default (0).

    A pass time is within a fraction of the best. A data share is within that many points of step
    time: workers can save at most the share the data stage takes, so when the default's share is
    already small (0.4% against 0.2%), the workers buy nothing and the knee stays at the default.
    """
    points = sorted(points, key=lambda p: p["num_workers"])
    best = min(points, key=lambda p: p["median"])
    if best["metric"] == "data_share":
        limit = best["median"] + tolerance
    else:
        limit = best["median"] * (1 + tolerance) if best["median"] > 0 else tolerance
    knee_point = next(p for p in points if p["median"] <= limit)
    default = next((p for p in points if p["num_workers"] == PYTORCH_DEFAULT_WORKERS), None)
    result = {
        "best_workers": best["num_workers"],
        "best_median": best["median"],
        "knee_workers": knee_point["num_workers"],
        "knee_median": knee_point["median"],
        "metric": best["metric"],
        "flags": train_flags(knee_point),
    }
    if default is not None:
        result["default_median"] = default["median"]
        if best["metric"] == "pass_s" and best["median"] > 0:
            result["best_speedup_over_default"] = default["median"] / best["median"]
            result["knee_speedup_over_default"] = default["median"] / knee_point["median"]
    return result


def train_flags(entry: dict) -> str:
    """The train.py flags that reproduce a sweep setting."""
    flags = [f"--num-workers {entry['num_workers']}", f"--per-device-batch-size {entry['batch_size']}"]
    flags.append("--pin-memory" if entry["pin_memory"] else "--pin-memory false")
    if entry["num_workers"] > 0:
        flags.append(f"--prefetch-factor {entry['prefetch_factor']}")
        if entry["persistent_workers"]:
            flags.append("--persistent-workers")
    return " ".join(flags)


# ---------------------------------------------------------------- output


def write_outputs(report: dict, results_dir: Path) -> list[Path]:
    results_dir.mkdir(parents=True, exist_ok=True)
    paths = bench.write_results(results_dir / "loaders", report, markdown(report))
    rows = LoaderSweepView(report).rows
    columns = sorted({k for row in rows for k in row})
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=columns)
    writer.writeheader()
    writer.writerows(rows)
    write_text_atomic(results_dir / "loaders.csv", buffer.getvalue())
    return [*paths, results_dir / "loaders.csv", *save_figure(figure(report), results_dir / "loaders")]


def markdown(report: dict) -> list[str]:
    view = LoaderSweepView(report)
    machine = view.machine
    return document.markdown(
        [
            Heading("DataLoader num_workers sweep"),
            Paragraph(
                f"{view.dataset_rows} training rows; {machine['device_name']}, {machine['usable_cores']} usable cores "
                f"({machine['cpu_budget_per_process']} per training process), {machine['torch_threads']} torch "
                f"threads; {view.repeats} repeats in alternating order; verdicts: {bench.METHOD}."
            ),
            knee_table(report),
            copy_table(report),
        ]
    )


def copy_table(report: dict) -> Table | None:
    """The copy to the device, per setting: the time the loop spent in it per pass, against the pass."""
    rows = [e for e in LoaderSweepView(report).settings_summary if e.get("median_copy_s") is not None]
    if not rows:
        return None
    return Table(
        "The copy to the device",
        ["batch", "pin_memory", "workers", "copy s per pass (median)", "pass s (median)"],
        [
            [
                e["batch_size"],
                "pinned, non-blocking" if e["pin_memory"] else "pageable",
                e["num_workers"],
                f"{e['median_copy_s']:.4f}",
                f"{e['median']:.4f}",
            ]
            for e in rows
        ],  # fmt: skip
        "loaders_copy",
        align="rlrrr",
    )


def print_recommendations(report: dict) -> None:
    for name, curve in LoaderSweepView(report).curves.items():
        if curve["metric"] == "pass_s":
            speedup = curve.get("knee_speedup_over_default")
            gain = f", {speedup:.2f}x the default's speed" if speedup else ""
            print(
                f"{name}: best {curve['best_workers']} workers ({curve['best_median']:.3f} s/pass); "
                f"knee {curve['knee_workers']} workers ({curve['knee_median']:.3f} s{gain})"
            )
        else:
            default = (
                f"{curve['default_median']:.1%} of step time with 0 workers, " if "default_median" in curve else ""
            )
            print(
                f"{name}: data share {default}lowest {curve['best_median']:.1%} with {curve['best_workers']}; "
                f"knee {curve['knee_workers']} workers ({curve['knee_median']:.1%})"
            )
        against = curve.get("knee_against_default")
        if against:
            print(f"  knee against the default: {bench.describe(against)}")
        print(f"  use: {curve['flags']}")
