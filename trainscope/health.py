"""Health warnings: conditions under which a run's figures are doubtful, as {code, message} items.

`check(record)` is pure: it reads the record's settings, environment and summary (what is absent is
not checked) and returns the warnings in a fixed order. train.py stores them in the record's
`warnings` list and prints them at the end of the run; the report prints them beside every figure
taken from that run, and the advisor ranks them first.
"""

# Fewer steady steps than this and a steady-state figure rests on too few samples.
MIN_STEADY_STEPS = 10
# Evaluation above this share of wall time: the run measures evaluation more than training.
EVAL_SHARE_LIMIT = 0.5

CODES = {
    "threads_below_budget": "fewer torch threads than the cores this process may use",
    "threads_above_budget": "more torch threads than this process's share of the cores (oversubscribed)",
    "profiler_on": "the profiler was on while stages were timed",
    "bf16_emulated": "bf16 on a CPU without native bf16 (AVX512-BF16 / AMX): emulated and slow",
    "fp16_unavailable": "fp16 was requested but the device ran another precision",
    "recompiles": "torch.compile recompiled during the run",
    "tf32_implicit": "TF32 matmuls were in effect without --tf32",
    "eval_dominates": "evaluation took most of the wall time",
    "few_steady_steps": "too few steady-state steps for a steady-state figure",
    "stage_memory_every_step": "per-stage memory statistics read at every step cost time on CUDA",
    "mfu_unknown": "no datasheet peak for this GPU: no MFU",
    "max_seq_length_clamped": "--max-seq-length was above what the model's position embeddings allow",
}


def warning(code: str, message: str) -> dict:
    if code not in CODES:
        raise ValueError(f"unknown warning code {code!r}")
    return {"code": code, "message": " ".join(message.split())}


def check(record: dict) -> list[dict]:
    """Every warning the record's conditions call for."""
    settings = record.get("settings") or {}
    env = record.get("environment") or {}
    summary = record.get("summary") or {}
    found = []
    for rule in (_threads, _profiler, _precision, _tf32, _compile, _memory_statistics, _evaluation, _steady,
                 _mfu, _sequence_length):
        found += rule(settings, env, summary)
    return found


def _threads(settings, env, summary):
    threads = env.get("threads")
    if not threads:
        return []
    have, budget = threads["torch_threads"], threads["thread_budget"]
    where = (f"{have} torch threads, budget {budget} ({threads['usable_cores']} usable cores / "
             f"{threads['local_processes']} processes on this node; source: {threads['threads_source']})")
    if have < budget:
        return [warning("threads_below_budget", f"{where}: the run used less CPU than it could, so its speed "
                        "understates the machine (--threads auto sets the budget)")]
    if have > budget:
        return [warning("threads_above_budget", f"{where}: processes compete for cores, so speed varies "
                        "and understates the machine")]
    return []


def _profiler(settings, env, summary):
    if settings.get("profile"):
        return [warning("profiler_on", "--profile traced steps while stages were timed: the traced steps are "
                        "slower; take stage shares from a run without --profile")]
    return []


def _precision(settings, env, summary):
    found = []
    effective, requested = env.get("effective_precision"), env.get("requested_precision")
    if effective == "bf16" and str(env.get("device", "")).startswith("cpu") and env.get("cpu_native_bf16") is False:
        found.append(warning("bf16_emulated", f"bf16 autocast on {env.get('device_name', 'this CPU')} "
                             f"({env.get('cpu_capability', 'no AVX512-BF16/AMX')}) is emulated in software: its "
                             "speed says nothing about bf16 on a GPU or a CPU with AMX"))
    if requested == "fp16" and effective not in (None, "fp16"):
        found.append(warning("fp16_unavailable", f"fp16 was requested but {env.get('device', 'the device')} "
                             f"ran {effective}: figures are {effective} figures"))
    return found


def _tf32(settings, env, summary):
    if env.get("tf32_in_effect") and not settings.get("tf32"):
        return [warning("tf32_implicit", "TF32 matmuls were in effect although --tf32 was not given: an 'fp32' "
                        "figure is a TF32 figure")]
    return []


def _compile(settings, env, summary):
    recompiles = (summary.get("compile") or {}).get("recompiles") or 0
    if recompiles > 0:
        return [warning("recompiles", f"torch.compile recompiled {recompiles} times (new input shapes): "
                        "compile time leaked into training steps; --pad-to-max-length gives one shape")]
    return []


def _memory_statistics(settings, env, summary):
    if str(env.get("device", "")).startswith("cuda") and settings.get("memory_every") == 1:
        return [warning("stage_memory_every_step", "--memory-every 1 reads the allocator at every stage "
                        "boundary: a few percent of step time on fast GPUs")]
    return []


def _evaluation(settings, env, summary):
    shares = (((summary.get("timing") or {}).get("across_ranks") or {}).get("run") or {}).get("shares") or {}
    eval_share = (shares.get("eval") or {}).get("median")
    if eval_share is not None and eval_share > EVAL_SHARE_LIMIT:
        return [warning("eval_dominates", f"evaluation took {eval_share:.0%} of wall time: the time breakdown "
                        "describes evaluation more than training (--max-eval-samples, --max-test-samples)")]
    return []


def _steady(settings, env, summary):
    throughput = summary.get("throughput")
    if not throughput:
        return []
    steps = throughput.get("optimizer_steps") or 0
    if steps < MIN_STEADY_STEPS:
        return [warning("few_steady_steps", f"only {steps} steady-state optimizer steps (at least "
                        f"{MIN_STEADY_STEPS} wanted): throughput rests on few samples")]
    return []


def _mfu(settings, env, summary):
    if str(env.get("device", "")).startswith("cuda") and "mfu" in summary and summary["mfu"] is None:
        return [warning("mfu_unknown", f"{env.get('device_name')} is not in the datasheet peak table "
                        "(trainscope/flops.py) for this precision: MFU is not computed rather than guessed")]
    return []


def _sequence_length(settings, env, summary):
    limit = env.get("model_sequence_limit")
    requested = env.get("requested_max_seq_length")
    if limit is not None and requested is not None and requested > limit:
        return [warning("max_seq_length_clamped", f"--max-seq-length {requested} is above the model's {limit} "
                        f"positions: sequences were truncated to {limit}")]
    return []
