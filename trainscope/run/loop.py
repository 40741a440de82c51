"""The loop's counters: where a run is and what it has counted, per phase, checkpointed for --resume."""

import torch

from trainscope.measure.timing import PHASES

# micro-batches whose sequence lengths wait, at most, before they are summed on the device
FOLD_EVERY = 64

# what each phase counts; squares: the sum of each sequence's real length squared (the attention term of the FLOPs
# on real tokens)
COUNTED = tuple("samples tokens optimizer_steps micro_batches flops padded_tokens padded_squares squares".split())


class LoopState:
    """Where the training loop is and what it has counted, checkpointed for --resume. Per-micro-batch figures that
    live on the device (loss, token count) stay there until a step line reads them: reading them is a device sync."""

    def __init__(self, device, checkpoint: dict | None = None):
        checkpoint = checkpoint or {}
        self.device = device
        self.step, self.epoch = checkpoint.get("step", 0), checkpoint.get("epoch", 0)
        self.batches_in_epoch = checkpoint.get("batches_in_epoch", 0)
        self.skipped_steps = checkpoint.get("skipped_steps", 0)
        self.counts = checkpoint.get("counts") or {}
        for phase in PHASES:  # a fresh run, or a checkpoint of an older run that lacks a phase
            self.counts.setdefault(phase, dict.fromkeys(COUNTED, 0))
            self.counts[phase].setdefault("squares", 0)
        self.evaluations = []
        self.micro_batches_in_step = 0
        self.counts_tokens = False  # some micro-batch said how many tokens it holds
        self._phase_tokens = {phase: torch.zeros((), device=device, dtype=torch.long) for phase in self.counts}
        self._phase_squares = {phase: torch.zeros((), device=device, dtype=torch.long) for phase in self.counts}
        self._lengths = []  # (phase, each sequence's real length) of the micro-batches not yet folded into the sums
        self._reset_interval()

    def _reset_interval(self):
        self.interval_losses = []
        self.interval_tokens = torch.zeros((), device=self.device, dtype=torch.long)
        self.interval_host_tokens = 0
        self.interval_samples = 0
        self.interval_flops = 0

    def start_epoch(self, epoch: int) -> int:
        """Returns how many batches of this epoch a resumed run skips."""
        skip = self.batches_in_epoch if epoch == self.epoch else 0
        self.epoch, self.batches_in_epoch = epoch, skip
        return skip

    def add_micro_batch(self, phase: str, loss, facts, flops: int | None):
        """One trained micro-batch; `facts` (trainscope.measure.flops_source.BatchFacts): its samples, and its tokens from its
        attention mask (on the device: read at log steps), from its (batch, length) layout, or as given."""
        samples = facts.samples
        counts = self.counts[phase]
        if facts.tokens is not None:  # the loop's own count wins over what the batch shows
            self.interval_host_tokens += facts.tokens
            counts["tokens"] += facts.tokens
        elif facts.mask is not None:  # one device operation here; the sums when they are read (`_fold`)
            self._lengths.append((phase, facts.mask.sum(-1)))
            if len(self._lengths) >= FOLD_EVERY:
                self._fold()
        elif facts.tokens_known:  # no padding: every position is a real token
            self.interval_host_tokens += facts.positions
            counts["tokens"] += facts.positions
            counts["squares"] += facts.shape[0] * facts.shape[1] ** 2
        if facts.tokens_known:
            self.counts_tokens = True
        self.interval_losses.append(loss)
        self.interval_samples += samples
        self.interval_flops += flops or 0
        self.batches_in_epoch += 1
        counts["samples"] += samples
        counts["micro_batches"] += 1
        counts["flops"] += flops or 0
        if facts.shape is not None:  # positions the kernels process, and batch x length^2 (the attention term)
            batch, length = facts.shape
            counts["padded_tokens"] = counts.get("padded_tokens", 0) + batch * length
            counts["padded_squares"] = counts.get("padded_squares", 0) + batch * length * length
        self.micro_batches_in_step += 1

    def end_step(self, phase: str):
        self.step += 1
        self.counts[phase]["optimizer_steps"] += 1
        self.micro_batches_in_step = 0

    @property
    def at_step_boundary(self) -> bool:
        """No micro-batch of the coming optimizer step trained yet: a checkpoint here is whole."""
        return self.micro_batches_in_step == 0

    def _fold(self) -> None:
        """The pending sequence lengths into the interval's and the phases' token sums and squares (on the device)."""
        for phase in {phase for phase, _ in self._lengths}:
            lengths = torch.cat([found for at, found in self._lengths if at == phase])
            tokens = lengths.sum()
            self.interval_tokens += tokens
            self._phase_tokens[phase] += tokens
            self._phase_squares[phase] += (lengths * lengths).sum()
        self._lengths = []

    def take_interval(self) -> dict:
        """The micro-batches since the last step line."""
        self._fold()
        interval = {
            "losses": self.interval_losses,
            "tokens": self.interval_tokens + self.interval_host_tokens if self.counts_tokens else None,
            "samples": self.interval_samples,
            "flops": self.interval_flops,
        }
        self._reset_interval()
        return interval

    def finish(self):
        """Fold the device-side token counts into `counts` (one sync, at the end)."""
        self._fold()
        for key, sums in (("tokens", self._phase_tokens), ("squares", self._phase_squares)):
            for phase, total in sums.items():
                self.counts[phase][key] += total.item()
                total.zero_()

    def checkpoint(self) -> dict:
        self.finish()
        position = {"step": self.step, "epoch": self.epoch, "batches_in_epoch": self.batches_in_epoch}
        return {**position, "skipped_steps": self.skipped_steps, "counts": self.counts}
