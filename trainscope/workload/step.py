"""train.py's classifier step and its evaluation: what train.py, the loader sweep, the batch search and the overhead
benchmark's bare loop all run, so that each measures the same step."""

import contextlib
from pathlib import Path

import torch
import torch.nn.functional as F

from trainscope.workload.modeling import classification_loss

METRIC_MODULE = str(Path(__file__).parent / "metrics" / "classification")


def unmeasured(stage: str):
    """No clock: the step as a loop without instruments runs it."""
    return contextlib.nullcontext()


def train_step(accelerator, model, batch, optimizer, scheduler, stage, max_grad_norm: float | None, backward=None):
    """One micro-batch: forward, loss + backward, then clipping and the optimizer step when the gradients synchronize
    (Accelerate skips the step inside an accumulation window).

    `stage` times each part (`run.stage`, a StageTimer, or `unmeasured`); `backward` is `run.backward` in a measured
    run (DDP's exposed communication stamped where backward returns), else `accelerator.backward`. Returns (loss,
    labels), still on the device: reading the loss is left to log steps."""
    labels = batch.pop("labels")
    with accelerator.accumulate(model):
        with stage("forward"):
            logits = model(**batch).logits
        with stage("backward"):
            loss = classification_loss(logits, labels)  # fp32 cross-entropy
            (backward or accelerator.backward)(loss)
        with stage("optimizer"):
            if accelerator.sync_gradients and max_grad_norm:
                accelerator.clip_grad_norm_(model.parameters(), max_grad_norm)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
    return loss.detach(), labels


def load_metric():
    """Accuracy and macro-F1 through `evaluate`, from the module shipped in the package (offline), kept in memory:
    its default cache file has one name for every process, so a second process (another rank, another run on the
    machine) waited for the first one's file lock, a second per evaluated split charged to `eval`."""
    import evaluate  # imported here: it pulls in transformers' pipelines, seconds a failed start need not pay

    return evaluate.load(METRIC_MODULE, keep_in_memory=True)


@torch.no_grad()
def evaluate_split(model, loader, accelerator, metric, between_batches=None) -> dict:
    """Accuracy, macro-F1 and mean loss over a whole split, gathered from every process, and the token
    positions it processed (`positions`: real, padded, batch x length^2, samples; summed over ranks).
    `between_batches` is called after every batch (a run's stop check)."""
    model.eval()
    loss_sum, count = torch.zeros((), device=accelerator.device), 0
    real = torch.zeros((), dtype=torch.long, device=accelerator.device)  # read once, at the end
    padded = squares = samples = 0  # from shapes: no sync
    for batch in loader:
        labels = batch.pop("labels")
        mask = batch["attention_mask"]
        real += mask.sum()
        padded, squares, samples = (
            padded + mask.numel(),
            squares + mask.numel() * mask.shape[-1],
            samples + mask.shape[0],
        )
        logits = model(**batch).logits
        losses = F.cross_entropy(logits.float(), labels, reduction="none")
        predictions, references, losses = accelerator.gather_for_metrics((logits.argmax(-1), labels, losses))
        metric.add_batch(predictions=predictions.cpu(), references=references.cpu())
        loss_sum += losses.sum()
        count += losses.numel()
        if between_batches is not None:
            between_batches()
    model.train()
    local = torch.stack([real, *(torch.tensor(v, device=real.device) for v in (padded, squares, samples))])
    tokens, padded, squares, samples = accelerator.reduce(local, reduction="sum").tolist()
    return {
        **metric.compute(),
        "loss": loss_sum.item() / count,
        "positions": {"tokens": tokens, "padded_tokens": padded, "padded_squares": squares, "samples": samples},
    }
