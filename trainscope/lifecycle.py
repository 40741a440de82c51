"""A run's life: start, resume, checkpoint, interrupt, fail and finish. The record's writer.

trainscope.run_metrics measures and summarizes; this module decides what becomes of the run and writes
it down, so that every ending leaves a true record:

* `complete`: the summary, the warnings, the end-of-run table.
* `interrupted`: SIGINT (Ctrl-C), SIGTERM (torchrun stopping the survivors of a dead rank, SLURM or
  Kubernetes pre-emption) or SIGUSR1 (SLURM's warning before pre-emption, `#SBATCH --signal=USR1@120`).
  Every rank handles them. The loop stops at the next boundary where the run's state is whole (before a
  step's first micro-batch, after its optimizer step, between evaluation batches); with several
  processes, the ranks first agree on the step (an asynchronous all-reduce on a CPU group, read one step
  later: no rank stops while another waits in a collective, and no step waits for the vote). The record
  gets the signal, the step reached and a partial summary; with --save-on-interrupt a checkpoint is
  written first. The exit status is 128 + the signal (130 for SIGINT, 143 for SIGTERM). A second
  signal (a second Ctrl-C) exits at once, marking the record interrupted without a summary.
* `failed`: the one line the user read, the step reached and this rank's partial summary. A rank that
  lost a peer (a collective error) names the rank that disappeared when it can tell (a process of the
  same host that no longer exists); if the main process is the one gone, a surviving rank writes.

Accelerate's own `set_trigger`/`check_trigger` agree across ranks too, but with a blocking all-reduce on
the device at every check (a GPU sync per step); the vote here never stalls the device.
"""

import contextlib
import os
import signal
import socket
import sys
import time
from dataclasses import asdict
from pathlib import Path

import torch
from accelerate.utils import gather_object
from tqdm.auto import tqdm

from trainscope import checkpoints, health, provenance, trackers
from trainscope.data import dropped_rows_lines
from trainscope.distributed import shut_down
from trainscope.errors import one_line
from trainscope.records import RunRecord, now_iso, read_record
from trainscope.run_metrics import table_lines

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)


def exit_code(signum: int) -> int:
    """The shell's convention for a process ended by a signal: 128 + its number (130 SIGINT, 143 SIGTERM)."""
    return 128 + signum


