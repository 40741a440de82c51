"""nn.DataParallel against DistributedDataParallel, measured on the same model, data and steps.

Three explicit loops, written to differ only where the parallelism differs (the diffs are part of
the output): one device; torch.nn.DataParallel (one process, the batch scattered over the GPUs,
outputs gathered on GPU 0); DDP with plain torch.distributed (one process per device, each with its
own shard of every global batch, gradients all-reduced). Same model, seed, global batch, samples and
optimizer steps; dropout is off so the three compute the same function and their losses can be
compared step by step. The first --warmup-steps steps (allocations, DataParallel's replicas, the
process group's first collectives) are outside the timed window; DDP's time is its slowest rank's.

Fair hardware: on GPUs, one device against N devices (efficiency = speed-up / N). On a CPU there
are no extra devices, only the same cores: one process with all of them as threads against N
processes with cores/N threads each, so the question is how well DDP uses the same cores.
Rounds alternate the variants; each comparison is a median of per-round ratios with a verdict.

    python compare_dp.py [--steps 20 --global-batch-size 32 --ddp-processes 2 --rounds 5] [train.py flags]

DataParallel needs at least two CUDA devices; with fewer it is reported as not measurable here.
Writes <results-dir>/compare_dp.{json,md,tex,png,pdf} and the two diffs.
"""

from trainscope.core.script_help import answer_help
from trainscope.experiments.data_parallel.options import CompareSettings

if __name__ == "__main__":
    answer_help(CompareSettings, __doc__)  # this script's flags, before the imports below load torch (seconds)

import contextlib
import json
import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

from trainscope.core.distributed import destroy_process_group
from trainscope.core.errors import UserError, exit_with, redacted_output
from trainscope.core.paths import ROOT
from trainscope.experiments.data_parallel import loops as dp_compare
from trainscope.experiments.data_parallel.loops import (
    NotMeasurable,
    StepClock,
    average_over_ranks,
    bind,
    devices_of,
    gather_floats,
    process_group_arguments,
    run_variant,
    worker_device,
)
from trainscope.measure import bench
from trainscope.run import startup
from trainscope.workload.data import build_collator, load_classification_data
from trainscope.workload.modeling import build_model, build_tokenizer
from trainscope.workload.settings import parse_settings

# ---------------------------------------------------------------- the three loops


