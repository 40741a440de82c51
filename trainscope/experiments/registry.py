"""The experiments in the report's order (`REGISTRY`, `SECTIONS`) and their command line,
`python -m trainscope.experiments NAME --runs DIR [options] -- [train.py flags]`: trainscope.experiments says how
an experiment is declared."""

import argparse
import sys

from trainscope.core.errors import UserError
from trainscope.core.launching import split_args
from trainscope.experiments import (
    amp,
    batch,
    ckpt,
    compare,
    compiling,
    ddp_cost,
    matrix,
    optimization,
    prediction,
    profile,
)
from trainscope.experiments.base import Experiment, ExperimentFailed
from trainscope.experiments.data_parallel import results as data_parallel
from trainscope.experiments.loaders import results as loaders

# In the report's order; `compare` and `find-batch` have no section (a tool and a child process), `tune-confirm`
# (trainscope tune --confirm's result) shows in the Optimization section.
REGISTRY: list[Experiment] = [
    profile.EXPERIMENT, optimization.EXPERIMENT, loaders.EXPERIMENT, amp.EXPERIMENT, data_parallel.EXPERIMENT,
    ddp_cost.EXPERIMENT, ckpt.EXPERIMENT, batch.EXPERIMENT, matrix.EXPERIMENT, compiling.EXPERIMENT,
    prediction.EXPERIMENT, compare.EXPERIMENT, batch.FIND_BATCH, optimization.CONFIRM
]  # fmt: skip
SECTIONS = [e for e in REGISTRY if e.section is not None]
USAGE = """python -m trainscope.experiments NAME --runs DIR [options] -- [train.py flags]

Every experiment that runs train.py is a subcommand; `--help` after its name lists its options. Writes
<runs>/comparison.{json,md} with provenance; `make report` reads them."""


# ---------------------------------------------------------------- python -m trainscope.experiments NAME ... -- [train.py flags]


def parser() -> argparse.ArgumentParser:
    root = argparse.ArgumentParser(
        prog="python -m trainscope.experiments", description=USAGE, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    commands = root.add_subparsers(dest="command", required=True)
    for experiment in REGISTRY:
        if experiment.run is not None:
            sub = commands.add_parser(experiment.name, help=experiment.help, description=experiment.help)
            experiment.arguments(sub)
    return root


def main(argv=None) -> None:
    ours, train_args = split_args(sys.argv[1:] if argv is None else argv)
    args = parser().parse_args(ours)
    if getattr(args, "rounds", 1) < 1:
        parser().error("--rounds must be at least 1")
    experiment = next(e for e in REGISTRY if e.name == args.command)
    try:
        experiment.run(args, train_args)
    except (ExperimentFailed, UserError) as error:
        print(f"error: {error}", file=sys.stderr)
        sys.exit(1)
