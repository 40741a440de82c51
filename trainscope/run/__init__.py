"""A training run: its options and its driver (what its caller passes), its start-up, its metrics component, its life
(resume, checkpoints, signals, the endings) and the loop's counters.
"""

__all__ = ["options", "driver", "startup", "metrics", "table", "lifecycle", "signals", "checkpoints",
           "trackers", "endings", "loop", "events"]  # fmt: skip
