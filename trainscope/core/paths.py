"""The project's places and units, defined once: the repository's root, the cache folder, and bytes per GiB."""

import os
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # the project's root: train.py, benchmarks/, reports/
GIB = 1024**3
CACHE_ENV = "TRAINSCOPE_CACHE_DIR"


def cache_dir(environ=None) -> Path:
    """$TRAINSCOPE_CACHE_DIR, else $XDG_CACHE_HOME/trainscope, else ~/.cache/trainscope."""
    environ = os.environ if environ is None else environ
    if environ.get(CACHE_ENV):
        return Path(environ[CACHE_ENV]).expanduser()
    base = Path(environ["XDG_CACHE_HOME"]).expanduser() if environ.get("XDG_CACHE_HOME") else Path.home() / ".cache"
    return base / "trainscope"
