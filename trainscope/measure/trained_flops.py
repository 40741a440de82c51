"""Model FLOPs of a transformer as it is built and as it trains: its layers walked one by one.

A projection of i inputs and o outputs costs 2io per token forward, 2io for its input's gradient where needed, 2io for
its weight's where it trains; attention 4QT per token forward (Q the query width, T positions: the full square) and
2QT for each gradient autograd computes. What is counted: docs/instrument.md#flops-of-the-model-as-it-trains.
"""

import dataclasses

import torch

from trainscope.measure.layers import forced_input_grads, transformer_layer_classes
from trainscope.measure.shapes import decoder_shape, encoder_shape, is_decoder_config

# A layer's projections by their names inside the layer, matched on the end of the name, in this order (a module
# takes the first role it matches: BERT's attention.output.dense is `o` before `down` could take it as output.dense).
ROLES = (
    ("qkv", ("c_attn", "qkv_proj", "query_key_value", "Wqkv")),
    ("q", ("q_proj", "query", "q_lin")),
    ("k", ("k_proj", "key", "k_lin")),
    ("v", ("v_proj", "value", "v_lin")),
    ("o", ("o_proj", "out_proj", "out_lin", "attention.output.dense", "attn.c_proj", "attention.dense", "self_attn.dense")),
    ("gate_up", ("gate_up_proj",)),
    ("gate", ("gate_proj",)),
    ("up", ("up_proj", "intermediate.dense", "mlp.c_fc", "ffn.lin1", "fc1", "fc_in", "dense_h_to_4h")),
    ("down", ("down_proj", "output.dense", "mlp.c_proj", "ffn.lin2", "fc2", "fc_out", "dense_4h_to_h")),
)  # fmt: skip
# Norms before the attention and the MLP (pre-norm decoders) or after them (post-norm encoders).
ATTENTION_NORMS = ("input_layernorm", "ln_1", "self_attn_layer_norm")
MLP_NORMS = ("post_attention_layernorm", "ln_2", "final_layer_norm", "pre_feedforward_layernorm")
AFTER_ATTENTION_NORMS = ("attention.output.LayerNorm", "sa_layer_norm")
AFTER_MLP_NORMS = ("output.LayerNorm", "output_layer_norm")
FINAL_NORMS = ("ln_f", "norm", "final_layer_norm", "final_layernorm")
# Decoders whose attention and MLP both read the layer's input (True: through one shared norm).
PARALLEL = {"gptj": True, "phi": True}


@dataclasses.dataclass(frozen=True)
class WalkedFlops:
    """FLOPs of one training micro-batch of B sequences of T positions: per_token x B x T + per_square x B x T^2 +
    per_sample x B; `forward` the same for the layers' forward alone (what activation checkpointing recomputes)."""

    per_token: int
    per_square: int
    per_sample: int
    forward: tuple[int, int]  # the layers' forward: (per token, per square)
    head: str  # what the head is and how often it runs
    trained_layers: int  # layers with a weight, bias or adapter that trains
    layers: int

    def micro_batch(self, batch: int, length: int) -> int:
        return self.per_token * batch * length + self.per_square * batch * length * length + self.per_sample * batch

    def describe(self) -> str:
        return f"{self.trained_layers} of {self.layers} layers train; {self.head}"


def _matches(relative: str, names: tuple) -> bool:
    return any(relative == name or relative.endswith("." + name) for name in names)


def _dims(module) -> tuple[int, int] | None:
    base = getattr(module, "base_layer", module)
    if hasattr(base, "in_features") and hasattr(base, "out_features"):
        return int(base.in_features), int(base.out_features)
    weight = getattr(base, "weight", None)
    if type(base).__name__ == "Conv1D" and weight is not None and weight.dim() == 2:  # GPT-2's: weight is (in, out)
        return int(weight.shape[0]), int(weight.shape[1])
    return None


def _trains(parameter) -> bool:
    return parameter is not None and parameter.requires_grad


