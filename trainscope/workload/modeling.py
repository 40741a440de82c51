"""Model: a name or path -> tokenizer and sequence classifier, with optional LoRA and checkpointing."""

import contextlib
import math
import os
from pathlib import Path

import torch
import torch.nn.functional as F
from transformers import AutoConfig, AutoModelForSequenceClassification, AutoTokenizer

from trainscope.core.errors import UserError
from trainscope.core.records import redact
from trainscope.measure.layers import transformer_layer_classes
from trainscope.measure.shapes import shape_facts
from trainscope.workload import embedded, hub, unpad
from trainscope.workload.settings import EMBEDDED_MODEL

TINY_MODEL = "embedded:tiny-bert"
EMBEDDED_MODELS = (EMBEDDED_MODEL, TINY_MODEL)
# Architectures peft has no default LoRA targets for.
EXTRA_LORA_TARGETS = {"distilbert": ["q_lin", "v_lin"]}
# Models whose position ids start after the padding index (fairseq's convention): fewer usable positions.
PADDING_OFFSET_POSITIONS = tuple(
    "roberta xlm-roberta xlm-roberta-xl camembert longformer data2vec-text roberta-prelayernorm".split()
)
# Configuration attributes that set dropout, by what they drop (BERT and RoBERTa, DistilBERT, GPT-2 style names).
DROPOUT_ATTRIBUTES = {
    "hidden": (
        "hidden_dropout_prob",
        "dropout",
        "hidden_dropout",
        "resid_pdrop",
        "embd_pdrop",
        "seq_classif_dropout",
        "classifier_dropout",
    ),
    "attention": ("attention_probs_dropout_prob", "attention_dropout", "attn_pdrop"),
}


def _is_local(name: str) -> bool:
    return Path(name).expanduser().exists()


def _from_hub_or_path(load, name: str, what: str, **kwargs):
    """Run a from_pretrained-style loader; a missing model becomes one line that says what to do."""
    local = _is_local(name)
    if name.startswith((".", "/", "~")) and not local:
        raise UserError(f"no such {what} directory: {name}")
    with contextlib.nullcontext(False) if local else hub.offline_if_unreachable() as offline:
        try:
            return load(str(Path(name).expanduser()) if local else name, **kwargs)
        except (OSError, ValueError) as error:
            if "trust_remote_code" in str(error):
                raise UserError(
                    f"{what} {redact(name)!r} runs its own code on loading: pass --trust-remote-code "
                    "only if you trust it"
                ) from None
            where = "in the local Hugging Face cache (the Hub is unreachable)" if offline else "on the Hub or on disk"
            first_line = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
            raise UserError(redact(f"{what} {name!r} not found {where}: {first_line}")) from None


def build_tokenizer(settings):
    name = settings.tokenizer or settings.model
    if name in EMBEDDED_MODELS:
        return AutoTokenizer.from_pretrained(embedded.minilm_dir())
    if name.startswith("embedded:"):
        raise UserError(f"unknown embedded tokenizer {name!r}: use {EMBEDDED_MODEL}")
    if settings.architecture_only and settings.tokenizer is None:
        try:
            return _from_hub_or_path(AutoTokenizer.from_pretrained, name, "tokenizer")
        except UserError as error:
            raise UserError(
                f"{error} -- with --architecture-only, --tokenizer {EMBEDDED_MODEL} works offline"
            ) from None
    return _from_hub_or_path(
        AutoTokenizer.from_pretrained, name, "tokenizer", trust_remote_code=settings.trust_remote_code
    )


def sequence_limit(settings) -> int | None:
    """Token positions the model can embed (None when its configuration does not say)."""
    if settings.model in EMBEDDED_MODELS or settings.architecture_only:
        config, _ = _config_for(settings, ["0", "1"])
    else:
        config = _from_hub_or_path(
            AutoConfig.from_pretrained, settings.model, "model", trust_remote_code=settings.trust_remote_code
        )
    return config_positions(config)


def config_positions(config) -> int | None:
    """Token positions a model of `config` can embed (RoBERTa-like models offset theirs past the padding index)."""
    positions = getattr(config, "max_position_embeddings", None)
    if positions is None:
        return None
    if config.model_type in PADDING_OFFSET_POSITIONS:
        positions -= (config.pad_token_id or 0) + 1
    return int(positions)


