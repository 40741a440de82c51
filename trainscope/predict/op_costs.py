"""What each traced operator (trainscope.predict.trace) costs on this machine, per call.

How it works: docs/predict.md#in-the-code-what-each-operator-costs-trainscopepredictop_costspy.
"""

import json
import os
import pickle
import sys
from pathlib import Path

import torch
from torch.utils import _pytree as pytree

from trainscope.core import precision
from trainscope.core.paths import ROOT, cache_dir
from trainscope.core.records import write_json_atomic
from trainscope.measure import peak
from trainscope.predict.kept import cpu_seconds
from trainscope.predict.trace import is_leaf_spec, is_rng_spec, is_tensor_spec, rng_inputs

MIN_CALLS, MAX_CALLS = 3, 20
CALL_BUDGET_S = 0.02
BENCH_CAP_BYTES = 256 * 2**20
VERSION = 4  # bump when what a cached timing means changes: caches of another version are not read


def gemm_precision(dtype: str, device: torch.device) -> str:
    """The peak's precision name of a matrix product in `dtype` on `device`."""
    if dtype == "bfloat16":
        return "bf16"
    if dtype == "float16":
        return "fp16"
    return "tf32" if device.type == "cuda" and precision.tf32_in_effect() else "fp32"


def _storage_elements(shape, stride, offset) -> int:
    if any(size == 0 for size in shape):
        return 0
    return offset + sum((size - 1) * step for size, step in zip(shape, stride)) + 1


def _materialize(spec, device: torch.device):
    """A real tensor of a tensor spec (shape, stride, offset, dtype, device type) on `device`, or on the CPU where the
    traced tensor was a CPU one (a host-side scalar beside device tensors); anything else unchanged."""
    if not is_tensor_spec(spec):
        return spec
    _, shape, stride, offset, dtype_name, device_type = spec
    device = torch.device("cpu") if device_type == "cpu" else device
    dtype = getattr(torch, dtype_name)
    elements = max(1, _storage_elements(shape, stride, offset))
    if dtype.is_floating_point:
        base = torch.empty(elements, dtype=dtype, device=device).uniform_(0.5, 1.0)
    elif dtype == torch.bool:
        base = torch.ones(elements, dtype=dtype, device=device)
    else:
        base = torch.zeros(elements, dtype=dtype, device=device)
    return base.as_strided(shape, stride, offset)


class Unmeasurable(Exception):
    """An operator that cannot be timed alone, with the reason (the prediction counts it as free and says why)."""


def materialize(spec, device: torch.device):
    """Real arguments of a spec (args, kwargs): tensors as `_materialize` makes them, and random-generator state as a
    real call of the operator that made it in the trace returns it (trainscope.predict.trace.RNG_STATE_NAMES)."""
    produced = {}

    def make(leaf):
        if not is_rng_spec(leaf):
            return _materialize(leaf, device)
        _, name, producer, index = leaf
        if repr(producer) not in produced:
            args, kwargs = materialize(producer, device)
            with torch.no_grad():
                produced[repr(producer)] = _operator(name)(*args, **kwargs)
        return produced[repr(producer)][index]

    return pytree.tree_map(make, spec, is_leaf=is_leaf_spec)


def check_generator_state(func, spec) -> None:
    """Refuse an operator that takes random-generator state no traced call made (a made-up seed tensor can be read
    as a pointer: the process would crash)."""
    args, kwargs = spec
    named = {**{a.name: v for a, v in zip(func._schema.arguments, args)}, **kwargs}
    for name in rng_inputs(func):
        if is_tensor_spec(named.get(name)):
            raise Unmeasurable(f"takes random-generator state ({name}) that no traced call made")


def _spec_bytes(spec) -> int:
    return sum(
        _storage_elements(s[1], s[2], s[3]) * torch.empty((), dtype=getattr(torch, s[4])).element_size()
        for s in pytree.tree_leaves(spec, is_leaf=is_tensor_spec)
        if is_tensor_spec(s)
    )


def _shrink(spec) -> tuple:
    """(spec with every list of tensors cut to a prefix under BENCH_CAP_BYTES, the share of elements kept)."""
    args, kwargs = spec
    lists = [a for a in args if isinstance(a, list) and a and is_tensor_spec(a[0])]
    if not lists:
        return spec, 1.0
    sizes = [sum(_storage_elements(*column[i][1:4]) for column in lists) for i in range(len(lists[0]))]
    kept, total = 0, 0
    for size in sizes:
        if total and (total + size) * 4 * len(lists) > BENCH_CAP_BYTES:
            break
        kept, total = kept + 1, total + size
    args = tuple(a[:kept] if isinstance(a, list) and a and is_tensor_spec(a[0]) else a for a in args)
    return (args, kwargs), total / sum(sizes)


