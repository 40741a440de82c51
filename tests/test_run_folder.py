"""The run folder is decided alike on every rank: an existing folder is the main process's finding, so a rank that
looks later never mistakes the folder the main process has just made for this very run for an older one."""

import time
from pathlib import Path

from conftest import run_in_forked_ranks


def make_the_folder_as_a_late_rank_looks(args: list[str]) -> None:
    """Two ranks: rank 1 looks a second late, after the main process has made the run's folder."""
    from accelerate import PartialState

    from trainscope.run import startup
    from trainscope.run.options import RunOptions

    state = PartialState(cpu=True)  # as train.py's start-up makes it on a machine without a GPU
    if state.process_index == 1:
        time.sleep(1.0)
    options = RunOptions(output_dir=args[0], run_name="race")
    run_dir = startup.resolve_run_dir(options, state, ("model",), "give another name")
    if state.is_main_process:
        run_dir.mkdir()
    state.wait_for_everyone()


def test_a_rank_that_looks_late_does_not_find_its_own_run_folder_already_there(tmp_path, capfd):
    assert run_in_forked_ranks([str(tmp_path)], main=make_the_folder_as_a_late_rank_looks, timeout=120) == 0, (
        capfd.readouterr().err[-2000:]
    )
    assert (Path(tmp_path) / "race").is_dir()
