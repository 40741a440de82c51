"""The machine a figure comes from (`Machine`: a run record's, through `RunView.machine`, or a results file's
provenance, `results_machine`) and the typed views of results files other than a run record (`LoaderSweepView`:
the DataLoader sweep's loaders.json). The run record's own view is trainscope.core.record_view.
"""

from dataclasses import dataclass

# ---------------------------------------------------------------- the machine a figure comes from


@dataclass(frozen=True, eq=False)
class Machine:
    """What measured a figure, as the record stores it: a CPU's model name (/proc/cpuinfo), its ISA class (torch's
    CPU capability and the native-bf16 flags, environment.cpu_capability), the GPU where one ran, the usable cores.
    Two figures are comparable only when their `Machine`s are equal; `text` names it for a reader."""

    cpu: str | None
    capability: str | None  # "AVX2, no native bf16", "AVX512 + amx_bf16, avx512_bf16"
    bf16_flags: tuple | None = None  # the native-bf16 flags the record lists (schema 5), else read from `capability`
    gpu: str | None = None
    gpus: int = 0
    cores: int | None = None

    @property
    def isa(self) -> str:
        """'AVX2, bf16 emulated', 'AVX512-BF16 + AMX', 'AVX512-BF16', 'SVE256 + BF16'."""
        if not self.capability:
            return "ISA not recorded"
        vector, _, rest = self.capability.replace(" + ", ", ", 1).partition(", ")
        flags = (
            set(self.bf16_flags)
            if self.bf16_flags is not None
            else (set() if "no native bf16" in rest else {f.strip() for f in rest.split(",") if f.strip()})
        )
        if not flags:
            return f"{vector}, bf16 emulated"
        if "avx512_bf16" in flags or "amx_bf16" in flags:
            return " + ".join(
                [f"{vector}-BF16" if "avx512_bf16" in flags else vector] + (["AMX"] if "amx_bf16" in flags else [])
            )
        return f"{vector} + {'SVE-BF16' if 'svebf16' in flags else 'BF16'}"

    @property
    def cpu_text(self) -> str:
        """The CPU's model name without trademark marks and filler words: 'Intel(R) Xeon(R) Processor' -> 'Intel Xeon',
        'Intel(R) Xeon(R) Gold 6338 CPU @ 2.00GHz' -> 'Intel Xeon Gold 6338 @ 2.00GHz'."""
        if not self.cpu:
            return "CPU not recorded"
        words = self.cpu.replace("(R)", "").replace("(TM)", "").replace("(tm)", "").split()
        kept = [
            w for i, w in enumerate(words) if w != "Processor" and not (w == "CPU" and words[i + 1 : i + 2] == ["@"])
        ]
        return " ".join(kept) or self.cpu

    @property
    def text(self) -> str:
        """'AMD EPYC, AVX2, bf16 emulated, 2 cores'; on a GPU 'NVIDIA H200 (host Intel Xeon, AVX512-BF16 + AMX, 16 cores)'."""
        host = f"{self.cpu_text}, {self.isa}" + (f", {self.cores} cores" if self.cores else "")
        if self.gpu:
            return (f"{self.gpus} x {self.gpu}" if self.gpus > 1 else self.gpu) + f" (host {host})"
        return host

    @property
    def key(self) -> tuple:
        """What makes two machines the same one: the CPU model, its ISA class, the GPU and their counts."""
        return self.cpu, self.isa, self.gpu, self.gpus, self.cores

    def __eq__(self, other) -> bool:
        return isinstance(other, Machine) and self.key == other.key

    def __hash__(self) -> int:
        return hash(self.key)

    def __str__(self) -> str:
        return self.text


def results_machine(result: dict) -> Machine | None:
    """The machine a results file or comparison was measured on, from its provenance's `machine` block (a script's
    own results carry no run record); None where it has none."""
    block = ((result or {}).get("provenance") or {}).get("machine") if isinstance(result, dict) else None
    if not block:
        return None
    gpus = block.get("device_count") or 0
    return Machine(
        cpu=block.get("cpu"),
        capability=block.get("cpu_capability"),
        gpu=block.get("device_name") if gpus else None,
        gpus=gpus,
        cores=block.get("usable_cores"),
    )


def machines_text(grouped: dict) -> str:
    """'AMD EPYC, AVX2, bf16 emulated, 2 cores' from {Machine: what it measured}; several: each with what it
    measured, and that their figures are not comparable."""
    if len(grouped) == 1:
        return next(iter(grouped)).text
    return f"{len(grouped)} machines, whose figures are not comparable with each other: " + "; ".join(
        f"{machine.text} ({', '.join(names)})" for machine, names in grouped.items()
    )


def reader(block: str, key: str, empty: type | None = None) -> property:
    """A view's property reading `key` of one of its blocks (RunView's record, env, summary, throughput): the value,
    None where absent; with `empty` (dict, list or str), a new empty one where the value is absent or empty."""

    def read(self):
        found = getattr(self, block).get(key)
        return (found or empty()) if empty else found

    return property(read)


class LoaderSweepView:
    """The typed view of a DataLoader sweep's results file (loaders.json, written by trainscope.experiments.loaders.sweep for
    loaders_bench.py): its readers (the script's Markdown and recommendations, the report's section) ask it."""

    def __init__(self, result: dict):
        self.result = result

    _summary = reader("result", "summary", dict)
    _sweep = reader("result", "sweep", dict)
    # Per setting swept: its median, min and max over the repeats (pass time or data share).
    settings_summary = reader("_summary", "settings", list)
    # Per curve (mode, batch, pin, persistent, prefetch): the best setting, the knee and its flags.
    curves = reader("_summary", "curves", dict)
    rows = reader("result", "rows", list)  # every timed pass or training measurement, per setting and repeat
    machine = reader("result", "machine", dict)
    dataset_rows = reader("result", "dataset_rows")
    repeats = reader("_sweep", "repeats")
    default_workers = reader("result", "pytorch_default_num_workers")
