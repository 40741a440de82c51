"""The one typed view of a run record: every reader (report, advisor, tune, experiments, benchmarks, health checks)
asks `RunView` for the figures it needs; the record's raw keys appear only here and in the writer
(trainscope.run.metrics, trainscope.run.lifecycle); docs/RECORD.md describes them. A partial record (a header
without a summary, an interrupted run's) reads what is absent as None or empty."""

from trainscope.core.communication_view import (
    COMMUNICATION_BLOCK_FIGURES,
    COMMUNICATION_FIGURES,
    hidden_share,
    per_step_readings,
    resolved,
    two_pass_readings,
)
from trainscope.core.results_view import Machine, reader

TRAINING_STAGES = ("data", "forward", "backward", "optimizer", "other")


def option_words(name: str, value=None, options_as: str = "flags") -> str:
    """An option as its driver writes it: train.py's flag (`--memory-every 10`, `--profile`) or a keyword of
    trainscope.Run (`memory_every=10`, `profile=True`)."""
    if options_as == "keywords":
        value = int(value) if isinstance(value, str) and value.isdigit() else value  # a flag's "10" is a number
        return f"{name}={value!r}" if value is not None else f"{name}=True"
    flag = "--" + name.replace("_", "-")
    return f"{flag} {value}" if value is not None else flag


