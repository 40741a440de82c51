"""The package's imports run one way: no module of trainscope imports, directly or through others, a module that
imports it back, and none reaches up into the top-level scripts (imports show every dependency). Read
from the source (ast), nothing imported: an import inside a function counts as the function-level graph, reported
apart from the module-level one (it runs later, but it is a dependency all the same)."""

import ast
import functools
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "trainscope"
SCRIPTS = {"train", "report", "compare_dp", "loaders_bench"}


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(path): path for path in PACKAGE.rglob("*.py")}


def _target(name: str) -> str | None:
    """The module of trainscope that `name` (a module, or a name in one) is, or None outside the package."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def _imports(node, module: str, path: Path):
    """(imported name, function-level) of every import under `node`; names a `from` import brings count as
    modules where they are ones (`from trainscope import peak`)."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for child, inside in _walk(node, False):
        if isinstance(child, ast.Import):
            for alias in child.names:
                yield alias.name, inside
        elif isinstance(child, ast.ImportFrom):
            base = child.module or ""
            if child.level:
                anchor = package.split(".")[: len(package.split(".")) - child.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            for alias in child.names:
                yield (f"{base}.{alias.name}" if f"{base}.{alias.name}" in MODULES else base), inside


def _walk(node, inside: bool):
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
            continue  # never runs
        yield child, inside
        yield from _walk(child, inside or isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda))


def _with_packages(target: str, module: str) -> list[str]:
    """`target` and the packages above it that importing it runs (their `__init__`), short of trainscope itself and
    of the packages `module` is inside (which are running already)."""
    parts = target.split(".")
    names = [".".join(parts[:end]) for end in range(2, len(parts) + 1)]
    return [name for name in names if name != module and not module.startswith(name + ".")]


@functools.cache
def import_graph() -> tuple[dict, dict, dict]:
    """(module-level edges, function-level edges, imports of the top-level scripts) of every module."""
    module_level, function_level, scripts = {}, {}, {}
    for module, path in MODULES.items():
        module_level[module], function_level[module] = set(), set()
        for name, inside in _imports(ast.parse(path.read_text()), module, path):
            if name.split(".")[0] in SCRIPTS:
                scripts.setdefault(module, set()).add(name)
            target = _target(name) if name.startswith("trainscope") else None
            for imported in _with_packages(target, module) if target else ():
                (function_level if inside else module_level)[module].add(imported)
    return module_level, function_level, scripts


def cycles(edges: dict) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(node):
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for other in sorted(edges.get(node, ())):
            if other not in index:
                visit(other)
                low[node] = min(low[node], low[other])
            elif other in on_stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(edges):
        if node not in index:
            visit(node)
    return sorted(found)


def merged(*graphs: dict) -> dict:
    return {module: set().union(*(g.get(module, set()) for g in graphs)) for module in MODULES}


def test_the_graph_is_read_from_the_source():
    """Planted: a module-level import, a function-level one, a relative one, a name from a package."""
    module_level, function_level, _ = import_graph()
    assert "trainscope.core.records" in module_level["trainscope.core.errors"]
    assert "trainscope.core.faults" in module_level["trainscope.core.liveness"]
    assert "trainscope.measure.layers" in function_level["trainscope.measure.flops"]
    assert (
        "trainscope.measure.peak" in module_level["trainscope.predict.calibration"]
    )  # from trainscope.measure import peak
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    # importing a package's module runs the package's __init__, except from inside the package
    assert _with_packages("trainscope.experiments.base", "trainscope.gpu.check") == [
        "trainscope.experiments",
        "trainscope.experiments.base",
    ]
    assert _with_packages("trainscope.experiments.base", "trainscope.experiments.batch") == [
        "trainscope.experiments.base"
    ]


def test_no_import_cycle_at_module_level():
    module_level, _, _ = import_graph()
    assert cycles(module_level) == []


# None left: flops and modeling both read a model's layer classes from trainscope.measure.layers. A cycle that comes back
# fails the test.
KNOWN_CYCLES = []


def test_no_import_cycle_counting_imports_inside_functions():
    module_level, function_level, _ = import_graph()
    assert cycles(merged(module_level, function_level)) == KNOWN_CYCLES


def test_the_package_never_imports_the_top_level_scripts():
    assert import_graph()[2] == {}


if __name__ == "__main__":  # python tests/test_imports.py: the cycles, module-level and with function-level imports
    module_level, function_level, scripts = import_graph()
    print("module-level cycles:", cycles(module_level) or "none")
    print("cycles counting function-level imports:", cycles(merged(module_level, function_level)) or "none")
    print("imports of the top-level scripts:", scripts or "none")


