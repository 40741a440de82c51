"""The step traced, and what it costs on this machine: a training step and an evaluation batch traced operator by
operator on fake tensors at a length near the run's mean (trainscope.predict.trace, cached), each phase's operators at this
machine's measured costs (trainscope.predict.op_costs) with their power of the length, so that a phase's time follows at
any length; and the machine's costs a step adds besides its operators (memory first touched, a large copy)."""

import contextlib
import dataclasses
import json
import logging
import math
import statistics
import time

import torch

from trainscope.core import environment
from trainscope.core.paths import cache_dir
from trainscope.core.records import write_json_atomic
from trainscope.measure import peak
from trainscope.predict import op_costs, trace
from trainscope.predict.planned import PlannedRun

VERSION = 1  # of the prediction block, and of the traces cached for it
MIN_LENGTH = 8


def traced_length(mean: float, batch: int, avoid: set, limit: int | None = None) -> int:
    """A length near `mean`, at most `limit` (the positions the model embeds: a longer one cannot be traced), that,
    alone or times the batch, equals no other size of the model or batch (so its power in each shape can be read,
    trainscope.predict.trace.length_power): the nearest such length, above or below."""
    top = limit if limit is not None else math.inf
    start = min(max(MIN_LENGTH, int(round(mean))), top)
    for distance in range(int(max(start, 64))):
        for length in (start + distance, start - distance):
            if MIN_LENGTH <= length <= top and length not in avoid and batch * length not in avoid:
                return length
    raise ValueError(f"no sequence length to trace near {mean:.0f} within the model's {limit} positions")


MODEL_DIMS = (
    "hidden_size dim intermediate_size hidden_dim num_attention_heads n_heads vocab_size max_position_embeddings "
    "type_vocab_size num_hidden_layers n_layers"
).split()