def time_call(call, device: torch.device) -> float:
    """Seconds of `call()`: the fastest of the timed calls after one warm-up call (on a GPU each between CUDA events)."""
    first = peak.call_seconds(device, call)
    if device.type == "cuda":
        return min(peak.device_call_seconds(call, peak.calls_within(first, CALL_BUDGET_S), device))
    times = []
    while len(times) < MAX_CALLS and (len(times) < MIN_CALLS or sum(times) < CALL_BUDGET_S):
        times.append(peak.call_seconds(device, call))
    return min(times)


def benchmark(func_name: str, spec, device: torch.device) -> float:
    """Seconds of one call of the aten operator `func_name` on real tensors of `spec` (args, kwargs)."""
    func = _operator(func_name)
    scale = 1.0
    if _spec_bytes(spec) > BENCH_CAP_BYTES:
        spec, scale = _shrink(spec)
    check_generator_state(func, spec)
    generator_state = torch.get_rng_state()  # inputs and random operators leave the run's random state alone
    cuda_state = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    try:
        args, kwargs = materialize(spec, device)
        with torch.no_grad():
            seconds = time_call(lambda: func(*args, **kwargs), device)
    finally:
        torch.set_rng_state(generator_state)
        if cuda_state is not None:
            torch.cuda.set_rng_state(cuda_state, device)
    return seconds / scale if scale > 0 else seconds


def _operator(name: str):
    """'aten.addmm.default' -> torch.ops.aten.addmm.default."""
    namespace, op, overload = name.split(".")
    return getattr(getattr(getattr(torch.ops, namespace), op), overload)


class OpCosts:
    """Per-call seconds of traced operators on `device` at `threads` with `processes` local processes measuring at
    once, from the cache or timed now; `store` false leaves the writing to another process. `guarded` (default: on a
    GPU) times them in a child process (`time_guarded`), which a kernel crashing on made-up inputs ends, not the run."""

    def __init__(
        self, device: torch.device, threads: int, processes: int, store: bool = True, guarded: bool | None = None
    ):
        self.device, self.threads, self.processes, self.store = device, threads, processes, store
        self.guarded = device.type == "cuda" if guarded is None else guarded
        self.key = {**peak.machine_key(device, threads=threads, processes=processes), "op_costs": VERSION}
        self.path = cache_dir() / "predict" / f"{peak.key_id(self.key)}.json"
        stored = peak.read_keyed(self.path, self.key)
        self.cached, self.reasons = stored.get("seconds", {}), stored.get("unmeasured", {})
        self.measured = 0  # operators timed now (not from the cache)
        self.unmeasured: set = set()  # operators that could not be timed (counted as free), with the reason if known
        self._before = None  # the machine's and this process's CPU seconds at the first timing here (kept.cpu_seconds)
        self.others_cores: float | None = None  # other processes' cores while they were timed (at save)
        self.not_cached: str | None = None  # why the timings made now were kept for this run only

    def prepare(self, ops) -> None:
        """Time every operator of `ops` not known here yet, all at once: in one guarded child process when guarded
        (in this process where no child can use the device, e.g. a GPU in exclusive-process mode), else one by one
        as `seconds` asks."""
        todo = {
            op.key: (op.name, op.spec)
            for op in ops
            if op.gemm is None and op.spec is not None and op.key not in self.cached
        }
        if not self.guarded or not todo:
            return
        self._timing_starts()
        found = time_guarded([(key, name, spec) for key, (name, spec) in todo.items()], self.device, self.threads)
        if found is None:  # no child could run on the device: timed here
            self.guarded = False
            return
        for key, (seconds, reason) in found.items():
            self._store(key, todo[key][0], seconds, reason)

    def _store(self, key: str, name: str, seconds: float | None, reason: str | None) -> None:
        self.cached[key] = seconds if seconds is not None else 0.0
        if seconds is None:
            self.reasons[key] = f"{name} ({reason})" if reason else name
        self.measured += 1

    def seconds(self, op) -> float:
        """Seconds of one call of a traced operator."""
        if op.gemm is not None:
            rate = peak.rate(self.device, gemm_precision(op.dtype, self.device), op.gemm, self.threads, self.processes)
            if rate is not None and rate.tflops > 0:
                return 2 * op.gemm[0] * op.gemm[1] * op.gemm[2] / (rate.tflops * 1e12)
        if op.key not in self.cached:
            if op.spec is None:  # a cached trace whose operator was never timed here: not its shapes to time now
                self.unmeasured.add(op.name)
                return 0.0
            if self.guarded:
                self.prepare([op])
        if op.key not in self.cached:
            self._timing_starts()
            try:
                with peak.threads_set_to(self.threads):
                    self._store(op.key, op.name, benchmark(op.name, op.spec, self.device), None)
            except Unmeasurable as why:
                self._store(op.key, op.name, None, str(why))
            except Exception:  # an operator that real tensors of its shapes cannot run alone: counted as free, said
                self._store(op.key, op.name, None, None)
        if op.key in self.reasons:
            self.unmeasured.add(self.reasons[op.key])
        return self.cached[op.key]

    def _timing_starts(self) -> None:
        if self._before is None:
            self._before = cpu_seconds()

    def save(self) -> None:
        """The timings made now into the machine's cache, unless other processes (beyond the launch's) kept more than
        peak.BUSY_CORES busy meanwhile: those serve this run only, as the matmul peak's rates do."""
        if not (self.store and self.measured):
            return
        if self._before is not None:
            self.others_cores = peak.other_cores(self._before, cpu_seconds())
            peers = (self.processes - 1) * self.threads  # the launch's other processes time theirs at the same time
            if peak.too_busy(self.others_cores, allowance=peers):
                self.not_cached = (
                    f"other processes kept {self.others_cores:.2f} cores busy while its operators were timed: "
                    "kept for this run only"
                )
                return
        write_json_atomic(self.path, {"key": self.key, "seconds": self.cached, "unmeasured": self.reasons})


