"""Where the gap to the measured matmul peak goes (trainscope.measure.gap): operators put in categories, on planted profiler
events and on one real layer of the tiny model profiled apart."""

import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from conftest import cpu_env
from transformers import AutoConfig, AutoModelForSequenceClassification

from trainscope.measure import gap, profiling
from trainscope.workload import embedded


def event(name, self_us, parent=None, seq=-1, flops=0, thread=1):
    """A stand-in for torch.profiler's FunctionEvent with what categorize reads."""
    e = SimpleNamespace(
        name=name,
        self_cpu_time_total=self_us,
        self_device_time_total=0,
        cpu_parent=parent,
        sequence_nr=seq,
        flops=flops,
        thread=thread,
        device_type="DeviceType.CPU",
        cpu_time_total=self_us,
    )
    return e


def planted_step():
    """One training step's operators: a linear, dropout, attention on the math path (with its own dropout), layer
    norm, their backward nodes linked by sequence number, the optimizer stage, a cast; 1000 us of step overhead."""
    step = event("ProfilerStep#3", 1000)
    forward = event("forward", 100, step)
    events = [step, forward]
    linear = event("aten::linear", 10, forward, seq=1)
    events += [linear, event("aten::addmm", 2000, linear, seq=1, flops=4e9)]
    drop = event("aten::dropout", 5, forward, seq=2)
    events += [drop, event("aten::bernoulli_", 300, drop, seq=2), event("aten::mul", 200, drop, seq=2)]
    attention = event("aten::scaled_dot_product_attention", 5, forward, seq=3)
    math = event("aten::_scaled_dot_product_attention_math", 5, attention, seq=3)
    attention_drop = event("aten::dropout", 5, math, seq=4)
    events += [
        attention,
        math,
        event("aten::bmm", 400, math, seq=3, flops=1e9),
        event("aten::_softmax", 150, math),
        event("aten::where", 50, math),
        attention_drop,
        event("aten::mul", 90, attention_drop, seq=4),
    ]
    norm = event("aten::layer_norm", 5, forward, seq=5)
    events += [norm, event("aten::native_layer_norm", 120, norm, seq=5)]
    backward = event("backward", 50, step)
    node = event("autograd::engine::evaluate_function: MulBackward0", 10, backward, seq=2)
    inner = event("MulBackward0", 5, node, seq=2)
    attention_node = event("autograd::engine::evaluate_function: MulBackward0", 10, backward, seq=4)
    addmm_node = event("autograd::engine::evaluate_function: AddmmBackward0", 10, backward, seq=1)
    events += [
        backward,
        node,
        inner,
        event("aten::mul", 180, inner),
        attention_node,
        event("aten::mul", 60, attention_node),
        addmm_node,
        event("aten::mm", 3000, addmm_node, flops=8e9),
        event("aten::sum", 70, addmm_node),
    ]
    optimizer = event("optimizer", 20, step)
    events += [
        optimizer,
        event("aten::_fused_adamw_", 500, optimizer),
        event("aten::stack", 40, optimizer),
        event("aten::to", 30, forward),
        event("other thread op", 9999, thread=2),
    ]
    return events


def test_operators_take_the_category_of_what_they_serve_forward_and_backward():
    found = gap.categorize(planted_step(), on_device=False, labels=("forward", "backward", "optimizer"))
    seconds = {k: round(v * 1e6) for k, v in found["categories"].items()}
    assert seconds["matmul"] == 10 + 2000 + 400 + 10 + 3000  # linear, addmm, the attention's bmm; AddmmBackward0, mm
    assert seconds["dropout"] == 5 + 300 + 200 + 5 + 90 + 10 + 5 + 180 + 10 + 60  # masks, both dropouts' backward
    assert seconds["attention"] == 5 + 5 + 150 + 50  # softmax and masking inside the math path
    assert seconds["layer norm"] == 125 and seconds["optimizer"] == 500 + 40 and seconds["copies and casts"] == 30
    assert seconds["other operators"] == 70  # the bias gradient's sum: not matmul time
    assert seconds["outside operators"] == 1000 + 100 + 50 + 20  # the step and the stage spans
    assert sum(seconds.values()) == 1000 + sum(round(e.self_cpu_time_total) for e in planted_step()[1:-1])
    assert found["window_s"] == pytest.approx(1000e-6) and found["matmul_flops"] == 13e9  # one thread: the step's
    assert found["attention_dropout_s"] * 1e6 == pytest.approx(5 + 90 + 10 + 60)
    assert found["attention_total_s"] * 1e6 == pytest.approx(5 + 5 + 400 + 150 + 50 + 5 + 90 + 10 + 60)
    assert list(found["attention_ops"])[0] == "aten::_softmax"


