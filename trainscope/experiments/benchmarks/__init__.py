"""The Make targets that benchmark trainscope itself, each writing committed results: what trainscope costs a
script's whole run (`overhead`, make bench-overhead), train.py against the HF Trainer and what the Trainer callback
costs (`trainer_peer`, make bench-trainer), the advisor's estimates against what changes measure (`advice_check`,
make bench-advice), the import's weight (`import_weight`, make bench-import) and the dropout loop's draw against
torch's (`dropout_draw`, make bench-dropout-draw); `whole_run` is the harness of the whole-run verdicts, `pieces`
the diagnostic that locates a cost inside one process.

`short_run` is the one list of a short train.py run's flags every benchmark builds on."""

__all__ = ["overhead", "trainer_peer", "advice_check", "import_weight", "dropout_draw", "whole_run",
           "pieces", "short_run"]  # fmt: skip


def short_run(samples: int, steps: int | None, warmup: int, log_every: int | None = None, held_out: int = 32) -> list:
    """train.py's flags for a short run: `samples` training rows, `steps` optimizer steps (None: the epochs'), the first
    `warmup` of them outside the steady figures, `held_out` validation and test rows, no tracker."""
    return [
        "--max-train-samples", str(samples),
        *(["--max-steps", str(steps)] if steps is not None else []),
        "--timing-warmup-steps", str(warmup),
        "--max-eval-samples", str(held_out),
        "--max-test-samples", str(held_out),
        "--report-to", "none",
        *(["--log-every", str(log_every)] if log_every is not None else []),
    ]  # fmt: skip
