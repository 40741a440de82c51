"""From one run record to "what to try next": ranked suggestions, each with its evidence and a bound.

Every rule reads the record and either stays silent or returns a `Suggestion`: the exact change (train.py
flags, or an Accelerate config), the evidence from the record, an upper bound of the speed-up the
evidence allows, and a confidence. Bounds are Amdahl's law on the measured shares (Amdahl 1967): a
change that removes (or shrinks by a factor) a part taking a share `s` of the time can speed the whole
up by at most 1 / (1 - s) (or 1 / (1 - s + s / factor)) -- not fixed thresholds. Rules stay silent when
their bound is below MIN_GAIN. Health warnings of the record come first: they make the figures
themselves doubtful, so they are fixed before anything is tuned on them.

`make tune` (trainscope.tune) takes the suggestions that carry flags, tries them and keeps what is
measurably faster.
"""

from dataclasses import asdict, dataclass, field

from trainscope.flops import peak_tflops

MIN_GAIN = 1.02  # a bound below 2% is not worth a trial on a noisy machine
FIX_FIRST = {  # warning code -> what to change so the figures can be trusted
    "threads_below_budget": (["--threads", "auto"], "give each process its share of the cores"),
    "threads_above_budget": (["--threads", "auto"], "stop the processes oversubscribing the cores"),
    "profiler_on": ([], "time without --profile (profile in a separate run)"),
    "bf16_emulated": ([], "compare speed in fp32 on this CPU (bf16 is emulated here); measure bf16 on a GPU or an AMX CPU"),
    "fp16_unavailable": ([], "use a config whose precision this device runs (fp16 needs CUDA)"),
    "tf32_implicit": (["--tf32"], "ask for TF32 explicitly, or keep true fp32: an implicit TF32 figure is mislabeled"),
    "recompiles": (["--pad-to-max-length"], "give torch.compile one input shape"),
    "few_steady_steps": ([], "run more steps (--max-steps) so the steady phase has enough samples"),
    "eval_dominates": (["--max-eval-samples", "1000", "--max-test-samples", "1000"], "evaluate on fewer samples"),
    "stage_memory_every_step": (["--memory-every", "10"], "sample per-stage memory every 10 steps"),
    "mfu_unknown": ([], "add the device's datasheet peak to trainscope/flops.py"),
    "max_seq_length_clamped": ([], "lower --max-seq-length to the model's limit"),
}


@dataclass
class Suggestion:
    rule: str
    change: str
    evidence: str
    flags: list = field(default_factory=list)  # train.py flags that make the change ([] when it is not a flag)
    config: str | None = None                   # an Accelerate config to launch with instead
    bound: float | None = None                  # at most this many times faster (None: no speed claim)
    confidence: str = "medium"                  # high / medium / low
    fix_first: bool = False                     # a health warning: the figures themselves are doubtful
    changes_result: str | None = None           # what the change alters in what is learned, if anything

    def to_dict(self) -> dict:
        return asdict(self)


def amdahl(share: float, factor: float | None = None) -> float:
    """Upper bound of the whole's speed-up when a part of `share` becomes `factor` times faster (None: free)."""
    remaining = 0.0 if factor is None else share / factor
    return 1.0 / max(1e-9, 1.0 - share + remaining)


def steady(record: dict) -> dict:
    """Steady-phase shares (median over ranks) and the facts the rules share."""
    timing = record["summary"]["timing"]["across_ranks"]
    phase = "steady" if timing["steady"]["wall_s"]["median"] > 0 else "run"
    shares = {stage: value["median"] for stage, value in timing[phase]["shares"].items()}
    run_shares = {stage: value["median"] for stage, value in timing["run"]["shares"].items()}
    return {"shares": shares, "run_shares": run_shares, "settings": record["settings"], "env": record["environment"],
            "summary": record["summary"], "model": record.get("model") or {}}


def advise(record: dict) -> list[Suggestion]:
    """Every suggestion the record supports: health warnings first, then by bound, largest first."""
    facts = steady(record)
    found = [s for rule in RULES for s in rule(facts)]
    for warning in record.get("warnings", []):
        fix = fix_first(warning)
        same = next((s for s in found if fix.flags and s.flags == fix.flags), None)
        if same:  # the rule's suggestion is the fix: one item, ranked first, with the rule's bound
            same.fix_first, same.evidence = True, f"{same.evidence}; {fix.evidence}"
        else:
            found.append(fix)
    return sorted(found, key=lambda s: (not s.fix_first, -(s.bound or 1.0)))


