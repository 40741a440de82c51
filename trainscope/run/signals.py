"""A run's stop signals: the handler that notes SIGINT, SIGTERM and SIGUSR1 (and exits at once, writing a prepared
record, on a second one), the Interrupted exception raised at a boundary, and the stop vote by which several ranks
agree on the step to stop at. trainscope.run.lifecycle acts on them.
"""

import os
import signal
import threading
import time
from datetime import timedelta

import torch

from trainscope.core.records import write_prepared

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)


def exit_code(signum: int) -> int:
    """The shell's convention for a process ended by a signal: 128 + its number (130 SIGINT, 143 SIGTERM)."""
    return 128 + signum


class Interrupted(Exception):
    """Raised at a boundary where the run's state is whole, once a stop signal has been received (and,
    with several processes, agreed on by every rank)."""

    def __init__(self, signum: int, rank: int = 0):
        super().__init__(signal.Signals(signum).name)
        self.signum, self.rank = signum, rank


# The forced exit's record is rendered in advance with these placeholders, filled in by the handler.
STEP_MARK, FINISHED_MARK = "<trainscope:step>", "<trainscope:finished>"


class StopSignals:
    """SIGINT, SIGTERM and SIGUSR1 in this process. The handler only notes the first (the training thread acts on it
    at its next boundary). A second one, more than DUPLICATE_S after the first (a launcher may deliver one Ctrl-C
    twice within milliseconds), exits at once, writing a record prepared in advance (`prepare`) with system calls."""

    DUPLICATE_S = 1.0

    def __init__(self):
        self.received: int | None = None
        self._first_at = None
        self._previous = {}
        self._prepared = None  # (record path, {signal: record bytes with placeholders}, the step now)
        self._messages = {s: f"\n{signal.Signals(s).name} again: exiting at once\n".encode() for s in STOP_SIGNALS}

    def install(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        for signum in STOP_SIGNALS:
            self._previous[signum] = signal.signal(signum, self._handle)

    def restore(self) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous = {}

    def prepare(self, path, records: dict | None, step=None) -> None:
        """What a forced exit writes: `records` by signal (bytes with the step and time left as placeholders)
        and `step()`, the optimizer steps done; None: leave the record as it is (it already says how the run ended)."""
        self._prepared = (str(path), records, step) if records else None

    def _handle(self, signum, frame) -> None:
        if self.received is None:
            self.received, self._first_at = signum, time.monotonic()
        elif time.monotonic() - self._first_at > self.DUPLICATE_S:
            self._exit_at_once(signum)

    def _exit_at_once(self, signum: int) -> None:
        os.write(2, self._messages.get(signum, b"\nexiting at once\n"))
        if self._prepared is not None:
            path, records, step = self._prepared
            finished = time.strftime("%Y-%m-%dT%H:%M:%S+00:00", time.gmtime()).encode()
            data = records[signum].replace(f'"{STEP_MARK}"'.encode(), str(step()).encode())
            try:
                write_prepared(path, data.replace(f'"{FINISHED_MARK}"'.encode(), b'"' + finished + b'"'))
            except OSError:
                pass
        os._exit(exit_code(signum))


# The most optimizer steps between two stop votes: a signal waits up to K - 1 steps more than with a vote at every
# step, and SIGTERM's grace before SIGKILL (30 s under torchrun and SLURM) must still hold those steps and a checkpoint.
VOTE_EVERY_MAX = 10


def vote_interval(log_every: int) -> int:
    """K, the optimizer steps from one stop vote to the next: the log interval (the loop's other pause), at most
    VOTE_EVERY_MAX."""
    return max(1, min(log_every, VOTE_EVERY_MAX))


# The vote's value: the signal in the high bits, the lowest rank that received it in the low ones (MAX picks
# the highest signal, and among the ranks that received it the lowest).
_RANK_BITS = 24


def vote_value(signum: int, rank: int) -> int:
    return (signum << _RANK_BITS) | ((1 << _RANK_BITS) - 1 - rank) if signum else 0


def vote_of(value: int) -> tuple[int, int]:
    """(signal, the lowest rank that received it) of an agreed vote value."""
    return value >> _RANK_BITS, (1 << _RANK_BITS) - 1 - (value & ((1 << _RANK_BITS) - 1))


class StopVote:
    """Ranks agree on stopping without stalling a step: at a voting boundary (every K-th optimizer step's end, every
    gap between evaluation batches) each rank posts the signal it received (0 for none) in an asynchronous MAX
    all-reduce, and reads it at the next boundary, long arrived; every rank has the same boundaries. CPU tensors over
    a gloo group beside NCCL: on NCCL reading the vote would be a device sync behind the gradient all-reduces."""

    def __init__(self, backend: str | None, timeout_s: float | None = None):
        import torch.distributed as dist

        self.dist = dist
        timeout = timedelta(seconds=timeout_s) if timeout_s else None
        self.group = dist.new_group(backend="gloo", timeout=timeout) if backend not in (None, "gloo") else None
        self._pending = None

    def post_and_read(self, local: int, post: bool = True) -> int:
        """The vote posted at the previous boundary (0 where none was); then, when `post`, this boundary's."""
        agreed = self._read()
        if post:
            flag = torch.tensor([local], dtype=torch.int64)
            work = self.dist.all_reduce(flag, op=self.dist.ReduceOp.MAX, group=self.group, async_op=True)
            self._pending = (work, flag)
        return agreed

    def _read(self) -> int:
        if self._pending is None:
            return 0
        work, flag = self._pending
        work.wait()
        self._pending = None
        return int(flag.item())  # a CPU tensor: no device sync

    def conclude(self, local: int) -> int:
        """The last vote, read: the pending one, and if it agreed on nothing, one more taken now (blocking,
        once, at the run's end), so a signal received after the last boundary still stops the run."""
        agreed = self._read()
        if agreed:
            return agreed
        flag = torch.tensor([local], dtype=torch.int64)
        self.dist.all_reduce(flag, op=self.dist.ReduceOp.MAX, group=self.group)
        return int(flag.item())

    def settle(self) -> None:
        """Wait for the last vote, so no collective is left in flight when the run ends."""
        self._read()
