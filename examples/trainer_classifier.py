"""Fine-tune a text classifier with transformers' Trainer, trainscope's callback measuring it.

    python examples/trainer_classifier.py                        # embedded tiny BERT on the embedded tweets, offline
    accelerate launch examples/trainer_classifier.py --model embedded:minilm-l6
    python examples/trainer_classifier.py --model distilbert-base-uncased   # Hub reachable

A Trainer script as transformers' documentation writes one (a tokenized dataset, TrainingArguments, a data collator
that pads each batch), plus one line: `trainer.add_callback(trainscope.TrainscopeCallback(trainer, ...))`. The record
goes to <output-dir>/<run-name>/record.json. `trainscope tune -- python examples/trainer_classifier.py` tries what
makes it faster from outside the script (docs/tune.md).
"""

import argparse
import csv

import datasets
import torch
from transformers import (
    AutoConfig,
    AutoModelForSequenceClassification,
    AutoTokenizer,
    BertConfig,
    DataCollatorWithPadding,
    Trainer,
    TrainingArguments,
)

import trainscope
from trainscope.workload import embedded

LABELS = ["negative", "neutral", "positive"]


def arguments(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add = parser.add_argument
    add("--model", default="embedded:tiny-bert", help="embedded:tiny-bert, embedded:minilm-l6, a Hub name or a path")
    add("--max-texts", type=int, default=4000, help="Use the first N tweets (the last 10%% held out).")
    add("--max-length", type=int, default=64, help="Tokens per text at most.")
    add("--batch-size", type=int, default=16, help="Texts per device and step.")
    add("--steps", type=int, default=100, help="Optimizer steps.")
    add("--learning-rate", type=float, default=5e-4, help="AdamW's learning rate.")
    add("--output-dir", default="runs", help="Where run records go (the Trainer's own output under <it>/trainer).")
    add("--run-name", default=None, help="The run's folder; default <model class>-<precision>-<N>p-<date-time>.")
    return parser.parse_args(argv)


def build(name: str, labels: int):
    if name == "embedded:tiny-bert":  # an architecture-only tiny BERT with MiniLM's WordPiece vocabulary
        tokenizer = AutoTokenizer.from_pretrained(embedded.minilm_dir())
        config = BertConfig(vocab_size=len(tokenizer), hidden_size=128, num_hidden_layers=2, num_attention_heads=2,
                            intermediate_size=256, num_labels=labels)  # fmt: skip
        return tokenizer, AutoModelForSequenceClassification.from_config(config)
    path = embedded.minilm_dir() if name == "embedded:minilm-l6" else name
    tokenizer = AutoTokenizer.from_pretrained(path)
    config = AutoConfig.from_pretrained(path, num_labels=labels)
    return tokenizer, AutoModelForSequenceClassification.from_pretrained(path, config=config)


def tweets(limit: int) -> datasets.Dataset:
    with open(embedded.tweets_csv(), encoding=embedded.TWEETS_ENCODING, newline="") as file:
        rows = [row for row, _ in zip(csv.DictReader(file), range(limit))]
    return datasets.Dataset.from_dict(
        {"text": [row["text"] for row in rows], "label": [LABELS.index(row["sentiment"]) for row in rows]}
    )


def main(argv=None) -> None:
    args = arguments(argv)
    torch.manual_seed(0)
    tokenizer, model = build(args.model, len(LABELS))
    data = tweets(args.max_texts).map(
        lambda batch: tokenizer(batch["text"], truncation=True, max_length=args.max_length), batched=True
    )
    split = data.train_test_split(test_size=0.1, seed=0)
    training_args = TrainingArguments(
        output_dir=f"{args.output_dir}/trainer", per_device_train_batch_size=args.batch_size,
        per_device_eval_batch_size=64, max_steps=args.steps, learning_rate=args.learning_rate, logging_steps=10,
        eval_strategy="no", save_strategy="no", report_to="none", seed=0,
    )  # fmt: skip
    trainer = Trainer(
        model=model, args=training_args, train_dataset=split["train"], eval_dataset=split["test"],
        data_collator=DataCollatorWithPadding(tokenizer), processing_class=tokenizer,
    )  # fmt: skip
    trainer.add_callback(trainscope.TrainscopeCallback(trainer, name=args.run_name, output_dir=args.output_dir))
    trainer.train()
    print(trainer.evaluate())


if __name__ == "__main__":
    main()
