"""Process-group teardown that cannot deadlock.

Gloo's worker threads free a finished collective's tensors, which takes the GIL. The process
group's C++ destructor, run when the last reference goes (often when a DDP model is freed at the
end of a function), joins those threads while holding the GIL (pytorch/pytorch#56297), so a
thread still freeing tensors waits forever. Sleeping after the last collective releases the GIL
and lets the threads finish first.
"""

import time

SETTLE_S = 0.2


def settle_collectives() -> None:
    """Call after the last collective, before the process group (or a DDP model) is freed."""
    time.sleep(SETTLE_S)


def destroy_process_group() -> None:
    import torch.distributed

    settle_collectives()
    torch.distributed.destroy_process_group()


def shut_down(accelerator, wait: bool = True) -> None:
    """End trackers and the process group on every rank. `wait=False` on a failure path, where the
    other ranks may never reach a barrier."""
    if wait:
        accelerator.wait_for_everyone()
    accelerator.end_training()
    if accelerator.num_processes > 1:
        settle_collectives()