PUBLIC = {"trainscope", "trainscope.classifier", "trainscope.workload.embedded"}  # with trainscope.__all__'s names


def test_the_scripts_that_train_import_only_the_public_api():
    """train.py and the examples reach trainscope through its public names only (docs/instrument.md)."""
    import trainscope

    for script in (ROOT / "train.py", *sorted((ROOT / "examples").glob("*.py"))):
        tree = ast.parse(script.read_text())
        used = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                used |= {a.name for a in node.names if a.name.split(".")[0] == "trainscope"}
            elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "trainscope":
                used |= {f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in MODULES else node.module
                         for a in node.names}  # fmt: skip
        assert used <= PUBLIC, (script.name, used - PUBLIC)
        attributes = {
            node.attr
            for node in ast.walk(tree)
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "trainscope"
        }
        assert attributes <= set(trainscope.__all__), (script.name, attributes - set(trainscope.__all__))


# The floors of the package, lowest first (docs/design.md): a module imports only from its own floor or below, at
# module level and inside functions alike. The instrument (measure, run) stands on the ground floor alone; train.py's
# workload and the predictor stand on it; the public modules (trainscope, its instrument, classifier and Trainer
# callback) on them; advice, the report, the experiments and make gpu-check stand on those; trainscope tune (its
# command line `trainscope/__main__.py` too) on top.
FLOORS = ["core", "measure", "run", "workload", "predict", "public", "advice", "report", "experiments", "gpu", "tune"]
PUBLIC_MODULES = {"trainscope", "trainscope.instrument", "trainscope.classifier", "trainscope.trainer"}


def floor_of(module: str) -> str:
    if module == "trainscope.__main__":  # the command line (trainscope tune) sits on the top floor
        return "tune"
    return "public" if module in PUBLIC_MODULES else module.split(".")[1]


def test_the_top_level_is_the_public_api_and_the_floors():
    entries = sorted(p.name for p in PACKAGE.iterdir() if p.name != "__pycache__")
    assert len(entries) <= 15, entries
    assert {floor_of(m) for m in MODULES} == set(FLOORS)
    public = ["__init__.py", "__main__.py", "instrument.py", "classifier.py", "trainer.py"]
    assert entries == sorted([*public, *(f for f in FLOORS if f != "public")])


def test_every_import_runs_down_the_floors():
    module_level, function_level, _ = import_graph()
    up = [
        (module, imported)
        for graph in (module_level, function_level)
        for module, targets in graph.items()
        for imported in targets
        if FLOORS.index(floor_of(imported)) > FLOORS.index(floor_of(module))
    ]
    assert up == []
    assert floor_of("trainscope.measure.timing") == "measure" and FLOORS.index("run") > FLOORS.index("measure")


def test_every_subpackage_states_its_public_names():
    for init in PACKAGE.rglob("__init__.py"):
        if init.parent == PACKAGE:
            continue
        tree = ast.parse(init.read_text())
        assert ast.get_docstring(tree), init
        names = next(
            (
                ast.literal_eval(n.value)
                for n in tree.body
                if isinstance(n, ast.Assign) and n.targets[0].id == "__all__"
            ),
            None,
        )
        assert names, f"{init} has no __all__"
        defined = {p.stem for p in init.parent.glob("*.py")} | {p.name for p in init.parent.iterdir() if p.is_dir()}
        defined |= {n.id for node in tree.body if isinstance(node, ast.Assign) for n in node.targets}
        defined |= {node.target.id for node in tree.body if isinstance(node, ast.AnnAssign)}
        defined |= {a.asname or a.name for node in tree.body if isinstance(node, ast.ImportFrom) for a in node.names}
        defined |= {node.name for node in tree.body if isinstance(node, ast.FunctionDef | ast.ClassDef)}
        # a name loaded on first use: a string the package's __getattr__ answers for (trainscope.experiments)
        lazy = [node for node in tree.body if isinstance(node, ast.FunctionDef) and node.name == "__getattr__"]
        defined |= {c.value for node in lazy for c in ast.walk(node) if isinstance(c, ast.Constant)}
        assert set(names) <= defined, (init, set(names) - defined)


LONGEST = 600


def test_every_module_is_under_600_lines():
    long = {m: n for m, p in MODULES.items() if (n := len(p.read_text().splitlines())) >= LONGEST}
    assert long == {}


def test_at_most_three_functions_outside_the_tests_run_past_60_lines():
    """Split by concern: a function that does several things is split, not left to grow (issue 65's bound: at most 3
    over 60 lines in the package and the root scripts; none is now)."""
    files = [*MODULES.values(), *ROOT.glob("*.py")]
    long = [
        f"{path.name}:{node.name} ({node.end_lineno - node.lineno + 1} lines)"
        for path in files
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno + 1 > 60
    ]
    assert len(long) <= 3, long


