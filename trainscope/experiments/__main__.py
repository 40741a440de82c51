"""python -m trainscope.experiments NAME --runs DIR [options] -- [train.py flags] (see trainscope.experiments)."""

from trainscope.experiments.registry import main

if __name__ == "__main__":
    main()
