"""Peak memory: device allocator peaks on CUDA, peak resident set size on a CPU; what a tensor holds on this rank."""

import resource
import sys

import torch


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of a tensor: a DTensor's local shard (FSDP2 shards parameters, gradients and optimizer state
    as DTensors, which have no storage of their own: reading their data pointer fails), any other tensor itself."""
    if torch.distributed.is_available():
        from torch.distributed.tensor import DTensor

        if isinstance(tensor, DTensor):
            return tensor.to_local()
    return tensor


def local_bytes(tensor: torch.Tensor) -> int:
    """Bytes of this rank's part of a tensor (a DTensor's numel() is the whole tensor's, across ranks)."""
    local = local_tensor(tensor)
    return local.numel() * local.element_size()


def is_sharded(tensor: torch.Tensor) -> bool:
    return local_tensor(tensor) is not tensor


def peak_rss_bytes() -> int:
    """Peak resident set size of this process so far (it cannot be reset)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # Linux reports KiB


class CudaMemoryProbe:
    """The allocator's peak allocated and reserved bytes since the last reset, in one C call (max_memory_allocated()
    flattens the whole statistics dict each call). The statistics are kept on the host: no call waits for the GPU."""

    def __init__(self, device: torch.device):
        self.device = device

    def reset(self) -> None:
        torch.cuda.reset_peak_memory_stats(self.device)

    def read(self) -> tuple[int, int]:
        stats = torch.cuda.memory_stats_as_nested_dict(self.device)
        if not stats:
            return 0, 0
        return stats["allocated_bytes"]["all"]["peak"], stats["reserved_bytes"]["all"]["peak"]