def loaded_by(modules: list[str], watched: list[str]) -> list[str]:
    """Which of `watched` a fresh interpreter has loaded once it imported `modules` (from the project's root)."""
    import subprocess
    import sys

    code = f"import sys, {', '.join(modules)}; print(sorted(set({watched!r}) & set(sys.modules)))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True)
    return ast.literal_eval(done.stdout.strip())


def test_the_flops_count_and_import_trainscope_load_no_torch():
    """The FLOPs formulas read a model's shape from its config alone (trainscope.measure.shapes), and `import
    trainscope` defers whatever loads torch or transformers: both stay light."""
    assert loaded_by(["trainscope", "trainscope.measure.flops"], ["torch", "transformers"]) == []


def test_the_design_map_names_every_module_once_in_its_room():
    """docs/design.md's map is drawn from the tree: each module of a floor is one row of that floor's table."""
    rows, floor = [], None
    for line in (ROOT / "docs" / "design.md").read_text().splitlines():
        if line.startswith("**`trainscope/"):
            floor = line.split("`")[1].removeprefix("trainscope/").rstrip("/")
        elif floor is not None and line.startswith("| `") and "," not in line.split("|")[1]:
            rows.append(f"{floor}/{line.split('`')[1]}" if floor else line.split("`")[1])
        elif line.startswith("## ") and floor is not None:
            break
    named = {
        str(p.relative_to(PACKAGE))
        for p in PACKAGE.rglob("*.py")
        if (p.name not in ("__init__.py", "__main__.py") or p.parent == PACKAGE)
        and not p.is_relative_to(PACKAGE / "workload" / "metrics")  # the evaluate metric: the `metrics/` row
    }
    assert sorted(r for r in rows if r.endswith(".py") and not r.endswith("/__init__.py")) == sorted(named)


def test_the_report_and_the_experiments_command_load_no_model_code():
    """report.py and `python -m trainscope.experiments` read records: importing them loads neither transformers'
    models, peft nor datasets (about 2 s a process); what trains defers those imports to the functions that train."""
    heavy = ["transformers.modeling_utils", "peft", "datasets"]
    assert loaded_by(["report", "trainscope.experiments"], heavy) == []


def test_trainscope_run_for_a_plain_loop_loads_no_model_library():
    """`import trainscope; trainscope.Run` for a loop with no HuggingFace model loads no transformers, datasets,
    evaluate or peft (2.2-2.6 s on top of `import accelerate` when it did; measured: docs/benchmarks.md)."""
    watched = ["transformers", "datasets", "evaluate", "peft", "trainscope.predict", "trainscope.classifier"]
    assert loaded_by(["accelerate", "trainscope", "trainscope.instrument"], watched) == []


# What only train.py's classifier is made of: the instrument (trainscope/run, trainscope/measure) imports none of it.
CLASSIFIER_MODULES = (
    "trainscope.classifier",
    "trainscope.predict",
    "trainscope.workload.modeling",
    "trainscope.workload.data",
    "trainscope.workload.unpad",
    "trainscope.workload.step",
    "trainscope.workload.dropout_draws",
)


def test_the_instrument_imports_no_classifier():
    """Nothing under trainscope/run or trainscope/measure imports train.py's workload, at module level or inside a
    function: what the classifier adds to a run reaches it through trainscope.run.driver."""
    found = []
    for path in [*(PACKAGE / "run").rglob("*.py"), *(PACKAGE / "measure").rglob("*.py")]:
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
            found += [
                f"{path.relative_to(PACKAGE)}: {name}"
                for name in names
                if any(name == m or name.startswith(m + ".") for m in CLASSIFIER_MODULES)
            ]
    assert found == []


def test_train_py_answers_help_before_torch_loads():
    """`python train.py --help` (4.5 s on a quiet 2-core machine when it imported the workload first) parses with
    argparse alone: no torch, transformers, datasets or accelerate (docs/benchmarks.md: its time)."""
    import subprocess
    import sys

    code = (
        "import runpy, sys; sys.argv = ['train.py', '--help']\n"
        "try:\n    runpy.run_path('train.py', run_name='__main__')\nexcept SystemExit:\n    pass\n"
        "print(sorted({'torch', 'transformers', 'datasets', 'accelerate'} & set(sys.modules)), file=sys.stderr)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True)
    assert "--per-device-batch-size" in done.stdout and done.stderr.strip().splitlines()[-1] == "[]"
