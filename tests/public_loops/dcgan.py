"""pytorch/examples' dcgan/main.py loop as written (a generator and a discriminator, each with its own Adam; per batch
the discriminator's step on real and fake images, then the generator's), on an Accelerator, offline: random 16x16
images, small networks. trainscope.Run is given the generator and its optimizer: a step is the generator's, the
discriminator's steps are counted beside it (docs/instrument.md#what-counts-as-a-step)."""

import argparse

import torch
import torch.nn as nn
import torch.optim as optim
from accelerate import Accelerator
from torch.utils.data import DataLoader, TensorDataset

import trainscope
from public_loops.truth import Truth

nz, ngf, ndf, nc = 8, 8, 8, 1


class Generator(nn.Module):
    def __init__(self):
        super().__init__()
        self.main = nn.Sequential(
            nn.ConvTranspose2d(nz, ngf * 2, 4, 1, 0, bias=False), nn.BatchNorm2d(ngf * 2), nn.ReLU(True),  # 4x4
            nn.ConvTranspose2d(ngf * 2, ngf, 4, 2, 1, bias=False), nn.BatchNorm2d(ngf), nn.ReLU(True),  # 8x8
            nn.ConvTranspose2d(ngf, nc, 4, 2, 1, bias=False), nn.Tanh(),  # 16x16
        )  # fmt: skip

    def forward(self, input):
        return self.main(input)


class Discriminator(nn.Module):
    def __init__(self):
        super().__init__()
        self.main = nn.Sequential(
            nn.Conv2d(nc, ndf, 4, 2, 1, bias=False), nn.LeakyReLU(0.2, inplace=True),  # 8x8
            nn.Conv2d(ndf, ndf * 2, 4, 2, 1, bias=False), nn.BatchNorm2d(ndf * 2), nn.LeakyReLU(0.2, inplace=True),
            nn.Conv2d(ndf * 2, 1, 4, 1, 0, bias=False), nn.Sigmoid(),
        )  # fmt: skip

    def forward(self, input):
        return self.main(input).view(-1, 1).squeeze(1)


def main(argv=None):
    parser = argparse.ArgumentParser()
    parser.add_argument("--output-dir", required=True)
    parser.add_argument("--truth", required=True)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--rows", type=int, default=80)
    args = parser.parse_args(argv)

    accelerator = Accelerator(cpu=True)
    truth = Truth(f"{args.truth}.{accelerator.process_index}")
    torch.manual_seed(0)
    dataloader = DataLoader(TensorDataset(torch.rand(args.rows, nc, 16, 16) * 2 - 1), batch_size=args.batch_size,
                            shuffle=True)  # fmt: skip
    netG, netD = Generator(), Discriminator()
    criterion = nn.BCELoss()
    real_label, fake_label = 1.0, 0.0
    optimizerD = optim.Adam(netD.parameters(), lr=0.0002, betas=(0.5, 0.999))
    optimizerG = optim.Adam(netG.parameters(), lr=0.0002, betas=(0.5, 0.999))
    netG, netD, optimizerG, optimizerD, dataloader = accelerator.prepare(netG, netD, optimizerG, optimizerD, dataloader)
    run = trainscope.Run(accelerator, netG, optimizerG, steps=args.epochs * len(dataloader), name="dcgan",  # trainscope
                         output_dir=args.output_dir, log_every=2)  # fmt: skip
    truth.start()
    with run:  # trainscope
        for epoch in range(args.epochs):  # noqa: B007 (as dcgan/main.py writes it)
            for i, data in enumerate(run.data(dataloader), 0):  # noqa: B007  # trainscope: was `in dataloader`
                # (1) Update D network: maximize log(D(x)) + log(1 - D(G(z)))
                netD.zero_grad()
                real_cpu = data[0]
                batch_size = real_cpu.size(0)
                label = torch.full((batch_size,), real_label, dtype=real_cpu.dtype)
                output = netD(real_cpu)
                errD_real = criterion(output, label)
                accelerator.backward(errD_real)
                noise = torch.randn(batch_size, nz, 1, 1)
                fake = netG(noise)
                label.fill_(fake_label)
                output = netD(fake.detach())
                errD_fake = criterion(output, label)
                accelerator.backward(errD_fake)
                optimizerD.step()
                # (2) Update G network: maximize log(D(G(z)))
                netG.zero_grad()
                label.fill_(real_label)
                output = netD(fake)
                errG = criterion(output, label)
                run.backward(errG)  # trainscope: was errG.backward()
                optimizerG.step()
                truth.fed(data, tuple(real_cpu.shape), batch_size, 0)
                run.count_micro_batch(data, errG)  # trainscope
    truth.stop()
    truth.write(generator_steps=truth.steps_of(optimizerG), discriminator_steps=truth.steps_of(optimizerD))
