"""The precision a run really computes in, and the fp16 loss scaler's skipped steps.

How it works: docs/trust.md#in-the-code-the-precision-in-effect-trainscopecoreprecisionpy.
"""

from functools import lru_cache
from pathlib import Path

import torch

# A precision as the record names it, and the dtype its tensors are in (TF32: fp32 tensors, TF32 matmuls). The half
# precisions are autocast's: a run in fp32 or TF32 has no autocast.
DTYPES = {"fp32": torch.float32, "tf32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
HALF = ("bf16", "fp16")


def autocast_dtype(name: str | None) -> torch.dtype | None:
    """The dtype autocast computes a run of precision `name` in (bf16, fp16); None for fp32 and TF32."""
    return DTYPES[name] if name in HALF else None


def effective_precision(accelerator) -> str:
    """'fp16', 'bf16', 'tf32' or 'fp32': a matmul under the autocast that wraps the forward tells."""
    a = torch.ones(8, 8, device=accelerator.device)
    with accelerator.autocast():
        dtype = (a @ a).dtype
    return precision_name(dtype, accelerator.device.type)


def loop_autocast(device_type: str) -> torch.dtype | None:
    """The dtype of the loop's own `torch.autocast` around this point (a training forward's pre-hook: outside
    Accelerate's, which wraps the model's forward itself); None without one."""
    return torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else None


def seen_in_the_loop(env: dict, device_type: str, autocast, accelerate_scaler, own_scaler) -> dict:
    """The environment's precision as the loop ran it: Accelerate's mixed precision where it has one, else the loop's
    own autocast seen at its first training forward (`autocast`: its dtype, None without, False where no training
    forward was seen), and who scales the loss. {effective_precision, precision_seen, loss_scaling}."""
    effective, seen = env["effective_precision"], "a matmul under accelerator.autocast() (Accelerate's mixed precision)"
    if env["requested_precision"] == "no" and autocast is not False:
        seen = "no autocast around the model's first training forward"
        if autocast is not None:
            effective = precision_name(autocast, device_type)
            seen = f"the loop's own torch.autocast({device_type!r}, dtype={autocast}) around its first training forward"
    scaling = None
    if accelerate_scaler is not None:
        scaling = "Accelerate's GradScaler (mixed_precision fp16)"
    elif own_scaler is not None and own_scaler.is_enabled():
        scaling = "the loop's own torch.amp.GradScaler (given to trainscope.Run)"
    return {"effective_precision": effective, "precision_seen": seen, "loss_scaling": scaling}


def precision_name(matmul_dtype: torch.dtype, device_type: str) -> str:
    """The name of what a matmul computed in: TF32 only on a CUDA device with TF32 units and the flags on."""
    if matmul_dtype == torch.float16:
        return "fp16"
    if matmul_dtype == torch.bfloat16:
        return "bf16"
    if device_type == "cuda" and tf32_in_effect() and cuda_tf32_supported():
        return "tf32"
    return "fp32"


def tf32_in_effect() -> bool:
    """Whether fp32 matmuls or convolutions on CUDA may run as TF32 right now (the flags; a GPU without TF32
    units ignores them: see `cuda_tf32_supported`)."""
    return bool(torch.backends.cuda.matmul.allow_tf32 or torch.backends.cudnn.allow_tf32)


def cuda_native_bf16() -> bool:
    """Whether the current CUDA device computes bf16 natively: compute capability 8.0 and up (Ampere on).
    Before it (V100, T4) torch and Accelerate still accept bf16 autocast (`is_bf16_supported()` counts
    emulation by default), and it runs emulated. torch 2.13's `is_bf16_supported(including_emulation=False)`
    is exactly the capability rule (ROCm: always)."""
    return bool(torch.cuda.is_bf16_supported(including_emulation=False))


def cuda_tf32_supported() -> bool:
    """Whether the current CUDA device has TF32 units (Ampere on): on a V100 the TF32 flags change nothing
    and its fp32 matmuls stay fp32. `torch.cuda.is_tf32_supported` (torch 2.13)."""
    return bool(torch.cuda.is_tf32_supported())


def cuda_precision_facts() -> dict:
    """The environment's GPU precision keys (on the current CUDA device): compute capability, native bf16,
    TF32 units, and whether TF32 is really in effect (the flags on a GPU that has the units)."""
    major, minor = torch.cuda.get_device_capability()
    tf32_units = cuda_tf32_supported()
    return {
        "gpu_compute_capability": f"{major}.{minor}",
        "gpu_native_bf16": cuda_native_bf16(),
        "tf32_supported": tf32_units,
        "tf32_in_effect": tf32_in_effect() and tf32_units,
    }


def enforce_tf32(requested: bool) -> bool:
    """Set the TF32 flags to what --tf32 asked; returns True when something had changed them."""
    changed = tf32_in_effect() != requested or torch.backends.cuda.matmul.allow_tf32 != torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = requested
    torch.backends.cudnn.allow_tf32 = requested
    return changed


# CPU flags that mean bf16 matmuls run natively: x86 (AVX512-BF16, AMX-BF16) and ARM (BF16 in AdvSIMD, SVE-BF16).
NATIVE_BF16_FLAGS = frozenset({"avx512_bf16", "amx_bf16", "bf16", "svebf16"})
# A bf16 matmul measured below this many times fp32's is not faster (the bf16_not_faster warning).
BF16_NOT_FASTER_BELOW = 1.0


@lru_cache(maxsize=4)
def cpu_flags(cpuinfo: Path = Path("/proc/cpuinfo")) -> frozenset:
    """The CPU's feature flags: x86's `flags` line or ARM's `Features` line of /proc/cpuinfo (empty when unreadable)."""
    try:
        for line in cpuinfo.read_text().splitlines():
            name = line.split(":", 1)[0].strip()
            if name in ("flags", "Features") and ":" in line:
                return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def cpu_native_bf16(flags: frozenset | None = None) -> bool | None:
    """True with AVX512-BF16, AMX-BF16 (x86) or BF16 / SVE-BF16 (ARM), False without, None when the CPU flags cannot
    be read. The flags only: `cpu_bf16` sets the measured matmuls beside them."""
    flags = cpu_flags() if flags is None else flags
    if not flags:
        return None
    return bool(NATIVE_BF16_FLAGS & flags)


def cpu_bf16(flags: frozenset, machine_peak: dict | None) -> dict:
    """bf16 on this CPU, the flags and the timing together: {flags (the native-bf16 flags found), native_by_flags,
    fp32_tflops, bf16_tflops, speedup (bf16 over fp32 measured peak, same threads), faster (speedup above
    BF16_NOT_FASTER_BELOW, None unmeasured)}. The timing runs whatever the flags say, so it can correct them."""
    rates = (machine_peak or {}).get("precisions") or {}
    fp32, bf16 = (rates.get(p, {}).get("peak_tflops") for p in ("fp32", "bf16"))
    speedup = bf16 / fp32 if fp32 and bf16 else None
    return {
        "flags": sorted(NATIVE_BF16_FLAGS & flags),
        "native_by_flags": cpu_native_bf16(flags),
        "fp32_tflops": fp32,
        "bf16_tflops": bf16,
        "speedup": speedup,
        "faster": None if speedup is None else speedup > BF16_NOT_FASTER_BELOW,
    }


class SkippedSteps:
    """Optimizer steps the loss scaler skipped (inf/NaN gradients), counted without a device sync.

    Call `before_step()` after backward and `after_step()` after the optimizer step (GradScaler's
    `step` + `update`); read `total()` at log steps only: it is a sync point.
    """

    def __init__(self, scaler, device: torch.device):
        self.scaler = scaler
        self.count = torch.zeros((), dtype=torch.long, device=device) if scaler is not None else None
        self._scale_before = None

    def before_step(self) -> None:
        scale = getattr(self.scaler, "_scale", None)  # set by the scaler's first scale(loss); its initial one before
        self._scale_before = scale.clone() if scale is not None else getattr(self.scaler, "_init_scale", None)

    def after_step(self) -> None:
        scale = getattr(self.scaler, "_scale", None)
        if self._scale_before is not None and scale is not None:
            self.count += (scale < self._scale_before).long()  # update() halves it on overflow
        self._scale_before = None

    def total(self) -> int:
        return int(self.count.item()) if self.count is not None else 0  # .item() is a sync point


def planted_overflow_run(device: torch.device, planted: set[int], steps: int = 16, fused: bool = True):
    """A tiny fp16-scaled training loop (GradScaler, fused AdamW) with inf gradients planted at `planted`
    steps: returns the SkippedSteps counter and the weights after every step. Tests run it on the CPU,
    make gpu-check on CUDA."""
    torch.manual_seed(0)
    model = torch.nn.Linear(64, 8, device=device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=fused)
    scaler = torch.amp.GradScaler(device.type, init_scale=2.0**8, growth_interval=1000)
    skips, weights = SkippedSteps(scaler, device), []
    for step in range(steps):
        with torch.autocast(device.type, dtype=torch.float16 if device.type == "cuda" else torch.bfloat16):
            loss = model(torch.randn(16, 64, device=device)).float().pow(2).mean()
        scaler.scale(loss).backward()
        if step in planted:
            model.weight.grad[0, 0] = float("inf")
        skips.before_step()
        scaler.step(optimizer)
        scaler.update()
        skips.after_step()
        optimizer.zero_grad(set_to_none=True)
        weights.append(model.weight.detach().clone())
    return skips, weights
