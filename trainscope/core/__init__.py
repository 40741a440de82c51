"""The ground floor every other part stands on: the files a run writes and their one typed view, provenance, the
environment and precision in effect, one-line errors, liveness of the ranks, the help of a script's own flags, and the
one way to launch train.py.
"""

__all__ = ["paths", "script_help", "records", "record_view", "results_view", "communication_view",
           "provenance", "environment", "precision", "errors", "faults", "liveness", "distributed",
           "launching"]  # fmt: skip
