"""Peak memory: device allocator peaks on accelerators, peak resident set size on a CPU."""

import resource
import sys

import torch

GIB = 1024**3


def peak_rss_bytes() -> int:
    """Peak resident set size of this process so far (it cannot be reset)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # Linux reports KiB


def _cuda_peaks(device: torch.device) -> tuple[int, int]:
    # The nested form skips the flattening that max_memory_allocated() does on every call:
    # this runs at every stage boundary. Allocator statistics are kept on the host when work is
    # enqueued, so reading them does not wait for the GPU.
    stats = torch.cuda.memory_stats_as_nested_dict(device)
    if not stats:
        return 0, 0
    return stats["allocated_bytes"]["all"]["peak"], stats["reserved_bytes"]["all"]["peak"]


class PeakMemory:
    """`with PeakMemory(device) as peak: ...` then `peak.allocated_bytes`, `peak.reserved_bytes`.

    Resets the device's peak counters on entry (as accelerate's TorchTracemalloc does) and reads them
    on exit; the peaks from before the reset are kept in `before_*`, so nested or consecutive uses
    can still report a whole-run peak. On a CPU there is no resettable counter: both stay None and `rss_bytes` holds the
    process's lifetime peak RSS.
    """

    def __init__(self, device: torch.device):
        self.device = device
        self.on_cuda = device.type == "cuda"
        self.allocated_bytes: int | None = None
        self.reserved_bytes: int | None = None
        self.rss_bytes: int | None = None
        self.before_allocated_bytes = self.before_reserved_bytes = 0

    def __enter__(self):
        if self.on_cuda:
            self.before_allocated_bytes, self.before_reserved_bytes = _cuda_peaks(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        return self

    def __exit__(self, *exc):
        if self.on_cuda:
            self.allocated_bytes, self.reserved_bytes = _cuda_peaks(self.device)
        else:
            self.rss_bytes = peak_rss_bytes()
        return False
