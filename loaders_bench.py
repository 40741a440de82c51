"""How long does a pass over every training batch take as DataLoader num_workers grows?

PyTorch's DataLoader default is num_workers=0: batches are loaded in the training process itself,
one after the other. This sweep builds the data exactly as train.py does (same dataset,
tokenization, collate) and times full passes for each setting, repeated, in up to four modes:

  pretokenized  the train.py pipeline: cached token ids, padded per batch by the collate function
  device-copy   the same plus the copy of every batch to the device (pinned + non-blocking if asked)
  on-the-fly    raw text, tokenized inside the collate function (in the workers), as pipelines that
                do not pre-tokenize do: real work per batch, where parallel workers pay off
  in-training   a few real training steps per setting (train.py's model and step): the data stage's
                share of step time, i.e. how long the device waits for data

    python loaders_bench.py --workers 0 1 2 4 --repeats 5 --modes pretokenized on-the-fly

Repeats alternate the order of the settings (0 1 2 ... then ... 2 1 0), so drift hits all of them
alike. Writes <results-dir>/loaders.{json,md,csv,png,pdf} with provenance and prints the knee (the
fewest workers within --knee-tolerance of the best) with the flags to use and a verdict: is the
knee faster than PyTorch's default (0 workers) in every repeat, slower, or within noise?
"""

from trainscope.core.script_help import answer_help
from trainscope.experiments.loaders.options import SweepSettings

if __name__ == "__main__":
    answer_help(SweepSettings, __doc__)  # this script's flags, before the imports below load torch (seconds)

import contextlib
import dataclasses
import time
import warnings
from collections.abc import Mapping
from pathlib import Path

import torch

from trainscope.core.errors import UserError, exit_with, redacted_output
from trainscope.experiments.loaders import sweep as loader_sweep
from trainscope.measure import bench
from trainscope.run import startup
from trainscope.workload.data import build_collator, load_classification_data, worker_options
from trainscope.workload.settings import Settings, parse_settings

# ---------------------------------------------------------------- timing one pass


def time_passes(loader, passes: int = 1, to_device=None, synchronize=None) -> list[dict]:
    """Iterate `loader` `passes` times; per pass: wall time, first-batch latency, batches, samples, and with a copy to
    the device `copy_s`: the time the loop spent in the copies and waiting for them (a pageable copy blocks the host
    for its whole transfer; a pinned, non-blocking one returns at once and is waited for only at the pass's end).

    The first batch's latency holds the worker start-up (a fresh iterator forks its workers);
    the steady rate is measured over the remaining batches.
    """
    results = []
    for _ in range(passes):
        started = time.perf_counter()
        first = None
        batches = samples = 0
        copy = 0.0
        for batch in loader:
            if to_device is not None:
                copying = time.perf_counter()
                batch = to_device(batch)
                copy += time.perf_counter() - copying
            if first is None:
                if synchronize:
                    synchronize()
                first = time.perf_counter() - started
            batches += 1
            samples += len(batch["labels"]) if isinstance(batch, Mapping) else len(batch)
        if synchronize:
            waiting = time.perf_counter()
            synchronize()
            copy += time.perf_counter() - waiting
        wall = time.perf_counter() - started
        steady = wall - (first or 0.0)
        results.append(
            {
                "pass_s": wall,
                "first_batch_s": first,
                "batches": batches,
                "samples": samples,
                "copy_s": copy if to_device is not None else None,
                "batches_per_s": batches / wall if wall > 0 else None,
                "samples_per_s": samples / wall if wall > 0 else None,
                "steady_batches_per_s": (batches - 1) / steady if batches > 1 and steady > 0 else None,
            }
        )
    return results


# ---------------------------------------------------------------- the sweep


def make_loader(dataset, collate, batch_size, point, settings, pin_memory, seed):
    """One setting's DataLoader, its worker options made as train.py makes them (trainscope.workload.data.worker_options)."""
    loader_settings = dataclasses.replace(
        settings,
        num_workers=point["num_workers"],
        prefetch_factor=point["prefetch_factor"] if point["num_workers"] else None,
        persistent_workers=point["persistent_workers"] and point["num_workers"] > 0,
    )
    return torch.utils.data.DataLoader(
        dataset,
        batch_size=batch_size,
        shuffle=True,
        collate_fn=collate,
        generator=torch.Generator().manual_seed(seed),
        **worker_options(loader_settings, pin_memory),
    )


def measure_point(point, repeat, sweep, settings, data, tokenizer, raw_train, trainer, device) -> list[dict]:
    """The rows of one setting in one repeat: a training measurement or one row per timed pass."""
    pin_memory = loader_sweep.pin_memory_of(point, device)
    base = {**point, "pin_memory": pin_memory, "repeat": repeat}
    dataset, collate = raw_train if point["mode"] == "on-the-fly" else (data.train, build_collator(tokenizer, settings))
    loader = make_loader(dataset, collate, point["batch_size"], point, settings, pin_memory, settings.seed)
    if point["mode"] == "in-training":
        return [{**base, **trainer.measure(loader, sweep.train_steps)}]
    to_device = loader_sweep.device_copier(device, pin_memory) if point["mode"] == "device-copy" else None
    synchronize = torch.cuda.synchronize if device.type == "cuda" and to_device else None
    return [
        {**base, "pass": i, **timing}
        for i, timing in enumerate(time_passes(loader, sweep.passes, to_device, synchronize))
    ]


def run_sweep(settings: Settings, sweep: SweepSettings) -> dict:
    """Every setting of the grid, once per repeat, in alternating order (drift hits all of them alike)."""
    from trainscope.workload.modeling import build_tokenizer

    threads = startup.configure_process(settings)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    tokenizer = build_tokenizer(settings)
    data = load_classification_data(settings, tokenizer, contextlib.nullcontext)
    raw_train = loader_sweep.raw_training_rows(settings, data) if "on-the-fly" in sweep.modes else None
    trainer = loader_sweep.InTraining(settings, data, tokenizer, device) if "in-training" in sweep.modes else None
    budget = loader_sweep.cpu_budget(threads["usable_cores"], sweep)
    grid = list(loader_sweep.settings_grid(sweep, settings))
    rows = []
    for repeat in range(sweep.repeats):
        for index, point in enumerate(bench.round_order(grid, repeat), 1):
            rows += measure_point(point, repeat, sweep, settings, data, tokenizer, raw_train, trainer, device)
            print(loader_sweep.progress(point, rows[-1], repeat, index, sweep, len(grid)), flush=True)
    return loader_sweep.build_report(settings, sweep, device, threads, budget, len(data.train), rows)


def main(argv=None) -> None:
    answer_help(SweepSettings, __doc__, argv)
    with redacted_output():
        settings, sweep = parse_settings(SweepSettings, argv=argv, description=__doc__)
        warnings.filterwarnings("ignore", message=".*This DataLoader will create.*")
        try:
            report = run_sweep(settings, sweep)
        except UserError as error:
            exit_with(error)
        paths = loader_sweep.write_outputs(report, Path(sweep.results_dir))
        loader_sweep.print_recommendations(report)
        print("wrote " + ", ".join(str(p) for p in paths))


if __name__ == "__main__":
    main()
