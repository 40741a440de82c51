"""Model FLOPs, achieved TFLOP/s and MFU: small pure functions with their sources.

How it works: docs/peak.md#in-the-code-model-flops-from-the-formula-to-mfu-trainscopemeasureflopspy.
"""

import dataclasses

from trainscope.measure.shapes import decoder_shape, encoder_shape

# Dense peak TFLOP/s per precision (no 2:4 sparsity; fp16/bf16: tensor cores with fp32 accumulate). Keys are tokens
# of the normalized device name (`device_tokens`); the entry with the most matching tokens wins. Where each entry's
# figures come from and were checked: docs/peak.md#the-datasheet-peak-table.
PEAK_TFLOPS = {
    ("h100",): {"fp32": 67.0, "tf32": 494.5, "bf16": 989.5, "fp16": 989.5},  # SXM5 ("H100 80GB HBM3")
    ("h100", "pcie"): {"fp32": 51.0, "tf32": 378.0, "bf16": 756.5, "fp16": 756.5},
    ("h100", "nvl"): {"fp32": 60.0, "tf32": 417.5, "bf16": 835.5, "fp16": 835.5},
    ("h200",): {"fp32": 67.0, "tf32": 494.5, "bf16": 989.5, "fp16": 989.5},
    ("h200", "nvl"): {"fp32": 60.0, "tf32": 417.5, "bf16": 835.5, "fp16": 835.5},
    ("a100",): {"fp32": 19.5, "tf32": 156.0, "bf16": 312.0, "fp16": 312.0},  # SXM4 and PCIe, 40 and 80 GB
    ("l4",): {"fp32": 30.3, "tf32": 60.0, "bf16": 121.0, "fp16": 121.0},
    ("l40",): {"fp32": 90.5, "tf32": 90.5, "bf16": 181.05, "fp16": 181.05},
    ("l40s",): {"fp32": 91.6, "tf32": 183.0, "bf16": 362.05, "fp16": 362.05},
    ("a10",): {"fp32": 31.2, "tf32": 62.5, "bf16": 125.0, "fp16": 125.0},
    ("b200",): {"fp32": 75.0, "tf32": 1125.0, "bf16": 2250.0, "fp16": 2250.0},  # HGX B200, per GPU
    ("rtx", "4090"): {"fp32": 82.6, "tf32": 82.6, "bf16": 165.2, "fp16": 165.2},
    ("v100", "sxm2"): {"fp32": 15.7, "fp16": 125.0},  # no tf32 or bf16 units
    ("v100", "pcie"): {"fp32": 14.0, "fp16": 112.0},
}
_VENDOR_WORDS = {"nvidia", "geforce", "tesla", "quadro"}
# Words of a device name that make it another part than the full card a key names; a key matches such a name
# only when it has the word itself (an entry for that exact part, with its source). None is known here, so
# these parts have no peak and no MFU, and the record says why (`variant_reason`).
_MIG = (
    "a MIG slice has a fraction of the GPU's SMs (a 1g slice is one of its 7 compute slices), so the full GPU's peak "
    "would understate its MFU up to 7x"
)
_LAPTOP = "a laptop part runs at lower clocks and power than the desktop card of the same name"
VARIANT_WORDS = {
    "mig": _MIG,
    "laptop": _LAPTOP,
    "mobile": _LAPTOP,
    "d": "a D variant has fewer SMs than the card of the same number (RTX 4090 D: 114 of 128)",
}


def device_tokens(device_name: str) -> tuple[str, ...]:
    """'NVIDIA A100-SXM4-80GB' -> ('a100', 'sxm4', '80gb'): lower case, dashes split, vendor words dropped."""
    words = device_name.lower().replace("-", " ").replace("_", " ").split()
    return tuple(w for w in words if w not in _VENDOR_WORDS)


