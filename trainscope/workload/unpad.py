"""Padding-free encoder layers for the BERT family (--unpad): the same model, its token-wise work on real tokens.

How it works: docs/same-result.md#in-the-code-how-the-padding-free-layers-work-trainscopeworkloadunpadpy.
"""

import contextlib
import sys
from types import MethodType

import torch
import torch.nn.functional as F
from torch import nn
from torch.profiler import record_function
from transformers.modeling_outputs import BaseModelOutputWithPastAndCrossAttentions
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from trainscope.core.errors import UserError
from trainscope.workload import dropout_draws

# model_type -> the name of the encoder model inside the task model (BERT's layout: embeddings, encoder.layer[i] with
# attention.self.{query,key,value}, attention.output, intermediate, output).
SUPPORTED = {"bert": "bert", "roberta": "roberta"}


class Layout:
    """Where the current batch's real tokens are: the flat indices of its mask's ones, and the padded (B, T)."""

    def __init__(self):
        self.mask = None  # the batch's 2-D attention mask, as the model was called with it
        self.indices = None
        self.batch = self.length = 0

    def __deepcopy__(self, memo):
        return self  # one layout per model, its copies included: each forward sets it before any layer reads it

    def set(self, mask: torch.Tensor) -> None:
        self.batch, self.length = mask.shape
        self.indices = torch.nonzero(mask.reshape(-1)).flatten()  # a sync point on accelerators

    def unpad(self, padded: torch.Tensor) -> torch.Tensor:
        """(B, T, ...) or (B x T, ...) -> (1, N, ...): the real rows."""
        return padded.reshape(self.batch * self.length, *padded.shape[-1:]).index_select(0, self.indices).unsqueeze(0)

    def pad(self, real: torch.Tensor) -> torch.Tensor:
        """(1, N, width) -> (B, T, width), zeros at the padding positions."""
        real = real.reshape(-1, real.shape[-1])
        padded = real.new_zeros(self.batch * self.length, real.shape[-1]).index_copy(0, self.indices, real)
        return padded.view(self.batch, self.length, -1)


class PaddedShapeDropout(nn.Dropout):
    """nn.Dropout on real rows with the mask the padded model draws for the padded shape, its real rows kept.

    On a CPU, torch's dropout is `empty_like(input).bernoulli_(1 - p)`, divided by 1 - p, times the input
    (aten/src/ATen/native/Dropout.cpp, _dropout_impl; compiled with eager's random numbers it is native_dropout's
    fallback, whose mask is the same bernoulli_ draw): the same draw here, on the padded shape and dtype, then
    divided and multiplied on the real rows only -- the same values. Elsewhere (CUDA's fused dropout kernel) the
    mask is the dropout of ones of the padded shape: the very call the padded model makes."""

    def __init__(self, p: float, layout: Layout):
        super().__init__(p)
        self.layout = layout

    def forward(self, real: torch.Tensor) -> torch.Tensor:
        if not self.training or self.p == 0:
            return real
        layout = self.layout
        shape = (layout.batch, layout.length, real.shape[-1])
        if real.device.type == "cpu":
            with _span("trainscope::dropout"):
                mask = dropout_draws.bernoulli(shape, 1 - self.p, real.dtype, real.device)
                return real * layout.unpad(mask).div_(1 - self.p)
        ones = torch.ones(shape, dtype=real.dtype, device=real.device)
        return real * layout.unpad(F.dropout(ones, self.p, True))


def attention_text(implementation: str) -> str:
    """What the record says of the attention: the kernel, and the steps that replace it where the loop draws."""
    said = f"{implementation} on the padded layout"
    if implementation == "eager":
        return said + " (with attention dropout on a CPU: its steps with the mask drawn by the checked loop)"
    return said + (
        " (with attention dropout on a CPU: sdpa's math path written out -- fp32 scores, softmax and dropout, "
        "the mask drawn by the checked loop)"
    )


def supported_types() -> str:
    return ", ".join(SUPPORTED)


