"""Experiments, each declared once: its arms and how it runs, the rows it contributes and its report section.

An experiment is one module of this package ending in `EXPERIMENT = Experiment(...)` (trainscope.experiments.base):
its name (the subcommand of `python -m trainscope.experiments`), its report section's title and function, the
make target that produces its inputs, and either the folder its train.py runs go to under --runs or the results
file a script of its own writes under --results. `REGISTRY` (in trainscope/experiments/registry.py) lists
them in the report's order; report.py writes
one section each, sections.collect reads their inputs, the CLI offers their subcommands.

Adding an experiment: a module here (arms, run, section), its line in REGISTRY, and one Makefile
target.
"""

__all__ = ["REGISTRY", "SECTIONS", "Experiment", "ExperimentFailed", "main", "parser"]


def __getattr__(name: str):
    # deferred: the declarations load torch and accelerate, which `python -m trainscope.experiments.<module> --help`
    # and the scripts' --help (their flags are in this package) need none of
    if name in ("REGISTRY", "SECTIONS", "Experiment", "ExperimentFailed", "main", "parser"):
        from trainscope.experiments import registry

        return getattr(registry, name)
    raise AttributeError(f"module 'trainscope.experiments' has no attribute {name!r}")
