"""What a prediction is of: the run's settings and launch (`PlannedRun`: this launch's, or another's from its record),
and the batches it will see -- the padded length of each training and evaluation batch, from the data's real token
lengths, batched as the run batches them -- with the seconds a batch takes to collate, measured here."""

import contextlib
import dataclasses
import os
import statistics
import time
from pathlib import Path

import numpy as np
import torch

from trainscope.core import environment, launching
from trainscope.core.precision import tf32_in_effect
from trainscope.core.record_view import RunView
from trainscope.workload.settings import Settings, parse_settings, plan_steps

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


# ---------------------------------------------------------------- the planned run


@dataclasses.dataclass
class PlannedRun:
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


@dataclasses.dataclass
class Batches:
    """The batches a run will see on one process: each training micro-batch's padded length in order, the steady
    ones (after the warm-up steps), and each evaluation split's (padded length, rows) per batch."""

    train: np.ndarray
    steady: np.ndarray
    warmup: int  # optimizer steps
    accumulation: int
    evaluation: dict  # split -> (padded lengths, rows)

    @property
    def longest(self) -> int:
        return int(self.train.max())

    @property
    def eval_lengths(self) -> np.ndarray:
        """Every evaluation batch's padded length, validation then test."""
        return np.concatenate([self.evaluation["validation"][0], self.evaluation["test"][0]])


def run_batches(planned: PlannedRun) -> Batches:
    """The batches of `planned`'s run, as its settings and plan batch them (training_lengths, evaluation_lengths)."""
    settings, plan = planned.settings, planned.plan
    accumulation = settings.gradient_accumulation_steps
    micro_batches = max(1, plan.get("optimizer_steps", 1) * accumulation)
    train = training_lengths(
        planned.lengths["train"],
        settings.per_device_batch_size,
        micro_batches,
        planned.processes,
        settings.pad_to_max_length,
        settings.max_seq_length,
        settings.group_by_length,
        planned.pad_to_multiple_of,
        seed=settings.seed,
    )
    evaluation = {
        split: evaluation_lengths(
            planned.lengths[split],
            settings.resolved_eval_batch_size,
            planned.processes,
            settings.pad_to_max_length,
            settings.max_seq_length,
            getattr(settings, "eval_order", "given") == "length",
            planned.pad_to_multiple_of,
        )
        for split in ("validation", "test")
    }
    warmup = min(settings.timing_warmup_steps, plan.get("optimizer_steps", 1))
    steady = train[warmup * accumulation :] if len(train) > warmup * accumulation else train
    return Batches(train, steady, warmup, accumulation, evaluation)


# ---------------------------------------------------------------- this launch's, measured here


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


def _planned_run(settings, tokenizer, data, label_names, **launch) -> PlannedRun:
    """The planned run of `settings` on its tokenized `data` in `launch` (device, precision, processes,
    local_processes, threads, rss_bytes), with the seconds its batches take to collate, measured here."""
    from trainscope.workload.data import MODEL_INPUTS, build_collator  # deferred: it loads datasets

    planned = PlannedRun(
        settings=settings,
        label_names=list(label_names),
        input_names=[c for c in data.train.column_names if c in MODEL_INPUTS],
        lengths={split: token_lengths(getattr(data, split)) for split in ("train", "validation", "test")},
        plan=plan_steps(settings, len(data.train), launch["processes"]),
        **launch,
    )
    collate = build_collator(tokenizer, settings, planned.pad_to_multiple_of)
    planned.collate_s = {
        "train": collate_seconds(data.train, collate, settings.per_device_batch_size, settings.seed),
        "eval": collate_seconds(data.validation, collate, settings.resolved_eval_batch_size, settings.seed),
    }
    return planned


def planned_run_for(settings, started, tokenizer, data, label_names=None) -> PlannedRun:
    """The planned run of this launch (train.py's settings, start-up, tokenizer and tokenized data)."""
    device = started.state.device
    return _planned_run(
        settings,
        tokenizer,
        data,
        label_names or data.label_names,
        device=device,
        precision=precision_from_environment(device),
        processes=started.state.num_processes,
        local_processes=environment.local_processes(),
        threads=torch.get_num_threads(),
        rss_bytes=current_rss_bytes(),
    )


# ---------------------------------------------------------------- another launch's: a record's, or a change's


def settings_of(record_or_settings):
    """The Settings of a run record (or Settings themselves), fields unknown to this trainscope left out."""

    if isinstance(record_or_settings, Settings):
        return record_or_settings
    values = RunView(record_or_settings).settings
    known = {f.name for f in dataclasses.fields(Settings)}
    return Settings(**{k: v for k, v in values.items() if k in known})


def changed_settings(settings, flags) -> object:
    """`settings` with train.py `flags` applied (the fields those flags set to something else than the default)."""

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
# The settings a run's tokenizer and tokenized data depend on: what `data_for` keeps them by.
DATA_SETTINGS = tuple(
    "model tokenizer dataset dataset_config max_seq_length max_train_samples max_eval_samples max_test_samples "
    "resolved_data_seed text_column label_column validation_fraction test_fraction".split()
)


def data_for(settings):
    """Tokenizer and tokenized data of `settings` (from the datasets cache), kept for the process's later calls."""
    from trainscope.workload.data import load_classification_data  # deferred: it loads datasets
    from trainscope.workload.modeling import build_tokenizer  # deferred: it loads transformers' models

    key = tuple(getattr(settings, name) for name in DATA_SETTINGS)
    if key not in _DATA_MEMO:
        tokenizer = build_tokenizer(settings)
        _DATA_MEMO[key] = (tokenizer, load_classification_data(settings, tokenizer, contextlib.nullcontext))
    return _DATA_MEMO[key]


def planned_run_of(record: dict | None, settings, config: str | None = None) -> PlannedRun:
    """The run `settings` would be on the machine and launch of `record` (or of this process when None), with
    `config`'s processes and precision where given."""
    view = RunView(record or {})
    device = torch.device((view.device or ("cuda" if torch.cuda.is_available() else "cpu")).split(":")[0])
    processes = view.world_size
    precision_name = view.precision or precision_from_environment(device)
    threads = view.torch_threads or torch.get_num_threads()
    if config:
        facts = launching.config_facts(launching.config_path(config))
        processes = facts["num_processes"]
        precision_name = precision_from_environment(device, {"ACCELERATE_MIXED_PRECISION": facts["mixed_precision"]})
        if settings.threads == "auto":
            threads = max(1, environment.usable_cores() // processes)
    tokenizer, data = data_for(settings)
    return _planned_run(
        settings,
        tokenizer,
        data,
        data.label_names,
        device=device,
        precision=precision_name,
        processes=processes,
        local_processes=processes,
        threads=threads,
        rss_bytes=None,
    )
