"""train.py against the HF transformers.Trainer (same model, data, batches, precision and steps) in alternating rounds,
and what trainscope's Trainer callback costs a Trainer script's whole run (trainscope.experiments.benchmarks.whole_run).

    python -m trainscope.experiments.benchmarks.trainer_peer [--pairs 5] [--cost-pairs 11] [--precision bf16] [train.py flags]

Writes benchmarks/trainer_peer.{json,md}; exits 1 where the direct figure lies outside the rounds' interval.
How it works: docs/benchmarks.md#in-the-code-how-make-bench-trainer-compares-trainscopeexperimentsbenchmarkstrainer_peerpy."""

import argparse
import contextlib
import itertools
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from trainscope.core import launching
from trainscope.core.paths import ROOT
from trainscope.core.record_view import RunView
from trainscope.core.records import read_record, read_steps
from trainscope.experiments.benchmarks import short_run, whole_run
from trainscope.measure import bench
from trainscope.report.document import Heading, Paragraph, markdown
from trainscope.report.tables import Table, spread_cell
from trainscope.workload.settings import parse_settings

DEFAULT_ARGS = ["--per-device-batch-size", "32", *short_run(samples=1600, steps=30, warmup=5, log_every=5)]
CONFIG_FOR = {
    ("cpu", "fp32"): None,
    ("cuda", "fp32"): "single_gpu",
    ("cuda", "bf16"): "bf16",
    ("cuda", "fp16"): "fp16",
    ("cpu", "bf16"): "bf16",
}
GOAL = 1.05  # train.py by its documented launcher against the Trainer
# The callback's cost is measured on the embedded tiny model: steps of milliseconds, the callback's share the largest.
COST_ARGS = ["--model", "embedded:tiny-bert", "--per-device-batch-size", "16", "--max-seq-length", "64", "--threads",
             "1"]  # fmt: skip
COST_STEPS, COST_WARMUP = 1000, 20
COST_PAIRS = 11  # the median's interval at 98.8%


def peer_trainer(settings, precision: str, scratch: str, callbacks: list):
    """A transformers.Trainer on train.py's workload and own loader (the same samples in the same order, the same
    thread budget), with `callbacks`."""
    from trainscope.run import startup  # deferred: it loads transformers' models
    from trainscope.workload.data import build_dataloaders, load_classification_data  # deferred: it loads datasets
    from trainscope.workload.modeling import build_model, build_tokenizer  # deferred: it loads transformers' models

    startup.configure_process(settings)
    tokenizer = build_tokenizer(settings)
    data = load_classification_data(settings, tokenizer, contextlib.nullcontext)
    torch.manual_seed(settings.seed)
    model, _ = build_model(settings, data.label_names, tokenizer)
    on_cuda = torch.cuda.is_available()
    loader = build_dataloaders(data, tokenizer, settings, pin_memory=on_cuda)[0]
    arguments = training_arguments(settings, precision, scratch, on_cuda)
    return peer_trainer_class(loader)(model=model, args=arguments, train_dataset=data.train, callbacks=callbacks)


def trainer_loop(argv: list[str], precision: str, with_callback: bool = False) -> None:
    """Fine-tune with transformers.Trainer on train.py's own loader (with trainscope's callback when asked); print
    steady-state figures as JSON (and the callback's record's stage split)."""
    (settings,) = parse_settings(argv=argv)
    clock = steady_clock(settings, torch.cuda.is_available(), lambda: trainer.tokens)  # the trainer below counts them
    with tempfile.TemporaryDirectory() as scratch:
        trainer = peer_trainer(settings, precision, scratch, [clock])
        if with_callback:
            from trainscope.trainer import TrainscopeCallback  # deferred: it loads transformers' Trainer

            options = {"log_every": settings.log_every, "timing_warmup_steps": settings.timing_warmup_steps}
            trainer.add_callback(
                TrainscopeCallback(trainer, name="callback", output_dir=scratch, threads="launcher", **options)
            )
        trainer.train()
        figures = steady_figures(settings, clock)
        if with_callback:
            figures["stage_shares"] = RunView(read_record(Path(scratch) / "callback")).shares("steady")
    print(json.dumps(figures))


ALONE_BLOCKS = 5  # blocks of each arm in one child, alternated


