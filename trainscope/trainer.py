"""trainscope for HuggingFace Trainer users: one callback gives a `transformers.Trainer` run the same record, table,
report and advice as trainscope.Run on a loop of one's own, through the same public API (trainscope.Run's).

    trainer = Trainer(model=model, args=args, train_dataset=train)
    trainer.add_callback(trainscope.TrainscopeCallback(trainer))

How the Trainer's loop is bounded into stages, and how its own figures differ: docs/instrument.md#hf-trainer.
"""

from transformers import Trainer, TrainerCallback

from trainscope.core.errors import UserError
from trainscope.instrument import Run
from trainscope.run.driver import Driver

NEEDS_TRAINER = (
    "trainscope.TrainscopeCallback needs the Trainer it measures (a Trainer gives its callbacks neither itself nor its "
    "Accelerator): trainer.add_callback(trainscope.TrainscopeCallback(trainer))"
)


class TrainscopeCallback(TrainerCallback):
    """trainscope's measurements of a `transformers.Trainer` run (the Trainer's own loop, unchanged): stage clocks
    for data (the wait for each accumulation window's batches), forward, backward (the loss and backward), optimizer
    (the Trainer's loss bookkeeping, clipping, the step, the schedule), eval and other; samples and real tokens per
    step; the model's FLOPs as it trains; memory; DDP's exposed communication; the run's ending. Written to
    <output_dir>/<name>/record.json and steps.jsonl, with the end-of-run table; the Trainer's own
    `train_samples_per_second` and `total_flos` noted beside (`notes.trainer_metrics`).

    trainer: the Trainer it measures. The other keywords are trainscope.Run's (name, output_dir, flops, log_every,
    timing, profile, ...)."""

    def __init__(self, trainer: Trainer | None = None, **run_options):
        if trainer is None:
            raise UserError(NEEDS_TRAINER)
        self.trainer, self.run_options = trainer, run_options
        self.run: Run | None = None  # open from the Trainer's on_train_begin to its train()'s end
        self._open = None  # the stage held open between two of the Trainer's events
        self._hooks = []
        self._measure(trainer)

    # ---------------------------------------------------------------- where the Trainer has no event

    def _measure(self, trainer: Trainer) -> None:
        """The Trainer's own methods, each called as it was, bounded by the run's public calls: attributes of this
        Trainer instance only, and only where no callback event marks the moment (transformers 5.17 to 5.23)."""
        train, fetch, step, evaluate = trainer.train, trainer.get_batch_samples, trainer.training_step, trainer.evaluate

        def train_measured(*args, **kwargs):
            # no event sees train() fail or stop: the run's ending (failed, interrupted) is recorded here
            try:
                return train(*args, **kwargs)
            except BaseException as error:
                if self.run is None:
                    raise
                self._close_stage()
                run, self.run = self.run, None
                self._unhook()
                run.close(error)  # what the ending raises goes on: the error, its one line, SystemExit for a signal
                return None

        def batches_measured(*args, **kwargs):
            # no event comes before an accumulation window's batches are fetched: the fetch is the run's `data`
            if self.run is None:
                return fetch(*args, **kwargs)
            self._close_stage()
            return self.run.fetch(fetch, *args, **kwargs)

        def step_measured(model, inputs, *args, **kwargs):
            # no event carries a micro-batch's inputs and loss, nor comes between its backward and the clipping
            if self.run is None:
                return step(model, inputs, *args, **kwargs)
            self._close_stage()
            loss = step(model, inputs, *args, **kwargs)
            self._close_stage()
            self.run.count_micro_batch(inputs, loss)
            if trainer.accelerator.sync_gradients:  # the window's last micro-batch: clipping and the step follow
                self._open_stage("optimizer")
            return loss

        def evaluate_measured(*args, **kwargs):
            # on_evaluate comes at an evaluation's end only: its start is here
            if self.run is None:
                return evaluate(*args, **kwargs)
            self._close_stage()
            with self.run.evaluation():
                return evaluate(*args, **kwargs)

        trainer.train, trainer.get_batch_samples = train_measured, batches_measured
        trainer.training_step, trainer.evaluate = step_measured, evaluate_measured

    # ---------------------------------------------------------------- the stages the Trainer's events bound

    def _open_stage(self, name: str) -> None:
        self._close_stage()
        self._open = self.run.stage(name)
        self._open.__enter__()

    def _close_stage(self) -> None:
        if self._open is not None:
            opened, self._open = self._open, None
            opened.__exit__(None, None, None)

    def _forward_began(self, module, args, kwargs):
        if self.run is not None and module.training and self._open is None:
            self._open_stage("forward")

    def _forward_ended(self, module, args, kwargs, output):
        if self.run is not None and self._open is not None and module.training:
            self._open_stage("backward")  # the loss (where the Trainer computes it) and the backward

    def _unhook(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
        vars(self.trainer.accelerator).pop("backward", None)

    # ---------------------------------------------------------------- the run's life

    def on_train_begin(self, args, state, control, model=None, optimizer=None, lr_scheduler=None, **kwargs):
        trainer, accelerator = self.trainer, self.trainer.accelerator
        options = {"name": None, "output_dir": "runs", **self.run_options}
        driver = Driver(api="trainscope.TrainscopeCallback (transformers.Trainer)", progress=False)  # it has its own
        run = Run(accelerator, trainer.model_wrapped, optimizer, steps=state.max_steps, scheduler=lr_scheduler,
                  driver=driver, **options)  # fmt: skip
        self.run = run.open()
        self._hooks = [
            model.register_forward_pre_hook(self._forward_began, with_kwargs=True),
            model.register_forward_hook(self._forward_ended, with_kwargs=True),
        ]
        # no event brackets the Trainer's accelerator.backward: this Accelerator's backward is the run's (which calls
        # the Accelerator's own, as it was when the run was made), DDP's exposed communication stamped at its end
        accelerator.backward = run.backward

    def on_step_end(self, args, state, control, **kwargs):
        if self.run is not None:
            self._close_stage()
            self.run.between_steps()

    def on_substep_end(self, args, state, control, **kwargs):
        if self.run is not None:
            self._close_stage()

    def on_evaluate(self, args, state, control, metrics=None, **kwargs):
        if self.run is not None and metrics:
            self.run.evaluated({k: v for k, v in metrics.items() if isinstance(v, (int, float))})

    def on_train_end(self, args, state, control, **kwargs):
        if self.run is None:
            return
        self._close_stage()
        self.run.between_steps()  # a stop signal here still reaches train()'s ending (train_measured)
        # the Trainer's own figures, which it logs at the end of train() before this event
        logged = next((logs for logs in reversed(state.log_history) if "train_runtime" in logs), {})
        self.run.note("trainer_metrics", {"total_flos": state.total_flos, **logged})
        run, self.run = self.run, None
        try:
            run.close()
        finally:
            self._unhook()
