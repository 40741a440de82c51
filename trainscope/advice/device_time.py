"""The advisor's rules on where the device's time went: a GPU that waits for the host, and the gap rules.

How it works: docs/tune.md#in-the-code-how-the-advisor-reasons-trainscopeadviceadvisorpy.
"""

from trainscope.advice import changes, estimates
from trainscope.advice.rules import (
    MIN_GAIN,
    Suggestion,
    amdahl,
    data_loading,
    optimizer,
)
from trainscope.core.record_view import RunView

# torch.compile (inductor) fuses chains of elementwise operators (dropout, layer norm, activations, casts, softmax)
# into one pass over memory: their time assumed halved. Its compile time, assumed where the record has none (what
# make bench-compile measured: docs/benchmarks.md#committed-results), is counted against the gain.
FUSION_FACTOR = 2.0
ASSUMED_COMPILE_S = {"cpu": 30.0, "cuda": 40.0}
ELEMENTWISE = ("attention", "dropout", "layer norm", "activation", "copies and casts")
# A batch is worth doubling when the matmuls at twice the tokens measured at least this much faster.
BATCH_MIN_RATE_GAIN = 1.05


# ---------------------------------------------------------------- the host-bound rule (summary.device_time)


def host_bound(view: RunView) -> list[Suggestion]:
    """A GPU that idles above summary.device_time's threshold of each step waits for the host: one item says so and
    ranks what shortens the host's part of the step; a doubled batch and CUDA graphs are items of their own. What
    it offers and why: docs/tune.md#the-advisor."""
    block = view.device_time
    if not view.on_cuda or not block.get("host_bound"):
        return []
    wall, spans, estimate = block["step_wall_s"], block["stage_spans_s"], block.get("kernel_estimate")
    busy = estimate["busy_s"] if estimate else block["busy_at_most_s"]
    said = _host_bound_evidence(view, block)
    offered = [
        s
        for s in (_host_bound_batch(view, said, wall, spans, busy), _host_bound_graphs(view, said, wall, spans, block))
        if s
    ]
    helps = sorted(offered + optimizer(view) + data_loading(view), key=lambda s: -(s.gain or 1.0))
    what = "; ".join(
        f"{n}. {s.change} (`{' '.join(s.flags)}`, {'at most' if s.gain_kind == 'bound' else 'estimate'} {s.gain:.2f}x)"
        for n, s in enumerate(helps, 1)
    )
    headline = Suggestion(
        "host_bound",
        "the GPU waits for the host: shorten the host's part of each step (what helps, ranked in the evidence)",
        f"host-bound: {said}; what helps, ranked: {what or 'no change with a flag applies'}; not offered: "
        f"{'; '.join(_host_bound_left_out(view, wall, spans, block))}",
        gain=amdahl(estimate["idle_share"]) if estimate else None,
        gain_kind="estimate" if estimate else None,
        factor="every idle moment of the device removed, its work unchanged (the kernel estimate): the ceiling of "
        "every change to the host's part"
        if estimate
        else None,
        confidence="high" if block["host_bound_by"] == "event spans" else "medium",
    )
    return [headline, *offered]


def _host_bound_evidence(view: RunView, block: dict) -> str:
    """How busy the device is: the CUDA events' bound, the kernel estimate where there is one, the MFU."""
    estimate = block.get("kernel_estimate")
    said = (
        f"the device is busy at most {block['busy_at_most_s'] * 1e3:.1f} ms of each {block['step_wall_s'] * 1e3:.1f} "
        f"ms step by the stages' CUDA events (idle at least {block['idle_share_at_least']:.0%})"
    )
    if estimate:
        said += (
            f", about {estimate['busy_s'] * 1e3:.1f} ms by kernel time (idle about {estimate['idle_share']:.0%}: "
            f"{estimate['layers']} layers x {estimate['layer_s'] * 1e3:.2f} ms, one layer's forward and backward "
            f"kernels profiled at the run's shapes, plus the data and optimizer stages' spans)"
        )
    return said + (f"; MFU {view.mfu:.1%}" if view.mfu is not None else "")


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
        changes_result=None if steps % 2 == 0 else "the effective batch doubles",
    )


