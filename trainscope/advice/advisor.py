"""From one run record to "what to try next": ranked suggestions, each with its evidence and its gain.

How it works: docs/tune.md#in-the-code-how-the-advisor-reasons-trainscopeadvisorpy.
"""

from dataclasses import asdict, dataclass, field

from trainscope.advice import changes
from trainscope.core import launching
from trainscope.core.record_view import RunView
from trainscope.measure import health
from trainscope.measure.flops import matmul_parameters, padding_flops_share, peak_tflops

MIN_GAIN = 1.02  # a gain below 2% is not worth a trial on a noisy machine
NATIVE_BF16_MIN_SPEEDUP = 1.1  # a measured bf16 matmul speed-up below this is not worth a precision change
# torch.compile (inductor) fuses chains of elementwise operators (dropout, layer norm, activations, casts, softmax)
# into one pass over memory: their time assumed halved. Its compile time, assumed where the record has none (the
# tiny 2-layer BERT took 9-13 s on machine A: make bench-compile), is counted against the gain.
FUSION_FACTOR = 2.0
ASSUMED_COMPILE_S = {"cpu": 30.0, "cuda": 40.0}
ELEMENTWISE = ("attention", "dropout", "layer norm", "activation", "copies and casts")
# A batch is worth doubling when the matmuls at twice the tokens measured at least this much faster.
BATCH_MIN_RATE_GAIN = 1.05


@dataclass
class Suggestion:
    rule: str
    change: str
    evidence: str
    flags: list = field(default_factory=list)  # train.py flags that make the change ([] when it is not a flag)
    config: str | None = None  # an Accelerate config to launch with instead
    gain: float | None = None  # the whole run this many times faster (None: no speed claim)
    gain_kind: str | None = None  # "bound" (at most, Amdahl on a measured share) or "estimate"
    factor: str | None = None  # for an estimate: the assumed or measured factor, said
    confidence: str = "medium"  # high / medium / low
    fix_first: bool = False  # a health warning: the figures themselves are doubtful
    changes_result: str | None = None  # what the change alters in what is learned, if anything
    kind: str | None = None  # exact / numeric / training (trainscope.advice.changes), set by advise()
    unavailable: str | None = None  # why this build cannot make the change (a flag it lacks), or None

    def to_dict(self) -> dict:
        return asdict(self)

    def gain_text(self) -> str:
        if self.gain is None:
            return "fix first: the figures are doubtful" if self.fix_first else "no speed claim"
        if self.gain_kind == "bound":
            return f"at most {self.gain:.2f}x faster"
        return f"estimate {self.gain:.2f}x faster ({self.factor})"


def amdahl(share: float, factor: float | None = None) -> float:
    """Speed-up of the whole when a part of `share` becomes `factor` times faster (None: free)."""
    remaining = 0.0 if factor is None else share / factor
    return 1.0 / max(1e-9, 1.0 - share + remaining)


def advise(record: dict) -> list[Suggestion]:
    """Every suggestion the record supports: health warnings first, then by gain, largest first."""
    view = RunView(record)
    found = [s for rule in RULES for s in rule(view)]
    found += [s for rule in GAP_RULES for s in rule(view, gap_evidence(view))]
    found = [s for s in (predicted(view, s) for s in found) if s is not None]
    for warning in view.warnings:
        fix = fix_first(warning)
        same = next((s for s in found if fix.flags and s.flags == fix.flags), None)
        if same:  # the rule's suggestion is the fix: one item, ranked first, with the rule's gain
            same.fix_first, same.evidence = True, f"{same.evidence}; {fix.evidence}"
        else:
            found.append(fix)
    for s in found:
        if s.flags or s.config:
            s.kind, s.unavailable = changes.kind_of(s.flags, s.config), changes.unavailable(s.flags, s.config)
    if view.record.get("instrument"):  # a loop of its own (trainscope.Run): only what applies to any model
        found = [s for s in found if s.rule not in CLASSIFIER_ONLY]
        for s in found:
            if s.flags and not s.fix_first:
                s.unavailable = "train.py's flag: make the same change in your loop"
    return sorted(found, key=lambda s: (not s.fix_first, -(s.gain or 1.0)))


# What reads train.py's classifier (its padding and evaluation order, its encoder's attention and dropout) and does
# not apply to a loop of its own (trainscope.Run).
CLASSIFIER_ONLY = {"padding", "unpad", "eval_order", "evaluation", "attention_kernel", "dropout"}


# Estimates the predictor makes for a run that recorded a prediction (trainscope.predict.speedup: every operator
# at its shapes, this machine's measured rates): a precision, a batch, an evaluation batch.
PREDICTED_RULES = ("precision", "cpu_precision", "batch", "evaluation")
PREDICTED = "predicted by trainscope.predict (each operator at its shapes, this machine's measured rates)"


def predicted(view: RunView, suggestion: Suggestion) -> Suggestion | None:
    """The suggestion with the predictor's speed-up as its estimate where the run has a prediction (None: predicted
    below MIN_GAIN); else as the rule made it."""
    if suggestion.rule not in PREDICTED_RULES or view.prediction is None:
        return suggestion
    from trainscope import predict

    try:
        ratio = predict.speedup(view.record, suggestion.flags, suggestion.config)["ratio"]
    except Exception:  # the data or the model is not reachable here: the rule's own estimate stands
        return suggestion
    if ratio is None or ratio < MIN_GAIN:
        return None
    suggestion.gain, suggestion.gain_kind, suggestion.factor = ratio, "estimate", PREDICTED
    return suggestion


