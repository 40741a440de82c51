"""Which ranks are alive, which failed and with what error, judged through the launcher's store.

How it works: docs/endings.md#in-the-code-how-a-ranks-death-is-told-trainscopecorelivenesspy.
"""

import json
import os
import socket
import sys
import threading
import time
from dataclasses import dataclass
from datetime import timedelta

from trainscope.core.faults import Fault
from trainscope.core.records import redact

BEAT_S = 0.5
PATIENCE_S = 3.0
STORE_TIMEOUT_S = 10.0
PREFIX = "trainscope/"

_current = None  # this process's PeerWatch while one runs (publish_error reaches it from any error path)


@dataclass(frozen=True)
class Verdict:
    """What became of one peer: `alive`, `failed` (with its one line), `vanished` or `unknown`."""

    rank: int
    state: str
    error: str | None = None
    caused_by: int | None = None  # a failed rank whose failure followed another peer's
    where: str | None = None  # "pid 4242 on host-b", as the rank registered itself
    silent_s: float | None = None
    reason: str | None = None  # why it is unknown

    @property
    def name(self) -> str:
        return f"rank {self.rank} ({self.where})" if self.where else f"rank {self.rank}"

    def describe(self) -> str:
        if self.state == "failed":
            return f"rank {self.rank} failed: {self.error}"
        if self.state == "vanished":
            return f"{self.name} vanished (no heartbeat for {self.silent_s:.1f} s: killed, or its machine lost)"
        if self.state == "unknown":
            return f"rank {self.rank}: state unknown ({self.reason})"
        return f"rank {self.rank} alive"


def lost_a_peer(error: BaseException) -> bool:
    """Whether an error is a collective that lost its peers (a closed connection, a timeout), as gloo and NCCL
    report it, rather than one every rank raised alike (a non-finite loss, out of memory)."""
    import torch

    if isinstance(error, getattr(torch.distributed, "DistError", ())):
        return True
    text = str(error).lower()
    return isinstance(error, RuntimeError) and any(
        word in text for word in ("connection", "gloo", "nccl", "timed out", "timeout", "broken pipe")
    )


def collective_timed_out(error: BaseException) -> bool:
    """The NCCL watchdog's or gloo's timeout of one collective (as opposed to a closed connection)."""
    text = str(error).lower()
    return "timed out" in text or "timeout" in text


def first_line(error: BaseException) -> str:
    """A store error's first line (c10d appends its C++ stack to the message)."""
    lines = str(error).strip().splitlines()
    return " ".join(lines[0].split())[:300].rstrip() if lines else type(error).__name__


def default_store():
    """The default process group's store (the launcher's rendezvous store under torchrun), or None."""
    try:
        from torch.distributed import distributed_c10d

        return distributed_c10d._get_default_store()
    except Exception:  # no process group, or an API that moved
        return None


def _own_connection(store):
    """A connection of this thread's own with a short timeout: store calls from two threads on one
    connection wait for each other, and a store that stopped answering must not hold a rank for the
    process group's whole timeout."""
    try:
        store = store.clone()
    except (AttributeError, RuntimeError):
        pass
    store.set_timeout(timedelta(seconds=STORE_TIMEOUT_S))
    return store


