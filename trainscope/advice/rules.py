"""The suggestion a rule returns and its gain (Amdahl on a share), and the rules that read the run's measured
stages, its settings and its machine; the advisor (trainscope.advice.advisor) ranks what they find.

How it works: docs/tune.md#in-the-code-how-the-advisor-reasons-trainscopeadviceadvisorpy.
"""

from dataclasses import asdict, dataclass, field

from trainscope.advice import changes, estimates
from trainscope.core.record_view import RunView
from trainscope.measure.flops import matmul_parameters, padding_flops_share, peak_tflops

MIN_GAIN = 1.02  # a gain below 2% is not worth a trial on a noisy machine


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
    interval: tuple | None = None  # an estimate's (low, high); None: from half its assumed effect to all of it
    assumes: str | None = None  # what an estimate from the run's own measurement assumes
    estimate_unavailable: str | None = None  # why the record gives no estimate (a failure inside one included)
    in_loop: str | None = None  # the change in a loop's own terms (trainscope.Run records), set by advise()
    note: str | None = None  # in place of "fix first" for a warning about one figure only (the prediction)

    def to_dict(self) -> dict:
        return asdict(self)

    def bounds(self) -> tuple[float, float] | None:
        """An estimate's interval: its own, or from half its assumed effect to all of it."""
        if self.gain is None or self.gain_kind != "estimate":
            return None
        return self.interval or tuple(sorted((1 + (self.gain - 1) / 2, self.gain)))

    def gain_text(self) -> str:
        if self.estimate_unavailable:
            return f"estimate unavailable: {self.estimate_unavailable}"
        if self.gain is None:
            if self.note:
                return self.note
            return "fix first: the figures are doubtful" if self.fix_first else "no speed claim"
        if self.gain_kind == "bound":
            return f"at most {self.gain:.2f}x faster"
        low, high = self.bounds()
        said = [
            self.factor,
            f"interval {low:.2f}-{high:.2f}x" + ("" if self.interval else ": half to all of that effect"),
            f"assumes {self.assumes}" if self.assumes else None,
        ]
        said = "; ".join(part for part in said if part)
        return f"estimate {self.gain:.2f}x {'faster' if self.gain >= 1 else 'slower'} ({said})"


def amdahl(share: float, factor: float | None = None) -> float:
    """Speed-up of the whole when a part of `share` becomes `factor` times faster (None: free)."""
    remaining = 0.0 if factor is None else share / factor
    return 1.0 / max(1e-9, 1.0 - share + remaining)


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
    """Another intra-op thread count: where the record timed the run's model at other counts (the budget where the
    run used another, half the run's), the best of them by its estimate; else, on a record without that timing, the
    budget where the run's threads are off it (linear scaling assumed)."""
    t = view.threads
    counts = estimates.thread_counts(view)
    if counts and t:
        found = [(count, estimates.guarded(estimates.threads, view, count)) for count in counts]
        failed = [(count, e) for count, e in found if e.unavailable]
        usable = [(count, e) for count, e in found if e.gain is not None]
        if not usable:
            defects = [(count, e) for count, e in failed if e.failed]
            return [_threads_suggestion(view, defects[0][0], None, defects[0][1].unavailable)] if defects else []
        count, best = max(usable, key=lambda pair: pair[1].gain)
        if best.gain < MIN_GAIN:
            return []
        return [_threads_suggestion(view, count, best)]
    if not t or t["threads_source"] == "auto" or t["torch_threads"] == t["thread_budget"]:
        return []
    below = t["torch_threads"] < t["thread_budget"]
    compute = sum(view.shares().get(s, 0.0) for s in ("forward", "backward", "optimizer"))
    ratio = t["thread_budget"] / t["torch_threads"]
    return [
        Suggestion(
            "threads",
            "use each process's share of the cores as threads",
            _threads_evidence(t),
            ["--threads", "auto"],
            gain=amdahl(compute, ratio) if below else None,
            gain_kind="estimate" if below else None,
            factor=f"compute x{ratio:g}: linear scaling with threads assumed (the record did not time other counts)"
            if below
            else None,
            interval=(1.0, amdahl(compute, ratio)) if below else None,
            confidence="high" if below else "medium",
        )
    ]


