"""What a change does to the result, and so what can decide that it keeps it: the catalogue of changes.

How it works: docs/tune.md#in-the-code-the-catalogue-of-changes-trainscopeadvicechangespy.
"""

from dataclasses import dataclass, fields

from trainscope.workload.settings import Settings

EXACT, NUMERIC, TRAINING = "exact", "numeric", "training"
KINDS = (EXACT, NUMERIC, TRAINING)  # the order make tune tries them in; a change of several flags takes the last

# Exact changes are judged in fp32 with one tolerance, tests and make tune alike (`exact_difference`): why fp32 and
# why 2^-18 relative, docs/tune.md#kinds-of-change-exact-numeric-training.
EXACT_PRECISION = "fp32"
EXACT_TOLERANCE = 2.0**-18


def exact_difference(reference: float, value: float, relative: bool = True) -> float:
    """How far `value` is from `reference` as the exactness rule measures it: relative for losses, absolute for
    accuracies (a share of the samples)."""
    return abs(value - reference) / (abs(reference) if relative and reference else 1.0)


def exact(reference: float, value: float, relative: bool = True) -> bool:
    """Whether two fp32 figures of paired runs agree as an exact change must (`EXACT_TOLERANCE`)."""
    return exact_difference(reference, value, relative) <= EXACT_TOLERANCE


@dataclass(frozen=True)
class Change:
    flag: str  # the train.py flag, or "config:<name>"
    kind: str
    does: str  # what it does to the result, in words


# what each change does to the result, by kind
_DOES = {
    EXACT: {  # the same samples, order and random draws
        "--unpad": "nothing: the token-wise layers run on the real tokens only, with the padded model's "
        "dropout draws (rounding only)",
        "--eval-order": "nothing: evaluation in length order, the same samples and metrics (rounding only)",
        "--eval-batch-size": "nothing: evaluation in other batches (rounding only)",
        "--optimizer-implementation": "nothing: the same update, up to rounding",
        "--compile": "nothing: fused kernels with eager's random numbers (inductor's fallback_random; rounding only)",
        "--compile-mode": "nothing: the compiled kernels replayed as CUDA graphs with eager's random numbers "
        "(rounding only)",
        "--num-workers": "nothing: the same batches, loaded in worker processes",
        "--pin-memory": "nothing: the same batches, in page-locked memory",
        "--persistent-workers": "nothing: the same batches, the workers kept between epochs",
        "--prefetch-factor": "nothing: the same batches, loaded further ahead",
        "--threads": "nothing: the same operations over other threads (rounding only)",
        "--gradient-checkpointing": "nothing: activations recomputed with the same random state (rounding only)",
        "--ddp-bucket-cap-mb": "nothing: the same gradients, all-reduced in other buckets (rounding only)",
    },
    NUMERIC: {  # another rounding
        "config:bf16": "bf16 autocast rounding",
        "config:fp16": "fp16 autocast rounding and loss scaling",
        "--tf32": "TF32 matmuls (10-bit mantissas)",
        "--ddp-comm-hook": "gradients rounded before the all-reduce",
    },
    TRAINING: {  # what is learned
        "--hidden-dropout": "the hidden states' dropout: regularization",
        "--attention-dropout": "the attention weights' dropout: regularization",
        "--lora-dropout": "the LoRA branch's dropout: regularization",
        "--group-by-length": "the order of the training batches",
        "--per-device-batch-size": "the batches (their dropout draws; the effective batch unless accumulation "
        "compensates)",
        "--gradient-accumulation-steps": "the effective batch and the optimizer's steps",
    },
}
CATALOGUE = {flag: Change(flag, kind, text) for kind, table in _DOES.items() for flag, text in table.items()}


def parts(flags: list[str], config: str | None) -> list[str]:
    """The catalogue keys of a change: its flags' names and its config."""
    return [f for f in flags if f.startswith("--")] + ([f"config:{config}"] if config else [])