# ---------------------------------------------------------------- timing in a child process

GUARD_CRASHES = 3  # children a guarded benchmark may lose to crashing operators before it times the rest no more
GUARD_TIMEOUT_S = 300.0


def time_guarded(
    items: list[tuple], device: torch.device, threads: int, timeout_s: float = GUARD_TIMEOUT_S
) -> dict | None:
    """Seconds of each (key, operator, spec) of `items`, timed by `python -m trainscope.predict.op_costs` in a child process
    that names each operator before it starts it: {key: (seconds, None) or (None, why not)}. An operator that kills
    its child is unmeasured with the signal, and a new child times the rest (GUARD_CRASHES children at most). None
    when the first child could not time anything: the caller times them itself."""
    import tempfile

    found: dict = {}
    crashes, ended = 0, "not timed"
    environ = _child_environment()
    with tempfile.TemporaryDirectory(prefix="trainscope-op-costs-") as folder:
        inputs, progress = Path(folder) / "ops.pickle", Path(folder) / "progress.jsonl"
        command = [sys.executable, "-m", "trainscope.predict.op_costs", *map(str, (inputs, progress, device, threads))]
        while len(found) < len(items):
            left = [(key, name, pickle.dumps(spec)) for key, name, spec in items if key not in found]
            inputs.write_bytes(pickle.dumps(left))
            progress.write_text("")
            succeeded, ended = _run_child(command, environ, timeout_s)
            started, timed_now = _read_progress(progress, found)
            if succeeded:
                break
            if started is None and not timed_now and not found:
                return None  # the child could not start on the device
            if started is not None:
                found[started] = (None, f"{ended} when timed alone")
            crashes += 1
            if crashes >= GUARD_CRASHES or started is None:
                break
    for key, _, _ in items:
        found.setdefault(key, (None, f"not timed: an operator before it {ended}"))
    return found


def _child_environment() -> dict:
    """This process's environment for a guarded benchmark's child: faulthandler on (a crash prints its stack), and
    the package importable as `-m trainscope.predict.op_costs` from any folder."""
    return {
        **os.environ,
        "PYTHONFAULTHANDLER": "1",
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
    }


def _run_child(command: list[str], environ: dict, timeout_s: float) -> tuple[bool, str]:
    """Run one guarded benchmark's child: (whether it ended well, how it ended, as the reason of what it left)."""
    import signal
    import subprocess

    try:
        child = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s, env=environ)
    except subprocess.TimeoutExpired:
        return False, f"hung the benchmark's process past {timeout_s:.0f} s"
    ended = (
        f"crashed the benchmark's process ({signal.Signals(-child.returncode).name})"
        if child.returncode < 0
        else f"ended the benchmark's process (exit {child.returncode})"
    )
    return child.returncode == 0, ended


def _read_progress(progress: Path, found: dict) -> tuple[str | None, int]:
    """Put the operators a child timed (its progress file) into `found`: (the key of the one it started and did not
    finish, or None; how many it timed)."""
    started, timed_now = None, 0
    for line in progress.read_text().splitlines():
        entry = json.loads(line)
        if entry.get("start"):
            started = entry["key"]
        else:
            found[entry["key"]] = (entry.get("seconds"), entry.get("error"))
            started, timed_now = None, timed_now + 1
    return started, timed_now


def _child(argv: list[str]) -> None:
    """The guarded benchmark's child: times each operator of the inputs file, writing a `start` line before it and
    its seconds (or its error) after it, each line flushed to disk before going on."""
    inputs, progress, device_name, thread_count = argv
    device = torch.device(device_name)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    items = pickle.loads(Path(inputs).read_bytes())
    with open(progress, "a") as out, peak.threads_set_to(int(thread_count)):

        def say(entry: dict) -> None:
            out.write(json.dumps(entry) + "\n")
            out.flush()
            os.fsync(out.fileno())

        for key, name, blob in items:
            say({"start": True, "key": key})
            try:
                say({"key": key, "seconds": benchmark(name, pickle.loads(blob), device)})
            except Unmeasurable as why:
                say({"key": key, "error": str(why)})
            except Exception as error:  # noqa: BLE001 - any failure of one operator is that operator's
                say({"key": key, "error": " ".join(str(error).split())[:200] or type(error).__name__})


if __name__ == "__main__":
    _child(sys.argv[1:])
