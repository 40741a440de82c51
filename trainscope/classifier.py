"""train.py's workload, the pieces it is built from: a transformers sequence classifier (BERT/RoBERTa-like encoders,
LoRA through peft) fine-tuned on a text classification dataset. train.py imports these and trainscope.Run only."""

from trainscope import dropout_draws, predict
from trainscope.data import build_dataloaders, load_classification_data
from trainscope.loop import classification_loss, evaluate_split, load_metric
from trainscope.modeling import (
    build_model,
    build_optimizer,
    build_scheduler,
    build_tokenizer,
    fsdp_wrap_rule,
    optimizer_facts,
)
from trainscope.settings import Settings, parse_settings
from trainscope.startup import build_accelerator, device_loader_options, plan_steps, start

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
