"""What the predictor prints: the one screen of `train.py --predict` and what a prediction rests on (the end-of-run
table's lines on the prediction's error are trainscope.run.table's, from the record alone)."""

from trainscope.core.errors import UserError
from trainscope.core.paths import GIB


def screen_lines(block: dict, settings, wall_s: float | None = None) -> list[str]:
    """The one screen `train.py --predict` prints."""
    if block.get("error"):
        return [f"no prediction: {block['error']}"]
    machine, batches, memory, timing = block["machine"], block["batches"], block["memory"], block["time"]
    gib = memory["terms_gib"]
    lines = [
        f"prediction: {settings.model} on {settings.dataset}, batch {batches['batch']} x {machine['processes']} "
        f"process(es), {machine['precision']}, {machine['device_name']} ({machine['threads']} threads per process)",
        f"batches     {batches['micro_batches']} micro-batches per process: padded length {batches['mean_length']:.1f} "
        f"on average (real {batches['mean_real_length']:.1f}), longest {batches['longest']}; evaluation at batch "
        f"{batches['eval_batch']}: {sum(batches['eval_batches'].values())} batches",
        f"memory      {memory['kind']} {memory['peak_gib']:.2f} GiB per process -- "
        + ("fits" if memory["fits"] else "DOES NOT FIT")
        + (f" in {memory['capacity_gib']:.1f} GiB" if memory.get("capacity_gib") else ""),
    ]
    allocator = memory.get("allocator") or {}
    names = [
        ("baseline", "framework and data now (measured)"),
        ("parameters", "parameters"),
        ("optimizer", "optimizer state (AdamW)"),
        ("activations", f"activations kept for backward (length {memory['at_length']})"),
        ("temporaries", f"gradients ({memory['gradients_gib']:.3f} in all), backward's temporaries"),
        ("ddp_buckets", "DDP's gradient buckets"),
        (
            "allocator",
            f"allocator ({allocator['factor']:.2f} x live + {allocator['constant_bytes'] / GIB:.2f})"
            if allocator.get("calibrated")
            else "allocator (not calibrated)",
        ),
    ]
    lines += [
        f"  {label:<56} {gib[key]:7.3f} GiB" for key, label in names if key in gib and (key != "allocator" or allocator)
    ]
    layers = {k: v for k, v in (memory.get("activations_by_layer_gib") or {}).items() if v * 1024 >= 0.5}
    if layers:
        lines.append("  activations by layer: " + ", ".join(f"{k} {v * 1024:.0f} MiB" for k, v in layers.items()))
    stages = timing["stages_s"]
    kinds = timing["kinds_s"]
    step = timing["step_s"]
    lines += [
        f"time        steady step {step:.3f} s: "
        + ", ".join(f"{k} {v:.3f}" for k, v in stages.items() if v)
        + f"; matmuls {kinds.get('matmul', 0) / step:.0%} (at the measured peak), other operators "
        f"{kinds.get('operator', 0) / step:.0%}, framework {kinds.get('framework', 0) / step:.0%}"
        if step
        else "",
        f"            run: {batches['micro_batches'] // max(1, batches['accumulation'])} steps "
        f"({batches['warmup_steps']} warm-up, first {timing['first_step_s'] or 0:.2f} s), evaluation "
        f"{timing['evaluation_s']:.1f} s -> {timing['run_s']:.1f} s ({timing['run_s'] / 60:.1f} min)",
    ]
    lines += source_lines(block)
    lines += [f"note: {note}" for note in block.get("notes", [])]
    lines.append(
        f"predicted in {wall_s if wall_s is not None else block['seconds']:.1f} s "
        f"({machine['timed_now']} costs timed now, cached in {machine['cost_cache']}); nothing trained, "
        "no run record written"
    )
    return [line for line in lines if line]


def source_lines(block: dict) -> list[str]:
    """What the prediction rests on, its calibration, and a warning for each fit held at a bound."""
    found = block.get("sources")
    state = block.get("calibration") or {}
    if not found:
        return []
    peak, step = found["peak_share"], found["step_share"]
    pct = lambda share: f"{share:.0%}" if share is not None else "-"  # noqa: E731
    lines = [
        f"rests on    peak: {pct(peak['derived'])} derived, {pct(peak['fitted'])} fitted, {pct(peak['measured'])} "
        f"measured in this run; step: {pct(step['derived'])} derived, {pct(step['fitted'])} fitted, "
        f"{pct(step['measured'])} measured"
    ]
    if state.get("state") == "uncalibrated":
        why = f" ({state['error']})" if state.get("error") else ""
        lines.append(
            f"UNCALIBRATED: this machine has no calibration{why}: the allocator's share and the framework's "
            "time are left out, so memory and time are predicted low (make predict-calibrate)"
        )
    elif state.get("state") == "first use":
        lines.append(
            f"calibrated now (first use on this machine, {state.get('seconds') or 0:.0f} s, cached: "
            f"{state.get('path')})"
        )
    lines += [
        f"warning: the calibration's {bound}: the fitted term does not fit this machine"
        for bound in state.get("at_bound") or []
    ]
    return lines


def show(block: dict, settings, started) -> dict:
    """--predict: the screen, on the main process only; nothing else happens. A prediction that could not be made
    is the command's one error line."""

    if block.get("error"):
        raise UserError(f"no prediction: {block['error']}")
    if started.state.is_main_process:
        print("\n".join(screen_lines(block, settings)), flush=True)
    return {"prediction": block}
