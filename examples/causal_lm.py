"""Fine-tune a decoder-only language model (GPT-2 or Llama architecture) with trainscope measuring it.

    python examples/causal_lm.py                                  # embedded tiny GPT-2 on the embedded tweets, offline
    python examples/causal_lm.py --model embedded:tiny-llama
    ACCELERATE_USE_CPU=1 accelerate launch --config_file accelerate_configs/ddp.yaml examples/causal_lm.py
    accelerate launch --config_file accelerate_configs/bf16.yaml examples/causal_lm.py --model gpt2   # Hub reachable

Texts are tokenized, joined and cut into blocks of --seq-length tokens (no padding: every token is real). The loop is
a plain Accelerate loop; the lines that say `run` are trainscope's (docs/instrument.md). The record goes to
<output-dir>/<run-name>/record.json, with tokens/s and the model FLOPs' share of this machine's measured peak.
`--without-trainscope` runs the same loop with none of those lines (what make bench-overhead measures it against).
"""

import argparse
import csv
import math

import torch
from accelerate import Accelerator
from torch.utils.data import DataLoader
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GPT2Config, LlamaConfig

import trainscope
from trainscope.workload import embedded

TINY = {  # architecture-only models built from these configurations (the tokenizer's vocabulary): no download
    "embedded:tiny-gpt2": lambda vocab, end: GPT2Config(
        n_layer=4, n_embd=128, n_head=4, n_positions=512, vocab_size=vocab, bos_token_id=end, eos_token_id=end
    ),
    "embedded:tiny-llama": lambda vocab, end: LlamaConfig(
        num_hidden_layers=4, hidden_size=128, intermediate_size=344, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=512, vocab_size=vocab, bos_token_id=end, eos_token_id=end,
    ),
}  # fmt: skip


def arguments(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add = parser.add_argument
    add("--model", default="embedded:tiny-gpt2", help="embedded:tiny-gpt2, embedded:tiny-llama, a Hub name or a path")
    add("--architecture-only", action="store_true", help="Build --model from its configuration, random weights.")
    add("--tokenizer", default=None, help="Default: the model's; the embedded models use MiniLM's WordPiece (offline).")
    add("--dataset", default="embedded:tweets", help="embedded:tweets, a .txt/.csv/.json file or a Hub dataset name.")
    add("--text-column", default="text", help="The column that holds the texts.")
    add("--max-texts", type=int, default=20000, help="Use the first N texts.")
    add("--seq-length", type=int, default=128, help="Tokens per training sequence.")
    add("--batch-size", type=int, default=8, help="Sequences per process and micro-batch.")
    add("--steps", type=int, default=100, help="Optimizer steps.")
    add("--learning-rate", type=float, default=3e-4, help="AdamW's learning rate.")
    add("--log-every", type=int, default=10, help="A step line every N optimizer steps.")
    add("--output-dir", default="runs", help="Where run records go.")
    add("--run-name", default=None, help="The run's folder; default <model class>-<precision>-<N>p-<date-time>.")
    add("--overwrite", action="store_true", help="Replace a run folder of the same name.")
    add("--without-trainscope", action="store_true", help="The same loop without trainscope's lines; nothing written.")
    return parser.parse_args(argv)


def load_texts(args) -> list[str]:
    if args.dataset == "embedded:tweets":
        with open(embedded.tweets_csv(), encoding=embedded.TWEETS_ENCODING, newline="") as file:
            return [row["text"] for row, _ in zip(csv.DictReader(file), range(args.max_texts))]
    import datasets

    kind = {".txt": "text", ".csv": "csv", ".json": "json", ".jsonl": "json"}.get(
        args.dataset[args.dataset.rfind(".") :]
    )
    split = datasets.load_dataset(kind, data_files=args.dataset)["train"] if kind else datasets.load_dataset(
        args.dataset, split="train"
    )  # fmt: skip
    return split[args.text_column][: args.max_texts]


def end_token(tokenizer) -> int:
    return tokenizer.eos_token_id if tokenizer.eos_token_id is not None else tokenizer.sep_token_id


def blocks(texts, tokenizer, length: int) -> torch.Tensor:
    """All texts' tokens, each text ended by the end token, joined and cut into rows of `length`."""
    end = end_token(tokenizer)
    ids = [token for text in tokenizer(texts, add_special_tokens=False)["input_ids"] for token in (*text, end)]
    rows = len(ids) // length
    if rows < 2:
        raise trainscope.UserError(f"{len(ids)} tokens make fewer than 2 sequences of {length}: more texts")
    return torch.tensor(ids[: rows * length]).view(rows, length)


def build(args):
    if args.model in TINY:
        tokenizer = AutoTokenizer.from_pretrained(args.tokenizer or embedded.minilm_dir())
        return tokenizer, AutoModelForCausalLM.from_config(TINY[args.model](len(tokenizer), end_token(tokenizer)))
    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer or args.model)
    if args.architecture_only:
        return tokenizer, AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(args.model))
    return tokenizer, AutoModelForCausalLM.from_pretrained(args.model)