def single_device(model, dataset, collate, global_batch, lr, seed, warmup):
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model = model.to(device)
    sampler = torch.utils.data.RandomSampler(dataset, generator=torch.Generator().manual_seed(seed))
    loader = torch.utils.data.DataLoader(
        dataset, batch_size=global_batch, sampler=sampler, collate_fn=collate, drop_last=True
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    clock = StepClock(warmup, [device])
    for batch in loader:
        batch = {k: v.to(device) for k, v in batch.items()}
        labels = batch.pop("labels")
        logits = model(**batch).logits
        loss = F.cross_entropy(logits.float(), labels)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        clock.step(loss)
    return clock.finish()


def data_parallel(model, dataset, collate, global_batch, lr, seed, warmup, min_gpus=2):
    if torch.cuda.device_count() < min_gpus:
        raise NotMeasurable(
            f"nn.DataParallel needs at least {min_gpus} CUDA devices; this machine has {torch.cuda.device_count()}"
        )
    device = torch.device("cuda:0" if torch.cuda.is_available() else "cpu")
    model = torch.nn.DataParallel(model.to(device))  # scatters each batch, gathers outputs on cuda:0
    sampler = torch.utils.data.RandomSampler(dataset, generator=torch.Generator().manual_seed(seed))
    loader = torch.utils.data.DataLoader(
        dataset, batch_size=global_batch, sampler=sampler, collate_fn=collate, drop_last=True
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    clock = StepClock(warmup, devices_of(model))
    for batch in loader:
        batch = {k: v.to(device) for k, v in batch.items()}
        labels = batch.pop("labels")
        logits = model(**batch).logits
        loss = F.cross_entropy(logits.float(), labels)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        clock.step(loss)
    return clock.finish()


def distributed_data_parallel(model, dataset, collate, global_batch, lr, seed, warmup):
    device = worker_device(int(os.environ["LOCAL_RANK"]), torch.cuda.is_available())
    bind(device)  # before the process group: NCCL and barrier() work on the current device
    torch.distributed.init_process_group(**process_group_arguments(device))
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    model = torch.nn.parallel.DistributedDataParallel(
        model.to(device), device_ids=[device] if device.index is not None else None
    )
    sampler = torch.utils.data.DistributedSampler(dataset, num_replicas=world, rank=rank, shuffle=True, seed=seed)
    loader = torch.utils.data.DataLoader(
        dataset, batch_size=global_batch // world, sampler=sampler, collate_fn=collate, drop_last=True
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    clock = StepClock(warmup, [device], barrier=torch.distributed.barrier)  # all ranks start timing together
    for batch in loader:
        batch = {k: v.to(device) for k, v in batch.items()}
        labels = batch.pop("labels")
        logits = model(**batch).logits
        loss = F.cross_entropy(logits.float(), labels)
        loss.backward()  # DDP all-reduces (averages) gradients in buckets during backward
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        clock.step(loss)
    result = clock.finish()
    result["world_size"] = world
    result["losses"] = average_over_ranks(result["losses"], device)  # each rank saw its own shard
    result["per_rank_wall_s"] = gather_floats(result["wall_s"], device)
    result["wall_s"] = max(result["per_rank_wall_s"])  # the step ends when the slowest rank's does
    destroy_process_group()
    return result


# ---------------------------------------------------------------- inputs, DDP worker and main


def prepare_inputs(settings, compare):
    """Model (dropout off) and exactly (warm-up + steps) x global-batch training rows, built as train.py builds them."""
    tokenizer = build_tokenizer(settings)
    data = load_classification_data(settings, tokenizer, contextlib.nullcontext)
    dataset, collate = dp_compare.training_rows(data.train, compare), build_collator(tokenizer, settings)

    def fresh_model():
        torch.manual_seed(settings.seed)
        model, facts = build_model(settings, data.label_names, tokenizer)
        for module in model.modules():
            if isinstance(module, torch.nn.Dropout):
                module.p = 0.0  # dropout masks would differ between one big and two half batches
        return model, facts

    return fresh_model, dataset, collate


def ddp_worker(settings, compare) -> None:
    startup.configure_process(settings)  # cores / processes threads each (torchrun sets LOCAL_WORLD_SIZE)
    fresh_model, dataset, collate = prepare_inputs(settings, compare)
    result = run_variant(distributed_data_parallel, settings, compare, fresh_model, dataset, collate)
    if int(os.environ.get("RANK", "0")) == 0:
        Path(compare.result_file).write_text(json.dumps(result))


def launch_ddp(processes: int, argv: list[str], global_batch: int) -> dict:
    """torchrun one DDP worker per device, each running this file's distributed_data_parallel loop."""
    return dp_compare.launch_ddp(ROOT / "compare_dp.py", processes, argv, global_batch)


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    answer_help(CompareSettings, __doc__, argv)
    with redacted_output():
        settings, compare = parse_settings(CompareSettings, argv=argv, description=__doc__)
        if compare.role == "ddp-worker":
            return ddp_worker(settings, compare)
        try:
            report = compare_all(settings, compare, argv)
        except UserError as error:
            exit_with(error)
        for path in dp_compare.write_outputs(report, Path(compare.results_dir)):
            print(f"wrote {path}")
        print((Path(compare.results_dir) / "compare_dp.md").read_text())


def compare_all(settings, compare, argv) -> dict:
    """The three loops in alternating rounds on the same model, data and global batch."""
    gpus = torch.cuda.device_count()
    processes = compare.ddp_processes or (gpus if gpus else 2)
    note = dp_compare.plan_batch(compare, processes)  # a global batch that splits evenly over the processes
    threads = startup.configure_process(settings)  # the single process gets every core as threads
    fresh_model, dataset, collate = prepare_inputs(settings, compare)
    arms = {
        "single": lambda i: run_variant(single_device, settings, compare, fresh_model, dataset, collate),
        "ddp": lambda i: launch_ddp(processes, argv, compare.global_batch_size),
    }
    if gpus >= 2:
        arms["data_parallel"] = lambda i: run_variant(data_parallel, settings, compare, fresh_model, dataset, collate)
    rounds = bench.alternate(arms, compare.rounds)
    loops = (single_device, data_parallel, distributed_data_parallel)
    return dp_compare.build_report(settings, compare, rounds, gpus, processes, threads["usable_cores"], note, loops)


if __name__ == "__main__":
    main()
