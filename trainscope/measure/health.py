"""Health warnings: conditions under which a run's figures are doubtful. One registry entry per warning, defined
with `@register` (how to add one: docs/design.md); its check is a function of the record's typed view returning the
message or None.

    health.check(record) -> [{code, message}]    # pure, in registry order; what is absent is not checked
"""

import re
from collections.abc import Callable
from dataclasses import dataclass

from trainscope.core.communication_view import exposed_above_transfer
from trainscope.core.record_view import RunView
from trainscope.measure import machine_kinds
from trainscope.measure.flops import peak_tflops, variant_reason
from trainscope.measure.gap import matmul_rate

# Fewer steady steps than this and a steady-state figure rests on too few samples.
MIN_STEADY_STEPS = 10
PREDICTION_GOAL = 0.15  # the steady step's (docs/predict.md): a fit held at a bound is said where the step missed it
# Evaluation above this share of wall time: the run measures evaluation more than training.
EVAL_SHARE_LIMIT = 0.5


@dataclass(frozen=True)
class WarningEntry:
    code: str
    meaning: str
    condition: Callable[[RunView], str | None]
    fix: str | dict  # {"flags": ..., "keywords": ...} where train.py's words and a loop's differ
    flags: tuple[str, ...] = ()  # train.py's flags that make the fix
    at_start: bool = False  # decided by the settings and the environment alone

    def fix_in(self, view: RunView) -> str:
        """The fix in the words of whoever ran the run (RunView.options_as), its options spelled as it writes them."""
        words = self.fix[view.options_as] if isinstance(self.fix, dict) else self.fix
        return re.sub(r"\{(\w+)(?::(\w+))?\}", lambda found: view.option(found[1], found[2]), words)


REGISTRY: dict[str, WarningEntry] = {}


def register(code: str, meaning: str, fix: str | dict, flags: tuple[str, ...] = (), at_start: bool = False):
    def add(condition):
        REGISTRY[code] = WarningEntry(code, meaning, condition, fix, tuple(flags), at_start)
        return condition

    return add


def warning(code: str, message: str) -> dict:
    if code not in REGISTRY:
        raise ValueError(f"unknown warning code {code!r}")
    return {"code": code, "message": " ".join(message.split())}


def check(record: dict, at_start: bool = False) -> list[dict]:
    """Every warning the record's conditions call for (with `at_start`, only those known at start-up)."""
    view = RunView(record)
    found = []
    for entry in REGISTRY.values():
        if at_start and not entry.at_start:
            continue
        message = entry.condition(view)
        if message:
            found.append(warning(entry.code, message))
    return found


def fix_for(code: str) -> WarningEntry | None:
    return REGISTRY.get(code)


# ---------------------------------------------------------------- the warnings, in the order they are listed


def _threads_where(t: dict) -> str:
    return (
        f"{t['torch_threads']} torch threads, budget {t['thread_budget']} ({t['usable_cores']} usable cores / "
        f"{t['local_processes']} processes on this node; source: {t['threads_source']})"
    )


@register(
    "threads_below_budget",
    "fewer torch threads than the cores this process may use",
    "give each process its share of the cores ({threads:auto})",
    ("--threads", "auto"),
    at_start=True,
)
def _threads_below(view: RunView):
    t = view.threads
    if t and t["torch_threads"] < t["thread_budget"]:
        return (
            f"{_threads_where(t)}: the run used less CPU than it could, so its speed understates the machine "
            f"({view.option('threads', 'auto')} sets the budget)"
        )


@register(
    "threads_above_budget",
    "more torch threads than this process's share of the cores (oversubscribed)",
    "stop the processes oversubscribing the cores ({threads:auto})",
    ("--threads", "auto"),
    at_start=True,
)
def _threads_above(view: RunView):
    t = view.threads
    if t and t["torch_threads"] > t["thread_budget"]:
        return f"{_threads_where(t)}: processes compete for cores, so speed varies and understates the machine"


