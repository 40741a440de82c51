"""The training step every script shares, so a sweep measures exactly what train.py runs."""

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
