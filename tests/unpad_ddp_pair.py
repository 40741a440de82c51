"""The padded and the padding-free model side by side on the ranks of one DDP run. tests/test_unpad.py runs `main`
on two ranks forked from its process (conftest.run_in_forked_ranks); by hand:

    accelerate launch --config_file accelerate_configs/ddp.yaml tests/unpad_ddp_pair.py OUT [train.py flags]

Both models built by trainscope.workload.modeling, each prepared by Accelerate (DDP over gloo on a CPU) and trained by
trainscope.workload.step.train_step on the same per-rank batches from the same seeds. Rank 0 writes {"padded": [...],
"unpad": [...], "world_size": n}: the per-step losses averaged over ranks. The batches are the in-process tests' too."""

import contextlib
import json
import sys
from pathlib import Path

import torch
from accelerate import Accelerator

from trainscope.core.distributed import shut_down
from trainscope.core.environment import usable_cores
from trainscope.workload.modeling import build_model, build_optimizer, build_scheduler, build_tokenizer
from trainscope.workload.settings import parse_settings
from trainscope.workload.step import train_step

BATCH, LONGEST, STEPS = 8, 40, 5


def batches(pad_id: int, vocab: int = 1000, seed: int = 1) -> list[dict]:
    """Batches of random tokens and random lengths (3 to LONGEST), right-padded as the collator pads."""
    generator = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(STEPS):
        lengths = torch.randint(3, LONGEST + 1, (BATCH,), generator=generator)
        mask = (torch.arange(int(lengths.max()))[None] < lengths[:, None]).long()
        ids = torch.randint(5, vocab, mask.shape, generator=generator).masked_fill(mask == 0, pad_id)
        labels = torch.randint(0, 3, (BATCH,), generator=generator)
        out.append({"input_ids": ids, "attention_mask": mask, "labels": labels})
    return out


def main(out: str, args: list[str]) -> None:
    accelerator = Accelerator()
    # each process its share of the cores, as train.py's --threads auto gives it (two processes of two threads
    # on two cores crawl)
    torch.set_num_threads(max(1, usable_cores() // accelerator.num_processes))
    rank, world = accelerator.process_index, accelerator.num_processes
    losses = {}
    for name, extra in (("padded", []), ("unpad", ["--unpad"])):
        (settings,) = parse_settings(argv=[*args, *extra])
        torch.manual_seed(0)
        model, _ = build_model(settings, ["a", "b", "c"], build_tokenizer(settings))
        optimizer = build_optimizer(model, settings, accelerator.device)
        scheduler = build_scheduler(settings, optimizer, 100, 0)
        model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
        data = batches(0, seed=1 + rank)  # each rank its own batches, as a sharded loader gives them
        torch.manual_seed(5 + rank)
        model.train()
        mine = [
            train_step(
                accelerator,
                model,
                batch,
                optimizer,
                scheduler,
                lambda _: contextlib.nullcontext(),
                settings.max_grad_norm,
            )[0]
            for batch in data
        ]
        losses[name] = accelerator.gather(torch.stack(mine)).view(world, -1).mean(0).tolist()
    if accelerator.is_main_process:
        Path(out).write_text(json.dumps({**losses, "world_size": world}))
    shut_down(accelerator)  # settles gloo's threads before the DDP models are freed (trainscope.core.distributed)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
