"""What each traced operator (trainscope.trace) costs on this machine, per call.

* Matrix products (mm, addmm): their FLOPs over the machine's measured matmul rate at that shape and precision
  (trainscope.peak.rate, cached per machine by peak).
* Everything else (batched products of attention, softmax, dropout's random masks, layer norm, GELU, embedding
  gradients, the fused AdamW step, norms, copies): timed once on real tensors of the traced shapes, strides and
  dtypes, at the run's threads, and cached per machine key beside the peak's cache (`<cache>/predict/`). Floating
  inputs hold values in [0.5, 1), integer ones zeros (a valid index anywhere), masks ones. An operator on lists of
  tensors (the fused optimizer step, foreach norms) above BENCH_CAP_BYTES is timed on a prefix of its lists and
  scaled by their elements. This is what torch.distributed._tools.RuntimeEstimator's operator-level benchmark does
  on GPUs, on any device; PyTorch's roofline estimate (75% of a datasheet peak) is not used.

Each timing: one warm-up call, then calls until MIN_CALLS have run and CALL_BUDGET_S has passed (at most
MAX_CALLS); the fastest (as timeit advises: slower calls are the machine's interference, not the operator's cost --
an operator of microseconds on two threads can wait milliseconds for a descheduled thread on a busy machine). The
cache file is rewritten whole (atomically) by the process that measured.
"""

import contextlib
import json
import time

import torch
from torch.utils import _pytree as pytree

from trainscope import peak, precision
from trainscope.records import write_json_atomic
from trainscope.trace import is_tensor_spec

MIN_CALLS, MAX_CALLS = 3, 20
CALL_BUDGET_S = 0.02
BENCH_CAP_BYTES = 256 * 2**20
VERSION = 2  # bump when what a cached timing means changes


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
    """A real tensor of a tensor spec (shape, stride, offset, dtype); anything else unchanged."""
    if not is_tensor_spec(spec):
        return spec
    _, shape, stride, offset, dtype_name = spec
    dtype = getattr(torch, dtype_name)
    elements = max(1, _storage_elements(shape, stride, offset))
    if dtype.is_floating_point:
        base = torch.empty(elements, dtype=dtype, device=device).uniform_(0.5, 1.0)
    elif dtype == torch.bool:
        base = torch.ones(elements, dtype=dtype, device=device)
    else:
        base = torch.zeros(elements, dtype=dtype, device=device)
    return base.as_strided(shape, stride, offset)


def _spec_bytes(spec) -> int:
    return sum(_storage_elements(s[1], s[2], s[3]) * torch.empty((), dtype=getattr(torch, s[4])).element_size()
               for s in pytree.tree_leaves(spec, is_leaf=is_tensor_spec) if is_tensor_spec(s))


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


@contextlib.contextmanager
def threads(count: int | None):
    """torch's intra-op threads set to `count` for a measurement, as they were afterwards."""
    saved = torch.get_num_threads()
    if count and count != saved:
        torch.set_num_threads(count)
    try:
        yield
    finally:
        if torch.get_num_threads() != saved:
            torch.set_num_threads(saved)


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_call(call, device: torch.device) -> float:
    """Seconds of `call()`: the fastest of the timed calls after one warm-up call (see the module's docstring)."""
    call()
    _synchronize(device)
    times, spent = [], 0.0
    while len(times) < MAX_CALLS and (len(times) < MIN_CALLS or spent < CALL_BUDGET_S):
        started = time.perf_counter()
        call()
        _synchronize(device)
        times.append(time.perf_counter() - started)
        spent += times[-1]
    return min(times)


def benchmark(func_name: str, spec, device: torch.device) -> float:
    """Seconds of one call of the aten operator `func_name` on real tensors of `spec` (args, kwargs)."""
    func = _operator(func_name)
    scale = 1.0
    if _spec_bytes(spec) > BENCH_CAP_BYTES:
        spec, scale = _shrink(spec)
    generator_state = torch.get_rng_state()  # inputs and random operators leave the run's random state alone
    cuda_state = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    try:
        args, kwargs = pytree.tree_map(lambda s: _materialize(s, device), spec, is_leaf=is_tensor_spec)
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
    once, from the cache or timed now; `store` false leaves the writing to another process."""

    def __init__(self, device: torch.device, threads: int, processes: int, store: bool = True):
        self.device, self.threads, self.processes, self.store = device, threads, processes, store
        self.key = {**peak.machine_key(device, threads=threads, processes=processes), "op_costs": VERSION}
        self.path = peak.cache_dir() / "predict" / f"{peak.key_id(self.key)}.json"
        self.cached = self._read()
        self.measured = 0  # operators timed now (not from the cache)
        self.unmeasured: set = set()  # operators that could not be timed (counted as free)

    def _read(self) -> dict:
        try:
            data = json.loads(self.path.read_text())
            return data.get("seconds", {}) if data.get("key") == self.key else {}
        except (OSError, ValueError, AttributeError):
            return {}

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
            try:
                with threads(self.threads):
                    self.cached[op.key] = benchmark(op.name, op.spec, self.device)
            except Exception:  # an operator that real tensors of its shapes cannot run alone: counted as free, said
                self.unmeasured.add(op.name)
                self.cached[op.key] = 0.0
            self.measured += 1
        return self.cached[op.key]

    def save(self) -> None:
        if self.store and self.measured:
            write_json_atomic(self.path, {"key": self.key, "seconds": self.cached})