def _label_fields(label_names: list[str]) -> dict:
    """The configuration's label attributes for a classifier of `label_names`."""
    return {
        "num_labels": len(label_names),
        "id2label": dict(enumerate(label_names)),
        "label2id": {n: i for i, n in enumerate(label_names)},
    }


def _config_for(settings, label_names: list[str]):
    labels = _label_fields(label_names)
    if settings.model == EMBEDDED_MODEL:
        return AutoConfig.from_pretrained(embedded.minilm_dir(), **labels), "embedded MiniLM-L6 configuration"
    if settings.model == TINY_MODEL:
        values = embedded.bundled_architecture("tiny-bert")
        return AutoConfig.for_model(values.pop("model_type"), **values, **labels), "embedded tiny-bert configuration"
    bundled = embedded.bundled_architecture(settings.model) if not _is_local(settings.model) else None
    if bundled is not None:
        values = dict(bundled)
        return AutoConfig.for_model(
            values.pop("model_type"), **values, **labels
        ), f"bundled {settings.model} configuration"
    config = _from_hub_or_path(
        AutoConfig.from_pretrained,
        settings.model,
        "model configuration",
        trust_remote_code=settings.trust_remote_code,
        **labels,
    )
    return config, f"{settings.model} configuration"


def dropout_overrides(config, settings) -> dict:
    """The configuration attributes --hidden-dropout and --attention-dropout set ({} without them); a model whose
    configuration has no such attribute is refused in one line."""
    overrides = {}
    for kind, value in (("hidden", settings.hidden_dropout), ("attention", settings.attention_dropout)):
        if value is None:
            continue
        # classifier_dropout None means "as the hidden layers": left alone then
        names = [n for n in DROPOUT_ATTRIBUTES[kind] if getattr(config, n, None) is not None]
        if not names:
            raise UserError(
                f"--{kind}-dropout: the {config.model_type} configuration has none of "
                f"{', '.join(DROPOUT_ATTRIBUTES[kind])}"
            )
        overrides.update(dict.fromkeys(names, value))
    return overrides


def build_model(settings, label_names: list[str], tokenizer):
    """Sequence classifier for `label_names`; returns (model, facts for the run record)."""
    if settings.model.startswith("embedded:") and settings.model not in EMBEDDED_MODELS:
        raise UserError(f"unknown embedded model {settings.model!r}: choose one of {', '.join(EMBEDDED_MODELS)}")
    if settings.architecture_only or settings.model == TINY_MODEL:
        model, weights, dropout = _random_model(settings, label_names)
    else:
        model, weights, dropout = _pretrained_model(settings, label_names)
    _fit_tokenizer(model, tokenizer)
    facts = {
        "class": type(model).__name__,
        "model_type": model.config.model_type,
        "weights": weights,
        "parameters": sum(p.numel() for p in model.parameters()),
        "shape": shape_facts(model.config),
        "dropout": dropout_facts(model.config),
        "dropout_overrides": dropout or None,
    }
    if settings.unpad:
        unpad.check(model.config)  # before LoRA and checkpointing are built for nothing
    model, lora = _checkpointing_and_lora(model, settings)
    if lora:
        facts["lora"] = lora
    if settings.unpad:  # after LoRA: its dropouts draw the padded model's masks too
        facts["unpad"] = unpad.apply(model, tokenizer)
    facts["trainable_parameters"] = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return model, facts


def _random_model(settings, label_names: list[str]):
    """A model of the configuration (--architecture-only, the tiny model) with random weights: (model, weights,
    dropout overrides)."""
    config, source = _config_for(settings, label_names)
    dropout = dropout_overrides(config, settings)
    for name, value in dropout.items():
        setattr(config, name, value)
    model = AutoModelForSequenceClassification.from_config(
        config, attn_implementation=settings.attn_implementation, trust_remote_code=settings.trust_remote_code
    )
    return model, f"random ({source})", dropout


