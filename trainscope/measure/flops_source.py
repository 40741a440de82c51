"""Where a run's model FLOPs come from: the model's layers walked as they train, a figure the user gives, or
FlopCounterMode on the training micro-batches themselves.

How it works: docs/instrument.md#flops-of-the-model-as-it-trains.
"""

import torch

from trainscope.measure import attention
from trainscope.measure import flops as formulas

# FlopCounterMode's operators whose work grows with the square of a sequence's length (attention's batched matmuls and
# fused kernels); the others (mm, addmm, convolutions) grow with its positions.
SQUARE_OPERATORS = ("bmm", "baddbmm", "scaled_dot_product", "flash_attention", "efficient_attention", "cudnn_attention")
# Shapes counted at most: beyond them, and after the warm-up steps, shapes are estimated from those counted.
MAX_COUNTED_SHAPES = 8


class NoFlops:
    basis = None

    def micro_batch(self, facts) -> int | None:
        return None

    def real(self, tokens, squares, samples=None) -> int | None:
        return None

    def recomputed(self, padded_tokens: int, padded_squares: int) -> int:
        return 0

    def details(self) -> dict:
        return {}

    def forward_started(self, args, kwargs, counting_allowed: bool) -> None:
        pass

    def end(self) -> None:
        pass


class WalkedSource(NoFlops):
    """A transformer whose layers were walked as they train (trainscope.measure.trained_flops.walk)."""

    def __init__(self, walked, unpad: bool, recomputes: bool):
        self.walked, self.unpad, self.recomputes = walked, unpad, recomputes
        self.basis = (
            f"formula: the model's layers as they train ({walked.describe()}; trainscope.measure.trained_flops)"
        )

    def micro_batch(self, facts) -> int | None:
        if facts.shape is None:
            return None
        batch, length = facts.shape
        walked = self.walked
        if self.unpad and facts.mask is not None:  # the real tokens' work (the forward's index of them synced)
            tokens = int(facts.mask.sum())
            return walked.per_token * tokens + walked.per_square * batch * length**2 + walked.per_sample * batch
        return walked.micro_batch(batch, length)  # from shapes: no sync

    def real(self, tokens, squares, samples=None) -> int | None:
        if not tokens:
            return None
        walked = self.walked
        return walked.per_token * tokens + walked.per_square * (squares or 0) + walked.per_sample * (samples or 0)

    def recomputed(self, padded_tokens: int, padded_squares: int) -> int:
        if not self.recomputes:
            return 0
        per_token, per_square = self.walked.forward
        return per_token * (padded_tokens or 0) + per_square * (padded_squares or 0)

    def details(self) -> dict:
        walked = self.walked
        return {
            "per_token": walked.per_token,
            "per_square": walked.per_square,
            "per_sample": walked.per_sample,
            "head": walked.head,
            "trained_layers": walked.trained_layers,
            "layers": walked.layers,
        }


class EncoderFlops(NoFlops):
    """BERT-like encoders whose layers could not be walked: PaLM's formula, what trains read from the model
    (trainscope.measure.flops.training_of)."""

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

    def real(self, tokens, squares, samples=None) -> int | None:
        return formulas.real_training_flops(self.shape, tokens, squares, self.training())

    def recomputed(self, padded_tokens: int, padded_squares: int) -> int:
        return formulas.recomputed_flops(self.config, padded_tokens, padded_squares, self.training()) or 0


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


def shape_key(args: tuple, kwargs: dict) -> tuple | None:
    """What a forward's FLOPs depend on: the shape of its `input_ids`, else of its first tensor argument."""
    ids = kwargs.get("input_ids")
    tensor = ids if isinstance(ids, torch.Tensor) else None
    if tensor is None:
        tensor = next((v for v in (*args, *kwargs.values()) if isinstance(v, torch.Tensor)), None)
    return tuple(tensor.shape) if tensor is not None and tensor.dim() else None


def is_sequence(key: tuple | None) -> bool:
    """A (batch, length) input: token positions, whose attention grows with the length's square."""
    return key is not None and len(key) == 2


