"""A training run: its start-up, its metrics component, its life (resume, checkpoints, signals, the endings) and
the loop's shared step and counters.
"""

__all__ = ["startup", "metrics", "table", "lifecycle", "signals", "checkpoints", "trackers", "endings", "loop"]