def check(config) -> None:
    """One line when a model cannot run padding-free."""
    if config.model_type not in SUPPORTED:
        raise UserError(
            f"--unpad supports the BERT family ({supported_types()}: the embedded minilm-l6 and tiny-bert, "
            f"bert-*, roberta-*), not {config.model_type}"
        )
    if getattr(config, "is_decoder", False) or getattr(config, "add_cross_attention", False):
        raise UserError("--unpad supports encoders only: this configuration is a decoder")
    if getattr(config, "chunk_size_feed_forward", 0):
        raise UserError("--unpad: feed-forward chunking (chunk_size_feed_forward) is not supported")


def apply(model, tokenizer=None) -> dict:
    """Make the encoder layers of `model` (a task model, or peft's wrapper of one) padding-free, in place. Returns
    what the record says of it."""
    task_model = model.get_base_model() if hasattr(model, "get_base_model") else model
    config = task_model.config
    check(config)
    if tokenizer is not None and getattr(tokenizer, "padding_side", "right") != "right":
        raise UserError("--unpad needs right padding (the classifier reads the first position)")
    encoder_model = getattr(task_model, SUPPORTED[config.model_type])
    layout = Layout()
    encoder_model.register_forward_pre_hook(_mask_keeper(layout), with_kwargs=True)
    encoder = encoder_model.encoder
    encoder.unpad_layout = layout
    encoder.padded_forward = encoder.forward
    encoder.forward = MethodType(_encoder_forward(layout), encoder)
    replaced = 0
    for layer in encoder.layer:
        attention = layer.attention.self
        attention.forward = MethodType(_self_attention_forward(layout), attention)
        replaced += _replace_dropouts(layer, layout)
    return {
        "layers": len(encoder.layer),
        "dropouts_drawn_padded": replaced,
        "attention": attention_text(config._attn_implementation),
    }


@contextlib.contextmanager
def probing(model, batch: int, length: int, device: torch.device):
    """One padding-free layer run outside the model's forward (trainscope.measure.profiling.layer_breakdown, which feeds a
    layer (probe batch, probe length, width)): inside, the layers take `batch` sequences of `length` real tokens and
    no padding, fed as (1, batch x length, width). Yields that probe's (batch, length): (1, batch x length)."""
    layout = next(m.unpad_layout for m in model.modules() if hasattr(m, "unpad_layout"))
    saved = dict(vars(layout))
    layout.set(torch.ones(batch, length, dtype=torch.long, device=device))
    try:
        yield 1, batch * length
    finally:
        vars(layout).update(saved)


def _mask_keeper(layout: Layout):
    def keep(module, args, kwargs):
        mask = kwargs.get("attention_mask", args[1] if len(args) > 1 else None)
        layout.mask = mask

    return keep


