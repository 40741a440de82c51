"""A plain PyTorch loop with no HuggingFace model (a small MLP on synthetic data), measured by trainscope.

    python examples/plain_loop.py
    ACCELERATE_USE_CPU=1 accelerate launch --config_file accelerate_configs/ddp.yaml examples/plain_loop.py

The lines marked `# trainscope` are all it takes (docs/instrument.md); without them this is the loop as written.
The model has no shapes trainscope knows, so its FLOPs are counted once by FlopCounterMode; the predictor and
--unpad (for BERT/RoBERTa-like encoders) do not apply, and the record says so.
"""

import argparse

import torch
import torch.nn.functional as F
from accelerate import Accelerator
from torch.utils.data import DataLoader, TensorDataset

import trainscope


def train(args) -> dict:
    accelerator = Accelerator(gradient_accumulation_steps=args.accumulate)
    torch.manual_seed(0)
    inputs = torch.randn(8192, 64)
    targets = inputs @ torch.randn(64, 1) + 0.1 * torch.randn(8192, 1)
    loader = DataLoader(TensorDataset(inputs, targets), batch_size=args.batch_size, shuffle=True)
    model = torch.nn.Sequential(torch.nn.Linear(64, 512), torch.nn.GELU(), torch.nn.Linear(512, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)

    where = dict(name=args.run_name, output_dir=args.output_dir, log_every=args.log_every)  # trainscope
    run = trainscope.Run(accelerator, model, optimizer, steps=args.steps, overwrite=True, **where)  # trainscope
    with run:  # trainscope
        while not run.done:  # trainscope (an epoch loop would do)
            for x, y in run.data(loader):  # trainscope: was `for x, y in loader:`
                with accelerator.accumulate(model):
                    with run.stage("forward"):  # trainscope
                        loss = F.mse_loss(model(x), y)
                    with run.stage("backward"):  # trainscope
                        run.backward(loss)  # trainscope: was accelerator.backward(loss)
                    with run.stage("optimizer"):  # trainscope
                        optimizer.step()
                        optimizer.zero_grad()
                run.count_micro_batch((x, y), loss)  # trainscope
    return run.result


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=200, help="Optimizer steps.")
    parser.add_argument("--batch-size", type=int, default=64, help="Samples per process and micro-batch.")
    parser.add_argument("--accumulate", type=int, default=1, help="Micro-batches per optimizer step.")
    parser.add_argument("--log-every", type=int, default=20, help="A step line every N optimizer steps.")
    parser.add_argument("--output-dir", default="runs", help="Where run records go.")
    parser.add_argument("--run-name", default="plain-loop", help="The run's folder (replaced if it exists).")
    args = parser.parse_args(argv)
    with trainscope.one_line_endings():  # bad input or a fault: one line, no traceback
        train(args)


if __name__ == "__main__":
    main()
