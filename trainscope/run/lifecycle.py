"""A run's life: start, resume, checkpoint, interrupt, fail and finish. The record's writer. The stop signals'
handler and the ranks' stop vote it acts on are trainscope.run.signals.

How it works: docs/endings.md#in-the-code-how-the-runs-life-is-coded-trainscoperunlifecyclepy.
"""

import contextlib
import signal
import sys
import threading

import torch
from accelerate.utils import gather_object
from tqdm.auto import tqdm

from trainscope.core import provenance
from trainscope.core.distributed import shut_down
from trainscope.core.errors import Fault, one_line, report
from trainscope.core.liveness import explain_collective_failure, lost_a_peer, root_cause
from trainscope.core.record_view import option_words
from trainscope.core.records import RunRecord, now_iso, read_record
from trainscope.measure import health, sharding
from trainscope.run import checkpoints, trackers
from trainscope.run.signals import (
    FINISHED_MARK,
    STEP_MARK,
    STOP_SIGNALS,
    Interrupted,
    StopSignals,
    StopVote,
    exit_code,
    vote_interval,
    vote_of,
    vote_value,
)
from trainscope.run.table import table_lines

# How long a watched peer may stay silent before the heartbeat thread writes the failure on its own. Longer
# than a verdict's patience (a rank holding the GIL in a long C call misses beats), well inside the 30 s
# torchrun gives the survivors between its SIGTERM and SIGKILL.
WATCH_SILENCE_S = 10.0
# What a record says of how a run ended (and of its latest resume), dropped when it is resumed.
ENDING_KEYS = tuple(
    "finished interruption error failed_at_step failed_rank lost_ranks summary warnings record_rebuilt "
    "checkpoints_skipped".split()
)


def _say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