def fix_first(warning: dict) -> Suggestion:
    flags, change = FIX_FIRST.get(warning["code"], ([], "see the warning"))
    return Suggestion(f"warning:{warning['code']}", change, warning["message"], list(flags), fix_first=True,
                      confidence="high")


# ---------------------------------------------------------------- the rules


def data_loading(f) -> list[Suggestion]:
    share, s = f["shares"]["data"], f["settings"]
    threads = f["env"]["threads"]
    bound = amdahl(share)
    if bound < MIN_GAIN:
        return []
    budget = threads["thread_budget"]
    workers = max(1, min(4, budget - 1)) if s["num_workers"] == 0 else min(2 * s["num_workers"], max(1, budget))
    flags = ["--num-workers", str(workers)]
    if str(f["env"]["device"]).startswith("cuda") and not s.get("pin_memory"):
        flags.append("--pin-memory")
    if s.get("epochs", 1) > 1:
        flags.append("--persistent-workers")
    evidence = (f"data {share:.1%} of the steady step, {s['num_workers']} workers, {threads['usable_cores']} usable "
                f"cores / {threads['local_processes']} processes = {budget} per process")
    confidence = "high" if budget >= 4 else "low"  # with 2 cores a worker takes a core from the compute threads
    return [Suggestion("data_loading", f"load batches in {workers} worker process(es)", evidence, flags, bound=bound,
                       confidence=confidence)]


def threads(f) -> list[Suggestion]:
    t = f["env"]["threads"]
    if t["threads_source"] == "auto" or t["torch_threads"] == t["thread_budget"]:
        return []
    below = t["torch_threads"] < t["thread_budget"]
    compute = sum(f["shares"][s] for s in ("forward", "backward", "optimizer"))
    bound = amdahl(compute, t["thread_budget"] / t["torch_threads"]) if below else None
    evidence = (f"{t['torch_threads']} torch threads, budget {t['thread_budget']} ({t['usable_cores']} usable cores / "
                f"{t['local_processes']} processes; source {t['threads_source']})")
    return [Suggestion("threads", "use each process's share of the cores as threads", evidence, ["--threads", "auto"],
                       bound=bound, confidence="high" if below else "medium")]


def padding(f) -> list[Suggestion]:
    throughput, s = f["summary"]["throughput"], f["settings"]
    padded, real = throughput.get("padded_tokens"), throughput.get("tokens")
    if s.get("group_by_length") or s.get("pad_to_max_length") or not padded or not real:
        return []
    waste = 1 - real / padded
    compute = f["run_shares"]["forward"] + f["run_shares"]["backward"] + f["run_shares"]["eval"]
    bound = amdahl(compute * waste)  # the kernels' work is proportional to the padded length
    if bound < MIN_GAIN:
        return []
    return [Suggestion("padding", "batch sequences of similar length (and evaluate in length order)",
                       f"{waste:.0%} of the token positions processed are padding ({real} real of {padded}); forward, "
                       f"backward and evaluation take {compute:.0%} of the wall time", ["--group-by-length"],
                       bound=bound, confidence="high",
                       changes_result="training batches are grouped by length (the same samples, another order)")]


def evaluation(f) -> list[Suggestion]:
    share, s = f["run_shares"]["eval"], f["settings"]
    current = s.get("eval_batch_size") or 2 * s["per_device_batch_size"]
    bound = amdahl(share, 1.25)  # a larger eval batch amortizes per-batch overhead; no more than a quarter, here
    if share < 0.05 or bound < MIN_GAIN:
        return []
    return [Suggestion("evaluation", f"evaluate in batches of {2 * current} (or on fewer samples)",
                       f"evaluation {share:.1%} of the wall time at batch {current}",
                       ["--eval-batch-size", str(2 * current)], bound=bound, confidence="low")]


def optimizer(f) -> list[Suggestion]:
    share = f["shares"]["optimizer"]
    facts = f["model"].get("optimizer") or {}
    if facts.get("fused", True) or amdahl(share, 3) < MIN_GAIN:
        return []
    return [Suggestion("optimizer", "use the fused (or foreach) AdamW: one kernel per step instead of one per tensor",
                       f"optimizer {share:.1%} of the steady step, {facts.get('name')} not fused", [],
                       bound=amdahl(share, 3), confidence="medium")]