class Interrupted(Exception):
    """Raised at a boundary where the run's state is whole, once a stop signal has been received (and,
    with several processes, agreed on by every rank)."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


class StopSignals:
    """SIGINT, SIGTERM and SIGUSR1 in this process: the first asks the run to stop; a second one, more than
    DUPLICATE_S after the first, calls `at_once` (a launcher that forwards the terminal's Ctrl-C delivers
    the same keystroke twice within milliseconds)."""

    DUPLICATE_S = 1.0

    def __init__(self, at_once):
        self.at_once = at_once
        self.received: int | None = None
        self._first_at = None
        self._previous = {}

    def install(self) -> None:
        if not _main_thread():
            return
        for signum in STOP_SIGNALS:
            self._previous[signum] = signal.signal(signum, self._handle)

    def restore(self) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous = {}

    def _handle(self, signum, frame) -> None:
        if self.received is None:
            self.received, self._first_at = signum, time.monotonic()
            print(f"\n{signal.Signals(signum).name} received: stopping at the next step boundary and recording what "
                  "was measured (send it again to exit at once)", file=sys.stderr, flush=True)
        elif time.monotonic() - self._first_at > self.DUPLICATE_S:
            self.at_once(signum)


def _main_thread() -> bool:
    import threading

    return threading.current_thread() is threading.main_thread()


class StopVote:
    """Ranks agree on stopping without stalling a step: at the end of every optimizer step each rank posts
    the signal it received (0 for none) in an asynchronous MAX all-reduce and reads the previous step's
    result, which has long arrived. Every rank reads the same value at the same step. CPU tensors over a
    gloo group: no device synchronization (a gloo group beside NCCL where the run's own group is NCCL)."""

    def __init__(self, backend: str | None):
        import torch.distributed as dist

        self.dist = dist
        self.group = dist.new_group(backend="gloo") if backend not in (None, "gloo") else None
        self._pending = None

    def post_and_read(self, local_signal: int) -> int:
        agreed = 0
        if self._pending is not None:
            work, flag = self._pending
            work.wait()
            agreed = int(flag.item())  # a CPU tensor: no device sync
        flag = torch.tensor([local_signal], dtype=torch.int32)
        self._pending = (self.dist.all_reduce(flag, op=self.dist.ReduceOp.MAX, group=self.group, async_op=True), flag)
        return agreed

    def settle(self) -> None:
        """Wait for the last vote, so no collective is left in flight when the run ends."""
        if self._pending is not None:
            self._pending[0].wait()
            self._pending = None


class RunLifecycle:
    def __init__(self, accelerator, started, plan: dict):
        self.accelerator, self.started, self.plan = accelerator, started, plan
        self.settings, self.run_dir = started.settings, started.run_dir
        self.world = accelerator.num_processes
        self.record = RunRecord(self.run_dir) if accelerator.is_main_process else None
        self.vote = StopVote(accelerator.state.backend) if self.world > 1 else None
        # Every rank's host and pid, to name a rank that disappears (one collective, at start).
        self.peers = gather_object([(accelerator.process_index, socket.gethostname(), os.getpid())])
        self.metrics = None
        self.progress = None
        self.saved_step = None  # the step of the last checkpoint written (the same on every rank)
        self.signals = StopSignals(self._exit_at_once)
        self.signals.install()  # from here to the end of ending(), or until open() fails

    # ---------------------------------------------------------------- opening

    def open(self, metrics, model_facts: dict, data_facts: dict, prediction: dict | None = None) -> None:
        """Resume if asked, write the record's header (with the prediction made before the run), say the warnings
        known now, start trackers and progress."""
        try:
            self._open(metrics, model_facts, data_facts, prediction)
        except BaseException:
            self.signals.restore()
            raise

    def _open(self, metrics, model_facts: dict, data_facts: dict, prediction: dict | None) -> None:
        self.metrics = metrics
        resumed = checkpoints.load_latest(self.accelerator, self.run_dir) if self.settings.resume else None
        metrics.resume_from(resumed)
        env = metrics.environment()
        names = trackers.trackers_for(self.settings.report_to)
        init_kwargs, tracker_facts = trackers.init_kwargs(names, self.run_dir.name, self.run_dir,
                                                          self.settings.tracker_group)
        if self.record:
            self._write_header(resumed, env, model_facts, data_facts, tracker_facts, prediction)
            for warning in health.check(self.record.data, at_start=True):
                print(f"warning [{warning['code']}]: {warning['message']}", flush=True)
            for line in dropped_rows_lines(data_facts.get("dropped_rows") or {}):
                print(line, flush=True)
        if names:
            self.accelerator.init_trackers("trainscope", config=trackers.flat_config(asdict(self.settings)),
                                           init_kwargs=init_kwargs)
        self.progress = tqdm(total=self.plan["optimizer_steps"], initial=metrics.loop.step, desc="training",
                             unit="step", disable=not self.accelerator.is_local_main_process)

    def _write_header(self, resumed, env, model_facts, data_facts, tracker_facts, prediction=None) -> None:
        if resumed:
            self.record.data = read_record(self.run_dir)
            self.record.truncate_steps(after_step=resumed["step"])
        self.record.update(
            run_name=self.run_dir.name, status="running", created=self.record.data.get("created", now_iso()),
            settings=asdict(self.settings), environment=env, provenance=provenance.collect(),
            model=model_facts, data=data_facts, trackers=tracker_facts, plan=self.plan,
            prediction=self.record.data.get("prediction") if resumed else prediction,
            resumed_from=self.record.data.get("resumed_from", []) + ([resumed["checkpoint"]] if resumed else []),
        )

    def batches(self, loader, epoch: int):
        """The epoch's batches, less those a resumed run already trained."""
        skip = self.metrics.loop.start_epoch(epoch)
        loader.set_epoch(epoch)
        return iter(self.accelerator.skip_first_batches(loader, skip) if skip else loader)

    # ---------------------------------------------------------------- the loop's boundaries

    def check(self) -> None:
        """A boundary inside the loop: a single process stops here if asked and its state is whole. With
        several processes only the vote at a step's end stops the run (every rank at the same step)."""
        if self.signals.received and self.world == 1 and self.metrics.loop.at_step_boundary:
            raise Interrupted(self.signals.received)

    def step_finished(self) -> None:
        """After an optimizer step: progress, the step line, a checkpoint when due, the stop vote."""
        metrics = self.metrics
        self.progress.update(1)
        if metrics.log_due:
            line = metrics.step_line()
            if self.record:
                self.record.append_step(line)
            self.accelerator.log({"train/loss": line["loss"], "train/lr": line["lr"]}, step=line["step"])
            self.progress.set_postfix(loss=f"{line['loss']:.4f}")
        every = self.settings.save_every
        if every and metrics.loop.step % every == 0 and not metrics.done:
            self.save_checkpoint()
        if self.vote is not None:
            agreed = self.vote.post_and_read(self.signals.received or 0)
            if agreed:
                raise Interrupted(agreed)
        else:
            self.check()

    def save_checkpoint(self) -> str:
        """A checkpoint of this step (the one already written when --save-every just did)."""
        step = self.metrics.loop.step
        if self.saved_step != step:
            self.saved_checkpoint = checkpoints.save(self.accelerator, self.run_dir, self.metrics.checkpoint_state()).name
            self.saved_step = step
        return self.saved_checkpoint

    def evaluated(self, epoch: int, scores: dict) -> None:
        scores = self.metrics.validation(epoch, scores)
        self.accelerator.log({f"validation/{k}": v for k, v in scores.items()}, step=self.metrics.loop.step)

    # ---------------------------------------------------------------- the endings

    @contextlib.contextmanager
    def ending(self):
        """Whatever ends the block, the record says how: interrupted (exit 128 + signal), failed (the error
        goes on to the caller, which prints its one line), or -- by `finish` -- complete."""
        try:
            yield
        except Interrupted as stop:
            self._interrupted(stop.signum)
            raise SystemExit(exit_code(stop.signum)) from None
        except BaseException as error:
            self._failed(error)
            raise
        finally:
            self.signals.restore()

    def finish(self, test_scores: dict) -> dict:
        """Summarize every rank, write the complete record, print the table, end trackers and the group."""
        self.progress.close()
        if self.vote is not None:
            self.vote.settle()
        result, warnings = self.metrics.summarize(test_scores)
        if self.record:
            self.record.update(status="complete", finished=now_iso(), summary=result, warnings=warnings)
            print("\n".join(table_lines(self.record.data, self.run_dir)), flush=True)
        shut_down(self.accelerator)
        return result

    def _interrupted(self, signum: int) -> None:
        name, step = signal.Signals(signum).name, self.metrics.loop.step if self.metrics else 0
        if self.progress is not None:
            self.progress.close()
        checkpoint = None
        if self.settings.save_on_interrupt and self.metrics is not None and step > 0:
            checkpoint = self.save_checkpoint()
        if self.vote is not None:
            self.vote.settle()
        result, warnings = self._partial_summary(gather=True)
        interruption = {"signal": name, "step": step, "checkpoint": checkpoint,
                        "received_here": self.signals.received == signum}
        if self.record and self.record.path.exists():
            self.record.update(status="interrupted", finished=now_iso(), interruption=interruption,
                               **({"summary": result, "warnings": warnings} if result else {}))
            if result:
                print("\n".join(table_lines(self.record.data, self.run_dir)), flush=True)
            resume = (f"; continue with --resume --run-name {self.run_dir.name}" if checkpoint else
                      "" if self.settings.save_on_interrupt else "; --save-on-interrupt would have kept a checkpoint")
            print(f"interrupted by {name} after optimizer step {step}: the record says so "
                  f"({self.run_dir / 'record.json'}){resume}", file=sys.stderr, flush=True)
        shut_down(self.accelerator, wait=False)

    def _failed(self, error: BaseException) -> None:
        """Mark the run failed with the error's one line, the step reached and this rank's partial summary.
        Out of memory gets a note naming the batch size and what to try (the user's one line)."""
        step = self.metrics.loop.step if self.metrics else 0
        if isinstance(error, torch.OutOfMemoryError):
            error.add_note(f"out of memory at --per-device-batch-size {self.settings.per_device_batch_size} (step "
                           f"{step + 1}): halve it and double --gradient-accumulation-steps, or add "
                           "--gradient-checkpointing, a bf16/fp16 config or --lora")
        lost = self._lost_peers() if self.world > 1 and lost_a_peer(error) else []
        if lost:
            error.add_note(f"{', '.join(lost)} disappeared: {one_line(error)}")
        if self.progress is not None:
            self.progress.close()
        record = self.record or self._record_of_a_lost_main(lost)
        if record is not None and record.path.exists():
            result, warnings = self._partial_summary(gather=False)
            record.update(status="failed", finished=now_iso(), error=one_line(error), failed_at_step=step,
                          lost_ranks=lost or None, **({"summary": result, "warnings": warnings} if result else {}))
        shut_down(self.accelerator, wait=False)

    def _partial_summary(self, gather: bool) -> tuple[dict | None, list]:
        """What was measured so far; this rank's alone when the ranks cannot all be reached."""
        if self.metrics is None:
            return None, []
        try:
            return self.metrics.summarize(None, partial=True, gather=gather and self.world > 1)
        except Exception as error:  # a dead peer, a device error: the record still says how the run ended
            if gather:
                return self._partial_summary(gather=False)
            print(f"warning: no partial summary ({one_line(error)})", file=sys.stderr, flush=True)
            return None, []

    def _lost_peers(self, patience_s: float = 2.0) -> list[str]:
        """Ranks of this host whose process no longer exists ('rank 1 (pid 4242)'). A killed process closes its
        sockets while it is still exiting, so the connection error can come first: look again for a moment."""
        here, me = socket.gethostname(), self.accelerator.process_index
        deadline = time.monotonic() + patience_s
        while True:
            lost = [f"rank {rank} (pid {pid})" for rank, host, pid in self.peers
                    if rank != me and host == here and not _alive(pid)]
            if lost or time.monotonic() > deadline:
                return lost
            time.sleep(0.1)

    def _record_of_a_lost_main(self, lost: list[str]) -> RunRecord | None:
        """When the main process is the one gone, the lowest surviving rank of its host writes the failure."""
        main_pid = next(pid for rank, _, pid in self.peers if rank == 0)
        survivors = [rank for rank, host, pid in self.peers if host == socket.gethostname() and _alive(pid)]
        if _alive(main_pid) or not survivors or min(survivors) != self.accelerator.process_index:
            return None
        record = RunRecord(self.run_dir)
        try:
            record.data = read_record(self.run_dir)
        except ValueError:
            return None
        return record

    def _exit_at_once(self, signum: int) -> None:
        """A second signal: mark the record interrupted (no summary) and leave without cleaning up."""
        if self.record is not None and self.record.path.exists():
            self.record.update(status="interrupted", finished=now_iso(), interruption={
                "signal": signal.Signals(signum).name, "step": self.metrics.loop.step if self.metrics else 0,
                "checkpoint": None, "forced": True})
        print(f"\n{signal.Signals(signum).name} again: exiting at once", file=sys.stderr, flush=True)
        os._exit(exit_code(signum))


def lost_a_peer(error: BaseException) -> bool:
    """Whether an error is a collective that lost its peers (a closed connection, a timeout), as gloo and NCCL
    report it, rather than one every rank raised alike (a non-finite loss, out of memory)."""
    if isinstance(error, getattr(torch.distributed, "DistError", ())):
        return True
    text = str(error).lower()
    return isinstance(error, RuntimeError) and any(word in text for word in ("connection", "gloo", "nccl", "timed out",
                                                                              "timeout", "broken pipe"))


def _alive(pid: int) -> bool:
    """Whether a process exists and is not a zombie (a killed rank stays one until its launcher reaps it)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        return state not in ("Z", "X")
    except (OSError, IndexError):
        pass
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