def fix_first(warning: dict) -> Suggestion:
    entry = health.fix_for(warning["code"])
    change, flags = (entry.fix, list(entry.flags)) if entry else ("see the warning", [])
    return Suggestion(
        f"warning:{warning['code']}", change, warning["message"], flags, fix_first=True, confidence="high"
    )


# ---------------------------------------------------------------- the rules


def data_loading(view: RunView) -> list[Suggestion]:
    share, threads = view.shares().get("data", 0.0), view.threads
    gain = amdahl(share)
    if gain < MIN_GAIN or not threads:
        return []
    workers_now, budget = view.setting("num_workers", 0), threads["thread_budget"]
    workers = max(1, min(4, budget - 1)) if workers_now == 0 else min(2 * workers_now, max(1, budget))
    flags = ["--num-workers", str(workers)]
    if view.on_cuda and not view.setting("pin_memory"):
        flags.append("--pin-memory")
    if view.setting("epochs", 1) > 1:
        flags.append("--persistent-workers")
    evidence = (
        f"data {share:.1%} of the steady step, {workers_now} workers, {threads['usable_cores']} usable "
        f"cores / {threads['local_processes']} processes = {budget} per process"
    )
    confidence = "high" if budget >= 4 else "low"  # with 2 cores a worker takes a core from the compute threads
    return [
        Suggestion(
            "data_loading",
            f"load batches in {workers} worker process(es)",
            evidence,
            flags,
            gain=gain,
            gain_kind="bound",
            confidence=confidence,
        )
    ]


def threads(view: RunView) -> list[Suggestion]:
    t = view.threads
    if not t or t["threads_source"] == "auto" or t["torch_threads"] == t["thread_budget"]:
        return []
    below = t["torch_threads"] < t["thread_budget"]
    compute = sum(view.shares().get(s, 0.0) for s in ("forward", "backward", "optimizer"))
    ratio = t["thread_budget"] / t["torch_threads"]
    evidence = (
        f"{t['torch_threads']} torch threads, budget {t['thread_budget']} ({t['usable_cores']} usable cores / "
        f"{t['local_processes']} processes; source {t['threads_source']})"
    )
    return [
        Suggestion(
            "threads",
            "use each process's share of the cores as threads",
            evidence,
            ["--threads", "auto"],
            gain=amdahl(compute, ratio) if below else None,
            gain_kind="estimate" if below else None,
            factor=f"compute x{ratio:g}: linear scaling with threads assumed" if below else None,
            confidence="high" if below else "medium",
        )
    ]


def padding(view: RunView) -> list[Suggestion]:
    pad, shape = view.padding, view.model_facts.get("shape")
    if view.setting("group_by_length") or view.setting("pad_to_max_length") or not pad["train_padded"]:
        return []
    run_shares = view.shares("run")
    train_share = run_shares.get("forward", 0.0) + run_shares.get("backward", 0.0)
    eval_share = run_shares.get("eval", 0.0)
    waste = 1 - pad["train_tokens"] / pad["train_padded"]
    train_saved = padding_flops_share(
        shape,
        pad["train_tokens"],
        pad["train_padded"],
        pad["train_samples"],
        pad["train_padded_squares"],
        training=True,
    )
    eval_saved = padding_flops_share(
        shape, pad["eval_tokens"], pad["eval_padded"], pad["eval_samples"], pad["eval_padded_squares"], training=False
    )
    # No time share of padding is measured: the saving is the FLOPs share taken as a time share, an estimate.
    assumed = [
        "forward, backward and evaluation time taken as proportional to their matmul FLOPs (softmax, mask and "
        "dropout tensors, not counted, shrink more)"
    ]
    if train_saved is None:  # a record without the model's shape: the FLOPs share taken as the positions' share
        train_saved = waste
        assumed.append("padding's FLOPs share taken as its share of positions (the record lacks the model's shape)")
    if eval_saved is None:
        assumed.append("evaluation padded like training (its token counts are not recorded)")
    gain = amdahl(train_share * train_saved + eval_share * (train_saved if eval_saved is None else eval_saved))
    if gain < MIN_GAIN:
        return []
    flops = "" if shape is None else f", {train_saved:.0%} of the training matmul FLOPs"
    evidence = (
        f"{waste:.0%} of the training token positions are padding ({pad['train_tokens']} real of "
        f"{pad['train_padded']}){flops}; forward and backward take {train_share:.0%} of the wall time, "
        f"evaluation {eval_share:.0%}"
    )
    if eval_saved is not None:
        evidence += f" ({1 - pad['eval_tokens'] / pad['eval_padded']:.0%} of its positions padding)"
    found = [
        Suggestion(
            "padding",
            "batch sequences of similar length (and evaluate in length order)",
            evidence,
            ["--group-by-length"],
            gain=gain,
            gain_kind="estimate",
            factor="; ".join(assumed),
            confidence="high",
            changes_result=order_change(view, "grouped by length") + "; evaluation in length order (the same samples)",
        )
    ]
    return found + padding_free(view, evidence, train_share, eval_share, eval_saved)


