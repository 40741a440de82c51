"""Where the gap between a run and its machine's measured matmul peak goes: pure functions.

How it works: docs/peak.md#in-the-code-where-the-gap-goes-trainscopemeasuregappy.
"""

import re

# The categories, in the order tables and figures show them.
CATEGORIES = (
    "matmul",
    "attention",
    "dropout",
    "layer norm",
    "activation",
    "optimizer",
    "copies and casts",
    "communication",
    "other operators",
    "outside operators",
)
MATMUL_OPS = frozenset(
    "aten::mm aten::addmm aten::bmm aten::baddbmm aten::addbmm aten::matmul aten::linear aten::_scaled_mm aten::mv "
    "aten::addmv aten::dot aten::vdot aten::convolution aten::_convolution aten::mkldnn_convolution".split()
)
COPY_OPS = frozenset(
    "aten::copy_ aten::to aten::_to_copy aten::contiguous aten::clone aten::copy aten::_copy_from "
    "aten::_copy_from_and_resize".split()
)
# Substrings of lower-cased operator names (with underscores removed, so a backward node's CamelCase name matches
# too), first match wins. log_softmax is the loss, not attention.
KEYWORDS = (
    ("communication", ("allreduce", "allgather", "reducescatter", "gloo", "nccl", "c10d::", "recordparamcomms")),
    ("optimizer", ("optimizer.", "fusedadam", "foreach", "fusedsgd", "clipgrad")),
    (
        "attention",
        tuple(
            "scaleddotproduct flashattention efficientattention cudnnattention safesoftmax aten::softmax "
            "softmaxbackward".split()
        ),
    ),
    ("dropout", ("dropout", "bernoulli")),
    ("layer norm", ("layernorm", "rmsnorm", "groupnorm", "batchnorm")),
    ("activation", ("gelu", "relu", "silu", "tanh", "sigmoid", "aten::glu", "mish")),
)
_BACKWARD_NODE = re.compile(r"^(autograd::engine::evaluate_function: )?(\w+::)*\w+Backward\d*$")


def _keyword_category(name: str) -> str | None:
    if name in MATMUL_OPS:
        return "matmul"
    if name in COPY_OPS:
        return "copies and casts"
    squashed = name.lower().replace("_", "")
    if "logsoftmax" in squashed:
        return None
    for category, words in KEYWORDS:
        if any(word in squashed for word in words):
            return category
    return None


def categorize(events, on_device: bool, labels: tuple[str, ...] = ()) -> dict:
    """Self time per category over the traced steps, from torch.profiler's `events()` (FunctionEvents); `labels`:
    record_function names that are spans, not operators (the stage names). What it returns:
    docs/peak.md#in-the-code-where-the-gap-goes-trainscopemeasuregappy."""
    events = list(events)
    hidden = hidden_communication_s(events) if on_device else 0.0
    events = [e for e in events if str(getattr(e, "device_type", "CPU")).endswith("CPU")]
    steps = [e for e in events if e.name.startswith("ProfilerStep#")]
    main_thread = steps[0].thread if steps else None
    if not on_device and main_thread is not None:
        events = [e for e in events if e.thread == main_thread]
    found = _tally(events, _Categories(events, labels), on_device)
    seconds = found["categories"]
    window = sum(e.cpu_time_total for e in steps) / 1e6 if steps else sum(seconds.values())
    overlap = 0.0
    if on_device:  # device time that no operator accounts for: the device waited
        seconds["communication"] = max(0.0, seconds["communication"] - hidden)
        busy = sum(v for k, v in seconds.items() if k != "outside operators")
        seconds["outside operators"], overlap = max(0.0, window - busy), max(0.0, busy - window)
    return {
        "basis": "self device time" if on_device else "self CPU time, main thread",
        "window_s": window,
        "categories": seconds,
        "communication_hidden_s": hidden,
        "overlap_s": overlap,
        "calls": found["calls"],
        "matmul_flops": found["matmul_flops"],
        "matmul_s": found["matmul_s"],
        "attention_ops": dict(sorted(found["attention_ops"].items(), key=lambda kv: -kv[1])),
        "attention_total_s": found["attention_total_s"],
        "attention_dropout_s": found["attention_dropout_s"],
    }