@register(
    "ran_on_cpu",
    "a multi-process GPU config ran on the CPU over gloo (no usable GPU): as DDP, or FSDP2 where asked to",
    "run the config on a machine with GPUs, or use accelerate_configs/ddp.yaml on a CPU",
    at_start=True,
)
def _ran_on_cpu(view: RunView):
    fallback = view.env.get("cpu_fallback")
    if fallback:
        requested = fallback.get("requested_precision", "no")
        ran = (
            "FSDP2 over gloo on the CPU (TRAINSCOPE_FSDP_ON_CPU=1: FSDP's code path, not its speed)"
            if fallback.get("fsdp_on_cpu")
            else "DDP over gloo on the CPU"
        )
        return (
            f"a {fallback['processes']}-process launch ({'FSDP, ' if fallback.get('fsdp_requested') else ''}"
            f"precision {requested}) found no usable GPU: it ran as {ran} "
            f"({view.world_size} processes, {view.precision}); its figures are CPU figures"
        )


@register(
    "profiler_on",
    "the profiler was on while stages were timed",
    "time without {profile} (profile in a separate run)",
    at_start=True,
)
def _profiler(view: RunView):
    if view.setting("profile"):
        return (
            f"{view.option('profile')} traced steps while stages were timed: the traced steps are slower; take stage "
            "shares from a run without it"
        )


@register(
    "memory_snapshot_on",
    "the CUDA allocator history was recorded for a window of steps",
    "take speed figures from a run without {memory_snapshot}",
    at_start=True,
)
def _memory_snapshot(view: RunView):
    if view.setting("memory_snapshot") and view.on_cuda:
        return (
            f"{view.option('memory_snapshot')} recorded the allocator history over a window of steps, which slows them: "
            "those steps are kept out of the steady figures (phase `snapshot`), but compare speed from a run "
            "without it"
        )


@register(
    "bf16_emulated",
    "bf16 on a CPU without native bf16 (AVX512-BF16 / AMX): emulated and slow",
    "compare speed in fp32 on this CPU (bf16 is emulated here); measure bf16 on a GPU or on a CPU with "
    "AVX512-BF16 or AMX",
    at_start=True,
)
def _bf16_emulated(view: RunView):
    if view.precision == "bf16" and view.on_cpu and view.env.get("cpu_native_bf16") is False:
        return (
            f"bf16 autocast on {view.device_name} ({view.env.get('cpu_capability', 'no AVX512-BF16/AMX')}) is "
            "emulated in software: its speed says nothing about bf16 on a GPU or on a CPU with AVX512-BF16 or AMX"
        )


@register(
    "bf16_not_faster",
    "bf16 on a CPU whose bf16 matmuls measured no faster than fp32",
    "train in fp32 on this CPU (no mixed precision in the Accelerate config, as accelerate_configs/cpu.yaml): its "
    "bf16 matmuls are not faster",
    at_start=True,
)
def _bf16_not_faster(view: RunView):
    bf16 = view.cpu_bf16
    native = bf16.get("native_by_flags")
    if view.precision == "bf16" and view.on_cpu and bf16.get("faster") is False and native is not False:
        said = {
            True: f"although its flags list {', '.join(bf16.get('flags') or ['native bf16'])}",
            None: "(its flags could not be read)",
        }[native]
        rates = [(bf16.get(k) or 0) * 1e3 for k in ("bf16_tflops", "fp32_tflops")]
        return (
            f"bf16 matmuls on {view.device_name} {said} measured {bf16['speedup']:.2f}x fp32's at this run's "
            f"threads (bf16 {rates[0]:.0f} against fp32 {rates[1]:.0f} GFLOP/s): bf16 autocast is not buying "
            "speed here"
        )


@register(
    "fp16_unavailable",
    "fp16 was requested but the device ran another precision",
    "use a config whose precision this device runs (fp16 needs CUDA)",
    at_start=True,
)
def _fp16_unavailable(view: RunView):
    effective = view.precision
    if view.requested_precision == "fp16" and effective not in (None, "fp16"):
        return f"fp16 was requested but {view.device or 'the device'} ran {effective}: figures are {effective} figures"


