"""PEFT's LoRA causal-LM example loop as written (peft_lora_clm_accelerate: get_peft_model on a causal LM,
`outputs = model(**batch); loss = outputs.loss; accelerator.backward(loss); optimizer.step(); lr_scheduler.step();
optimizer.zero_grad()`), offline: a tiny Llama from its configuration (transformers' default attention, SDPA: on a CPU without
dropout, torch's fused flash kernel), LoRA on q_proj and v_proj, batches of 16 and of 512 tokens padded with an attention mask."""

import argparse

import torch
from accelerate import Accelerator
from peft import LoraConfig, TaskType, get_peft_model
from transformers import LlamaConfig, LlamaForCausalLM, get_linear_schedule_with_warmup

import trainscope
from public_loops.truth import Truth


def dataset(rows: int, lengths: list[int], batch_size: int):
    """Batches alternating between `lengths`, each row a random number of real tokens, padded to the batch's length."""
    generator = torch.Generator().manual_seed(0)
    out = []
    for i in range(rows // batch_size):
        length = lengths[i % len(lengths)]
        ids = torch.randint(3, 500, (batch_size, length), generator=generator)
        real = torch.randint(length // 2, length + 1, (batch_size,), generator=generator)
        mask = (torch.arange(length)[None, :] < real[:, None]).long()
        labels = ids.masked_fill(mask == 0, -100)
        out.append({"input_ids": ids * mask, "attention_mask": mask, "labels": labels})
    return out


def main(argv=None):
    parser = argparse.ArgumentParser()
    parser.add_argument("--output-dir", required=True)
    parser.add_argument("--truth", required=True)
    parser.add_argument("--lengths", default="16,512")
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--batch-size", type=int, default=2)
    parser.add_argument("--target-modules", default="q_proj,v_proj")
    args = parser.parse_args(argv)

    accelerator = Accelerator(cpu=True)
    truth = Truth(f"{args.truth}.{accelerator.process_index}")
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=500, hidden_size=64, intermediate_size=172, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=1024, pad_token_id=0,
    )  # fmt: skip
    model = LlamaForCausalLM._from_config(config)
    peft_config = LoraConfig(
        task_type=TaskType.CAUSAL_LM, inference_mode=False, r=8, lora_alpha=32, lora_dropout=0.1,
        target_modules=args.target_modules.split(","),
    )  # fmt: skip
    model = get_peft_model(model, peft_config)
    train_dataloader = dataset(args.rows, [int(n) for n in args.lengths.split(",")], args.batch_size)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    lr_scheduler = get_linear_schedule_with_warmup(optimizer, 0, len(train_dataloader))
    model, optimizer, lr_scheduler = accelerator.prepare(model, optimizer, lr_scheduler)
    run = trainscope.Run(accelerator, model, optimizer, steps=len(train_dataloader), scheduler=lr_scheduler,  # trainscope
                         name="peft_lora", output_dir=args.output_dir, log_every=2)  # fmt: skip
    truth.start()
    with run:  # trainscope
        model.train()
        for step, batch in enumerate(run.data(train_dataloader)):  # noqa: B007  # trainscope: was `in train_dataloader`
            truth.fed(
                batch, tuple(batch["input_ids"].shape), batch["input_ids"].shape[0], int(batch["attention_mask"].sum())
            )
            with run.stage("forward"):  # trainscope
                outputs = model(**batch)
                loss = outputs.loss
            with run.stage("backward"):  # trainscope
                run.backward(loss)  # trainscope: was accelerator.backward(loss)
            with run.stage("optimizer"):  # trainscope
                optimizer.step()
                lr_scheduler.step()
                optimizer.zero_grad()
            run.count_micro_batch(batch, loss)  # trainscope
    truth.stop()
    truth.write(accelerator.unwrap_model(model), lambda m, b: m(**b).loss)