class _Categories:
    """Each operator's category and whether it runs inside attention, memoized per event: a backward node takes its
    forward operator's (by autograd sequence number), a generic operator the nearest enclosing one that says what
    it serves."""

    def __init__(self, events: list, labels: tuple[str, ...]):
        self.labels = labels
        self.forward_by_sequence, self.forward_inside, self.memo, self.memo_inside = {}, {}, {}, {}
        for event in events:  # the outermost forward operator of each autograd sequence number
            if event.sequence_nr is not None and event.sequence_nr >= 0 and not _BACKWARD_NODE.match(event.name):
                parent = event.cpu_parent
                if parent is None or parent.sequence_nr != event.sequence_nr:
                    self.forward_by_sequence.setdefault(event.sequence_nr, self.category(event))
                    self.forward_inside.setdefault(event.sequence_nr, self.inside_attention(event))

    def own(self, event) -> str | None:
        if event.name.startswith("ProfilerStep#") or event.name in self.labels:
            return "outside operators"
        return _keyword_category(event.name)

    def category(self, event) -> str:
        if id(event) in self.memo:
            return self.memo[id(event)]
        found = None
        if _BACKWARD_NODE.match(event.name):  # a backward node: what its forward operator was
            found = self.forward_by_sequence.get(event.sequence_nr) or _keyword_category(event.name.split(": ")[-1])
        found = found or self.own(event)
        if found is None:  # a generic operator: the nearest enclosing one that says what it serves
            parent = event.cpu_parent
            inherited = self.category(parent) if parent is not None else None
            if parent is not None and parent.name == "optimizer" and "optimizer" in self.labels:
                inherited = "optimizer"
            # a matmul's other work (a bias gradient's sum) is not matmul time; a span is no operator
            found = inherited if inherited not in (None, "matmul", "outside operators") else "other operators"
        self.memo[id(event)] = found
        return found

    def inside_attention(self, event) -> bool:
        if id(event) not in self.memo_inside:
            if _BACKWARD_NODE.match(event.name):
                found = self.forward_inside.get(event.sequence_nr, False)
            else:
                found = self.category(event) == "attention" or (
                    event.cpu_parent is not None and self.inside_attention(event.cpu_parent)
                )
            self.memo_inside[id(event)] = found
        return self.memo_inside[id(event)]


def _tally(events: list, categories: _Categories, on_device: bool) -> dict:
    """Self time and calls per category; the matmuls' FLOPs and time; attention's operators, everything inside
    attention and the dropout inside it."""
    seconds = dict.fromkeys(CATEGORIES, 0.0)
    calls = dict.fromkeys(CATEGORIES, 0)
    flops = matmul_s = attention_total = attention_dropout = 0.0
    attention_ops: dict[str, float] = {}
    for event in events:
        name = categories.category(event)
        self_us = (event.self_device_time_total if on_device else event.self_cpu_time_total) or 0.0
        seconds[name] += self_us / 1e6
        calls[name] += 1
        if categories.inside_attention(event):
            attention_total += self_us / 1e6
            attention_dropout += self_us / 1e6 if name == "dropout" else 0.0
        if name == "matmul":
            flops += getattr(event, "flops", 0) or 0
            matmul_s += self_us / 1e6
        if name == "attention" and event.name.startswith("aten::"):
            attention_ops[event.name] = attention_ops.get(event.name, 0.0) + self_us / 1e6
    return {
        "categories": seconds,
        "calls": calls,
        "matmul_flops": flops,
        "matmul_s": matmul_s,
        "attention_ops": attention_ops,
        "attention_total_s": attention_total,
        "attention_dropout_s": attention_dropout,
    }