class CountedFlops(NoFlops):
    """FlopCounterMode around a training micro-batch, once per new input shape while counting is allowed; a shape
    not counted is estimated from those that were (docs/instrument.md#flops-of-the-model-as-it-trains)."""

    def __init__(self):
        self.counted: dict[tuple, dict] = {}  # shape -> {"total", "square"} counted
        self._counter, self._key = None, None
        self._pending: int | None = None  # FLOPs of the micro-batch's forwards so far
        self.estimated = 0  # micro-batches whose FLOPs came from the fit, not from a count of their shape
        self.unknown = 0  # micro-batches with no estimate (no count of a comparable shape)
        self._fit = None

    basis = (
        "FlopCounterMode on the training micro-batches (fused attention as its math), once per new input shape during "
        "warm-up; other shapes from those counted (positions' work by positions, attention's by positions x length)"
    )

    def forward_started(self, args, kwargs, counting_allowed: bool) -> None:
        self.end()
        key = shape_key(args, kwargs)
        if key is None:
            return
        counting = counting_allowed or not self.counted
        if key not in self.counted and counting and len(self.counted) < MAX_COUNTED_SHAPES:
            from torch.utils.flop_counter import FlopCounterMode  # deferred: it loads torch's module tracker

            self._key = key  # fused attention counted as math's (FlopCounterMode has no formula for the CPU kernel)
            self._counter = FlopCounterMode(display=False, custom_mapping=attention.flop_formulas())
            self._counter.__enter__()
            return
        value = self.estimate(key)
        if value is None:
            self.unknown += 1
            return
        self.estimated += key not in self.counted
        self._pending = (self._pending or 0) + value

    def end(self) -> None:
        """Close a count still open: its micro-batch ended."""
        if self._counter is None:
            return
        counter, self._counter = self._counter, None
        counter.__exit__(None, None, None)
        by_operator = counter.get_flop_counts().get("Global", {})
        square = sum(v for op, v in by_operator.items() if any(name in str(op) for name in SQUARE_OPERATORS))
        total = counter.get_total_flops()
        self.counted[self._key] = {"total": int(total), "square": int(square)}
        self._fit = None
        self._pending = (self._pending or 0) + int(total)

    def estimate(self, key: tuple) -> int | None:
        found = self.counted.get(key)
        if found is not None:
            return found["total"]
        batch = key[0]
        if is_sequence(key):
            fit = self._sequence_fit()
            if fit is None:
                return None
            per_sample, per_position, per_square = fit
            length = key[1]
            return int(round(batch * (per_sample + per_position * length + per_square * length * length)))
        same = [(k, v) for k, v in self.counted.items() if k[1:] == key[1:] and k[0]]
        if not same:
            return None
        counted_key, value = same[-1]
        return int(round(value["total"] * batch / counted_key[0]))

    def _sequence_fit(self) -> tuple[float, float, float] | None:
        """(per sample, per position, per position x length) from the counted (batch, length) shapes."""
        if self._fit is not None:
            return self._fit
        points = [(k[0], k[1], v) for k, v in self.counted.items() if is_sequence(k) and k[0] and k[1]]
        if not points:
            return None
        per_square = sum(v["square"] for _, _, v in points) / sum(b * t * t for b, t, _ in points)
        lengths = [t for _, t, _ in points]
        linear = [((v["total"] - v["square"]) / b, t) for b, t, v in points]  # per sample, at length t
        if max(lengths) >= 2 * min(lengths):  # lengths far enough apart to tell per sample from per position
            n = len(linear)
            mean_t, mean_y = sum(t for _, t in linear) / n, sum(y for y, _ in linear) / n
            spread = sum((t - mean_t) ** 2 for _, t in linear)
            per_position = sum((t - mean_t) * (y - mean_y) for y, t in linear) / spread
            per_sample = mean_y - per_position * mean_t
        else:
            per_sample, per_position = 0.0, sum(y for y, _ in linear) / sum(t for _, t in linear)
        self._fit = (per_sample, per_position, per_square)
        return self._fit

    def micro_batch(self, facts) -> int | None:
        self.end()
        value, self._pending = self._pending, None
        return value

    def real(self, tokens, squares, samples=None) -> int | None:
        fit = self._sequence_fit()
        if fit is None or not tokens:
            return None
        per_sample, per_position, per_square = fit
        return int(round(per_sample * (samples or 0) + per_position * tokens + per_square * (squares or 0)))

    def details(self) -> dict:
        return {
            "counted_shapes": [list(key) for key in self.counted],
            "estimated_micro_batches": self.estimated,
            "unestimated_micro_batches": self.unknown,
        }


class BatchFacts:
    """What a micro-batch says of itself: its samples, its attention mask, its (batch, length) layout (a dict's
    input_ids or attention_mask, or a tuple's first tensor where it holds integers in two dimensions: token ids)."""

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
            if first is not None and first.dim() == 2 and not first.is_floating_point():
                self.shape = tuple(first.shape)  # token ids (nanoGPT's X): every position a real token
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


def source_for(model, config, given=None, unpad: bool = False, training=None, recomputes: bool = False):
    """The FLOPs source for `model` (unwrapped) of `config` (None for a model that is not a transformers one)."""
    if given == "count":
        return CountedFlops()
    if given is not None:
        return GivenFlops(given)
    if config is not None and model is not None:
        from trainscope.measure.trained_flops import walk  # deferred: it reads the layers' classes (torch)

        walked = walk(model, config)
        if walked is not None:
            return WalkedSource(walked, unpad, recomputes)
    if formulas.encoder_shape(config) is not None:
        return EncoderFlops(config, unpad, training)
    return CountedFlops()
