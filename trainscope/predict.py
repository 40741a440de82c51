"""Predict a run before it runs -- peak memory per process, the steady step time and the run's time, "fits" or
"does not fit" -- and, once it has run, how far off each predicted quantity was.

    python train.py --predict [train.py flags]      # one screen, exit 0, nothing trained, no record written

From what the run will really do, without building its weights:

* **The batches**: the training split's token lengths (tokenized as the run tokenizes, from the datasets cache),
  batched as the run batches them -- padding to the longest sequence of a random batch, to --max-seq-length with
  --pad-to-max-length, or in length-sorted megabatches with --group-by-length (transformers' own grouping) -- for
  as many micro-batches as the run trains on one process; the evaluation splits in their fixed order.
* **The step** (trainscope.trace): the model built from its configuration on fake tensors, one training step
  traced operator by operator at the run's batch and a length near the mean padded one, precision, activation
  checkpointing and LoRA included, and one evaluation batch; every operator's and tensor's power of the length
  then tells the step at each batch's length (its time) and at the longest (the memory peak). Traces are cached.
* **Time** (trainscope.op_costs): each matrix product's FLOPs over this machine's measured matmul rate at that
  shape (trainscope.peak), every other operator timed once at its real shapes, cached per machine. An operator's
  cost at another length follows the length's power in its shapes (one for a linear layer, two for attention
  scores). Plus the collate of real batches of the training split (when the loop loads them itself, --num-workers
  0), DDP's communication where this machine has measured its bandwidth (else left out, and said), evaluation
  batch by batch, and the framework's own time as the calibration runs showed it: per operator dispatched
  (Python, module calls, autograd), per step (the loop) and per evaluation pass, with a factor on the operators
  other than matrix products (timed alone, their inputs are warmer in cache than in a step).
* **Memory** (peak RSS on a CPU, the allocator's max allocated on CUDA): the process's RSS now (framework, data:
  measured where the prediction is made, before any model exists) + parameters + the step's live peak (optimizer
  state, activations kept for backward at the longest batch, temporaries of backward), and on a CPU the
  allocator's own share (glibc keeps freed heap pages, and fragments them): factor x the live peak + a constant.

The fitted terms (the allocator's share, the framework's time) come from trainscope.calibration: short runs of
other shapes, once per machine, made by themselves on first use (at most a minute, cached) or in full by `python -m
trainscope.predict --calibrate` (make predict-calibrate); uncalibrated (switched off, or failed), they are left out
and the prediction says so. Each prediction records how much of it rests on what (`sources`): derived from first
principles (the traced step at this machine's benchmarked costs), fitted (the calibration; a coefficient held at a
bound of its fit is a warning) or measured in the same run before it starts (the process's memory, the collate).

Every train.py run makes the prediction at start (the record's `prediction` block) and, at its end, the error of
each predicted quantity and term (summary `prediction_error`); `make predict-check` runs many shapes and the
report plots predicted against measured. `speedup(baseline, flags, config)` is a change's predicted speed-up.
"""

import contextlib
import dataclasses
import json
import logging
import math
import os
import statistics
import time
from pathlib import Path

import numpy as np
import torch

from trainscope import calibration, environment, op_costs, peak, trace
from trainscope.memory import GIB
from trainscope.records import now_iso, write_json_atomic

VERSION = 1
MIN_LENGTH = 8
SIMULATED_EPOCHS_MAX = 4  # micro-batches beyond this many epochs repeat the same lengths
COLLATE_SAMPLES = 5


# ---------------------------------------------------------------- the batches the run will see (pure)


def token_lengths(split) -> np.ndarray:
    """Token count of every row of a tokenized split (read as Arrow through its indices: no Python lists)."""
    import pyarrow.compute as pc

    column = split.select_columns(["input_ids"]).with_format("arrow")[:].column("input_ids")
    return np.asarray(pc.list_value_length(column).to_numpy(zero_copy_only=False), dtype=np.int64)