class PeerWatch:
    def __init__(self, store, rank: int, world: int, beat_s: float = BEAT_S, patience_s: float = PATIENCE_S):
        self.rank, self.world, self.beat_s, self.patience_s = rank, world, beat_s, patience_s
        self._store = _own_connection(store)  # the training thread's
        self._thread_store = _own_connection(store)  # the beating thread's
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._on_lost, self._watched, self._silence_s = None, (), patience_s
        self._last_seen: dict[int, tuple[bytes, float]] = {}
        self.judged: dict[int, Verdict] = {}  # verdicts already reached (by the watch or by `verdicts`)
        self._store.set(self._key("who", rank), f"pid {os.getpid()} on {socket.gethostname()}")
        self._store.add(self._key("beat", rank), 1)
        self._thread = threading.Thread(target=self._run, name="trainscope-heartbeat", daemon=True)
        self._thread.start()

    @staticmethod
    def _key(kind: str, rank: int | str) -> str:
        return f"{PREFIX}{kind}/{rank}"

    @classmethod
    def start(cls, state) -> "PeerWatch | None":
        """A watch for this process of a multi-process run; None for a single process or without a store."""
        global _current
        if state.num_processes < 2:
            return None
        store = default_store()
        if store is None:
            return None
        try:
            _current = cls(store, state.process_index, state.num_processes)
        except Exception:  # a store that does not answer: peers are then judged `unknown`
            return None
        return _current

    # ---------------------------------------------------------------- the beating thread

    def _run(self) -> None:
        while not self._stop.wait(self.beat_s):
            try:
                self._thread_store.add(self._key("beat", self.rank), 1)
                if self._on_lost is not None:
                    self._look()
            except Exception:  # the store is gone (its host ended): peers are `unknown` from now on
                return

    def _look(self) -> None:
        """One look at the watched peers; the callback, once, for those found failed or silent for too long."""
        lost = [
            v if v.state != "vanished" or v.silent_s >= self._silence_s else None
            for v in self._observe(self._thread_store, self._watched, self._last_seen)
            if v.state in ("failed", "vanished")
        ]
        lost = [v for v in lost if v is not None]
        with self._lock:
            callback = self._on_lost
            if not lost or callback is None:
                return
            self._on_lost = None
            self.judged.update({v.rank: v for v in lost})
        try:
            callback(lost)
        except Exception as error:  # the beat must go on: peers would take this rank for vanished
            print(f"warning: a lost peer could not be recorded ({first_line(error)})", file=sys.stderr, flush=True)

    def _observe(self, store, ranks, seen: dict, since: float = 0.0) -> list[Verdict]:
        """Each rank's state now: `failed` when it published an error; `alive` when its beat moved between two
        looks taken after `since`; `vanished` when it has not moved for PATIENCE_S; else `silent` (not decided).
        `seen`: rank -> (beat, when it was last seen to move), updated."""
        now = time.monotonic()
        published = int(store.add(self._key("errors", "count"), 0)) > 0  # one call, unless some rank failed
        failed = {
            r: json.loads(store.get(self._key("error", r)))
            for r in ranks
            if published and store.check([self._key("error", r)])
        }
        beats = store.multi_get([self._key("beat", r) for r in ranks]) if ranks else []
        found = []
        for rank, beat in zip(ranks, beats):
            if rank in failed:
                found.append(Verdict(rank, "failed", error=failed[rank]["line"], caused_by=failed[rank]["caused_by"]))
                continue
            previous = seen.get(rank)
            if previous is None or previous[0] != beat:
                # a move seen against an older look (before `since`) may be the last beat before a kill
                moved = previous is not None and previous[1] >= since
                seen[rank] = (beat, now)
                found.append(Verdict(rank, "alive") if moved else Verdict(rank, "silent", silent_s=0.0))
                continue
            silent = now - previous[1]
            found.append(
                Verdict(rank, "vanished", where=self._where(store, rank), silent_s=silent)
                if silent >= self.patience_s
                else Verdict(rank, "silent", silent_s=silent)
            )
        return found

    def _where(self, store, rank: int) -> str | None:
        try:
            return store.get(self._key("who", rank)).decode()
        except Exception:
            return None

    # ---------------------------------------------------------------- what the training thread asks

    def watch(self, on_lost, ranks=None, silence_s: float | None = None) -> None:
        """Call `on_lost([verdicts])` from the beating thread, once, when a watched peer (all, by default) publishes
        an error or stays silent for `silence_s` (default: the patience)."""
        ranks = [r for r in (range(self.world) if ranks is None else ranks) if r != self.rank]
        with self._lock:
            self._watched, self._on_lost = tuple(ranks), on_lost
            self._silence_s = self.patience_s if silence_s is None else silence_s

    def quiet(self) -> None:
        """No more callbacks (the run is ending on its own path); the beat goes on until `stop`."""
        with self._lock:
            self._on_lost = None

    def publish_error(self, line: str, caused_by: int | None = None) -> None:
        """This rank's one line, for its peers to name (before it exits); `caused_by` when it only follows a
        peer's failure (the peers then name the root, not this rank). The first line published stays."""

        try:
            self._store.compare_set(
                self._key("error", self.rank), "", json.dumps({"line": redact(line), "caused_by": caused_by})
            )
            self._store.add(self._key("errors", "count"), 1)
        except Exception:  # the store is gone: the peers will say `unknown`
            pass

    def verdicts(self) -> dict[int, Verdict]:
        """Every peer's state, waiting up to PATIENCE_S for a silent one to beat again (a peer that is
        alive but slow to answer is not called vanished on one missed beat)."""
        peers = [r for r in range(self.world) if r != self.rank]
        with self._lock:
            known = dict(self.judged)
        if len(known) == len(peers):
            return known
        started = time.monotonic()
        deadline, seen = started + self.patience_s + self.beat_s, dict(self._last_seen)  # the thread's looks so far
        try:
            while True:
                found = {
                    v.rank: v
                    for v in self._observe(self._store, [r for r in peers if r not in known], seen, since=started)
                }
                found.update(known)
                undecided = [v for v in found.values() if v.state == "silent"]
                if not undecided or time.monotonic() > deadline:
                    break
                time.sleep(self.beat_s / 2)
        except Exception as error:
            reason = f"the launcher's store is unreachable: {first_line(error)}"
            return {r: known.get(r) or Verdict(r, "unknown", reason=reason) for r in peers}
        found = {
            r: v
            if v.state != "silent"
            else Verdict(r, "vanished", where=self._where(self._store, r), silent_s=v.silent_s)
            for r, v in found.items()
        }
        with self._lock:
            self.judged.update({r: v for r, v in found.items() if v.state in ("failed", "vanished")})
        return found

    def claim(self, name: str) -> bool:
        """True for exactly one rank of the launch that claims `name` (the first), False for the others and
        when the store cannot be reached (then nobody can be sure to be the only one)."""
        try:
            return self._store.compare_set(self._key("claim", name), "", str(self.rank)) == str(self.rank).encode()
        except Exception:
            return False

    def stop(self) -> None:
        global _current
        self.quiet()
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join(
                timeout=1.0
            )  # a thread stuck on an unreachable store is a daemon: it ends with the process
        if _current is self:
            _current = None