class RunView:
    def __init__(self, record: dict):
        self.record = record

    # ---------------------------------------------------------------- identity and conditions

    path = reader("record", "path")  # set by the report's reader
    status = reader("record", "status")
    finished = reader("record", "finished", str)
    # Checkpoints --resume found unusable and passed over ({checkpoint, problem}), at the latest resume.
    checkpoints_skipped = reader("record", "checkpoints_skipped", list)
    # Why the record a resumed run continued could not be read (the run then began a new one).
    record_rebuilt = reader("record", "record_rebuilt")
    settings = reader("record", "settings", dict)
    env = reader("record", "environment", dict)
    precision = reader("env", "effective_precision")
    requested_precision = reader("env", "requested_precision")
    threads = reader("env", "threads", dict)
    backend = reader("env", "backend")
    model_facts = reader("record", "model", dict)
    plan = reader("record", "plan", dict)
    trackers = reader("record", "trackers", dict)
    warnings = reader("record", "warnings", list)
    steps = reader("record", "steps", list)  # attached by the report's reader

    @property
    def name(self) -> str:
        return self.record.get("run_name", "?")

    @property
    def script(self) -> str | None:
        """The file name of the script its command ran (`train.py` from `accelerate launch ... train.py ...` or
        `python train.py ...`), None where the command names no .py file."""
        command = (self.record.get("provenance") or {}).get("command") or ""
        return next((part.rsplit("/", 1)[-1] for part in command.split() if part.endswith(".py")), None)

    @property
    def options_as(self) -> str:
        """How the run's driver writes its options, as its record says: "flags" (train.py's command line) or
        "keywords" (trainscope.Run's or the Trainer callback's). Records before schema 6 say it by their
        `instrument` block, which only a run of trainscope.Run had."""
        instrument = self.record.get("instrument")
        return (instrument or {}).get("options") or ("keywords" if instrument else "flags")

    def option(self, name: str, value=None) -> str:
        """One of the run's options as whoever ran it writes it: `--memory-every 10` or `memory_every=10`."""
        return option_words(name, value, self.options_as)

    @property
    def own_cost(self) -> dict | None:
        """What trainscope's own work cost the run, seconds (`instrument.cost_s`: start_s, after_loop_s, writing_s,
        total_s, run_s, budget_s); None in older records and unfinished runs."""
        return (self.record.get("instrument") or {}).get("cost_s")

    def setting(self, name: str, default=None):
        return self.settings.get(name, default)

    @property
    def device(self) -> str:
        return str(self.env.get("device", ""))

    @property
    def on_cuda(self) -> bool:
        return self.device.startswith("cuda")

    @property
    def on_cpu(self) -> bool:
        return self.device.startswith("cpu")

    @property
    def device_name(self) -> str:
        return self.env.get("device_name", "?")

    @property
    def machine(self) -> "Machine":
        """The machine that measured this run: its GPU where it ran on one, its CPU's model and ISA class
        (environment, and the provenance's `machine` block for a GPU run's host), its usable cores."""
        env, host = self.env, (self.record.get("provenance") or {}).get("machine") or {}
        gpu = env.get("device_name") if self.on_cuda else None
        flags = (env.get("cpu_bf16") or {}).get("flags")
        return Machine(
            cpu=host.get("cpu") or (env.get("device_name") if self.on_cpu else None),
            capability=env.get("cpu_capability") or host.get("cpu_capability"),
            bf16_flags=tuple(flags) if flags else None,
            gpu=gpu,
            gpus=(env.get("device_count") or 1) if gpu else 0,
            cores=env.get("usable_cores") or host.get("usable_cores"),
        )

    @property
    def tf32_in_effect(self) -> bool:
        """Whether TF32 matmuls were in effect (asked for or not)."""
        return bool(self.env.get("tf32_in_effect"))

    @property
    def torch_threads(self) -> int | None:
        """The intra-op threads each process used (schema 1 records have it at the top of the environment)."""
        return self.threads.get("torch_threads", self.env.get("torch_threads"))

    @property
    def warning_codes(self) -> list[str]:
        return [w["code"] for w in self.warnings]

    # ---------------------------------------------------------------- the summary

    summary = reader("record", "summary", dict)
    wall_s = reader("summary", "wall_s")
    throughput = reader("summary", "throughput", dict)
    samples_per_s = reader("throughput", "samples_per_s")
    tokens_per_s = reader("throughput", "tokens_per_s")
    step_s = reader("throughput", "step_s")
    optimizer_steps_timed = reader("throughput", "optimizer_steps")
    memory = reader("summary", "memory", dict)
    # The device's busy time and idle share per training step (trainscope.measure.summary.device_time): the CUDA events'
    # bound `busy_at_most_s` / `idle_share_at_least`, the `kernel_estimate`, `host_bound` (and `host_bound_by`), or the
    # `reason` they are None (a CPU's host clocks, --timing sync); {} in older records.
    device_time = reader("summary", "device_time", dict)
    device_memory_gib = reader("env", "device_memory_gib")
    validation = reader("summary", "validation", list)
    test = reader("summary", "test", dict)
    mfu = reader("summary", "mfu")
    # The machine's measured matmul peak block (trainscope.measure.peak.machine_peak; schema 5).
    machine_peak = reader("env", "machine_peak")
    # The run against its machine's measured peak for the precision in effect: {precision, peak_tflops, peak_shape,
    # spread, measured, key_id, achieved_tflops, share, gap_estimate} (schema 5).
    measured_peak = reader("summary", "measured_peak")
    # What the model FLOPs count (trainscope.measure.flops): {trained_share, adapter_weights, input_gradient,
    # recomputed, recomputed_tflops_per_device}; {} in older records (PaLM's 6N for every run: LoRA overstated).
    model_flops = reader("summary", "model_flops", dict)
    # Model TFLOP/s per device on real tokens only (padding positions not counted); None in older records.
    real_tflops_per_device = reader("throughput", "real_tflops_per_device")
    # The share of the counted training FLOPs that went to padding positions; None in older records.
    padding_flops_share = reader("throughput", "padding_flops_share")
    # The attention kernel torch picks for this model in training and evaluation ({training, evaluation,
    # attention_dropout}), or None (eager attention, older records).
    sdpa_kernels = reader("env", "sdpa_kernels")
    compile = reader("summary", "compile")
    profile = reader("summary", "profile")
    communication = reader("summary", "communication")
    # Each predicted quantity against what the run measured (summary `prediction_error`).
    prediction_error = reader("summary", "prediction_error")

    @property
    def partial(self) -> bool:
        return bool(self.summary.get("partial"))

    @property
    def world_size(self) -> int:
        return self.summary.get("world_size") or self.env.get("world_size") or 1

    def timing(self, phase: str) -> dict:
        """Across-rank stage table of a phase (run, steady, warmup, ...)."""
        return ((self.summary.get("timing") or {}).get("across_ranks") or {}).get(phase) or {}

    @property
    def per_rank(self) -> list[dict]:
        return (self.summary.get("timing") or {}).get("per_rank") or []

    @property
    def steady_phase(self) -> str:
        """'steady' when the run had steady steps, else 'run'."""
        steady = self.timing("steady")
        return "steady" if steady and steady["wall_s"]["median"] > 0 else "run"

    def shares(self, phase: str | None = None) -> dict:
        """Stage shares of a phase, median over ranks (default: the steady phase)."""
        table = self.timing(phase or self.steady_phase)
        return {stage: value["median"] for stage, value in (table.get("shares") or {}).items()}

    def stage_seconds(self, phase: str = "run") -> dict:
        table = self.timing(phase)
        return {stage: value["median"] for stage, value in (table.get("seconds") or {}).items()}

    def category_seconds(self, phase: str = "run") -> dict:
        table = self.timing(phase)
        return {name: value["median"] for name, value in (table.get("category_seconds") or {}).items()}

    def wall_median(self, phase: str = "run") -> float | None:
        table = self.timing(phase)
        return table["wall_s"]["median"] if table else None

    def stage_seconds_per_step(self) -> dict:
        """Training stages per optimizer step (steady phase, median over ranks)."""
        phase = self.steady_phase
        steps = self.optimizer_steps_timed or self.summary.get("optimizer_steps") or 1
        seconds = self.stage_seconds(phase)
        return {stage: seconds.get(stage, 0.0) / steps for stage in TRAINING_STAGES}

    @property
    def eval_s(self) -> float:
        """Evaluation seconds of the whole run (median over ranks)."""
        return self.stage_seconds("run").get("eval", 0.0)

    @property
    def padding(self) -> dict:
        """Real and padded token positions of the steady training phase, and of evaluation where recorded."""
        keys = {"tokens": "tokens", "padded": "padded_tokens", "samples": "samples", "padded_squares": "padded_squares"}
        parts = (("train", self.throughput), ("eval", self.summary.get("evaluation_tokens") or {}))
        return {f"{part}_{name}": found.get(key) for part, found in parts for name, key in keys.items()}

    def run_counts(self) -> dict:
        """Samples, real tokens and optimizer steps trained over the whole run, all ranks."""
        totals = {"samples": 0, "tokens": 0, "optimizer_steps": 0}
        for rank in self.per_rank:
            for counts in (rank.get("counts") or {}).values():
                totals["samples"] += counts.get("samples", 0)
                totals["tokens"] += counts.get("tokens", 0)
                if rank is self.per_rank[0]:
                    totals["optimizer_steps"] += counts.get("optimizer_steps", 0)
        return totals

    @property
    def train_wall_s(self) -> float | None:
        """The whole run's wall time less evaluation (median over ranks)."""
        wall = self.wall_median("run")
        return None if wall is None else wall - self.eval_s

    @property
    def peak_memory(self) -> tuple[float | None, str]:
        """The one peak-memory figure to show: (GiB, kind), the device allocator's max over ranks where there
        is one (CUDA), else the processes' peak RSS."""
        memory = self.memory
        if "max_allocated_gib" in memory:
            return memory["max_allocated_gib"]["max"], "max allocated"
        if "peak_rss_gib" in memory:
            return memory["peak_rss_gib"]["max"], "peak RSS"
        return None, "unknown"

    @property
    def host_bound(self) -> bool:
        """The device idled above summary.device_time's threshold in each step, measured or estimated."""
        return bool(self.device_time.get("host_bound"))

    @property
    def max_allocated_gib(self) -> float | None:
        return (self.memory.get("max_allocated_gib") or {}).get("max")

    @property
    def last_validation(self) -> dict:
        return self.validation[-1] if self.validation else {}

    @property
    def run_operations(self) -> dict | None:
        """The run's own model timed alone after the loop on a micro-batch of its own (trainscope.measure.operations):
        {configurations [{name, precision, threads, rows, seconds {median, low, high} per mean micro-batch, calls,
        error}], precision, threads, micro_batches_per_step, others_cores, basis, measured, cost_s}, or {reason} where
        nothing was kept; None in older records."""
        return ((self.measured_peak or {}).get("run_shapes") or {}).get("operations")

    @property
    def micro_batch_s(self) -> float | None:
        """Training seconds per micro-batch over the phase the throughput covers (steady, else warm-up): the slowest
        rank's training time less evaluation over rank 0's micro-batches."""
        wall, micro_batches = self.throughput.get("train_wall_s"), self._throughput_counts.get("micro_batches")
        return wall / micro_batches if wall and micro_batches else None

    @property
    def micro_batch_samples(self) -> int | None:
        """The mean samples per micro-batch of the phase the throughput covers, on rank 0 (a loop's own batch size,
        where its settings do not say it)."""
        found = self._throughput_counts
        return round(found["samples"] / found["micro_batches"]) if found.get("micro_batches") else None

    @property
    def _throughput_counts(self) -> dict:
        """Rank 0's counts of the phase the throughput covers: steady, else warm-up."""
        counts = (self.per_rank[0].get("counts") or {}) if self.per_rank else {}
        return counts.get("steady" if (counts.get("steady") or {}).get("optimizer_steps") else "warmup") or {}

    def measured_peak_tflops(self, precision: str | None = None) -> float | None:
        """This machine's measured matmul peak in `precision` (default: the run's), from the environment's block."""
        found = ((self.machine_peak or {}).get("precisions") or {}).get(precision or self.precision)
        return found["peak_tflops"] if found else None

    @property
    def cpu_bf16(self) -> dict:
        """bf16 on a CPU, the flags and the measured matmuls together: {flags, native_by_flags, fp32_tflops,
        bf16_tflops, speedup, faster}. Schema 3 records had a 1024^2 matmul timing (`cpu_bf16_matmul`), read here
        as the speed-up of the same name; {} where neither was recorded."""
        if self.env.get("cpu_bf16"):
            return self.env["cpu_bf16"]
        old = self.env.get("cpu_bf16_matmul")
        if old and old.get("speedup"):
            return {
                "flags": [],
                "native_by_flags": self.env.get("cpu_native_bf16"),
                "speedup": old["speedup"],
                "faster": old["speedup"] > 1.0,
                "size": old.get("size"),
                "threads": old.get("threads"),
            }
        return {}

    @property
    def gap_breakdown(self) -> dict | None:
        """With --profile: self time per category over the traced steps and the matmuls' FLOPs (trainscope.measure.gap)."""
        return (self.profile or {}).get("breakdown")

    @property
    def communication_figures(self) -> dict | None:
        """The communication block's headline figures, whatever schema measured them, physical or not given: schema 3's
        two-pass estimate reads as a time with its calibration samples' interval (no overlap, no agreement).
        `exposed_s` is given only where resolved; `exposed_median_s` is the median either way."""
        block = self.communication
        if not block:
            return None
        old = block.get("method") is None
        figures = {key: block.get(key) for key in COMMUNICATION_BLOCK_FIGURES}
        figures["method"] = "two-pass estimate (schema 3)" if old else block["method"]
        if not block.get("measured"):
            return {**figures, "reason": block.get("reason"), "resolved": False, "agreement": None}
        exposed = block.get("exposed_s")
        interval, transfer, overlap, per_rank, agreed = (two_pass_readings if old else per_step_readings)(block)
        clear = exposed is not None and resolved(exposed, interval)
        share = block.get("exposed_share") if not old else exposed / self.step_s if exposed and self.step_s else None
        return {
            **figures,
            "exposed_s": exposed if clear else None,
            "exposed_median_s": exposed,
            "exposed_interval": interval,
            "resolved": clear,
            "exposed_share": share if clear else None,
            "transfer_s": transfer,
            "hidden_share": hidden_share(exposed, interval, transfer),
            "overlap": overlap if overlap is not None and 0 <= overlap <= 1 else None,
            "window_s": block.get("window_s"),
            "per_rank": per_rank,
            "stragglers": block.get("stragglers") or [],
            "agreement": agreed,
        }

    @property
    def prediction(self) -> dict | None:
        """The prediction made before the run (trainscope.predict), or None (an older record, or none made)."""
        block = self.record.get("prediction")
        return block if block and not block.get("error") else None

    @property
    def prediction_baseline_gib(self) -> float:
        """The memory the run held before its model, as its prediction measured it (GiB; 0 without a prediction)."""
        return (((self.prediction or {}).get("memory") or {}).get("terms_gib") or {}).get("baseline", 0.0)

    def with_prediction_error(self, errors: dict) -> dict:
        """A copy of the record whose summary `prediction_error` is `errors` (the record itself left as it is)."""
        return {**self.record, "summary": {**self.summary, "prediction_error": errors}}

    @property
    def losses(self) -> tuple[list[int], list[float]]:
        return [line["step"] for line in self.steps], [line["loss"] for line in self.steps]

    # ---------------------------------------------------------------- what readers compare

    def headline(self) -> dict:
        """The figures an experiment or `make tune` compares, from one run record."""
        peak, kind = self.peak_memory
        communication = self.communication_figures or {}
        compared = (*COMMUNICATION_FIGURES, "resolved", "exposed_interval", "agreement", "method")
        counts = self.run_counts()
        return {
            "run": self.name,
            "wall_s": self.wall_s,
            "samples_per_s": self.samples_per_s,
            "tokens_per_s": self.tokens_per_s,
            "step_s": self.step_s,
            "train_wall_s": self.train_wall_s,
            "eval_s": self.eval_s,
            "train_tokens": counts["tokens"],
            "train_samples": counts["samples"],
            "communication": {k: communication.get(k) for k in compared} if communication.get("measured") else None,
            "peak_memory_gib": peak,
            "memory_kind": kind,
            "test_accuracy": self.test.get("accuracy"),
            "validation_accuracy": self.last_validation.get("accuracy"),
            "validation_loss": self.last_validation.get("loss"),
            "test_loss": self.test.get("loss"),
            "precision": self.precision,
            "world_size": self.world_size,
            "warnings": self.warning_codes,
            "seed": self.setting("seed"),
            "data_seed": self.data_seed,
            "optimizer_steps": self.plan.get("optimizer_steps"),
            "steps_per_epoch": self.plan.get("steps_per_epoch"),
        }

    @property
    def data_seed(self) -> int | None:
        """The seed of the data split and subsets: --data-seed, else --seed (trainscope.workload.settings)."""
        data_seed = self.setting("data_seed")
        return self.setting("seed") if data_seed is None else data_seed

    @property
    def partial_epoch(self) -> tuple[int, int] | None:
        """(optimizer steps planned, steps in an epoch) when the run stops inside an epoch (--max-steps not a
        whole number of epochs): it trains on a subset of the data that depends on the order. None otherwise."""
        steps, epoch = self.plan.get("optimizer_steps"), self.plan.get("steps_per_epoch")
        return (steps, epoch) if steps and epoch and steps % epoch else None


def warning_lines(records) -> list[str]:
    """'run: [code] message' lines for the records a figure shows."""
    return [f"{RunView(r).name}: [{w['code']}] {w['message']}" for r in records for w in RunView(r).warnings]