@dataclasses.dataclass
class _Cost:
    forward: int = 0
    backward: int = 0


def projection(module, input_needs_grad: bool, cost: _Cost) -> bool:
    """Add one projection's FLOPs per token (with its LoRA adapters) to `cost`; returns whether its output needs a
    gradient."""
    base = getattr(module, "base_layer", module)
    inputs, outputs = _dims(module)
    weight = 2 * inputs * outputs
    trains = _trains(base.weight)
    cost.forward += weight
    cost.backward += weight * (input_needs_grad + trains)
    needs = input_needs_grad or trains or _trains(getattr(base, "bias", None))
    for name in _active_adapters(module):
        a, b = module.lora_A[name], module.lora_B[name]
        rank = int(a.out_features)
        a_trains, b_trains = _trains(a.weight), _trains(b.weight)
        a_out = input_needs_grad or a_trains
        cost.forward += 2 * inputs * rank + 2 * rank * outputs
        cost.backward += 2 * inputs * rank * (input_needs_grad + a_trains) + 2 * rank * outputs * (a_out + b_trains)
        needs = needs or a_out or b_trains
    return needs


def _active_adapters(module) -> list[str]:
    lora_a = getattr(module, "lora_A", None)
    if not isinstance(lora_a, torch.nn.ModuleDict) or getattr(module, "disable_adapters", False):
        return []
    active = getattr(module, "active_adapters", None) or list(lora_a.keys())
    active = [active] if isinstance(active, str) else active
    return [name for name in active if name in lora_a and name in module.lora_B]


def _norms_train(layer_modules: dict, names: tuple) -> bool:
    return any(_trains(p) for relative, m in layer_modules.items() if _matches(relative, names) for p in m.parameters())


def _layer_roles(layer) -> dict | None:
    """The layer's projections by role, or None when they are not all found (another layout)."""
    found = {}
    for relative, module in layer.named_modules():
        if not relative or _dims(module) is None or relative.rsplit(".", 1)[-1] in ("base_layer", "default"):
            continue
        if ".lora_" in f".{relative}" or ".base_layer" in relative:
            continue
        for role, names in ROLES:
            if role not in found and _matches(relative, names):
                found[role] = module
                break
    attention = "qkv" in found or all(role in found for role in ("q", "k", "v"))
    mlp = "down" in found and ("up" in found or "gate_up" in found)
    return found if attention and mlp and "o" in found else None


def walk_layer(layer, roles: dict, input_needs_grad: bool, query: int, post_norm: bool, parallel) -> tuple:
    """One layer's (forward, backward) FLOPs per token, its attention's per square, and whether its output needs a
    gradient."""
    modules = dict(layer.named_modules())
    linear, square = _Cost(), _Cost()
    attention_in = input_needs_grad or (not post_norm and _norms_train(modules, ATTENTION_NORMS))
    if "qkv" in roles:
        q = k = v = projection(roles["qkv"], attention_in, linear)
    else:
        q, k, v = (projection(roles[role], attention_in, linear) for role in ("q", "k", "v"))
    square.forward += 4 * query
    square.backward += 2 * query * (v + (q or k) + q + k)
    attended = projection(roles["o"], q or k or v, linear)
    if parallel is not None:
        mlp_in = attention_in if parallel else input_needs_grad or _norms_train(modules, MLP_NORMS)
    else:
        after_attention = input_needs_grad or attended or (post_norm and _norms_train(modules, AFTER_ATTENTION_NORMS))
        mlp_in = after_attention or (not post_norm and _norms_train(modules, MLP_NORMS))
    if "gate_up" in roles:
        activated = projection(roles["gate_up"], mlp_in, linear)
    else:
        activated = any([projection(roles[role], mlp_in, linear) for role in ("gate", "up") if role in roles])
    down = projection(roles["down"], activated, linear)
    if parallel is not None:
        out = input_needs_grad or attended or down
    else:
        out = after_attention or down or (post_norm and _norms_train(modules, AFTER_MLP_NORMS))
    return linear, square, out


