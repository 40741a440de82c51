"""The loop's own events, in the order they happened: each training forward of the model and each optimizer step.

An optimizer step is counted by the optimizer itself (torch's step post-hook on the optimizer the loop steps; with a
loss scaler, each synchronizing call of the prepared optimizer's step, and those the scaler skipped counted apart),
never by `accelerator.sync_gradients`, which a loop that accumulates by hand never turns off. How the order is used: docs/instrument.md#what-counts-as-a-step.
"""

import itertools

import torch
from accelerate.optimizer import AcceleratedOptimizer

from trainscope.core.precision import SkippedSteps


class LoopEvents:
    """Training forwards (a forward pre-hook on the model the loop calls) and optimizer steps (a step post-hook on
    the optimizer), each stamped with one sequence number, so that a step can be placed before or after the micro-
    batch whose forward came last. `forward_listeners` are called with each training forward's inputs (the FLOPs
    counter's shapes)."""

    def __init__(self, model, optimizer):
        self._sequence = itertools.count()
        self.last_forward = -1  # sequence number of the latest training forward
        self.pending: list[int] = []  # sequence numbers of the optimizer steps not yet settled
        self.forward_listeners = []
        self.step_listeners = []  # called at each step the optimizer takes (a FLOPs count ends with its micro-batch)
        self.taken = 0  # calls of the optimizer's own step
        self.skips = None  # with a loss scaler: the steps it skipped (precision.SkippedSteps, counted on the device)
        self._handles = []
        self._wrapped = None
        self.optimizer = optimizer
        if model is not None:
            self._handles.append(model.register_forward_pre_hook(self._forward, with_kwargs=True))
        inner = optimizer.optimizer if isinstance(optimizer, AcceleratedOptimizer) else optimizer
        if optimizer is None or not hasattr(inner, "register_step_post_hook"):  # none, or not a torch optimizer
            self.optimizer = None
            self.basis = (
                "accelerator.sync_gradients ("
                + ("no optimizer given to trainscope.Run" if optimizer is None else f"{type(inner).__name__} has no "
                   "step hooks")
                + ": a loop that accumulates by hand is counted per micro-batch)"
            )  # fmt: skip
            return
        scaled = isinstance(optimizer, AcceleratedOptimizer) and optimizer.scaler is not None
        self._handles.append(inner.register_step_post_hook(self._taken if scaled else self._stepped))
        self.basis = f"the optimizer's own steps ({type(inner).__name__}'s step hook)"
        if scaled:
            self._watch_scaled_steps(optimizer)
            self.basis = (
                f"the prepared optimizer's synchronizing steps ({type(inner).__name__} under a loss scaler; the steps "
                "it skipped counted apart)"
            )

    @property
    def counts_steps(self) -> bool:
        """The optimizer's hook counts the steps (else the loop's sync_gradients does)."""
        return self.optimizer is not None

    def _forward(self, module, args, kwargs):
        if torch.is_grad_enabled() and module.training:
            self.last_forward = next(self._sequence)
            for listener in self.forward_listeners:
                listener(args, kwargs)

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
        for handle in self._handles:
            handle.remove()
        self._handles = []
        if self._wrapped is not None:
            vars(self._wrapped).pop("step", None)
            self._wrapped = None