def _replace_dropouts(layer: nn.Module, layout: Layout) -> int:
    """Every nn.Dropout called inside the layer (hidden dropout, LoRA's) -> PaddedShapeDropout. The self-attention's
    own dropout module is only read for its p (the attention kernel drops on the padded layout): left as it is."""
    replaced = 0
    for parent in list(layer.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.Dropout and parent is not layer.attention.self:
                setattr(parent, name, PaddedShapeDropout(child.p, layout))
                replaced += 1
    return replaced


def _encoder_forward(layout: Layout):
    def forward(
        self,
        hidden_states,
        attention_mask=None,
        encoder_hidden_states=None,
        encoder_attention_mask=None,
        past_key_values=None,
        use_cache=None,
        **kwargs,
    ):
        if layout.mask is None:  # no padding to skip
            return self.padded_forward(
                hidden_states,
                attention_mask,
                encoder_hidden_states,
                encoder_attention_mask,
                past_key_values,
                use_cache,
                **kwargs,
            )
        layout.set(layout.mask)
        real = layout.unpad(hidden_states)
        for layer in self.layer:
            real = layer(real, attention_mask, None, **kwargs)  # positional, as the padded encoder passes them
        return BaseModelOutputWithPastAndCrossAttentions(last_hidden_state=layout.pad(real))

    return forward


def _self_attention_forward(layout: Layout):
    def forward(self, hidden_states, attention_mask=None, past_key_values=None, **kwargs):
        def heads(projected):  # (1, N, H x d) -> (B, H, T, d), zeros at padding positions
            return layout.pad(projected).view(layout.batch, layout.length, -1, self.attention_head_size).transpose(1, 2)

        query, key, value = (heads(projection(hidden_states)) for projection in (self.query, self.key, self.value))
        dropout = self.dropout.p if self.training else 0.0
        if dropout and dropout_draws.drawn_here(torch.float32, query.device):
            output, weights = _attention_drawn(
                query, key, value, attention_mask, self.scaling, dropout, self.config._attn_implementation
            )
        else:
            eager = sys.modules[type(self).__module__].eager_attention_forward
            attention = ALL_ATTENTION_FUNCTIONS.get_interface(self.config._attn_implementation, eager)
            output, weights = attention(
                self, query, key, value, attention_mask, dropout=dropout, scaling=self.scaling, **kwargs
            )
        return layout.unpad(output.reshape(layout.batch * layout.length, -1)), weights

    return forward


def _attention_drawn(query, key, value, attention_mask, scaling: float, p: float, implementation: str):
    """Attention on the padded layout with its dropout mask drawn by trainscope.workload.dropout_draws, in the steps and the
    precision of the kernel the padded model runs, its mask the one that kernel draws (`empty_like(weights).
    bernoulli_(1 - p)` on the (B, H, T, T) weights, then divided by 1 - p and multiplied: aten's _dropout_impl).

    * sdpa: with dropout on a CPU sdpa takes its math path (aten's _scaled_dot_product_attention_math), which turns
      bf16 and fp16 operands to fp32 first, scales query and key by the square root of the scale each, and returns
      the output in the operands' dtype: the same steps here, outside autocast, so a bf16 run's scores, softmax and
      dropout are fp32 as the padded model's are (its output is bitwise sdpa's math path's without dropout).
    * eager: transformers' eager_attention_forward (scores, mask, softmax, dropout, values) in the autocast dtype.
    The mask holds 0 and 1 in any dtype and the loop draws the same numbers for each, so it is drawn in float32."""
    with _span("trainscope::scaled_dot_product_attention"):
        if implementation == "eager":
            return _weights_then_values(torch.matmul(query, key.transpose(2, 3)) * scaling, value, attention_mask, p)
        dtype, root = query.dtype, scaling**0.5
        with torch.autocast(query.device.type, enabled=False):
            scores = torch.matmul(query.float() * root, key.float().transpose(2, 3) * root)
            output, weights = _weights_then_values(scores, value.float(), attention_mask, p)
        return output.to(dtype), weights.to(dtype)


def _weights_then_values(scores, value, attention_mask, p: float):
    """The attention's steps after its scores: mask, softmax, the drawn dropout, the values; (output (B, T, H, d),
    weights)."""
    if attention_mask is not None:
        if attention_mask.dtype == torch.bool:
            scores = scores.masked_fill(~attention_mask, torch.finfo(scores.dtype).min)
        else:
            scores = scores + attention_mask
    weights = F.softmax(scores, dim=-1)
    with _span("trainscope::dropout"):
        mask = dropout_draws.bernoulli(weights.shape, 1 - p, torch.float32, weights.device)
        weights = weights * mask.div_(1 - p).to(weights.dtype)
    return torch.matmul(weights, value).transpose(1, 2).contiguous(), weights


def _span(name: str):
    """A named span for the profiler, so that the gap table (trainscope.measure.gap) files the work inside under what it
    serves -- the loop's draw is no aten operator, and the mask's multiply would be a generic one -- as it files
    the padded model's aten::dropout and attention kernel. None while torch.compile traces."""
    return contextlib.nullcontext() if torch.compiler.is_compiling() else record_function(name)