@register(
    "tf32_implicit",
    "TF32 matmuls were in effect without --tf32",
    {
        "flags": "ask for TF32 explicitly, or keep true fp32: an implicit TF32 figure is mislabeled",
        "keywords": "set torch.backends.cuda.matmul.allow_tf32 yourself (True, and call the figures TF32, or False "
        "for true fp32): an implicit TF32 figure is mislabeled",
    },
    ("--tf32",),
    at_start=True,
)
def _tf32(view: RunView):
    if view.tf32_in_effect and not view.setting("tf32"):
        asked = {"flags": "--tf32 was not given", "keywords": "the loop did not ask for it"}[view.options_as]
        return f"TF32 matmuls were in effect although {asked}: an 'fp32' figure is a TF32 figure"


@register(
    "gpu_bf16_emulated",
    "bf16 on a GPU without native bf16 (compute capability below 8.0): emulated and slow",
    "use fp16 on this GPU (mixed_precision fp16 in the Accelerate config, as accelerate_configs/fp16.yaml); "
    "measure bf16 on an Ampere or later GPU",
    at_start=True,
)
def _gpu_bf16_emulated(view: RunView):
    if view.precision == "bf16" and view.on_cuda and view.env.get("gpu_native_bf16") is False:
        return (
            f"bf16 autocast on {view.device_name} (compute capability {view.env.get('gpu_compute_capability', '?')}, "
            "no bf16 tensor cores) is emulated: its speed and memory say nothing about bf16 on an Ampere or later "
            "GPU; fp16 is this GPU's fast precision"
        )


@register(
    "tf32_unsupported",
    "--tf32 on a GPU without TF32 units: the matmuls ran in fp32",
    "drop --tf32 on this GPU (TF32 needs compute capability 8.0, Ampere or later)",
    at_start=True,
)
def _tf32_unsupported(view: RunView):
    if view.setting("tf32") and view.on_cuda and view.env.get("tf32_supported") is False:
        return (
            f"--tf32 was given but {view.device_name} (compute capability "
            f"{view.env.get('gpu_compute_capability', '?')}) has no TF32 units: matmuls ran in fp32, and the "
            "record says fp32"
        )


@register(
    "stage_memory_every_step",
    "per-stage memory statistics read at every step cost time on CUDA",
    "sample per-stage memory every 10 steps ({memory_every:10})",
    ("--memory-every", "10"),
    at_start=True,
)
def _memory_statistics(view: RunView):
    if view.on_cuda and view.setting("memory_every") == 1:
        return (
            f"{view.option('memory_every', 1)} reads the allocator at every stage boundary: a few percent of step "
            "time on fast GPUs"
        )


@register(
    "max_seq_length_clamped",
    "--max-seq-length was above what the model's position embeddings allow",
    "lower --max-seq-length to the model's limit",
    at_start=True,
)
def _sequence_length(view: RunView):
    limit, requested = view.env.get("model_sequence_limit"), view.env.get("requested_max_seq_length")
    if limit is not None and requested is not None and requested > limit:
        return (
            f"--max-seq-length {requested} is above the model's {limit} positions: sequences were truncated to {limit}"
        )


@register(
    "checkpoint_skipped",
    "--resume passed over checkpoints it could not read and continued from an older one",
    "keep the output directory on a disk with room, and let saves finish (a killed or failed save is never used)",
    at_start=True,
)
def _checkpoint_skipped(view: RunView):
    skipped = view.checkpoints_skipped
    if skipped:
        listed = "; ".join(f"{s['checkpoint']} ({s['problem']})" for s in skipped)
        return (
            f"--resume could not use {listed}: it was removed and the run continued from an older checkpoint, "
            "retraining the steps in between"
        )


