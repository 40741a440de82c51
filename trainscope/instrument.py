"""trainscope's public instrument: where the time and memory of *your* Accelerate training loop go.

`trainscope.Run` times the loop's stages (`run.data`, `run.stage`, `run.backward`, `run.step`) and records the run;
train.py runs on it too (`Run.from_started`).

How it works: docs/instrument.md#the-loop.
"""

import contextlib

from trainscope.core.errors import UserError
from trainscope.core.settings import Settings
from trainscope.run import startup
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


def _settings(accelerator, model_name: str, name: str | None, output_dir: str, options: dict) -> Settings:
    unknown = sorted(set(options) - set(OPTIONS))
    if unknown:
        raise TypeError(f"trainscope.Run got unknown option(s) {', '.join(unknown)}; it takes {', '.join(OPTIONS)}")
    settings = Settings(
        model=model_name,
        dataset="loop",
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

    accelerator, model, optimizer: after `accelerator.prepare`. steps: the optimizer steps the loop will take (the
    progress bar's total; `run.data` stops there). flops: None (a formula for BERT-like encoders, GPT-2 and Llama
    decoders; FlopCounterMode on the first micro-batch for any other model), "count" (FlopCounterMode always), a
    number (FLOPs per sample) or a function of a batch (FLOPs per micro-batch). Any other keyword is one of train.py's
    measuring flags (OPTIONS: log_every, timing, profile, save_every, ...)."""

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
            **{option: getattr(settings, option) for option in OPTIONS},
            "flops": flops if flops is None or isinstance(flops, (int, float, str)) else "function",
        }
        self._attach(accelerator, model, optimizer, scheduler, started, {"optimizer_steps": steps}, config,
                     _model_facts(unwrapped), {}, None, flops, block)  # fmt: skip

    @classmethod
    def from_started(
        cls,
        accelerator,
        model,
        optimizer,
        scheduler,
        started,
        plan: dict,
        model_config,
        model_facts: dict,
        data_facts: dict,
        prediction: dict | None = None,
    ) -> "Run":
        """A run whose start-up (`trainscope.run.startup.start`: process group, threads, seed, run folder) was train.py's,
        its settings every flag of train.py."""
        run = cls.__new__(cls)
        run._attach(accelerator, model, optimizer, scheduler, started, plan, model_config, model_facts, data_facts,
                    prediction)  # fmt: skip
        return run

    def _attach(self, accelerator, model, optimizer, scheduler, started, plan, config, model_facts, data_facts,
                prediction, flops=None, settings_block=None) -> None:  # fmt: skip
        """The measurements attached to the model, the record's header written, trackers and progress started. A
        `settings_block` (the instrument's options) marks a loop of its own: its record says what does not apply."""
        self.accelerator, self.result = accelerator, None
        self._profiling, self._running = contextlib.ExitStack(), None
        metrics = RunMetrics(accelerator, started, plan, config, scheduler, prediction, flops, optimizer)
        metrics.attach(model, optimizer)
        self.metrics, self.timer = metrics, metrics.timer
        own = settings_block is not None
        header = {"instrument": {"api": "trainscope.Run", "flops_basis": metrics.flops.basis,
                                 "not_available": NOT_AVAILABLE}} if own else None  # fmt: skip
        self.lifecycle = RunLifecycle(accelerator, started, plan, settings_block, header)
        self.lifecycle.open(metrics, model_facts, data_facts, prediction)
        if own and self.lifecycle.record is not None:
            print(  # what this model gets and what it does not, in one line
                f"trainscope: {model_facts.get('class') or 'the model'}'s FLOPs from "
                f"{metrics.flops.basis or 'nowhere (none counted)'}; not available for this model: the predictor and "
                "--unpad (train.py's, for BERT/RoBERTa-like encoders), and advice that reads train.py's classifier",
                flush=True,
            )
        self._skips = metrics.skips if metrics.skips.count is not None else None
        self._next_epoch = metrics.loop.epoch  # a resumed run goes on in the epoch it stopped in

    # ---------------------------------------------------------------- the run's block

    def __enter__(self) -> "Run":
        self._running = self._block()
        return self._running.__enter__()

    def __exit__(self, *exc):
        running, self._running = self._running, None
        return running.__exit__(*exc)

    @contextlib.contextmanager
    def _block(self):
        with self.lifecycle.ending():  # interrupted, failed or complete: the record says which
            self.metrics.start()
            with self._profiling:
                self._profiling.enter_context(self.metrics.profiler)
                yield self
            if self.result is None:
                self.finish()

    # ---------------------------------------------------------------- the loop

    def stage(self, name: str):
        """`with run.stage("forward"): ...`: one of data, forward, backward, optimizer, eval; the rest is `other`."""
        if name == "optimizer" and self._skips is not None:
            return self._optimizer_stage()
        if self.metrics.flops.counting and name in ("forward", "backward"):
            return self._counted_stage(name)
        return self.timer(name)

    @contextlib.contextmanager
    def _optimizer_stage(self):
        """The optimizer stage of a loss-scaled (fp16) run: a step the scaler skips is counted, without a sync."""
        with self.timer("optimizer"):
            self._skips.before_step()
            yield
            self._skips.after_step()

    @contextlib.contextmanager
    def _counted_stage(self, name: str):
        """The first micro-batch's forward and backward, counted by FlopCounterMode (a warm-up step)."""
        with self.timer(name):
            if name == "forward":
                self.metrics.flops.begin()
            yield
            if name == "backward":
                self.metrics.flops.end()

    def data(self, loader, epoch: int | None = None):
        """The loader's batches, the wait for each timed as `data`; a resumed run skips what it already trained; stops
        at the run's steps, and at a Ctrl-C or SIGTERM (where the run's state is whole)."""
        epoch = self._next_epoch if epoch is None else epoch
        self._next_epoch = epoch + 1
        batches = self.lifecycle.batches(loader, epoch)
        while not self.metrics.done:
            self.lifecycle.check()
            with self.timer("data"):
                batch = next(batches, None)
            if batch is None:
                break
            yield batch

    def backward(self, loss, **kwargs) -> None:
        """`accelerator.backward(loss)`, with DDP's exposed communication stamped the moment it returns."""
        with self.metrics.communication.backward(self.accelerator.sync_gradients):
            self.accelerator.backward(loss, **kwargs)

    def step(self, batch, loss, *, samples: int | None = None, tokens: int | None = None) -> bool:
        """Count one trained micro-batch: its samples (the batch's first dimension) and tokens (its attention mask, or
        its input_ids' positions) unless given, and its loss (read at log steps only). True when it completed an
        optimizer step (then: the step line, a checkpoint when due, the stop vote)."""
        if loss is None:
            raise UserError("trainscope.Run.step needs the micro-batch's loss")
        if self.metrics.micro_batch(batch, loss.detach(), samples, tokens):
            self.lifecycle.step_finished()
            return True
        return False

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
        return self.metrics.evaluation()

    def evaluated(self, scores: dict, epoch: int | None = None) -> None:
        """An evaluation's scores, into the record's validation list and the trackers."""
        self.lifecycle.evaluated(self.epoch if epoch is None else epoch, dict(scores))

    def between_batches(self) -> None:
        """Call between evaluation batches: where a Ctrl-C or SIGTERM stops the run."""
        self.lifecycle.between_batches()

    def checkpoint(self) -> str:
        """A checkpoint of this step (Accelerate's save_state and the run's counters); its folder name."""
        return self.lifecycle.save_checkpoint()

    def finish(self, test_scores: dict | None = None) -> dict:
        """End the run: the summary of every rank, the complete record, the end-of-run table. Returns the summary."""
        if self.result is not None:
            return self.result
        self._profiling.close()
        self.result = self.lifecycle.finish(test_scores)
        return self.result

    @property
    def run_dir(self):
        return self.lifecycle.run_dir
