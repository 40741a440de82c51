"""The loop's own events, in the order they happened: each training forward of the model and each optimizer step.

How an optimizer step is counted and how the order is used: docs/instrument.md#what-counts-as-a-step.
"""

import itertools

import torch
from accelerate.optimizer import AcceleratedOptimizer
from accelerate.utils.deepspeed import DeepSpeedOptimizerWrapper
from torch.optim.optimizer import register_optimizer_step_post_hook

from trainscope.core.precision import SkippedSteps


class LoopEvents:
    """Training forwards (a forward pre-hook on the model) and optimizer steps (a step post-hook on the run's
    optimizer; torch's global one sees the others), each stamped with one sequence number, so that a step can be placed
    before or after the micro-batch whose forward came last. `scaler`: the loop's own torch.amp.GradScaler."""

    def __init__(self, model, optimizer, scaler=None):
        self._sequence = itertools.count()
        self.last_forward = -1  # sequence number of the latest training forward
        self.pending: list[int] = []  # sequence numbers of the optimizer steps not yet settled
        self.forward_listeners = []
        self.step_listeners = []  # called at each step the optimizer takes (a FLOPs count ends with its micro-batch)
        self.taken = 0  # calls of the optimizer's own step
        self.skips = None  # with a loss scaler: the steps it skipped (precision.SkippedSteps, counted on the device)
        self.beside: dict[int, list] = {}  # optimizers stepped beside the run's, not adopted: id -> [class, steps]
        self.adopted: list[str] = []  # optimizers that replaced the run's, as they were adopted
        self._handles, self._wrapped, self._own_scaler, self._own = [], None, False, None
        self.optimizer = optimizer
        if model is not None:
            self._handles.append(model.register_forward_pre_hook(self._forward, with_kwargs=True))
        inner = optimizer.optimizer if isinstance(optimizer, AcceleratedOptimizer) else optimizer
        if optimizer is None or not hasattr(inner, "register_step_post_hook"):  # none, or not a torch optimizer
            self.optimizer = None
            self.basis = "accelerator.sync_gradients (" + without_hooks(optimizer, inner) + ")"
            return
        self.inner, self._parameters = inner, parameter_ids(inner)
        scaled = isinstance(optimizer, AcceleratedOptimizer) and optimizer.scaler is not None
        self._on_step = self._taken if scaled else self._stepped
        self._own = inner.register_step_post_hook(self._on_step)
        self._handles.append(register_optimizer_step_post_hook(self._any_step))
        self.basis = f"the optimizer's own steps ({type(inner).__name__}'s step hook)"
        if scaled:
            self._watch_scaled_steps(optimizer)
            self.basis = (
                f"the prepared optimizer's synchronizing steps ({type(inner).__name__} under a loss scaler; the steps "
                "it skipped counted apart)"
            )
        elif scaler is not None and scaler.is_enabled():  # the loop's own: it skips before the optimizer's step
            self.skips, self._own_scaler = SkippedSteps(scaler, torch.device(scaler._device)), True
            self.basis += "; the steps the loop's GradScaler skipped counted apart (its scale, lowered by update())"

    @property
    def counts_steps(self) -> bool:
        """The optimizer's hook counts the steps (else the loop's sync_gradients does)."""
        return self.optimizer is not None

    def _forward(self, module, args, kwargs):
        if torch.is_grad_enabled() and module.training:
            if self._own_scaler:  # the scale the last update() left, against the one before: on the device, no sync
                self.skips.after_step()
                self.skips.before_step()
            self.last_forward = next(self._sequence)
            for listener in self.forward_listeners:
                listener(args, kwargs)

    def _any_step(self, optimizer, args, kwargs):
        """Any torch optimizer's step (the run's is counted by its own hook): one sharing the run's parameters
        replaced its optimizer (a new one made after a warm-up or a parameter-group change) and is adopted, its own
        hook counting its steps from the next; any other is counted beside."""
        if optimizer is self.inner:
            return
        if id(optimizer) in self.beside or self._parameters.isdisjoint(parameter_ids(optimizer)):
            self.beside.setdefault(id(optimizer), [type(optimizer).__name__, 0])[1] += 1
            return
        self.adopted.append(f"{type(optimizer).__name__} after {self.taken} steps of {type(self.inner).__name__}")
        self._own.remove()
        self.inner, self._parameters, self._on_step = optimizer, parameter_ids(optimizer), self._stepped
        self._own = optimizer.register_step_post_hook(self._stepped)
        self._stepped(optimizer, args, kwargs)

    def steps_basis(self) -> str:
        """How the steps were counted, with the optimizers adopted and those stepped beside the run's."""
        said = [self.basis, *(f"adopted {adopted}" for adopted in self.adopted)]
        said += [
            f"{name} stepped {steps} times beside it, not counted as steps" for name, steps in self.beside.values()
        ]
        return "; ".join(said)

    def _taken(self, optimizer, args, kwargs):
        self.taken += 1

    def _stepped(self, optimizer, args, kwargs):
        self._taken(optimizer, args, kwargs)
        self.step_ended()

    def step_ended(self) -> None:
        """An optimizer step ended now (the hooks', or a loop without an optimizer at Accelerate's sync)."""
        self.pending.append(next(self._sequence))
        for listener in self.step_listeners:
            listener()

    def _watch_scaled_steps(self, optimizer) -> None:
        """Under a loss scaler a step is each synchronizing call of the prepared optimizer's step: Accelerate's step
        calls the inner one only for finite gradients, and a fused optimizer's kernel skips the update on the
        device, so neither the inner hook nor Accelerate's `step_was_skipped` sees every skipped step. The scaler's
        scale, lowered by `update()` on an overflow, counts them on the device (precision.SkippedSteps: no sync)."""
        original = optimizer.step
        self.skips = SkippedSteps(optimizer.scaler, torch.device(optimizer.scaler._device))

        def step(*args, **kwargs):
            if not optimizer.gradient_state.sync_gradients:  # inside an accumulation window: no step
                return original(*args, **kwargs)
            self.skips.before_step()
            result = original(*args, **kwargs)
            self.skips.after_step()
            self.step_ended()
            return result

        optimizer.step = step  # an attribute of this instance, removed at close (as Accelerate patches its own)
        self._wrapped = optimizer

    def skipped_total(self) -> int:
        """Steps the loss scaler skipped so far: a sync point (log steps and the summary only)."""
        if self._own_scaler:  # the last update() since the latest forward
            self.skips.after_step()
            self.skips.before_step()
        return self.skips.total() if self.skips is not None else 0

    def steps_before_last_forward(self) -> int:
        """How many steps ended before the latest training forward began, taken out of `pending`."""
        if not self.pending:  # most calls: nothing to settle
            return 0
        before = [sequence for sequence in self.pending if sequence < self.last_forward]
        self.pending = [sequence for sequence in self.pending if sequence > self.last_forward]
        return len(before)

    def take(self) -> int:
        """How many steps are pending, all taken out."""
        if not self.pending:
            return 0
        taken, self.pending = len(self.pending), []
        return taken

    def close(self) -> None:
        for handle in [*self._handles, *([self._own] if self._own else [])]:  # the run's optimizer's, adopted or not
            handle.remove()
        self._handles = []
        if self._wrapped is not None:
            vars(self._wrapped).pop("step", None)
            self._wrapped = None


def parameter_ids(optimizer) -> set[int]:
    return {id(p) for group in getattr(optimizer, "param_groups", ()) for p in group["params"]}


def without_hooks(optimizer, inner) -> str:
    """Why the steps are Accelerate's synchronizing micro-batches."""
    if optimizer is None:
        return "no optimizer given to trainscope.Run: a loop that accumulates by hand is counted per micro-batch"
    if isinstance(optimizer, DeepSpeedOptimizerWrapper):
        return (
            f"DeepSpeed's {type(inner).__name__} has no torch step hook: DeepSpeed's engine steps it inside "
            "accelerator.backward at its gradient-accumulation boundary, which Accelerate's sync_gradients marks"
        )
    return f"{type(inner).__name__} has no step hooks: a loop that accumulates by hand is counted per micro-batch"
