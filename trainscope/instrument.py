"""trainscope's public instrument: where the time and memory of *your* Accelerate training loop go.

`trainscope.Run` is the one driver API of every front door (a loop of one's own, train.py, the Trainer's callback):
docs/instrument.md#the-driver-api. How it works: docs/instrument.md#the-loop.
"""

import contextlib
import dataclasses
import time

from trainscope.core.errors import UserError
from trainscope.run import overrides, startup
from trainscope.run.driver import Driver
from trainscope.run.lifecycle import RunLifecycle
from trainscope.run.metrics import RunMetrics
from trainscope.run.options import RunOptions

HOW_TO_USE = "open the run first: `with run:` around the training loop (docs/instrument.md#the-loop)"
# trainscope.Run's defaults where train.py's flags differ: the loop's threads as they are, no trackers
LOOP_DEFAULTS = {"threads": "launcher", "report_to": "none"}
KEYWORDS = {"run_name": "name"}  # a run option that trainscope.Run takes under another keyword


@dataclasses.dataclass(frozen=True)
class Prepared:
    """What the loop trains, after `accelerator.prepare`."""

    accelerator: object
    model: object
    optimizer: object = None
    scheduler: object = None
    scaler: object = None  # the loop's own torch.amp.GradScaler (Accelerate's is the Accelerator's)


@dataclasses.dataclass(frozen=True)
class TrainingFacts:
    """What a run knows of its training beyond the prepared objects: the model's config taken before `prepare`
    wrapped the model, the step plan ({optimizer_steps}; train.py's has its epochs and global batch too), and what
    the record keeps of the model and the data."""

    config: object
    plan: dict
    model_facts: dict
    data_facts: dict = dataclasses.field(default_factory=dict)


def _options(name: str | None, output_dir, given: dict) -> RunOptions:
    known = sorted(f.name for f in dataclasses.fields(RunOptions) if f.name not in ("run_name", "output_dir"))
    unknown = sorted(set(given) - set(known))
    if unknown:
        raise TypeError(f"trainscope.Run got unknown option(s) {', '.join(unknown)}; it takes {', '.join(known)}")
    options = RunOptions(run_name=name, output_dir=str(output_dir), **{**LOOP_DEFAULTS, **given})
    options.validate(spell=lambda option: KEYWORDS.get(option, option))
    return options


def _model_facts(model) -> dict:
    parameters = list(model.parameters())
    config = getattr(model, "config", None)
    return {
        "class": type(model).__name__,
        "model_type": getattr(config, "model_type", None),
        "name_or_path": getattr(config, "_name_or_path", None) or None,
        "parameters": sum(p.numel() for p in parameters),
        "trainable_parameters": sum(p.numel() for p in parameters if p.requires_grad),
    }


