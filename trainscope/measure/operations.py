"""The run's own model timed alone, as the run ran it and as a change would (other precisions, threads, twice the
rows): what the advisor's estimates read from the record, so that no estimate needs the reading machine.

How it works: docs/tune.md#in-the-code-estimates-from-the-runs-own-model-trainscopeadviceestimatespy.
"""

import contextlib
import statistics
import time

import torch

from trainscope.core.precision import autocast_dtype
from trainscope.core.records import now_iso
from trainscope.measure import peak
from trainscope.measure.flops_source import BatchFacts
from trainscope.measure.memory import is_sharded

BUDGET_S = 0.1  # timed calls of one configuration, after its warm-up call (rounds go on while under it)
MIN_CALLS, MAX_CALLS = 3, 20  # rounds of every configuration
# Rounds cheaper than this get at least FEW_CALLS: a median of 5 per-round ratios outlasts one disturbed round.
CHEAP_ROUND_S, FEW_CALLS = 1.5, 5


class NoWatch:
    """The do-nothing watch, and why nothing was kept: a compiled model (a hook taken off would recompile it)."""

    forwards = 0

    def __init__(self, reason: str = "the loop ran no training forward that could be watched"):
        self.reason = reason
        self.inputs = None

    def close(self) -> None:
        pass


class Watch(NoWatch):
    """A forward pre-hook on the model that keeps the inputs of its training forwards while `phase()` is "warmup"
    (and of the first, whatever the phase), detached: the last one kept is the one timed after the loop."""

    def __init__(self, model: torch.nn.Module, phase):
        super().__init__()
        self.phase = phase
        self.handle = model.register_forward_pre_hook(self._forward, with_kwargs=True)

    def _forward(self, module, args, kwargs) -> None:
        if not (module.training and torch.is_grad_enabled()):
            return
        if self.forwards and self.phase() != "warmup":
            self.close()  # the steady phase: no hook runs in a timed step
            return
        self.forwards += 1
        self.inputs = (_map_tensors(torch.Tensor.detach, args), _map_tensors(torch.Tensor.detach, kwargs))

    def close(self) -> None:
        if self.handle is not None:
            self.handle.remove()
            self.handle = None


def watch(model: torch.nn.Module | None, phase, compiled: bool = False, sharded: bool = False):
    """A Watch on `model` (unwrapped), or NoWatch where no hook may go."""
    if model is None:
        return NoWatch("the run has no model to time")
    if compiled or hasattr(model, "_orig_mod"):
        return NoWatch("the model is compiled: it was not timed apart (a hook taken off recompiles it)")
    if sharded or any(is_sharded(p) for p in model.parameters()):
        return NoWatch("the model is sharded (FSDP): a forward of its own would gather its shards with its peers")
    return Watch(model, phase)


def _map_tensors(change, value):
    """`value` with `change(tensor)` in place of each tensor of its dicts (ModelOutputs too), tuples and lists."""
    if isinstance(value, torch.Tensor):
        return change(value)
    if isinstance(value, dict) or hasattr(value, "keys"):
        return {k: _map_tensors(change, v) for k, v in value.items()}
    if isinstance(value, (tuple, list)):
        return type(value)(_map_tensors(change, v) for v in value)
    return value


def positions(inputs) -> int:
    """What the kept micro-batch holds: its token positions where its layout says so, else its samples."""
    args, kwargs = inputs
    facts = BatchFacts(kwargs if kwargs else args)
    return facts.positions or facts.samples


def doubled(inputs):
    """The kept inputs with every tensor whose first dimension is the batch's repeated along it: twice the rows."""
    args, kwargs = inputs
    samples = BatchFacts(kwargs if kwargs else args).samples
    twice = lambda t: torch.cat([t, t]) if t.dim() and t.shape[0] == samples else t
    return _map_tensors(twice, args), _map_tensors(twice, kwargs)


# ---------------------------------------------------------------- one training forward and backward, alone


def _precision_context(device: torch.device, precision_name: str):
    """Autocast as mixed precision runs it (bf16, fp16), TF32 allowed for tf32, nothing for fp32."""
    dtype = autocast_dtype(precision_name)
    if dtype is not None:
        return torch.autocast(device.type, dtype=dtype)
    if device.type == "cuda":
        return peak.tf32_allowed(precision_name == "tf32")
    return contextlib.nullcontext()


def _to_fp32(value):
    """Every low-precision floating tensor of an output in fp32 (Accelerate's convert_outputs_to_fp32)."""
    return _map_tensors(lambda t: t.float() if t.dtype in (torch.bfloat16, torch.float16) else t, value)


def loss_of(output) -> torch.Tensor:
    """What the backward starts from: the model's own loss where its output holds one (a `loss` field, or a scalar in
    a tuple: nanoGPT's (logits, loss)), else the sum of its first tensor (the loop's loss is outside the model)."""
    if isinstance(output, torch.Tensor):
        tensors = [output]
    elif isinstance(output, dict) or hasattr(output, "keys"):  # a dict, transformers' ModelOutput
        found = output.get("loss")
        if isinstance(found, torch.Tensor) and found.requires_grad:
            return found
        tensors = [v for v in output.values() if isinstance(v, torch.Tensor)]
    else:
        tensors = [v for v in output if isinstance(v, torch.Tensor)]
    scalar = next((t for t in tensors if t.dim() == 0 and t.requires_grad), None)
    if scalar is not None:
        return scalar
    first = next((t for t in tensors if t.requires_grad), None)
    if first is None:
        raise ValueError("the model's output holds no tensor that takes a gradient")
    return first.float().sum()