def peak_entry(device_name: str) -> tuple | None:
    """The table key for a device: every token of the key is a token of the name, and every variant word of
    the name (MIG, laptop, D) is one of the key's; most tokens wins."""
    tokens = set(device_tokens(device_name))
    variants = tokens & set(VARIANT_WORDS)
    matches = [key for key in PEAK_TFLOPS if set(key) <= tokens and variants <= set(key)]
    return max(matches, key=len) if matches else None


def variant_reason(device_name: str) -> str | None:
    """Why a MIG slice, laptop part or D variant has no peak here (None for any other name)."""
    if peak_entry(device_name) is not None:
        return None
    words = [word for word in device_tokens(device_name) if word in VARIANT_WORDS]
    return VARIANT_WORDS[words[0]] if words else None


def matmul_parameters(layers: int, hidden: int, intermediate: int) -> int:
    """Weights of an encoder stack's matrix multiplications (no embeddings, no biases)."""
    return layers * (4 * hidden * hidden + 2 * hidden * intermediate)


def training_flops_per_token(layers: int, hidden: int, intermediate: int, sequence_length: int) -> int:
    """PaLM Appendix B: 6N + 12 L H Q T, for one token of a sequence of `sequence_length`."""
    return 6 * matmul_parameters(layers, hidden, intermediate) + 12 * layers * hidden * sequence_length


@dataclasses.dataclass(frozen=True)
class Training:
    """What one training step computes gradients for, beyond the forward (read from a model by `training_of`)."""

    trained_share: float = 1.0  # of the encoder's matmul weights N, the share with gradients (LoRA: 0)
    adapter_weights: int = 0  # LoRA adapters' weights in the encoder layers (all trained)
    input_gradient: bool = True  # the first layer's input needs a gradient (the embeddings train)
    recomputed: bool = False  # activation checkpointing: each layer's forward runs again in backward
    # where the first layer's input needs no gradient: which of its query, key and value projections has a weight,
    # bias or adapter that trains (their outputs need a gradient all the same), and its adapters' weights on them
    first_layer_trains: tuple[bool, bool, bool] = (True, True, True)
    first_layer_adapters: int = 0


FULL = Training()


def flops_coefficients(layers: int, hidden: int, intermediate: int, training: Training = FULL) -> dict:
    """FLOPs of one training micro-batch as a x (batch x length) + b x (batch x length^2), for the model FLOPs
    ("model": (a, b)) and for the recomputation of activation checkpointing ("recomputed": (a, b), zeros without
    it): docs/peak.md's formula, linear in the positions and their squares."""
    n, adapters = matmul_parameters(layers, hidden, intermediate), training.adapter_weights
    attention = layers * hidden
    forward = (2 * (n + adapters), 4 * attention)
    skipped = (0, 0) if training.input_gradient else first_layer_skipped(hidden, training)
    input_gradients = (2 * (n + adapters) - skipped[0], 8 * attention - skipped[1])
    weight_gradients = (2 * (training.trained_share * n + adapters), 0)
    model = tuple(f + i + w for f, i, w in zip(forward, input_gradients, weight_gradients))
    return {"model": model, "recomputed": forward if training.recomputed else (0, 0)}


def first_layer_skipped(hidden: int, training: Training) -> tuple[int, int]:
    """The backward matmuls autograd skips where the first layer's input needs no gradient, as (a, b) per token and
    per token x length (which ones: docs/peak.md#in-the-code-model-flops-from-the-formula-to-mfu-trainscopemeasureflopspy)."""
    query, key, value = training.first_layer_trains
    executed = value + (query or key) + query + key
    return 6 * hidden * hidden + 2 * training.first_layer_adapters, 2 * hidden * (4 - executed)


# The names of the query, key and value projections in a layer (BERT and RoBERTa, DistilBERT, most others).
PROJECTIONS = ({"query", "q_lin", "q_proj"}, {"key", "k_lin", "k_proj"}, {"value", "v_lin", "v_proj"})


