"""python -m trainscope.experiments NAME --runs DIR [options] -- [train.py flags]

Every experiment declared in trainscope.experiments.REGISTRY that runs train.py is a subcommand; `--help` after
its name lists its options. Writes <runs>/comparison.{json,md} with provenance; `make report` reads them.
"""

import argparse
import sys

from trainscope.experiments import REGISTRY, ExperimentFailed
from trainscope.experiments.base import split_args


def parser() -> argparse.ArgumentParser:
    root = argparse.ArgumentParser(prog="python -m trainscope.experiments", description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
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
    except ExperimentFailed as error:
        print(f"error: {error}", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
