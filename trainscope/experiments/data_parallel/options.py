"""compare_dp.py's own flags, apart from its loops (trainscope.experiments.data_parallel.loops, which load torch) so
that the script answers --help before it imports torch."""

from dataclasses import dataclass

from trainscope.core.errors import UserError
from trainscope.core.script_help import option, require_at_least_one

ASSUMED_COMPUTE_STEP_S = 0.1


@dataclass
class CompareSettings:
    steps: int = option(default=20, help="Timed optimizer steps in every loop (after the warm-up steps).")
    warmup_steps: int = option(default=2, help="Untimed first steps of every loop (allocations, lazy set-up).")
    global_batch_size: int = option(
        default=32,
        help="Samples per optimizer step, summed over devices; rounded "
        "to the nearest multiple of the DDP process count when it does not divide.",
    )
    ddp_processes: int | None = option(default=None, help="DDP processes; default: the GPU count, or 2 on a CPU.")
    rounds: int = option(default=5, help="Alternating rounds of the variants (median, min-max, verdict).")
    results_dir: str = option(default="results/compare_dp", help="Where results, tables, plot and diffs go.")
    projection_gpus: list[int] = option(
        default_factory=lambda: [1, 2, 4, 8, 16], help="GPU counts for the DDP step-time projection."
    )
    interconnect: list[str] = option(
        default_factory=list,
        help="Interconnect presets to project for (default: every preset; a wrong name lists them).",
    )
    bandwidth_gbs: float | None = option(
        default=None, help="Custom all-reduce bandwidth in GB/s (adds a 'custom' row)."
    )
    latency_us: float = option(default=10.0, help="Per-hop latency in microseconds for --bandwidth-gbs.")
    overlap: float = option(
        default=0.0,
        help="Share of the all-reduce hidden behind backward (DDP buckets); 0 assumes none, the pessimistic bound.",
    )
    gpu_record: str | None = option(
        default=None,
        help="A run record (record.json or its folder) of a GPU run: the "
        "projection takes its measured steady step time as the compute per step.",
    )
    assumed_compute_step_s: float = option(
        default=ASSUMED_COMPUTE_STEP_S,
        help="Compute seconds per step assumed "
        "by the projection when no --gpu-record is given (said so in the output).",
    )
    ddp_cost: str | None = option(
        default=None,
        help="A `make ddp-cost` comparison.json: the projection adds a row "
        "with the all-reduce bandwidth measured there.",
    )
    role: str = option(default="compare", help="Internal: 'ddp-worker' runs one DDP process.")
    result_file: str | None = option(default=None, help="Internal: where a DDP worker writes its result.")

    def validate(self):
        require_at_least_one(self, "steps", "global_batch_size", "rounds")
        if self.warmup_steps < 0:
            raise UserError(f"--warmup-steps must be 0 or more, got {self.warmup_steps}")
        if self.ddp_processes is not None and self.ddp_processes < 1:
            raise UserError(f"--ddp-processes must be at least 1, got {self.ddp_processes}")
        from trainscope.measure.communication.measured import INTERCONNECTS  # deferred: it loads torch (after --help)

        unknown = [name for name in self.interconnect if name not in INTERCONNECTS]
        if unknown:
            raise UserError(f"unknown interconnect(s) {unknown}: choose from {', '.join(INTERCONNECTS)}")
        if not 0 <= self.overlap <= 1:
            raise UserError(f"--overlap must be between 0 and 1, got {self.overlap}")
        if any(n < 1 for n in self.projection_gpus):
            raise UserError("--projection-gpus must be positive")
        if self.assumed_compute_step_s <= 0:
            raise UserError("--assumed-compute-step-s must be positive")