class RunLifecycle:
    def __init__(self, accelerator, started, plan: dict, settings_block: dict, driver):
        self.accelerator, self.started, self.plan, self.driver = accelerator, started, plan, driver
        self.options, self.run_dir = started.settings, started.run_dir
        self.settings_block = settings_block  # what the record's settings say: the options its driver took
        self.header = {}  # more of the record's header, kept through a resume (`keep`: the driver's notes)
        self.world, self.rank = accelerator.num_processes, accelerator.process_index
        self.record = RunRecord(self.run_dir) if accelerator.is_main_process else None
        self.vote = StopVote(accelerator.state.backend, self.options.distributed_timeout) if self.world > 1 else None
        self.vote_every = vote_interval(self.options.log_every)  # K: optimizer steps from one stop vote to the next
        self.watch = started.watch
        self._verdicts = {}  # the peers' states, asked of the store when a collective failed
        self.metrics = None
        self.sharding = None  # FSDP2's sharding and collectives (trainscope.measure.sharding)
        self.progress = None
        self.saved_step = None  # the step of the last checkpoint written (the same on every rank)
        self._noticed = False
        self._ended = False  # an ending has begun: the heartbeat thread no longer writes the record
        self._ending_lock = threading.Lock()
        self.signals = StopSignals()
        self.signals.install()  # from here to the end of ending(), or until open() fails

    # ---------------------------------------------------------------- opening

    def open(self, metrics, model_facts: dict, data_facts: dict, prediction: dict | None = None) -> None:
        """Resume if asked, write the record's header (with the prediction made before the run), say the warnings
        known now, start trackers and progress."""
        try:
            with self.started.cost.timing("start_s"):
                self._open(metrics, model_facts, data_facts, prediction)
        except BaseException:
            self.signals.restore()
            raise

    def _open(self, metrics, model_facts: dict, data_facts: dict, prediction: dict | None) -> None:
        self.metrics = metrics
        with self.started.cost.timing(None):  # the checkpoint --resume asked for: not trainscope's own work
            resumed = checkpoints.load(self.accelerator, self.started.resume_from) if self.started.resume_from else None
        metrics.resume_from(resumed)
        self.sharding = sharding.attach(metrics.model) if metrics.model is not None else None
        env = metrics.environment()
        names = trackers.trackers_for(self.options.report_to)
        run_dir, group = self.run_dir, self.options.tracker_group
        init_kwargs, tracker_facts = trackers.init_kwargs(names, run_dir.name, run_dir, group)
        if self.record:
            with self.started.cost.timing("writing_s"):
                self._write_header(resumed, env, model_facts, data_facts, tracker_facts, prediction)
            self._prepare_forced_exit()
            for warning in health.check(self.record.data, at_start=True):
                print(f"warning [{warning['code']}]: {warning['message']}", flush=True)
            for line in self.driver.announcements(data_facts):
                print(line, flush=True)
        if self.watch is not None:  # the main process watches every peer; the others watch the main process
            self.watch.watch(self._peer_lost, None if self.record else [0], silence_s=WATCH_SILENCE_S)
        if names:
            self.accelerator.init_trackers(
                "trainscope", config=trackers.flat_config(self.settings_block), init_kwargs=init_kwargs
            )
        self.progress = tqdm(
            total=self.plan["optimizer_steps"],
            initial=metrics.loop.step,
            desc="training",
            unit="step",
            disable=not (self.accelerator.is_local_main_process and self.driver.progress),
        )

    def _write_header(self, resumed, env, model_facts, data_facts, tracker_facts, prediction=None) -> None:
        resume = {}
        if resumed:
            try:
                self.record.data = read_record(self.run_dir)
            except ValueError as error:  # the checkpoint is whole: continue it, with a new record that says so
                resume["record_rebuilt"] = one_line(error)
            for key in ENDING_KEYS:  # how the part before ended: the resumed run says how it ends
                self.record.data.pop(key, None)
            self.record.truncate_steps(after_step=resumed["step"])
            resume["checkpoints_skipped"] = self.started.checkpoints_skipped or None
        self.record.update(
            run_name=self.run_dir.name,
            status="running",
            created=self.record.data.get("created", now_iso()),
            settings=self.settings_block,
            environment=env,
            provenance=provenance.collect(),
            model=model_facts,
            data=data_facts,
            trackers=tracker_facts,
            plan=self.plan,
            prediction=self.record.data.get("prediction") if resumed else prediction,
            resumed_from=self.record.data.get("resumed_from", []) + ([resumed["checkpoint"]] if resumed else []),
            instrument=self.driver.instrument_block(self.metrics),
            **self.header,
            **resume,
        )

    def _prepare_forced_exit(self, **failure) -> None:
        """The record a second signal writes (the handler may not build it): interrupted, forced, no summary; or,
        once the run is failing, the failure."""

        def fields(signum: int) -> dict:
            if failure:
                return {"status": "failed", "finished": FINISHED_MARK, "failed_at_step": STEP_MARK, **failure}
            stop = {"signal": signal.Signals(signum).name, "step": STEP_MARK, "checkpoint": None, "forced": True}
            stop.update(received_here=True, received_by=self.rank)
            return {"status": "interrupted", "finished": FINISHED_MARK, "interruption": stop}

        records = {signum: self.record.render(**fields(signum)) for signum in STOP_SIGNALS}
        self.signals.prepare(self.record.path, records, lambda: self.metrics.loop.step if self.metrics else 0)

    def batches(self, loader, epoch: int):
        """The epoch's batches, less those a resumed run already trained."""
        skip = self.metrics.loop.start_epoch(epoch)
        if hasattr(loader, "set_epoch"):  # Accelerate's prepared loaders; a plain iterable has none
            loader.set_epoch(epoch)
        return iter(self.accelerator.skip_first_batches(loader, skip) if skip else loader)

    def keep(self, **fields) -> None:
        """More of the record's header, written now (by the main process) and again when a resumed run rewrites it:
        the driver's notes (`notes`)."""
        self.header.update(fields)
        if self.record is not None:
            with self.started.cost.timing("writing_s"):
                self.record.update(**fields)

    # ---------------------------------------------------------------- the loop's boundaries

    def _notice(self) -> None:
        """Say, once, from the training thread, that a signal was received (the handler does not print)."""
        if self.signals.received and not self._noticed:
            self._noticed = True
            _say(
                f"\n{signal.Signals(self.signals.received).name} received: stopping at the next step boundary "
                "and recording what was measured (send it again to exit at once)"
            )

    def check(self) -> None:
        """A boundary inside the loop: a single process stops here if asked and its state is whole. With
        several processes only the vote stops the run (every rank at the same boundary)."""
        self._notice()
        if self.signals.received and self.world == 1 and self.metrics.loop.at_step_boundary:
            raise Interrupted(self.signals.received)

    def between_batches(self) -> None:
        """Between evaluation batches (the model is not changing): the same stop as at a step's end."""
        self._notice()
        if self.vote is not None:
            self._vote(self.vote.post_and_read(vote_value(self.signals.received or 0, self.rank)))
        else:
            self.check()

    def _vote(self, agreed: int) -> None:
        if agreed:
            raise Interrupted(*vote_of(agreed))

    def step_finished(self) -> None:
        """After an optimizer step: progress, the step line, a checkpoint when due; the stop vote read when one is
        pending, and posted every `vote_every` steps."""
        metrics = self.metrics
        self.progress.update(1)
        if metrics.log_due:
            line = metrics.step_line()
            if self.record:
                self.record.append_step(line)
            self.accelerator.log({"train/loss": line["loss"], "train/lr": line["lr"]}, step=line["step"])
            self.progress.set_postfix(loss=f"{line['loss']:.4f}" if line["loss"] is not None else "n/a")
        every = self.options.save_every
        if every and metrics.loop.step % every == 0 and not metrics.done:
            self.save_checkpoint()
        self._notice()
        if self.vote is not None:
            due = metrics.loop.step % self.vote_every == 0
            self._vote(self.vote.post_and_read(vote_value(self.signals.received or 0, self.rank), post=due))
        else:
            self.check()

    def save_checkpoint(self) -> str:
        """A checkpoint of this step (the one already written when --save-every just did)."""
        step = self.metrics.loop.step
        if self.saved_step != step:
            state = self.metrics.checkpoint_state()
            self.saved_checkpoint = checkpoints.save(self.accelerator, self.run_dir, state).name
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
            try:
                self._interrupted(stop.signum, stop.rank)
            except BaseException as error:  # while it stopped: a peer lost in the last collectives
                self._raise_failed(error)
            raise SystemExit(exit_code(stop.signum)) from None
        except BaseException as error:
            self._raise_failed(error)
        finally:
            self.signals.restore()
            if self.record is not None:
                self.record.close_steps()

    def _raise_failed(self, error: BaseException):
        raised = self._failed(error)
        if raised is error:
            raise error
        raise raised from None

    def _begin_ending(self) -> None:
        """From here the training thread alone writes the record (the heartbeat thread stops watching)."""
        with self._ending_lock:
            self._ended = True
        if self.watch is not None:
            self.watch.quiet()

    def finish(self, test_scores: dict) -> dict:
        """Read the last stop vote; summarize every rank, write the complete record, print the table, end
        trackers and the group."""
        self.progress.close()
        self._notice()
        if self.vote is not None:
            self._vote(self.vote.conclude(vote_value(self.signals.received or 0, self.rank)))
        elif self.signals.received:
            raise Interrupted(self.signals.received)
        self._begin_ending()
        cost = self.started.cost
        with cost.timing("after_loop_s"):
            result = self.metrics.summarize(test_scores)
            if self.sharding is not None:  # every rank's (a collective)
                result["fsdp"] = gather_object([self.sharding.facts()])
            if self.world > 1:  # every rank's (a collective): DDP's ranks end with the same parameters and scaler
                result["end_state"] = gather_object([sharding.end_state(self.metrics.model, self.accelerator.scaler)])
            if self.record:
                self._forget_a_failure_the_run_outlived()
                warnings = self._warnings(self.record, result)
        if self.record:
            self.record.update(
                status="complete",
                finished=now_iso(),
                environment=self.metrics.env,  # the machine's peak joined it after the loop
                # the optimizers adopted in the loop, and what trainscope's own work cost the run
                instrument={**self.driver.instrument_block(self.metrics), "cost_s": cost.block()},
                summary=result,
                warnings=warnings,
            )
            self.signals.prepare(self.record.path, None)  # complete stays complete, whatever comes now
            print("\n".join(table_lines(self.record.data, self.run_dir)), flush=True)
        late = self.signals.received
        shut_down(self.accelerator)
        self._stop_watch()
        if late and not self._noticed:  # after every rank had agreed the run was complete
            _say(f"{signal.Signals(late).name} received after the run completed: its record is complete")
        return result

    def _forget_a_failure_the_run_outlived(self) -> None:
        """The heartbeat thread wrote a failure (a peer silent for long, busy in a long call), yet every rank reached
        this ending together: the failure was not one."""
        with self.record.lock:
            for key in ("error", "failed_at_step", "failed_rank", "lost_ranks"):
                self.record.data.pop(key, None)

    def _stop_watch(self) -> None:
        if self.watch is not None:
            self.watch.stop()

    def _interrupted(self, signum: int, by: int) -> None:
        self._begin_ending()
        self._notice()
        name, step = signal.Signals(signum).name, self.metrics.loop.step if self.metrics else 0
        if self.progress is not None:
            self.progress.close()
        checkpoint, unsaved = None, None
        if self.options.save_on_interrupt and self.metrics is not None and step > 0:
            try:
                checkpoint = self.save_checkpoint()
            except Fault as error:  # a full disk: the run still stops as asked, and says what was not kept
                unsaved = error
        if self.vote is not None:
            self.vote.settle()
        result = self._partial_summary(gather=True)
        interruption = {
            "signal": name,
            "step": step,
            "checkpoint": checkpoint,
            "received_here": self.signals.received == signum,
            "received_by": by,
            **({"checkpoint_error": one_line(unsaved)} if unsaved else {}),
        }
        if self.record and self.record.path.exists():
            self._forget_a_failure_the_run_outlived()
            self._write(
                self.record,
                status="interrupted",
                finished=now_iso(),
                interruption=interruption,
                **({"summary": result, "warnings": self._warnings(self.record, result)} if result else {}),
            )
            self.signals.prepare(self.record.path, None)  # written whole: a forced exit now leaves it so
            if result:
                print("\n".join(table_lines(self.record.data, self.run_dir)), flush=True)
            resume = (
                f"; continue with {self.driver.resume.format(name=self.run_dir.name)}"
                if checkpoint
                else ""
                if self.options.save_on_interrupt
                else f"; {option_words('save_on_interrupt', None, self.driver.options)} would have kept a checkpoint"
            )
            _say(
                f"interrupted by {name} after optimizer step {step}: the record says so ({self.run_dir / 'record.json'}){resume}"
            )
        if unsaved is not None:
            report(unsaved)
        shut_down(self.accelerator, wait=False)
        self._stop_watch()

    def _failed(self, error: BaseException) -> BaseException:
        """Mark the run failed with the error's one line, the step reached, the rank it comes from and this
        rank's partial summary; returns what the caller raises (the error, or its one-line Fault). Out of
        memory gets a note naming the batch size and what to try (the user's one line)."""
        self._begin_ending()
        step = self.metrics.loop.step if self.metrics else 0
        if isinstance(error, torch.OutOfMemoryError):
            error.add_note(self.driver.out_of_memory.format(step=step + 1))
        if lost_a_peer(error):
            raised, failure = self._collective_failure(error)
        else:
            raised, failure = error, {"error": one_line(error), "failed_rank": self.rank, "lost_ranks": None}
            if self.watch is not None:
                self.watch.publish_error(one_line(error))  # before anything that could hang: the peers name it
        if self.progress is not None:
            self.progress.close()
        record = self.record or self._record_of_a_lost_main()
        if self.record is not None:
            self._prepare_forced_exit(**failure)
        if record is not None and record.path.exists():
            result = self._partial_summary(gather=False)
            self._write(
                record,
                status="failed",
                finished=now_iso(),
                failed_at_step=step,
                **failure,
                **({"summary": result, "warnings": self._warnings(record, result)} if result else {}),
            )
            self.signals.prepare(record.path, None)
        shut_down(self.accelerator, wait=False)
        if self.watch is not None:
            self.watch.publish_error(one_line(raised), getattr(raised, "caused_by", None))
        self._stop_watch()
        return raised

    def _collective_failure(self, error: BaseException) -> tuple[BaseException, dict]:
        """A collective failed: which peer ended the run, and how, asked of the launcher's store."""
        self._verdicts = self.watch.verdicts() if self.watch is not None else {}
        return explain_collective_failure(error, self._verdicts, self.options.distributed_timeout)

    def _record_of_a_lost_main(self) -> RunRecord | None:
        """When the main process vanished, one surviving rank that sees its record (the first to claim it in the
        store) writes the failure; none when the main process is alive or failed (it writes its own)."""
        main = self._verdicts.get(0)
        if self.watch is None or main is None or main.state != "vanished":
            return None
        return self._claim_record()

    def _claim_record(self) -> RunRecord | None:
        if not (self.run_dir / "record.json").exists() or not self.watch.claim("record"):
            return None
        record = RunRecord(self.run_dir)
        try:
            record.data = read_record(self.run_dir)
        except ValueError:
            return None
        return record

    def _peer_lost(self, verdicts) -> None:
        """From the heartbeat thread, while the run trains: a watched peer failed or went silent. The failure is
        written now -- the training thread may be stuck in a collective that only the NCCL watchdog would end --
        and written again, with the partial summary, when the training thread reaches its own ending."""
        cause = root_cause(verdicts)
        with self._ending_lock:
            if self._ended or cause is None:
                return
            record = self.record
            if record is None:
                if cause.rank != 0 or cause.state != "vanished":
                    return
                record = self._claim_record()
                if record is None:
                    return
            line = f"rank {cause.rank} failed: {cause.error}" if cause.state == "failed" else cause.describe()
            self._write(
                record,
                status="failed",
                finished=now_iso(),
                error=line,
                failed_at_step=self.metrics.loop.step if self.metrics else 0,
                failed_rank=cause.rank,
                lost_ranks=[v.name for v in verdicts if v.state == "vanished"] or None,
            )

    @staticmethod
    def _warnings(record: RunRecord, summary: dict) -> list[dict]:
        """The run's warnings, from the whole record (a resume's skipped checkpoints included) and its summary."""
        return health.check({**record.data, "summary": summary})

    def _write(self, record: RunRecord, **fields) -> None:
        """A record update on an ending path: a full disk there says so in one line instead of hiding the cause."""
        try:
            record.update(**fields)
        except OSError as error:
            _say(f"warning: the record could not be updated ({one_line(error)})")

    def _partial_summary(self, gather: bool) -> dict | None:
        """What was measured so far; this rank's alone when the ranks cannot all be reached."""
        if self.metrics is None:
            return None
        try:
            return self.metrics.summarize(None, partial=True, gather=gather and self.world > 1)
        except Exception as error:  # a dead peer, a device error: the record still says how the run ended
            if gather:
                return self._partial_summary(gather=False)
            _say(f"warning: no partial summary ({one_line(error)})")
            return None
