"""Experiments, each declared once: its arms and how it runs, the rows it contributes and its report section.

An experiment is one module of this package ending in `EXPERIMENT = Experiment(...)` (trainscope.experiments.base):
its name (the subcommand of `python -m trainscope.experiments`), its report section's title and function, the
make target that produces its inputs, and either the folder its train.py runs go to under --runs or the results
file a script of its own writes under --results. `REGISTRY` lists them in the report's order; report.py writes
one section each, reporting.collect reads their inputs, the CLI offers their subcommands.

Adding an experiment: a module here (arms, run, section), its line in REGISTRY, and one Makefile target.
"""

from trainscope.experiments import (amp, batch, ckpt, compare, compiling, data_parallel, ddp_cost, loaders, matrix,
                                    optimization, profile)
from trainscope.experiments.base import Experiment, ExperimentFailed

# In the report's order; `compare` and `find-batch` have no section (a tool and a child process).
REGISTRY: list[Experiment] = [profile.EXPERIMENT, optimization.EXPERIMENT, loaders.EXPERIMENT, amp.EXPERIMENT,
                              data_parallel.EXPERIMENT, ddp_cost.EXPERIMENT, ckpt.EXPERIMENT, batch.EXPERIMENT,
                              matrix.EXPERIMENT, compiling.EXPERIMENT, compare.EXPERIMENT, batch.FIND_BATCH]
SECTIONS = [e for e in REGISTRY if e.section is not None]

__all__ = ["REGISTRY", "SECTIONS", "Experiment", "ExperimentFailed"]
