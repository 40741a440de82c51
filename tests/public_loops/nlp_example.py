"""accelerate's examples/nlp_example.py as written (a BERT classifier, AdamW, a linear schedule with warm-up,
`if step % gradient_accumulation_steps == 0: optimizer.step()`: gradients accumulated by hand), offline: a tiny BERT
from its configuration (transformers' default attention, SDPA) on random sequences of varied lengths, padded per
batch. The lines marked `# trainscope` are the documented ones."""

import argparse
import time

import torch
from accelerate import Accelerator
from torch.utils.data import DataLoader
from transformers import BertConfig, BertForSequenceClassification, get_linear_schedule_with_warmup

import trainscope
from public_loops.truth import Truth


def sequences(count: int, seed: int) -> list[dict]:
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.randint(8, 41, (count,), generator=generator)
    return [
        {"input_ids": torch.randint(5, 1000, (int(n),), generator=generator), "label": i % 2}
        for i, n in enumerate(lengths)
    ]


def collate_fn(examples, delay: float = 0.0):
    if delay:
        time.sleep(delay)  # a slow loader, planted
    longest = max(len(e["input_ids"]) for e in examples)
    ids = torch.zeros(len(examples), longest, dtype=torch.long)
    mask = torch.zeros(len(examples), longest, dtype=torch.long)
    for row, example in enumerate(examples):
        ids[row, : len(example["input_ids"])] = example["input_ids"]
        mask[row, : len(example["input_ids"])] = 1
    return {"input_ids": ids, "attention_mask": mask, "labels": torch.tensor([e["label"] for e in examples])}


def main(argv=None):
    parser = argparse.ArgumentParser()
    parser.add_argument("--output-dir", required=True)
    parser.add_argument("--truth", required=True)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--gradient-accumulation-steps", type=int, default=2)
    parser.add_argument("--rows", type=int, default=160)
    parser.add_argument("--slow-collate", type=float, default=0.0)
    args = parser.parse_args(argv)

    accelerator = Accelerator(cpu=True)
    gradient_accumulation_steps = args.gradient_accumulation_steps
    truth = Truth(f"{args.truth}.{accelerator.process_index}")
    torch.manual_seed(42)
    train_dataloader = DataLoader(
        sequences(args.rows, 0), shuffle=True, batch_size=args.batch_size,
        collate_fn=lambda rows: collate_fn(rows, args.slow_collate),
    )  # fmt: skip
    eval_dataloader = DataLoader(sequences(32, 1), batch_size=16, collate_fn=collate_fn)
    config = BertConfig(
        vocab_size=1000, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
        max_position_embeddings=64,
    )  # fmt: skip
    model = BertForSequenceClassification._from_config(config)
    optimizer = torch.optim.AdamW(params=model.parameters(), lr=2e-5)
    steps_per_epoch = -(-len(train_dataloader) // accelerator.num_processes // gradient_accumulation_steps)
    lr_scheduler = get_linear_schedule_with_warmup(
        optimizer=optimizer, num_warmup_steps=2, num_training_steps=steps_per_epoch * args.epochs
    )
    model, optimizer, train_dataloader, eval_dataloader, lr_scheduler = accelerator.prepare(
        model, optimizer, train_dataloader, eval_dataloader, lr_scheduler
    )
    run = trainscope.Run(  # trainscope
        accelerator, model, optimizer, steps=steps_per_epoch * args.epochs, scheduler=lr_scheduler,
        name="nlp_example", output_dir=args.output_dir, log_every=2,
    )  # fmt: skip
    truth.watch_forwards(model)
    truth.start()
    with run:  # trainscope
        for epoch in range(args.epochs):  # noqa: B007 (as nlp_example.py writes it)
            model.train()
            for step, batch in enumerate(run.data(train_dataloader)):  # trainscope: was `in train_dataloader`
                truth.fed(
                    batch, tuple(batch["input_ids"].shape), len(batch["labels"]), int(batch["attention_mask"].sum())
                )
                outputs = model(**batch)
                loss = outputs.loss
                loss = loss / gradient_accumulation_steps
                run.backward(loss)  # trainscope: was accelerator.backward(loss)
                if step % gradient_accumulation_steps == 0:
                    optimizer.step()
                    lr_scheduler.step()
                    optimizer.zero_grad()
                run.count_micro_batch(batch, loss)  # trainscope
            model.eval()
            correct = seen = 0
            with run.evaluation():  # trainscope
                for batch in eval_dataloader:
                    with torch.no_grad():
                        outputs = model(**batch)
                    predictions = outputs.logits.argmax(dim=-1)
                    predictions, references = accelerator.gather_for_metrics((predictions, batch["labels"]))
                    correct += int((predictions == references).sum())
                    seen += len(references)
            run.evaluated({"accuracy": correct / seen})  # trainscope
    truth.stop()
    truth.write(accelerator.unwrap_model(model), lambda m, b: m(**b).loss)