def _threads_evidence(t: dict) -> str:
    return (
        f"{t['torch_threads']} torch threads, budget {t['thread_budget']} ({t['usable_cores']} usable cores / "
        f"{t['local_processes']} processes; source {t['threads_source']})"
    )


def _threads_suggestion(
    view: RunView, count: int, estimate: estimates.Estimate | None, failed: str | None = None
) -> Suggestion:
    t = view.threads
    budget = count == t["thread_budget"]
    busy = ((view.run_operations or {}).get("others_cores") or 0.0) > 0.25
    return Suggestion(
        "threads",
        "use each process's share of the cores as threads" if budget else f"use {count} intra-op thread(s)",
        _threads_evidence(t) + (f"; {estimate.evidence}" if estimate else ""),
        ["--threads", "auto" if budget else str(count)],
        gain=estimate.gain if estimate else None,
        gain_kind="estimate" if estimate else None,
        interval=(estimate.low, estimate.high) if estimate else None,
        assumes=estimate.assumes if estimate else None,
        estimate_unavailable=failed,
        confidence="low" if busy or not budget else "medium",
    )


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
    return [
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
    ] + padding_free(view, evidence, train_share, eval_share, eval_saved)


def padding_free(
    view: RunView, evidence: str, train_share: float, eval_share: float, eval_saved: float | None
) -> list[Suggestion]:
    """The exact changes that skip padding without touching what is learned: padding-free encoder layers (the
    token-wise matmuls -- projections and feed-forward -- on the real tokens; attention stays padded, so only the
    6N part of the padded FLOPs is saved) and evaluation in length order (its own padding share), each where the
    run did not use it already. Estimates, on the FLOPs as time, like the padding rule."""
    pad, shape = view.padding, view.model_facts.get("shape")
    found = []
    # not on a host-bound step: the FLOPs saved do not shorten it, and the layers add host work (advisor.host_bound)
    if shape and pad["train_padded_squares"] and not view.setting("unpad") and not view.host_bound:
        tokenwise = 6 * matmul_parameters(shape["layers"], shape["hidden"], shape["intermediate"])
        attention = 12 * shape["layers"] * shape["hidden"]
        padded = tokenwise * pad["train_padded"] + attention * pad["train_padded_squares"]
        saved = tokenwise * (pad["train_padded"] - pad["train_tokens"]) / padded
        found.append(
            Suggestion(
                "unpad",
                "run the encoder's token-wise layers on the real tokens only (padding-free layers)",
                evidence,
                ["--unpad"],
                gain=amdahl(train_share * saved),
                gain_kind="estimate",
                factor=f"forward and backward time x(1 - {saved:.0%}): the token-wise matmul "
                "FLOPs on padding positions, taken as time (attention stays padded)",
                changes_result=changes.does(["--unpad"]),
            )
        )
    if eval_saved and view.setting("eval_order") != "length":  # in length order already: what is left stays
        found.append(
            Suggestion(
                "eval_order",
                "evaluate in length order (the same samples, less padding)",
                evidence,
                ["--eval-order", "length"],
                gain=amdahl(eval_share * eval_saved),
                gain_kind="estimate",
                factor=f"evaluation time x(1 - {eval_saved:.0%}): its padding FLOPs taken as time",
                changes_result=changes.does(["--eval-order"]),
            )
        )
    return [suggestion for suggestion in found if suggestion.gain >= MIN_GAIN]


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


def _bf16_at_start(view: RunView) -> str:
    """What a record without its model timed says of bf16: the machine's matmuls at start-up, not this run's share."""
    speedup = view.cpu_bf16.get("speedup")
    if not speedup:
        return view.device_name
    return (
        f"{view.device_name}: bf16 matmuls measured {speedup:.2f}x fp32's at the start of the run (the machine's "
        "peak shapes, not this run's share of its time)"
    )


def gpu_precision(view: RunView) -> list[Suggestion]:
    """A GPU record without its model timed (cpu_precision speaks where it was): the datasheet's peak ratio."""
    if not view.on_cuda or view.precision != "fp32" or estimates.timed(view):
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


