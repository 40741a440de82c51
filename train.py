"""Fine-tune a transformer text classifier and measure where the time and memory go.

The same script runs on a CPU, one GPU, several GPUs (DDP, FSDP) and in fp16/bf16; only the
Accelerate config changes:

    python train.py                                    # embedded MiniLM-L6 on the embedded tweets
    python train.py --predict                          # its peak memory, step and run time predicted; nothing trained
    accelerate launch --config_file accelerate_configs/ddp_fp16.yaml train.py --model roberta-base --dataset glue/sst2

Every run writes runs/<run-name>/record.json (settings, environment, provenance, stage timing per
rank, throughput, memory, accuracy, warnings) and steps.jsonl; docs/RECORD.md describes them.
"""

import sys

import torch

from trainscope import dropout_draws, liveness, predict, startup
from trainscope.data import build_dataloaders, load_classification_data
from trainscope.errors import Fault, UserError, exit_with, redacted_output
from trainscope.lifecycle import RunLifecycle
from trainscope.loop import evaluate_split, load_metric, train_step
from trainscope.modeling import (
    build_model,
    build_optimizer,
    build_scheduler,
    build_tokenizer,
    fsdp_wrap_rule,
    optimizer_facts,
)
from trainscope.run_metrics import NonFiniteLoss, RunMetrics
from trainscope.settings import Settings, parse_settings


def main(argv: list[str] | None = None) -> None:
    with redacted_output():
        (settings,) = parse_settings(argv=argv, description=__doc__)
        try:
            train(settings)
        except UserError as error:
            exit_with(error, code=2)
        except (NonFiniteLoss, torch.OutOfMemoryError, Fault) as error:  # Fault: a lost peer, a full disk...
            exit_with(error, code=1)
        except KeyboardInterrupt:  # before the run could handle it: nothing was recorded yet
            exit_with(UserError("interrupted while starting: no run was recorded"), code=130)
        except Exception as error:  # before the loop: a peer that failed or vanished, named through the store
            fault = liveness.explain(error, settings.distributed_timeout)
            if fault is None:
                raise
            exit_with(fault, code=1)


def train(settings: Settings) -> dict:
    # ---------------------------------------------------------------- set-up
    started = startup.start(settings)  # process group, CPU threads, seed, TF32, sequence limit, run folder
    settings = started.settings
    tokenizer = build_tokenizer(settings)
    data = load_classification_data(settings, tokenizer, started.state.main_process_first)
    # Peak memory, step and run time predicted before the model exists (trainscope/predict.py); --predict stops here.
    prediction = predict.before_run(settings, started, tokenizer, data)
    if settings.predict:
        return predict.show(prediction, settings, started)
    plan = startup.plan_steps(settings, len(data.train), started.state.num_processes)
    model, model_facts = build_model(settings, data.label_names, tokenizer)
    accelerator = startup.build_accelerator(settings, started)
    train_loader, validation_loader, test_loader = build_dataloaders(
        data, tokenizer, settings, **startup.device_loader_options(settings, accelerator)
    )
    optimizer = build_optimizer(model, settings, accelerator.device)
    model_facts.update(optimizer=optimizer_facts(optimizer), fsdp_wrap=fsdp_wrap_rule(model, accelerator))
    if "unpad" in model_facts:  # how its dropout masks are drawn: built and checked here, before the first step
        model_facts["unpad"]["dropout_draws"] = dropout_draws.status(accelerator.device)
    # Accelerate steps a prepared scheduler once per process for every optimizer step.
    scheduler = build_scheduler(
        settings,
        optimizer,
        plan["optimizer_steps"] * accelerator.num_processes,
        int(settings.warmup_fraction * plan["optimizer_steps"]) * accelerator.num_processes,
    )
    model_config = model.config  # before prepare() wraps it (DDP, FSDP, compile)
    model, optimizer, train_loader, validation_loader, test_loader, scheduler = accelerator.prepare(
        model, optimizer, train_loader, validation_loader, test_loader, scheduler
    )
    metric = load_metric()
    metrics = RunMetrics(accelerator, started, plan, model_config, scheduler, prediction)  # measures and summarizes
    metrics.attach(model, optimizer)
    run = RunLifecycle(accelerator, started, plan)  # the record; resume, checkpoints, signals, the ending
    run.open(metrics, model_facts, data.record_facts(), prediction)

    # ---------------------------------------------------------------- the timed loop
    # Stages: `data` around next(batches) in train_epoch; `forward`, `backward` (loss + backward) and `optimizer`
    # inside train_step (trainscope/loop.py); `eval` in metrics.evaluation() below; the rest is `other`.
    # run.check(), run.step_finished() and run.between_batches() (evaluation) are where a Ctrl-C or SIGTERM
    # stops the run, its state whole.
    model.train()
    with run.ending():  # interrupted, failed or complete: the record says which
        metrics.start()
        with metrics.profiler:
            for epoch in range(metrics.loop.epoch, plan["epochs"]):
                batches = run.batches(train_loader, epoch)
                train_epoch(accelerator, model, batches, optimizer, scheduler, settings.max_grad_norm, metrics, run)
                with metrics.evaluation():
                    run.evaluated(
                        epoch, evaluate_split(model, validation_loader, accelerator, metric, run.between_batches)
                    )
                if metrics.done:
                    break
            with metrics.evaluation():
                test_scores = evaluate_split(model, test_loader, accelerator, metric, run.between_batches)

        # ---------------------------------------------------------------- summary
        return run.finish(test_scores)  # reads the last stop vote, gathers every rank, writes the record, the table


def train_epoch(accelerator, model, batches, optimizer, scheduler, max_grad_norm, metrics, run) -> None:
    """Train on the epoch's batches until they run out or the run is done (its steps, or a stop)."""
    while not metrics.done:
        run.check()
        with metrics.stage("data"):
            batch = next(batches, None)
        if batch is None:
            break
        loss, labels = train_step(
            accelerator,
            model,
            batch,
            optimizer,
            scheduler,
            metrics.stage,
            max_grad_norm,
            metrics.skips,
            metrics.communication,
        )
        if metrics.micro_batch(batch, loss, labels):
            run.step_finished()  # step line, checkpoint when due, the stop vote


if __name__ == "__main__":
    sys.exit(main())
