"""The machine's measured matmul peak: what this device's matmuls really reach, per precision, at the run's threads.

How it works: docs/peak.md#in-the-code-how-the-machines-peak-is-measured-trainscopemeasurepeakpy.
"""

import contextlib
import dataclasses
import functools
import hashlib
import json
import operator
import os
import platform
import statistics
import subprocess
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from trainscope.core import environment, precision
from trainscope.core.paths import cache_dir
from trainscope.core.records import now_iso, write_json_atomic

SQUARE_ENV = "TRAINSCOPE_PEAK_SQUARE"
DEFAULT_SQUARE = {"cpu": 2048, "cuda": 8192}
MIN_CALLS, MAX_CALLS = 3, 10
SHAPE_BUDGET_S = 0.15
MAX_CALL_S = 1.0
PROBE_SIDE = 256
DTYPES = precision.DTYPES  # the one map of a precision's name to its dtype (trainscope.core.precision)
CPU_FP16_FLAGS = frozenset({"avx512_fp16", "amx_fp16"})  # x86 flags of CPUs that compute fp16 matmuls natively


@dataclass(frozen=True)
class Rate:
    """One (precision, shape) measurement: TFLOP/s over the timed calls (median, min, max)."""

    precision: str
    shape: tuple  # (m, n, k): an (m x k) @ (k x n) matmul, 2 m n k FLOPs
    tflops: float  # median over the timed calls
    low: float
    high: float
    calls: int  # timed calls (after one warm-up call)
    measured: str  # UTC ISO-8601 time of the measurement
    seconds: float  # what measuring it cost, warm-up included
    skipped: str | None = None  # why the shape was not timed (too slow at the probe's rate): tflops is the probe's
    others_cores: float | None = None  # cores other processes kept busy while it was measured (None: unknown)

    @property
    def spread(self) -> float:
        """(max - min) / median of the timed calls: how far one call's rate strays."""
        return (self.high - self.low) / self.tflops if self.tflops else 0.0

    def to_dict(self) -> dict:
        return {**asdict(self), "shape": list(self.shape), "spread": self.spread}

    @classmethod
    def from_dict(cls, data: dict) -> "Rate":
        fields = {k: data[k] for k in cls.__dataclass_fields__ if k in data}
        return cls(**{**fields, "shape": tuple(fields["shape"])})


# ---------------------------------------------------------------- what the hardware runs, and the key


def precisions(device: torch.device, flags: frozenset | None = None) -> tuple[str, ...]:
    """The precisions this device's matmuls run: on a CPU fp32 and bf16 (measured whatever the flags say, so the
    timing tells native from emulated) and fp16 where the flags say native; on CUDA fp32, TF32 and bf16 from
    compute capability 8.0, and fp16."""
    if device.type == "cuda":
        major, _ = torch.cuda.get_device_capability(device)
        return ("fp32", "tf32", "bf16", "fp16") if major >= 8 else ("fp32", "fp16")
    if device.type != "cpu":
        return ("fp32",)
    flags = precision.cpu_flags() if flags is None else flags
    return ("fp32", "bf16") + (("fp16",) if CPU_FP16_FLAGS & flags else ())


def _gpu_clocks(device: torch.device) -> dict:
    """Driver and SM clocks of a GPU, from NVML (nvidia-ml-py) or nvidia-smi; {} when neither answers. Asked once per
    process and GPU: a run asks for its machine key at every GEMM shape it costs."""
    return dict(_clocks_of(device.index if device.index is not None else torch.cuda.current_device()))


