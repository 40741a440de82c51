"""Model FLOPs, achieved TFLOP/s and MFU: small pure functions with their sources.

Training FLOPs per token follow PaLM (Chowdhery et al. 2022, Appendix B):

    6 * N  +  12 * L * H * Q * T

N = weights of the matrix multiplications (embeddings are lookups, not FLOPs, and are left out),
L = layers, H * Q = hidden size (heads x head dimension), T = sequence length. 6N is 2N for the
forward pass and 4N for the backward pass; the second term is the attention scores and the
weighted sum (QK^T and AV), 2 x 2 x T x d per token and layer forward, tripled for training.
For a transformer encoder layer, N per layer = 4 d^2 (Q, K, V, output) + 2 d d_ff (feed-forward).
T is the padded length the kernels really process. With LoRA the frozen weights need no weight
gradients, so 6N is an upper bound there.

MFU = achieved FLOP/s / the device's dense peak for the precision in effect (peak table below,
vendor datasheets, dense, no sparsity). An unknown device has no MFU rather than a guessed one.
"""

# Dense peak TFLOP/s by device-name substring, most specific first. Datasheet values (NVIDIA
# H100/H200/A100/L4/A10 datasheets; V100 has no TF32 or bf16 units).
PEAK_TFLOPS = [
    ("H100 PCIe", {"fp32": 51.0, "tf32": 378.0, "bf16": 756.0, "fp16": 756.0}),
    ("H100 NVL", {"fp32": 60.0, "tf32": 418.0, "bf16": 835.0, "fp16": 835.0}),
    ("H100", {"fp32": 67.0, "tf32": 495.0, "bf16": 989.0, "fp16": 989.0}),  # SXM5
    ("H200", {"fp32": 67.0, "tf32": 495.0, "bf16": 989.0, "fp16": 989.0}),
    ("A100", {"fp32": 19.5, "tf32": 156.0, "bf16": 312.0, "fp16": 312.0}),
    ("L4", {"fp32": 30.3, "tf32": 60.0, "bf16": 121.0, "fp16": 121.0}),
    ("A10", {"fp32": 31.2, "tf32": 62.5, "bf16": 125.0, "fp16": 125.0}),
    ("V100", {"fp32": 15.7, "fp16": 125.0}),
]


def matmul_parameters(layers: int, hidden: int, intermediate: int) -> int:
    """Weights of an encoder stack's matrix multiplications (no embeddings, no biases)."""
    return layers * (4 * hidden * hidden + 2 * hidden * intermediate)


def training_flops_per_token(layers: int, hidden: int, intermediate: int, sequence_length: int) -> int:
    """PaLM Appendix B: 6N + 12 L H Q T, for one token of a sequence of `sequence_length`."""
    return 6 * matmul_parameters(layers, hidden, intermediate) + 12 * layers * hidden * sequence_length


def encoder_shape(config) -> tuple[int, int, int] | None:
    """(layers, hidden, intermediate) of a BERT-like config, or None when it is not one."""
    layers = getattr(config, "num_hidden_layers", None) or getattr(config, "n_layers", None)
    hidden = getattr(config, "hidden_size", None) or getattr(config, "dim", None)
    intermediate = getattr(config, "intermediate_size", None) or getattr(config, "hidden_dim", None)
    if not (layers and hidden and intermediate):
        return None
    return int(layers), int(hidden), int(intermediate)


def training_flops(config, batch_size: int, sequence_length: int) -> int | None:
    """FLOPs of one training micro-batch of `batch_size` sequences padded to `sequence_length`."""
    shape = encoder_shape(config)
    if shape is None:
        return None
    return batch_size * sequence_length * training_flops_per_token(*shape, sequence_length)


def peak_tflops(device_name: str, precision: str) -> float | None:
    """Dense peak TFLOP/s of `device_name` in `precision` ('fp32', 'tf32', 'bf16', 'fp16'); None if unknown."""
    for fragment, peaks in PEAK_TFLOPS:
        if fragment.lower() in device_name.lower():
            return peaks.get(precision)
    return None


def mfu(achieved_tflops: float | None, device_name: str, precision: str) -> float | None:
    peak = peak_tflops(device_name, precision)
    if peak is None or achieved_tflops is None:
        return None
    return achieved_tflops / peak
