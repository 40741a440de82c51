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


def main(argv: list[str] | None = None) -> None:
    with trainscope.one_line_endings() as ending:  # bad input, a fault: one line and an exit status, no traceback
        (settings,) = trainscope.parse_settings(argv=argv, description=__doc__)  # --help answers before torch loads
        ending.distributed_timeout = settings.distributed_timeout
        train(settings)


def train(settings) -> dict:
    from trainscope import classifier as task  # the workload's pieces: torch, transformers' models, datasets

    # ---------------------------------------------------------------- set-up
    started = task.start(settings)  # process group, CPU threads, seed, TF32, run folder, sequence limit
    settings = started.settings  # --max-seq-length clamped to the model's positions
    tokenizer = task.build_tokenizer(settings)
    data = task.load_classification_data(settings, tokenizer, started.state.main_process_first)
    # Peak memory, step and run time predicted before the model exists (trainscope/predict/__init__.py); --predict stops here.
    prediction = task.predict.before_run(settings, started, tokenizer, data)
    if settings.predict:
        return task.predict.show(prediction, settings, started)
    task.announce(settings, started, len(data.train), prediction)  # a CPU and the whole corpus: says so, and how long
    # The step plan, model, Accelerator, loaders, AdamW and its schedule, through accelerator.prepare (DDP, FSDP, ...)
    training = task.build_training(settings, started, tokenizer, data)
    accelerator, model, plan = training.accelerator, training.model, training.plan
    metric = task.load_metric()
    # The instrument (trainscope.Run, docs/instrument.md): stage clocks, memory, communication, the record, the
    # endings (resume, checkpoints, signals), as any loop gets it; its driver names train.py's flags and adds the
    # classifier's prediction and probes.
    driver = task.ClassifierDriver(settings, prediction)
    run = trainscope.Run.from_started(training.prepared, started, task.facts(training, data), driver)

    # ---------------------------------------------------------------- the timed loop
    # A Ctrl-C or SIGTERM stops the run where its state is whole: before a step's first batch (run.data), after its
    # optimizer step (run.count_micro_batch), between evaluation batches (run.between_batches).
    model.train()
    with run:  # interrupted, failed or complete: the record says which
        for epoch in range(run.epoch, plan["epochs"]):
            for batch in run.data(training.train_loader, epoch):  # the wait for each batch: stage `data`
                # forward, loss + backward (DDP's exposed communication stamped at its end), clip, AdamW's step and
                # the schedule's, each its stage; inside an accumulation window no all-reduce and no step
                loss, _ = task.train_step(
                    accelerator, model, batch, training.optimizer, training.scheduler, run.stage,
                    settings.max_grad_norm, run.backward,
                )  # fmt: skip
                run.count_micro_batch(batch, loss)  # samples, tokens, FLOPs; a step's end: step line, checkpoint, vote
            with run.evaluation():
                run.evaluated(
                    task.evaluate_split(model, training.validation_loader, accelerator, metric, run.between_batches)
                )
            if run.done:
                break
        with run.evaluation():
            test_scores = task.evaluate_split(model, training.test_loader, accelerator, metric, run.between_batches)
        # ---------------------------------------------------------------- summary
        return run.finish(test_scores)  # reads the last stop vote, gathers every rank, writes the record, the table


if __name__ == "__main__":
    sys.exit(main())
