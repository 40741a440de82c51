"""`python -m trainscope tune [options] -- <your training command>`, the console script `trainscope`."""

import sys

USAGE = "usage: trainscope tune [options] -- <your training command>  (trainscope tune --help: the options)"
HELP = f"""{USAGE}

trainscope's command line (its library: `import trainscope`, docs/instrument.md).

commands:
  tune   what makes your training faster with the same result, tried from outside your script (docs/tune.md)"""


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] != ["tune"]:
        asked = argv[:1] in (["--help"], ["-h"])
        print(
            HELP if asked else f"trainscope: {' '.join(argv[:1]) or 'no command'}: {USAGE}",
            file=sys.stdout if asked else sys.stderr,
        )
        sys.exit(0 if asked else 2)
    from trainscope.tune.main import main as tune

    tune(argv[1:])


if __name__ == "__main__":
    main()
