"""A transformers.Trainer fine-tuning run as its documentation writes one (TrainingArguments, a data collator, an
evaluation strategy), with trainscope's callback added to it (`trainer.add_callback`) and nothing else: a tiny BERT classifier from its
configuration (transformers' default attention, SDPA), or a tiny Llama with LoRA (peft) as a
causal LM, on random sequences of varied lengths padded per batch; gradient accumulation 2 with a short last window.
The collator counts what the Trainer's loader fed (truth.py)."""

import argparse
import os

import torch
from transformers import (
    BertConfig,
    BertForSequenceClassification,
    LlamaConfig,
    LlamaForCausalLM,
    Trainer,
    TrainingArguments,
)

import trainscope
from public_loops.truth import Truth


class Rows(torch.utils.data.Dataset):
    def __init__(self, count: int, seed: int, split: str):
        generator = torch.Generator().manual_seed(seed)
        lengths = torch.randint(8, 33, (count,), generator=generator)
        self.rows = [torch.randint(5, 500, (int(n),), generator=generator) for n in lengths]
        self.split = split

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, index):
        return {"input_ids": self.rows[index], "label": index % 2, "split": self.split}


def collator(truth: Truth, causal: bool, fail_at: int = 0):
    def collate(rows):
        if rows[0]["split"] == "train" and fail_at and sum(truth.shapes.values()) + 1 == fail_at:
            raise ValueError(f"a planted fault in training batch {fail_at}")
        longest = max(len(r["input_ids"]) for r in rows)
        ids = torch.zeros(len(rows), longest, dtype=torch.long)
        mask = torch.zeros(len(rows), longest, dtype=torch.long)
        for i, row in enumerate(rows):
            ids[i, : len(row["input_ids"])] = row["input_ids"]
            mask[i, : len(row["input_ids"])] = 1
        batch = {"input_ids": ids, "attention_mask": mask}
        batch["labels"] = ids.masked_fill(mask == 0, -100) if causal else torch.tensor([r["label"] for r in rows])
        if rows[0]["split"] == "train":  # what the training loader fed
            truth.fed(batch, tuple(ids.shape), len(rows), int(mask.sum()))
        return batch

    return collate


def main(argv=None):
    parser = argparse.ArgumentParser()
    parser.add_argument("--output-dir", required=True)
    parser.add_argument("--truth", required=True)
    parser.add_argument("--lora", action="store_true")
    parser.add_argument("--rows", type=int, default=72)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--fail-at", type=int, default=0, help="the collator raises at this training batch")
    args = parser.parse_args(argv)
    rank = int(os.environ.get("RANK", "0"))
    truth = Truth(f"{args.truth}.{rank}")
    torch.manual_seed(0)
    if args.lora:
        from peft import LoraConfig, TaskType, get_peft_model

        config = LlamaConfig(
            vocab_size=500, hidden_size=64, intermediate_size=172, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256, pad_token_id=0,
        )  # fmt: skip
        model = get_peft_model(
            LlamaForCausalLM._from_config(config),
            LoraConfig(task_type=TaskType.CAUSAL_LM, r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"]),
        )
    else:
        config = BertConfig(
            vocab_size=500, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
            max_position_embeddings=64, num_labels=2,
        )  # fmt: skip
        model = BertForSequenceClassification._from_config(config)
    training_args = TrainingArguments(
        output_dir=os.path.join(args.output_dir, "trainer"), per_device_train_batch_size=8,
        per_device_eval_batch_size=8, gradient_accumulation_steps=2, num_train_epochs=args.epochs, learning_rate=1e-3,
        eval_strategy="steps", eval_steps=3, logging_steps=2, save_strategy="no", report_to="none",
        use_cpu=True, dataloader_num_workers=0, disable_tqdm=True, seed=0, remove_unused_columns=False,
    )  # fmt: skip
    trainer = Trainer(
        model=model, args=training_args, train_dataset=Rows(args.rows, 0, "train"),
        eval_dataset=Rows(16, 1, "evaluation"), data_collator=collator(truth, args.lora, args.fail_at),
    )  # fmt: skip
    trainer.add_callback(trainscope.TrainscopeCallback(trainer, name="hf_trainer", output_dir=args.output_dir,
                                                       log_every=2))  # fmt: skip
    truth.start()
    trainer.train()
    truth.stop()
    truth.write(trainer.accelerator.unwrap_model(trainer.model), lambda m, b: m(**b).loss)