def callback_alone(argv: list[str]) -> None:
    """The callback's own time per step, direct: a Trainer whose steps do next to nothing (a 5-weight model on batches
    of the cost runs' shape already in memory, so that the callback's hooks and wrappers all run) with and without
    the callback, in alternating blocks in one process; prints the median of the blocks' differences in
    microseconds per step as JSON. The Trainer's own work is the same in both and small, so the difference of the
    two is the callback's calls, not the noise of two long totals."""
    from transformers import Trainer, TrainerCallback, TrainingArguments

    from trainscope.trainer import TrainscopeCallback  # deferred: it loads transformers' Trainer

    (settings,) = parse_settings(argv=argv)
    if settings.threads.isdigit():
        torch.set_num_threads(int(settings.threads))
    steps, warmup = settings.max_steps or 500, settings.timing_warmup_steps
    batch, length = settings.per_device_batch_size, settings.max_seq_length
    mask = torch.ones(length, dtype=torch.long)
    mask[length // 2 :] = 0
    rows = [{"input_ids": torch.zeros(length, dtype=torch.long), "attention_mask": mask, "labels": 0}] * batch

    class Probe(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = torch.nn.Linear(4, 1)
            self.register_buffer("features", torch.zeros(1, 4))

        def forward(self, input_ids=None, attention_mask=None, labels=None):
            return {"loss": self.linear(self.features).sum()}

    class Clock(TrainerCallback):
        started = finished = None

        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == warmup:
                self.started = time.perf_counter()
            elif state.global_step == steps:
                self.finished = time.perf_counter()

    def us_per_step(with_callback: bool, scratch: str) -> float:
        clock = Clock()
        arguments = TrainingArguments(output_dir=scratch, per_device_train_batch_size=batch, max_steps=steps,
                                      report_to=[], save_strategy="no", eval_strategy="no", disable_tqdm=True,
                                      use_cpu=not torch.cuda.is_available(), logging_steps=settings.log_every,
                                      optim="adamw_torch", seed=settings.seed)  # fmt: skip
        trainer = Trainer(model=Probe(), args=arguments, train_dataset=rows * steps, callbacks=[clock])
        if with_callback:
            trainer.add_callback(TrainscopeCallback(trainer, name="alone", output_dir=scratch, flops=0,
                                                    threads="launcher", log_every=settings.log_every,
                                                    timing_warmup_steps=warmup))  # fmt: skip
        trainer.train()
        return (clock.finished - clock.started) / (steps - warmup) * 1e6

    differences, bare = [], []
    with tempfile.TemporaryDirectory() as scratch:
        for block in range(ALONE_BLOCKS):
            order = (False, True) if block % 2 == 0 else (True, False)
            timed = {arm: us_per_step(arm, str(Path(scratch) / f"{block}-{arm}")) for arm in order}
            differences.append(timed[True] - timed[False])
            bare.append(timed[False])
    print(json.dumps({"us_per_step": statistics.median(differences), "trainer_us_per_step": statistics.median(bare),
                      "blocks": ALONE_BLOCKS, "threads": torch.get_num_threads(), "steps": steps}))  # fmt: skip


def peer_trainer_class(loader):
    """A Trainer that trains on `loader` (train.py's own) and counts the non-padding tokens it trains on."""
    from transformers import Trainer

    class PeerTrainer(Trainer):
        tokens = None

        def get_train_dataloader(self):
            return self.accelerator.prepare(loader)

        def training_step(self, model, inputs, num_items_in_batch=None):
            mask = inputs["attention_mask"].sum()  # on the device: read at log steps only, as train.py does
            self.tokens = mask if self.tokens is None else self.tokens + mask
            return super().training_step(model, inputs, num_items_in_batch)

    return PeerTrainer


def steady_clock(settings, on_cuda: bool, tokens):
    """A callback that times the steps after the timing warm-up and reads `tokens()` (the trainer's count so far)
    at log steps and at the timed window's ends."""
    from transformers import TrainerCallback

    class SteadyClock(TrainerCallback):
        started = finished = None
        tokens_at = {}

        def on_step_end(self, args, state, control, **kwargs):
            step = state.global_step
            if step == settings.timing_warmup_steps or step == settings.max_steps:
                if on_cuda:
                    torch.cuda.synchronize()
                now = time.perf_counter()
                self.started, self.finished = (
                    (now, None) if step == settings.timing_warmup_steps else (self.started, now)
                )
            if step % settings.log_every == 0 or step in (settings.timing_warmup_steps, settings.max_steps):
                self.tokens_at[step] = int(tokens().item())  # sync point: log steps and the window's ends

    return SteadyClock()


def steady_figures(settings, clock) -> dict:
    """Samples/s and tokens/s over the timed window, the thread count, and the token counts the batches are
    compared by."""
    seconds = clock.finished - clock.started
    steady_steps = settings.max_steps - settings.timing_warmup_steps
    tokens = clock.tokens_at[settings.max_steps] - clock.tokens_at[settings.timing_warmup_steps]
    return {
        "samples_per_s": steady_steps * settings.per_device_batch_size / seconds,
        "tokens_per_s": tokens / seconds,
        "threads": torch.get_num_threads(),
        "tokens_at": clock.tokens_at,
    }


def training_arguments(settings, precision: str, scratch: str, on_cuda: bool):
    """The Trainer's arguments for train.py's settings: same steps, schedule, clipping, seeds, optimizer."""
    from transformers import TrainingArguments

    return TrainingArguments(
        output_dir=scratch, per_device_train_batch_size=settings.per_device_batch_size, max_steps=settings.max_steps,
        learning_rate=settings.learning_rate, weight_decay=settings.weight_decay,
        lr_scheduler_type=settings.lr_scheduler, warmup_steps=int(settings.warmup_fraction * settings.max_steps),
        max_grad_norm=settings.max_grad_norm or 0.0, logging_steps=settings.log_every, report_to=[],
        save_strategy="no", eval_strategy="no", dataloader_num_workers=settings.num_workers,
        dataloader_pin_memory=on_cuda, seed=settings.seed, data_seed=settings.seed, optim="adamw_torch_fused",
        bf16=precision == "bf16", fp16=precision == "fp16", tf32=settings.tf32 if on_cuda else None,
        disable_tqdm=True, use_cpu=not on_cuda, dataloader_drop_last=False
    )  # fmt: skip


def run_trainer(train_args: list[str], precision: str, config: str | None, with_callback: bool = False) -> dict:
    """This module's `--trainer` child by `accelerate launch`, the JSON its last line prints."""
    command = [*launching.accelerate_launch(config), "-m", "trainscope.experiments.benchmarks.trainer_peer",
               "--trainer", "--precision", precision, *(["--with-callback"] if with_callback else []),
               *train_args]  # fmt: skip
    result = launching.run_captured(command, launching.training_env())
    if result.returncode != 0:
        raise SystemExit(f"error: the Trainer arm failed: {launching.failure_reason(result)}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def run_train_py(train_args: list[str], config: str | None, launcher: str, output_dir: Path, name: str) -> dict:
    result = launching.run_training(
        [*train_args, "--output-dir", str(output_dir), "--run-name", name], config, launcher, echo=False
    )
    if result.returncode != 0:
        raise SystemExit(f"error: train.py ({launcher}) failed: {launching.failure_reason(result)}")
    view = RunView(read_record(output_dir / name))
    steps = read_steps(output_dir / name)
    so_far = itertools.accumulate(line["tokens"] for line in steps)
    return {
        "samples_per_s": view.samples_per_s,
        "tokens_per_s": view.tokens_per_s,
        "threads": view.torch_threads,
        "tokens_at": {str(line["step"]): tokens for line, tokens in zip(steps, so_far)},
        "effective_precision": view.precision,
        "warnings": view.warning_codes,
        "stage_shares": view.shares("steady"),  # each stage's median share of the steady wall time
    }


def same_batches(rounds: list[dict]) -> bool:
    """Both trainers counted the same non-padding tokens at every step train.py logged: the same batches."""
    return all(
        all(
            str(step) in r["trainer"]["tokens_at"] and r["trainer"]["tokens_at"][str(step)] == tokens
            for step, tokens in r["accelerate"]["tokens_at"].items()
        )
        for r in rounds
    )


def cost_script(train_args: list[str], precision: str, config: str | None, steps: int) -> whole_run.Script:
    """The Trainer script (this module's `--trainer` child) on the embedded tiny model, with trainscope's callback and
    without it; its direct figure the callback alone (`--callback-alone`)."""
    warmup = COST_WARMUP if steps > 2 * COST_WARMUP else 1  # a short check (the tests): the warm-up within the steps
    cost_args = [*train_args, *COST_ARGS, *short_run(samples=16 * steps, steps=steps, warmup=warmup, log_every=10)]
    child = ["-m", "trainscope.experiments.benchmarks.trainer_peer", "--precision", precision]
    return whole_run.Script(
        "a Trainer script", "transformers.Trainer (the embedded tiny model) with trainscope.TrainscopeCallback against "
        "the same script without it", launching.accelerate_launch(config),
        {whole_run.BASELINE: [*child, "--trainer", *cost_args],
         "TrainscopeCallback": [*child, "--trainer", "--with-callback", *cost_args]},
        warmup=warmup, direct=[*child, "--callback-alone", *cost_args],
    )  # fmt: skip


def measure(args, user_args: list[str]) -> dict:
    """The peer comparison on DEFAULT_ARGS then the user's flags; the callback's cost on the user's flags then
    COST_ARGS (its own short run: not the peer's defaults written before it, overridden)."""
    train_args = [*DEFAULT_ARGS, *user_args]
    device = "cuda" if torch.cuda.is_available() else "cpu"
    config = CONFIG_FOR[(device, args.precision)]
    with tempfile.TemporaryDirectory() as scratch:
        arms = {
            "trainer": lambda i: run_trainer(train_args, args.precision, config),
            "trainer+callback": lambda i: run_trainer(train_args, args.precision, config, with_callback=True),
            "accelerate": lambda i: run_train_py(train_args, config, "accelerate", Path(scratch), f"a{i}"),
            "python": lambda i: run_train_py(train_args, config, "python", Path(scratch), f"p{i}"),
        }
        if config is not None:
            arms.pop("python")  # a precision needs its config: python train.py runs fp32 only
        rounds = bench.alternate(arms, args.pairs)
        script = cost_script(user_args, args.precision, config, args.cost_steps)
        cost = whole_run.measure(script, args.cost_pairs, args.warm_rounds, whole_run.launcher(Path(scratch)))
    comparisons = {
        "accelerate_over_trainer": bench.compare_rounds(rounds, "accelerate", "trainer", "samples_per_s"),
        "accelerate_over_trainer_tokens": bench.compare_rounds(rounds, "accelerate", "trainer", "tokens_per_s"),
    }
    if "python" in arms:
        comparisons["accelerate_over_python"] = bench.compare_rounds(rounds, "accelerate", "python", "samples_per_s")
    return {
        "benchmark": "trainer_peer",
        "benchmark_version": 5,  # 5: the callback's cost judged on the Trainer script's whole run
        "precision": args.precision,
        "accelerate_config": config,
        "train_args": train_args,
        "rounds": rounds,
        "arms": {
            name: {
                "samples_per_s": bench.spread([r[name]["samples_per_s"] for r in rounds]),
                "tokens_per_s": bench.spread([r[name]["tokens_per_s"] for r in rounds]),
                "threads": sorted({r[name]["threads"] for r in rounds}),
            }
            for name in arms
        },
        "same_batches": same_batches(rounds),
        "comparisons": comparisons,
        "goal": GOAL,
        "meets_goal": comparisons["accelerate_over_trainer"]["min_ratio"] >= GOAL,
        "stage_shares": {
            name: {stage: statistics.median(r[name]["stage_shares"][stage] for r in rounds) for stage in STAGE_ORDER}
            for name in ("accelerate", "trainer+callback")
        },
        "warm_rounds": args.warm_rounds,
        "callback_cost": cost,
    }


STAGE_ORDER = ("data", "forward", "backward", "optimizer", "eval", "other")


def tables(report: dict) -> tuple[Table, Table, Table]:
    """The arms' speed, the comparisons with their verdicts, and the stage splits of the steady steps."""
    arms = Table(
        "Arms",
        ["arm", "samples/s (median, min-max)", "tokens/s (median)", "threads"],
        [
            [
                name,
                spread_cell(arm["samples_per_s"]),
                f"{arm['tokens_per_s']['median']:.0f}",
                ", ".join(map(str, arm["threads"])),
            ]
            for name, arm in report["arms"].items()
        ],  # fmt: skip
        "trainer_peer_arms",
    )
    comparisons = Table(
        "Comparisons",
        ["comparison", "ratio (median, min-max)", "verdict"],
        [[name.replace("_", " "), bench.ratio_text(c), c["verdict"]] for name, c in report["comparisons"].items()],
        "trainer_peer",
        align="lrl",
    )
    shares = report["stage_shares"]
    split = Table(
        "Stage splits of the steady steps (median share of the wall time)",
        ["stage", "train.py (its record)", "Trainer (trainscope's callback)"],
        [
            [stage, f"{shares['accelerate'][stage]:.1%}", f"{shares['trainer+callback'][stage]:.1%}"]
            for stage in STAGE_ORDER
        ],
        "trainer_peer_stages",
        align="lrr",
    )
    return arms, comparisons, split


def page(report: dict) -> list:
    arms, comparisons, split = tables(report)
    cost = report["callback_cost"]
    probe = [r[whole_run.DIRECT]["trainer_us_per_step"] for r in cost["rounds"] if whole_run.DIRECT in r]
    return [
        Heading("train.py against transformers.Trainer"),
        Paragraph(
            f"Precision {report['precision']} (config {report['accelerate_config'] or 'none'}); flags "
            f"`{' '.join(report['train_args'])}`; {len(report['rounds'])} alternating rounds; same batches in both "
            f"trainers: **{'yes' if report['same_batches'] else 'NO'}** (non-padding tokens per logged interval); "
            f"verdicts: {bench.METHOD}."
        ),
        arms,
        comparisons,
        Paragraph(
            f"Goal: accelerate launch train.py >= {report['goal']}x the Trainer in every round: "
            f"{'met' if report['meets_goal'] else 'not met'}."
        ),
        split,
        Paragraph(
            "Under the Trainer, `optimizer` holds its loss bookkeeping (a NaN check that waits for the device), "
            "clipping, the step and the schedule; `data` the wait for each accumulation window's batches "
            "(docs/instrument.md#hf-trainer)."
        ),
        Heading("What trainscope's callback costs a Trainer script's whole run", level=2),
        Paragraph(f"{cost['what']}: `{' '.join(cost['arms_run']['TrainscopeCallback'])}`."),
        *whole_run.tables([cost]),
        whole_run.method([cost], report["warm_rounds"]),
        Paragraph(
            "The direct figure: the callback's own calls, a Trainer of near-empty steps (a 5-weight model on batches of "
            f"the same shape) with and without the callback in {ALONE_BLOCKS} alternating blocks a round, one child a "
            f"round; the probe Trainer's own step {statistics.median(probe):.0f} us."
            if probe
            else ""
        ),
        Paragraph("" if torch.cuda.is_available() else "GPU: not measured on GPU."),
    ]


def main() -> None:
    parser = bench.driver_parser(__doc__, ROOT / "benchmarks" / "trainer_peer", "--trainer")
    parser.add_argument(
        "--precision",
        default="fp32",
        choices=["fp32", "bf16", "fp16"],
        help="precision of both (train.py gets the matching Accelerate config)",
    )
    parser.add_argument("--with-callback", action="store_true", help=argparse.SUPPRESS)  # a child's
    parser.add_argument("--callback-alone", action="store_true", help=argparse.SUPPRESS)  # a child: the direct figure
    parser.add_argument(
        "--cost-steps", type=int, default=COST_STEPS, help=f"steps of each callback-cost run (default {COST_STEPS})"
    )
    parser.add_argument(
        "--cost-pairs",
        type=int,
        default=COST_PAIRS,
        help=f"alternating rounds of the callback's cost (default {COST_PAIRS})",
    )
    parser.add_argument(
        "--warm-rounds", type=int, default=1, help="callback-cost rounds run first, not counted (default 1)"
    )
    args, train_args = parser.parse_known_args()
    if args.trainer:
        return trainer_loop(train_args, args.precision, args.with_callback)
    if args.callback_alone:
        return callback_alone(train_args)
    if args.pairs < 1 or args.cost_pairs < 1 or args.warm_rounds < 0:
        parser.error("--pairs and --cost-pairs must be at least 1, --warm-rounds at least 0")
    if (("cuda" if torch.cuda.is_available() else "cpu"), args.precision) not in CONFIG_FOR:
        parser.error(f"{args.precision} cannot run on this device")
    report = measure(args, train_args)
    bench.publish(Path(args.out), report, markdown(page(report)))
    print(
        "median speed-ups: " + ", ".join(f"{k} {v['median_ratio']:.3f}" for k, v in report["comparisons"].items()),
        file=sys.stderr,
    )
    whole_run.exit_if_failed([report["callback_cost"]])


if __name__ == "__main__":
    main()
