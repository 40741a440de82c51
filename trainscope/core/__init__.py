"""The ground floor every other part stands on: the run's settings, the files it writes and their one typed view,
provenance, the environment and precision in effect, one-line errors, liveness of the ranks, and the one way to
launch train.py.
"""

__all__ = [
    "paths",
    "settings",
    "records",
    "record_view",
    "results_view",
    "communication_view",
    "provenance",
    "environment",
    "precision",
    "errors",
    "faults",
    "liveness",
    "distributed",
    "launching",
]
