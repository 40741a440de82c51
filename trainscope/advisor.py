"""From one run record to "what to try next": ranked suggestions, each with its evidence and its gain.

Every rule reads the record's typed view and either stays silent or returns a `Suggestion`: the exact
change (train.py flags, or an Accelerate config), the evidence from the record, the gain and a
confidence. A gain is one of two kinds, and the advice says which:

* **at most** (`gain_kind="bound"`): Amdahl's law on a measured share and nothing else (Amdahl 1967). A
  change that removes a part taking a share `s` of the time can speed the whole up by at most
  1 / (1 - s); the padding bound counts the FLOPs spent on padding positions from the record's token
  counts and the model's shape (trainscope.flops).
* **estimate** (`gain_kind="estimate"`): Amdahl's law with an assumed or separately measured factor for
  the part that changes (bf16 matmuls k times faster, a fused optimizer 3x); the factor is stated. Where the run
  recorded a prediction, a precision, batch or evaluation-batch estimate is the predictor's instead
  (trainscope.predict.speedup).

Rules fire only for the hardware in the record: no kernel-launch argument on a CPU, no NCCL argument on
gloo. Rules stay silent when their gain is below MIN_GAIN. Health warnings of the record come first,
with the fix their registry entry (trainscope.health) offers.

`make tune` (trainscope.tune) takes the suggestions that carry flags or a config, tries them and keeps
what is measurably faster.
"""

from dataclasses import asdict, dataclass, field

from trainscope import health, launching
from trainscope.flops import padding_flops_share, peak_tflops
from trainscope.record_view import RunView

MIN_GAIN = 1.02  # a gain below 2% is not worth a trial on a noisy machine
NATIVE_BF16_MIN_SPEEDUP = 1.1  # a measured bf16 matmul speed-up below this is not worth a precision change


@dataclass
class Suggestion:
    rule: str
    change: str
    evidence: str
    flags: list = field(default_factory=list)  # train.py flags that make the change ([] when it is not a flag)
    config: str | None = None                   # an Accelerate config to launch with instead
    gain: float | None = None                   # the whole run this many times faster (None: no speed claim)
    gain_kind: str | None = None                # "bound" (at most, Amdahl on a measured share) or "estimate"
    factor: str | None = None                   # for an estimate: the assumed or measured factor, said
    confidence: str = "medium"                  # high / medium / low
    fix_first: bool = False                     # a health warning: the figures themselves are doubtful
    changes_result: str | None = None           # what the change alters in what is learned, if anything

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
    found = [s for s in (predicted(view, s) for s in found) if s is not None]
    for warning in view.warnings:
        fix = fix_first(warning)
        same = next((s for s in found if fix.flags and s.flags == fix.flags), None)
        if same:  # the rule's suggestion is the fix: one item, ranked first, with the rule's gain
            same.fix_first, same.evidence = True, f"{same.evidence}; {fix.evidence}"
        else:
            found.append(fix)
    return sorted(found, key=lambda s: (not s.fix_first, -(s.gain or 1.0)))


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
    return Suggestion(f"warning:{warning['code']}", change, warning["message"], flags, fix_first=True,
                      confidence="high")


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
    evidence = (f"data {share:.1%} of the steady step, {workers_now} workers, {threads['usable_cores']} usable "
                f"cores / {threads['local_processes']} processes = {budget} per process")
    confidence = "high" if budget >= 4 else "low"  # with 2 cores a worker takes a core from the compute threads
    return [Suggestion("data_loading", f"load batches in {workers} worker process(es)", evidence, flags, gain=gain,
                       gain_kind="bound", confidence=confidence)]


def threads(view: RunView) -> list[Suggestion]:
    t = view.threads
    if not t or t["threads_source"] == "auto" or t["torch_threads"] == t["thread_budget"]:
        return []
    below = t["torch_threads"] < t["thread_budget"]
    compute = sum(view.shares().get(s, 0.0) for s in ("forward", "backward", "optimizer"))
    ratio = t["thread_budget"] / t["torch_threads"]
    evidence = (f"{t['torch_threads']} torch threads, budget {t['thread_budget']} ({t['usable_cores']} usable cores / "
                f"{t['local_processes']} processes; source {t['threads_source']})")
    return [Suggestion("threads", "use each process's share of the cores as threads", evidence, ["--threads", "auto"],
                       gain=amdahl(compute, ratio) if below else None, gain_kind="estimate" if below else None,
                       factor=f"compute x{ratio:g}: linear scaling with threads assumed" if below else None,
                       confidence="high" if below else "medium")]


