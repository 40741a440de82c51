"""Experiments, each declared once: a module here ending in `EXPERIMENT = Experiment(...)` (trainscope.experiments.base:
its arms and run, its report section), listed in the report's order by `REGISTRY` (registry.py), plus one Makefile
target. report.py writes one section each; `python -m trainscope.experiments NAME` runs them."""

__all__ = ["REGISTRY", "SECTIONS", "Experiment", "ExperimentFailed", "main", "parser"]


def __getattr__(name: str):
    # deferred: the declarations load torch and accelerate, which `python -m trainscope.experiments.<module> --help`
    # and the scripts' --help (their flags are in this package) need none of
    if name in ("REGISTRY", "SECTIONS", "Experiment", "ExperimentFailed", "main", "parser"):
        from trainscope.experiments import registry

        return getattr(registry, name)
    raise AttributeError(f"module 'trainscope.experiments' has no attribute {name!r}")