def _merged(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[list[float]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(start, end) for start, end in merged]


def hidden_communication_s(events) -> float:
    """Seconds of the collectives' device kernels (NCCL's) that ran while a compute kernel ran: from the device
    events' own timestamps (torch.profiler's CUDA activity), each instant once."""
    kernels = [e for e in events if str(getattr(e, "device_type", "")).endswith("CUDA")]
    communication = _merged([(k.time_range.start, k.time_range.end) for k in kernels if "nccl" in k.name.lower()])
    compute = _merged([(k.time_range.start, k.time_range.end) for k in kernels if "nccl" not in k.name.lower()])
    overlap, i = 0.0, 0
    for start, end in communication:
        while i < len(compute) and compute[i][1] <= start:
            i += 1
        j = i
        while j < len(compute) and compute[j][0] < end:
            overlap += min(end, compute[j][1]) - max(start, compute[j][0])
            j += 1
    return overlap / 1e6


def rows(breakdown: dict, peak_tflops: float | None, padding_share: float | None = None) -> list[dict]:
    """The gap table of a profiled window: the floor (the matmuls' FLOPs at the measured peak), the matmuls above it,
    then every other category; seconds and share of the window. The matmul rows are None without a peak.

    With `padding_share` (the share of the run's counted model FLOPs that went to padding positions: the record's
    throughput.padding_flops_share) padding is a row of its own: that share of the matmul time (padding's FLOPs at
    the rate the matmuls ran), the floor and the time above it then counted on real tokens only. An estimate: the
    profiled steps are taken as padded like the run, and the token-wise operators' time on padding positions (dropout,
    layer norm, activations) stays in their rows."""
    window = breakdown["window_s"] or 0.0
    categories = breakdown["categories"]
    real = 1.0 - padding_share if padding_share is not None else 1.0
    floor = real * breakdown["matmul_flops"] / (peak_tflops * 1e12) if peak_tflops else None
    above = real * categories["matmul"] - floor if floor is not None else None
    on_real = " on real tokens" if padding_share is not None else ""
    # below the floor the matmuls beat the measured peak: impossible, so not printed (above_measured_peak says why)
    out = [
        {"part": f"matmuls{on_real} at the measured peak (floor)", "seconds": floor},
        {"part": f"matmuls{on_real} above the floor", "seconds": above if above is None or above >= 0 else None},
    ]
    if padding_share is not None:
        out.append({"part": "padding positions (their matmuls)", "seconds": padding_share * categories["matmul"]})
    out += [{"part": name, "seconds": categories[name]} for name in CATEGORIES if name != "matmul"]
    for row in out:
        row["share"] = row["seconds"] / window if row["seconds"] is not None and window else None
    return out


def matmul_rate(breakdown: dict) -> float | None:
    """TFLOP/s the traced matmuls achieved (profiler FLOPs over their self time)."""
    if not breakdown.get("matmul_flops") or not breakdown.get("matmul_s"):
        return None
    return breakdown["matmul_flops"] / breakdown["matmul_s"] / 1e12


def estimate(
    flops_per_device: float | None,
    peak_tflops: float | None,
    stage_seconds: dict,
    train_s: float | None,
    padding_share: float | None = None,
) -> dict | None:
    """Without a profile: the model FLOPs at the measured peak (the floor) against the training time of the same
    steps, split into forward + backward, optimizer, and data + other (one device's share of the work); with
    `padding_share` (the counted FLOPs' share on padding positions) the floor's part on padding (`padding_floor_s`)."""
    if not (flops_per_device and peak_tflops and train_s):
        return None
    floor = flops_per_device / (peak_tflops * 1e12)
    return {
        "method": "estimate: model FLOPs (PaLM) at the measured peak against the measured steady stages",
        "floor_s": floor,
        "train_s": train_s,
        "padding_floor_s": floor * padding_share if padding_share is not None else None,
        "forward_backward_s": stage_seconds.get("forward", 0.0) + stage_seconds.get("backward", 0.0),
        "optimizer_s": stage_seconds.get("optimizer", 0.0),
        "data_other_s": stage_seconds.get("data", 0.0) + stage_seconds.get("other", 0.0),
        "floor_share": floor / train_s,
    }