@contextlib.contextmanager
def _untouched(model: torch.nn.Module, device: torch.device):
    """The model in training mode, its buffers, modes and the random state put back afterwards."""
    modes = {m: m.training for m in model.modules()}
    buffers = {name: b.detach().clone() for name, b in model.named_buffers()}
    devices = [device] if device.type == "cuda" else []
    try:
        with torch.random.fork_rng(devices=devices), torch.enable_grad():
            model.train()
            yield
    finally:
        for module, training in modes.items():
            module.training = training
        with torch.no_grad():
            for name, buffer in model.named_buffers():
                if name in buffers:
                    buffer.copy_(buffers[name])


def training_call(model, inputs, device: torch.device, precision_name: str):
    """One forward and backward of the model on `inputs` in `precision_name`, as a function. The forward is the
    model's own (Accelerate's mixed-precision wrapper and every module hook of the model itself left out), its
    gradients taken, not accumulated."""
    forward = getattr(model, "_original_forward", None) or model.forward
    trained = [p for p in model.parameters() if p.requires_grad]
    args, kwargs = inputs
    autocast = precision_name in ("bf16", "fp16")

    def call():
        with _precision_context(device, precision_name):
            output = forward(*args, **kwargs)
        if autocast:
            output = _to_fp32(output)
        torch.autograd.grad(loss_of(output), trained, allow_unused=True)

    return call


def host_seconds(call, device: torch.device, threads: int) -> float:
    """One call timed on the host between synchronizations, at `threads` intra-op threads."""
    with peak.threads_set_to(threads):
        return peak.call_seconds(device, call)


def spread(values: list[float]) -> dict:
    """Median and the 10th and 90th percentiles (the extremes of fewer than 10 values: one descheduled call does
    not set the spread)."""
    deciles = (
        statistics.quantiles(values, n=10, method="inclusive") if len(values) >= 10 else [min(values), max(values)]
    )
    return {"median": statistics.median(values), "low": deciles[0], "high": deciles[-1]}


# Half the run's threads are timed only where one call of the model takes less than this: fewer threads win on small
# operators (a thread's start costs more than its share of the work), not on a model whose matmuls fill the cores.
SMALL_CALL_S = 0.02


def configurations(
    device: torch.device, precision_name: str, threads: int, budget: int | None, small: bool = True
) -> list[dict]:
    """What is timed: the run as it ran, each other precision the device runs, the thread counts worth trying (the
    process's budget where the run used another count, and half the run's where the model's call is `small`), and
    twice the rows."""
    found = [{"name": "run", "precision": precision_name, "threads": threads, "rows": 1}]
    for other in peak.precisions(device):
        if other != precision_name and not (precision_name == "fp32" and other == "tf32" and device.type != "cuda"):
            found.append({"name": f"precision {other}", "precision": other, "threads": threads, "rows": 1})
    if device.type == "cpu":
        for count in dict.fromkeys(c for c in (budget, max(1, threads // 2) if small else None) if c and c != threads):
            found.append({"name": f"threads {count}", "precision": precision_name, "threads": count, "rows": 1})
    found.append({"name": "rows x2", "precision": precision_name, "threads": threads, "rows": 2})
    return found


def least(times: dict) -> int:
    """The rounds to time at least: FEW_CALLS where the first round was cheap, else MIN_CALLS."""
    first = sum(values[0] for values in times.values() if values)
    return FEW_CALLS if first and first < CHEAP_ROUND_S else MIN_CALLS


def measure(
    model: torch.nn.Module,
    inputs,
    device: torch.device,
    precision_name: str,
    threads: int,
    budget: int | None = None,
    scale: float = 1.0,
) -> dict:
    """Every configuration's seconds for one micro-batch ({median, low, high}, scaled by `scale`: the steady phase's
    mean micro-batch against the one kept) and its `ratio` to the run's own, round by round in interleaved rounds
    (docs/tune.md); a configuration that fails is recorded with its error and left out of the rounds."""
    started = time.perf_counter()
    others_before = peak.cpu_seconds()
    entries, calls = [], {}
    with _untouched(model, device):
        first = host_seconds(training_call(model, inputs, device, precision_name), device, threads)
        for config in configurations(device, precision_name, threads, budget, small=first < SMALL_CALL_S):
            entry = dict(config)
            entries.append(entry)
            try:
                call = training_call(model, inputs if config["rows"] == 1 else doubled(inputs), device,
                                     config["precision"])  # fmt: skip
                if config["name"] != "run":  # the run's own was warmed up by the first call above
                    host_seconds(call, device, config["threads"])  # warm-up: kernels chosen, memory first touched
                calls[config["name"]] = (call, config["threads"])
            except (RuntimeError, ValueError, TypeError) as error:  # out of memory included: said, not fatal
                entry["error"] = f"{type(error).__name__}: {' '.join(str(error).split())[:200]}"
            finally:
                if device.type == "cuda":
                    torch.cuda.empty_cache()
        times = {name: [] for name in calls}
        rounds = 0
        while (
            calls
            and rounds < MAX_CALLS
            and (rounds < least(times) or sum(map(sum, times.values())) < BUDGET_S * len(calls))
        ):
            names = list(calls) if rounds % 2 == 0 else list(reversed(calls))
            for name in names:
                call, count = calls[name]
                times[name].append(host_seconds(call, device, count))
            rounds += 1
    run = times.get("run")
    for entry in entries:
        measured = times.get(entry["name"])
        if measured:
            entry["seconds"] = {k: v * scale for k, v in spread(measured).items()}
            entry["calls"] = len(measured)
            if run:
                entry["ratio"] = spread([t / r for t, r in zip(measured, run)])
    return {
        "configurations": entries,
        "measured": now_iso(),
        "cost_s": time.perf_counter() - started,
        "others_cores": peak.other_cores(others_before, peak.cpu_seconds()),
    }
