"""The project's places and units, defined once: the repository's root, and bytes per GiB."""

from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent  # the project's root: train.py, benchmarks/, reports/
GIB = 1024**3
