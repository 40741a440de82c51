"""loaders_bench.py's own flags, apart from the sweep (trainscope.experiments.loaders.sweep, which loads torch) so
that the script answers --help before it imports torch."""

from dataclasses import dataclass

from trainscope.core.errors import UserError
from trainscope.core.script_help import option, require_at_least_one

MODES = ("pretokenized", "device-copy", "on-the-fly", "in-training")
MAX_WORKERS = 64
# The sweep's one set of defaults (make sweep-workers passes none of its own)
DEFAULT_WORKERS = (0, 1, 2, 3, 4, 6, 8, 10)
DEFAULT_MODES = ("pretokenized", "on-the-fly", "in-training")


@dataclass
class SweepSettings:
    workers: list[int] = option(
        default_factory=lambda: list(DEFAULT_WORKERS), help="num_workers values to time (default 0-4, 6, 8 and 10)."
    )
    repeats: int = option(
        default=5,
        help="Timed passes per setting, in alternating order; median, min and max are "
        "reported, and a verdict against the default needs 5.",
    )
    modes: list[str] = option(
        default_factory=lambda: list(DEFAULT_MODES),
        help=f"Any of {', '.join(MODES)} (default {', '.join(DEFAULT_MODES)}).",
    )
    pin_memory_values: list[str] = option(
        default_factory=lambda: ["auto"], help="pin_memory values to sweep: true, false, auto (on with CUDA)."
    )
    persistent_workers_values: list[str] = option(
        default_factory=lambda: ["false"], help="persistent_workers values to sweep: true, false."
    )
    prefetch_factors: list[int] = option(
        default_factory=lambda: [2], help="prefetch_factor values to sweep (used when num_workers > 0)."
    )
    batch_sizes: list[int] | None = option(default=None, help="Batch sizes to sweep; default --per-device-batch-size.")
    passes: int = option(
        default=1,
        help="Passes per loader; with --persistent-workers the second pass shows what keeping workers alive saves.",
    )
    train_steps: int = option(
        default=8, help="Timed training steps per setting in the in-training mode (after 2 untimed ones)."
    )
    knee_tolerance: float = option(
        default=0.05,
        help="The knee is the fewest workers within this fraction "
        "of the best median pass time; in the in-training mode, within this "
        "many points of step time of the lowest data share (0.05: 5 points).",
    )
    results_dir: str = option(default="results/loaders", help="Where the results and the plot go.")
    processes_per_node: int = option(
        default=1,
        help="Training processes that will share this machine's "
        "cores (the CPU budget per process is usable cores / this).",
    )

    def validate(self):
        if not self.workers:
            raise UserError("--workers needs at least one value")
        if any(w < 0 for w in self.workers):
            raise UserError(f"--workers must be 0 or more, got {self.workers}")
        if max(self.workers) > MAX_WORKERS:
            raise UserError(f"--workers above {MAX_WORKERS} is not a sane DataLoader setting, got {max(self.workers)}")
        unknown = [m for m in self.modes if m not in MODES]
        if unknown:
            raise UserError(f"unknown mode(s) {unknown}: choose from {', '.join(MODES)}")
        bad_pin = [p for p in self.pin_memory_values if p not in ("true", "false", "auto")]
        if bad_pin:
            raise UserError(f"--pin-memory-values takes true, false or auto, got {bad_pin}")
        bad_persistent = [p for p in self.persistent_workers_values if p not in ("true", "false")]
        if bad_persistent:
            raise UserError(f"--persistent-workers-values takes true or false, got {bad_persistent}")
        for flag, values in (("prefetch-factors", self.prefetch_factors), ("batch-sizes", self.batch_sizes or [1])):
            if any(v <= 0 for v in values):
                raise UserError(f"--{flag} must be positive, got {values}")
        require_at_least_one(self, "repeats", "passes", "train_steps", "processes_per_node")
        if not 0 <= self.knee_tolerance < 1:  # checked up front: a sweep must not end without its knee
            raise UserError(f"--knee-tolerance must be at least 0 and below 1, got {self.knee_tolerance}")
