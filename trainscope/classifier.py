"""train.py's workload, the pieces it is built from: a transformers sequence classifier (BERT/RoBERTa-like encoders,
LoRA through peft) fine-tuned on a text classification dataset, its one training step and evaluation, and its driver
of trainscope.Run: its flags' words, and what it adds to the record (the prediction and its check, one layer probed
at the run's shapes, the sequence limit). train.py imports these and trainscope.Run only;
the overhead benchmark's bare loop builds the same."""

import contextlib
import dataclasses

from trainscope import predict
from trainscope.instrument import Prepared, TrainingFacts
from trainscope.measure import profiling
from trainscope.measure.shapes import encoder_shape
from trainscope.run import startup
from trainscope.run.driver import Driver
from trainscope.run.startup import build_accelerator, device_loader_options
from trainscope.workload import dropout_draws, unpad
from trainscope.workload.data import build_dataloaders, dropped_rows_lines, load_classification_data
from trainscope.workload.modeling import (
    build_model,
    build_optimizer,
    build_scheduler,
    build_tokenizer,
    classification_loss,
    dropout_facts,
    fsdp_wrap_rule,
    optimizer_facts,
    sequence_limit,
)
from trainscope.workload.settings import Settings, parse_settings, plan_steps
from trainscope.workload.step import evaluate_split, load_metric, train_step, unmeasured

__all__ = ["ClassifierDriver", "Settings", "Training", "build_accelerator", "build_dataloaders",
           "build_model", "build_optimizer", "build_scheduler", "build_tokenizer", "build_training",
           "classification_loss", "device_loader_options", "dropout_draws", "evaluate_split",
           "fsdp_wrap_rule", "load_classification_data", "load_metric", "optimizer_facts",
           "parse_settings", "plan_steps", "predict", "start", "train_step", "unmeasured"]  # fmt: skip


EXISTS = "pass --overwrite, --resume or another --run-name"  # where the run folder exists already


def start(settings: Settings):
    """train.py's start-up (trainscope.run.startup.start): process group, CPU threads, seed, TF32, the run folder,
    --max-seq-length clamped to the model's positions (said by the max_seq_length_clamped warning)."""
    started = startup.start(settings, exists=EXISTS)
    limit = sequence_limit(settings)  # the workload's to read: it loads the model's config
    if limit is not None and settings.max_seq_length > limit:
        started.settings = dataclasses.replace(settings, max_seq_length=limit)
    started.facts.update(requested_max_seq_length=settings.max_seq_length, model_sequence_limit=limit)
    return started


def announce(settings: Settings, started, rows: int, prediction: dict | None) -> None:
    """On a CPU with the whole corpus (no --max-train-samples), one line first: what is about to train, how long the
    prediction says it takes, and make train's subset."""
    if started.state.device.type != "cpu" or settings.max_train_samples is not None or settings.predict:
        return
    if not started.state.is_main_process:
        return
    run_s = ((prediction or {}).get("time") or {}).get("run_s")
    how_long = f"about {run_s / 60:.0f} min predicted" if run_s else "this may take long"
    print(
        f"training on all {rows:,} rows on a CPU ({how_long}); make train trains a subset: --max-train-samples 4000 "
        "--max-eval-samples 1000 --max-test-samples 2000",
        flush=True,
    )


@dataclasses.dataclass
class Training:
    """The prepared pieces of train.py's run: what its loop, and the overhead benchmark's bare loop, train."""

    accelerator: object
    model: object
    optimizer: object
    scheduler: object
    train_loader: object
    validation_loader: object
    test_loader: object
    plan: dict
    model_config: object  # taken before prepare() wraps the model (DDP, FSDP, compile)
    model_facts: dict

    @property
    def prepared(self) -> Prepared:
        return Prepared(self.accelerator, self.model, self.optimizer, self.scheduler)


