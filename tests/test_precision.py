"""Precision logic that matters on GPUs, checked on the CPU: loss-scaler skips, TF32, native bf16."""

import contextlib
from types import SimpleNamespace

import pytest
import torch

from trainscope.core import precision


def scaled_steps(planted_inf_at: set[int], steps: int = 6):
    return precision.planted_overflow_run(torch.device("cpu"), planted_inf_at, steps)


def test_loss_scaler_skips_are_counted_with_a_fused_optimizer():
    skips, weights = scaled_steps({1, 4})
    assert skips.total() == 2
    # the skipped steps really did not update the weights
    assert torch.equal(weights[0], weights[1]) and torch.equal(weights[3], weights[4])
    assert not torch.equal(weights[1], weights[2])


def test_no_skips_without_overflow_and_no_counter_without_a_scaler():
    skips, _ = scaled_steps(set())
    assert skips.total() == 0
    none = precision.SkippedSteps(None, torch.device("cpu"))
    none.before_step(), none.after_step()
    assert none.total() == 0 and none.count is None


def test_counting_a_skip_reads_nothing_back_from_the_device(monkeypatch):
    """Counting is tensor arithmetic on the device: no .item() (a sync point on a GPU) until total() is read."""
    reads = []
    real_item = torch.Tensor.item
    monkeypatch.setattr(torch.Tensor, "item", lambda self: reads.append(1) or real_item(self))
    skips = precision.SkippedSteps(torch.amp.GradScaler("cpu", init_scale=2.0**8), torch.device("cpu"))
    skips.scaler._scale = torch.tensor(256.0)
    for scale in (128.0, 128.0, 64.0):  # update() backed off twice
        skips.before_step()
        skips.scaler._scale = torch.tensor(scale)
        skips.after_step()
    assert reads == [] and isinstance(skips.count, torch.Tensor)
    assert skips.total() == 2 and reads == [1]


@pytest.fixture
def tf32_flags():
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


def test_tf32_switched_on_behind_the_users_back_is_switched_off_and_reported(tf32_flags):
    torch.backends.cuda.matmul.allow_tf32 = True  # what Accelerate's dynamo set-up does for fp32 CUDA runs
    assert precision.enforce_tf32(False) is True
    assert precision.tf32_in_effect() is False
    assert precision.enforce_tf32(False) is False  # nothing to change the second time
    assert precision.enforce_tf32(True) is True and precision.tf32_in_effect() is True


@pytest.mark.parametrize(
    "flags,native",
    [
        (frozenset({"avx2", "fma"}), False),
        (frozenset({"avx512f", "avx512_bf16"}), True),
        (frozenset({"amx_bf16", "amx_tile"}), True),
        (frozenset(), None),
    ],
)
def test_native_bf16_comes_from_the_cpu_flags(flags, native):
    assert precision.cpu_native_bf16(flags) is native


# /proc/cpuinfo of an AWS Graviton3 (Neoverse V1) core as Linux prints it: no `flags` and no `model name`.
ARM_CPUINFO = """processor\t: 0
BogoMIPS\t: 2100.00
Features\t: fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics fphp asimdhp cpuid asimdrdm jscvt fcma lrcpc dcpop \
sha3 sm3 sm4 asimddp sha512 sve asimdfhm dit uscat ilrcpc flagm ssbs paca pacg dcpodp svei8mm svebf16 i8mm bf16 dgh rng
CPU implementer\t: 0x41
CPU architecture: 8
CPU variant\t: 0x1
CPU part\t: 0xd40
CPU revision\t: 1
""".replace("\\\n", "")
X86_CPUINFO = """processor\t: 0
model name\t: AMD EPYC 9B14
flags\t\t: fpu vme de pse avx2 avx512f avx512bw avx512_bf16 avx512_vnni
vmx flags\t: vnmi
bugs\t\t: sysret_ss_attrs
"""


@pytest.mark.parametrize(
    "text,native,flags,name",
    [
        (ARM_CPUINFO, True, ["bf16", "svebf16"], "ARM CPU implementer 0x41 part 0xd40"),
        (ARM_CPUINFO.replace(" svebf16", "").replace(" bf16", ""), False, [], "ARM CPU implementer 0x41 part 0xd40"),
        (X86_CPUINFO, True, ["avx512_bf16"], "AMD EPYC 9B14"),
        (X86_CPUINFO.replace(" avx512_bf16", ""), False, [], "AMD EPYC 9B14"),
    ],
)
def test_bf16_detection_reads_x86_flags_and_arm_features(tmp_path, text, native, flags, name):
    from trainscope.core.environment import cpu_model_name

    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text(text)
    found = precision.cpu_flags(cpuinfo)
    assert precision.cpu_native_bf16(found) is native and cpu_model_name(cpuinfo) == name
    assert "vnmi" not in found  # x86's `vmx flags` line is not the CPU's flags
    # the flags and the timing recorded together; the timing is what says faster or not
    block = {"precisions": {"fp32": {"peak_tflops": 0.2}, "bf16": {"peak_tflops": 0.9 if native else 0.01}}}
    facts = precision.cpu_bf16(found, block)
    assert facts["flags"] == flags and facts["native_by_flags"] is native
    assert facts["speedup"] == pytest.approx(4.5 if native else 0.05) and facts["faster"] is native
    assert precision.cpu_bf16(found, None)["faster"] is None  # unmeasured: not called slower


class TinyClassifier(torch.nn.Module):
    """Answers like a transformers classifier (an output with .logits), as train_step expects."""

    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(16, 2)

    def forward(self, features):
        return SimpleNamespace(logits=self.linear(features))


