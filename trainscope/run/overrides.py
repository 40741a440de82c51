"""What `trainscope tune` sets from outside a script for every run in it (environment variables, read when the run
opens).

How it works: docs/tune.md#what-trainscope-tune-changes-and-how.
"""

import dataclasses
import os
from pathlib import Path

OUTPUT = "TRAINSCOPE_TUNE_RUN"  # <folder>/<name>: the run's own folder, whatever the script names it
SEED = "TRAINSCOPE_TUNE_SEED"  # set (random, numpy, torch) when the run opens; the data split's seed held
WORKERS = "TRAINSCOPE_NUM_WORKERS"
PIN_MEMORY = "TRAINSCOPE_PIN_MEMORY"
EAGER_RANDOM = "TRAINSCOPE_EAGER_RANDOM"  # 1: compiled code draws eager's random numbers
TIME_MODEL = "TRAINSCOPE_TIME_MODEL"  # 1: the run's model timed alone after the loop (the advice run's estimates)


def settings(settings, environ=None):
    """The run's settings with what tune set (the seed set here, before any of the run's draws)."""
    environ = os.environ if environ is None else environ
    fields = {field.name for field in dataclasses.fields(settings)}  # train.py's settings, or a Run's options
    changed = {}
    if environ.get(OUTPUT):
        folder = Path(environ[OUTPUT])
        changed.update(output_dir=str(folder.parent), run_name=folder.name, overwrite=True, resume=False)
    if environ.get(SEED):
        from accelerate.utils import set_seed

        set_seed(int(environ[SEED]))
        if "seed" in fields:  # train.py's: its record says the seed it ran on
            changed.update(seed=int(environ[SEED]), data_seed=settings.resolved_data_seed)
    if environ.get(WORKERS) and "num_workers" in fields:  # a Run's loop: applied by Run.data
        changed["num_workers"] = int(environ[WORKERS])
    if environ.get(PIN_MEMORY) and "pin_memory" in fields:
        changed["pin_memory"] = environ[PIN_MEMORY] == "1"
    if environ.get(TIME_MODEL) == "1":
        changed["time_model"] = True
    if environ.get(EAGER_RANDOM) == "1":
        eager_random_numbers()
    return dataclasses.replace(settings, **changed) if changed else settings


def eager_random_numbers() -> None:
    """Compiled code draws its random numbers as eager code does: inductor's fallback_random calls the eager random
    kernels (dropout's bernoulli on the input's shape and strides) on the eager generator instead of its own
    generated ones, so a seeded compiled run draws the eager run's dropout masks (torch/_inductor/config.py)."""
    import torch._inductor.config as inductor_config

    inductor_config.fallback_random = True


def loader(loader, environ=None):
    """The loop's loader with the workers and pinned memory tune set, where a worker process yields the batch the
    main process would: a torch DataLoader (Accelerate's wrapper too) over a map-style dataset, whose indices the
    main process draws. A dataset or collate function that draws random numbers itself would draw them in the
    workers: the change is then not exact, which tune's judgement of it finds. Anything else is refused in one line."""
    environ = os.environ if environ is None else environ
    wanted = {"num_workers": environ.get(WORKERS), "pin_memory": environ.get(PIN_MEMORY)}
    if not any(wanted.values()):
        return loader
    import torch.utils.data as data

    base = getattr(loader, "base_dataloader", loader)  # Accelerate's DataLoaderShard delegates to the loader it wraps
    if not isinstance(base, data.DataLoader) or isinstance(base.dataset, data.IterableDataset):
        from trainscope.core.errors import UserError

        raise UserError(
            f"{WORKERS}/{PIN_MEMORY}: this loop's loader ({type(base).__name__}) is not a DataLoader over a "
            "map-style dataset, whose batches workers would leave as they are"
        )
    if wanted["num_workers"]:
        base.num_workers = int(wanted["num_workers"])
        base.prefetch_factor = base.prefetch_factor or (2 if base.num_workers else None)  # DataLoader's default
    if wanted["pin_memory"]:
        base.pin_memory = wanted["pin_memory"] == "1"
    return loader