def _round_up(values: np.ndarray, multiple: int | None) -> np.ndarray:
    return values if not multiple else -(-values // multiple) * multiple


def training_lengths(
    lengths: np.ndarray,
    batch: int,
    micro_batches: int,
    processes: int = 1,
    pad_to_max_length: bool = False,
    max_seq_length: int = 128,
    group_by_length: bool = False,
    pad_to_multiple_of: int | None = None,
    seed: int = 0,
) -> np.ndarray:
    """The padded length of each micro-batch one process trains, in the order it trains them: the whole run's
    batches (shuffled, or length-grouped as transformers' LengthGroupedSampler groups them), every `processes`-th
    going to this process as Accelerate shards them. The order is a simulation with its own seed (the run's comes
    from Accelerate's seedable sampler): the lengths have the run's distribution, not its exact sequence."""
    if pad_to_max_length:
        return np.full(micro_batches, max_seq_length, dtype=np.int64)
    generator = torch.Generator().manual_seed(seed)
    wanted, padded = micro_batches * processes, []
    for _ in range(SIMULATED_EPOCHS_MAX):
        if group_by_length:
            from transformers.trainer_pt_utils import get_length_grouped_indices

            order = np.asarray(get_length_grouped_indices(lengths.tolist(), batch, generator=generator))
        else:
            order = torch.randperm(len(lengths), generator=generator).numpy()
        ordered = lengths[order]
        starts = np.arange(0, len(ordered), batch)
        padded.extend(np.maximum.reduceat(ordered, starts).tolist())
        if len(padded) >= wanted:
            break
    padded = np.resize(np.asarray(padded, dtype=np.int64), wanted)[::processes][:micro_batches]
    return _round_up(padded, pad_to_multiple_of)


def evaluation_lengths(
    lengths: np.ndarray,
    batch: int,
    processes: int = 1,
    pad_to_max_length: bool = False,
    max_seq_length: int = 128,
    group_by_length: bool = False,
    pad_to_multiple_of: int | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """(padded length, rows) of each evaluation batch one process runs: the split in order (sorted by length with
    --group-by-length), batches shared out in turn among the processes; the last batch holds what is left."""
    if len(lengths) == 0:
        return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)
    ordered = np.sort(lengths, kind="stable") if group_by_length else lengths
    starts = np.arange(0, len(ordered), batch)
    rows = np.minimum(batch, len(ordered) - starts)
    if pad_to_max_length:
        padded = np.full(len(starts), max_seq_length, dtype=np.int64)
    else:
        padded = np.maximum.reduceat(ordered, starts).astype(np.int64)
    return _round_up(padded[::processes], pad_to_multiple_of), rows[::processes]


# ---------------------------------------------------------------- a phase's time at any length


def traced_length(mean: float, batch: int, avoid: set, limit: int | None = None) -> int:
    """A length near `mean`, at most `limit` (the positions the model embeds: a longer one cannot be traced), that,
    alone or times the batch, equals no other size of the model or batch (so its power in each shape can be read,
    trainscope.trace.length_power): the nearest such length, above or below."""
    top = limit if limit is not None else math.inf
    start = min(max(MIN_LENGTH, int(round(mean))), top)
    for distance in range(int(max(start, 64))):
        for length in (start + distance, start - distance):
            if MIN_LENGTH <= length <= top and length not in avoid and batch * length not in avoid:
                return length
    raise ValueError(f"no sequence length to trace near {mean:.0f} within the model's {limit} positions")


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


def traced_step(
    kind: str,
    workload: "Workload",
    batch: int,
    length: int,
    avoid: set,
    costs: op_costs.OpCosts,
    settings=None,
    label_names=None,
) -> trace.Trace:
    """The training step (`kind` "train") or evaluation batch ("eval") traced, or read from the cache of traces
    (`<cache>/predict/traces/`) when it was traced before with the same model, settings, shapes and versions and
    every operator's cost is known here."""
    from trainscope import modeling

    settings = settings or workload.settings
    label_names = label_names or workload.label_names
    config = modeling.model_config(settings, label_names)
    identity = {
        "kind": kind,
        "version": [VERSION, trace.VERSION],
        "config": config.to_json_string(use_diff=False),
        "settings": {k: getattr(settings, k) for k in TRACE_SETTINGS},
        "inputs": sorted(workload.input_names),
        "precision": workload.precision,
        "device": workload.device.type,
        "batch": batch,
        "length": length,
        "avoid": sorted(avoid),
        "packages": environment.package_versions(),
    }
    path = peak.cache_dir() / "predict" / "traces" / f"{peak.key_id(identity)}.json"
    try:
        cached = trace.Trace.from_dict(json.loads(path.read_text()))
        if all(op.gemm is not None or op.key in costs.cached for op in cached.ops):
            return cached
    except (OSError, ValueError, KeyError, TypeError):
        pass
    build = lambda: _on_meta(lambda: modeling.build_architecture(settings, label_names, config=config))  # noqa: E731
    with quiet_fake_tensors():
        if kind == "train":
            made = trace.trace_training(
                build,
                workload.input_names,
                batch,
                length,
                workload.precision,
                workload.device,
                settings.max_grad_norm,
                settings.weight_decay,
                avoid,
            )
        else:
            made = trace.trace_evaluation(
                build, workload.input_names, batch, length, workload.precision, workload.device, avoid
            )
    if costs.store:
        write_json_atomic(path, made.to_dict())
    return made


# The settings that change what a traced step is (everything else changes only how often it runs).
TRACE_SETTINGS = (
    "model",
    "architecture_only",
    "attn_implementation",
    "gradient_checkpointing",
    "lora",
    "lora_r",
    "lora_alpha",
    "lora_dropout",
    "lora_target_modules",
    "max_grad_norm",
    "weight_decay",
)


@contextlib.contextmanager
def quiet_fake_tensors():
    """torch's fake-tensor mode logs, with its traceback, every operator that fails on fake tensors before raising
    the error: the error is what the prediction reports (one line, trainscope.errors.one_line), not the log."""
    logger = logging.getLogger("torch._subclasses.fake_tensor")
    level = logger.level
    logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        logger.setLevel(level)


# ---------------------------------------------------------------- the machine's own costs


def _on_meta(build):
    with torch.device("meta"):
        return build()


def collate_seconds(split, collate, batch: int, seed: int = 0) -> float:
    """Seconds to fetch and collate one batch of real rows of `split`, as the DataLoader does in the training
    process (--num-workers 0): the median of COLLATE_SAMPLES batches of random rows."""
    if len(split) == 0:
        return 0.0
    generator = np.random.default_rng(seed)
    times = []
    for _ in range(COLLATE_SAMPLES + 1):
        rows = generator.choice(len(split), size=min(batch, len(split)), replace=False).tolist()
        started = time.perf_counter()
        collate(split.__getitems__(rows))
        times.append(time.perf_counter() - started)
    return statistics.median(times[1:])


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
        with op_costs.threads(costs.threads):
            costs.cached[key] = op_costs.time_call(lambda: target.copy_(source), costs.device) / size
        costs.measured += 1
    return costs.cached[key]


# ---------------------------------------------------------------- the workload


@dataclasses.dataclass
class Workload:
    """What the prediction is of: the run's settings and what start-up found."""

    settings: object
    label_names: list
    input_names: list
    device: torch.device
    precision: str  # in effect: fp32, tf32, bf16, fp16
    processes: int  # this launch's processes (the world size)
    local_processes: int
    threads: int  # torch threads per process
    lengths: dict  # split -> token lengths (np arrays)
    rss_bytes: int | None  # this process's RSS now (a CPU run's baseline)
    collate_s: dict = dataclasses.field(default_factory=dict)  # {"train": s per batch, "eval": s per batch}
    plan: dict = dataclasses.field(default_factory=dict)

    @property
    def pad_to_multiple_of(self) -> int | None:
        return 8 if self.device.type == "cuda" and self.precision in ("fp16", "bf16") else None


def precision_from_environment(device: torch.device, environ=None) -> str:
    """The precision a launch will compute in, before its Accelerator exists: the config's mixed precision (which
    `accelerate launch` exports), fp16 running as fp32 on a CPU (as Accelerate runs it), TF32 on CUDA where on."""
    from trainscope.precision import tf32_in_effect

    environ = os.environ if environ is None else environ
    requested = environ.get("ACCELERATE_MIXED_PRECISION", "no")
    if requested == "bf16":
        return "bf16"
    if requested == "fp16" and device.type == "cuda":
        return "fp16"
    return "tf32" if device.type == "cuda" and tf32_in_effect() else "fp32"


def current_rss_bytes() -> int | None:
    """This process's resident set size now (Linux), None where /proc does not say."""
    try:
        return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


def device_memory_bytes(device: torch.device) -> int | None:
    """What a process's peak is held against: the GPU's memory, or the machine's RAM on a CPU."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (OSError, ValueError):
        return None


# ---------------------------------------------------------------- the prediction


@contextlib.contextmanager
def _random_state_kept():
    """Predicting never moves the run's random state (CPU and CUDA generators), whatever it builds or times."""
    cpu = torch.get_rng_state()
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
    try:
        yield
    finally:
        torch.set_rng_state(cpu)
        if cuda is not None:
            torch.cuda.set_rng_state_all(cuda)


def predict(workload: Workload, store: bool = True, fitted: dict | None = None) -> dict:
    """The prediction block (docs/RECORD.md `prediction`), with this machine's calibration (made now on first use,
    trainscope.calibration.ensure) or the one given (`fitted`: {} for none)."""
    with _random_state_kept():
        return _predict(workload, store, fitted)


def _predict(workload: Workload, store: bool, fitted: dict | None) -> dict:
    started = time.perf_counter()
    settings, device = workload.settings, workload.device
    # before the costs are read: a first-use calibration times and caches costs of its own
    fitted = calibration.ensure(device) if fitted is None else fitted
    costs = op_costs.OpCosts(device, workload.threads, workload.local_processes, store=store)
    notes = []
    plan = workload.plan
    accumulation = settings.gradient_accumulation_steps
    micro_batches = max(1, plan.get("optimizer_steps", 1) * accumulation)
    train = training_lengths(
        workload.lengths["train"],
        settings.per_device_batch_size,
        micro_batches,
        workload.processes,
        settings.pad_to_max_length,
        settings.max_seq_length,
        settings.group_by_length,
        workload.pad_to_multiple_of,
        seed=settings.seed,
    )
    eval_batch = settings.resolved_eval_batch_size
    evaluation = {
        split: evaluation_lengths(
            workload.lengths[split],
            eval_batch,
            workload.processes,
            settings.pad_to_max_length,
            settings.max_seq_length,
            getattr(settings, "eval_order", "given") == "length",
            workload.pad_to_multiple_of,
        )
        for split in ("validation", "test")
    }
    warmup = min(settings.timing_warmup_steps, plan.get("optimizer_steps", 1))
    steady = train[warmup * accumulation :] if len(train) > warmup * accumulation else train

    from trainscope import modeling

    config = modeling.model_config(settings, workload.label_names)
    avoid = _model_dims(config, settings.per_device_batch_size, eval_batch, len(workload.label_names))
    positions = modeling.config_positions(config)
    length = traced_length(float(steady.mean()), settings.per_device_batch_size, avoid, positions)
    traced = traced_step("train", workload, settings.per_device_batch_size, length, avoid, costs)
    longest = int(train.max())
    eval_all = np.concatenate([evaluation["validation"][0], evaluation["test"][0]])
    eval_length = traced_length(float(eval_all.mean()) if len(eval_all) else length, eval_batch, avoid, positions)
    evaluated = traced_step("eval", workload, eval_batch, eval_length, avoid, costs)

    phases = {**phase_models(traced, costs), **phase_models(evaluated, costs)}
    timing = fitted.get("time") or {}
    # The framework's own time (Python, module calls, autograd, dispatch) per operator dispatched, as calibrated
    dispatches = {**traced.dispatches, **evaluated.dispatches}
    framework = {phase: timing.get("dispatch_s", 0.0) * count for phase, count in dispatches.items()}
    time_block = _time(
        workload, phases, framework, train, steady, warmup, evaluation, traced, costs, notes, dispatches, timing
    )
    memory_block = _memory(workload, traced, longest, notes, fitted.get("allocator"))
    costs.save()
    if costs.unmeasured:
        notes.append(f"operators that could not be timed alone, counted as free: {', '.join(sorted(costs.unmeasured))}")
    if settings.compile:
        notes.append(
            "--compile: the prediction is of the eager model (compiled kernels and compile time are not modelled)"
        )
    if os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true":
        notes.append("FSDP: parameters, gradients and optimizer state are predicted unsharded")
    return {
        "version": VERSION,
        "made": now_iso(),
        "seconds": time.perf_counter() - started,
        "calibration": calibration_state(fitted, device),
        "sources": sources(memory_block, time_block),
        "machine": {
            "device": str(device),
            "device_name": environment.device_name(device),
            "precision": workload.precision,
            "threads": workload.threads,
            "processes": workload.processes,
            "cost_cache": str(costs.path),
            "timed_now": costs.measured,
        },
        "batches": {
            "batch": settings.per_device_batch_size,
            "micro_batches": int(len(train)),
            "accumulation": accumulation,
            "warmup_steps": warmup,
            "traced_length": length,
            "mean_length": float(steady.mean()),
            "longest": longest,
            "mean_real_length": float(workload.lengths["train"].mean()) if len(workload.lengths["train"]) else 0.0,
            "eval_batch": eval_batch,
            "eval_batches": {k: int(len(v[0])) for k, v in evaluation.items()},
            "eval_mean_length": float(eval_all.mean()) if len(eval_all) else None,
        },
        "memory": memory_block,
        "time": time_block,
        "notes": notes,
    }


def _model_dims(config, batch: int, eval_batch: int, labels: int) -> set:
    """Every size a traced tensor has besides the length, so the traced length can be chosen apart from them."""
    dims = {batch, eval_batch, labels, 1}
    for name in (
        "hidden_size",
        "dim",
        "intermediate_size",
        "hidden_dim",
        "num_attention_heads",
        "n_heads",
        "vocab_size",
        "max_position_embeddings",
        "type_vocab_size",
        "num_hidden_layers",
        "n_layers",
    ):
        value = getattr(config, name, None)
        if isinstance(value, int):
            dims.add(value)
    heads = getattr(config, "num_attention_heads", None) or getattr(config, "n_heads", None)
    width = getattr(config, "hidden_size", None) or getattr(config, "dim", None)
    if heads and width:
        dims |= {width // heads, batch * heads, eval_batch * heads}
    return dims


def _time(
    workload, phases, framework, train, steady, warmup, evaluation, traced, costs, notes, dispatches, calibration: dict
) -> dict:
    settings = workload.settings
    accumulation = settings.gradient_accumulation_steps
    factor = calibration.get("operator_factor", 1.0)
    if not calibration:
        notes.append(
            "the framework's own time (per operator dispatched, per step, per evaluation pass) is not "
            "calibrated on this machine: left out (python -m trainscope.predict --calibrate)"
        )

    def micro(length: float) -> dict:
        return {
            phase: phases[phase].seconds(length, factor) + framework.get(phase, 0.0)
            for phase in ("forward", "backward")
        }

    per_length = {int(t): micro(t) for t in np.unique(train)}
    forward = float(np.mean([per_length[int(t)]["forward"] for t in steady]))
    backward = float(np.mean([per_length[int(t)]["backward"] for t in steady]))
    optimizer = phases["optimizer"].seconds(traced.length, factor) + framework.get("optimizer", 0.0)
    first_optimizer = phases.get("optimizer_first", phases["optimizer"]).seconds(traced.length, factor) + framework.get(
        "optimizer_first", 0.0
    )
    data = workload.collate_s.get("train", 0.0) if settings.num_workers == 0 else 0.0
    if settings.num_workers:
        notes.append(f"{settings.num_workers} loader workers: the data wait is taken as none")
    communication = _communication(workload, traced, costs, notes)
    loop = calibration.get("step_s", 0.0)
    stages = {
        "data": data * accumulation,
        "forward": forward * accumulation,
        "backward": backward * accumulation,
        "optimizer": optimizer,
        "communication": communication,
        "other": loop,
    }
    step = sum(stages.values())
    kinds = {"matmul": 0.0, "operator": 0.0}
    for phase in ("forward", "backward"):
        for kind, seconds in phases[phase].by_kind(float(steady.mean())).items():
            kinds[kind] += seconds * accumulation * (factor if kind == "operator" else 1.0)
    for kind, seconds in phases["optimizer"].by_kind(traced.length).items():
        kinds[kind] += seconds * (factor if kind == "operator" else 1.0)
    kinds["framework"] = (
        sum(framework.get(p, 0.0) for p in ("forward", "backward")) * accumulation
        + framework.get("optimizer", 0.0)
        + loop
    )
    kinds["data"], kinds["communication"] = stages["data"], communication

    # The first step creates the optimizer state, and touches fresh memory for everything it holds.
    touch = first_touch_seconds_per_byte(costs) if workload.device.type == "cpu" else 0.0
    first_extra = first_optimizer - optimizer + touch * traced.peak_at(float(steady.mean()))
    train_lengths_by_step = train.reshape(-1, accumulation) if len(train) % accumulation == 0 else None
    step_seconds = []
    for index in range(len(train) // accumulation):
        lengths = train_lengths_by_step[index] if train_lengths_by_step is not None else [train[index]]
        seconds = (
            sum(per_length[int(t)]["forward"] + per_length[int(t)]["backward"] + data for t in lengths)
            + optimizer
            + communication
            + loop
        )
        step_seconds.append(seconds + (first_extra if index == 0 else 0.0))
    eval_forward = phases["eval"]
    eval_collate = workload.collate_s.get("eval", 0.0) if settings.num_workers == 0 else 0.0
    eval_passes = {"validation": max(1, workload.plan.get("epochs", 1)), "test": 1}
    # A batch's operators scale with its rows (a last, partial batch costs its share); the framework's per batch.
    eval_batch = settings.resolved_eval_batch_size
    eval_batches = sum(passes * len(evaluation[split][0]) for split, passes in eval_passes.items())
    evaluation_s = sum(
        passes
        * (
            calibration.get("evaluation_pass_s", 0.0)
            + sum(
                (eval_forward.seconds(t) + eval_collate) * rows / eval_batch + framework.get("eval", 0.0)
                for t, rows in zip(*evaluation[split])
            )
        )
        for split, passes in eval_passes.items()
    )
    evaluation_operators = sum(
        passes
        * sum(eval_forward.by_kind(t).get("operator", 0.0) * rows / eval_batch for t, rows in zip(*evaluation[split]))
        for split, passes in eval_passes.items()
    )
    warmup_s = sum(step_seconds[:warmup])
    run_s = sum(step_seconds) + evaluation_s
    return {
        "step_s": step,
        "stages_s": stages,
        "kinds_s": kinds,
        "first_step_s": step_seconds[0] if step_seconds else None,
        "warmup_s": warmup_s,
        "steady_steps": max(0, len(step_seconds) - warmup),
        "evaluation_s": evaluation_s,
        "evaluation_passes": sum(eval_passes.values()),
        "evaluation_operator_s": evaluation_operators,
        "dispatches": {
            "step": sum(traced.dispatches.get(p, 0) for p in ("forward", "backward")) * accumulation
            + traced.dispatches.get("optimizer", 0),
            "evaluation": eval_batches * dispatches.get("eval", 0),
        },
        "run_s": run_s,
        "collate_s": dict(workload.collate_s),
        "calibration": calibration or None,
    }


def _communication(workload, traced, costs, notes) -> float:
    """DDP's exposed all-reduce per optimizer step, from this machine's measured bandwidth and exposed share (the
    last multi-process run with these processes and threads recorded them); 0 and said when none did."""
    if workload.processes < 2:
        return 0.0
    measured = costs.cached.get("communication")
    if not measured:
        notes.append(
            "DDP communication: this machine has not measured its all-reduce yet (no multi-process run with "
            "these processes and threads): left out"
        )
        return 0.0
    gradient_bytes = traced.trainable_bytes
    ring = 2 * (workload.processes - 1) / workload.processes
    total = ring * gradient_bytes / (measured["bus_bandwidth_gbs"] * 1e9)
    resolved = "" if measured.get("exposed_resolved", True) else " (the median of an exposed time not resolved)"
    notes.append(
        f"DDP communication from this machine's last measurement ({measured['bus_bandwidth_gbs']:.2f} GB/s, "
        f"{measured['exposed_fraction']:.0%} of it exposed{resolved}) and the buckets' copies"
    )
    # DDP copies the gradients into its buckets and back (without --ddp-gradient-as-bucket-view): two copies
    copies = 0 if workload.settings.ddp_gradient_as_bucket_view else 2 * gradient_bytes * copy_seconds_per_byte(costs)
    return total * measured["exposed_fraction"] + copies


def _memory(workload, traced: trace.Trace, longest: int, notes, calibration: dict | None) -> dict:
    """The peak at the run's longest batch, by term."""
    kinds = traced.memory_at(longest)
    saved_by_module = traced.saved_at(longest)
    saved = sum(saved_by_module.values())
    # DDP keeps its gradient buckets (a flat copy of the gradients) for the whole run, beside the gradients.
    buckets = (
        traced.trainable_bytes if workload.processes > 1 and not workload.settings.ddp_gradient_as_bucket_view else 0
    )
    live = kinds["optimizer"] + kinds["activations"] + kinds["temporary"] + buckets
    # The live peak, split: the optimizer state, what autograd keeps for backward, and the rest of what lives at that
    # moment (gradients as backward makes them, backward's temporaries, the forward's outputs not kept).
    terms = {
        "parameters": traced.parameter_bytes,
        "optimizer": kinds["optimizer"],
        "activations": saved,
        "temporaries": max(0.0, live - buckets - kinds["optimizer"] - saved),
    }
    if buckets:
        terms["ddp_buckets"] = buckets
    on_cpu = workload.device.type == "cpu"
    calibration = calibration if on_cpu else None
    allocator = 0.0
    if on_cpu and calibration:
        allocator = calibration["factor"] * live + calibration["constant_bytes"]
    elif on_cpu:
        notes.append(
            "the allocator's share of a CPU process (freed heap kept, fragmented) is not calibrated on this "
            "machine: left out (python -m trainscope.predict --calibrate, or make predict-calibrate)"
        )
    baseline = workload.rss_bytes if on_cpu and workload.rss_bytes is not None else 0
    terms = {"baseline": baseline, **terms, "allocator": allocator}
    peak_bytes = sum(terms.values())
    capacity = device_memory_bytes(workload.device)
    return {
        "kind": "peak RSS" if on_cpu else "max allocated",
        "peak_gib": peak_bytes / GIB,
        "terms_gib": {k: v / GIB for k, v in terms.items()},
        "live_gib": live / GIB,
        "gradients_gib": traced.trainable_bytes / GIB,
        "activations_by_layer_gib": {k: v / GIB for k, v in saved_by_module.items() if v},
        "saved_by_power": {module: {str(p): b for p, b in powers.items()} for module, powers in traced.saved.items()},
        "traced": {"batch": traced.batch, "length": traced.length},
        "at_length": longest,
        "allocator": {"calibrated": bool(calibration), **(calibration or {})} if on_cpu else None,
        "capacity_gib": capacity / GIB if capacity else None,
        "fits": bool(capacity is None or peak_bytes * max(1, workload.local_processes if on_cpu else 1) <= capacity),
    }


def calibration_state(fitted: dict, device: torch.device) -> dict:
    """How the prediction was calibrated: `state` calibrated (a calibration cached before), first use (made by this
    prediction, in `seconds`) or uncalibrated (switched off, or it failed: `error`), its method and date, and each
    fitted coefficient held at a bound of its fit (a warning: the fitted model does not fit this machine)."""
    timing = fitted.get("time") or {}
    state = "first use" if fitted.get("made_now") else "calibrated" if fitted.get("key") else "uncalibrated"
    return {
        "state": state,
        "method": fitted.get("method") or ("full" if fitted.get("key") else None),
        "measured": fitted.get("measured"),
        "seconds": fitted.get("seconds"),
        "error": fitted.get("error"),
        "at_bound": list(timing.get("at_bound") or []),
        "path": str(calibration.calibration_path(device)) if fitted.get("key") else None,
    }


# What each term of a prediction rests on: derived from first principles (the traced step's shapes and bytes, at
# this machine's benchmarked costs: the matmul peak, each operator timed alone, a measured all-reduce bandwidth),
# fitted (the calibration), or measured in the same run before it starts (the process's memory, the collate).
MEMORY_SOURCES = {
    "baseline": "measured",
    "parameters": "derived",
    "optimizer": "derived",
    "activations": "derived",
    "temporaries": "derived",
    "ddp_buckets": "derived",
    "allocator": "fitted",
}


def sources(memory: dict, timing: dict) -> dict:
    """The peak's and the steady step's shares derived, fitted and measured (MEMORY_SOURCES). The step's are over
    its kinds at the mean padded length: the operators' calibrated factor is fitted beyond 1 (what they cost timed
    alone is derived), the framework's time (per dispatch, per step) fitted, the collate measured now."""
    peak = {kind: 0.0 for kind in ("derived", "fitted", "measured")}
    for term, gib in memory["terms_gib"].items():
        peak[MEMORY_SOURCES.get(term, "derived")] += gib
    kinds = timing["kinds_s"]
    factor = (timing.get("calibration") or {}).get("operator_factor", 1.0)
    alone = kinds.get("operator", 0.0) / factor if factor else kinds.get("operator", 0.0)
    step = {
        "derived": kinds.get("matmul", 0.0) + alone + kinds.get("communication", 0.0),
        "fitted": kinds.get("operator", 0.0) - alone + kinds.get("framework", 0.0),
        "measured": kinds.get("data", 0.0),
    }
    share = lambda parts: {k: v / sum(parts.values()) if sum(parts.values()) else None for k, v in parts.items()}  # noqa: E731
    return {"peak_gib": peak, "peak_share": share(peak), "step_s": step, "step_share": share(step)}


def saved_bytes_at(block: dict, batch: int, length: int) -> float | None:
    """The predicted bytes saved for backward at another (batch, length), from the traced step's bytes by power of
    the length (what grows with the length grows with the batch)."""
    memory = block.get("memory") or {}
    traced = memory.get("traced")
    if not traced or not memory.get("saved_by_power"):
        return None
    total = 0.0
    for powers in memory["saved_by_power"].values():
        for power, size in powers.items():
            power = int(power)
            total += size * (length / traced["length"]) ** power * (batch / traced["batch"] if power else 1.0)
    return total


# ---------------------------------------------------------------- before a run: what train.py calls


def with_collate_costs(workload: Workload, tokenizer, data) -> Workload:
    """The workload with the seconds its training and evaluation batches take to collate, measured here."""
    from trainscope.data import build_collator

    settings, pad = workload.settings, workload.pad_to_multiple_of
    workload.collate_s = {
        "train": collate_seconds(
            data.train, build_collator(tokenizer, settings, pad), settings.per_device_batch_size, settings.seed
        ),
        "eval": collate_seconds(
            data.validation, build_collator(tokenizer, settings, pad), settings.resolved_eval_batch_size, settings.seed
        ),
    }
    return workload


def workload_for(settings, started, tokenizer, data, label_names=None) -> Workload:
    """The workload of this launch (train.py's settings, start-up, tokenizer and tokenized data)."""
    from trainscope.data import MODEL_INPUTS
    from trainscope.startup import plan_steps

    state = started.state
    device = state.device
    precision_name = precision_from_environment(device)
    workload = Workload(
        settings=settings,
        label_names=list(label_names or data.label_names),
        input_names=[c for c in data.train.column_names if c in MODEL_INPUTS],
        device=device,
        precision=precision_name,
        processes=state.num_processes,
        local_processes=environment.local_processes(),
        threads=torch.get_num_threads(),
        lengths={split: token_lengths(getattr(data, split)) for split in ("train", "validation", "test")},
        rss_bytes=current_rss_bytes(),
        plan=plan_steps(settings, len(data.train), state.num_processes),
    )
    return with_collate_costs(workload, tokenizer, data)


def before_run(settings, started, tokenizer, data) -> dict:
    """The prediction of this launch, made on every process (peers measure what is missing at once, as the peak
    does); the main process's is the record's. Never fails a run: an error becomes the block's `error`."""
    try:
        return predict(workload_for(settings, started, tokenizer, data), store=started.state.is_local_main_process)
    except Exception as error:  # the run goes on without a prediction; the record says why
        from trainscope.errors import one_line

        return {"version": VERSION, "error": one_line(error)}


# ---------------------------------------------------------------- the screen


def screen_lines(block: dict, settings, wall_s: float | None = None) -> list[str]:
    """The one screen `train.py --predict` prints."""
    if block.get("error"):
        return [f"no prediction: {block['error']}"]
    machine, batches, memory, timing = block["machine"], block["batches"], block["memory"], block["time"]
    gib = memory["terms_gib"]
    lines = [
        f"prediction: {settings.model} on {settings.dataset}, batch {batches['batch']} x {machine['processes']} "
        f"process(es), {machine['precision']}, {machine['device_name']} ({machine['threads']} threads per process)",
        f"batches     {batches['micro_batches']} micro-batches per process: padded length {batches['mean_length']:.1f} "
        f"on average (real {batches['mean_real_length']:.1f}), longest {batches['longest']}; evaluation at batch "
        f"{batches['eval_batch']}: {sum(batches['eval_batches'].values())} batches",
        f"memory      {memory['kind']} {memory['peak_gib']:.2f} GiB per process -- "
        + ("fits" if memory["fits"] else "DOES NOT FIT")
        + (f" in {memory['capacity_gib']:.1f} GiB" if memory.get("capacity_gib") else ""),
    ]
    allocator = memory.get("allocator") or {}
    names = [
        ("baseline", "framework and data now (measured)"),
        ("parameters", "parameters"),
        ("optimizer", "optimizer state (AdamW)"),
        ("activations", f"activations kept for backward (length {memory['at_length']})"),
        ("temporaries", f"gradients ({memory['gradients_gib']:.3f} in all), backward's temporaries"),
        ("ddp_buckets", "DDP's gradient buckets"),
        (
            "allocator",
            f"allocator ({allocator['factor']:.2f} x live + {allocator['constant_bytes'] / GIB:.2f})"
            if allocator.get("calibrated")
            else "allocator (not calibrated)",
        ),
    ]
    lines += [
        f"  {label:<56} {gib[key]:7.3f} GiB" for key, label in names if key in gib and (key != "allocator" or allocator)
    ]
    layers = {k: v for k, v in (memory.get("activations_by_layer_gib") or {}).items() if v * 1024 >= 0.5}
    if layers:
        lines.append("  activations by layer: " + ", ".join(f"{k} {v * 1024:.0f} MiB" for k, v in layers.items()))
    stages = timing["stages_s"]
    kinds = timing["kinds_s"]
    step = timing["step_s"]
    lines += [
        f"time        steady step {step:.3f} s: "
        + ", ".join(f"{k} {v:.3f}" for k, v in stages.items() if v)
        + f"; matmuls {kinds.get('matmul', 0) / step:.0%} (at the measured peak), other operators "
        f"{kinds.get('operator', 0) / step:.0%}, framework {kinds.get('framework', 0) / step:.0%}"
        if step
        else "",
        f"            run: {batches['micro_batches'] // max(1, batches['accumulation'])} steps "
        f"({batches['warmup_steps']} warm-up, first {timing['first_step_s'] or 0:.2f} s), evaluation "
        f"{timing['evaluation_s']:.1f} s -> {timing['run_s']:.1f} s ({timing['run_s'] / 60:.1f} min)",
    ]
    lines += source_lines(block)
    lines += [f"note: {note}" for note in block.get("notes", [])]
    lines.append(
        f"predicted in {wall_s if wall_s is not None else block['seconds']:.1f} s "
        f"({machine['timed_now']} costs timed now, cached in {machine['cost_cache']}); nothing trained, "
        "no run record written"
    )
    return [line for line in lines if line]


def source_lines(block: dict) -> list[str]:
    """What the prediction rests on, its calibration, and a warning for each fit held at a bound."""
    found = block.get("sources")
    state = block.get("calibration") or {}
    if not found:
        return []
    peak, step = found["peak_share"], found["step_share"]
    pct = lambda share: f"{share:.0%}" if share is not None else "-"  # noqa: E731
    lines = [
        f"rests on    peak: {pct(peak['derived'])} derived, {pct(peak['fitted'])} fitted, {pct(peak['measured'])} "
        f"measured in this run; step: {pct(step['derived'])} derived, {pct(step['fitted'])} fitted, "
        f"{pct(step['measured'])} measured"
    ]
    if state.get("state") == "uncalibrated":
        why = f" ({state['error']})" if state.get("error") else ""
        lines.append(
            f"UNCALIBRATED: this machine has no calibration{why}: the allocator's share and the framework's "
            "time are left out, so memory and time are predicted low (make predict-calibrate)"
        )
    elif state.get("state") == "first use":
        lines.append(
            f"calibrated now (first use on this machine, {state.get('seconds') or 0:.0f} s, cached: "
            f"{state.get('path')})"
        )
    lines += [
        f"warning: the calibration's {bound}: the fitted term does not fit this machine"
        for bound in state.get("at_bound") or []
    ]
    return lines


def show(block: dict, settings, started) -> dict:
    """--predict: the screen, on the main process only; nothing else happens. A prediction that could not be made
    is the command's one error line."""
    from trainscope.errors import UserError

    if block.get("error"):
        raise UserError(f"no prediction: {block['error']}")
    if started.state.is_main_process:
        print("\n".join(screen_lines(block, settings)), flush=True)
    return {"prediction": block}


# ---------------------------------------------------------------- in the run: the measured side of each term


class Check:
    """The measured counterpart of each predicted term, taken in the run it predicts (trainscope.run_metrics owns
    it): the parameters' and optimizer state's bytes (real tensors, after the first optimizer step), the bytes
    autograd saves for backward in the first micro-batch (saved-tensor hooks, each storage once, the parameters
    left out: as predicted), and at the end the error of each predicted quantity. With --compile or --resume the
    saved bytes are not measured (the hooks would break the graph; the first step already ran), nor under FSDP2
    (see first_micro_batch); there the bytes are this rank's shards."""

    def __init__(self, block: dict | None, settings):
        self.block = block if block and not block.get("error") else None
        self.settings = settings
        self.model = self.optimizer = None
        self.measured: dict = {}
        self._hooks = None
        self._seen: set = set()
        self._params: set = set()
        self._sharded = False  # FSDP2: DTensor parameters

    def attach(self, model, optimizer) -> None:
        """This rank's bytes: under FSDP2 the parameters, gradients and optimizer state are DTensors, and their local
        shards are what the rank holds (and what has a storage to read)."""
        from trainscope.memory import is_sharded, local_bytes, local_tensor

        self.model, self.optimizer = model, optimizer
        if self.block is None:
            return
        params = list(model.parameters())
        self.measured["parameters"] = sum(local_bytes(p) for p in params)
        self.measured["gradients"] = sum(local_bytes(p) for p in params if p.requires_grad)
        self._params = {local_tensor(p).untyped_storage().data_ptr() for p in params}
        self._sharded = any(is_sharded(p) for p in params)

    def first_micro_batch(self) -> None:
        """Before the run's first micro-batch: count what autograd saves for backward (not under FSDP2: its gathered
        weights are saved too, in storages of their own that are not the sharded parameters')."""
        if self.block is None or self.settings.compile or self.settings.resume or self._sharded:
            return
        self.measured["saved"] = 0
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda tensor: tensor)
        self._hooks.__enter__()

    def _pack(self, tensor):
        storage = tensor.untyped_storage()
        pointer = storage.data_ptr()
        if pointer not in self._params and pointer not in self._seen:
            self._seen.add(pointer)
            self.measured["saved"] += storage.nbytes()
        return tensor

    def micro_batch_done(self, batch: dict, stepped: bool) -> None:
        """After a micro-batch: the hooks come off after the first; the optimizer state is read after its first step."""
        if self._hooks is not None:
            self._hooks.__exit__(None, None, None)
            self._hooks, self._seen = None, set()
            self.measured["saved_at"] = list(batch["input_ids"].shape)
        if stepped and self.block is not None and "optimizer" not in self.measured and self.optimizer is not None:
            from trainscope.memory import local_tensor

            tensors = [
                local_tensor(t)
                for state in self.optimizer.state.values()
                for t in state.values()
                if isinstance(t, torch.Tensor)
            ]
            storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
            self.measured["optimizer"] = sum(storages.values())

    def errors(self, summary: dict) -> dict | None:
        """summary `prediction_error` (docs/RECORD.md)."""
        return prediction_errors(self.block, summary, self.measured) if self.block else None


def _error(predicted, measured) -> dict | None:
    if predicted is None or measured is None:
        return None
    return {
        "predicted": predicted,
        "measured": measured,
        "error": (predicted - measured) / measured if measured else None,
    }


def prediction_errors(block: dict, summary: dict, measured: dict) -> dict:
    """Each predicted quantity against the run's measurement: peak memory, and the peak above the memory the run held
    before the model (measured in the same run and so the same on both sides: the error of what was predicted), the
    steady step and its stages, the warm-up, evaluation and the whole run; each memory term measured in the run; the
    residual (what the measured peak leaves after the measured terms, against what the prediction put there: not a
    measurement of any one term); the measured term furthest off (its error as a share of its quantity's total)."""
    from trainscope.record_view import RunView

    view = RunView({"summary": summary})
    memory, timing = block["memory"], block["time"]
    peak, kind = view.peak_memory
    baseline = memory["terms_gib"].get("baseline", 0.0)
    result = {
        "peak_memory_gib": _error(memory["peak_gib"], peak),
        "memory_kind": kind,
        "peak_above_baseline_gib": _error(memory["peak_gib"] - baseline, peak - baseline if peak else None),
        "step_s": _error(timing["step_s"], view.step_s),
        "evaluation_s": _error(timing["evaluation_s"], view.eval_s or None),
        "warmup_s": _error(timing["warmup_s"], view.wall_median("warmup")),
        "run_s": _error(timing["run_s"], view.wall_s),
    }
    per_step = view.stage_seconds_per_step() if view.step_s else {}
    stages = dict(timing["stages_s"])
    stages["backward"] = stages.get("backward", 0.0) + stages.pop("communication", 0.0)  # measured inside backward
    stages.setdefault("other", 0.0)
    time_terms = {stage: _error(stages.get(stage, 0.0), per_step.get(stage)) for stage in per_step}
    gib = {**memory["terms_gib"], "gradients": memory["gradients_gib"]}
    memory_terms = {}
    for term in ("parameters", "gradients", "optimizer"):
        if term in measured:
            memory_terms[term] = _error(gib[term], measured[term] / GIB)
    if measured.get("saved_at"):
        batch, length = measured["saved_at"]
        predicted_saved = saved_bytes_at(block, batch, length)
        memory_terms["activations"] = _error(
            predicted_saved / GIB if predicted_saved else None, measured["saved"] / GIB
        )
    if peak is not None and all(t in memory_terms for t in ("parameters", "optimizer")):
        # The residual (gradients and temporaries at the peak, the allocator's share) is what the measured peak leaves
        # after the measured terms, the activations at the longest batch scaled by their measured error.
        ratio = 1.0
        if memory_terms.get("activations") and memory_terms["activations"]["predicted"]:
            ratio = memory_terms["activations"]["measured"] / memory_terms["activations"]["predicted"]
        held = sum(memory_terms[t]["measured"] for t in ("parameters", "optimizer"))
        remainder = peak - gib.get("baseline", 0.0) - held - gib["activations"] * ratio
        result["memory_residual"] = _error(
            gib["temporaries"] + gib.get("allocator", 0.0) + gib.get("ddp_buckets", 0.0), remainder
        )
    result["memory_terms"] = memory_terms
    result["time_terms"] = time_terms
    result["calibration"] = (block.get("calibration") or {}).get("state")
    result["furthest"] = furthest_term(result, peak, view.step_s)
    return result


def furthest_term(result: dict, peak: float | None, step: float | None) -> dict | None:
    """The measured term whose error moves its total most: |predicted - measured| over the measured total (memory
    terms over the peak, stage terms over the steady step). The residual is not a term: it is what is left."""
    candidates = []
    for name, entry in (result.get("memory_terms") or {}).items():
        if entry and peak:
            candidates.append((abs(entry["predicted"] - entry["measured"]) / peak, f"memory: {name}", entry))
    for name, entry in (result.get("time_terms") or {}).items():
        if entry and step:
            candidates.append((abs(entry["predicted"] - entry["measured"]) / step, f"time: {name}", entry))
    if not candidates:
        return None
    share, name, entry = max(candidates, key=lambda c: c[0])
    return {"term": name, "share_of_total": share, "error": entry["error"]}


def remember_communication(block: dict | None, summary: dict, settings, started) -> None:
    """After a multi-process run: its all-reduce bandwidth and the share of it backward waited for, for the next
    prediction on this machine with these processes and threads (main process)."""
    from trainscope.record_view import RunView

    if not block or block.get("error") or not started.state.is_main_process:
        return
    figures = RunView({"summary": summary or {}}).communication_figures or {}
    bandwidth, transfer = figures.get("bus_bandwidth_gbs"), figures.get("transfer_s")
    if not figures.get("measured") or not bandwidth or not transfer:
        return
    # The median exposed time, resolved or not: the best estimate there is (a note says when it was not resolved).
    exposed = figures.get("exposed_median_s") or 0.0
    device = torch.device(block["machine"]["device"].split(":")[0])
    costs = op_costs.OpCosts(device, block["machine"]["threads"], environment.local_processes())
    costs.cached["communication"] = {
        "bus_bandwidth_gbs": bandwidth,
        "exposed_fraction": min(1.0, max(0.0, exposed / transfer)),
        "exposed_resolved": bool(figures.get("resolved")),
        "measured": now_iso(),
    }
    costs.measured += 1
    costs.save()


def error_lines(errors: dict | None) -> list[str]:
    """The end-of-run table's lines on the prediction."""
    if not errors:
        return []

    def pct(entry):
        return f"{entry['error']:+.0%}" if entry and entry.get("error") is not None else "n/a"

    memory, step, run = errors.get("peak_memory_gib"), errors.get("step_s"), errors.get("run_s")
    parts = []
    if memory:
        parts.append(
            f"peak memory {memory['predicted']:.2f} GiB predicted, {memory['measured']:.2f} measured ({pct(memory)})"
        )
    if step:
        parts.append(f"steady step {step['predicted']:.3f} s, {step['measured']:.3f} ({pct(step)})")
    if run:
        parts.append(f"run {run['predicted']:.1f} s, {run['measured']:.1f} ({pct(run)})")
    state = errors.get("calibration")
    said = (
        f" ({state}: {'calibrated now, on first use' if state == 'first use' else 'fitted terms left out'})"
        if state and state != "calibrated"
        else ""
    )
    lines = ["prediction: " + "; ".join(parts) + said] if parts else []
    above, residual = errors.get("peak_above_baseline_gib"), errors.get("memory_residual")
    if above:
        lines.append(
            f"  peak above the memory before the model {above['predicted']:.2f} GiB predicted, "
            f"{above['measured']:.2f} measured ({pct(above)})"
            + (
                f"; residual (the peak less the measured terms) {residual['predicted']:.2f} GiB predicted, "
                f"{residual['measured']:.2f} left"
                if residual
                else ""
            )
        )
    furthest = errors.get("furthest")
    if furthest:
        lines.append(
            f"  furthest off: {furthest['term']} ({pct(furthest)} of itself, "
            f"{furthest['share_of_total']:.0%} of its total)"
        )
    return lines


# ---------------------------------------------------------------- what a change would do


def settings_of(record_or_settings):
    """The Settings of a run record (or Settings themselves), fields unknown to this trainscope left out."""
    from trainscope.settings import Settings

    if isinstance(record_or_settings, Settings):
        return record_or_settings
    values = record_or_settings.get("settings") or {}
    known = {f.name for f in dataclasses.fields(Settings)}
    return Settings(**{k: v for k, v in values.items() if k in known})


def changed_settings(settings, flags) -> object:
    """`settings` with train.py `flags` applied (the fields those flags set to something else than the default)."""
    from trainscope.settings import Settings, parse_settings

    if not flags:
        return settings
    (given,) = parse_settings(argv=list(flags))
    default = Settings()
    changes = {
        f.name: getattr(given, f.name)
        for f in dataclasses.fields(Settings)
        if getattr(given, f.name) != getattr(default, f.name)
    }
    return dataclasses.replace(settings, **changes)


_DATA_MEMO: dict = {}


def _data_for(settings):
    """Tokenizer and tokenized data of `settings` (from the datasets cache), kept for the process's later calls."""
    from trainscope.data import load_classification_data
    from trainscope.modeling import build_tokenizer

    key = (
        settings.model,
        settings.tokenizer,
        settings.dataset,
        settings.dataset_config,
        settings.max_seq_length,
        settings.max_train_samples,
        settings.max_eval_samples,
        settings.max_test_samples,
        settings.resolved_data_seed,
        settings.text_column,
        settings.label_column,
        settings.validation_fraction,
        settings.test_fraction,
    )
    if key not in _DATA_MEMO:
        tokenizer = build_tokenizer(settings)
        _DATA_MEMO[key] = (tokenizer, load_classification_data(settings, tokenizer, contextlib.nullcontext))
    return _DATA_MEMO[key]


def workload_of(record: dict | None, settings, config: str | None = None) -> Workload:
    """The workload `settings` would be on the machine and launch of `record` (or of this process when None), with
    `config`'s processes and precision where given."""
    from trainscope import launching
    from trainscope.data import MODEL_INPUTS
    from trainscope.startup import plan_steps

    env = (record or {}).get("environment") or {}
    device = torch.device((env.get("device") or ("cuda" if torch.cuda.is_available() else "cpu")).split(":")[0])
    processes = env.get("world_size") or 1
    precision_name = env.get("effective_precision") or precision_from_environment(device)
    threads = (env.get("threads") or {}).get("torch_threads") or torch.get_num_threads()
    if config:
        facts = launching.config_facts(launching.config_path(config))
        processes = facts["num_processes"]
        requested = facts["mixed_precision"]
        precision_name = precision_from_environment(device, {"ACCELERATE_MIXED_PRECISION": requested})
        if settings.threads == "auto":
            threads = max(1, environment.usable_cores() // processes)
    tokenizer, data = _data_for(settings)
    workload = Workload(
        settings=settings,
        label_names=list(data.label_names),
        input_names=[c for c in data.train.column_names if c in MODEL_INPUTS],
        device=device,
        precision=precision_name,
        processes=processes,
        local_processes=processes,
        threads=threads,
        lengths={split: token_lengths(getattr(data, split)) for split in ("train", "validation", "test")},
        rss_bytes=None,
        plan=plan_steps(settings, len(data.train), processes),
    )
    return with_collate_costs(workload, tokenizer, data)


def same_work_seconds(block: dict, workload: Workload) -> tuple[float, float, float]:
    """(seconds of the run for its training tokens and evaluation, training tokens): what make tune compares, the
    training part per real token (trainscope.tune.work_seconds)."""
    timing = block["time"]
    settings = workload.settings
    tokens = (
        block["batches"]["micro_batches"]
        * settings.per_device_batch_size
        * workload.processes
        * block["batches"]["mean_real_length"]
    )
    return timing["run_s"] - timing["evaluation_s"], timing["evaluation_s"], tokens


def speedup(baseline, flags=(), config: str | None = None) -> dict:
    """The predicted speed-up of a change against a baseline run, on the same work (make tune's measure: training
    time per real training token, evaluation as it is): `baseline` a run record (its machine, launch and settings)
    or Settings (this machine, this launch); `flags` train.py flags and/or `config` an Accelerate config to launch
    with. {"ratio": baseline seconds / changed seconds (above 1: faster), "baseline_s", "changed_s"}."""
    record = baseline if isinstance(baseline, dict) else None
    before_settings = settings_of(baseline)
    after_settings = changed_settings(before_settings, flags)
    before_work = workload_of(record, before_settings)
    after_work = workload_of(record, after_settings, config)
    # a ratio of two predictions on this machine: its calibration if it has one, none made for it (the report and
    # the advisor ask for speed-ups; only a run's own prediction calibrates a new machine)
    fitted = calibration.read_calibration(before_work.device)
    before, after = predict(before_work, fitted=fitted), predict(after_work, fitted=fitted)
    train_b, eval_b, tokens_b = same_work_seconds(before, before_work)
    train_a, eval_a, tokens_a = same_work_seconds(after, after_work)
    baseline_s = train_b + eval_b
    changed_s = train_a * (tokens_b / tokens_a if tokens_a else 1.0) + eval_a
    return {
        "ratio": baseline_s / changed_s if changed_s else None,
        "baseline_s": baseline_s,
        "changed_s": changed_s,
        "flags": list(flags),
        "config": config,
    }


def largest_batch(
    settings,
    label_names,
    input_names,
    device: torch.device,
    precision_name: str,
    length: int,
    capacity_bytes: int | None = None,
    baseline_bytes: int = 0,
) -> dict:
    """The largest per-device batch whose predicted peak fits in `capacity_bytes` (the device's memory by default)
    at sequences of `length`: what grows with the length grows with the batch (trainscope.trace), the parameters and
    the optimizer state do not; on a CPU with the calibrated allocator's share."""
    from trainscope import modeling

    capacity = capacity_bytes if capacity_bytes is not None else device_memory_bytes(device)
    config = modeling.model_config(settings, label_names)
    avoid = _model_dims(config, 8, 16, len(label_names))
    traced_at = traced_length(length, 8, avoid | {16 * length}, modeling.config_positions(config))
    build = lambda: _on_meta(lambda: modeling.build_architecture(settings, label_names, config=config))  # noqa: E731
    with quiet_fake_tensors():
        traced = trace.trace_training(
            build,
            input_names,
            8,
            traced_at,
            precision_name,
            device,
            settings.max_grad_norm,
            settings.weight_decay,
            avoid,
        )
    live = lambda batch: sum(v for k, v in traced.memory_at(length, batch).items() if k != "parameters")  # noqa: E731
    per_sample = (live(16) - live(8)) / 8
    fixed_live = live(8) - 8 * per_sample
    allocator_fit = calibration.read_calibration(device).get("allocator") if device.type == "cpu" else None
    factor = 1 + (allocator_fit["factor"] if allocator_fit else 0.0)
    constant = allocator_fit["constant_bytes"] if allocator_fit else 0.0
    # peak(b) = baseline + parameters + (fixed_live + b x per_sample) x factor + constant
    room = capacity - baseline_bytes - traced.parameter_bytes - constant - fixed_live * factor
    batch = int(room // (per_sample * factor)) if per_sample > 0 and room > 0 else 0
    return {
        "batch": batch,
        "per_sample_bytes": per_sample,
        "fixed_bytes": fixed_live + traced.parameter_bytes,
        "capacity_bytes": capacity,
        "length": length,
    }


# ---------------------------------------------------------------- python -m trainscope.predict --calibrate


def main(argv=None) -> None:
    """The calibration's command (trainscope.calibration.main): make predict-calibrate."""
    calibration.main(argv)


if __name__ == "__main__":
    main()
