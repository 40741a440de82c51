"""train.py's workload, the pieces it is built from: a transformers sequence classifier (BERT/RoBERTa-like encoders,
LoRA through peft) fine-tuned on a text classification dataset. train.py imports these and trainscope.Run only."""

from trainscope import predict
from trainscope.core.settings import Settings, parse_settings, plan_steps
from trainscope.run.loop import evaluate_split, load_metric
from trainscope.run.startup import build_accelerator, device_loader_options, start
from trainscope.workload import dropout_draws
from trainscope.workload.data import build_dataloaders, load_classification_data
from trainscope.workload.modeling import (
    build_model,
    build_optimizer,
    build_scheduler,
    build_tokenizer,
    classification_loss,
    fsdp_wrap_rule,
    optimizer_facts,
)

__all__ = [
    "Settings",
    "build_accelerator",
    "build_dataloaders",
    "build_model",
    "build_optimizer",
    "build_scheduler",
    "build_tokenizer",
    "classification_loss",
    "device_loader_options",
    "dropout_draws",
    "evaluate_split",
    "fsdp_wrap_rule",
    "load_classification_data",
    "load_metric",
    "optimizer_facts",
    "parse_settings",
    "plan_steps",
    "predict",
    "start",
]


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
