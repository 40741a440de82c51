"""trainscope for HuggingFace Trainer users: one callback gives a `transformers.Trainer` run the same record, table,
report and advice as trainscope.Run on a loop of one's own.

    trainer = Trainer(model=model, args=args, train_dataset=train, callbacks=[trainscope.TrainscopeCallback()])

How the Trainer's loop is bounded into stages, and how its own figures differ: docs/instrument.md#hf-trainer.
"""

import inspect

from transformers import Trainer, TrainerCallback

from trainscope.core.errors import UserError
from trainscope.instrument import Run


def _calling_trainer(callback) -> Trainer | None:
    """The Trainer whose callback handler is calling `callback` now: the frame of one of its methods up the stack.
    The Trainer passes its callbacks no Accelerator and no Trainer, and the run's collectives, unwrapping and
    backward need the Trainer's Accelerator."""
    for frame in inspect.stack(context=0)[1:]:
        owner = frame.frame.f_locals.get("self")
        if isinstance(owner, Trainer) and callback in getattr(owner.callback_handler, "callbacks", ()):
            return owner
    return None


class TrainscopeCallback(TrainerCallback):
    """trainscope's measurements of a `transformers.Trainer` run (the Trainer's own loop, unchanged): stage clocks
    for data (the wait for each accumulation window's batches), forward, backward (the loss and backward), optimizer
    (the Trainer's loss bookkeeping, clipping, the step, the schedule), eval and other; samples and real tokens per
    step; the model's FLOPs as it trains; memory; DDP's exposed communication; the run's ending. Written to
    <output_dir>/<name>/record.json and steps.jsonl, with the end-of-run table; the Trainer's own
    `train_samples_per_second` and `total_flos` recorded beside (`trainer_metrics`).

    trainer: where the callback is added after the Trainer is built (`trainer.add_callback(TrainscopeCallback(
    trainer))`); given in `callbacks=[...]`, the callback finds its Trainer when the Trainer's construction ends.
    The other keywords are trainscope.Run's (name, output_dir, flops, log_every, timing, profile, ...)."""

    def __init__(self, trainer: Trainer | None = None, **run_options):
        self.trainer, self.run_options = None, run_options
        self.run: Run | None = None
        self.trainer_metrics: dict = {}
        self._open = None  # the stage held open between two of the Trainer's events
        self._hooks, self._restore = [], lambda: None
        if trainer is not None:
            self._wrap(trainer)

    # ---------------------------------------------------------------- finding the Trainer, wrapping its methods

    def on_init_end(self, args, state, control, **kwargs):
        if self.trainer is None:
            trainer = _calling_trainer(self)
            if trainer is not None:
                self._wrap(trainer)

    def _wrap(self, trainer: Trainer) -> None:
        """The Trainer's own methods, each called as it was, bounded by the run's clocks (attributes of this Trainer
        instance only)."""
        self.trainer = trainer
        train, fetch, step, evaluate = trainer.train, trainer.get_batch_samples, trainer.training_step, trainer.evaluate

        def train_measured(*args, **kwargs):
            try:
                return train(*args, **kwargs)
            except BaseException as error:  # the run's ending: interrupted or failed, as trainscope.Run records it
                if self.run is not None and self.run._running is not None:
                    self._close_stage()
                    if self.run.__exit__(type(error), error, error.__traceback__):
                        return None
                raise

        def batches_measured(*args, **kwargs):
            if self.run is None or self.run._running is None:
                return fetch(*args, **kwargs)
            self._close_stage()
            self.run._settle()
            self.run.lifecycle.check()
            with self.run.timer("data"):
                return fetch(*args, **kwargs)

        def step_measured(model, inputs, *args, **kwargs):
            if self.run is None or self.run._running is None:
                return step(model, inputs, *args, **kwargs)
            self._close_stage()
            loss = step(model, inputs, *args, **kwargs)
            self._close_stage()
            self.run.step(inputs, loss)
            if self.run.accelerator.sync_gradients:  # the window's last micro-batch: clipping and the step follow
                self._open_stage("optimizer")
            return loss

        def evaluate_measured(*args, **kwargs):
            if self.run is None or self.run._running is None:
                return evaluate(*args, **kwargs)
            self._close_stage()
            with self.run.evaluation():
                return evaluate(*args, **kwargs)

        trainer.train, trainer.get_batch_samples = train_measured, batches_measured
        trainer.training_step, trainer.evaluate = step_measured, evaluate_measured

    # ---------------------------------------------------------------- the stages the Trainer's events bound

    def _open_stage(self, name: str) -> None:
        self._close_stage()
        self._open = self.run.timer(name)
        self._open.__enter__()

    def _close_stage(self) -> None:
        if self._open is not None:
            opened, self._open = self._open, None
            opened.__exit__(None, None, None)

    def _forward_began(self, module, args, kwargs):
        if self.run is not None and self.run._running is not None and module.training and self._open is None:
            self._open_stage("forward")

    def _forward_ended(self, module, args, kwargs, output):
        if self.run is not None and self._open is not None and module.training:
            self._open_stage("backward")  # the loss (where the Trainer computes it) and the backward

    # ---------------------------------------------------------------- the run's life

    def on_train_begin(self, args, state, control, model=None, optimizer=None, lr_scheduler=None, **kwargs):
        if self.trainer is None:
            trainer = _calling_trainer(self)
            if trainer is None:
                raise UserError(
                    "trainscope.TrainscopeCallback found no Trainer calling it: give it the Trainer, "
                    "trainer.add_callback(TrainscopeCallback(trainer))"
                )
            self._wrap(trainer)
        trainer = self.trainer
        options = {"name": None, "output_dir": "runs", **self.run_options}
        self.run = Run(trainer.accelerator, trainer.model_wrapped, trainer.optimizer, steps=state.max_steps,
                       scheduler=trainer.lr_scheduler, _api="trainscope.TrainscopeCallback (transformers.Trainer)",
                       **options)  # fmt: skip
        accelerator, backward = trainer.accelerator, trainer.accelerator.backward
        inner = accelerator.unwrap_model(trainer.model_wrapped)
        self._hooks = [
            inner.register_forward_pre_hook(self._forward_began, with_kwargs=True),
            inner.register_forward_hook(self._forward_ended, with_kwargs=True),
        ]

        def backward_measured(loss, **kwargs):
            with self.run.metrics.communication.backward(accelerator.sync_gradients):
                backward(loss, **kwargs)
            self.run.metrics.flops.end()

        accelerator.backward = backward_measured
        self._restore = lambda: vars(accelerator).pop("backward", None)
        self.run.lifecycle.show_progress = False  # the Trainer shows its own
        self.run.__enter__()

    def on_step_end(self, args, state, control, **kwargs):
        if self.run is not None and self.run._running is not None:
            self._close_stage()
            self.run._settle()

    def on_substep_end(self, args, state, control, **kwargs):
        if self.run is not None and self.run._running is not None:
            self._close_stage()

    def on_evaluate(self, args, state, control, metrics=None, **kwargs):
        if self.run is not None and self.run._running is not None and metrics:
            self.run.evaluated({k: v for k, v in metrics.items() if isinstance(v, (int, float))})

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and any(key.startswith("train_") for key in logs):  # the Trainer's figures at the end of train()
            self.trainer_metrics.update(logs)

    def on_train_end(self, args, state, control, **kwargs):
        if self.run is None or self.run._running is None:
            return
        self._close_stage()
        self.run._settle()
        metrics = dict(self.trainer_metrics)
        metrics.setdefault("total_flos", state.total_flos)
        self.run.lifecycle.header["trainer_metrics"] = metrics
        if self.run.lifecycle.record is not None:
            self.run.lifecycle.record.update(trainer_metrics=metrics)
        try:
            self.run.__exit__(None, None, None)
        finally:
            for hook in self._hooks:
                hook.remove()
            self._restore()