def first_layer_projections(model, classes: set) -> tuple[bool, bool, bool, int]:
    """Whether the first encoder layer's query, key and value projections have a parameter that trains, and the
    weights of LoRA's A on them (their input is the layer's); (True, True, True, 0) where they are not found."""
    first = next((m for m in model.modules() if type(m).__name__ in classes), None)
    found = [
        [m for name, m in (first.named_modules() if first else ()) if name.rsplit(".", 1)[-1] in names]
        for names in PROJECTIONS
    ]
    if not all(len(modules) == 1 for modules in found):
        return True, True, True, 0
    modules = [modules[0] for modules in found]
    trains = [any(p.requires_grad for p in module.parameters()) for module in modules]
    adapters = sum(
        p.numel() for module in modules for name, p in module.named_parameters() if "lora_A" in name and p.requires_grad
    )
    return *trains, int(adapters)


def training_of(model, checkpointing: bool) -> Training:
    """What `model` (unwrapped: no DDP or compile wrapper) trains: the share of its encoder layers' matmul weights
    (their 2-D weights, adapters apart) with gradients, LoRA's adapter weights there (peft names them lora_A and
    lora_B), whether its input embeddings train; `checkpointing` as --gradient-checkpointing."""
    from trainscope.measure.layers import forced_input_grads, transformer_layer_classes  # flops imports no torch

    classes = set(transformer_layer_classes(model))
    seen = trained = adapters = 0
    for module in model.modules():
        if type(module).__name__ not in classes:
            continue
        for name, parameter in module.named_parameters():
            if "lora_" in name:
                adapters += parameter.numel() if parameter.requires_grad else 0
            elif parameter.dim() == 2:
                seen += parameter.numel()
                trained += parameter.numel() if parameter.requires_grad else 0
    embeddings = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    weight = getattr(embeddings, "weight", None)
    forced = forced_input_grads(model)  # the first layer's input gradients computed although nothing uses them
    *first_trains, first_adapters = first_layer_projections(model, classes)
    return Training(
        trained_share=trained / seen if seen else 1.0,
        adapter_weights=int(adapters),
        input_gradient=bool(weight is None or weight.requires_grad or forced),
        recomputed=bool(checkpointing),
        first_layer_trains=tuple(first_trains),
        first_layer_adapters=first_adapters,
    )


def causal_lm_flops_coefficients(config) -> tuple[int, int] | None:
    """(a, b) with the model FLOPs of one full fine-tuning micro-batch = a x batch x length + b x batch x length^2,
    summable over batches of other lengths (a x padded tokens + b x padded squares); None for no `decoder_shape`.

    a = 6 N: N the matmul weights of the layers and the LM head (hidden x vocab on every position), each 2 FLOPs
    forward and 4 backward (input and weight gradients: everything trains). b = 12 L Q: attention's scores QK^T and
    weighted sum AV, 2 x 2 x Q x T per token and layer forward, tripled for training, Q the query width (heads x head
    dimension; grouped-query attention's keys and values are repeated to every query head). The full T x T square,
    as FlopCounterMode counts eager and SDPA attention: no halving for the causal mask. Left out (not matmuls):
    embedding lookups, norms, activations, rotary embeddings, softmax, the loss; and any recomputation."""
    shape = decoder_shape(config)
    if shape is None:
        return None
    return 6 * shape.matmul_weights(), 12 * shape.layers * shape.query


def causal_lm_training_flops(config, batch_size: int, sequence_length: int) -> int | None:
    """Model FLOPs of one training micro-batch (forward and backward, every weight trained) of a decoder-only causal
    LM, `batch_size` sequences padded to `sequence_length` (`causal_lm_flops_coefficients`); None when the config is
    not a decoder modelled here."""
    coefficients = causal_lm_flops_coefficients(config)
    if coefficients is None:
        return None
    a, b = coefficients
    return int(a * batch_size * sequence_length + b * batch_size * sequence_length**2)


