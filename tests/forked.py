"""The child side of conftest.run_script_forked: a script or module run as `python` would run it, in a process
forked from a fork server that imported train.py's modules once (and never ran a parallel region: GNU OpenMP, which
torch's CPU builds use, hangs in a child forked from a process that ran one on several threads)."""

import multiprocessing
import os
import runpy
import sys

PROJECT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def as_a_fresh_interpreter() -> None:
    """multiprocessing's start method back to a fresh interpreter's default (a fork server's child has the fork
    server's: a DataLoader's workers would then need its collate function picklable)."""
    multiprocessing.set_start_method(None, force=True)


def with_output_to(out: str, err: str, env: dict) -> None:
    """This process's output to the files `out` and `err` (file descriptors and Python's streams), its environment
    `env`."""
    for fd, path in ((1, out), (2, err)):
        target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        os.dup2(target, fd)
        os.close(target)
    sys.stdout = open(1, "w", buffering=1, closefd=False)  # noqa: SIM115 (the child's streams)
    sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115
    os.environ.clear()
    os.environ.update(env)


def run(command: list[str], env: dict, out: str, err: str) -> None:
    """`command` ([python, script, args...] or [python, -m, module, args...]) with `env`, its folder the project's,
    in a session of its own, its output to the files `out` and `err`; exits with the script's status."""
    as_a_fresh_interpreter()
    os.setsid()
    with_output_to(out, err, env)
    threads_from(env)
    os.chdir(PROJECT)
    as_python(command)


def threads_from(env: dict) -> None:
    """torch's intra-op threads as a fresh interpreter takes them at start-up, from OMP_NUM_THREADS (what `accelerate
    launch` exports: 1 unless its config says use_cpu); the fork server's torch read its own environment."""
    if env.get("OMP_NUM_THREADS", "").isdigit():
        import torch

        torch.set_num_threads(int(env["OMP_NUM_THREADS"]))


def as_python(command: list[str]) -> None:
    """`command` ([python, (-u,) script, args...] or [python, (-u,) -m, module, args...]) run in this process as
    `python` runs it."""
    sys.orig_argv = list(command)  # the command its record names (trainscope.core.provenance.launch_command)
    command = [command[0], *command[2:]] if command[1:2] == ["-u"] else command
    if command[1] == "-m":
        sys.argv = command[2:]
        runpy.run_module(command[2], run_name="__main__", alter_sys=True)
    else:
        sys.argv = command[1:]
        runpy.run_path(command[1], run_name="__main__")


def torchrun(launch_args, env: dict, out: str, err: str) -> None:
    """`torchrun` with its parsed arguments `launch_args` (the multi-GPU launcher of `accelerate launch` runs
    torch.distributed.run with such arguments and its environment `env`): torch.distributed.run's own code, its
    elastic agent in this process, forking the ranks (script_rank) where torchrun would start interpreters. Their
    output to the files `out` and `err`; exits 0 when every rank succeeded, else 1."""
    as_a_fresh_interpreter()
    with_output_to(out, err, env)
    os.chdir(PROJECT)
    import torch.distributed.run as distrib_run
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    launch = distrib_run.elastic_launch

    def forking(config, entrypoint):  # entrypoint: the Python (or program) torchrun would start
        config.start_method = "fork"
        return lambda *command: launch(config, entrypoint=script_rank)([entrypoint, *command])

    distrib_run.elastic_launch = forking
    try:
        distrib_run.run(launch_args)
    except ChildFailedError:
        sys.exit(1)


def script_rank(command: list[str]) -> None:
    """One rank of `torchrun`: `command` ([python, -u, script, args...] or [python, -u, -m, module, args...]) as
    `python` runs it; a script's exit status is the rank's."""
    as_a_fresh_interpreter()
    try:
        as_python(command)
    except SystemExit as exit_:
        if exit_.code not in (None, 0):
            raise


def ranks(main, args: list[str], processes: int, port: str, env: dict, out: str, err: str) -> None:
    """`main(args)` on `processes` ranks by Accelerate's notebook_launcher (torch's elastic agent, torchrun's, in this
    process, the ranks forked from it), with `env`, their output to the files `out` and `err`; exits 0 when every
    rank succeeded, else 1 (torchrun's status)."""
    as_a_fresh_interpreter()
    with_output_to(out, err, env)
    from accelerate import notebook_launcher
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    try:
        notebook_launcher(main, args=(args,), num_processes=processes, use_port=port)
    except ChildFailedError:
        sys.exit(1)