def build_training(settings: Settings, started, tokenizer, data) -> Training:
    """The step plan, the model, the Accelerator, the loaders, AdamW and the schedule, prepared: train.py's set-up
    after its data, shared with the bare loop it is measured against."""
    plan = plan_steps(settings, len(data.train), started.state.num_processes)
    model, model_facts = build_model(settings, data.label_names, tokenizer)
    accelerator = build_accelerator(settings, started)
    loaders = build_dataloaders(data, tokenizer, settings, **device_loader_options(settings, accelerator))
    optimizer = build_optimizer(model, settings, accelerator.device)
    model_facts.update(optimizer=optimizer_facts(optimizer), fsdp_wrap=fsdp_wrap_rule(model, accelerator))
    if "unpad" in model_facts:  # how its dropout masks are drawn: built and checked here, before the first step
        model_facts["unpad"]["dropout_draws"] = dropout_draws.status(accelerator.device)
    # Accelerate steps a prepared scheduler once per process for every optimizer step.
    steps, processes = plan["optimizer_steps"], accelerator.num_processes
    scheduler = build_scheduler(
        settings, optimizer, steps * processes, int(settings.warmup_fraction * steps) * processes
    )
    config = model.config
    model, optimizer, *loaders, scheduler = accelerator.prepare(model, optimizer, *loaders, scheduler)
    return Training(accelerator, model, optimizer, scheduler, *loaders, plan, config, model_facts)


def facts(training: Training, data) -> TrainingFacts:
    """What train.py's run tells trainscope.Run beyond its prepared objects."""
    return TrainingFacts(training.model_config, training.plan, training.model_facts, data.record_facts())


class ClassifierDriver(Driver):
    """train.py driving trainscope.Run: its lines name its flags, and its classifier adds to the record the
    prediction made before the run and its check, one encoder layer profiled at the run's shapes and the data's
    dropped rows."""

    def __init__(self, settings: Settings, prediction: dict | None):
        super().__init__(
            api="train.py",
            options="flags",
            not_available={},
            unpadded=settings.unpad,
            resume="--resume --run-name {name}",
            exists=EXISTS,
            out_of_memory=f"out of memory at --per-device-batch-size {settings.per_device_batch_size} (step {{step}}): "
            "halve it and double --gradient-accumulation-steps, or add --gradient-checkpointing, a bf16/fp16 config "
            "or --lora",
            non_finite="lower --learning-rate, keep --max-grad-norm, or use bf16 instead of fp16",
            stop_on_non_finite=settings.stop_on_non_finite_loss,
        )
        self.settings, self.prediction = settings, prediction

    def prediction_check(self):
        return predict.PredictionCheck(self.prediction, self.settings)

    def layer_breakdown(self, metrics, batch: int, length: int, precision_name: str):
        config, settings, device = metrics.model_config, self.settings, metrics.accelerator.device
        shape = encoder_shape(config)
        if shape is None:
            return None
        unpadded = settings.unpad
        dropout = dropout_facts(config)
        name = (
            f"layer {config.model_type} {'x'.join(map(str, shape))} dropout {dropout['hidden']}/"
            f"{dropout['attention']} {settings.attn_implementation} {precision_name} {batch}x{length}"
            + (" unpad" if unpadded else "")
        )

        def measure():  # a padding-free layer probed on `batch` sequences of `length` real tokens
            with (
                unpad.probing(metrics.model, batch, length, device)
                if unpadded
                else contextlib.nullcontext((batch, length))
            ) as (probe_batch, probe_length):
                found = profiling.layer_breakdown(metrics.model, probe_batch, probe_length, precision_name, device)
            return {**found, "batch": batch, "length": length, "unpad": unpadded} if found else found

        return name, measure

    def summarized(self, check, result: dict, started) -> None:
        predict.remember_communication(check, result, self.settings, started)

    def announcements(self, data_facts: dict) -> list[str]:
        return dropped_rows_lines(data_facts.get("dropped_rows") or {})