def set_up(args):
    """The accelerator, and the model, optimizer, training and held-out loaders it prepared."""
    accelerator = Accelerator()
    torch.manual_seed(0)
    tokenizer, model = build(args)
    rows = blocks(load_texts(args), tokenizer, args.seq_length)
    held_out = min(max(1, len(rows) // 20), 64)  # the last 5% of the blocks, at most 64: the held-out loss
    loader = DataLoader(rows[:-held_out], batch_size=args.batch_size, shuffle=True, drop_last=True)
    evaluation = DataLoader(rows[-held_out:], batch_size=args.batch_size)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.learning_rate)
    trainscope.fsdp_wrap_rule(model, accelerator)  # an FSDP config: each decoder layer sharded
    return accelerator, *accelerator.prepare(model, optimizer, loader, evaluation)


def train(args) -> dict:
    accelerator, model, optimizer, loader, evaluation = set_up(args)
    if args.without_trainscope:
        return train_without_trainscope(args, accelerator, model, optimizer, loader, evaluation)

    run = trainscope.Run(  # the instrument: the lines with `run` are trainscope's
        accelerator, model, optimizer, steps=args.steps, name=args.run_name, output_dir=args.output_dir,
        overwrite=args.overwrite, log_every=args.log_every, threads="auto",  # this process's share of the cores
    )  # fmt: skip
    with run:
        model.train()
        while not run.done:
            for ids in run.data(loader):
                with run.stage("forward"):
                    loss = model(input_ids=ids, labels=ids).loss  # the model shifts the labels
                with run.stage("backward"):
                    run.backward(loss)
                with run.stage("optimizer"):
                    accelerator.clip_grad_norm_(model.parameters(), 1.0)
                    optimizer.step()
                    optimizer.zero_grad(set_to_none=True)
                run.count_micro_batch({"input_ids": ids}, loss)
        with run.evaluation():
            model.eval()
            with torch.no_grad():
                losses = [accelerator.gather_for_metrics(model(input_ids=ids, labels=ids).loss) for ids in evaluation]
            held = torch.stack([loss.mean() for loss in losses]).mean().item()
        return run.finish({"loss": held, "perplexity": math.exp(min(held, 50))})


def train_without_trainscope(args, accelerator, model, optimizer, loader, evaluation) -> dict:
    """The loop of `train` line for line, less trainscope's lines."""
    model.train()
    step = 0
    while step < args.steps:
        for ids in loader:
            loss = model(input_ids=ids, labels=ids).loss
            accelerator.backward(loss)
            accelerator.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1
            if step == args.steps:
                break
    model.eval()
    with torch.no_grad():
        losses = [accelerator.gather_for_metrics(model(input_ids=ids, labels=ids).loss) for ids in evaluation]
    held = torch.stack([loss.mean() for loss in losses]).mean().item()
    return {"loss": held, "perplexity": math.exp(min(held, 50))}


def main(argv=None):
    with trainscope.one_line_endings():
        train(arguments(argv))


if __name__ == "__main__":
    main()
