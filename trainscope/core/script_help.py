"""--help of a script that takes train.py's flags besides its own (loaders_bench.py, compare_dp.py): its own flags,
then where train.py's are listed. Built from the script's own settings dataclass by argparse alone, so a script can
answer it before it imports torch (over a second on 2 cores, docs/benchmarks.md#the-scripts---help)."""

import argparse
import dataclasses
import sys

from trainscope.core.faults import UserError

TRAIN_FLAGS = """Every train.py flag is taken too (the model, data, batch size, precision, ...):
`python train.py --help` lists them."""


def option(*, help: str, **kwargs) -> dataclasses.Field:
    """A settings field with its --help text: what transformers' HfArg(help=...) makes, without importing
    transformers (HfArgumentParser reads the help from the same metadata)."""
    return dataclasses.field(metadata={"help": help}, **kwargs)


def require_at_least_one(settings, *names: str) -> None:
    """A UserError naming the first of `names` (fields of the settings) below 1, by its flag."""
    for name in names:
        if getattr(settings, name) < 1:
            raise UserError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(settings, name)}")


def own_parser(own, description: str | None) -> argparse.ArgumentParser:
    """An argparse parser of the dataclass `own`'s fields only, for the help text (the script's real parsing is
    trainscope.workload.settings.parse_settings, with train.py's flags)."""
    parser = argparse.ArgumentParser(
        description=description,
        epilog=TRAIN_FLAGS,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        usage="%(prog)s [its flags below] [train.py flags]",
    )
    for field in dataclasses.fields(own):
        default = field.default_factory() if field.default is dataclasses.MISSING else field.default
        text = field.metadata.get("help", "")
        if default not in (None, [], "") and "default" not in text:
            text += f" (default: {' '.join(map(str, default)) if isinstance(default, list) else default})"
        parser.add_argument(
            "--" + field.name.replace("_", "-"),
            nargs="+" if isinstance(default, list) or "list[" in str(field.type) else None,
            metavar=field.name.upper(),
            help=argparse.SUPPRESS if text.startswith("Internal:") else text,
        )
    return parser


def answer_help(own, description: str | None, argv: list[str] | None = None) -> None:
    """When the command line asks for help: print the script's own flags, point to train.py's, and exit."""
    args = sys.argv[1:] if argv is None else argv
    if "-h" in args or "--help" in args:
        own_parser(own, description).print_help()
        sys.exit(0)
