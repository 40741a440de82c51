"""What trainscope measures after the loop, every rank at once, in its own cost (the record's instrument.cost_s):
this machine's matmul peak and rates at the run's own mean micro-batch, one layer probed at those shapes (train.py's
classifier), the model timed alone in each precision and thread count (on request: `time_model`); and the run
against that peak (the record's summary.measured_peak). How it works: docs/peak.md."""

import torch

from trainscope.core import precision
from trainscope.measure import gap, operations, peak, summary
from trainscope.measure.flops import encoder_shape
from trainscope.measure.memory import peak_rss_bytes


def run_shapes(metrics) -> dict | None:
    """The matmul rate at the run's own GEMM shapes (its batch x mean padded length) and at twice the tokens, and one
    encoder layer profiled apart at those shapes: from the machine's cache, measured now on a miss; and the model
    timed alone (`operations`, `model_alone`). None when nothing was measurable."""
    shape, counts = encoder_shape(metrics.model_config), metrics.loop.counts["steady"]
    if not counts["samples"]:
        counts = metrics.loop.counts["warmup"]
    machine_peak(metrics, counts)
    precision_name = metrics.env.get("effective_precision") or "fp32"
    device, processes = metrics.accelerator.device, metrics.started.threads["local_processes"]
    layers = model_alone(metrics, precision_name)
    sized = mean_shape(counts, metrics.driver.unpadded)
    if not shape or not sized or precision_name not in peak.precisions(device):
        return {"operations": layers} if layers else None
    batch, length = sized
    shapes, doubled = (peak.transformer_shapes(*shape, tokens) for tokens in (batch * length, 2 * batch * length))
    store = metrics.accelerator.is_local_main_process
    probe = metrics.driver.layer_breakdown(metrics, batch, length, precision_name)
    try:
        found = peak.rates(device, precision_name, shapes + doubled, processes=processes, store=store)
        layer = peak.cached(device, probe[0], probe[1], processes=processes, store=store) if probe else None
    except (RuntimeError, torch.OutOfMemoryError):
        return {"operations": layers} if layers else None
    rate = {
        f"{name}{suffix}": peak.matmul_rate(found, group, peak.TRANSFORMER_WEIGHTS, which)
        for name, group in (("tflops", shapes), ("tflops_doubled", doubled))
        for suffix, which in (("", "tflops"), ("_low", "low"), ("_high", "high"))
    }
    sized = {"batch": batch, "length": length, "tokens": batch * length, "layers": shape[0]}
    return {**sized, **rate, "layer": layer, "operations": layers}


def model_alone(metrics, precision_name: str) -> dict | None:
    """The model timed alone on the warm-up's last micro-batch (trainscope.measure.operations), every rank at once,
    scaled to the steady phase's mean micro-batch (positions where the batches have them, else samples); {reason}
    where nothing was kept."""
    metrics.operations.close()
    metrics.loop_peak_rss = peak_rss_bytes()  # the run's own: timing the model alone may raise the process's peak
    if metrics.operations.inputs is None:
        return {"reason": metrics.operations.reason}
    steady, warmup = metrics.loop.counts["steady"], metrics.loop.counts["warmup"]
    counts = steady if steady["optimizer_steps"] else warmup
    key = "padded_tokens" if counts.get("padded_tokens") else "samples"
    mean = counts[key] / counts["micro_batches"] if counts["micro_batches"] else None
    kept = operations.positions(metrics.operations.inputs)
    threads, scale = metrics.started.threads, mean / kept if mean and kept else 1.0
    model, device = metrics.accelerator.unwrap_model(metrics.model), metrics.accelerator.device
    try:
        inputs, budget = metrics.operations.inputs, threads.get("thread_budget")
        block = operations.measure(model, inputs, device, precision_name, threads["torch_threads"], budget, scale)
    except (RuntimeError, ValueError, TypeError) as error:  # a model that will not run alone: said, not fatal
        return {"reason": f"the model could not be timed alone: {' '.join(str(error).split())[:200]}"}
    finally:
        metrics.operations.inputs = None  # the batch kept for this is let go
    return {
        **block,
        "basis": "the model's own forward and backward on the warm-up's last training micro-batch "
        f"({kept} {'positions' if key == 'padded_tokens' else 'samples'}), timed alone after the loop; seconds "
        f"scaled to the steady phase's mean micro-batch ({mean:.4g})"
        if mean
        else "the model's own forward and backward on the warm-up's last training micro-batch",
        "precision": precision_name,
        "threads": threads["torch_threads"],
        "micro_batches_per_step": counts["micro_batches"] / counts["optimizer_steps"]
        if counts["optimizer_steps"]
        else None,
    }


