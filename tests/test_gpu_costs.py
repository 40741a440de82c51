"""What the predictor's operator benchmark and the matmul peak do on a GPU, checked on the CPU: tensors traced on
fake CUDA devices keep their device, random-generator state comes from a real call of the operator that made it,
an operator that crashes its process is timed in a child that it alone loses, and GPU kernels are timed on the
device (CUDA events on a planted device clock), not by the host around one call."""

import ctypes

import pytest
import torch
from conftest import PlantedGPU
from torch._subclasses.fake_tensor import FakeTensorMode

from trainscope.predict import op_costs, trace

CPU = torch.device("cpu")

# A stand-in for SDPA's fused attention: its forward returns the generator state its dropout drew (a CPU scalar, as
# the CUDA kernels return it outside CUDA graphs), its backward takes it back and reads it on the host.
_LIBRARY = torch.library.Library("trainscope_test", "DEF")
_LIBRARY.define("attention(Tensor q) -> (Tensor output, Tensor philox_seed, Tensor philox_offset)")
_LIBRARY.define("attention_backward(Tensor grad, Tensor philox_seed, Tensor philox_offset) -> Tensor")
_LIBRARY.impl("attention", lambda q: (q * 2, torch.tensor(1234), torch.tensor(7)), "CPU")


def _attention_backward(grad, seed, offset):
    if seed.device.type != "cpu" or seed.dtype != torch.int64 or int(seed) != 1234 or int(offset) != 7:
        raise RuntimeError("generator state no real call made")  # on a GPU: a host read of a device pointer
    return grad * 2


_LIBRARY.impl("attention_backward", _attention_backward, "CPU")


def tensor_spec(*shape, dtype="float32", device="cpu"):
    stride = tuple(int(s) for s in torch.empty(shape).stride())
    return ("tensor", tuple(shape), stride, 0, dtype, device)


def test_a_host_scalar_traced_beside_cuda_tensors_is_made_on_the_host():
    """The spec kept shape, strides, offset and dtype, and every tensor was made on the run's device: an operator's
    host-side scalar became a device tensor (the fp32 runs' segmentation fault on an H200)."""
    recorder = trace._Recorder(2, 16, set())
    with FakeTensorMode():  # fake CUDA tensors: no GPU needed
        x, scalar = torch.empty(4, 8, device="cuda"), torch.tensor(2.0)
        with recorder:
            torch.ops.aten.mul.Tensor(x, scalar)
    (op,) = recorder.ops.values()
    assert [spec[-1] for spec in op.spec[0]] == ["cuda", "cpu"]
    args, _ = op_costs.materialize(op.spec, torch.device("meta"))  # "meta" stands for the run's device here
    assert [a.device.type for a in args] == ["meta", "cpu"]


def test_sdpa_backward_on_cuda_takes_its_generator_state_from_a_real_forward():
    """Fake tensors put the memory-efficient kernel's philox seed and offset on the GPU; the real kernel keeps them on
    the host and its backward dereferences them there. The traced backward names the forward call that made them,
    and a seed no traced call made is refused before any kernel runs."""
    recorder = trace._Recorder(2, 16, set())
    with FakeTensorMode():
        q = torch.empty(2, 4, 16, 8, device="cuda")
        with recorder:
            out = torch.ops.aten._scaled_dot_product_efficient_attention(q, q, q, None, True, 0.1)
            torch.ops.aten._scaled_dot_product_efficient_attention_backward(
                out[0],
                q,
                q,
                q,
                torch.empty(0, device="cuda"),
                out[0],
                out[1],
                out[2],
                out[3],
                0.1,
                [True, True, True, False],
            )
    backward = next(op for op in recorder.ops.values() if op.name.endswith("attention_backward.default"))
    seed, offset = backward.spec[0][7:9]
    forward = next(
        op for op in recorder.ops.values() if op.name == "aten._scaled_dot_product_efficient_attention.default"
    )
    assert seed == ("rng", forward.name, forward.spec, 2) and offset == ("rng", forward.name, forward.spec, 3)
    made_up = (backward.spec[0][:7] + (tensor_spec(dtype="int64", device="cuda"),) * 2 + backward.spec[0][9:], {})
    with pytest.raises(op_costs.Unmeasurable, match="random-generator state"):
        op_costs.benchmark(backward.name, made_up, torch.device("cuda"))  # refused before any CUDA call


def test_an_operator_taking_generator_state_is_timed_with_a_real_calls_state():
    state = lambda index: ("rng", "trainscope_test.attention.default", ((tensor_spec(8, 8),), {}), index)  # noqa: E731
    spec = ((tensor_spec(8, 8), state(1), state(2)), {})
    assert op_costs.benchmark("trainscope_test.attention_backward.default", spec, CPU) > 0
    made_up = ((tensor_spec(8, 8), tensor_spec(dtype="int64"), tensor_spec(dtype="int64")), {})
    with pytest.raises(op_costs.Unmeasurable):
        op_costs.benchmark("trainscope_test.attention_backward.default", made_up, CPU)


class Crash:
    """A spec whose unpickling reads address 0: the child process dies of SIGSEGV as a crashing kernel's would."""

    def __reduce__(self):
        return (ctypes.string_at, (0,))


