"""The batch-size search: the largest of start, start/2, start/4, ... whose trial fits in device memory.

Accelerate's `find_executable_batch_size` calls the trial again after an out-of-memory error with a
smaller batch. Left to itself it multiplies the batch by 0.9 (accelerate 1.15, utils/memory.py): from
4096 that is dozens of rebuilds of the model and sizes like 3686 and 3317. Given a halving
`reduce_batch_size_fn`, it ends within log2(start) + 1 trials, on a halving of the start.

Only a single process may search: an out-of-memory error on one rank of a multi-process launch sends
that rank back to rebuild while the others wait for it in an all-reduce, for ever.
"""

from collections.abc import Callable

from accelerate.utils import find_executable_batch_size

from trainscope.core.errors import UserError


def halving(start: int) -> Callable[[], int]:
    """A `reduce_batch_size_fn` that halves. Accelerate calls it with no arguments, so it keeps the size."""
    size = start

    def reduce() -> int:
        nonlocal size
        size //= 2
        return size

    return reduce


def search(try_batch: Callable[[int], object], start: int, grow: bool = False, ceiling: int = 1 << 16) -> int:
    """The first size, halving from `start`, for which `try_batch(size)` returns without an out-of-memory
    error (as Accelerate's `should_reduce_batch_size` tells them). Other errors propagate; Accelerate
    raises RuntimeError when not even a batch of 1 fits.

    With `grow` (a start predicted to fit, trainscope.predict.largest_batch), a start that fits is doubled while the
    double fits (up to `ceiling`), so a prediction that is too low is found out as one that is too high is."""
    if start < 1:
        raise ValueError(f"the search starts from a positive batch size, got {start}")
    if grow and _fits(try_batch, start):
        size = start
        while 2 * size <= ceiling and _fits(try_batch, 2 * size):
            size *= 2
        return size
    if grow:
        if start == 1:
            raise RuntimeError("No executable batch size found, reached zero.")
        start //= 2

    @find_executable_batch_size(starting_batch_size=start, reduce_batch_size_fn=halving(start))
    def trial(batch_size: int) -> int:
        try_batch(batch_size)
        return batch_size

    return trial()


def _fits(try_batch: Callable[[int], object], size: int) -> bool:
    """Whether `try_batch(size)` runs without an out-of-memory error (other errors propagate)."""
    from accelerate.utils.memory import clear_device_cache, should_reduce_batch_size

    try:
        try_batch(size)
        return True
    except Exception as error:
        if not should_reduce_batch_size(error):
            raise
        clear_device_cache(garbage_collection=True)
        return False


def refuse_multi_process(config: str, processes: int) -> None:
    """UserError (one line) when `config` launches more than one process."""
    if processes > 1:
        raise UserError(
            f"the batch-size search runs one process, and {config} launches {processes}: an "
            "out-of-memory error on one rank would leave the others waiting in an all-reduce. Search "
            f"with a single-process config (single_gpu, bf16, fp16), or sweep {config} with --search-from 0"
        )