class Run:
    """One instrumented training run: stage clocks (device-honest: CUDA events on a GPU), per-stage peak memory,
    DDP's exposed communication, model FLOPs and the share of this machine's measured matmul peak, warnings,
    provenance and run endings (Ctrl-C, SIGTERM, a lost peer, a full disk: one line and a true record), written to
    <output_dir>/<name>/record.json and steps.jsonl, with the end-of-run table.

    accelerator, model, optimizer: after `accelerator.prepare`. The optimizer's own steps are the run's steps (a loop
    that accumulates gradients by hand is counted as it steps; one the loop makes later over the same parameters is
    adopted). steps: the optimizer steps the loop will take (the progress bar's total; `run.data` stops there).
    scaler: the loop's own torch.amp.GradScaler, whose skipped steps are counted and whose loss scaling is recorded. flops: None (the model's layers walked as they train, for BERT-like
    encoders and GPT-2/Llama-like decoders; else FlopCounterMode on the training micro-batches), "count"
    (FlopCounterMode always), a number (FLOPs per sample) or a function of a batch (FLOPs per micro-batch). driver:
    who drives the run (trainscope.run.driver.Driver; a loop of one's own by default). Any other keyword is one of
    the run's options (trainscope.run.options.RunOptions: log_every, timing, profile, save_every, ...)."""

    def __init__(
        self,
        accelerator,
        model,
        optimizer=None,
        *,
        steps: int | None = None,
        scheduler=None,
        scaler=None,
        name: str | None = None,
        output_dir="runs",
        flops=None,
        driver: Driver | None = None,
        **options,
    ):
        began = time.perf_counter()  # trainscope's start-up: its cost, and the run's wall time, from here
        unwrapped = accelerator.unwrap_model(model)
        config = getattr(unwrapped, "config", None)
        model_name = getattr(config, "_name_or_path", None) or type(unwrapped).__name__
        driver = driver or Driver()
        run_options = _options(name, output_dir, options)
        started = startup.attach(run_options, accelerator, model_name, driver.exists)
        started.cost.began = began
        settings = {
            **dataclasses.asdict(run_options),
            "steps": steps,
            "gradient_accumulation_steps": accelerator.gradient_accumulation_steps,
            "flops": flops if flops is None or isinstance(flops, (int, float, str)) else "function",
        }
        facts = TrainingFacts(config, {"optimizer_steps": steps}, _model_facts(unwrapped))
        prepared = Prepared(accelerator, model, optimizer, scheduler, scaler)
        self._attach(prepared, started, facts, driver, settings, flops, began)

    @classmethod
    def from_started(cls, prepared: Prepared, started, facts: TrainingFacts, driver: Driver) -> "Run":
        """A run whose start-up (trainscope.run.startup.start: process group, threads, seed, run folder) was its
        driver's own (train.py's: trainscope.classifier); its record's settings are every option it started with."""
        run = cls.__new__(cls)
        run._attach(prepared, started, facts, driver, dataclasses.asdict(started.settings), began=time.perf_counter())
        return run

    def _attach(self, prepared: Prepared, started, facts: TrainingFacts, driver: Driver, settings: dict, flops=None,
                began: float = 0.0):  # fmt: skip
        """The measurements attached to the model (the record is written when the run opens); trainscope's start-up
        from `began` to here is the run's cost."""
        self.accelerator, self.result = prepared.accelerator, None
        # the Accelerator's backward as it was when the run was made: a driver may route the Accelerator's own
        # backward through run.backward (the Trainer's callback does: its Trainer calls accelerator.backward)
        self._backward = prepared.accelerator.backward
        self._profiling, self._running, self._entered = contextlib.ExitStack(), None, False
        self._facts, self._driver, self._notes, self._next_epoch = facts, driver, {}, None
        self.metrics = RunMetrics(prepared.accelerator, started, facts.plan, facts.config, driver, prepared.scheduler,
                                  flops, prepared.optimizer)  # fmt: skip
        self.metrics.attach(prepared.model, prepared.optimizer, prepared.scaler)
        self.lifecycle = RunLifecycle(prepared.accelerator, started, facts.plan, settings, driver)
        started.cost.start_s += time.perf_counter() - began

    # ---------------------------------------------------------------- opening and closing

    def open(self) -> "Run":
        """Open the run: the record's header is written (settings, environment, provenance) and from here its ending
        is recorded, whatever ends it. `with run:` opens it; a driver that has no block around its loop (the Trainer's
        callback) calls `run.open()` and `run.close()` at its own events."""
        if self._entered:
            raise UserError("trainscope.Run: a run opens once; make a new trainscope.Run for another")
        self._entered = True
        facts, metrics = self._facts, self.metrics
        self.lifecycle.open(metrics, facts.model_facts, facts.data_facts, metrics.prediction.block)
        if self._driver.not_available and self.lifecycle.record is not None:
            print(  # what this model gets and what it does not, in one line
                f"trainscope: {facts.model_facts.get('class') or 'the model'}'s FLOPs from "
                f"{metrics.flops.basis or 'nowhere (none counted)'}; not available for this model: the predictor "
                "and --unpad (train.py's, for BERT/RoBERTa-like encoders), and advice that reads train.py's classifier",
                flush=True,
            )
        self._next_epoch = metrics.loop.epoch  # a resumed run goes on in the epoch it stopped in
        self._running = self._block()
        return self._running.__enter__()

    def close(self, error: BaseException | None = None) -> None:
        """End the run: complete (finished where `run.finish` was not called), or, given the exception that ended the
        loop, failed or interrupted as the record then says, and what that ending raises is raised from here (the
        error itself, its one-line fault, or SystemExit after a signal)."""
        if error is None:
            self.__exit__(None, None, None)
        elif not self.__exit__(type(error), error, error.__traceback__):
            raise error

    def __enter__(self) -> "Run":
        return self.open()

    def __exit__(self, *exc):
        if self._running is None:
            return False
        try:
            return self._running.__exit__(*exc)
        finally:
            self._running = None

    @contextlib.contextmanager
    def _block(self):
        try:
            with self.lifecycle.ending():  # interrupted, failed or complete: the record says which
                self.metrics.start()
                with self._profiling:
                    self._profiling.enter_context(self.metrics.profiler)
                    yield self
                if self.result is None:
                    self.finish()
        finally:
            self.metrics.detach()

    def _require_open(self, what: str) -> None:
        """A loop call outside an open run: one line saying how to use it, and no record left behind."""
        if self._running is not None:
            return
        if not self._entered:  # nothing is written before the run opens
            raise UserError(f"trainscope.Run: {what} used before `with run:`; {HOW_TO_USE}")
        raise UserError(f"trainscope.Run: {what} used after the run ended (its record is written)")

    def _settle(self, before_forward: bool = False) -> bool:
        """End the optimizer steps taken since the loop's last call to the run (all of them, or those taken before the
        latest training forward began): each one's step line, checkpoint and stop vote. True when one ended."""
        events = self.metrics.events
        if not events.pending:  # most calls: no step to end
            return False
        ended = events.steps_before_last_forward() if before_forward else events.take()
        for _ in range(ended):
            self.metrics.end_step()
            self.lifecycle.step_finished()
        return bool(ended)

    # ---------------------------------------------------------------- the loop

    def data(self, loader, epoch: int | None = None):
        """The loader's batches, each one's wait timed as `data` (`run.fetch`); a resumed run skips what it already
        trained; stops at the run's steps (after the optimizer's last step, never before), and at a Ctrl-C or SIGTERM
        (where the run's state is whole). Made before the run opens (nanoGPT's iterator), it is checked when first
        iterated."""
        self._require_open("run.data(...)")
        if epoch is None:
            epoch = self._next_epoch
        self._next_epoch = epoch + 1
        loader = overrides.loader(loader)  # the workers `trainscope tune` set, where they apply
        batches = self.lifecycle.batches(loader, epoch)
        while self._running is not None:
            self._settle()
            if self.metrics.done:
                break
            batch = self.fetch(next, batches, None)
            if batch is None:
                break
            yield batch

    def fetch(self, get, *args, **kwargs):
        """`batch = run.fetch(next, batches)`: one fetch, timed as `data`, where a Ctrl-C or SIGTERM stops a run whose
        state is whole: what `run.data` does for each batch, for a loop that fetches its own way (nanoGPT's
        `next(...)`, the Trainer's get_batch_samples)."""
        self._require_open("run.fetch(...)")
        self._settle()
        self.lifecycle.check()
        with self.metrics.timer("data"):
            return get(*args, **kwargs)

    def stage(self, name: str):
        """`with run.stage("forward"): ...`: one of data, forward, backward, optimizer, eval; the rest is `other`."""
        self._require_open(f"run.stage({name!r})")
        self._settle()
        # a FLOPs count of this micro-batch ends with its backward stage, whatever the loop calls inside
        return self.metrics.timer(name, self.metrics.flops.end if name == "backward" else None)

    def backward(self, loss, **kwargs) -> None:
        """`accelerator.backward(loss)`, with DDP's exposed communication stamped the moment it returns."""
        self._require_open("run.backward(loss)")
        self._settle(before_forward=True)
        with self.metrics.communication.backward(self.accelerator.sync_gradients):
            self._backward(loss, **kwargs)
        self.metrics.flops.end()  # a FLOPs count of this micro-batch ends with its backward

    def count_micro_batch(self, batch, loss, *, samples: int | None = None, tokens: int | None = None) -> bool:
        """Count one trained micro-batch: its samples (the batch's first dimension) and tokens (as given, else its
        attention mask, else its input_ids' positions), its FLOPs, its loss (read at log steps only). True when an
        optimizer step ended with it (then: the step line, a checkpoint when due, the stop vote)."""
        self._require_open("run.count_micro_batch(batch, loss)")
        if loss is None:
            raise UserError("trainscope.Run.count_micro_batch needs the micro-batch's loss: (batch, loss)")
        ended = self._settle(before_forward=True)  # steps the optimizer took before this micro-batch's forward
        self.metrics.micro_batch(batch, loss.detach(), samples, tokens)
        if not self.metrics.events.counts_steps and self.accelerator.sync_gradients:
            self.metrics.events.step_ended()  # no optimizer given: Accelerate's sync marks the step
        return self._settle() or ended

    def between_steps(self) -> None:
        """Call where the loop does other work between optimizer steps (logging, saving): the steps taken so far end
        here (their step lines, a checkpoint when due, the stop vote) rather than at the loop's next call."""
        self._require_open("run.between_steps()")
        self._settle()

    def note(self, key: str, value) -> None:
        """What the driver adds to the record, under `notes` (the Trainer's own figures: `trainer_metrics`)."""
        self._require_open(f"run.note({key!r}, ...)")
        self._notes[key] = value
        self.lifecycle.keep(notes=dict(self._notes))

    @property
    def epoch(self) -> int:
        """The epoch training is in (where a resumed run goes on)."""
        return self.metrics.loop.epoch

    @property
    def done(self) -> bool:
        """The run took its steps."""
        return self.metrics.done

    # ---------------------------------------------------------------- evaluation, checkpoints, the end

    def evaluation(self):
        """`with run.evaluation(): ...`: the `eval` stage (of a compiled model, its graphs told apart from
        recompiles)."""
        self._require_open("run.evaluation()")
        self._settle()
        self.metrics.flops.end()
        return self.metrics.evaluation()

    def evaluated(self, scores: dict, epoch: int | None = None) -> None:
        """An evaluation's scores, into the record's validation list and the trackers."""
        self._require_open("run.evaluated(scores)")
        self.lifecycle.evaluated(self.epoch if epoch is None else epoch, dict(scores))

    def between_batches(self) -> None:
        """Call between evaluation batches: where a Ctrl-C or SIGTERM stops the run."""
        self.lifecycle.between_batches()

    def checkpoint(self) -> str:
        """A checkpoint of this step (Accelerate's save_state and the run's counters); its folder name."""
        self._require_open("run.checkpoint()")
        self._settle()
        return self.lifecycle.save_checkpoint()

    def finish(self, test_scores: dict | None = None) -> dict:
        """End the run: the summary of every rank, the complete record, the end-of-run table. Returns the summary."""
        if self.result is not None:
            return self.result
        self._require_open("run.finish()")
        self._settle()
        self.metrics.flops.end()
        self._profiling.close()
        self.result = self.lifecycle.finish(test_scores)
        return self.result

    @property
    def run_dir(self):
        return self.lifecycle.run_dir