def test_the_gap_rows_put_the_floor_under_the_matmuls_and_never_print_a_negative_time():
    breakdown = {
        "window_s": 10.0,
        "matmul_flops": 4e12,
        "matmul_s": 5.0,
        "categories": {**dict.fromkeys(gap.CATEGORIES, 0.5), "matmul": 5.0},
    }
    rows = {r["part"]: r for r in gap.rows(breakdown, peak_tflops=1.0)}
    assert rows["matmuls at the measured peak (floor)"]["seconds"] == pytest.approx(4.0)
    assert rows["matmuls above the floor"]["seconds"] == pytest.approx(1.0) and rows["dropout"]["share"] == 0.05
    assert gap.matmul_rate(breakdown) == pytest.approx(0.8)
    faster_than_peak = {r["part"]: r for r in gap.rows(breakdown, peak_tflops=0.5)}
    assert faster_than_peak["matmuls above the floor"]["seconds"] is None  # 8 s of floor in 5 s: not printed
    # padding as a row of its own: 40% of the FLOPs on padding positions, so 40% of the matmul time, the rest real
    padded = gap.rows(breakdown, peak_tflops=1.0, padding_share=0.4)
    by_part = {r["part"]: r for r in padded}
    assert by_part["padding positions (their matmuls)"]["seconds"] == pytest.approx(2.0)
    assert by_part["matmuls on real tokens at the measured peak (floor)"]["seconds"] == pytest.approx(2.4)
    assert by_part["matmuls on real tokens above the floor"]["seconds"] == pytest.approx(0.6)
    assert sum(r["seconds"] for r in padded) == pytest.approx(sum(r["seconds"] for r in rows.values()))  # carved out
    estimate = gap.estimate(
        4e12,
        1.0,
        {"forward": 3.0, "backward": 4.0, "optimizer": 1.0, "data": 0.5, "other": 0.5},
        train_s=9.0,
        padding_share=0.25,
    )
    assert estimate["floor_share"] == pytest.approx(4 / 9) and estimate["forward_backward_s"] == 7.0
    assert estimate["padding_floor_s"] == pytest.approx(1.0)


def tiny_model(hidden_dropout: float, attention_dropout: float):
    values = {
        **embedded.bundled_architecture("tiny-bert"),
        "hidden_dropout_prob": hidden_dropout,
        "attention_probs_dropout_prob": attention_dropout,
    }
    config = AutoConfig.for_model(values.pop("model_type"), **values, num_labels=3)
    return AutoModelForSequenceClassification.from_config(config, attn_implementation="sdpa")


@pytest.mark.parametrize("attention_dropout", [0.1, 0.0])
def test_one_layer_profiled_apart_shows_what_attention_dropout_costs_and_leaves_the_model_alone(attention_dropout):
    """With attention dropout torch's fused CPU kernel cannot run: the math path (softmax, masking, dropout on the
    attention matrix) shows; without it the fused kernel does. The model's weights, gradients and the run's random
    state are as they were."""
    torch.manual_seed(0)
    model = tiny_model(0.1, attention_dropout)
    weights, state = [p.detach().clone() for p in model.parameters()], torch.get_rng_state()
    found = profiling.layer_breakdown(model, batch=4, length=16, precision_name="fp32", device=torch.device("cpu"))
    assert torch.equal(torch.get_rng_state(), state) and all(p.grad is None for p in model.parameters())
    assert all(torch.equal(w, p) for w, p in zip(weights, model.parameters()))
    assert found["matmul_flops"] > 0 and found["categories"]["dropout"] > 0 and found["width"] == 32
    ops = " ".join(found["attention_ops"])
    if attention_dropout:
        assert "_scaled_dot_product_attention_math" in ops and found["attention_dropout_s"] > 0
    else:
        assert "flash_attention" in ops and found["attention_dropout_s"] == 0