def test_an_operator_that_crashes_its_process_costs_only_its_own_timing(tmp_path, monkeypatch):
    """A segmentation fault cannot be caught in-process: guarded, the operators are timed in a child that names each
    before it starts it; the one that killed it is unmeasured with the signal (cached with the reason), and a new child
    times the rest."""
    monkeypatch.setenv("TRAINSCOPE_CACHE_DIR", str(tmp_path))
    square = ((tensor_spec(64, 64), tensor_spec(64, 64)), {})
    ops = [
        trace.Op("forward", "aten.mul.Tensor", "mul", square),
        trace.Op("forward", "aten.mul.Tensor", "crash", Crash()),
        trace.Op("forward", "aten.add.Tensor", "add", square),
    ]
    costs = op_costs.OpCosts(CPU, threads=1, processes=1, guarded=True)
    costs.prepare(ops)
    assert costs.cached["mul"] > 0 and costs.cached["add"] > 0 and costs.cached["crash"] == 0.0
    assert [costs.seconds(op) > 0 for op in ops] == [True, False, True]
    assert costs.unmeasured == {"aten.mul.Tensor (crashed the benchmark's process (SIGSEGV) when timed alone)"}
    costs.save()
    again = op_costs.OpCosts(CPU, threads=1, processes=1, guarded=True)
    assert again.seconds(ops[1]) == 0.0 and again.unmeasured == costs.unmeasured and again.measured == 0


@pytest.mark.parametrize("spinners", [0, 2])
def test_operator_timings_made_while_other_processes_are_busy_are_kept_for_this_run_only(
    tmp_path, monkeypatch, spinners
):
    """Two processes spinning on the cores while an operator is timed: its timing serves this prediction and is not
    cached (a busy minute once cached timings that put every later run's step at 2.25 times what it measured); the
    next OpCosts times it again. Without them (the suite's workers share the cores, so its busy check is the
    suite's: any load is cached) the timing is cached."""
    import subprocess
    import sys
    import time

    monkeypatch.setenv("TRAINSCOPE_CACHE_DIR", str(tmp_path))
    if spinners:
        monkeypatch.delenv("TRAINSCOPE_PEAK_CACHE_BUSY")
    op = trace.Op("forward", "aten.mul.Tensor", "mul", ((tensor_spec(64, 64), tensor_spec(64, 64)), {}))
    costs = op_costs.OpCosts(CPU, threads=1, processes=1)
    assert costs.seconds(op) > 0 and costs.measured == 1
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(spinners)]
    time.sleep(1.0 if spinners else 0.0)
    for process in busy:
        process.kill()  # reaped after the save: a reaped child's CPU would count as this process's own
    costs.save()
    for process in busy:
        process.wait()
    again = op_costs.OpCosts(CPU, threads=1, processes=1)
    if spinners:
        assert costs.others_cores > 1.0 and "kept for this run only" in costs.not_cached
        assert not list(tmp_path.rglob("*.json")) and "mul" not in again.cached
    else:
        assert costs.not_cached is None and again.cached["mul"] == costs.cached["mul"]


# ---------------------------------------------------------------- GPU timing on a planted device clock


@pytest.fixture
def planted_gpu(monkeypatch):
    """A 4096x768x768 GEMM of 8 us (604 TFLOP/s) behind 10 us launches and 20 us synchronizations."""
    from types import SimpleNamespace

    from trainscope.measure import peak

    gpu = PlantedGPU(kernel_s=8e-6)
    monkeypatch.setattr(peak, "time", SimpleNamespace(perf_counter=gpu.perf_counter))  # op_costs times through peak
    monkeypatch.setattr(peak, "synchronize", gpu.synchronize)
    monkeypatch.setattr(peak, "_new_event", gpu.event, raising=False)
    monkeypatch.setattr(peak, "_flush_buffer", gpu.flush_buffer, raising=False)
    monkeypatch.setattr(peak, "_operands", lambda device, precision, shape: (gpu.matrix(), gpu.matrix()))
    return gpu


def test_a_gpu_matmul_rate_is_its_kernels_not_its_launch_and_synchronization(planted_gpu):
    """One call timed on the host between synchronizations measured launch + kernel + sync: 38 us for an 8 us kernel
    (127 TFLOP/s against 604; on an H200, 157 against 382)."""
    from trainscope.measure import peak

    shape = (4096, 768, 768)
    rate = peak.measure(torch.device("cuda"), "bf16", shape)
    assert rate.tflops == pytest.approx(2 * 4096 * 768 * 768 / 8e-6 / 1e12)
    assert rate.low == pytest.approx(rate.tflops) and rate.calls >= peak.MIN_CALLS


def test_an_operators_gpu_cost_is_its_kernels_time(planted_gpu):
    matrix = planted_gpu.matrix()
    assert op_costs.time_call(lambda: matrix @ matrix, torch.device("cuda")) == pytest.approx(8e-6)


def test_the_gpus_clocks_are_asked_once_per_process(monkeypatch):
    """The machine key is asked for every GEMM shape a prediction costs: an nvidia-smi process each time (about 30 per
    run) where NVML's binding is not installed."""
    import subprocess
    import sys

    from trainscope.measure import peak

    asked = []

    def nvidia_smi(command, **kwargs):
        asked.append(command)
        return subprocess.CompletedProcess(command, 0, "570.86.15, 1980, 1755\n", "")

    monkeypatch.setitem(sys.modules, "pynvml", None)  # no NVML binding: nvidia-smi answers
    monkeypatch.setattr(peak.subprocess, "run", nvidia_smi)
    getattr(peak, "_clocks_of", None) and peak._clocks_of.cache_clear()
    clocks = [peak._gpu_clocks(torch.device("cuda", 0)) for _ in range(30)]
    assert clocks[0] == {"driver": "570.86.15", "max_sm_clock_mhz": "1980", "application_clock_mhz": "1755"}
    assert all(c == clocks[0] for c in clocks) and len(asked) == 1
    getattr(peak, "_clocks_of", None) and peak._clocks_of.cache_clear()
