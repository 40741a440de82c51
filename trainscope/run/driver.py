"""What a workload trainscope knows adds to a run's generic measurements, and what a plain loop gets instead: nothing.

train.py's classifier (trainscope.classifier.ClassifierExtras) adds the prediction made before the run and its check,
its attention kernels, and one encoder layer profiled at the run's shapes; trainscope.Run on any other loop runs with
`WorkloadExtras()`, which adds none of them and loads no model library.
"""


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


class WorkloadExtras:
    """The extras' interface; this base adds nothing."""

    def prediction_check(self, settings):
        """The prediction made before the run and what checks it against the run (`NoCheck` here)."""
        return NoCheck()

    def environment_facts(self, metrics, effective_precision: str) -> dict:
        """More of the record's environment block."""
        return {}

    def layer_breakdown(self, metrics, batch: int, length: int, precision_name: str) -> tuple[str, object] | None:
        """(the cache key, a function measuring it) of one layer profiled at the run's shapes, or None."""
        return None

    def summarized(self, check, result: dict, settings, started) -> None:
        """After the summary: what the workload keeps of it (the predictor's communication measurements)."""

    def announcements(self, data_facts: dict) -> list[str]:
        """Lines printed when the run opens (the data's dropped rows)."""
        return []
