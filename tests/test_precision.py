"""Precision logic that matters on GPUs, checked on the CPU: loss-scaler skips, TF32, native bf16."""

import pytest
import torch

from trainscope import precision


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


def test_the_count_stays_on_the_device_until_read():
    skips, _ = scaled_steps({0})
    assert isinstance(skips.count, torch.Tensor) and skips.count.device.type == "cpu"


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


@pytest.mark.parametrize("flags,native", [
    (frozenset({"avx2", "fma"}), False),
    (frozenset({"avx512f", "avx512_bf16"}), True),
    (frozenset({"amx_bf16", "amx_tile"}), True),
    (frozenset(), None),
])
def test_native_bf16_comes_from_the_cpu_flags(flags, native):
    assert precision.cpu_native_bf16(flags) is native