def padding_free(
    view: RunView, evidence: str, train_share: float, eval_share: float, eval_saved: float | None
) -> list[Suggestion]:
    """The exact changes that skip padding without touching what is learned: padding-free encoder layers (the
    token-wise matmuls -- projections and feed-forward -- on the real tokens; attention stays padded, so only the
    6N part of the padded FLOPs is saved) and evaluation in length order (its own padding share), each where the
    run did not use it already. Estimates, on the FLOPs as time, like the padding rule."""
    pad, shape = view.padding, view.model_facts.get("shape")
    found = []
    if shape and pad["train_padded_squares"] and not view.setting("unpad"):
        tokenwise = 6 * matmul_parameters(shape["layers"], shape["hidden"], shape["intermediate"])
        attention = 12 * shape["layers"] * shape["hidden"]
        padded = tokenwise * pad["train_padded"] + attention * pad["train_padded_squares"]
        saved = tokenwise * (pad["train_padded"] - pad["train_tokens"]) / padded
        gain = amdahl(train_share * saved)
        if gain >= MIN_GAIN:
            found.append(
                Suggestion(
                    "unpad",
                    "run the encoder's token-wise layers on the real tokens only (padding-free layers)",
                    evidence,
                    ["--unpad"],
                    gain=gain,
                    gain_kind="estimate",
                    factor=f"forward and backward time x(1 - {saved:.0%}): the token-wise matmul "
                    "FLOPs on padding positions, taken as time (attention stays padded)",
                    confidence="medium",
                    changes_result=changes.does(["--unpad"]),
                )
            )
    if eval_saved and view.setting("eval_order") != "length":  # in length order already: what is left stays
        gain = amdahl(eval_share * eval_saved)
        if gain >= MIN_GAIN:
            found.append(
                Suggestion(
                    "eval_order",
                    "evaluate in length order (the same samples, less padding)",
                    evidence,
                    ["--eval-order", "length"],
                    gain=gain,
                    gain_kind="estimate",
                    factor=f"evaluation time x(1 - {eval_saved:.0%}): its padding FLOPs taken as time",
                    confidence="medium",
                    changes_result=changes.does(["--eval-order"]),
                )
            )
    return found


def order_change(view: RunView, how: str) -> str:
    """What reordering the training batches alters in what is learned: the samples themselves when the run stops
    inside an epoch (--max-steps), since it trains on the ones the new order puts first."""
    partial = view.partial_epoch
    if partial is None:
        return f"training batches {how}: the same samples, another order"
    steps, epoch = partial
    where = (
        f"shorter than an epoch ({steps} of {epoch} steps)"
        if steps < epoch
        else f"not a whole number of epochs ({steps} steps of {epoch} each)"
    )
    return (
        f"training batches {how}: different samples -- the run is {where}, so it trains on those the new order "
        "puts first"
    )


def evaluation(view: RunView) -> list[Suggestion]:
    share = view.shares("run").get("eval", 0.0)
    if not view.on_cuda:  # the gain comes from fewer kernel launches per sample: a GPU cost
        return []
    # settings.default_eval_batch_size's rule (not imported: settings pulls in transformers); older records: given order
    current = view.setting("eval_batch_size") or (
        (4 if view.setting("eval_order") == "length" else 2) * view.setting("per_device_batch_size", 32)
    )
    gain = amdahl(share, 1.25)
    if share < 0.05 or gain < MIN_GAIN:
        return []
    return [
        Suggestion(
            "evaluation",
            f"evaluate in batches of {2 * current} (or on fewer samples)",
            f"evaluation {share:.1%} of the wall time at batch {current} on {view.device_name}",
            ["--eval-batch-size", str(2 * current)],
            gain=gain,
            gain_kind="estimate",
            factor="evaluation x1.25 from fewer kernel launches per sample (assumed)",
            confidence="low",
        )
    ]


def optimizer(view: RunView) -> list[Suggestion]:
    """The fused AdamW where the device has its kernel (CUDA, and the CPU since torch 2.4): one pass over every
    parameter instead of one kernel per operation (foreach) or per tensor (for-loop). Fires on the optimizer stage's
    measured share."""
    share = view.shares().get("optimizer", 0.0)
    facts = view.model_facts.get("optimizer") or {}
    if not (view.on_cuda or view.on_cpu) or facts.get("fused", True) or amdahl(share, 3) < MIN_GAIN:
        return []
    now = "foreach" if facts.get("foreach") else "for-loop"
    return [
        Suggestion(
            "optimizer",
            "use the fused AdamW: one kernel per step over every parameter",
            f"optimizer {share:.1%} of the steady step, {facts.get('name')} {now}, not fused",
            ["--optimizer-implementation", "fused"],
            gain=amdahl(share, 3),
            gain_kind="estimate",
            factor="optimizer x3 when fused (assumed)",
            changes_result=changes.does(["--optimizer-implementation"]),
        )
    ]