@register(
    "record_rebuilt",
    "the record of a resumed run was unreadable and began again from the checkpoint",
    "do not edit record.json by hand; keep runs/ on a disk with room",
    at_start=True,
)
def _record_rebuilt(view: RunView):
    if view.record_rebuilt:
        return (
            f"the run's record could not be read ({view.record_rebuilt}): the resumed run wrote a new one, so "
            "it lacks what the earlier record said (its creation time, earlier resumes); the timing continues "
            "from the checkpoint"
        )


@register(
    "non_finite_loss",
    "a loss was NaN or infinite: recorded, and the run went on as its loop did",
    "where the loop's loss scaler skipped those steps, nothing; else lower the learning rate, clip the gradients or "
    "use bf16 instead of fp16",
)
def _non_finite_loss(view: RunView):
    if found := view.summary.get("non_finite_losses"):
        return f"{found['micro_batches']} loss(es) NaN or infinite, the first {found['first']}; the run went on"


@register(
    "tuned_elsewhere",
    "the command was tuned by make tune on a machine of another kind (--tuned-on)",
    "run make tune on this machine: what it kept elsewhere (bf16 where bf16 was native or ran on AMX, threads and "
    "loader workers sized for its cores, a batch that fit) may be slower here",
    at_start=True,
)
def _tuned_elsewhere(view: RunView):
    tuned_on = view.setting("tuned_on")
    if differ := tuned_on and machine_kinds.kind_difference(tuned_on, machine_kinds.machine_kind(view)):
        return (
            f"this command was tuned on {tuned_on}, this run is on {machine_kinds.machine_kind(view)} ({differ}): "
            "the speed-ups make tune measured there need not hold here"
        )


@register(
    "recompiles",
    "torch.compile recompiled during the run",
    "give torch.compile one input shape (pad every batch to one length, or mark the length dynamic)",
    ("--pad-to-max-length",),
)
def _compile(view: RunView):
    recompiles = (view.compile or {}).get("recompiles") or 0
    if recompiles > 0:
        how = {"flags": "--pad-to-max-length", "keywords": "padding every batch to one length"}[view.options_as]
        return (
            f"torch.compile recompiled {recompiles} times (new input shapes): compile time leaked into training "
            f"steps; {how} gives one shape"
        )


@register(
    "eval_dominates",
    "evaluation took most of the wall time",
    {"flags": "evaluate on fewer samples", "keywords": "evaluate on fewer samples, or less often"},
    ("--max-eval-samples", "1000", "--max-test-samples", "1000"),
)
def _evaluation(view: RunView):
    share = view.shares("run").get("eval")
    if share is not None and share > EVAL_SHARE_LIMIT:
        how = {"flags": " (--max-eval-samples, --max-test-samples)", "keywords": ""}[view.options_as]
        return (
            f"evaluation took {share:.0%} of wall time: the time breakdown describes evaluation more than training{how}"
        )


@register(
    "few_steady_steps",
    "too few steady-state steps for a steady-state figure",
    {
        "flags": "run more steps (--max-steps) so the steady phase has enough samples",
        "keywords": "train more optimizer steps (and raise steps= with them) so the steady phase has enough samples",
    },
)
def _steady(view: RunView):
    steps = view.optimizer_steps_timed or 0
    if view.throughput and steps < MIN_STEADY_STEPS:
        return (
            f"only {steps} steady-state optimizer steps (at least {MIN_STEADY_STEPS} wanted): throughput rests on "
            "few samples"
        )


@register(
    "mfu_unknown",
    "no datasheet peak for this GPU: no MFU",
    "add the device's datasheet peak to trainscope/measure/flops.py",
)
def _mfu(view: RunView):
    unknown = view.on_cuda and "mfu" in view.summary and view.mfu is None
    if unknown and peak_tflops(view.device_name, view.precision or "fp32") is None:
        variant = variant_reason(view.device_name)
        return (
            f"{view.device_name} is not in the datasheet peak table (trainscope/measure/flops.py) for {view.precision}"
            f"{f' ({variant})' if variant else ''}: MFU is not computed rather than guessed"
        )


