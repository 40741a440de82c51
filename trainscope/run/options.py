"""What trainscope.Run takes beside its prepared objects: its own options, one dataclass with a help text per field.
train.py takes the same as flags of the same names (its Settings extends this class: trainscope.workload.settings),
a loop of one's own as trainscope.Run's keywords, the Trainer's callback as its own keywords.
"""

import dataclasses
from typing import Literal

from trainscope.core.errors import UserError
from trainscope.core.record_view import option_words
from trainscope.core.script_help import option

# The numeric options' bounds, checked in this order (the first one broken is the error): (fields, what breaks the
# rule, what the option must be). A field left None (not given) is not checked.
POSITIVE = "log_every save_every memory_snapshot_steps memory_every communication_samples distributed_timeout".split()
NUMBER_RULES = (
    (POSITIVE, lambda value: value <= 0, "a positive integer"),
    (("timing_warmup_steps", "profile_wait", "profile_warmup"), lambda value: value < 0, "0 or more"),
    (("profile_active",), lambda value: value < 1, "at least 1"),
)


def check_numbers(options, rules, spell=option_words) -> None:
    """Each numeric field against its rule (`NUMBER_RULES`' form): one line for the first broken."""
    for names, wrong, must_be in rules:
        for name in names:
            value = getattr(options, name)
            if value is not None and wrong(value):
                raise UserError(f"{spell(name)} must be {must_be}, got {value}")


@dataclasses.dataclass
class RunOptions:
    # ---- timing and profiling ----
    log_every: int = option(default=10, help="Write a step line (loss, lr, stage seconds) every N optimizer steps.")
    timing: Literal["events", "sync"] = option(
        default="events",
        help="How stages get device time on accelerators: events (device events read back later, no stall) "
        "or sync (synchronize the device at every stage boundary). On a CPU both are host clocks.",
    )
    timing_warmup_steps: int = option(
        default=2, help="First optimizer steps recorded apart (start-up, allocator warm-up) from the steady state."
    )
    threads: str = option(
        default="auto",
        help="Intra-op CPU threads of each process: auto (the cores this process may use, from its CPU affinity, "
        "divided by the processes on this node), a number, or launcher (keep what OMP_NUM_THREADS says). "
        "accelerate launch exports OMP_NUM_THREADS=1 (its --num_cpu_threads_per_process, default 1 unless the "
        "config says use_cpu), which would run a CPU job on one core; auto overrides it. Recorded with its source.",
    )
    profile: bool = option(
        default=False,
        help="Trace a window of optimizer steps with torch.profiler into <run>/profile (TensorBoard and "
        "Chrome-trace JSON, stages labelled); the top operators go into the record.",
    )
    profile_wait: int = option(default=2, help="Steps skipped before the profiler warms up.")
    profile_warmup: int = option(default=1, help="Steps the profiler runs but discards.")
    profile_active: int = option(default=3, help="Steps traced.")
    memory_snapshot: bool = option(
        default=False,
        help="On CUDA: record the allocator history over --memory-snapshot-steps optimizer steps after the "
        "timing warm-up and save it for pytorch.org/memory_viz (the record says which steps).",
    )
    memory_snapshot_steps: int = option(default=3, help="Optimizer steps the memory snapshot covers.")
    memory_every: int = option(
        default=10,
        help="On CUDA, read per-stage allocator peaks on every Nth optimizer step (one reset and one read per "
        "stage); 1 reads them every step, which costs time on fast GPUs.",
    )
    time_model: bool = option(
        default=False,
        help="After the loop, time the run's own model alone on a warm-up micro-batch in every precision the device "
        "runs, at other thread counts and on twice the rows: what the advisor's precision, threads and batch estimates "
        "read (seconds after the loop, more for a large model; trainscope tune asks for it in its advice run). Off, "
        "those estimates say how to get them.",
    )

    # ---- communication (multi-process runs) ----
    measure_communication: Literal["auto", "on", "off"] = option(
        default="auto",
        help="In multi-process DDP runs, measure on every synchronizing step the all-reduce time backward waits for "
        "(exposed communication: from the last gradient DDP's reducer takes to the end of backward), its overlap with "
        "compute, and after training each bucket's all-reduce alone; checked against DDP's own logger. No DDP "
        "communication hook is registered for it. auto and on: measure; off: register nothing.",
    )
    communication_samples: int = option(
        default=3,
        help="Times each DDP bucket's all-reduce is timed alone after training (the transfer figure; the "
        "median over them is kept).",
    )
    distributed_timeout: int = option(
        default=600,
        help="Seconds a collective (an all-reduce, a barrier, a checkpoint's wait for rank 0) may wait for the other "
        "processes before the run fails saying so (torch.distributed's timeout; NCCL's watchdog aborts at it). Raise it "
        "when rank 0 needs longer than this to write a checkpoint of a large model. A peer that dies is named within "
        "seconds whatever this says (heartbeats in the launcher's store).",
    )

    # ---- output, trackers and checkpoints ----
    output_dir: str = option(default="runs", help="Where run records go: <output-dir>/<run-name>/.")
    run_name: str | None = option(
        default=None, help="Run directory name; default <model>-<dataset>-<precision>-<time>."
    )
    overwrite: bool = option(default=False, help="Replace an existing run directory of the same name.")
    report_to: Literal["wandb", "tensorboard", "all", "none"] = option(
        default="wandb", help="Trackers through Accelerate. W&B runs offline when it has no API key or no network."
    )
    tracker_group: str | None = option(
        default=None,
        help="W&B group for this run, so runs of one experiment overlay in one W&B view (the AMP comparison "
        "sets it); also recorded.",
    )
    save_every: int | None = option(
        default=None, help="Save a resumable checkpoint (Accelerate save_state) every N optimizer steps."
    )
    resume: bool = option(
        default=False, help="Continue --run-name from its latest checkpoint, with the same data order."
    )
    save_on_interrupt: bool = option(
        default=False,
        help="On SIGINT (Ctrl-C), SIGTERM or SIGUSR1, save a checkpoint before exiting, so --resume continues with "
        "the same data order and losses. The run stops at the next optimizer-step boundary (with several "
        "processes, which agree on the step first, at the next stop vote: up to min(--log-every, 10) steps "
        "later, docs/endings.md), then writes the model and optimizer state: that must "
        "fit in the grace time before SIGKILL -- 30 s after torchrun's SIGTERM, SLURM's KillWait (30 s by "
        "default) after its SIGTERM, or ask SLURM for an earlier SIGUSR1 with #SBATCH --signal=USR1@120. Without "
        "this flag an interrupted run still records what it measured, but cannot be resumed from that point.",
    )

    def validate(self, spell=option_words) -> None:
        """Refuse impossible options with one line each, before anything is loaded or written; `spell(name)` writes an
        option as its user gives it (train.py's --flag, or trainscope.Run's keyword)."""
        check_numbers(self, NUMBER_RULES, spell)
        if self.threads not in ("auto", "launcher") and not (self.threads.isdigit() and int(self.threads) > 0):
            raise UserError(f"{spell('threads')} takes auto, launcher or a positive number, got {self.threads!r}")
        if self.resume and not self.run_name:
            raise UserError(f"{spell('resume')} needs {spell('run_name')} of the run to continue")
        if self.resume and self.overwrite:
            raise UserError(f"{spell('resume')} and {spell('overwrite')} contradict each other: choose one")
        if self.run_name is not None and (not self.run_name or "/" in self.run_name or self.run_name.startswith(".")):
            raise UserError(f"{spell('run_name')} must be a plain directory name, got {self.run_name!r}")