@functools.lru_cache(maxsize=None)
def _clocks_of(index: int) -> tuple:
    try:
        import pynvml

        pynvml.nvmlInit()
        handle = pynvml.nvmlDeviceGetHandleByIndex(index)
        driver = pynvml.nvmlSystemGetDriverVersion()
        return (
            ("driver", driver.decode() if isinstance(driver, bytes) else driver),
            ("max_sm_clock_mhz", pynvml.nvmlDeviceGetMaxClockInfo(handle, pynvml.NVML_CLOCK_SM)),
            ("application_clock_mhz", pynvml.nvmlDeviceGetApplicationsClock(handle, pynvml.NVML_CLOCK_SM)),
        )
    except Exception:  # no NVML binding or no NVML: ask nvidia-smi
        pass
    try:
        query = "--query-gpu=driver_version,clocks.max.sm,clocks.applications.graphics"
        command = ["nvidia-smi", f"--id={index}", query, "--format=csv,noheader,nounits"]
        out = subprocess.run(command, capture_output=True, text=True, timeout=10).stdout.strip()
        driver, max_clock, application = [part.strip() for part in out.split(",")]
        return (("driver", driver), ("max_sm_clock_mhz", max_clock), ("application_clock_mhz", application))
    except (OSError, ValueError, subprocess.SubprocessError):
        return ()


def machine_key(device: torch.device, threads: int | None = None, processes: int | None = None) -> dict:
    """What a measured rate belongs to (docs/peak.md); `threads` default: torch's now, `processes`: this launch's."""
    processes = environment.local_processes() if processes is None else processes
    common = {
        "device": device.type,
        "name": environment.device_name(device),
        "torch": torch.__version__,
        "processes": processes,
    }
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        return {**common, "capability": f"{major}.{minor}", "cuda": torch.version.cuda, **_gpu_clocks(device)}
    flags = precision.cpu_flags()
    return {
        **common,
        "flags": hashlib.sha256(" ".join(sorted(flags)).encode()).hexdigest()[:12],
        "isa": torch.backends.cpu.get_cpu_capability(),
        "machine": platform.machine(),
        "threads": torch.get_num_threads() if threads is None else threads,
    }


def key_id(key: dict) -> str:
    """A short digest naming a machine key (the cache file's name)."""
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:12]


def _cache_path(key: dict) -> Path:
    return cache_dir() / "peak" / f"{key_id(key)}.json"


def _entry(precision_name: str, shape: tuple) -> str:
    return f"{precision_name} {'x'.join(map(str, shape))}"


def read_keyed(path: Path, key: dict) -> dict:
    """The JSON object stored at `path` for `key` (its "key" field), else {}: absent, unreadable or another key's."""
    try:
        data = json.loads(path.read_text())
        return data if isinstance(data, dict) and data.get("key") == key else {}
    except (OSError, ValueError):
        return {}  # absent or unreadable: measured again, and rewritten whole


def _read_cache(key: dict, section: str = "rates") -> dict:
    found = read_keyed(_cache_path(key), key).get(section)
    return found if isinstance(found, dict) else {}


def _store(key: dict, section: str, entries: dict) -> None:
    """Merge `entries` into a section ("rates", "probes") of the key's cache file (atomic; a concurrent writer's new
    entries may be lost: measured again next time)."""
    data = read_keyed(_cache_path(key), key) or {"key": key}
    data[section] = {**(data.get(section) if isinstance(data.get(section), dict) else {}), **entries}
    try:
        write_json_atomic(_cache_path(key), data)
    except OSError:
        pass  # a read-only cache folder costs a measurement next time, nothing else


def cached(device: torch.device, name: str, measure_now, processes: int | None = None, store: bool = True) -> dict:
    """Another measurement of this machine at the run's threads -- one encoder layer profiled at the run's shapes
    (trainscope.measure.profiling.layer_breakdown) -- cached under `name` beside the matmul rates: from the cache, else
    `measure_now()` (a JSON-able dict; None is not cached)."""
    key = machine_key(device, processes=processes)
    found = _read_cache(key, "probes").get(name)
    if found is None:
        found = measure_now()
        if found is not None and store:
            _store(key, "probes", {name: {**found, "measured": now_iso()}})
    return found


# ---------------------------------------------------------------- measuring


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)  # CUDA work is asynchronous: time the work, not its launch


def _operands(device: torch.device, precision_name: str, shape: tuple):
    m, n, k = shape
    generator = torch.Generator(device=device).manual_seed(0)  # private: the run's random state is left alone
    dtype = DTYPES[precision_name]
    a = torch.randn(m, k, device=device, generator=generator).to(dtype)
    b = torch.randn(k, n, device=device, generator=generator).to(dtype)
    return a, b