@register(
    "comm_not_resolved",
    "the exposed communication's interval includes 0 or spans more than the time itself",
    "run more steps, on a quieter machine",
)
def _exposed_not_resolved(view: RunView):
    block = view.communication or {}
    interval = block.get("exposed_interval")
    if block.get("measured") and block.get("method") and not block.get("exposed_resolved"):
        where = (
            f"between {max(0.0, interval[0]) * 1e3:.1f} and {interval[1] * 1e3:.1f} ms"
            if interval
            else f"too few steps for a 95% interval ({block.get('steps')})"
        )
        return (
            f"exposed communication not resolved over {block.get('steps')} steady steps: {where} per step; no "
            "share of the step is given"
        )


@register(
    "above_measured_peak",
    "the run's matmuls measured faster than the machine's measured matmul peak",
    "measure the peak again on a quiet machine (delete the trainscope cache folder named in the record)",
)
def _above_measured_peak(view: RunView):
    """The measured peak checked against the FLOP/s the run's matmuls executed (model FLOPs and recomputation) and,
    with --profile, the traced matmuls' rate: either above the peak by more than its spread is impossible."""

    measured = view.measured_peak or {}
    peak, spread = measured.get("peak_tflops"), measured.get("spread") or 0.0
    if not peak:
        return None
    executed = measured.get("executed_tflops", measured.get("achieved_tflops"))  # older records: model FLOPs alone
    readings = [
        ("the run's executed FLOP/s", executed),
        ("the profiled matmuls", matmul_rate(view.gap_breakdown or {})),
    ]
    over = [f"{name} {rate * 1e3:.1f} GFLOP/s" for name, rate in readings if rate and rate > peak * (1 + spread)]
    if over:
        return (
            f"{' and '.join(over)} above this machine's measured {measured['precision']} matmul peak "
            f"{peak * 1e3:.1f} GFLOP/s (+{spread:.0%}, its spread): the peak was measured low (a busy machine?) "
            f"-- shares of it are overstated"
        )


@register(
    "device_busy_above_wall",
    "the training stages' device time (CUDA events) adds up to more than the steps' host wall time, beyond the "
    "clocks' stated tolerance",
    "compare with --timing sync (trainscope.Run: timing='sync') on the same command; a stage whose work runs on another stream than its events, or "
    "a device clock that disagrees with the host's, reads this way",
)
def _device_busy_above_wall(view: RunView):
    """The stages' event spans lie inside the steps' wall time (the wall's edges synchronize the device), so their
    sum above it by more than the tolerance (trainscope.measure.summary.CLOCK_RATE_TOLERANCE) is impossible: no idle share
    is given, and the figures are reported as measured."""
    over = view.device_time.get("over_wall") or []
    if over:
        ranks = "; ".join(
            f"rank {r['rank']}: {r['busy_s'] * 1e3:.2f} ms of device time in a {r['wall_s'] * 1e3:.2f} ms step "
            f"(tolerance {r['tolerance_s'] * 1e3:.2f} ms)"
            for r in over
        )
        return (
            f"the training stages' CUDA event spans exceed each step's wall time: {ranks}; no device idle share given"
        )


@register(
    "prediction_fit_at_bound",
    "a coefficient of the predictor's calibration is held at a bound of its fit, or was not fitted (a calibration "
    "from fewer than 3 runs)",
    "calibrate again on a quiet machine (make predict-calibrate: a full fit of every term); if a term stays at its "
    "bound, the framework's time on this machine is not what the predictor models",
)
def _prediction_fit_at_bound(view: RunView):
    prediction, errors = view.prediction or {}, view.prediction_error or {}
    step = (errors.get("step_s") or {}).get("error")
    if step is not None and abs(step) <= PREDICTION_GOAL:  # a first use holds step_s at 0 and predicts within it
        return None
    bounds = (prediction.get("calibration") or {}).get("at_bound") or []
    # the terms a calibration from too few runs left unfitted: in the calibration the time block was predicted with
    unfitted = ((prediction.get("time") or {}).get("calibration") or {}).get("not_fitted") or []
    said = []
    if bounds:
        said.append(
            f"the prediction's calibration has {'; '.join(bounds)}: the fit wanted beyond it, so that fitted term "
            "is off on this machine (trainscope.predict.calibration)"
        )
    if unfitted:
        said.append(
            f"the prediction's calibration has {'; '.join(unfitted)}: the predicted time leaves out what they "
            "would add; make predict-calibrate fits them"
        )
    return "; and ".join(said) or None