@pytest.mark.parametrize("fused", [True, False])
def test_skipped_steps_are_counted_through_accelerates_patched_optimizer_step(fused):
    """trainscope.workload.step.train_step (train.py's step) with Accelerate's AcceleratedOptimizer around AdamW and
    a GradScaler, counted as trainscope.Run counts (trainscope.run.events): every synchronizing step a step, those the
    scaler skipped apart. Accelerate patches the optimizer's step to learn whether GradScaler called it, and
    runs scaler.update() inside its own step. On CUDA, Accelerator(mixed_precision="fp16") builds the
    scaler itself; it makes none on a CPU, so a CPU GradScaler is handed to the Accelerator here. That
    a CUDA scaler and the fused CUDA kernel skip the same steps: not measured on GPU."""
    from accelerate import Accelerator
    from accelerate.optimizer import AcceleratedOptimizer
    from accelerate.state import AcceleratorState

    from trainscope.run.events import LoopEvents
    from trainscope.workload.step import train_step

    planted, steps = {1, 4}, 6
    try:
        accelerator = Accelerator(cpu=True)
        accelerator.scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8, growth_interval=1000)
        torch.manual_seed(0)
        model = TinyClassifier()
        model, optimizer = accelerator.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-2, fused=fused))
        assert isinstance(optimizer, AcceleratedOptimizer) and optimizer.scaler is accelerator.scaler
        events = LoopEvents(model, optimizer)
        step_now = {"step": 0}

        def plant_inf(grad):
            if step_now["step"] in planted:
                grad = grad.clone()
                grad[0, 0] = float("inf")
            return grad

        model.linear.weight.register_hook(plant_inf)
        updated, accelerate_says_skipped = [], []
        for step in range(steps):
            step_now["step"] = step
            before = model.linear.weight.detach().clone()
            batch = {"features": torch.randn(8, 16), "labels": torch.randint(0, 2, (8,))}
            train_step(
                accelerator,
                model,
                batch,
                optimizer,
                SimpleNamespace(step=lambda: None),
                lambda stage: contextlib.nullcontext(),
                max_grad_norm=None,
            )
            updated.append(not torch.equal(before, model.linear.weight))
            accelerate_says_skipped.append(optimizer.step_was_skipped)
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)
    events.close()
    assert events.skipped_total() == len(planted) and events.take() == steps
    assert updated == [step not in planted for step in range(steps)]  # the planted steps really were skipped
    # With the fused optimizer GradScaler always calls its step (the kernel skips the update itself), so
    # Accelerate's flag never turns; without fusing, GradScaler skips the call and the flag tells.
    assert accelerate_says_skipped == ([False] * steps if fused else [step in planted for step in range(steps)])


@pytest.fixture
def stand_in_gpu(monkeypatch, tf32_flags):
    """A CUDA device of a given compute capability for this CPU-only torch: its properties and the calls that
    read them are replaced; torch's own is_bf16_supported / is_tf32_supported logic runs on them."""

    def install(major: int, minor: int = 0, name: str = "Tesla V100-SXM2-16GB"):
        properties = SimpleNamespace(major=major, minor=minor, name=name, total_memory=16 * 1024**3)
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
        monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
        monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device=None: properties)
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)

    return install


@pytest.mark.parametrize("major,native", [(7, False), (8, True), (9, True)])
def test_a_gpu_before_ampere_has_neither_native_bf16_nor_tf32(stand_in_gpu, major, native):
    stand_in_gpu(major)
    torch.backends.cuda.matmul.allow_tf32 = True  # --tf32
    facts = precision.cuda_precision_facts()
    assert facts == {
        "gpu_compute_capability": f"{major}.0",
        "gpu_native_bf16": native,
        "tf32_supported": native,
        "tf32_in_effect": native,
    }
    assert precision.precision_name(torch.float32, "cuda") == ("tf32" if native else "fp32")
    assert precision.precision_name(torch.bfloat16, "cuda") == "bf16"


def test_a_v100_run_asked_for_bf16_and_tf32_is_recorded_as_emulated_bf16_and_fp32_with_warnings(stand_in_gpu):
    """The environment block of a bf16 run with --tf32 on a stand-in V100 (compute capability 7.0), through
    environment.describe, then the health checks on it. On a real V100: not measured on GPU."""
    from trainscope.core import environment
    from trainscope.measure import health

    stand_in_gpu(7)
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    accelerator = SimpleNamespace(
        device=torch.device("cuda", 0),
        num_processes=1,
        mixed_precision="bf16",
        state=SimpleNamespace(distributed_type="DistributedType.NO", backend=None),
    )
    threads = {
        "torch_threads": 2,
        "thread_budget": 2,
        "usable_cores": 2,
        "local_processes": 1,
        "threads_source": "auto",
    }
    env = environment.describe(accelerator, precision.precision_name(torch.bfloat16, "cuda"), threads)
    assert (env["effective_precision"], env["gpu_native_bf16"], env["tf32_in_effect"]) == ("bf16", False, False)
    record = {"settings": {"tf32": True, "memory_every": 10}, "environment": env, "summary": {}}
    warnings = {w["code"]: w["message"] for w in health.check(record, at_start=True)}
    assert set(warnings) == {"gpu_bf16_emulated", "tf32_unsupported"}
    assert "compute capability 7.0" in warnings["gpu_bf16_emulated"] and "emulated" in warnings["gpu_bf16_emulated"]
    assert "no TF32 units" in warnings["tf32_unsupported"]
    stand_in_gpu(8, name="NVIDIA A100-SXM4-80GB")
    env = environment.describe(accelerator, "bf16", threads)
    assert health.check({**record, "environment": env}, at_start=True) == []
