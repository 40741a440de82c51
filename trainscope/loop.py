"""The training step every script shares, so a sweep measures exactly what train.py runs."""

import time

import torch
import torch.nn.functional as F


def train_step(accelerator, model, batch, optimizer, scheduler, timer, max_grad_norm: float | None):
    """One micro-batch: forward, loss + backward, then clipping and the optimizer step when the
    gradients synchronize (Accelerate skips the step inside an accumulation window).

    Returns (loss, labels), still on the device: reading the loss is left to log steps.
    """
    with accelerator.accumulate(model):
        with timer("forward"):
            labels = batch.pop("labels")
            logits = model(**batch).logits
        with timer("backward"):
            loss = F.cross_entropy(logits.float(), labels)
            accelerator.backward(loss)
        with timer("optimizer"):
            if accelerator.sync_gradients and max_grad_norm:
                accelerator.clip_grad_norm_(model.parameters(), max_grad_norm)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
    return loss.detach(), labels


class LoopState:
    """Where the training loop is and what it has counted, checkpointed for --resume.

    Per-micro-batch figures that live on the device (loss, token count) are kept there and read
    only when a step line is written: reading them is a device sync.
    """

    def __init__(self, device, checkpoint: dict | None = None):
        checkpoint = checkpoint or {}
        self.device = device
        self.step = checkpoint.get("step", 0)
        self.epoch = checkpoint.get("epoch", 0)
        self.batches_in_epoch = checkpoint.get("batches_in_epoch", 0)
        self.skipped_steps = checkpoint.get("skipped_steps", 0)
        self.counts = checkpoint.get("counts") or {
            phase: {"samples": 0, "tokens": 0, "optimizer_steps": 0, "micro_batches": 0, "flops": 0}
            for phase in ("warmup", "steady")}
        self.evaluations = []
        self._phase_tokens = {phase: torch.zeros((), device=device, dtype=torch.long) for phase in self.counts}
        self._reset_interval()

    def _reset_interval(self):
        self.interval_losses = []
        self.interval_tokens = torch.zeros((), device=self.device, dtype=torch.long)
        self.interval_samples = 0
        self.interval_flops = 0
        self.interval_started = time.perf_counter()

    def start_epoch(self, epoch: int) -> int:
        """Returns how many batches of this epoch a resumed run skips."""
        skip = self.batches_in_epoch if epoch == self.epoch else 0
        self.epoch, self.batches_in_epoch = epoch, skip
        return skip

    def add_micro_batch(self, phase: str, loss, labels, attention_mask, flops: int | None):
        tokens = attention_mask.sum()
        self.interval_losses.append(loss)
        self.interval_tokens += tokens
        self._phase_tokens[phase] += tokens
        self.interval_samples += labels.shape[0]
        self.interval_flops += flops or 0
        self.batches_in_epoch += 1
        counts = self.counts[phase]
        counts["samples"] += labels.shape[0]
        counts["micro_batches"] += 1
        counts["flops"] += flops or 0

    def end_step(self, phase: str, skipped: bool):
        self.step += 1
        self.counts[phase]["optimizer_steps"] += 1
        self.skipped_steps += int(skipped)

    def take_interval(self) -> dict:
        """The micro-batches since the last step line, and the host time they took."""
        interval = {"losses": self.interval_losses, "tokens": self.interval_tokens,
                    "samples": self.interval_samples, "flops": self.interval_flops,
                    "wall_s": time.perf_counter() - self.interval_started}
        self._reset_interval()
        return interval

    def finish(self):
        """Fold the device-side token counts into `counts` (one sync, at the end)."""
        for phase, tokens in self._phase_tokens.items():
            self.counts[phase]["tokens"] += tokens.item()
            tokens.zero_()

    def checkpoint(self) -> dict:
        self.finish()
        return {"step": self.step, "epoch": self.epoch, "batches_in_epoch": self.batches_in_epoch,
                "skipped_steps": self.skipped_steps, "counts": self.counts}
