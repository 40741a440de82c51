"""make gpu-check's plan: the checks in the order they run, their estimates and timeouts, the total and the parts.

How it works: docs/gpu.md#what-make-gpu-check-does.
"""

import copy
import math

from trainscope.core import launching
from trainscope.core.errors import UserError
from trainscope.gpu import checks
from trainscope.gpu.estimates import SESSION_S, cut, first_costs

# After a collective times out: the peers name the failed rank and the record is written (seconds); a check's timeout
# leaves this beyond its estimate and its --distributed-timeout, which is at least MIN_DISTRIBUTED_TIMEOUT_S (a rank
# may wait that long for another's start-up work: its operators timed, the first evaluation)
DISTRIBUTED_EVIDENCE_S = 30.0
MIN_DISTRIBUTED_TIMEOUT_S = 60
# With one GPU: what the plan leaves out, to keep it to few sessions (`--only NAME` runs it), and what cannot run there
LEFT_OUT_ON_ONE_GPU = {
    "memory-snapshot": "run 2 on the H200 recorded its window and dumped it within its timeout",
    "ddp-compile": "two processes compiling at once (about 3 minutes) on the shared GPU",
    "overhead": "10 launches of 75 steps (about 4.5 minutes)",
}
NEEDS_TWO_GPUS = {
    "compare-dp": "needs 2 GPUs: compare_dp.py's DDP workers each bind cuda:<local rank> over NCCL (a second "
    "process cannot share the GPU there, and one process has no all-reduce); DataParallel needs two",
}


def distributed_timeout(step: dict) -> int:
    """A multi-process check's --distributed-timeout: what its timeout leaves after its estimate (a collective can
    hang at the run's end) and DISTRIBUTED_EVIDENCE_S (the peers' report and the record written)."""
    return math.floor(step["timeout_s"] - step["estimate_s"] - DISTRIBUTED_EVIDENCE_S)


def _distributed_timeouts(steps: list[dict]) -> None:
    """Each multi-process check's timeout made room for MIN_DISTRIBUTED_TIMEOUT_S and DISTRIBUTED_EVIDENCE_S past its
    estimate, and its --distributed-timeout set to what that timeout leaves (train.py's default, 600 s, outlived the
    checks' timeouts of 109-138 s: a hung collective was killed before the run could say anything)."""
    for step in steps:
        if "config" not in step or step["processes"] < 2:
            continue
        least = math.ceil(step["estimate_s"]) + MIN_DISTRIBUTED_TIMEOUT_S + DISTRIBUTED_EVIDENCE_S
        step["timeout_s"] = max(step["timeout_s"], least)
        step["args"] = checks.with_flag(step["args"], "--distributed-timeout", str(distributed_timeout(step)))


def plan(gpus: int | None = None, only: list[str] | None = None) -> list[dict]:
    """The checks, in the order they run (the most informative first: a short budget skips the tail): those of
    several processes, then those of one GPU, then the benchmarks. Each has a name, what only a GPU run confirms,
    a train.py run (config + args, and `env` to launch it with) or a command ("{out}" stands for its results folder),
    its estimated seconds (with how they were estimated) and its timeout. A check that cannot run on `gpus` GPUs is
    marked skipped with its reason; with one GPU the multi-process training checks share it (`shared_gpu`), and
    LEFT_OUT_ON_ONE_GPU is left out (skipped, `left_out`). `only`: just the checks named, the left-out ones among
    them run. The checks are numbered into parts (`part`), each one command within a session's device time, each
    check's estimate as in its part alone. With no GPU (a dry run) it is planned as for one."""
    gpus = max(launching.cuda_devices() if gpus is None else gpus, 1)
    steps = checks.declared(gpus)
    for step in steps:
        _fit(step, gpus)
    if only:
        unknown = sorted(set(only) - {step["name"] for step in steps})
        if unknown:
            raise UserError(f"--only {' '.join(unknown)}: no such check (the dry run lists them)")
        steps = [step for step in steps if step["name"] in only]
        for step in steps:
            if step.pop("left_out", False):
                del step["skipped"]
    cut(steps, _charged)
    return steps


def _charged(steps: list[dict]) -> list[dict]:
    """Copies of `steps` planned as one command: what only its first launches cost, and the multi-process checks'
    --distributed-timeout from their estimates."""
    charged = copy.deepcopy(steps)
    first_costs(charged)
    _distributed_timeouts(charged)
    return charged


def _fit(step: dict, gpus: int) -> None:
    """The check as it runs on `gpus` GPUs: skipped where it cannot, shared over gloo where one GPU holds its
    processes, left out where the one-GPU plan has no room for it."""
    name, processes, on_one_gpu = step["name"], step.get("processes", 1), step.pop("confirms_on_one_gpu", None)
    if gpus == 1 and name in NEEDS_TWO_GPUS:
        step["skipped"] = NEEDS_TWO_GPUS[name]
        return
    if "config" in step and not launching.plan(step["config"], gpus).runnable:
        if gpus == 1 and processes == 2:
            checks.share_one_gpu(step, on_one_gpu)
        else:
            step["skipped"] = launching.plan(step["config"], gpus).reason
            return
    if gpus == 1 and name in LEFT_OUT_ON_ONE_GPU:
        step["skipped"] = (
            f"left out of the one-GPU plan, each of whose parts takes a session's {SESSION_S / 60:.0f} minutes of "
            f"GPU time: {LEFT_OUT_ON_ONE_GPU[name]}; `python -m trainscope.gpu.check --only {name}` runs it"
        )
        step["left_out"] = True