def unavailable(flags: list[str], config: str | None = None, settings: set[str] | None = None) -> str | None:
    """Why this build cannot run the change (None: it can): a flag the settings do not know."""
    known = settings if settings is not None else {f.name for f in fields(Settings)}
    for part in parts(flags, config):
        if part.startswith("--") and part.lstrip("-").replace("-", "_") not in known:
            return f"not available in this build (train.py has no {part})"
    return None


def resolved(part: str) -> tuple[str, str]:
    """(kind, what it does) of one catalogue key; a key not in the catalogue is a training change."""
    entry = CATALOGUE.get(part)
    if entry is None:
        return TRAINING, "not in trainscope's catalogue of changes: taken to change what is learned"
    return entry.kind, entry.does


def kind_of_parts(keys: list[str]) -> str:
    """The strictest kind of a change's catalogue keys (exact < numeric < training); a change of nothing is exact."""
    return max((resolved(key)[0] for key in keys), key=KINDS.index, default=EXACT)


def does_of_parts(keys: list[str]) -> str:
    """What a change of these catalogue keys does to the result, key by key where they differ."""
    return "; ".join(dict.fromkeys(resolved(key)[1] for key in keys)) or "nothing"


def kind_of(flags: list[str], config: str | None = None) -> str:
    return kind_of_parts(parts(flags, config))


def does(flags: list[str], config: str | None = None) -> str:
    return does_of_parts(parts(flags, config))


# The same changes in a loop's own terms (a trainscope.Run record): what its author writes instead of train.py's
# flag or config ({value}: the flag's value).
LOOP_WORDS = {
    "config:bf16": "Accelerator(mixed_precision='bf16') (or accelerate launch --mixed_precision bf16)",
    "config:fp16": "Accelerator(mixed_precision='fp16') (or accelerate launch --mixed_precision fp16)",
    "--tf32": "torch.backends.cuda.matmul.allow_tf32 = True",
    "--threads": "torch.set_num_threads({value}) before the loop, or trainscope.Run(threads={value})",
    "--per-device-batch-size": "the training DataLoader's batch_size={value}",
    "--gradient-accumulation-steps": "Accelerator(gradient_accumulation_steps={value}) (or your loop's own count)",
    "--num-workers": "DataLoader(num_workers={value})",
    "--pin-memory": "DataLoader(pin_memory=True)",
    "--persistent-workers": "DataLoader(persistent_workers=True)",
    "--prefetch-factor": "DataLoader(prefetch_factor={value})",
    "--optimizer-implementation": "torch.optim.AdamW(..., fused=True)",
    "--compile": "model = torch.compile(model) before accelerator.prepare",
    "--compile-mode": "torch.compile(model, mode='{value}') (or accelerate launch --dynamo_mode {value})",
    "--gradient-checkpointing": "model.gradient_checkpointing_enable() (transformers) or torch.utils.checkpoint",
    "--ddp-bucket-cap-mb": "DistributedDataParallelKwargs(bucket_cap_mb={value}) in the Accelerator's kwargs_handlers",
    "--ddp-comm-hook": "DistributedDataParallelKwargs(comm_hook=DDPCommunicationHookType.FP16)",
    "--eval-batch-size": "the evaluation DataLoader's batch_size={value}",
}


def loop_words(flags: list[str], config: str | None = None) -> str:
    """A change of train.py's flags and config in a loop's own terms, part by part."""
    said, index = [], 0
    while index < len(flags):
        flag = flags[index]
        has_value = index + 1 < len(flags) and not flags[index + 1].startswith("--")
        value = flags[index + 1] if has_value else None
        index += 2 if has_value else 1
        words = LOOP_WORDS.get(flag)
        if flag == "--threads" and value == "auto":
            said.append("trainscope.Run(threads='auto'): each process's share of the cores")
        elif words:
            said.append(words.format(value=value))
        else:
            said.append(f"your loop's equivalent of train.py's {flag}" + (f" {value}" if value else ""))
    if config:
        said.append(LOOP_WORDS.get(f"config:{config}") or f"your loop launched as accelerate_configs/{config}.yaml")
    return "; ".join(said)
