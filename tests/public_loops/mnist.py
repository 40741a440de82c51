"""pytorch/examples' mnist/main.py loop as written (its Net of two convolutions, dropout and two linear layers,
`optimizer.zero_grad(); output = model(data); loss = F.nll_loss(output, target); loss.backward();
optimizer.step()`, a StepLR schedule stepped per epoch), on an Accelerator, offline: random 28x28 images, the last
batch of each epoch short. `--slow-forward` plants a delay in every training forward; `--new-optimizer-at EPOCH`
makes a new optimizer over the model's parameters at that epoch (as a loop that re-creates its optimizer after a
warm-up or a change of parameter groups), the one given to trainscope.Run no longer stepped."""

import argparse
import time

import torch
import torch.nn as nn
import torch.nn.functional as F
from accelerate import Accelerator
from torch.optim.lr_scheduler import StepLR
from torch.utils.data import DataLoader, TensorDataset

import trainscope
from public_loops.truth import Truth


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 8, 3, 1)
        self.conv2 = nn.Conv2d(8, 16, 3, 1)
        self.dropout1 = nn.Dropout(0.25)
        self.dropout2 = nn.Dropout(0.5)
        self.fc1 = nn.Linear(2304, 32)
        self.fc2 = nn.Linear(32, 10)

    def forward(self, x):
        x = F.relu(self.conv1(x))
        x = F.relu(self.conv2(x))
        x = F.max_pool2d(x, 2)
        x = self.dropout1(x)
        x = torch.flatten(x, 1)
        x = F.relu(self.fc1(x))
        x = self.dropout2(x)
        return F.log_softmax(self.fc2(x), dim=1)


def main(argv=None):
    parser = argparse.ArgumentParser()
    parser.add_argument("--output-dir", required=True)
    parser.add_argument("--truth", required=True)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--rows", type=int, default=200)
    parser.add_argument("--slow-forward", type=float, default=0.0)
    parser.add_argument("--new-optimizer-at", type=int, default=0)
    parser.add_argument("--steps", type=int, default=None)
    args = parser.parse_args(argv)

    accelerator = Accelerator(cpu=True)
    truth = Truth(f"{args.truth}.{accelerator.process_index}")
    torch.manual_seed(1)
    data = TensorDataset(torch.randn(args.rows, 1, 28, 28), torch.randint(0, 10, (args.rows,)))
    train_loader = DataLoader(data, batch_size=args.batch_size, shuffle=True)
    model = Net()
    if args.slow_forward:
        model.register_forward_pre_hook(
            lambda module, inputs: time.sleep(args.slow_forward) if module.training else None
        )
    optimizer = torch.optim.Adadelta(model.parameters(), lr=1.0)
    scheduler = StepLR(optimizer, step_size=1, gamma=0.7)
    model, optimizer, train_loader = accelerator.prepare(model, optimizer, train_loader)
    run = trainscope.Run(accelerator, model, optimizer, steps=args.steps or args.epochs * len(train_loader),  # trainscope
                         name="mnist", output_dir=args.output_dir, log_every=2)  # fmt: skip
    truth.start()
    with run:  # trainscope
        for epoch in range(1, args.epochs + 1):  # noqa: B007 (as mnist/main.py writes it)
            model.train()
            if epoch == args.new_optimizer_at:
                optimizer = accelerator.prepare(torch.optim.Adadelta(model.parameters(), lr=0.5))
                scheduler = StepLR(optimizer, step_size=1, gamma=0.7)
            for batch_idx, (data, target) in enumerate(run.data(train_loader)):  # noqa: B007  # trainscope: was `in train_loader`
                truth.fed((data, target), tuple(data.shape), data.shape[0], 0)
                optimizer.zero_grad()
                with run.stage("forward"):  # trainscope
                    output = model(data)
                    loss = F.nll_loss(output, target)
                with run.stage("backward"):  # trainscope
                    run.backward(loss)  # trainscope: was loss.backward()
                with run.stage("optimizer"):  # trainscope
                    optimizer.step()
                run.count_micro_batch((data, target), loss)  # trainscope
            scheduler.step()
    truth.stop()
    truth.write(accelerator.unwrap_model(model), lambda m, b: F.nll_loss(m(b[0]), b[1]))