def model_dims(config, batch: int, eval_batch: int, labels: int) -> set:
    """Every size a traced tensor has besides the length, so the traced length can be chosen apart from them."""
    dims = {batch, eval_batch, labels, 1}
    for name in MODEL_DIMS:
        value = getattr(config, name, None)
        if isinstance(value, int):
            dims.add(value)
    heads = getattr(config, "num_attention_heads", None) or getattr(config, "n_heads", None)
    width = getattr(config, "hidden_size", None) or getattr(config, "dim", None)
    if heads and width:
        dims |= {width // heads, batch * heads, eval_batch * heads}
    return dims


@dataclasses.dataclass
class PhaseModel:
    """A phase's operators at the traced length: seconds per call x calls, and each one's power of the length."""

    length: int
    terms: list  # (seconds, power, kind) with kind matmul / operator

    def seconds(self, length: float, operator_factor: float = 1.0) -> float:
        """Seconds at `length`; `operator_factor` scales the operators other than matrix products (a calibration)."""
        return sum(
            s * (length / self.length) ** p * (operator_factor if kind == "operator" else 1.0)
            for s, p, kind in self.terms
        )

    def by_kind(self, length: float) -> dict:
        kinds: dict = {}
        for s, p, kind in self.terms:
            kinds[kind] = kinds.get(kind, 0.0) + s * (length / self.length) ** p
        return kinds


def phase_models(traced: trace.Trace, costs: op_costs.OpCosts) -> dict[str, PhaseModel]:
    models: dict[str, PhaseModel] = {}
    costs.prepare(traced.ops)  # what is not known yet, timed at once (on a GPU in a child process)
    for op in traced.ops:
        models.setdefault(op.phase, PhaseModel(traced.length, [])).terms.append(
            (costs.seconds(op) * op.count, op.power, "matmul" if op.gemm is not None else "operator")
        )
    return models


# ---------------------------------------------------------------- the traced step


def traced_step(
    kind: str, planned: PlannedRun, batch: int, length: int, avoid: set, costs: op_costs.OpCosts
) -> trace.Trace:
    """The training step (`kind` "train") or evaluation batch ("eval") traced, or read from the cache of traces
    (`<cache>/predict/traces/`) when it was traced before with the same model, settings, shapes and versions and
    every operator's cost is known here."""
    from trainscope.workload import modeling  # deferred: it loads transformers' models

    settings, label_names = planned.settings, planned.label_names
    config = modeling.model_config(settings, label_names)
    identity = {
        "kind": kind,
        "version": [VERSION, trace.VERSION],
        "config": config.to_json_string(use_diff=False),
        "settings": {k: getattr(settings, k) for k in TRACE_SETTINGS},
        "inputs": sorted(planned.input_names),
        "precision": planned.precision,
        "device": planned.device.type,
        "batch": batch,
        "length": length,
        "avoid": sorted(avoid),
        "packages": environment.package_versions(),
    }
    path = cache_dir() / "predict" / "traces" / f"{peak.key_id(identity)}.json"
    try:
        cached = trace.Trace.from_dict(json.loads(path.read_text()))
        if all(op.gemm is not None or op.key in costs.cached for op in cached.ops):
            return cached
    except (OSError, ValueError, KeyError, TypeError):
        pass
    build = lambda: on_meta(lambda: modeling.build_architecture(settings, label_names, config=config))  # noqa: E731
    shared = (build, planned.input_names, batch, length, planned.precision, planned.device)
    with quiet_fake_tensors():
        if kind == "train":
            made = trace.trace_training(*shared, settings, avoid)
        else:
            made = trace.trace_evaluation(*shared, avoid)
    if costs.store:
        write_json_atomic(path, made.to_dict())
    return made


# The settings that change what a traced step is (everything else changes only how often it runs).
TRACE_SETTINGS = tuple(
    "model architecture_only attn_implementation gradient_checkpointing lora lora_r lora_alpha lora_dropout "
    "lora_target_modules max_grad_norm weight_decay optimizer_implementation".split()
)


@contextlib.contextmanager
def quiet_fake_tensors():
    """torch's fake-tensor mode logs, with its traceback, every operator that fails on fake tensors before raising
    the error: the error is what the prediction reports (one line, trainscope.core.errors.one_line), not the log."""
    logger = logging.getLogger("torch._subclasses.fake_tensor")
    level = logger.level
    logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        logger.setLevel(level)


def on_meta(build):
    with torch.device("meta"):
        return build()


# ---------------------------------------------------------------- the machine's own costs besides the operators


def first_touch_seconds_per_byte(costs: op_costs.OpCosts) -> float:
    """What the operating system charges to hand a process new memory, per byte: filling a fresh 64 MiB tensor
    less filling it again. Cached per machine (a CPU cost: on CUDA the caching allocator reuses its blocks)."""
    key = "first touch s/byte"
    if key not in costs.cached:
        size = 64 * 2**20
        fresh, again = [], []
        for _ in range(3):
            started = time.perf_counter()
            tensor = torch.empty(size, dtype=torch.uint8)
            tensor.fill_(1)
            fresh.append(time.perf_counter() - started)
            started = time.perf_counter()
            tensor.fill_(2)
            again.append(time.perf_counter() - started)
            del tensor
        costs.cached[key] = max(0.0, (statistics.median(fresh) - statistics.median(again)) / size)
        costs.measured += 1
    return costs.cached[key]


def copy_seconds_per_byte(costs: op_costs.OpCosts) -> float:
    """Seconds per byte of a large tensor copy at the run's threads (cached per machine)."""
    key = "copy s/byte"
    if key not in costs.cached:
        size = 32 * 2**20
        source, target = torch.ones(size // 4, device=costs.device), torch.empty(size // 4, device=costs.device)
        with peak.threads_set_to(costs.threads):
            costs.cached[key] = op_costs.time_call(lambda: target.copy_(source), costs.device) / size
        costs.measured += 1
    return costs.cached[key]