QUIET_PROBE = """
import json, sys, torch
sys.path.insert(0, sys.argv[1])
from test_gap import tiny_model
from trainscope.measure import profiling
found = profiling.layer_breakdown(tiny_model(0.1, 0.1), batch=2, length=8, precision_name="fp32", device=torch.device("cpu"))
x = torch.randn(8, 8)
with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]):  # the user's own, after the probe
    x @ x
print(json.dumps({"found": found is not None}))
"""


@pytest.mark.parametrize("level", [None, "0"])
def test_the_probe_adds_no_kineto_lines_to_a_runs_output_and_a_level_set_by_the_user_stays(level):
    """kineto prints 'USDT: ... profiler_start' and '... profiler_stop' for each profiler: the layer probe that
    train.py runs unasked (at the end of make train) prints nothing, unless the user set KINETO_LOG_LEVEL."""
    env = cpu_env()
    env.pop("KINETO_LOG_LEVEL", None)
    if level is not None:
        env["KINETO_LOG_LEVEL"] = level
    done = subprocess.run(
        [sys.executable, "-c", QUIET_PROBE, str(Path(__file__).parent)], capture_output=True, text=True, env=env
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert json.loads(done.stdout.splitlines()[-1]) == {"found": True}
    assert ("profiler_start" in done.stderr) == (level is not None), done.stderr[-2000:]


def kernel(name, start_us, end_us):
    """A stand-in for a device event (a CUDA kernel) with its timestamps."""
    return SimpleNamespace(
        name=name,
        device_type="DeviceType.CUDA",
        time_range=SimpleNamespace(start=start_us, end=end_us),
        self_cpu_time_total=0,
        self_device_time_total=end_us - start_us,
        cpu_parent=None,
        sequence_nr=-1,
        flops=0,
        thread=1,
        cpu_time_total=0,
    )


def test_nccl_kernels_beside_compute_count_once_and_the_shares_stay_within_the_window():
    """Under DDP the all-reduce kernels run on NCCL's stream beside backward's: their device time was added to the
    operators' and the shares passed 100% (1000 us of a 1000 us window busy 1200 us, outside operators clamped to 0).
    Only the 200 us when no compute kernel ran are communication's; the 400 us beside compute are hidden."""
    step = event("ProfilerStep#3", 5)
    step.cpu_time_total = 1000
    mm = event("aten::mm", 5, step)
    mm.self_device_time_total = 600
    allreduce = event("nccl:all_reduce", 5, step)
    allreduce.self_device_time_total = 600
    events = [
        step,
        mm,
        allreduce,
        kernel("sm90_xmma_gemm_f32", 100, 700),
        kernel("ncclDevKernel_AllReduce_Sum_f32_RING_LL", 300, 900),
    ]
    found = gap.categorize(events, on_device=True)
    seconds = {k: round(v * 1e6) for k, v in found["categories"].items() if v}
    assert seconds == {"matmul": 600, "communication": 200, "outside operators": 200}
    assert round(found["communication_hidden_s"] * 1e6) == 400 and found["overlap_s"] == 0
    assert sum(r["share"] for r in gap.rows(found, peak_tflops=1.0) if r["share"]) == pytest.approx(1.0)


def test_the_top_operators_leave_out_device_events_counted_in_their_operators():
    """key_averages() lists each kernel beside the aten:: operator that launched it, whose self device time already
    holds it: the GEMM's 600 us showed twice."""
    averages = [
        SimpleNamespace(
            key=name,
            count=1,
            self_cpu_time_total=cpu,
            self_device_time_total=device_us,
            device_type=f"DeviceType.{kind}",
        )
        for name, cpu, device_us, kind in (
            ("aten::mm", 20, 600, "CPU"),
            ("sm90_xmma_gemm_f32", 0, 600, "CUDA"),
            ("nccl:all_reduce", 30, 500, "CPU"),
            ("ncclDevKernel_AllReduce_Sum_f32_RING_LL", 0, 500, "CUDA"),
            ("Memcpy HtoD (Pageable -> Device)", 0, 40, "CUDA"),
        )
    ]
    rows = profiling.top_operators(averages, torch.device("cuda"))
    assert [r["name"] for r in rows] == ["aten::mm", "nccl:all_reduce"]
    assert sum(r["self_device_s"] for r in rows) == pytest.approx(1100e-6)
