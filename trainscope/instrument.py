"""trainscope's public instrument: where the time and memory of *your* Accelerate training loop go.

`trainscope.Run` times the loop's stages (`run.data`, `run.stage`, `run.backward`, `run.step`) and records the run;
train.py runs on it too (`Run.from_started`, with its workload's extras: trainscope.classifier).

How it works: docs/instrument.md#the-loop.
"""

import contextlib
import dataclasses

from trainscope.core.errors import UserError
from trainscope.core.settings import LOOP_DATASET, Settings
from trainscope.run import overrides, startup
from trainscope.run.lifecycle import RunLifecycle
from trainscope.run.metrics import RunMetrics

# What trainscope.Run takes beside its arguments: the measuring flags of train.py, by their field names.
OPTIONS = (
    "overwrite",
    "log_every",
    "timing",
    "timing_warmup_steps",
    "threads",
    "profile",
    "profile_wait",
    "profile_warmup",
    "profile_active",
    "memory_snapshot",
    "memory_snapshot_steps",
    "memory_every",
    "measure_communication",
    "communication_samples",
    "distributed_timeout",
    "save_every",
    "save_on_interrupt",
    "resume",
    "report_to",
    "tracker_group",
)
# What the record says does not apply to a model that is not train.py's classifier.
NOT_AVAILABLE = {
    "prediction": "the predictor models BERT/RoBERTa-like encoder classifiers only (train.py --predict)",
    "unpad": "--unpad is train.py's, for BERT/RoBERTa-like encoders",
}
HOW_TO_USE = "open the run first: `with run:` around the training loop (docs/instrument.md#the-loop)"


@dataclasses.dataclass(frozen=True)
class Prepared:
    """What the loop trains, after `accelerator.prepare`."""

    accelerator: object
    model: object
    optimizer: object = None
    scheduler: object = None


@dataclasses.dataclass(frozen=True)
class Workload:
    """What a workload that trainscope knows (train.py's classifier: trainscope.classifier) adds to a run: the model's
    config taken before `prepare` wrapped the model, the step plan, the facts the record keeps, and its extras (the
    prediction's check, the layer probed at the run's shapes, environment facts). `None` extras: a plain loop's."""

    config: object
    plan: dict  # trainscope.core.settings.plan_steps
    model_facts: dict
    data_facts: dict = dataclasses.field(default_factory=dict)
    extras: object = None  # trainscope.run.metrics.WorkloadExtras