@register(
    "comm_exposed_above_total",
    "exposed communication measured above the all-reduce's own duration",
    "re-measure on a quieter machine: backward waited for more than the transfer alone takes",
)
def _exposed_above_total(view: RunView):
    block = view.communication or {}
    exposed, total = block.get("exposed_s"), block.get("transfer_s", block.get("total_allreduce_s"))  # schema 3's name
    interval = block.get("exposed_interval") or ([exposed, exposed] if block.get("method") is None else None)
    if block.get("measured") and block.get("exposed_resolved", True) and exposed_above_transfer(interval, total):
        return (
            f"exposed communication {exposed * 1e3:.1f} ms (95% interval {interval[0] * 1e3:.1f}-"
            f"{interval[1] * 1e3:.1f} ms) is more than the all-reduce of the same buckets alone "
            f"({total * 1e3:.1f} ms): backward waited for more than communication (contention for the cores); "
            "the figures are reported as measured, not clamped, and no hidden share is given"
        )


def _verdicts(block: dict, verdict: str) -> list[str]:
    """'<what> by <instrument> (median difference, interval, tolerance)' for each comparison with this verdict."""
    found = []
    for name, agreed in (
        ("DDP's own logger", (block.get("agreement") or {}).get("ddp")),
        ("the profiler trace", (block.get("agreement") or {}).get("trace")),
    ):
        for what, result, scale, unit in (
            ("exposed time", agreed, 1e3, " ms"),
            ("overlap", (agreed or {}).get("overlap"), 100, " points"),
        ):
            if result and result.get("verdict") == verdict and not result.get("pairs"):
                found.append(f"{what} against {name}: no paired steps")
            elif result and result.get("verdict") == verdict:
                interval = result.get("interval")
                found.append(
                    f"{what} against {name}: median difference {result['median_difference'] * scale:+.1f}{unit}"
                    + (
                        f", 95% interval {interval[0] * scale:+.1f} to {interval[1] * scale:+.1f}"
                        if interval
                        else ", too few pairs for a 95% interval"
                    )
                    + f", tolerance +-{result['tolerance'] * scale:.1f}{unit}, {result['pairs']} paired steps"
                )
    return found


def _instrument_warning(view: RunView, verdict: str, message: str) -> str | None:
    """`message` with the communication's comparisons of this verdict in place of {found}; None without any."""
    found = _verdicts(view.communication or {}, verdict)
    return message.format(found="; ".join(found)) if found else None


@register(
    "comm_instruments_disagree",
    "trainscope's per-step communication figures disagree with DDP's own logger (or the profiler trace) on "
    "the same steps",
    "read both instruments' figures in the record; re-measure with more steps",
)
def _instruments_disagree(view: RunView):
    return _instrument_warning(
        view,
        "disagree",
        "the instruments disagree beyond the tolerance stated before measuring (the 95% interval of the "
        "median paired difference lies outside it): {found}; neither figure is trusted alone",
    )


@register(
    "comm_instruments_undecided",
    "trainscope's per-step communication figures could not be shown to agree with DDP's own logger (or the trace)",
    "run more steps: DDP's logger samples iterations 1-10, then every 100th",
)
def _instruments_undecided(view: RunView):
    return _instrument_warning(
        view,
        "undecided",
        "agreement with a second instrument not shown (too few paired steps, or paired differences too spread "
        "to tell against the tolerance): {found}",
    )