def machine_peak(metrics, counts: dict) -> None:
    """This machine's matmul peak (trainscope.measure.peak: cached, or measured now by every local process at once)
    at the model's GEMM shapes for the run's mean micro-batch, and a large square, into the environment block. A
    failed measurement is recorded, not fatal: the run is what it measures."""
    shape, sized = encoder_shape(metrics.model_config), mean_shape(counts, metrics.driver.unpadded)
    shapes = peak.transformer_shapes(*shape, sized[0] * sized[1]) if shape and sized else []
    accelerator, processes = metrics.accelerator, metrics.started.threads["local_processes"]
    together = metrics.any_rank if accelerator.num_processes > 1 else None
    try:
        block = peak.machine_peak(
            accelerator.device, shapes, None, processes, together, accelerator.is_local_main_process
        )
        block["sized_at"] = {"batch": sized[0], "length": sized[1]} if shapes else None
    except (RuntimeError, torch.OutOfMemoryError) as error:
        block = {"error": " ".join(str(error).split())[:300]}
    metrics.env["machine_peak"] = block
    if metrics.accelerator.device.type == "cpu":
        metrics.env["cpu_bf16"] = precision.cpu_bf16(precision.cpu_flags(), block)


def mean_shape(counts: dict, unpadded: bool = False) -> tuple[int, int] | None:
    """A phase's mean micro-batch and mean padded length (the mean real length with --unpad: the matmuls' rows), the
    length up to a multiple of 8 (later runs of similar data hit the cache); None where it trained no sample."""
    if not counts["samples"]:
        return None
    batch = max(1, round(counts["samples"] / max(counts["micro_batches"], 1)))
    return batch, -(-counts["tokens" if unpadded else "padded_tokens"] // counts["samples"] // 8) * 8 or 8


def measured_peak(
    env: dict,
    throughput: dict,
    per_rank: list[dict],
    phase: str,
    run_shapes: dict | None = None,
    model_flops: dict | None = None,
) -> dict | None:
    """The run against its machine's measured matmul peak for the precision in effect: the achieved model TFLOP/s
    per device as a share of that peak (apart from the datasheet MFU), what the hardware executed (`executed_tflops`,
    checkpointing's recomputation included), the gap estimate without a profile (trainscope.measure.gap.estimate)
    and `run_shapes`. None when no peak was measured for that precision."""
    precision_name = env.get("effective_precision") or "fp32"
    found = peak.peak_of(env.get("machine_peak"), precision_name)
    if not found:
        return None
    achieved, real = throughput.get("tflops_per_device"), throughput.get("real_tflops_per_device")
    stages = summary.combine_ranks(per_rank, phase)["seconds"]
    flops = sum(rank["counts"][phase].get("flops") or 0 for rank in per_rank) / len(per_rank)
    return {
        "precision": precision_name,
        **{key: found[key] for key in ("peak_tflops", "peak_shape", "spread", "measured")},
        "key_id": env["machine_peak"].get("key_id"),
        "achieved_tflops": achieved,
        "share": achieved / found["peak_tflops"] if achieved else None,
        "executed_tflops": achieved + (model_flops or {}).get("recomputed_tflops_per_device", 0.0)
        if achieved
        else None,
        "real_tflops": real,
        "real_share": real / found["peak_tflops"] if real else None,
        "gap_estimate": gap.estimate(
            flops,
            found["peak_tflops"],
            {k: v["median"] for k, v in stages.items()},
            throughput.get("train_wall_s"),
            throughput.get("padding_flops_share"),
        ),
        "run_shapes": run_shapes,
    }
