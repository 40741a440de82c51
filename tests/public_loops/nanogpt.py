"""nanoGPT's train.py loop as written (a GPT whose forward returns `(logits, loss)`, gradient accumulation by hand
over `gradient_accumulation_steps` micro-steps, the next batch fetched with `X, Y = next(...)` while the GPU would
still be busy, `require_backward_grad_sync` set by hand under DDP, its `dtype` as an autocast context and a GradScaler
enabled for float16, the scaler's unscale, clip, step and update after the micro-steps), on an Accelerator. The model
is nanoGPT's model.py, small, its attention `F.scaled_dot_product_attention(..., is_causal=True)` (on a CPU without
dropout: torch's fused flash kernel, which FlopCounterMode alone does not count). `--lengths 16,512`: the first two
iterations' batches are 16 tokens long, later ones alternate 512 and 16 (a shape first met after the warm-up).
`--dtype` is nanoGPT's, its autocast here on the CPU; `--overflow-at N` plants an inf in a gradient at iteration N
(the step the GradScaler exists to skip)."""

import argparse
import contextlib
import itertools

import torch
import torch.nn as nn
from accelerate import Accelerator
from torch.nn import functional as F

import trainscope
from public_loops.truth import Truth


class CausalSelfAttention(nn.Module):
    def __init__(self, n_embd, n_head, dropout=0.0):
        super().__init__()
        self.c_attn = nn.Linear(n_embd, 3 * n_embd)
        self.c_proj = nn.Linear(n_embd, n_embd)
        self.n_head, self.n_embd, self.dropout = n_head, n_embd, dropout

    def forward(self, x):
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        # efficient attention using Flash Attention CUDA kernels
        y = torch.nn.functional.scaled_dot_product_attention(
            q, k, v, attn_mask=None, dropout_p=self.dropout if self.training else 0, is_causal=True
        )
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.c_proj(y)


class Block(nn.Module):
    def __init__(self, n_embd, n_head):
        super().__init__()
        self.ln_1, self.ln_2 = nn.LayerNorm(n_embd), nn.LayerNorm(n_embd)
        self.attn = CausalSelfAttention(n_embd, n_head)
        self.mlp = nn.Sequential(nn.Linear(n_embd, 4 * n_embd), nn.GELU(), nn.Linear(4 * n_embd, n_embd))

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, vocab_size=256, block_size=512, n_layer=2, n_head=2, n_embd=32):
        super().__init__()
        self.transformer = nn.ModuleDict(
            dict(
                wte=nn.Embedding(vocab_size, n_embd),
                wpe=nn.Embedding(block_size, n_embd),
                h=nn.ModuleList([Block(n_embd, n_head) for _ in range(n_layer)]),
                ln_f=nn.LayerNorm(n_embd),
            )
        )
        self.lm_head = nn.Linear(n_embd, vocab_size, bias=False)
        self.transformer.wte.weight = self.lm_head.weight

    def forward(self, idx, targets=None):
        b, t = idx.size()
        pos = torch.arange(0, t, dtype=torch.long, device=idx.device)
        x = self.transformer.wte(idx) + self.transformer.wpe(pos)
        for block in self.transformer.h:
            x = block(x)
        logits = self.lm_head(self.transformer.ln_f(x))
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1)) if targets is not None else None
        return logits, loss


def batches(batch_size: int, lengths: list[int], seed: int):
    """nanoGPT's get_batch, endless: random windows of a random token stream."""
    generator = torch.Generator().manual_seed(seed)
    data = torch.randint(0, 256, (20000,), generator=generator)
    for i in itertools.count():
        length = lengths[0] if i < 8 or len(lengths) == 1 else lengths[(i // 4) % len(lengths)]
        ix = torch.randint(len(data) - length - 1, (batch_size,), generator=generator)
        yield torch.stack([data[j : j + length] for j in ix]), torch.stack([data[j + 1 : j + 1 + length] for j in ix])


def main(argv=None):
    parser = argparse.ArgumentParser()
    parser.add_argument("--output-dir", required=True)
    parser.add_argument("--truth", required=True)
    parser.add_argument("--max-iters", type=int, default=6)
    parser.add_argument("--batch-size", type=int, default=2)
    parser.add_argument("--gradient-accumulation-steps", type=int, default=4)
    parser.add_argument("--lengths", default="64")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--overflow-at", type=int, default=-1)
    args = parser.parse_args(argv)
    lengths = [int(n) for n in args.lengths.split(",")]

    accelerator = Accelerator(cpu=True)
    ddp = accelerator.num_processes > 1
    gradient_accumulation_steps = args.gradient_accumulation_steps // accelerator.num_processes
    truth = Truth(f"{args.truth}.{accelerator.process_index}")
    torch.manual_seed(1337 + accelerator.process_index)
    model = GPT(block_size=max(lengths))
    optimizer = torch.optim.AdamW(model.parameters(), lr=6e-4, betas=(0.9, 0.95))
    model, optimizer = accelerator.prepare(model, optimizer)
    ptdtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[args.dtype]
    ctx = contextlib.nullcontext() if args.dtype == "float32" else torch.amp.autocast(device_type="cpu", dtype=ptdtype)
    scaler = torch.amp.GradScaler("cpu", enabled=(args.dtype == "float16"))
    run = trainscope.Run(accelerator, model, optimizer, steps=args.max_iters, name="nanogpt",  # trainscope
                         output_dir=args.output_dir, log_every=2, scaler=scaler)  # fmt: skip
    skipped = 0
    train_batches = run.data(batches(args.batch_size, lengths, accelerator.process_index))  # trainscope
    truth.watch_forwards(model)
    truth.start()
    with run:  # trainscope
        X, Y = next(train_batches)  # fetch the very first batch
        iter_num = 0
        while True:
            for micro_step in range(gradient_accumulation_steps):
                if ddp:
                    model.require_backward_grad_sync = micro_step == gradient_accumulation_steps - 1
                with ctx, run.stage("forward"):  # trainscope: the forward timed; backward is not a stage here
                    logits, loss = model(X, Y)
                    loss = loss / gradient_accumulation_steps
                truth.fed((X, Y), tuple(X.shape), X.shape[0], X.numel())
                batch = (X, Y)
                X, Y = next(train_batches)  # immediately async prefetch next batch while model is doing the forward
                run.backward(scaler.scale(loss))  # trainscope: was scaler.scale(loss).backward()
                run.count_micro_batch(batch, loss)  # trainscope
            if iter_num == args.overflow_at:  # planted: an overflowed gradient
                next(model.parameters()).grad[0, 0] = float("inf")
            scaler.unscale_(optimizer)
            accelerator.clip_grad_norm_(model.parameters(), 1.0)
            scale = scaler.get_scale()
            scaler.step(optimizer)
            scaler.update()
            skipped += scaler.get_scale() < scale  # the loop's own count of the steps its scaler skipped
            optimizer.zero_grad(set_to_none=True)
            iter_num += 1
            if iter_num >= args.max_iters:
                break
    truth.stop()
    truth.write(accelerator.unwrap_model(model), lambda m, b: m(*b)[1], iterations=iter_num, skipped=skipped)