def _host_bound_graphs(view: RunView, said: str, wall: float, spans: dict, block: dict) -> Suggestion | None:
    if view.setting("compile_mode") == "reduce-overhead":
        return None
    steps = _graphed_steps(wall, spans, block)
    run, compile_s = view.wall_s or view.wall_median("run"), ASSUMED_COMPILE_S["cuda"]
    training = 1.0 - view.shares("run").get("eval", 0.0)
    if not run:
        return None
    low, high = (1.0 / max(1e-9, 1.0 - (1.0 - step / wall) * training + compile_s / run) for step in steps)
    if high < MIN_GAIN:
        return None
    return Suggestion(
        "compile",
        "capture the model's forward and backward in CUDA graphs (torch.compile, mode reduce-overhead)",
        f"host-bound: {said}; forward and backward take {(spans['forward'] + spans['backward']) * 1e3:.1f} ms of "
        f"the step, mostly the host's launches",
        ["--compile", "--compile-mode", "reduce-overhead"],
        gain=high,
        gain_kind="estimate",
        interval=(low, high),
        factor=f"a step of {steps[1] * 1e3:.1f} ms: the host's forward and backward gone, its other "
        f"{(wall - spans['forward'] - spans['backward']) * 1e3:.1f} ms beside the device's work (in sequence: "
        f"{steps[0] * 1e3:.1f} ms); compile time {compile_s:.0f} s (assumed) against a {run:.0f} s run",
        confidence="medium" if block.get("kernel_estimate") else "low",
        changes_result=changes.does(["--compile-mode"]),
    )


def _graphed_steps(wall: float, spans: dict, block: dict) -> tuple[float, float]:
    """A host-bound step with the model's forward and backward replayed as CUDA graphs: the host's time in them
    gone, the device's work as the kernel estimate has it (else the CUDA events' bound). (in sequence: the device's
    forward and backward then the host's rest; side by side: the longer of the device's work and the host's rest)."""
    estimate = block.get("kernel_estimate") or {}
    busy = estimate.get("busy_s") or block["busy_at_most_s"]
    forward_backward = estimate.get("forward_backward_s") or busy - spans["data"] - spans["optimizer"]
    rest = wall - spans["forward"] - spans["backward"]
    return min(wall, forward_backward + rest), max(busy, rest)


def _host_bound_left_out(view: RunView, wall: float, spans: dict, block: dict) -> list[str]:
    """What the ranked list leaves out, and why."""
    found = []
    total, used = view.device_memory_gib, view.max_allocated_gib
    if not (total and used):
        found.append("a larger batch: the record lacks the peak or the device's memory")
    elif 2 * used > 0.9 * total:
        found.append(f"a larger batch: {used:.1f} of {total:.0f} GiB in use, twice it does not fit")
    if view.setting("compile_mode") == "reduce-overhead":
        found.append("CUDA graphs: captured already")
    elif _host_bound_graphs(view, "", wall, spans, block) is None:
        step = _graphed_steps(wall, spans, block)[1]
        if step < wall:
            even = ASSUMED_COMPILE_S["cuda"] / (wall - step)
            found.append(
                f"CUDA graphs (--compile --compile-mode reduce-overhead): about {wall / step:.2f}x on the steady step "
                f"(estimate: the host's forward and backward gone), paying back its compile time "
                f"({ASSUMED_COMPILE_S['cuda']:.0f} s assumed) after about {even:.0f} steps: not in a run this short "
                f"({view.summary.get('optimizer_steps') or '?'} steps)"
            )
    if view.padding["train_padded_squares"] and view.model_facts.get("shape") and not view.setting("unpad"):
        found.append(
            "--unpad: its estimate counts FLOPs, and this step's time is the host's: the padding-free layers add "
            "operator calls and a device-to-host sync (the real tokens' indices) to each forward"
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
        return {
            "shares": _scaled_shares(breakdown, training),
            "kind": "bound",
            "text": f"the profiled steps ({breakdown['basis']}) x training's {training:.0%} of the run",
        }
    layer = ((view.measured_peak or {}).get("run_shapes") or {}).get("layer")
    if layer and layer.get("window_s"):
        run_shares = view.shares("run")
        compute = run_shares.get("forward", 0.0) + run_shares.get("backward", 0.0)
        return {
            "shares": _scaled_shares(layer, compute),
            "kind": "estimate",
            "text": f"one encoder layer profiled apart at batch {layer['batch']} x length {layer['length']} "
            f"({layer['precision']}), its shares taken for forward + backward's {compute:.0%} of the run",
        }
    return None


def _scaled_shares(profiled: dict, scale: float) -> dict:
    """A profiled window's categories and attention totals as shares of it, times `scale`."""
    window = profiled["window_s"]
    shares = {k: v / window * scale for k, v in profiled["categories"].items()}
    shares["attention total"] = profiled.get("attention_total_s", 0.0) / window * scale
    shares["attention dropout"] = profiled.get("attention_dropout_s", 0.0) / window * scale
    return shares


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
    # a record with its model timed on twice the rows: the `batch` rule speaks
    if view.on_cuda or not (rate and doubled and estimate.get("train_s")) or estimates.timed(view):
        return []
    batch = view.setting("per_device_batch_size") or view.micro_batch_samples
    steps = view.setting("gradient_accumulation_steps", 1) or 1
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
