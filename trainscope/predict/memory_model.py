"""The memory model: a run's peak (peak RSS on a CPU, the allocator's max allocated on CUDA) by term -- the process
before the model (measured), parameters, optimizer state, activations kept for backward at the longest batch,
backward's temporaries, DDP's buckets, and on a CPU the allocator's calibrated share -- the saved bytes at another
shape, and the largest batch that fits."""

import torch

from trainscope.core.paths import GIB
from trainscope.predict import calibration, trace
from trainscope.predict.planned import device_memory_bytes
from trainscope.predict.step import model_dims, on_meta, quiet_fake_tensors, traced_length


def peak_memory(planned, traced: trace.Trace, longest: int, notes, calibration: dict | None) -> dict:
    """The peak at the run's longest batch, by term."""
    kinds = traced.memory_at(longest)
    saved_by_module = traced.saved_at(longest)
    saved = sum(saved_by_module.values())
    # DDP keeps its gradient buckets (a flat copy of the gradients) for the whole run, beside the gradients.
    buckets = (
        traced.trainable_bytes if planned.processes > 1 and not planned.settings.ddp_gradient_as_bucket_view else 0
    )
    live = kinds["optimizer"] + kinds["activations"] + kinds["temporary"] + buckets
    # The live peak, split: the optimizer state, what autograd keeps for backward, and the rest of what lives at that
    # moment (gradients as backward makes them, backward's temporaries, the forward's outputs not kept).
    terms = {
        "parameters": traced.parameter_bytes,
        "optimizer": kinds["optimizer"],
        "activations": saved,
        "temporaries": max(0.0, live - buckets - kinds["optimizer"] - saved),
    }
    if buckets:
        terms["ddp_buckets"] = buckets
    on_cpu = planned.device.type == "cpu"
    calibration = calibration if on_cpu else None
    allocator = 0.0
    if on_cpu and calibration:
        allocator = calibration["factor"] * live + calibration["constant_bytes"]
    elif on_cpu:
        notes.append(
            "the allocator's share of a CPU process (freed heap kept, fragmented) is not calibrated on this "
            "machine: left out (python -m trainscope.predict --calibrate, or make predict-calibrate)"
        )
    baseline = planned.rss_bytes if on_cpu and planned.rss_bytes is not None else 0
    terms = {"baseline": baseline, **terms, "allocator": allocator}
    peak_bytes = sum(terms.values())
    capacity = device_memory_bytes(planned.device)
    return {
        "kind": "peak RSS" if on_cpu else "max allocated",
        "peak_gib": peak_bytes / GIB,
        "terms_gib": {k: v / GIB for k, v in terms.items()},
        "live_gib": live / GIB,
        "gradients_gib": traced.trainable_bytes / GIB,
        "activations_by_layer_gib": {k: v / GIB for k, v in saved_by_module.items() if v},
        "saved_by_power": {module: {str(p): b for p, b in powers.items()} for module, powers in traced.saved.items()},
        "traced": {"batch": traced.batch, "length": traced.length},
        "at_length": longest,
        "allocator": {"calibrated": bool(calibration), **(calibration or {})} if on_cpu else None,
        "capacity_gib": capacity / GIB if capacity else None,
        "fits": bool(capacity is None or peak_bytes * max(1, planned.local_processes if on_cpu else 1) <= capacity),
    }


def saved_bytes_at(block: dict, batch: int, length: int) -> float | None:
    """The predicted bytes saved for backward at another (batch, length), from the traced step's bytes by power of
    the length (what grows with the length grows with the batch)."""
    memory = block.get("memory") or {}
    traced = memory.get("traced")
    if not traced or not memory.get("saved_by_power"):
        return None
    total = 0.0
    for powers in memory["saved_by_power"].values():
        for power, size in powers.items():
            power = int(power)
            total += size * (length / traced["length"]) ** power * (batch / traced["batch"] if power else 1.0)
    return total


def largest_batch(
    settings,
    label_names,
    input_names,
    device: torch.device,
    precision_name: str,
    length: int,
    capacity_bytes: int | None = None,
    baseline_bytes: int = 0,
) -> dict:
    """The largest per-device batch whose predicted peak fits in `capacity_bytes` (the device's memory by default)
    at sequences of `length`: what grows with the length grows with the batch (trainscope.predict.trace), the parameters and
    the optimizer state do not; on a CPU with the calibrated allocator's share."""
    from trainscope.workload import modeling  # deferred: it loads transformers' models

    capacity = capacity_bytes if capacity_bytes is not None else device_memory_bytes(device)
    config = modeling.model_config(settings, label_names)
    avoid = model_dims(config, 8, 16, len(label_names))
    traced_at = traced_length(length, 8, avoid | {16 * length}, modeling.config_positions(config))
    build = lambda: on_meta(lambda: modeling.build_architecture(settings, label_names, config=config))  # noqa: E731
    with quiet_fake_tensors():
        traced = trace.trace_training(
            build,
            input_names,
            8,
            traced_at,
            precision_name,
            device,
            settings,
            avoid,
        )
    live = lambda batch: sum(v for k, v in traced.memory_at(length, batch).items() if k != "parameters")  # noqa: E731
    per_sample = (live(16) - live(8)) / 8
    fixed_live = live(8) - 8 * per_sample
    allocator_fit = calibration.read_calibration(device).get("allocator") if device.type == "cpu" else None
    factor = 1 + (allocator_fit["factor"] if allocator_fit else 0.0)
    constant = allocator_fit["constant_bytes"] if allocator_fit else 0.0
    # peak(b) = baseline + parameters + (fixed_live + b x per_sample) x factor + constant
    room = capacity - baseline_bytes - traced.parameter_bytes - constant - fixed_live * factor
    batch = int(room // (per_sample * factor)) if per_sample > 0 and room > 0 else 0
    return {
        "batch": batch,
        "per_sample_bytes": per_sample,
        "fixed_bytes": fixed_live + traced.parameter_bytes,
        "capacity_bytes": capacity,
        "length": length,
    }