def gpu_precision(view: RunView) -> list[Suggestion]:
    if not view.on_cuda or view.precision != "fp32":
        return []
    fp32, bf16 = peak_tflops(view.device_name, "fp32"), peak_tflops(view.device_name, "bf16")
    if not fp32 or not bf16:
        return []
    compute = view.shares().get("forward", 0.0) + view.shares().get("backward", 0.0)
    return [
        Suggestion(
            "precision",
            "train in bf16 (accelerate_configs/bf16.yaml), or allow TF32 with --tf32",
            f"fp32 on {view.device_name}: dense peaks {fp32:g} TFLOP/s fp32, {bf16:g} bf16; forward and "
            f"backward {compute:.0%} of the step",
            config="bf16",
            gain=amdahl(compute, bf16 / fp32),
            gain_kind="estimate",
            factor=f"forward and backward x{bf16 / fp32:.1f}, the datasheet peak ratio",
            changes_result="bf16 rounding (losses agree to about 1e-2)",
        )
    ]


def cpu_precision(view: RunView) -> list[Suggestion]:
    """bf16 autocast on a CPU whose bf16 matmuls measured faster than fp32 at this run's threads (trainscope.measure.peak),
    whatever its flags say: the timing decides, the flags are reported beside it."""
    bf16 = view.cpu_bf16
    speedup = bf16.get("speedup")
    if not view.on_cpu or view.precision != "fp32" or not speedup:
        return []
    run_shares = view.shares("run")
    compute = run_shares.get("forward", 0.0) + run_shares.get("backward", 0.0) + run_shares.get("eval", 0.0)
    gain = amdahl(compute, speedup)
    if speedup < NATIVE_BF16_MIN_SPEEDUP or gain < MIN_GAIN:
        return []
    if bf16.get("bf16_tflops"):
        measured = (
            f"bf16 matmuls measured {speedup:.2f}x fp32's here ({bf16['bf16_tflops'] * 1e3:.0f} against "
            f"{bf16['fp32_tflops'] * 1e3:.0f} GFLOP/s, the machine's measured peaks at {view.torch_threads} "
            "threads)"
        )
    else:  # a schema 3 record: a 1024^2 matmul timed at start-up
        measured = (
            f"a {bf16.get('size')}x{bf16.get('size')} matmul at {bf16.get('threads')} threads ran "
            f"{speedup:.2f}x faster in bf16 autocast than fp32 here"
        )
    flags = (
        f"flags {', '.join(bf16['flags'])}"
        if bf16.get("flags")
        else {True: "native bf16 by its flags", False: "no native-bf16 flag listed", None: "flags unread"}[
            bf16.get("native_by_flags")
        ]
    )
    return [
        Suggestion(
            "cpu_precision",
            "train in bf16 autocast (accelerate_configs/bf16.yaml): this CPU computes bf16 faster than fp32",
            f"{view.env.get('cpu_capability')} ({flags}); {measured}; forward, "
            f"backward and evaluation take {compute:.0%} of the wall time",
            config="bf16",
            gain=gain,
            gain_kind="estimate",
            factor=f"all of forward, backward and evaluation x{speedup:.2f}, the measured matmul speed-up",
            confidence="medium",
            changes_result="bf16 rounding (losses agree to about 1e-2)",
        )
    ]