def padding(view: RunView) -> list[Suggestion]:
    pad, shape = view.padding, view.model_facts.get("shape")
    if view.setting("group_by_length") or view.setting("pad_to_max_length") or not pad["train_padded"]:
        return []
    run_shares = view.shares("run")
    train_share = run_shares.get("forward", 0.0) + run_shares.get("backward", 0.0)
    eval_share = run_shares.get("eval", 0.0)
    waste = 1 - pad["train_tokens"] / pad["train_padded"]
    train_saved = padding_flops_share(shape, pad["train_tokens"], pad["train_padded"], pad["train_samples"],
                                      pad["train_padded_squares"], training=True)
    eval_saved = padding_flops_share(shape, pad["eval_tokens"], pad["eval_padded"], pad["eval_samples"],
                                     pad["eval_padded_squares"], training=False)
    assumed = []
    if train_saved is None:  # a record without the model's shape: the FLOPs share taken as the positions' share
        train_saved = waste
        assumed.append("padding's FLOPs share taken as its share of positions (the record lacks the model's shape)")
    if eval_saved is None:
        assumed.append("evaluation padded like training (its token counts are not recorded)")
    gain = amdahl(train_share * train_saved + eval_share * (train_saved if eval_saved is None else eval_saved))
    if gain < MIN_GAIN:
        return []
    flops = "" if shape is None else f", {train_saved:.0%} of training FLOPs at most"
    evidence = (f"{waste:.0%} of the training token positions are padding ({pad['train_tokens']} real of "
                f"{pad['train_padded']}){flops}; forward and backward take {train_share:.0%} of the wall time, "
                f"evaluation {eval_share:.0%}")
    if eval_saved is not None:
        evidence += f" ({1 - pad['eval_tokens'] / pad['eval_padded']:.0%} of its positions padding)"
    return [Suggestion("padding", "batch sequences of similar length (and evaluate in length order)", evidence,
                       ["--group-by-length"], gain=gain, gain_kind="estimate" if assumed else "bound",
                       factor="; ".join(assumed) or None, confidence="high",
                       changes_result="training batches are grouped by length (the same samples, another order)")]


def evaluation(view: RunView) -> list[Suggestion]:
    share = view.shares("run").get("eval", 0.0)
    if not view.on_cuda:  # the gain comes from fewer kernel launches per sample: a GPU cost
        return []
    current = view.setting("eval_batch_size") or 2 * view.setting("per_device_batch_size", 32)
    gain = amdahl(share, 1.25)
    if share < 0.05 or gain < MIN_GAIN:
        return []
    return [Suggestion("evaluation", f"evaluate in batches of {2 * current} (or on fewer samples)",
                       f"evaluation {share:.1%} of the wall time at batch {current} on {view.device_name}",
                       ["--eval-batch-size", str(2 * current)], gain=gain, gain_kind="estimate",
                       factor="evaluation x1.25 from fewer kernel launches per sample (assumed)", confidence="low")]


def optimizer(view: RunView) -> list[Suggestion]:
    share = view.shares().get("optimizer", 0.0)
    facts = view.model_facts.get("optimizer") or {}
    if not view.on_cuda or facts.get("fused", True) or amdahl(share, 3) < MIN_GAIN:
        return []
    return [Suggestion("optimizer", "use the fused (or foreach) AdamW: one kernel per step instead of one per tensor",
                       f"optimizer {share:.1%} of the steady step, {facts.get('name')} not fused", [],
                       gain=amdahl(share, 3), gain_kind="estimate", factor="optimizer x3 when fused (assumed)")]


def gpu_precision(view: RunView) -> list[Suggestion]:
    if not view.on_cuda or view.precision != "fp32":
        return []
    fp32, bf16 = peak_tflops(view.device_name, "fp32"), peak_tflops(view.device_name, "bf16")
    if not fp32 or not bf16:
        return []
    compute = view.shares().get("forward", 0.0) + view.shares().get("backward", 0.0)
    return [Suggestion("precision", "train in bf16 (accelerate_configs/bf16.yaml), or allow TF32 with --tf32",
                       f"fp32 on {view.device_name}: dense peaks {fp32:g} TFLOP/s fp32, {bf16:g} bf16; forward and "
                       f"backward {compute:.0%} of the step", config="bf16", gain=amdahl(compute, bf16 / fp32),
                       gain_kind="estimate", factor=f"forward and backward x{bf16 / fp32:.1f}, the datasheet peak ratio",
                       changes_result="bf16 rounding (losses agree to about 1e-2)")]


