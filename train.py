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

import trainscope
from trainscope import classifier as task


def main(argv: list[str] | None = None) -> None:
    with trainscope.one_line_endings() as ending:  # bad input, a fault: one line and an exit status, no traceback
        (settings,) = task.parse_settings(argv=argv, description=__doc__)
        ending.distributed_timeout = settings.distributed_timeout
        train(settings)


def train(settings: task.Settings) -> dict:
    # ---------------------------------------------------------------- set-up
    started = task.start(settings)  # process group, CPU threads, seed, TF32, sequence limit, run folder
    settings = started.settings
    tokenizer = task.build_tokenizer(settings)
    data = task.load_classification_data(settings, tokenizer, started.state.main_process_first)
    # Peak memory, step and run time predicted before the model exists (trainscope/predict/__init__.py); --predict stops here.
    prediction = task.predict.before_run(settings, started, tokenizer, data)
    if settings.predict:
        return task.predict.show(prediction, settings, started)
    task.announce(settings, started, len(data.train), prediction)  # a CPU and the whole corpus: says so, and how long
    plan = task.plan_steps(settings, len(data.train), started.state.num_processes)
    model, model_facts = task.build_model(settings, data.label_names, tokenizer)
    accelerator = task.build_accelerator(settings, started)
    train_loader, validation_loader, test_loader = task.build_dataloaders(
        data, tokenizer, settings, **task.device_loader_options(settings, accelerator)
    )
    optimizer = task.build_optimizer(model, settings, accelerator.device)
    model_facts.update(optimizer=task.optimizer_facts(optimizer), fsdp_wrap=task.fsdp_wrap_rule(model, accelerator))
    if "unpad" in model_facts:  # how its dropout masks are drawn: built and checked here, before the first step
        model_facts["unpad"]["dropout_draws"] = task.dropout_draws.status(accelerator.device)
    # Accelerate steps a prepared scheduler once per process for every optimizer step.
    scheduler = task.build_scheduler(
        settings,
        optimizer,
        plan["optimizer_steps"] * accelerator.num_processes,
        int(settings.warmup_fraction * plan["optimizer_steps"]) * accelerator.num_processes,
    )
    model_config = model.config  # before prepare() wraps it (DDP, FSDP, compile)
    model, optimizer, train_loader, validation_loader, test_loader, scheduler = accelerator.prepare(
        model, optimizer, train_loader, validation_loader, test_loader, scheduler
    )
    metric = task.load_metric()
    # The instrument (trainscope.Run, docs/instrument.md): stage clocks, memory, communication, the record, the
    # endings (resume, checkpoints, signals), as any loop gets it.
    run = trainscope.Run.from_started(
        accelerator, model, optimizer, scheduler, started, plan, model_config, model_facts, data.record_facts(),
        prediction,
    )  # fmt: skip

    # ---------------------------------------------------------------- the timed loop
    # A Ctrl-C or SIGTERM stops the run where its state is whole: before a step's first batch (run.data), after its
    # optimizer step (run.step), between evaluation batches (run.between_batches).
    model.train()
    with run:  # interrupted, failed or complete: the record says which
        for epoch in range(run.epoch, plan["epochs"]):
            for batch in run.data(train_loader, epoch):  # the wait for each batch: stage `data`
                labels = batch.pop("labels")
                with accelerator.accumulate(model):  # inside an accumulation window: no all-reduce, no step
                    with run.stage("forward"):
                        logits = model(**batch).logits
                    with run.stage("backward"):
                        loss = task.classification_loss(logits, labels)  # fp32 cross-entropy
                        run.backward(loss)  # accelerator.backward; DDP's exposed communication stamped at its end
                    with run.stage("optimizer"):
                        if accelerator.sync_gradients and settings.max_grad_norm:
                            accelerator.clip_grad_norm_(model.parameters(), settings.max_grad_norm)
                        optimizer.step()
                        scheduler.step()
                        optimizer.zero_grad(set_to_none=True)
                run.step(batch, loss)  # samples, tokens, FLOPs; at a step's end: step line, checkpoint, stop vote
            with run.evaluation():
                run.evaluated(task.evaluate_split(model, validation_loader, accelerator, metric, run.between_batches))
            if run.done:
                break
        with run.evaluation():
            test_scores = task.evaluate_split(model, test_loader, accelerator, metric, run.between_batches)
        # ---------------------------------------------------------------- summary
        return run.finish(test_scores)  # reads the last stop vote, gathers every rank, writes the record, the table


if __name__ == "__main__":
    sys.exit(main())
