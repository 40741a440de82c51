"""One rank of the bf16-over-gloo check (tests/test_gpu_verdicts.py), started by torch.multiprocessing.spawn: gloo's
bf16 all-reduce, reduce-scatter and all-gather, and DDP's gradients through torch's own bf16 compression hook."""

import json
import os

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

from trainscope.core.distributed import destroy_process_group


def rank(index: int, world: int, port: str, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=index, world_size=world)
    summed = torch.full((4,), 1.5 + index, dtype=torch.bfloat16)
    dist.all_reduce(summed)
    scattered = torch.empty(2, dtype=torch.bfloat16)
    dist.reduce_scatter_single(scattered, torch.arange(4, dtype=torch.bfloat16) + index)
    gathered = torch.empty(2 * world, dtype=torch.bfloat16)
    dist.all_gather_single(gathered, torch.tensor([index, index + 10], dtype=torch.bfloat16))
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4)
    ddp = torch.nn.parallel.DistributedDataParallel(model)

    def bf16_hook(state, bucket):  # torch's own hook under a name DDP's guard (the build, not the backend) lets by
        return default_hooks.bf16_compress_hook(state, bucket)

    ddp.register_comm_hook(None, bf16_hook)
    torch.manual_seed(1 + index)
    inputs = torch.randn(3, 8)
    ddp(inputs).sum().backward()
    grads = [torch.empty_like(model.weight.grad) for _ in range(world)]
    dist.all_gather(grads, model.weight.grad)
    inputs_all = [torch.empty_like(inputs) for _ in range(world)]
    dist.all_gather(inputs_all, inputs)
    # the mean of the ranks' gradients in fp32, for the hook's bf16 result to be held to
    expected = torch.stack([x.sum(0) for x in inputs_all]).mean(0).expand_as(model.weight)
    if index == 0:
        found = {
            "dtype": str(summed.dtype),
            "all_reduce": summed.tolist(),
            "reduce_scatter": scattered.tolist(),
            "all_gather": gathered.tolist(),
            "grads_equal": torch.equal(grads[0], grads[1]),
            "grad_error": (grads[0] - expected).abs().max().item(),
        }
        with open(out, "w") as file:
            json.dump(found, file)
    dist.barrier()
    destroy_process_group()  # after gloo's threads settle (trainscope.core.distributed)
