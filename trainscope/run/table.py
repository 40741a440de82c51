"""The end-of-run table a run prints when it ends (complete, or interrupted with a summary): its stages, throughput,
MFU and the share of the measured peak, memory, device time, scores, communication, the prediction's errors, the
profile's top operators and the warnings, each with its fix. Read from the record alone (RunView).
"""

import math

from trainscope.core.record_view import RunView
from trainscope.measure import health, profiling
from trainscope.measure.communication import block as communication_block
from trainscope.measure.timing import STAGES


def table_lines(record: dict, run_dir) -> list[str]:
    """The end-of-run table: stages (median / max over ranks), throughput, MFU, memory, accuracy, warnings."""
    view = RunView(record)
    run = view.timing("run")
    several = view.world_size > 1
    rows = [f"{'stage':<10} {'seconds':>9} {'share':>7}" + ("  (median / max over ranks)" if several else "")]
    for stage in (*STAGES, "other"):
        seconds, share = run["seconds"][stage], run["shares"][stage]
        rows.append(
            f"{stage:<10} {seconds['median']:>9.2f} {share['median']:>7.1%}"
            + (f"  max {seconds['max']:.2f}s" if several else "")
        )
    rows.append(f"{'wall':<10} {run['wall_s']['median']:>9.2f}  (the whole run: warm-up and evaluation included)")
    peak_memory, kind = view.peak_memory
    threads, test = view.threads, view.test
    tokens = view.tokens_per_s
    rows += [
        f"throughput {significant(view.samples_per_s)} samples/s, "
        f"{significant(tokens) + ' tokens/s' if tokens else 'tokens/s n/a (no token counts)'} over "
        f"{throughput_window(view)} ({view.env['world_size']} x {view.device_name}, {view.precision}, timing: "
        f"{view.env['timing_mode']}, {threads['torch_threads']} threads per process ({threads['threads_source']}))",
        f"model FLOPs {flops_rate(view.throughput.get('tflops_per_device'))} per device"
        + (f", MFU {view.mfu:.1%} of the datasheet peak" if view.mfu is not None else "")
        + real_tokens_clause(view),
        peak_line(view),
        f"peak memory {peak_memory:.2f} GiB ({kind})",
        *device_time_lines(view),
    ]
    if test and "accuracy" in test:
        rows.append(f"test accuracy {test['accuracy']:.4f}, macro-F1 {test['macro_f1']:.4f}")
    elif test:  # a loop's own scores (trainscope.Run.finish)
        rows.append(
            "test " + ", ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in test.items())
        )
    rows += [
        *communication_block.table_lines(view.communication),
        *prediction_lines(view.prediction_error),
        *own_cost_lines(view),
        f"record: {run_dir / 'record.json'}",
    ]
    if view.profile:
        rows.append(
            f"profile: {view.profile['directory']} (tensorboard --logdir, or open a .pt.trace.json "
            "in ui.perfetto.dev); top operators by self time:"
        )
        rows += [
            f"  {op['milliseconds']:9.2f} ms  {op['calls']:6d}x  {op['name']}"
            for op in profiling.operator_rows(view.profile["top_operators"][:8])
        ]
    rows += [warning_line(w, view) for w in view.warnings]
    return rows


def significant(value: float | None, digits: int = 3) -> str:
    """A figure with `digits` significant digits (no trailing zeros lost to a fixed format: 0.000123, 7693), 'n/a'
    for none."""
    if value is None:
        return "n/a"
    if value == 0:
        return "0"
    magnitude = math.floor(math.log10(abs(value)))
    if magnitude < -4:
        return f"{value:.{digits - 1}e}"
    return f"{value:,.{max(0, digits - 1 - magnitude)}f}"


def percent(share: float) -> str:
    """A share as a percentage with its significant digits (0.018%, 12.3%)."""
    return f"{significant(share * 100)}%"


def flops_rate(tflops: float | None) -> str:
    """Model FLOP/s in the unit that keeps three significant digits readable: 'n/a' where none were counted."""
    if tflops is None:
        return "n/a (none counted)"
    for unit, scale in (("TFLOP/s", 1.0), ("GFLOP/s", 1e3), ("MFLOP/s", 1e6), ("kFLOP/s", 1e9)):
        if tflops * scale >= 1 or unit == "kFLOP/s":
            return f"{significant(tflops * scale)} {unit}"
    return "n/a"


def throughput_window(view: RunView) -> str:
    """What samples/s covers: the steady steps after the warm-up, evaluation left out."""
    throughput, summary = view.throughput, view.summary
    steps, warmup = throughput.get("optimizer_steps"), summary.get("timing", {}).get("warmup_steps") or 0
    if warmup and steps == summary.get("optimizer_steps"):
        window = f"its {steps} warm-up steps (no steady step)"
    else:
        window = f"{steps} steady steps after {warmup} warm-up" if warmup else f"{steps} steps"
    return f"{window} ({significant(throughput.get('train_wall_s'))} s, evaluation excluded)"