def call_seconds(device: torch.device, call) -> float:
    """One call timed on the host between synchronizations (a CPU's calls; a GPU's warm-up call)."""
    synchronize(device)
    started = time.perf_counter()
    call()
    synchronize(device)
    return time.perf_counter() - started


# On a GPU one call timed on the host is mostly launch and synchronization. Calls are timed on the device instead, as
# triton.testing.do_bench does: each between two CUDA events, after a write over a buffer larger than the L2 cache (so
# every call reads its operands from memory), all enqueued at once, one synchronization at the end.
GPU_MAX_CALLS = 50
FLUSH_BYTES = 256 * 2**20  # at least twice any current GPU's L2 cache (H100 50 MB, H200 60 MB)


def _new_event():
    return torch.cuda.Event(enable_timing=True)


def _flush_buffer(device: torch.device):
    """What `flush()` writes over: twice the device's L2 cache, or FLUSH_BYTES when the size is not known."""
    l2 = getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 0) or 0
    return torch.empty(max(2 * l2, FLUSH_BYTES if not l2 else 0) // 4, dtype=torch.int32, device=device)


def device_call_seconds(call, calls: int, device: torch.device) -> list[float]:
    """Seconds of each of `calls` calls of `call()` on a GPU, read from CUDA events (see above)."""
    flush = _flush_buffer(device)
    pairs = [(_new_event(), _new_event()) for _ in range(calls)]
    for start, end in pairs:
        flush.zero_()
        start.record()
        call()
        end.record()
    synchronize(device)  # the one sync point: every event has completed
    del flush
    return [start.elapsed_time(end) / 1e3 for start, end in pairs]  # elapsed_time is in milliseconds


def calls_within(seconds_per_call: float, budget_s: float) -> int:
    """How many calls of `seconds_per_call` fit `budget_s`: between MIN_CALLS and GPU_MAX_CALLS."""
    return max(MIN_CALLS, min(GPU_MAX_CALLS, int(budget_s / max(seconds_per_call, 1e-9))))


@contextlib.contextmanager
def tf32_allowed(on: bool):
    """TF32 matmuls allowed for the duration of a tf32 measurement only, as they were afterwards."""
    saved = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = on
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = saved


def measure(device: torch.device, precision_name: str, shape: tuple, best_tflops: float | None = None) -> Rate:
    """Time an (m, n, k) matmul in `precision_name` on `device` now, at torch's current threads (no cache); skipped
    above MAX_CALL_S a call at `best_tflops`, the best rate of smaller shapes (docs/peak.md); a warm-up call above
    MAX_CALL_S is the one measurement."""
    shape, flops, started = tuple(shape), 2 * shape[0] * shape[1] * shape[2], time.perf_counter()
    if best_tflops and flops / (best_tflops * 1e12) > MAX_CALL_S:
        why = (
            f"about {flops / (best_tflops * 1e12):.1f} s per call at the best rate of a smaller shape "
            f"({best_tflops * 1e3:.1f} GFLOP/s), which stands for it"
        )
        return Rate(precision_name, shape, best_tflops, best_tflops, best_tflops, 0, now_iso(), 0.0, skipped=why)
    with tf32_allowed(precision_name == "tf32") if device.type == "cuda" else contextlib.nullcontext():
        product = functools.partial(operator.matmul, *_operands(device, precision_name, shape))  # a @ b
        first = call_seconds(device, product)  # warm-up: kernel selection, JIT, first touch of the output
        times = [first] if first > MAX_CALL_S else []
        if not times and device.type == "cuda":
            times = device_call_seconds(product, calls_within(first, SHAPE_BUDGET_S), device)
        while (
            first <= MAX_CALL_S
            and device.type != "cuda"
            and len(times) < MAX_CALLS
            and (len(times) < MIN_CALLS or first + sum(times) < SHAPE_BUDGET_S)
        ):
            times.append(call_seconds(device, product))
        del product
    if device.type == "cuda":
        torch.cuda.empty_cache()  # give the operands' blocks back: the run's reserved-memory peak is not the benchmark's
    rates, spent = [flops / t / 1e12 for t in times], time.perf_counter() - started
    return Rate(precision_name, shape, statistics.median(rates), min(rates), max(rates), len(times), now_iso(), spent)


@contextlib.contextmanager
def threads_set_to(count: int | None):
    """torch's intra-op threads set to `count` for a measurement, as they were afterwards."""
    saved = torch.get_num_threads()
    if count and count != saved:
        torch.set_num_threads(count)
    try:
        yield
    finally:
        if torch.get_num_threads() != saved:
            torch.set_num_threads(saved)


# Other processes' cores (averaged over a measurement) above which its rates are not cached: a quarter of a core, the
# quiet machine of make predict-check (trainscope.experiments.prediction). The test suite, whose workers share the
# cores and one session cache, caches whatever it measures (BUSY_ENV=any).
BUSY_CORES = 0.25
BUSY_ENV = "TRAINSCOPE_PEAK_CACHE_BUSY"


def cpu_seconds() -> tuple[float, float, float] | None:
    """(the machine's busy CPU seconds, this process's CPU seconds, a monotonic clock), or None where the machine's
    cannot be read."""
    busy = environment.machine_busy_seconds()
    return None if busy is None else (busy, time.process_time(), time.monotonic())


def too_busy(others: float | None, allowance: float = 0.0) -> bool:
    """Whether a measurement made while other processes kept `others` cores busy (other_cores) stays out of the
    machine's cache: above BUSY_CORES beyond `allowance` (the cores of peers measuring at the same time), unless
    the cache keeps any load (BUSY_ENV=any); unknown load (None) is not busy."""
    return others is not None and others > BUSY_CORES + allowance and os.environ.get(BUSY_ENV) != "any"


def other_cores(before, after) -> float | None:
    """Cores other processes kept busy on average between two `cpu_seconds` readings."""
    if before is None or after is None or after[2] <= before[2]:
        return None
    others = (after[0] - before[0]) - (after[1] - before[1])
    return max(0.0, others) / (after[2] - before[2])


def rates(
    device: torch.device,
    precision_name: str,
    shapes: list[tuple],
    threads: int | None = None,
    processes: int | None = None,
    store: bool = True,
    use_cache: bool = True,
) -> dict[tuple, Rate]:
    """Rates of several shapes in one precision: from the cache (unless `use_cache` is false), the misses measured
    now (smallest first: docs/peak.md) and stored (unless `store` is false: a process measuring beside its peers
    leaves the writing to one)."""
    shapes = [tuple(int(x) for x in s) for s in shapes]
    with threads_set_to(threads):
        key = machine_key(device, processes=processes)
        cached = _read_cache(key) if use_cache else {}
        found = {
            s: Rate.from_dict(cached[_entry(precision_name, s)]) for s in shapes if _entry(precision_name, s) in cached
        }
        missing = sorted((s for s in shapes if s not in found), key=lambda s: s[0] * s[1] * s[2])
        if missing:
            before = cpu_seconds()
            best = measure(device, precision_name, (PROBE_SIDE,) * 3).high  # the best call: noise only slows
            new = {}
            for s in missing:
                new[s] = measure(device, precision_name, s, best)
                best = max(best, new[s].high)
            others = other_cores(before, cpu_seconds())
            new = {s: dataclasses.replace(r, others_cores=others) for s, r in new.items()}
            # A rate measured while other processes took a core's share would be cached for every later run on
            # this machine: kept for this run only (its record says how busy the machine was), measured again next.
            # The launch's other processes measure at the same time (machine_peak): their threads are allowed for.
            peers = ((processes or 1) - 1) * torch.get_num_threads()
            if store and not too_busy(others, allowance=peers):
                _store(key, "rates", {_entry(precision_name, s): r.to_dict() for s, r in new.items()})
            found.update(new)
    return {s: found[s] for s in shapes}


def rate(
    device: torch.device, precision_name: str, shape: tuple, threads: int | None = None, processes: int | None = None
) -> Rate | None:
    """Measured TFLOP/s of one (m, n, k) matmul shape on this machine: from the cache, measured on a miss; None when
    the device does not run `precision_name`."""
    if precision_name not in precisions(device):
        return None
    return rates(device, precision_name, [shape], threads, processes)[tuple(shape)]


# ---------------------------------------------------------------- a run's block


def transformer_shapes(layers: int, hidden: int, intermediate: int, tokens: int) -> list[tuple]:
    """An encoder layer's forward GEMMs for `tokens` rows (batch x sequence length): Q, K, V and the output
    projection (tokens, hidden, hidden), the feed-forward up (tokens, intermediate, hidden) and down (tokens,
    hidden, intermediate). `layers` does not change the shapes (every layer has the same)."""
    del layers
    return [(tokens, hidden, hidden), (tokens, intermediate, hidden), (tokens, hidden, intermediate)]


TRANSFORMER_WEIGHTS = (4, 1, 1)  # Q, K, V and output projections share a shape; one feed-forward up, one down


def matmul_rate(found: dict[tuple, Rate], shapes: list[tuple], weights=None, which: str = "tflops") -> float | None:
    """TFLOP/s of doing every shape (`weights[i]` times) once, one after the other: all their FLOPs over the sum of
    their times at the measured rates (a FLOP-weighted harmonic mean); `which`: "tflops" (the medians), "low" or
    "high" (every shape at its slowest or fastest call: the spread of the whole)."""
    weights = weights or (1,) * len(shapes)
    flops = [w * 2 * s[0] * s[1] * s[2] for s, w in zip(shapes, weights)]
    rates = [getattr(found[tuple(s)], which) for s in shapes]
    seconds = [f / (r * 1e12) for f, r in zip(flops, rates) if r]
    return sum(flops) / sum(seconds) / 1e12 if seconds and len(seconds) == len(shapes) else None


def square(device: torch.device, environ=None) -> tuple:
    environ = os.environ if environ is None else environ
    side = environ.get(SQUARE_ENV, "")
    side = int(side) if side.isdigit() and int(side) > 0 else DEFAULT_SQUARE.get(device.type, 2048)
    return (side, side, side)


def machine_peak(
    device: torch.device,
    shapes: list[tuple] = (),
    threads: int | None = None,
    processes: int | None = None,
    together=None,
    store: bool = True,
) -> dict:
    """The run record's block: every precision this device runs, at `shapes` and one large square, its peak the best
    median over the shapes (with that shape's spread). `together(missing) -> bool`, a collective across the launch's
    processes, has every process measure at once where any of them misses the cache."""
    shapes = [tuple(s) for s in shapes] + [square(device)]
    shapes = list(dict.fromkeys(shapes))
    names = precisions(device)
    with threads_set_to(threads):
        key = machine_key(device, processes=processes)
        cached = _read_cache(key)
        missing = any(_entry(p, s) not in cached for p in names for s in shapes)
        any_missed = together(missing) if together is not None else missing
        use_cache = together is None or not any_missed
        block = {"key": key, "key_id": key_id(key), "cache": str(_cache_path(key)), "precisions": {}}
        started = time.perf_counter()
        for name in names:
            found = rates(device, name, shapes, processes=processes, store=store, use_cache=use_cache)
            timed = [r for r in found.values() if not r.skipped] or list(found.values())
            best = max(timed, key=lambda r: r.tflops)
            block["precisions"][name] = {
                "peak_tflops": best.tflops,
                "peak_shape": list(best.shape),
                "spread": best.spread,
                "measured": best.measured,
                "rates": [r.to_dict() for r in found.values()],
            }
        block["seconds"] = time.perf_counter() - started
        block["from_cache"] = not any_missed
    return block


def peak_of(block: dict | None, precision_name: str | None) -> dict | None:
    """A machine_peak block's figures for one precision ({peak_tflops, peak_shape, spread, measured, rates}), or
    None when it has none."""
    if not block or not precision_name:
        return None
    return (block.get("precisions") or {}).get(precision_name)
