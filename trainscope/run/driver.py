"""Who drives a run through trainscope.Run's API, and what it adds: the name its record gives it, how its options are
written in the lines it prints, what does not apply, and what a workload trainscope knows adds. `Driver()` is a loop of
one's own: it adds nothing and loads no model library (train.py's: trainscope.classifier.ClassifierDriver).
"""

import dataclasses

# What does not apply to a model that is not train.py's classifier, as a plain run's record says.
NOT_AVAILABLE = {
    "prediction": "the predictor models BERT/RoBERTa-like encoder classifiers only (train.py --predict)",
    "unpad": "--unpad is train.py's, for BERT/RoBERTa-like encoders",
}


class NoCheck:
    """The measured side of a prediction, for a run that made none."""

    block = None

    def attach(self, model, optimizer) -> None:
        pass

    def first_micro_batch(self) -> None:
        pass

    def micro_batch_done(self, batch, stepped: bool) -> None:
        pass

    def errors(self, result: dict) -> None:
        return None


@dataclasses.dataclass
class Driver:
    """A loop of one's own (trainscope.Run's keywords); train.py and the Trainer's callback pass their own."""

    api: str = "trainscope.Run"  # the record's instrument.api
    options: str = "keywords"  # how its options are written: keywords (memory_every=10) or flags (--memory-every 10)
    progress: bool = True  # a progress bar of the run's own (the Trainer shows its own)
    not_available: dict = dataclasses.field(default_factory=lambda: dict(NOT_AVAILABLE))
    unpadded: bool = False  # the model's token-wise layers run on real tokens only (train.py's --unpad)
    # the lines that say what to do, in the driver's words ({name}: the run's; {step}: the step it failed at)
    resume: str = "trainscope.Run(..., name={name!r}, resume=True)"
    exists: str = "give trainscope.Run overwrite=True, resume=True or another name="
    out_of_memory: str = (
        "out of memory at step {step}: halve the loop's batch and accumulate twice as many micro-batches per step, "
        "or turn on activation checkpointing (model.gradient_checkpointing_enable()), a bf16/fp16 config or LoRA"
    )
    non_finite: str = (
        "lower the learning rate, clip the gradients (accelerator.clip_grad_norm_), or use bf16 instead of fp16"
    )
    stop_on_non_finite: bool = False  # a non-finite loss ends the run (train.py's); else recorded and warned

    def instrument_block(self, metrics) -> dict:
        """The record's `instrument` block: who drove the run, how its options are written, where its steps and FLOPs
        come from, what does not apply."""
        said = {"api": self.api, "options": self.options, "flops_basis": metrics.flops.basis}
        return {**said, "steps_basis": metrics.events.steps_basis(), "not_available": self.not_available}

    # ---------------------------------------------------------------- what a workload adds (here: nothing)

    def prediction_check(self):
        """The prediction made before the run and what checks it against the run (`NoCheck` here)."""
        return NoCheck()

    def layer_breakdown(self, metrics, batch: int, length: int, precision_name: str) -> tuple[str, object] | None:
        """(the cache key, a function measuring it) of one layer profiled at the run's shapes, or None."""
        return None

    def summarized(self, check, result: dict, started) -> None:
        """After the summary: what the workload keeps of it (the predictor's communication measurements)."""

    def announcements(self, data_facts: dict) -> list[str]:
        """Lines printed when the run opens (the data's dropped rows)."""
        return []