def _settings(accelerator, model_name: str, name: str | None, output_dir: str, options: dict) -> Settings:
    unknown = sorted(set(options) - set(OPTIONS))
    if unknown:
        raise TypeError(f"trainscope.Run got unknown option(s) {', '.join(unknown)}; it takes {', '.join(OPTIONS)}")
    settings = Settings(
        model=model_name,
        dataset=LOOP_DATASET,
        run_name=name,
        output_dir=str(output_dir),
        threads=options.pop("threads", "launcher"),  # the loop's own threads, measured as they are
        report_to=options.pop("report_to", "none"),
        gradient_accumulation_steps=accelerator.gradient_accumulation_steps,
        **options,
    )
    settings.validate()
    return settings


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
    that accumulates gradients by hand is counted as it steps). steps: the optimizer steps the loop will take (the
    progress bar's total; `run.data` stops there). flops: None (the model's layers walked as they train, for BERT-like
    encoders and GPT-2/Llama-like decoders; else FlopCounterMode on the training micro-batches), "count"
    (FlopCounterMode always), a number (FLOPs per sample) or a function of a batch (FLOPs per micro-batch). Any other
    keyword is one of train.py's measuring flags (OPTIONS: log_every, timing, profile, save_every, ...)."""

    def __init__(
        self,
        accelerator,
        model,
        optimizer=None,
        *,
        steps: int | None = None,
        scheduler=None,
        name: str | None = None,
        output_dir="runs",
        flops=None,
        _api: str = "trainscope.Run",
        **options,
    ):
        unwrapped = accelerator.unwrap_model(model)
        config = getattr(unwrapped, "config", None)
        model_name = getattr(config, "_name_or_path", None) or type(unwrapped).__name__
        settings = _settings(accelerator, model_name, name, output_dir, options)
        started = startup.attach(settings, accelerator)
        block = {
            "model": model_name,
            "output_dir": settings.output_dir,
            "run_name": started.run_dir.name,
            "gradient_accumulation_steps": settings.gradient_accumulation_steps,
            "steps": steps,
            **{option: getattr(settings, option) for option in OPTIONS},
            "flops": flops if flops is None or isinstance(flops, (int, float, str)) else "function",
        }
        workload = Workload(config=config, plan={"optimizer_steps": steps}, model_facts=_model_facts(unwrapped))
        self._api = _api  # who drives the run: trainscope.Run in a loop, or trainscope.TrainscopeCallback
        self._attach(Prepared(accelerator, model, optimizer, scheduler), started, workload, flops, block)

    @classmethod
    def from_started(cls, prepared: Prepared, started, workload: Workload) -> "Run":
        """A run whose start-up (`trainscope.run.startup.start`: process group, threads, seed, run folder) was train.py's,
        its settings every flag of train.py."""
        run = cls.__new__(cls)
        run._attach(prepared, started, workload)
        return run

    def _attach(self, prepared: Prepared, started, workload: Workload, flops=None, settings_block=None) -> None:
        """The measurements attached to the model (the record is written when `with run:` opens). A `settings_block`
        (the instrument's options) marks a loop of its own: its record says what does not apply."""
        self.accelerator, self.result = prepared.accelerator, None
        self._profiling, self._running, self._entered = contextlib.ExitStack(), None, False
        self._workload = workload
        metrics = RunMetrics(prepared.accelerator, started, workload.plan, workload.config, prepared.scheduler,
                             workload.extras, flops, prepared.optimizer)  # fmt: skip
        metrics.attach(prepared.model, prepared.optimizer)
        self.metrics, self.timer = metrics, metrics.timer
        self._own = settings_block is not None
        header = {"instrument": self._instrument_block()} if self._own else None
        self.lifecycle = RunLifecycle(prepared.accelerator, started, workload.plan, settings_block, header)
        self._next_epoch = None

    def _instrument_block(self) -> dict:
        return {
            "api": getattr(self, "_api", "trainscope.Run"),
            "flops_basis": self.metrics.flops.basis,
            "steps_basis": self.metrics.events.basis,
            "not_available": NOT_AVAILABLE,
        }

    # ---------------------------------------------------------------- the run's block

    def __enter__(self) -> "Run":
        if self._entered:
            raise UserError("trainscope.Run: `with run:` opens a run once; make a new trainscope.Run for another")
        self._entered = True
        workload = self._workload
        self.lifecycle.open(self.metrics, workload.model_facts, workload.data_facts, self.metrics.prediction.block)
        if self._own and self.lifecycle.record is not None:
            print(  # what this model gets and what it does not, in one line
                f"trainscope: {workload.model_facts.get('class') or 'the model'}'s FLOPs from "
                f"{self.metrics.flops.basis or 'nowhere (none counted)'}; not available for this model: the predictor "
                "and --unpad (train.py's, for BERT/RoBERTa-like encoders), and advice that reads train.py's classifier",
                flush=True,
            )
        self._next_epoch = self.metrics.loop.epoch  # a resumed run goes on in the epoch it stopped in
        self._running = self._block()
        return self._running.__enter__()

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
        """A loop call outside `with run:`: one line saying how to use it, and no record left behind."""
        if self._running is not None:
            return
        if not self._entered:  # nothing is written before `with run:` opens the run
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

    def stage(self, name: str):
        """`with run.stage("forward"): ...`: one of data, forward, backward, optimizer, eval; the rest is `other`."""
        self._require_open(f"run.stage({name!r})")
        self._settle()
        if name == "backward":
            return self._backward_stage()
        return self.timer(name)

    @contextlib.contextmanager
    def _backward_stage(self):
        """The backward stage: a FLOPs count of this micro-batch ends with it, whatever the loop calls inside."""
        with self.timer("backward"):
            yield
        self.metrics.flops.end()

    def data(self, loader, epoch: int | None = None):
        """The loader's batches, the wait for each timed as `data`; a resumed run skips what it already trained; stops
        at the run's steps (after the optimizer's last step, never before), and at a Ctrl-C or SIGTERM (where the
        run's state is whole)."""
        self._require_open("run.data(...)")
        epoch = self._next_epoch if epoch is None else epoch
        self._next_epoch = epoch + 1
        return self._batches(overrides.loader(loader), epoch)  # the workers `trainscope tune` set, where they apply

    def _batches(self, loader, epoch: int):
        batches = self.lifecycle.batches(loader, epoch)
        while self._running is not None:
            self._settle()
            if self.metrics.done:
                break
            self.lifecycle.check()
            with self.timer("data"):
                batch = next(batches, None)
            if batch is None:
                break
            yield batch

    def backward(self, loss, **kwargs) -> None:
        """`accelerator.backward(loss)`, with DDP's exposed communication stamped the moment it returns."""
        self._require_open("run.backward(loss)")
        self._settle(before_forward=True)
        with self.metrics.communication.backward(self.accelerator.sync_gradients):
            self.accelerator.backward(loss, **kwargs)
        self.metrics.flops.end()  # a FLOPs count of this micro-batch ends with its backward

    def step(self, batch, loss, *, samples: int | None = None, tokens: int | None = None) -> bool:
        """Count one trained micro-batch: its samples (the batch's first dimension) and tokens (as given, else its
        attention mask, else its input_ids' positions), its FLOPs, its loss (read at log steps only). True when an
        optimizer step ended with it (then: the step line, a checkpoint when due, the stop vote)."""
        self._require_open("run.step(batch, loss)")
        if loss is None:
            raise UserError("trainscope.Run.step needs the micro-batch's loss: run.step(batch, loss)")
        ended = self._settle(before_forward=True)  # steps the optimizer took before this micro-batch's forward
        self.metrics.micro_batch(batch, loss.detach(), samples, tokens)
        if not self.metrics.events.counts_steps and self.accelerator.sync_gradients:
            self.metrics.events.step_ended()  # no optimizer given: Accelerate's sync marks the step
        return self._settle() or ended

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
        """`with run.evaluation(): ...`: the `eval` stage (with --compile, its graphs told apart from recompiles)."""
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