def gpu_batch(view: RunView) -> list[Suggestion]:
    total, mfu, used = view.device_memory_gib, view.mfu, view.max_allocated_gib
    if not (view.on_cuda and total and used and mfu is not None):
        return []
    found = []
    # a host-bound run: the host_bound rule offers the batch with the device's idle time as its evidence
    if mfu < 0.3 and used < 0.5 * total and not view.host_bound:
        batch, steps = 2 * view.setting("per_device_batch_size"), view.setting("gradient_accumulation_steps", 1)
        flags = ["--per-device-batch-size", str(batch)]
        if steps % 2 == 0:
            flags += ["--gradient-accumulation-steps", str(steps // 2)]
        found.append(
            Suggestion(
                "batch",
                f"double the per-device batch to {batch}" + (" and halve accumulation" if steps % 2 == 0 else ""),
                f"MFU {mfu:.0%} with {used:.1f} of {total:.0f} GiB in use",
                flags,
                gain=min(2.0, 0.5 / max(mfu, 1e-3)),
                gain_kind="estimate",
                factor="MFU rising towards 50% with the batch (assumed)",
                confidence="medium",
                changes_result=None if steps % 2 == 0 else "the effective batch doubles",
            )
        )
    if used > 0.9 * total:
        found.append(
            Suggestion(
                "memory",
                "add --gradient-checkpointing (or --lora) to make room",
                f"{used:.1f} of {total:.0f} GiB allocated at the peak",
                ["--gradient-checkpointing"],
                confidence="medium",
            )
        )
    return found


def communication(view: RunView) -> list[Suggestion]:
    """Only a resolved exposed time (measured per step, its interval clear of 0) bounds a gain."""
    figures = view.communication_figures or {}
    share = figures.get("exposed_share")
    if not figures.get("resolved") or not share or share <= 0 or amdahl(share) < MIN_GAIN:
        return []
    interval, transfer = figures.get("exposed_interval"), figures.get("transfer_s")
    evidence = (
        f"exposed communication {figures['exposed_s'] * 1e3:.1f} ms"
        + (f" (95% interval {interval[0] * 1e3:.1f}-{interval[1] * 1e3:.1f})" if interval else "")
        + f", {share:.1%} of the step"
        + (f"; the same buckets' all-reduces alone {transfer * 1e3:.1f} ms" if transfer else "")
        + f" on {view.backend}"
    )
    found = []
    if view.backend in ("nccl", "xccl"):  # bucket timing and compression pay off where the link is the limit
        found.append(
            Suggestion(
                "ddp_buckets",
                "smaller buckets start the all-reduce earlier in backward (more overlap)",
                evidence,
                ["--ddp-bucket-cap-mb", "5"],
                gain=amdahl(share),
                gain_kind="bound",
                confidence="low",
            )
        )
        if view.setting("ddp_comm_hook") == "none":
            found.append(
                Suggestion(
                    "ddp_compression",
                    "all-reduce gradients in fp16 (half the bytes)",
                    evidence,
                    ["--ddp-comm-hook", "fp16"],
                    gain=amdahl(share, 2),
                    gain_kind="estimate",
                    factor="communication x2 from half the bytes (assumed)",
                    changes_result="gradients rounded to fp16 before the all-reduce",
                )
            )
    found.append(
        Suggestion(
            "ddp_accumulation",
            "accumulate 2 micro-batches per all-reduce (no_sync on the first)",
            evidence,
            ["--gradient-accumulation-steps", str(2 * view.setting("gradient_accumulation_steps", 1))],
            gain=amdahl(share, 2),
            gain_kind="estimate",
            factor="half the all-reduces per sample",
            changes_result="the effective batch doubles",
        )
    )
    return found


# ---------------------------------------------------------------- the host-bound rule (summary.device_time)

# torch.compile's fused kernels take this factor off the host's forward and backward time on a host-bound step
# (fewer launches and less framework work per operator): assumed, like FUSION_FACTOR on the device's.
COMPILE_HOST_FACTOR = 2.0
CUDA_GRAPHS_NOTE = (
    "not offered here: trainscope has no flag for CUDA graphs (torch.compile(mode='reduce-overhead'), or "
    "torch.cuda.graphs in a loop of your own)"
)


def host_bound(view: RunView) -> list[Suggestion]:
    """A GPU that idles above summary.device_time's threshold of each step waits for the host: what shortens the
    host's part of the step helps, what shortens the device's does not. The verdict is measured where the CUDA
    events' bound on the idle share passes the threshold, else estimated from the kernel time of one layer profiled
    at the run's shapes. One item says so and ranks what helps, each with its evidence; the changes that carry flags
    are items of their own (the batch and --compile here; the fused optimizer and the loader's workers from their
    own rules, which fire on the optimizer and data stages' shares):

    * a larger per-device batch where the peak memory leaves room for twice it: the host's time per step outside the
      data stage stays (the kernels launched do not grow with the batch), the data stage and the device's work
      double -- per sample, W / max((W - D) / 2 + D, B) for a step of W, data D and device time B;
    * --compile where not compiled: the host's forward and backward time x1/COMPILE_HOST_FACTOR (assumed), the
      device's work unchanged, less an assumed compile time over the run (the break-even steps said);
    * CUDA graphs: one launch for all of a step's kernels, a note (no flag here);
    * the fused optimizer, unless the record says it is fused; the loader's workers where the data stage's share
      leaves MIN_GAIN.
    """
    block = view.device_time
    if not view.on_cuda or not block.get("host_bound"):
        return []
    wall, spans, estimate = block["step_wall_s"], block["stage_spans_s"], block.get("kernel_estimate")
    measured = block["host_bound_by"] == "event spans"
    busy = estimate["busy_s"] if estimate else block["busy_at_most_s"]
    idle = estimate["idle_share"] if estimate else block["idle_share_at_least"]
    said = (
        f"the device is busy at most {block['busy_at_most_s'] * 1e3:.1f} ms of each {wall * 1e3:.1f} ms step by the "
        f"stages' CUDA events (idle at least {block['idle_share_at_least']:.0%})"
    )
    if estimate:
        said += (
            f", about {estimate['busy_s'] * 1e3:.1f} ms by kernel time (idle about {estimate['idle_share']:.0%}: "
            f"{estimate['layers']} layers x {estimate['layer_s'] * 1e3:.2f} ms, one layer's forward and backward "
            f"kernels profiled at the run's shapes, plus the data and optimizer stages' spans)"
        )
    if view.mfu is not None:
        said += f"; MFU {view.mfu:.1%}"
    offered = [
        s
        for s in (_host_bound_batch(view, said, wall, spans, busy), _host_bound_compile(view, said, wall, spans, busy))
        if s
    ]
    helps = offered + optimizer(view) + data_loading(view)  # those two from their own rules, on their stages' shares
    helps.sort(key=lambda s: -(s.gain or 1.0))
    what = "; ".join(
        f"{n}. {s.change} (`{' '.join(s.flags)}`, {'at most' if s.gain_kind == 'bound' else 'estimate'} {s.gain:.2f}x)"
        for n, s in enumerate(helps, 1)
    )
    notes = ["CUDA graphs (no flag here)", *_host_bound_left_out(view, wall, spans, busy)]
    headline = Suggestion(
        "host_bound",
        "the GPU waits for the host: shorten the host's part of each step (what helps, ranked in the evidence)",
        f"host-bound: {said}; what helps, ranked: {what or 'no change with a flag applies'}; not offered: "
        f"{'; '.join(notes)}",
        gain=amdahl(idle) if estimate else None,
        gain_kind="estimate" if estimate else None,
        factor="every idle moment of the device removed, its work unchanged (the kernel estimate): the ceiling of "
        "every change to the host's part"
        if estimate
        else None,
        confidence="high" if measured else "medium",
    )
    graphs = Suggestion(
        "cuda_graphs",
        f"capture each step in a CUDA graph: {CUDA_GRAPHS_NOTE}",
        f"host-bound: {said}",
        confidence="low",
    )
    return [headline, *offered, graphs]


def _host_bound_batch(view: RunView, said: str, wall: float, spans: dict, busy: float) -> Suggestion | None:
    total, used = view.device_memory_gib, view.max_allocated_gib
    if not (total and used) or 2 * used > 0.9 * total:
        return None
    batch, steps = view.setting("per_device_batch_size"), view.setting("gradient_accumulation_steps", 1)
    if not batch:
        return None
    data = spans["data"]
    gain = wall / max((wall - data) / 2 + data, busy)
    if gain < MIN_GAIN:
        return None
    flags = ["--per-device-batch-size", str(2 * batch)]
    if steps % 2 == 0:
        flags += ["--gradient-accumulation-steps", str(steps // 2)]
    return Suggestion(
        "batch",
        f"double the per-device batch to {2 * batch}" + (" and halve accumulation" if steps % 2 == 0 else ""),
        f"host-bound: {said}; {used:.1f} of {total:.0f} GiB in use at the peak (twice it fits)",
        flags,
        gain=gain,
        gain_kind="estimate",
        factor=f"per sample: the host's {(wall - data) * 1e3:.1f} ms a step outside the data stage unchanged (the "
        f"kernels launched do not grow with the batch), the data stage ({data * 1e3:.1f} ms) and the device's "
        f"{busy * 1e3:.1f} ms doubled",
        confidence="medium",
        changes_result=None if steps % 2 == 0 else "the effective batch doubles",
    )


def _host_bound_compile(view: RunView, said: str, wall: float, spans: dict, busy: float) -> Suggestion | None:
    if view.setting("compile"):
        return None
    step = _compiled_step(wall, spans, busy)
    run, compile_s = view.wall_s or view.wall_median("run"), ASSUMED_COMPILE_S["cuda"]
    if not run or step >= wall:
        return None
    training = 1.0 - view.shares("run").get("eval", 0.0)
    gain = 1.0 / max(1e-9, 1.0 - (1.0 - step / wall) * training + compile_s / run)
    if gain < MIN_GAIN:
        return None
    return Suggestion(
        "compile",
        "compile the model (torch.compile: fused kernels, fewer launches from the host)",
        f"host-bound: {said}; forward and backward take {(spans['forward'] + spans['backward']) * 1e3:.1f} ms of "
        "the step, mostly the host's launches",
        ["--compile"],
        gain=gain,
        gain_kind="estimate",
        factor=f"the host's forward and backward time x1/{COMPILE_HOST_FACTOR:g} (assumed), the device's work "
        f"unchanged; compile time {compile_s:.0f} s (assumed) against a {run:.0f} s run",
        confidence="low",
        changes_result=changes.does(["--compile"]),
    )


def _compiled_step(wall: float, spans: dict, busy: float) -> float:
    """A host-bound step with the host's forward and backward time cut by COMPILE_HOST_FACTOR, no shorter than the
    device's work."""
    compute = spans["forward"] + spans["backward"]
    return max(busy, wall - compute * (1 - 1 / COMPILE_HOST_FACTOR))


def _host_bound_left_out(view: RunView, wall: float, spans: dict, busy: float) -> list[str]:
    """What the ranked list leaves out, and why."""
    found = []
    total, used = view.device_memory_gib, view.max_allocated_gib
    if not (total and used):
        found.append("a larger batch: the record lacks the peak or the device's memory")
    elif 2 * used > 0.9 * total:
        found.append(f"a larger batch: {used:.1f} of {total:.0f} GiB in use, twice it does not fit")
    if view.setting("compile"):
        found.append("--compile: compiled already")
    elif _host_bound_compile(view, "", wall, spans, busy) is None:
        step = _compiled_step(wall, spans, busy)
        if step < wall:
            even = ASSUMED_COMPILE_S["cuda"] / (wall - step)
            found.append(
                f"--compile: about {wall / step:.2f}x on the steady step (estimate: the host's forward and backward "
                f"time x1/{COMPILE_HOST_FACTOR:g}), paying back its compile time ({ASSUMED_COMPILE_S['cuda']:.0f} s "
                f"assumed) after about {even:.0f} steps: not in a run this short "
                f"({view.summary.get('optimizer_steps') or '?'} steps)"
            )
    facts = view.model_facts.get("optimizer") or {}
    if facts.get("fused"):
        found.append("the fused optimizer: fused already")
    elif not facts:
        found.append("the fused optimizer: the record does not say the optimizer's implementation")
    data = spans["data"]
    if not data_loading(view):
        found.append(f"the loader's workers: the data stage, {data * 1e3:.1f} ms a step, leaves too little to gain")
    return found


RULES = [
    data_loading,
    threads,
    padding,
    evaluation,
    optimizer,
    gpu_precision,
    cpu_precision,
    gpu_batch,
    communication,
    host_bound,
]


# ---------------------------------------------------------------- the gap rules (trainscope.measure.gap)


def gap_evidence(view: RunView) -> dict | None:
    """Each gap category's share of the whole run and where it comes from: {shares, kind ("bound" from the run's
    own profile, "estimate" from one layer profiled apart), text}. None when neither was recorded, and on a
    host-bound GPU run (summary.device_time): there the device's time saved does not shorten the step, so no gap
    rule argues from it (the host_bound rule speaks)."""
    if view.host_bound:  # the device idles waiting for the host: its shares do not shorten the step
        return None
    breakdown = view.gap_breakdown
    if breakdown and breakdown.get("window_s"):
        training = 1.0 - view.shares("run").get("eval", 0.0)
        window = breakdown["window_s"]
        shares = {k: v / window * training for k, v in breakdown["categories"].items()}
        shares["attention total"] = breakdown.get("attention_total_s", 0.0) / window * training
        shares["attention dropout"] = breakdown.get("attention_dropout_s", 0.0) / window * training
        return {
            "shares": shares,
            "kind": "bound",
            "text": f"the profiled steps ({breakdown['basis']}) x training's {training:.0%} of the run",
        }
    layer = ((view.measured_peak or {}).get("run_shapes") or {}).get("layer")
    if layer and layer.get("window_s"):
        run_shares = view.shares("run")
        compute = run_shares.get("forward", 0.0) + run_shares.get("backward", 0.0)
        window = layer["window_s"]
        shares = {k: v / window * compute for k, v in layer["categories"].items()}
        shares["attention total"] = layer.get("attention_total_s", 0.0) / window * compute
        shares["attention dropout"] = layer.get("attention_dropout_s", 0.0) / window * compute
        return {
            "shares": shares,
            "kind": "estimate",
            "text": f"one encoder layer profiled apart at batch {layer['batch']} x length {layer['length']} "
            f"({layer['precision']}), its shares taken for forward + backward's {compute:.0%} of the run",
        }
    return None


def _gap_suggestion(rule, change, evidence_text, flags, share, found, changes_result, factor=None, confidence="medium"):
    """A suggestion whose gain removes `share` of the run: at most (a measured share) or an estimate."""
    gain = amdahl(share) if factor is None else amdahl(share, factor)
    if gain < MIN_GAIN:
        return []
    kind = "bound" if found["kind"] == "bound" and factor is None else "estimate"
    stated = (
        None
        if kind == "bound"
        else "; ".join(
            x
            for x in (
                f"the share from {found['text']}" if found["kind"] == "estimate" else None,
                f"that time x{factor:g} (assumed)" if factor else "that time removed",
            )
            if x
        )
    )
    return [
        Suggestion(
            rule,
            change,
            f"{evidence_text} ({found['text']})",
            flags,
            gain=gain,
            gain_kind=kind,
            factor=stated,
            confidence=confidence,
            changes_result=changes_result,
        )
    ]


def attention_kernel(view: RunView, found: dict | None) -> list[Suggestion]:
    """The math attention path where dropout on the attention weights is what keeps the fused kernel out (training
    runs MATH, evaluation -- no dropout -- a fused one): everything inside attention is what the fused kernel
    replaces, so its share bounds the gain."""
    kernels = view.sdpa_kernels or {}
    if (
        not found
        or kernels.get("training") != "MATH"
        or kernels.get("evaluation") == "MATH"
        or not kernels.get("attention_dropout")
    ):
        return []
    share = found["shares"].get("attention total", 0.0)
    text = (
        f"training attention runs torch's {kernels['training']} path because of attention dropout "
        f"{kernels['attention_dropout']:g} (evaluation, without dropout: {kernels['evaluation']}); everything "
        f"inside attention (its matmuls, softmax, masking and dropout) is {share:.1%} of the run"
    )
    return _gap_suggestion(
        "attention_kernel",
        "drop attention dropout so the fused attention kernel runs in training",
        text,
        ["--attention-dropout", "0"],
        share,
        found,
        "no dropout on the attention weights: less regularization",
    )


def dropout(view: RunView, found: dict | None) -> list[Suggestion]:
    """Hidden dropout's masks (bernoulli, scaling, the masked multiply, forward and backward) on its measured share."""
    hidden = (view.model_facts.get("dropout") or {}).get("hidden")
    if not found or hidden == 0:
        return []
    share = found["shares"].get("dropout", 0.0) - found["shares"].get("attention dropout", 0.0)
    text = (
        f"dropout outside attention (hidden dropout {hidden if hidden is not None else '?'}) is {share:.1%} of the run"
    )
    return _gap_suggestion(
        "dropout",
        "train without hidden dropout",
        text,
        ["--hidden-dropout", "0"],
        share,
        found,
        "no dropout on the hidden states: less regularization",
    )


def compile_fusion(view: RunView, found: dict | None) -> list[Suggestion]:
    """torch.compile where elementwise time is large: fusion's assumed factor on that time, less the compile time
    (measured where the record compiled, else assumed) over the run."""
    if not found or view.setting("compile"):
        return []
    share = sum(found["shares"].get(c, 0.0) for c in ELEMENTWISE)
    wall = view.wall_s or view.wall_median("run")
    device = "cuda" if view.on_cuda else "cpu"
    compile_s = ASSUMED_COMPILE_S[device]
    if not wall or share <= 0:
        return []
    saved = share * (1 - 1 / FUSION_FACTOR)
    gain = 1.0 / max(1e-9, 1.0 - saved + compile_s / wall)
    if gain < MIN_GAIN:
        return []
    lengths = (
        "one shape (--pad-to-max-length)"
        if view.setting("pad_to_max_length")
        else "dynamic shapes, since lengths vary (a new length can still recompile: the recompiles warning counts it)"
    )
    text = (
        f"elementwise work ({', '.join(ELEMENTWISE)}) is {share:.1%} of the run ({found['text']}); compiled with "
        f"{lengths}"
    )
    return [
        Suggestion(
            "compile",
            "compile the model (torch.compile fuses the elementwise operators)",
            text,
            ["--compile"],
            gain=gain,
            gain_kind="estimate",
            factor=f"elementwise time x1/{FUSION_FACTOR:g} (assumed), compile time {compile_s:.0f} s "
            f"(assumed) against a {wall:.0f} s run",
            confidence="low",
            changes_result=changes.does(["--compile"]),
        )
    ]


def batch_at_peak(view: RunView, found: dict | None = None) -> list[Suggestion]:
    """A doubled per-device batch, on two pieces of evidence (on a CPU; on a GPU the memory-based rule `batch`
    speaks): the matmuls at the run's own GEMM shapes against twice the tokens per micro-batch, measured on this
    machine (trainscope.measure.peak) and counted only outside the two rates' spreads; and, where the effective batch
    doubles (no accumulation to halve), the optimizer stage's measured share, paid once per step and so half as often
    for the same samples. An estimate: the matmul part is the model FLOPs at the run's measured rate."""
    measured = view.measured_peak or {}
    shapes, estimate = measured.get("run_shapes") or {}, measured.get("gap_estimate") or {}
    rate, doubled = shapes.get("tflops"), shapes.get("tflops_doubled")
    if view.on_cuda or not (rate and doubled and estimate.get("train_s")):
        return []
    batch, steps = view.setting("per_device_batch_size"), view.setting("gradient_accumulation_steps", 1)
    halves_accumulation = steps % 2 == 0
    resolved = doubled / rate >= BATCH_MIN_RATE_GAIN and (shapes.get("tflops_doubled_low") or doubled) > (
        shapes.get("tflops_high") or rate
    )
    factor = doubled / rate if resolved else 1.0
    matmul_s = estimate["floor_s"] * measured["peak_tflops"] / rate  # the model FLOPs at the run's measured rate
    train_share = estimate["train_s"] / (view.wall_s or estimate["train_s"])
    matmul_share = min(1.0, matmul_s / estimate["train_s"]) * train_share
    optimizer_share = 0.0 if halves_accumulation else view.shares("run").get("optimizer", 0.0)
    saved = matmul_share * (1 - 1 / factor) + optimizer_share / 2
    gain = 1.0 / max(1e-9, 1.0 - saved)
    if gain < MIN_GAIN:
        return []
    flags = ["--per-device-batch-size", str(2 * batch)] + (
        ["--gradient-accumulation-steps", str(steps // 2)] if halves_accumulation else []
    )
    parts = [
        f"matmuls at the run's shapes ({shapes['tokens']} tokens per micro-batch: batch {shapes['batch']} x "
        f"{shapes['length']}) measured {rate * 1e3:.0f} GFLOP/s, at twice the tokens {doubled * 1e3:.0f} GFLOP/s"
        + ("" if resolved else " (not apart from the first: counted as no faster)")
        + f"; the model's matmuls at that rate are {matmul_share:.0%} of the run"
    ]
    if optimizer_share:
        parts.append(f"the optimizer stage is {optimizer_share:.1%} of the run, once per step")
    factors = [
        f"the matmuls x{factor:.2f}, measured at twice the tokens" if resolved else None,
        "the optimizer half as often (one step per twice the samples)" if optimizer_share else None,
    ]
    return [
        Suggestion(
            "batch_at_peak",
            f"double the per-device batch to {2 * batch}" + (" and halve accumulation" if halves_accumulation else ""),
            "; ".join(parts),
            flags,
            gain=gain,
            gain_kind="estimate",
            factor="; ".join(f for f in factors if f),
            confidence="low",
            changes_result=None
            if halves_accumulation
            else "the effective batch doubles and the optimizer takes half the steps (the learning rate is not scaled)",
        )
    ]


GAP_RULES = [attention_kernel, dropout, compile_fusion, batch_at_peak]


def lines(suggestions: list[Suggestion]) -> list[str]:
    """The ranked list for the console and the report."""
    out = []
    for rank, s in enumerate(suggestions, 1):
        what = " ".join(s.flags) or (launching.config_argument(s.config) if s.config else "")
        kind = f"; {s.kind}" + (f", {s.unavailable}" if s.unavailable else "") if s.kind else ""
        out.append(
            f"{rank}. {s.change}" + (f" (`{what}`{kind})" if what else "") + f" -- {s.gain_text()}, "
            f"confidence {s.confidence}."
        )
        out.append(f"   evidence: {s.evidence}" + (f"; changes: {s.changes_result}" if s.changes_result else ""))
    return out or ["No suggestion: no measured share leaves 2% to gain."]