def _pretrained_model(settings, label_names: list[str]):
    """The model's pretrained weights with a new classification head: (model, weights, dropout overrides)."""
    path = str(embedded.minilm_dir()) if settings.model == EMBEDDED_MODEL else settings.model
    dropout = {}
    if settings.hidden_dropout is not None or settings.attention_dropout is not None:
        dropout = dropout_overrides(
            _from_hub_or_path(
                AutoConfig.from_pretrained,
                path,
                "model configuration",
                trust_remote_code=settings.trust_remote_code,
            ),
            settings,
        )
    with quiet_loading():  # transformers' LOAD REPORT table: said in one line of ours below
        model, loading = _from_hub_or_path(
            AutoModelForSequenceClassification.from_pretrained,
            path,
            "model",
            attn_implementation=settings.attn_implementation,
            trust_remote_code=settings.trust_remote_code,
            output_loading_info=True,
            **_label_fields(label_names),
            **dropout,  # configuration attributes given as keywords replace the saved ones
        )
    new = sorted(loading.get("missing_keys") or [])
    if new and os.environ.get("RANK", "0") == "0":
        print(
            f"{len(label_names)}-class head is new (starts from random values, as a fine-tune's does): {', '.join(new)}",
            flush=True,
        )
    return model, "pretrained", dropout


@contextlib.contextmanager
def quiet_loading():
    """transformers' own loading output off for the block: its LOAD REPORT of new and unused weights, its progress bar
    over the weights (a fraction of a second for the models here)."""
    from transformers.utils import logging as transformers_logging

    verbosity, bars = transformers_logging.get_verbosity(), transformers_logging.is_progress_bar_enabled()
    transformers_logging.set_verbosity_error()
    transformers_logging.disable_progress_bar()
    try:
        yield
    finally:
        transformers_logging.set_verbosity(verbosity)
        if bars:
            transformers_logging.enable_progress_bar()


def _fit_tokenizer(model, tokenizer) -> None:
    """Refuse a tokenizer whose ids the model cannot embed; give the model the tokenizer's padding id if it has none."""
    if len(tokenizer) > model.config.vocab_size:
        raise UserError(
            f"the tokenizer has {len(tokenizer)} tokens but the model's embedding only {model.config.vocab_size}: "
            "pass the model's own --tokenizer"
        )
    if model.config.pad_token_id is None:
        model.config.pad_token_id = tokenizer.pad_token_id


def _checkpointing_and_lora(model, settings):
    """Activation checkpointing (--gradient-checkpointing) and LoRA adapters (--lora) on a built model."""
    if settings.gradient_checkpointing:
        if not model.supports_gradient_checkpointing:
            raise UserError(f"{type(model).__name__} does not support --gradient-checkpointing")
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    return apply_lora(model, settings) if settings.lora else (model, None)


def model_config(settings, label_names: list[str]):
    """The model's configuration (with the run's labels and its --hidden-dropout / --attention-dropout), read
    without its weights."""
    config = _config_for(settings, label_names)[0]
    for name, value in dropout_overrides(config, settings).items():
        setattr(config, name, value)
    return config


def build_architecture(settings, label_names: list[str], config=None):
    """The model build_model makes, from its configuration alone (no weights are read), on torch's current default
    device: the predictor builds it on the meta device (trainscope.predict.trace). Pretrained weights keep the dtype their
    configuration names, as from_pretrained's dtype="auto" does. `config`: another configuration to build."""
    config = config if config is not None else model_config(settings, label_names)
    pretrained = not (settings.architecture_only or settings.model == TINY_MODEL)
    dtype = getattr(config, "dtype", None) if pretrained else None
    model = AutoModelForSequenceClassification.from_config(
        config,
        attn_implementation=settings.attn_implementation,
        trust_remote_code=settings.trust_remote_code,
        **({"dtype": dtype} if isinstance(dtype, torch.dtype) else {}),
    )
    return _checkpointing_and_lora(model, settings)[0]