def prediction_lines(errors: dict | None) -> list[str]:
    """The end-of-run table's lines on the prediction's error (train.py's runs: a plain loop's record has none)."""
    if not errors:
        return []

    def pct(entry):
        return f"{entry['error']:+.0%}" if entry and entry.get("error") is not None else "n/a"

    memory, step, run = errors.get("peak_memory_gib"), errors.get("step_s"), errors.get("run_s")
    parts = []
    if memory:
        parts.append(
            f"peak memory {memory['predicted']:.2f} GiB predicted, {memory['measured']:.2f} measured ({pct(memory)})"
        )
    if step:
        parts.append(f"steady step {step['predicted']:.3f} s, {step['measured']:.3f} ({pct(step)})")
    if run:
        parts.append(f"run {run['predicted']:.1f} s, {run['measured']:.1f} ({pct(run)})")
    state = errors.get("calibration")
    said = (
        f" ({state}: {'calibrated now, on first use' if state == 'first use' else 'fitted terms left out'})"
        if state and state != "calibrated"
        else ""
    )
    lines = ["prediction: " + "; ".join(parts) + said] if parts else []
    above, residual = errors.get("peak_above_baseline_gib"), errors.get("memory_residual")
    if above:
        lines.append(
            f"  peak above the memory before the model {above['predicted']:.2f} GiB predicted, "
            f"{above['measured']:.2f} measured ({pct(above)})"
            + (
                f"; residual (the peak less the measured terms) {residual['predicted']:.2f} GiB predicted, "
                f"{residual['measured']:.2f} left"
                if residual
                else ""
            )
        )
    furthest = errors.get("furthest")
    if furthest:
        lines.append(
            f"  furthest off: {furthest['term']} ({pct(furthest)} of itself, "
            f"{furthest['share_of_total']:.0%} of its total)"
        )
    return lines


def own_cost_lines(view: RunView) -> list[str]:
    """What trainscope's own work cost the run, against its budget (max(1 s, 2% of the run) on a warm cache)."""
    cost = view.own_cost
    if not cost:
        return []
    over = cost["total_s"] > cost["budget_s"]
    return [
        f"trainscope's own work {significant(cost['total_s'], 2)} s ({percent(cost['total_s'] / cost['run_s'])} of the "
        f"run's {significant(cost['run_s'])} s): start-up {significant(cost['start_s'], 2)} s, after the loop "
        f"{significant(cost['after_loop_s'], 2)} s, writing {significant(cost['writing_s'], 2)} s"
        + (
            f" -- above its budget of {cost['budget_s']:.1f} s (max(1 s, 2% of the run)): caches filled now, for the "
            f"next run, or the model timed alone ({view.option('time_model')})"
            if over
            else ""
        )
    ]


def warning_line(warning: dict, view: RunView | None = None) -> str:
    """'warning [code]: what is doubtful (what to do: its fix)': each warning with what a person can do about it,
    in the terms of whoever ran it (train.py's flags, or one's own loop)."""
    entry = health.REGISTRY.get(warning["code"])
    fix = entry.fix_in(view or RunView({})) if entry else None
    return f"warning [{warning['code']}]: {warning['message']}" + (f" (what to do: {fix})" if fix else "")


def real_tokens_clause(view: RunView) -> str:
    """'; on real tokens 0.036 TFLOP/s (44% of the counted FLOPs padding)' ('' where not recorded)."""
    real, padding = view.real_tflops_per_device, view.padding_flops_share
    if real is None:
        return ""
    return f"; on real tokens {flops_rate(real)}" + (
        f" ({padding:.0%} of the counted FLOPs padding)" if padding is not None else ""
    )


def peak_line(view: RunView) -> str:
    """'X% of this machine's measured <precision> matmul peak (Y TFLOP/s, measured <when>, key ...)'."""
    measured = view.measured_peak
    if not measured or measured.get("share") is None:
        why = (view.machine_peak or {}).get("error") or f"no {view.precision} peak measured"
        return f"share of this machine's measured matmul peak unknown ({why})"
    key = (view.machine_peak or {}).get("key") or {}
    where = ", ".join(f"{k} {key[k]}" for k in ("threads", "processes", "driver") if key.get(k) is not None)
    real = f", {percent(measured['real_share'])} on real tokens" if measured.get("real_share") is not None else ""
    return (
        f"{percent(measured['share'])} of this machine's measured {measured['precision']} matmul peak{real} "
        f"({flops_rate(measured['peak_tflops'])} at {'x'.join(map(str, measured['peak_shape']))}, spread "
        f"{measured['spread']:.0%}, measured {measured['measured']}, key {measured['key_id']}: {view.device_name}"
        + (f", {where}" if where else "")
        + ")"
    )


def device_time_lines(view: RunView) -> list[str]:
    """On a GPU, one line: the device's busy time against each step's wall time and the idle share that follows
    (trainscope.measure.summary.device_time), "host-bound" above the threshold; why not where it is not measured."""
    block = view.device_time
    if not block or not view.on_cuda:
        return []
    wall, busy = block.get("step_wall_s"), block.get("busy_at_most_s")
    if block.get("over_wall"):
        return [
            f"device busy {busy * 1e3:.1f} ms measured above each step's {wall * 1e3:.1f} ms by more than the "
            f"clocks' tolerance ({block['tolerance_s'] * 1e3:.2f} ms): no idle share (warning device_busy_above_wall)"
        ]
    if block.get("idle_share_at_least") is None:
        return [f"device idle share: {block.get('reason') or 'not measured'}"]
    line = (
        f"device busy at most {busy * 1e3:.1f} ms of each step's {wall * 1e3:.1f} ms (the stages' CUDA event "
        f"spans): idle at least {block['idle_share_at_least']:.1%}"
    )
    estimate = block.get("kernel_estimate")
    if estimate:
        line += (
            f"; by kernel time about {estimate['busy_s'] * 1e3:.1f} ms (estimate): idle about "
            f"{estimate['idle_share']:.0%}"
        )
    if block.get("host_bound"):
        line += f" -- host-bound (idle above {block['threshold']:.0%}, by the {block['host_bound_by']})"
    return [line]