def training_flops(config, batch_size: int, sequence_length: int, training: Training = FULL) -> int | None:
    """Model FLOPs of one training micro-batch of `batch_size` sequences padded to `sequence_length` (what trains:
    `training`; recomputation left out, `recomputed_flops`)."""
    shape = encoder_shape(config)
    if shape is None:
        return None
    a, b = flops_coefficients(*shape, training)["model"]
    return int(round(a * batch_size * sequence_length + b * batch_size * sequence_length**2))


def recomputed_flops(config, padded_tokens: int, padded_squares: int, training: Training) -> int | None:
    """FLOPs activation checkpointing recomputes over micro-batches of `padded_tokens` positions in all (sum of batch
    x padded length) and `padded_squares` (sum of batch x padded length squared); 0 without checkpointing."""
    shape = encoder_shape(config)
    if shape is None:
        return None
    a, b = flops_coefficients(*shape, training)["recomputed"]
    return int(round(a * (padded_tokens or 0) + b * (padded_squares or 0)))


def peak_tflops(device_name: str, precision: str) -> float | None:
    """Dense peak TFLOP/s of `device_name` in `precision` ('fp32', 'tf32', 'bf16', 'fp16'); None if unknown."""
    key = peak_entry(device_name)
    return PEAK_TFLOPS[key].get(precision) if key else None


def mfu(achieved_tflops: float | None, device_name: str, precision: str) -> float | None:
    peak = peak_tflops(device_name, precision)
    if peak is None or achieved_tflops is None:
        return None
    return achieved_tflops / peak


def padding_flops_share(
    shape: dict | None,
    tokens: int | None,
    padded_tokens: int | None,
    samples: int | None,
    padded_squares: int | None,
    training: bool = True,
) -> float | None:
    """At most this share of the model FLOPs went to padding positions (None when it cannot be told).

    Padded FLOPs, exactly: a N P + b L d Q, with P the positions processed (sum of batch x padded length)
    and Q the sum of batch x padded length squared (the attention term), a = 6, b = 12 for training and
    a = 2, b = 4 for a forward pass (PaLM Appendix B). Real FLOPs are at least a N R + b L d R^2 / n for R
    real tokens in n sequences: by Jensen, the sum of squared lengths is at least R^2 / n. So padding took
    at most 1 - real / padded of the FLOPs: an upper bound that removing every padding position could save.
    """
    if not (shape and tokens and padded_tokens and samples and padded_squares):
        return None
    a, b = (6, 12) if training else (2, 4)
    n = matmul_parameters(shape["layers"], shape["hidden"], shape["intermediate"])
    attention = shape["layers"] * shape["hidden"]
    padded = a * n * padded_tokens + b * attention * padded_squares
    real_at_least = a * n * tokens + b * attention * tokens**2 / samples
    return max(0.0, 1.0 - real_at_least / padded)


def real_training_flops(
    shape: tuple[int, int, int] | None, tokens: int | None, squares: int | None, training: Training = FULL
) -> int | None:
    """Training FLOPs on real tokens only (no padding position counted): the coefficients of `flops_coefficients`
    (what trains: `training`) on the real tokens and on the sum of each sequence's real length squared (`squares`).
    `shape`: (layers, hidden, intermediate) (encoder_shape). None when unknown."""
    if shape is None or tokens is None or squares is None:
        return None
    a, b = flops_coefficients(*shape, training)["model"]
    return int(round(a * tokens + b * squares))


def padding_free_training_flops(
    config, batch_size: int, sequence_length: int, tokens: int, training: Training = FULL
) -> int | None:
    """FLOPs of one training micro-batch with padding-free encoder layers (--unpad, trainscope.workload.unpad): the token-wise
    matmuls on the `tokens` real tokens, attention's on the padded layout (batch x length^2) where it still runs;
    what trains: `training`."""
    shape = encoder_shape(config)
    if shape is None:
        return None
    a, b = flops_coefficients(*shape, training)["model"]
    return int(round(a * tokens + b * batch_size * sequence_length**2))
