"""What a change does to the result, and so what can decide that it keeps it: the catalogue make tune
(trainscope.tune) and the advisor (trainscope.advisor) read.

Three kinds, tried and judged in this order:

* **exact**: the same samples, in the same order, with the same random draws; only the arithmetic's rounding
  may differ (padding-free layers, evaluation order or batch, the optimizer's implementation, compile with
  eager's random numbers, loader settings, threads). Judged by the paired runs themselves: kept when faster and
  every per-step loss and final metric of each pair agrees within the precision's rounding tolerance
  (`ROUNDING_TOLERANCE`), stated before measuring. A disagreement is "not exact": a defect to report, never a
  kept change.
* **numeric**: the same computation at another rounding (bf16 or fp16 autocast, TF32), whose paths drift apart
  over the steps: the paired-seed equivalence test (trainscope.tune_judge.equivalent).
* **training**: a change to what is learned (dropout, the order of the samples, the batch): "same" only from
  the full job, with the seeds it would need at the measured seed noise.

A change is one entry: its flag (or `config:<name>` for an Accelerate config), its kind, what it does to the
result, and the settings it needs beyond its own flag. A flag this build's Settings does not know (or a needed
setting it lacks) makes the change "not available in this build": listed, never launched. A flag not in the
catalogue is a training change (the strictest judgement: it may change what is learned).
"""

from dataclasses import dataclass, fields

EXACT, NUMERIC, TRAINING = "exact", "numeric", "training"
KINDS = (EXACT, NUMERIC, TRAINING)  # the order make tune tries them in; a change of several flags takes the last

# The relative tolerance an exact change's per-step losses and final losses must keep, and the absolute one of its
# accuracies (a share of the samples), by the precision in effect. fp32: 2^10 units of fp32's rounding (2^-24 =
# 6e-8), room for another order of summation to compound over a run's steps while a change of one dropout draw
# (1e-3 and more) stays far outside. Autocast: one unit of the half precision's rounding (bf16 2^-8, fp16 2^-11),
# since the same operands can round to the other side once the fp32 weights differ in their last bits.
ROUNDING_TOLERANCE = {"fp32": 2.0**-14, "tf32": 2.0**-11, "fp16": 2.0**-11, "bf16": 2.0**-8}


@dataclass(frozen=True)
class Change:
    flag: str  # the train.py flag, or "config:<name>"
    kind: str
    does: str  # what it does to the result, in words


CATALOGUE = {
    change.flag: change
    for change in (
        # ---- exact: the same samples, order and random draws
        Change(
            "--unpad",
            EXACT,
            "nothing: the token-wise layers run on the real tokens only, with the padded model's "
            "dropout draws (rounding only)",
        ),
        Change(
            "--eval-order", EXACT, "nothing: evaluation in length order, the same samples and metrics (rounding only)"
        ),
        Change("--eval-batch-size", EXACT, "nothing: evaluation in other batches (rounding only)"),
        Change("--optimizer-implementation", EXACT, "nothing: the same update, up to rounding"),
        Change(
            "--compile",
            EXACT,
            "nothing: fused kernels with eager's random numbers (inductor's fallback_random; rounding only)",
        ),
        Change("--num-workers", EXACT, "nothing: the same batches, loaded in worker processes"),
        Change("--pin-memory", EXACT, "nothing: the same batches, in page-locked memory"),
        Change("--persistent-workers", EXACT, "nothing: the same batches, the workers kept between epochs"),
        Change("--prefetch-factor", EXACT, "nothing: the same batches, loaded further ahead"),
        Change("--threads", EXACT, "nothing: the same operations over other threads (rounding only)"),
        Change(
            "--gradient-checkpointing",
            EXACT,
            "nothing: activations recomputed with the same random state (rounding only)",
        ),
        Change(
            "--ddp-bucket-cap-mb", EXACT, "nothing: the same gradients, all-reduced in other buckets (rounding only)"
        ),
        # ---- numeric: another rounding
        Change("config:bf16", NUMERIC, "bf16 autocast rounding"),
        Change("config:fp16", NUMERIC, "fp16 autocast rounding and loss scaling"),
        Change("--tf32", NUMERIC, "TF32 matmuls (10-bit mantissas)"),
        Change("--ddp-comm-hook", NUMERIC, "gradients rounded before the all-reduce"),
        # ---- training: what is learned
        Change("--hidden-dropout", TRAINING, "the hidden states' dropout: regularization"),
        Change("--attention-dropout", TRAINING, "the attention weights' dropout: regularization"),
        Change("--lora-dropout", TRAINING, "the LoRA branch's dropout: regularization"),
        Change("--group-by-length", TRAINING, "the order of the training batches"),
        Change(
            "--per-device-batch-size",
            TRAINING,
            "the batches (their dropout draws; the effective batch unless accumulation compensates)",
        ),
        Change("--gradient-accumulation-steps", TRAINING, "the effective batch and the optimizer's steps"),
    )
}


def _setting(flag: str) -> str:
    return flag.lstrip("-").replace("-", "_")


def _known(names: set[str] | None) -> set[str]:
    if names is not None:
        return names
    from trainscope.settings import Settings

    return {f.name for f in fields(Settings)}


def parts(flags: list[str], config: str | None) -> list[str]:
    """The catalogue keys of a change: its flags' names and its config."""
    return [f for f in flags if f.startswith("--")] + ([f"config:{config}"] if config else [])


def unavailable(flags: list[str], config: str | None = None, settings: set[str] | None = None) -> str | None:
    """Why this build cannot run the change (None: it can): a flag the settings do not know."""
    known = _known(settings)
    for part in parts(flags, config):
        if part.startswith("--") and _setting(part) not in known:
            return f"not available in this build (train.py has no {part})"
    return None


def resolved(part: str, settings: set[str] | None = None) -> tuple[str, str]:
    """(kind, what it does) of one catalogue key in this build; a key not in the catalogue is a training change."""
    entry = CATALOGUE.get(part)
    if entry is None:
        return TRAINING, "not in trainscope's catalogue of changes: taken to change what is learned"
    return entry.kind, entry.does


def kind_of(flags: list[str], config: str | None = None, settings: set[str] | None = None) -> str:
    """The kind of a change of several flags and a config: the strictest of its parts' (exact < numeric <
    training); a change of nothing is exact."""
    kinds = [resolved(part, settings)[0] for part in parts(flags, config)]
    return max(kinds, key=KINDS.index, default=EXACT)


def does(flags: list[str], config: str | None = None, settings: set[str] | None = None) -> str:
    """What the change does to the result, part by part where they differ."""
    said = [resolved(part, settings)[1] for part in parts(flags, config)]
    return "; ".join(dict.fromkeys(said)) if said else "nothing"


def tolerance(precision: str | None) -> float:
    """The rounding tolerance of exact changes at this precision (fp32 where unknown or 'no')."""
    return ROUNDING_TOLERANCE.get(precision or "fp32", ROUNDING_TOLERANCE["fp32"])