def publish_error(line: str, caused_by: int | None = None) -> None:
    """Tell the peers this rank's one line, when this process runs a watch (any error path may call it)."""
    if _current is not None:
        _current.publish_error(line, caused_by)


def root_cause(verdicts) -> "Verdict | None":
    """The peer whose failure ended the run: the lowest rank that failed of its own error, else the lowest that
    vanished, else the lowest that failed because of another (whose cause was not found)."""
    lost = sorted(verdicts, key=lambda v: v.rank)
    for wanted in (
        lambda v: v.state == "failed" and v.caused_by is None,
        lambda v: v.state == "vanished",
        lambda v: v.state == "failed",
    ):
        found = [v for v in lost if wanted(v)]
        if found:
            return found[0]
    return None


def current() -> PeerWatch | None:
    return _current


def explain_collective_failure(error: BaseException, verdicts: dict, timeout_s: float):
    """The one line of a collective that failed, from the peers' verdicts: the failed peer's own line (a Fault
    under its rank), the peers that vanished, or why it cannot be told; and the record's failure fields."""
    cause = root_cause(verdicts.values())
    vanished = [v for v in verdicts.values() if v.state == "vanished"]
    if cause is not None and cause.state == "failed":
        return Fault(cause.error, rank=cause.rank, caused_by=cause.rank), {
            "error": f"rank {cause.rank} failed: {cause.error}",
            "failed_rank": cause.rank,
            "lost_ranks": [v.name for v in vanished] or None,
        }
    if cause is not None:
        line = f"{'; '.join(v.describe() for v in vanished)}: {first_line(error)}"
        return Fault(line, caused_by=cause.rank), {
            "error": line,
            "failed_rank": cause.rank,
            "lost_ranks": [v.name for v in vanished],
        }
    unknown = [v for v in verdicts.values() if v.state == "unknown"]
    if unknown:
        line = f"a collective failed and the other ranks' state is unknown ({unknown[0].reason}): {first_line(error)}"
    elif collective_timed_out(error):
        line = (
            f"a collective timed out after --distributed-timeout {timeout_s:g} s with "
            f"{'every rank alive' if verdicts else 'no peer to ask'}: a rank was in another collective or too "
            f"slow (raise --distributed-timeout for long checkpoints): {first_line(error)}"
        )
    else:
        line = f"a collective failed with every rank alive: {first_line(error)}"
    return Fault(line), {"error": line, "failed_rank": None, "lost_ranks": None}


def explain(error: BaseException, timeout_s: float) -> BaseException | None:
    """Outside the training loop (start-up, data, prepare): a collective that failed because a peer failed or
    vanished, as its one-line Fault; None for any other error."""
    if _current is None or not lost_a_peer(error):
        return None
    return explain_collective_failure(error, _current.verdicts(), timeout_s)[0]
