"""Ad-hoc arms of one config, in alternating rounds (`python -m trainscope.experiments compare --arm NAME=FLAGS
...`): the generic comparison the declared experiments are made of, for a question none of them asks."""

import shlex
from pathlib import Path

from trainscope.experiments.base import Experiment, ExperimentFailed, experiment, planned_arm, runs_option


def arguments(parser) -> None:
    runs_option(parser)
    parser.add_argument("--arm", action="append", required=True, help="NAME=train.py flags; the first is the baseline")


def run(args, train_args: list[str]) -> dict:
    arms = []
    for text in args.arm:
        name, _, flags = text.partition("=")
        if not name:
            raise ExperimentFailed(f"--arm takes NAME=FLAGS, got {text!r}")
        arms.append(planned_arm(name, args.config, shlex.split(flags)))
    return experiment(Path(args.runs), Path(args.runs).name, arms, train_args, args.rounds)


EXPERIMENT = Experiment(
    name="compare",
    title="",
    target="",
    section=None,
    arguments=arguments,
    run=run,
    help="arms of one config, in alternating rounds (not in the report)",
)