def gpu_precision(f) -> list[Suggestion]:
    env = f["env"]
    if not str(env.get("device", "")).startswith("cuda") or env.get("effective_precision") != "fp32":
        return []
    fp32, bf16 = peak_tflops(env["device_name"], "fp32"), peak_tflops(env["device_name"], "bf16")
    if not fp32 or not bf16:
        return []
    compute = f["shares"]["forward"] + f["shares"]["backward"]
    return [Suggestion("precision", "train in bf16 (accelerate_configs/bf16.yaml), or allow TF32 with --tf32",
                       f"fp32 on {env['device_name']}: dense peaks {fp32:g} TFLOP/s fp32, {bf16:g} bf16; forward and "
                       f"backward {compute:.0%} of the step", config="bf16", bound=amdahl(compute, bf16 / fp32),
                       confidence="medium", changes_result="bf16 rounding (losses agree to about 1e-2)")]


def gpu_batch(f) -> list[Suggestion]:
    summary, env, s = f["summary"], f["env"], f["settings"]
    total, mfu = env.get("device_memory_gib"), summary.get("mfu")
    used = (summary["memory"].get("max_allocated_gib") or {}).get("max")
    if not (total and used and mfu is not None):
        return []
    found = []
    if mfu < 0.3 and used < 0.5 * total:
        batch, steps = 2 * s["per_device_batch_size"], s["gradient_accumulation_steps"]
        flags = ["--per-device-batch-size", str(batch)]
        if steps % 2 == 0:
            flags += ["--gradient-accumulation-steps", str(steps // 2)]
        found.append(Suggestion("batch", f"double the per-device batch to {batch}" + (" and halve accumulation" if
                                steps % 2 == 0 else ""), f"MFU {mfu:.0%} with {used:.1f} of {total:.0f} GiB in use",
                                flags, bound=min(2.0, 0.5 / max(mfu, 1e-3)), confidence="medium",
                                changes_result=None if steps % 2 == 0 else "the effective batch doubles"))
    if used > 0.9 * total:
        found.append(Suggestion("memory", "add --gradient-checkpointing (or --lora) to make room",
                                f"{used:.1f} of {total:.0f} GiB allocated at the peak", ["--gradient-checkpointing"],
                                confidence="medium"))
    return found


def communication(f) -> list[Suggestion]:
    block = f["summary"].get("communication") or {}
    if not block.get("measured") or not block.get("exposed_share"):
        return []
    share = block["exposed_share"]
    if amdahl(share) < MIN_GAIN:
        return []
    s = f["settings"]
    evidence = (f"exposed communication {block['exposed_s'] * 1e3:.1f} ms, {share:.1%} of the step; the all-reduce alone "
                f"{block['total_allreduce_s'] * 1e3:.1f} ms, {block['overlap']:.0%} hidden")
    found = [Suggestion("ddp_buckets", "smaller buckets start the all-reduce earlier in backward (more overlap)",
                        evidence, ["--ddp-bucket-cap-mb", "5"], bound=amdahl(share), confidence="low")]
    if s.get("ddp_comm_hook") == "none":
        found.append(Suggestion("ddp_compression", "all-reduce gradients in fp16 (half the bytes)", evidence,
                                ["--ddp-comm-hook", "fp16"], bound=amdahl(share, 2), confidence="medium",
                                changes_result="gradients rounded to fp16 before the all-reduce"))
    found.append(Suggestion("ddp_accumulation", "accumulate 2 micro-batches per all-reduce (no_sync on the first)",
                            evidence, ["--gradient-accumulation-steps", str(2 * s["gradient_accumulation_steps"])],
                            bound=amdahl(share, 2), confidence="medium", changes_result="the effective batch doubles"))
    return found


RULES = [data_loading, threads, padding, evaluation, optimizer, gpu_precision, gpu_batch, communication]


def lines(suggestions: list[Suggestion]) -> list[str]:
    """The ranked list for the console and the report."""
    out = []
    for rank, s in enumerate(suggestions, 1):
        what = " ".join(s.flags) or (f"--config_file accelerate_configs/{s.config}.yaml" if s.config else "")
        bound = f"at most {s.bound:.2f}x faster" if s.bound else ("fix first: the figures are doubtful" if s.fix_first
                                                                   else "no speed claim")
        out.append(f"{rank}. {s.change}" + (f" (`{what}`)" if what else "") + f" -- {bound}, confidence {s.confidence}.")
        out.append(f"   evidence: {s.evidence}" + (f"; changes: {s.changes_result}" if s.changes_result else ""))
    return out or ["No suggestion: no measured share leaves 2% to gain."]