def walk(model, config) -> WalkedFlops | None:
    """The FLOPs of `model` (unwrapped: no DDP or compile wrapper) as it trains, or None where its layers are not
    all of a layout walked here (then trainscope counts them with FlopCounterMode)."""
    decoder = is_decoder_config(config)
    shape = decoder_shape(config) if decoder else encoder_shape(config)  # a decoder's: None outside DECODER_LAYOUTS
    if shape is None:
        return None
    query = shape.query if decoder else shape[1]
    classes = set(transformer_layer_classes(model))
    names = {id(m): n for n, m in model.named_modules()}
    layers = [m for m in model.modules() if type(m).__name__ in classes and "Embedding" not in type(m).__name__]
    if not layers:
        return None
    roles = [_layer_roles(layer) for layer in layers]
    if any(found is None for found in roles):
        return None
    model_type = getattr(config, "model_type", None)
    parallel = PARALLEL.get(model_type)
    if model_type == "gpt_neox" and getattr(config, "use_parallel_residual", True):
        parallel = False
    layer_names = [names[id(layer)] for layer in layers]
    head_modules, head_kind = _head(model, names, layer_names, decoder)
    final_norms = [
        m
        for n, m in model.named_modules()
        if _matches(n, FINAL_NORMS) and not any(n.startswith(f"{layer}.") for layer in layer_names)
    ]
    inside = {id(p) for m in (*layers, *head_modules, *final_norms) for p in m.parameters()}
    embeddings = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    needs = (
        forced_input_grads(model)
        or _trains(getattr(embeddings, "weight", None))  # a tied LM head's weight is the embeddings' too
        or any(_trains(p) for p in model.parameters() if id(p) not in inside)
    )
    linear, square, trained = _Cost(), _Cost(), 0
    for layer, found in zip(layers, roles):
        trained += any(p.requires_grad for p in layer.parameters())
        layer_linear, layer_square, needs = walk_layer(layer, found, needs, query, not decoder, parallel)
        for total, part in ((linear, layer_linear), (square, layer_square)):
            total.forward, total.backward = total.forward + part.forward, total.backward + part.backward
    forward = (linear.forward, square.forward)
    needs = needs or any(_trains(p) for m in final_norms for p in m.parameters())
    head = _Cost()
    for module in head_modules:
        needs = projection(module, needs, head)
    once = head_kind.endswith("per sequence")  # a sequence classifier's head: one position per sequence
    per_token = linear.forward + linear.backward + (0 if once else head.forward + head.backward)
    per_sample = head.forward + head.backward if once else 0
    return WalkedFlops(
        per_token=int(per_token),
        per_square=int(square.forward + square.backward),
        per_sample=int(per_sample),
        forward=forward,
        head=head_kind,
        trained_layers=int(trained),
        layers=len(layers),
    )


def _head(model, names: dict, layer_names: list, decoder: bool) -> tuple[list, str]:
    """The projections after the layers, in the order they run, and what they are: an LM head or a classifier on every
    position (decoders), or a classifier on one position per sequence (encoders' sequence classifiers)."""
    output = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if output is not None and _dims(output) is not None:
        return [output], "an LM head on every position"
    after = [
        m
        for n, m in model.named_modules()
        if n
        and _dims(m) is not None
        and not any(n == layer or n.startswith(f"{layer}.") for layer in layer_names)
        and ".lora_" not in f".{n}"
        and not n.endswith(".base_layer")
        # peft's modules_to_save wraps a head and keeps its original beside the copy that trains: the copy runs
        and ".original_module" not in f".{n}"
        and not isinstance(getattr(m, "modules_to_save", None), torch.nn.ModuleDict)
        and not isinstance(m, torch.nn.Embedding)
    ]
    if not after:
        return [], "no head"
    if decoder:
        return after, "a classifier on every position"
    token_level = type(model).__name__.endswith(("ForTokenClassification", "ForMaskedLM", "ForQuestionAnswering"))
    return after, "a head on every position" if token_level else "a classifier head once per sequence"
