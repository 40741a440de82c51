"""The DataLoader num_workers sweep: `sweep` runs it (loaders_bench.py), `results` reads it (its figure, tables and
report section).
"""

__all__ = ["sweep", "results"]