def apply_lora(model, settings):
    """Wrap `model` in peft LoRA adapters; the classifier head stays fully trainable."""
    from peft import LoraConfig, TaskType, get_peft_model
    from peft.utils.constants import TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING as PEFT_TARGETS

    model_type = model.config.model_type
    targets = settings.lora_target_modules or PEFT_TARGETS.get(model_type) or EXTRA_LORA_TARGETS.get(model_type)
    if not targets:
        raise UserError(f"no default LoRA target modules for {model_type!r}: pass --lora-target-modules")
    names = {name.rsplit(".", 1)[-1] for name, _ in model.named_modules()}
    missing = [t for t in targets if t.rsplit(".", 1)[-1] not in names]
    if missing:
        raise UserError(f"--lora-target-modules {missing} not found in {type(model).__name__}")
    config = LoraConfig(
        task_type=TaskType.SEQ_CLS,
        r=settings.lora_r,
        lora_alpha=settings.lora_alpha,
        lora_dropout=settings.lora_dropout,
        target_modules=list(targets),
    )
    model = get_peft_model(model, config)
    trainable, total = model.get_nb_trainable_parameters()
    return model, {
        "r": settings.lora_r,
        "alpha": settings.lora_alpha,
        "dropout": settings.lora_dropout,
        "target_modules": sorted(targets),
        "trainable_parameters": trainable,
        "all_parameters": total,
    }


def optimizer_groups(model, weight_decay: float):
    """AdamW parameter groups: no weight decay on biases and normalization weights (1-D tensors)."""
    decay, no_decay = [], []
    for parameter in model.parameters():
        if parameter.requires_grad:
            (no_decay if parameter.ndim < 2 else decay).append(parameter)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def dropout_facts(config) -> dict:
    """The model's dropout probabilities as built: {hidden, attention} (None where the configuration has none)."""

    def first(names):
        return next((getattr(config, n) for n in names if getattr(config, n, None) is not None), None)

    return {"hidden": first(DROPOUT_ATTRIBUTES["hidden"]), "attention": first(DROPOUT_ATTRIBUTES["attention"])}


FUSED_ADAMW_DEVICES = ("cuda", "cpu", "xpu", "mps")


def build_optimizer(model, settings, device: torch.device):
    """AdamW in --optimizer-implementation: fused where the device has the kernel (one kernel per step instead of one
    per tensor), else foreach; foreach; or the for-loop over tensors."""
    implementation = getattr(settings, "optimizer_implementation", "fused")
    if implementation == "fused" and device.type in FUSED_ADAMW_DEVICES:
        choice = {"fused": True}
    elif implementation == "for-loop":
        choice = {"foreach": False}
    else:
        choice = {"foreach": True}
    return torch.optim.AdamW(optimizer_groups(model, settings.weight_decay), lr=settings.learning_rate, **choice)


def optimizer_facts(optimizer) -> dict:
    """What the record says of the optimizer (the advisor reads whether it is fused)."""
    return {
        "name": type(optimizer).__name__,
        "fused": bool(optimizer.defaults.get("fused")),
        "foreach": bool(optimizer.defaults.get("foreach")),
    }


def fsdp_wrap_rule(model, accelerator) -> list[str] | None:
    """In FSDP runs, the layer classes sharded one by one (None in other runs): the ones the config names
    (fsdp_transformer_layer_cls_to_wrap), else the model's repeated block -- not `_no_split_modules`, whose
    embeddings class makes Accelerate's FSDP2 prepare shard the input embedding twice (docs/gpu.md#fsdp2-without-a-gpu).
    """
    plugin = getattr(accelerator.state, "fsdp_plugin", None)
    if plugin is None:
        return None
    if not plugin.transformer_cls_names_to_wrap:
        plugin.transformer_cls_names_to_wrap = transformer_layer_classes(model)
    return list(plugin.transformer_cls_names_to_wrap)


def build_scheduler(settings, optimizer, training_steps: int, warmup_steps: int):
    """Linear warm-up, then linear or cosine decay or a constant rate: the schedules of transformers'
    get_scheduler, as torch LambdaLR factors (importing transformers.optimization costs seconds per process)."""
    kind = settings.lr_scheduler

    def factor(step: int) -> float:
        if step < warmup_steps:
            return step / max(1, warmup_steps)
        if kind == "constant_with_warmup":
            return 1.0
        progress = (step - warmup_steps) / max(1, training_steps - warmup_steps)
        if kind == "cosine":
            return max(0.0, 0.5 * (1.0 + math.cos(math.pi * progress)))
        return max(0.0, 1.0 - progress)

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def classification_loss(logits, labels):
    """Cross-entropy in fp32, whatever precision the logits come in."""
    return F.cross_entropy(logits.float(), labels)