def cpu_precision(view: RunView) -> list[Suggestion]:
    """A CPU with AVX512-BF16 or AMX runs bf16 matmuls natively: suggest bf16 autocast, with the matmul
    speed-up measured on this machine at start-up (environment.cpu_bf16_matmul)."""
    measured = view.env.get("cpu_bf16_matmul") or {}
    speedup = measured.get("speedup")
    if not view.on_cpu or view.precision != "fp32" or not view.env.get("cpu_native_bf16") or not speedup:
        return []
    run_shares = view.shares("run")
    compute = run_shares.get("forward", 0.0) + run_shares.get("backward", 0.0) + run_shares.get("eval", 0.0)
    gain = amdahl(compute, speedup)
    if speedup < NATIVE_BF16_MIN_SPEEDUP or gain < MIN_GAIN:
        return []
    return [Suggestion("cpu_precision", "train in bf16 autocast (accelerate_configs/bf16.yaml): this CPU computes "
                       "bf16 natively", f"{view.env.get('cpu_capability')}; a {measured['size']}x{measured['size']} "
                       f"matmul at {measured['threads']} threads ran {speedup:.2f}x faster in bf16 autocast than fp32 "
                       f"here; forward, backward and evaluation take {compute:.0%} of the wall time", config="bf16",
                       gain=gain, gain_kind="estimate",
                       factor=f"all of forward, backward and evaluation x{speedup:.2f}, the measured matmul speed-up",
                       confidence="medium", changes_result="bf16 rounding (losses agree to about 1e-2)")]


def gpu_batch(view: RunView) -> list[Suggestion]:
    total, mfu, used = view.device_memory_gib, view.mfu, view.max_allocated_gib
    if not (view.on_cuda and total and used and mfu is not None):
        return []
    found = []
    if mfu < 0.3 and used < 0.5 * total:
        batch, steps = 2 * view.setting("per_device_batch_size"), view.setting("gradient_accumulation_steps", 1)
        flags = ["--per-device-batch-size", str(batch)]
        if steps % 2 == 0:
            flags += ["--gradient-accumulation-steps", str(steps // 2)]
        found.append(Suggestion("batch", f"double the per-device batch to {batch}" + (" and halve accumulation" if
                                steps % 2 == 0 else ""), f"MFU {mfu:.0%} with {used:.1f} of {total:.0f} GiB in use",
                                flags, gain=min(2.0, 0.5 / max(mfu, 1e-3)), gain_kind="estimate",
                                factor="MFU rising towards 50% with the batch (assumed)", confidence="medium",
                                changes_result=None if steps % 2 == 0 else "the effective batch doubles"))
    if used > 0.9 * total:
        found.append(Suggestion("memory", "add --gradient-checkpointing (or --lora) to make room",
                                f"{used:.1f} of {total:.0f} GiB allocated at the peak", ["--gradient-checkpointing"],
                                confidence="medium"))
    return found


def communication(view: RunView) -> list[Suggestion]:
    block = view.communication or {}
    share = block.get("exposed_share")
    if not block.get("measured") or not share or share <= 0 or amdahl(share) < MIN_GAIN:
        return []
    evidence = (f"exposed communication {block['exposed_s'] * 1e3:.1f} ms, {share:.1%} of the step; the same buckets' "
                f"all-reduces alone {block['total_allreduce_s'] * 1e3:.1f} ms on {view.backend}")
    found = []
    if view.backend in ("nccl", "xccl"):  # bucket timing and compression pay off where the link is the limit
        found.append(Suggestion("ddp_buckets", "smaller buckets start the all-reduce earlier in backward (more overlap)",
                                evidence, ["--ddp-bucket-cap-mb", "5"], gain=amdahl(share), gain_kind="bound",
                                confidence="low"))
        if view.setting("ddp_comm_hook") == "none":
            found.append(Suggestion("ddp_compression", "all-reduce gradients in fp16 (half the bytes)", evidence,
                                    ["--ddp-comm-hook", "fp16"], gain=amdahl(share, 2), gain_kind="estimate",
                                    factor="communication x2 from half the bytes (assumed)",
                                    changes_result="gradients rounded to fp16 before the all-reduce"))
    found.append(Suggestion("ddp_accumulation", "accumulate 2 micro-batches per all-reduce (no_sync on the first)",
                            evidence, ["--gradient-accumulation-steps", str(2 * view.setting("gradient_accumulation_steps", 1))],
                            gain=amdahl(share, 2), gain_kind="estimate", factor="half the all-reduces per sample",
                            changes_result="the effective batch doubles"))
    return found


RULES = [data_loading, threads, padding, evaluation, optimizer, gpu_precision, cpu_precision, gpu_batch,
         communication]


def lines(suggestions: list[Suggestion]) -> list[str]:
    """The ranked list for the console and the report."""
    out = []
    for rank, s in enumerate(suggestions, 1):
        what = " ".join(s.flags) or (launching.config_argument(s.config) if s.config else "")
        out.append(f"{rank}. {s.change}" + (f" (`{what}`)" if what else "") + f" -- {s.gain_text()}, "
                   f"confidence {s.confidence}.")
        out.append(f"   evidence: {s.evidence}" + (f"; changes: {s.changes_result}" if s.changes_result else ""))
    return out or ["No suggestion: no measured share leaves 2% to gain."]
