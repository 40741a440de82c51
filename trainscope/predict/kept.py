"""Whether a calibration of the predictor may be kept (trainscope.predict.calibration): its runs must agree with each
other, and a first-use calibration is cached only where other processes left the machine quiet while it ran, as the
matmul peak's rates are (trainscope.measure.peak)."""

import itertools
import resource
import time

from trainscope.core import environment
from trainscope.core.record_view import RunView
from trainscope.measure import peak

# Other processes' cores, averaged over a first-use calibration's runs, above which it is kept for its run only:
# cached, it would skew every later prediction on this machine.
BUSY_CORES = peak.BUSY_CORES


class NotKept(RuntimeError):
    """A calibration whose runs contradict each other: refused, neither used nor cached nor remembered as failed."""


def contradictions(records: dict) -> list[str]:
    """Pairs of runs of one model, length, checkpointing and process count whose larger batch stepped faster than the
    smaller: points no fit can reconcile (a machine busy during one of them)."""
    groups = {}
    for name, record in records.items():
        view = RunView(record)
        key = tuple(view.setting(k) for k in ("model", "max_seq_length", "gradient_checkpointing")), view.world_size
        if view.step_s:
            groups.setdefault(key, []).append((view.setting("per_device_batch_size"), view.step_s, name))
    return [
        f"{large[2]}'s step {large[1]:.3f} s at batch {large[0]} below {small[2]}'s {small[1]:.3f} s at batch {small[0]}"
        for runs in groups.values()
        for small, large in itertools.combinations(sorted(runs), 2)
        if large[0] > small[0] and large[1] < small[1]
    ]


def cpu_seconds() -> tuple[float, float, float] | None:
    """(the machine's busy CPU seconds, this process's and its waited-for children's, a monotonic clock)."""
    busy, mine = environment.machine_busy_seconds(), resource.getrusage(resource.RUSAGE_SELF)
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    own = mine.ru_utime + mine.ru_stime + children.ru_utime + children.ru_stime
    return None if busy is None else (busy, own, time.monotonic())
