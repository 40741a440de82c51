"""Where a run's model FLOPs come from: the formula of a model whose shape trainscope knows (a BERT-like encoder, a
GPT-2 or Llama decoder: trainscope.measure.flops), a figure the user gives, or FlopCounterMode's count of the first
micro-batch's forward and backward, scaled to later micro-batches by their tokens (or samples)."""

import torch

from trainscope.measure import flops as formulas


class NoFlops:
    basis = None

    def micro_batch(self, facts) -> int | None:
        return None

    def real(self, tokens, squares) -> int | None:
        return None

    @property
    def counting(self) -> bool:
        return False


class EncoderFlops(NoFlops):
    """BERT-like encoders (PaLM's formula, what trains read from the model: trainscope.measure.flops.training_of)."""

    basis = "formula: BERT-like encoder (PaLM appendix B, trainscope.measure.flops)"

    def __init__(self, config, unpad: bool, training):
        self.config, self.unpad, self.training, self.shape = config, unpad, training, formulas.encoder_shape(config)
        self._coefficients = None  # (training, (a, b)): computed once per what trains, not per micro-batch

    def _model(self) -> tuple:
        training = self.training()
        if self._coefficients is None or self._coefficients[0] is not training:
            self._coefficients = (training, formulas.flops_coefficients(*self.shape, training)["model"])
        return self._coefficients[1]

    def micro_batch(self, facts) -> int | None:
        if facts.shape is None:
            return None
        batch, length = facts.shape
        a, b = self._model()
        if self.unpad and facts.mask is not None:  # the real tokens' work (the forward's index of them synced)
            return int(round(a * int(facts.mask.sum()) + b * batch * length**2))  # as flops.padding_free_training_flops
        return int(round(a * batch * length + b * batch * length**2))  # from shapes, as flops.training_flops: no sync

    def real(self, tokens, squares) -> int | None:
        return formulas.real_training_flops(self.shape, tokens, squares, self.training())


class DecoderFlops(NoFlops):
    """Decoder-only language models (GPT-2, Llama): every weight trained, the LM head counted."""

    basis = "formula: decoder-only language model, all weights trained (trainscope.measure.flops)"

    def __init__(self, config):
        self.coefficients = formulas.causal_lm_flops_coefficients(config)

    def micro_batch(self, facts) -> int | None:
        if facts.shape is None:
            return None
        batch, length = facts.shape
        a, b = self.coefficients
        return int(round(a * batch * length + b * batch * length * length))

    def real(self, tokens, squares) -> int | None:
        if not tokens:
            return None
        a, b = self.coefficients
        return int(round(a * tokens + b * (squares or 0)))


class GivenFlops(NoFlops):
    """The user's figure: FLOPs per sample (a number) or per micro-batch (a function of the batch)."""

    basis = "given by the user"

    def __init__(self, given):
        self.given = given

    def micro_batch(self, facts) -> int | None:
        if callable(self.given):
            value = self.given(facts.batch)
            return int(value) if value is not None else None
        return int(self.given * facts.samples)


class CountedFlops(NoFlops):
    """FlopCounterMode around the first micro-batch's forward and backward (a warm-up step: its time is in no steady
    figure); later micro-batches are scaled by their tokens, or their samples where no tokens are counted. A model
    whose attention is a large share of its work is off by the quadratic term at other lengths: the basis says so."""

    basis = "FlopCounterMode, first micro-batch's forward and backward, scaled by tokens (or samples)"

    def __init__(self):
        self.per_token = self.per_sample = None
        self._counter = None
        self._done = False

    @property
    def counting(self) -> bool:
        return not self._done

    def begin(self) -> None:
        from torch.utils.flop_counter import FlopCounterMode

        if self._counter is None and not self._done:
            self._counter = FlopCounterMode(display=False)
            self._counter.__enter__()

    def end(self) -> None:
        if self._counter is not None:
            self._counter.__exit__(None, None, None)

    def micro_batch(self, facts) -> int | None:
        if self._counter is not None and not self._done:
            total, self._counter, self._done = self._counter.get_total_flops(), None, True
            if facts.tokens_known:
                self.per_token = total / max(facts.positions, 1)
            self.per_sample = total / max(facts.samples, 1)
            return int(total)
        if self.per_token is not None and facts.tokens_known:
            return int(round(self.per_token * facts.positions))
        if self.per_sample is not None:
            return int(round(self.per_sample * facts.samples))
        return None

    def real(self, tokens, squares) -> int | None:
        return int(round(self.per_token * tokens)) if self.per_token is not None and tokens else None


class BatchFacts:
    """What a micro-batch says of itself: its samples, its attention mask, its (batch, length) layout."""

    __slots__ = ("batch", "samples", "mask", "shape", "tokens")

    def __init__(self, batch, samples: int | None = None, tokens: int | None = None):
        self.batch, self.mask, self.shape, self.tokens = batch, None, None, tokens
        first = None
        if isinstance(batch, torch.Tensor):
            first = batch
        elif hasattr(batch, "get") and hasattr(batch, "keys"):  # a dict, transformers' BatchEncoding
            self.mask = batch.get("attention_mask")
            ids = batch.get("input_ids")
            if ids is not None and ids.dim() == 2:
                self.shape = tuple(ids.shape)
            first = ids if ids is not None else next((v for v in batch.values() if isinstance(v, torch.Tensor)), None)
        elif isinstance(batch, (tuple, list)):
            first = next((v for v in batch if isinstance(v, torch.Tensor)), None)
        if samples is None:
            samples = int(first.shape[0]) if first is not None and first.dim() else 1
        self.samples = samples
        if self.mask is not None and self.shape is None:
            self.shape = tuple(self.mask.shape)

    @property
    def tokens_known(self) -> bool:
        return self.tokens is not None or self.shape is not None

    @property
    def positions(self) -> int:
        """Token positions the kernels processed (padding included)."""
        if self.shape is not None:
            return self.shape[0] * self.shape[1]
        return self.tokens or 0


def source_for(config, given=None, unpad: bool = False, training=None):
    """The FLOPs source for a model of `config` (None for a model that is not a transformers one)."""
    if given == "count":
        return CountedFlops()
    if given is not None:
        return GivenFlops(given)
    if formulas.encoder_shape(config) is not None:
        return EncoderFlops(config, unpad, training)
    if formulas.decoder_shape(config) is not None:
        return DecoderFlops(config)
    return CountedFlops()
