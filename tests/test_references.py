"""Every file, module and make target the pages and the code's words cite exists: the paths (trainscope/core/paths.py,
docs/design.md, benchmarks/...), the pages named alone (RECORD.md), the dotted names (trainscope.report.sections.collect)
and the `make <target>`s in README.md, docs/*.md, the Makefile, and the docstrings and comments of the package, the
scripts and the tests. An output that is no file of the project (runs/<run-name>/, a temporary folder) starts with none
of these folders. Read from the text (tokenize for the comments), nothing imported."""

import ast
import io
import re
import tokenize
from pathlib import Path

from conftest import ROOT

FOLDERS = ("trainscope", "docs", "tests", "examples", "benchmarks", "accelerate_configs", "reports")
PATH = re.compile(rf"(?<![\w./-])((?:{'|'.join(FOLDERS)})/[\w./*<>{{}},-]*[\w*}}])")
# a page or file named alone (RECORD.md): one of the project's files by that name
PAGE = re.compile(r"(?<![\w./<-])([A-Za-z][\w-]*\.md)\b")
MODULE = re.compile(r"(?<![\w./])trainscope(?:\.\w+)+")
# `make <target>` quoted as a command, or a Makefile comment that begins with one (prose says "make it" too)
TARGET = re.compile(r"(?:`|^# )make ([a-z][a-z0-9-]*[a-z0-9])\b(?!['\w-])", re.M)


def words(path: Path) -> str:
    """A page's or the Makefile's whole text; a Python file's docstrings and comments."""
    text = path.read_text()
    if path.suffix != ".py":
        return text
    tree = ast.parse(text)
    documented = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
    parts = [ast.get_docstring(node) or "" for node in ast.walk(tree) if isinstance(node, documented)]
    tokens = tokenize.generate_tokens(io.StringIO(text).readline)
    return "\n".join(parts + [token.string for token in tokens if token.type == tokenize.COMMENT])


def path_exists(cited: str) -> bool:
    """Relative to the project, or to a folder of the package (docs/design.md's tables list each folder's files):
    a cited pattern (`benchmarks/gpu/<device>.*`, `reports/report.{md,pdf}`) by the part before its first wildcard."""
    cited = cited.rstrip(".,")
    stem = re.split(r"[*<{]", cited)[0]
    bases = [ROOT, *(p for p in (ROOT / "trainscope").rglob("*") if p.is_dir() and p.name != "__pycache__")]
    if stem != cited:
        return any(list(base.glob(stem + "*")) for base in bases)
    return any((base / cited).exists() for base in bases)


def module_defines(dotted: str) -> bool:
    """The dotted name names a module (or package) of trainscope, and what follows it, if anything, is a name that
    module binds."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        base = ROOT.joinpath(*parts[:cut])
        source = base / "__init__.py" if base.is_dir() else base.with_suffix(".py")
        if source.exists():
            if cut == len(parts):
                return True
            name = parts[cut]
            bound = rf"^\s*(def|class)\s+{name}\b|^\s*{name}\s*[:=]|\bimport\b.*\b{name}\b|\bas {name}\b|^\s+{name}\b"
            return re.search(bound, source.read_text(), re.M) is not None
    return False


def test_every_cited_file_module_and_make_target_exists():
    targets = set(re.findall(r"^([a-zA-Z][\w-]*):", (ROOT / "Makefile").read_text(), re.M))
    sources = [
        ROOT / "README.md",
        ROOT / "Makefile",
        *(ROOT / "docs").glob("*.md"),
        *ROOT.glob("*.py"),
        *(ROOT / "trainscope").rglob("*.py"),
        *(ROOT / "tests").glob("*.py"),
        *(ROOT / "examples").glob("*.py"),
    ]
    named = {path.name for path in ROOT.rglob("*.md") if ".venv" not in path.parts}
    broken = []
    for source in sources:
        text, shown = words(source), str(source.relative_to(ROOT))
        broken += [(shown, m) for m in PATH.findall(text) if not path_exists(m)]
        broken += [(shown, m) for m in PAGE.findall(text) if m not in named]
        broken += [(shown, m) for m in MODULE.findall(text) if not module_defines(m.rstrip("."))]
        broken += [(shown, f"make {m}") for m in TARGET.findall(text) if m not in targets]
    assert broken == []