CONFIGS = {"bf16": "bf16", "fp16": "fp16"}  # the Accelerate config (accelerate_configs/<name>.yaml) of a precision


def cpu_precision(view: RunView) -> list[Suggestion]:
    """Mixed precision from the run's own measurement: its model timed alone in each precision the device runs
    against its share of the micro-batch (trainscope.advice.estimates.precision); on a CPU record without that timing,
    the matmul rates recorded at the model's GEMM shapes. The best precision by its estimate, where it leaves
    MIN_GAIN; an estimate that cannot be made is said where the CPU's bf16 matmuls measured faster."""
    if view.precision != "fp32" or not (view.on_cpu or estimates.timed(view)):
        return []
    targets = [p for p in estimates.precisions(view) if p in CONFIGS or (p == "tf32" and view.on_cuda)]
    if not targets and view.on_cpu and view.cpu_bf16:  # an older record: its bf16 matmuls timed at start-up only
        targets = ["bf16"]
    found = [(target, estimates.guarded(estimates.precision, view, target)) for target in targets]
    usable = [(target, e) for target, e in found if e.gain is not None]
    if not usable:  # said where it matters: a failure inside the estimate, or bf16 measured faster on this CPU
        missed = next((e for t, e in found if e.failed or (t == "bf16" and view.cpu_bf16.get("faster"))), None)
        if missed is None:
            return []
        target, estimate, failed = next(t for t, e in found if e is missed), None, missed.unavailable
    else:
        target, estimate = max(usable, key=lambda pair: pair[1].gain)
        if estimate.gain < MIN_GAIN:
            return []
        failed = None
    bf16 = view.cpu_bf16
    flags = (
        f"; the CPU's flags: {', '.join(bf16['flags'])}"
        if bf16.get("flags")
        else {True: "; native bf16 by its flags", False: "; no native-bf16 flag listed", None: ""}[
            bf16.get("native_by_flags")
        ]
        if view.on_cpu
        else ""
    )
    config = CONFIGS.get(target)
    return [
        Suggestion(
            "cpu_precision" if view.on_cpu else "precision",
            f"train in {target} autocast" if config else "allow TF32 matmuls",
            (estimate.evidence if estimate else _bf16_at_start(view)) + flags,
            [] if config else ["--tf32"],
            config=config,
            gain=estimate.gain if estimate else None,
            gain_kind="estimate" if estimate else None,
            interval=(estimate.low, estimate.high) if estimate else None,
            assumes=estimate.assumes if estimate else None,
            estimate_unavailable=failed,
            changes_result=f"{target} rounding" + (" (losses agree to about 1e-2)" if target == "bf16" else ""),
        )
    ]


def batch(view: RunView) -> list[Suggestion]:
    """A doubled micro-batch on a CPU, from the run's own measurement: its model timed on twice the rows
    (trainscope.advice.estimates.batch). On a GPU the memory-based rules speak (gpu_batch, host_bound)."""
    if view.on_cuda or not estimates.timed(view):
        return []
    estimate = estimates.guarded(estimates.batch, view)
    if (estimate.gain is None and not estimate.failed) or (estimate.gain is not None and estimate.gain < MIN_GAIN):
        return []
    size = view.setting("per_device_batch_size") or view.micro_batch_samples
    steps = view.setting("gradient_accumulation_steps", 1) or 1
    halves = steps % 2 == 0
    flags = ["--per-device-batch-size", str(2 * size)] + (
        ["--gradient-accumulation-steps", str(steps // 2)] if halves else []
    )
    return [
        Suggestion(
            "batch",
            f"double the per-device batch to {2 * size}" + (" and halve accumulation" if halves else ""),
            estimate.evidence or "the run's model timed on twice the rows",
            flags,
            gain=estimate.gain,
            gain_kind="estimate" if estimate.gain is not None else None,
            interval=(estimate.low, estimate.high) if estimate.gain is not None else None,
            assumes=estimate.assumes or None,
            estimate_unavailable=estimate.unavailable,
            confidence="low",
            changes_result=None
            if halves
            else "the effective batch doubles and the optimizer takes half the steps (the learning rate is not scaled)",
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
