"""`python -m trainscope tune [options] -- <your training command>`, the console script `trainscope`."""

import sys

USAGE = "usage: trainscope tune [options] -- <your training command>  (trainscope tune --help: the options)"


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] != ["tune"]:
        print(USAGE, file=sys.stdout if argv[:1] in (["--help"], ["-h"]) else sys.stderr)
        sys.exit(0 if argv[:1] in (["--help"], ["-h"]) else 2)
    from trainscope.tune.main import main as tune

    tune(argv[1:])


if __name__ == "__main__":
    main()
