"""What trainscope costs a script's whole run (trainscope.experiments.benchmarks.whole_run): train.py against its bare
loop (train.py's run less its instruments: `--bare`), examples/causal_lm.py against itself with
`--without-trainscope`, with trainscope.Run's own calls timed around near-empty steps as the direct figure.

    python -m trainscope.experiments.benchmarks.overhead [--pairs 11] [--warm-rounds 1] [--scripts train loop]
        [--modes events sync memory-every-step direct] [train.py flags]

Writes benchmarks/timing_overhead.{json,md}; exits 1 where a direct figure lies outside the rounds' interval.
How it works: docs/benchmarks.md#in-the-code-how-make-bench-overhead-compares-trainscopeexperimentsbenchmarksoverheadpy."""

import argparse
import dataclasses
import json
import tempfile
import time
from pathlib import Path

import torch

from trainscope.core import launching
from trainscope.core.paths import ROOT
from trainscope.experiments.benchmarks import short_run, whole_run
from trainscope.measure import bench
from trainscope.measure.timing import HostClock, synchronizer
from trainscope.report.document import Heading, Paragraph, markdown
from trainscope.workload.settings import parse_settings

# The embedded tiny model (2 layers, hidden 32): steps of a few milliseconds, the host-bound regime of a small model on a
# GPU, where the instruments' own host work is the largest share of a step it can be. One thread: that regime's host is
# one Python thread, and a pool of two on ops this small adds only its wake-ups, which spread samples/s in either arm
# (as measured: docs/benchmarks.md#committed-results).
TRAIN_ARGS = ["--threads", "1", "--model", "embedded:tiny-bert", "--per-device-batch-size", "16", "--max-seq-length",
              "64", *short_run(samples=16000, steps=1000, warmup=20)]  # fmt: skip
# The causal LM example (the embedded tiny GPT-2) as its README line runs it, shortened: its steps of about 0.15 s on a
# 2-core CPU are a user's model, not a probe; its fixed costs are what this arm shows.
LOOP_ARGS = ["--steps", "120", "--batch-size", "8", "--seq-length", "64", "--max-texts", "4000", "--log-every", "10"]


MODES = ("events", "sync", "memory-every-step", "direct")
WITH = {"events": [], "sync": ["--timing", "sync"], "memory-every-step": ["--memory-every", "1"]}


def scripts(train_args: list[str], modes=MODES) -> dict:
    """The scripts measured: train.py (on a GPU with each timing clock in `modes`, and per-stage memory read every
    step; on a CPU the host clock) and a trainscope.Run loop; the direct figures where `modes` has "direct"."""
    module, direct = ["-m", "trainscope.experiments.benchmarks.overhead"], "direct" in modes
    train = {whole_run.BASELINE: [*module, "--bare", *train_args]}
    for mode in [m for m in WITH if m in modes] if torch.cuda.is_available() else ["events"]:
        train[" ".join(["train.py", *WITH[mode]])] = [str(launching.TRAIN_SCRIPT), *train_args, *WITH[mode]]
    loop, alone = str(ROOT / "examples" / "causal_lm.py"), [*module, "--alone"]
    loop_steps = int(LOOP_ARGS[LOOP_ARGS.index("--steps") + 1])
    return {
        "train": whole_run.Script(
            "train.py", "train.py on the embedded tiny model against its bare loop", launching.accelerate_launch(),
            train, warmup=parse_settings(argv=train_args)[0].timing_warmup_steps,
            direct=[*alone, *train_args] if direct else None, records=tuple(list(train)[1:]),
        ),
        "loop": whole_run.Script(
            "a Run loop", "examples/causal_lm.py (the embedded tiny GPT-2) against itself with --without-trainscope",
            [launching.PYTHON], {whole_run.BASELINE: [loop, *LOOP_ARGS, "--without-trainscope"], "trainscope.Run":
                                 [loop, *LOOP_ARGS]},
            warmup=10 if loop_steps > 20 else 1, records=("trainscope.Run",),
            direct=[*alone, "--per-device-batch-size", "8", "--max-seq-length", "64", "--log-every", "10",
                    "--max-steps", "1000", "--threads", "auto"] if direct else None,
        ),
    }  # fmt: skip


BARE_REFUSES = {  # work train.py does inside its loop that a loop without trainscope has no part of
    "save_every": "--save-every (checkpoints inside the timed window)",
    "resume": "--resume (a continued run)",
    "predict": "--predict (nothing is trained)",
}


def bare_loop(argv: list[str]) -> None:
    """train.py's run without its instruments: train.py's own start-up, set-up (trainscope.classifier.build_training)
    and step (trainscope.workload.step.train_step), unmeasured; prints the steady window's training samples/s,
    samples and optimizer steps as JSON."""
    from trainscope import classifier as task  # deferred: it loads transformers' models and datasets

    (settings,) = parse_settings(argv=argv)
    refused = [flag for name, flag in BARE_REFUSES.items() if getattr(settings, name)]
    if refused:
        raise SystemExit(f"error: the bare loop has no counterpart of {', '.join(refused)}: leave it out")
    with tempfile.TemporaryDirectory() as scratch:  # start() names a run folder; the bare loop writes none
        started = task.start(dataclasses.replace(settings, output_dir=scratch, run_name="bare", overwrite=False))
        settings = started.settings  # --max-seq-length clamped to the model's limit, as train.py's
        tokenizer = task.build_tokenizer(settings)
        data = task.load_classification_data(settings, tokenizer, started.state.main_process_first)
        training = task.build_training(settings, started, tokenizer, data)
        total = training.plan["optimizer_steps"]
        if settings.timing_warmup_steps >= total:
            raise SystemExit(
                f"error: --timing-warmup-steps {settings.timing_warmup_steps} leaves none of the {total} optimizer "
                "steps to time"
            )
        samples, wall = bare_train(task, settings, training)
    print(json.dumps({"samples_per_s": samples / wall, "threads": torch.get_num_threads(), "samples": samples,
                      "optimizer_steps": total - settings.timing_warmup_steps, "train_wall_s": wall}))  # fmt: skip


def bare_train(task, settings, training) -> tuple[int, float]:
    """train.py's loop and evaluations, unmeasured: (the training samples after the warm-up steps, the seconds they
    took less the evaluations', timed as train.py's phase boundaries: the device's work done, then the host clock)."""
    accelerator, model, metric = training.accelerator, training.model, task.load_metric()
    now = HostClock(synchronizer(accelerator.device)).mark
    warmup, total = settings.timing_warmup_steps, training.plan["optimizer_steps"]
    step, samples, evaluation_s = 0, 0, 0.0
    window_started = now() if warmup == 0 else None

    def evaluate(loader) -> None:
        nonlocal evaluation_s
        began = now()
        task.evaluate_split(model, loader, accelerator, metric)
        if window_started is not None:  # train.py times it as `eval` and takes it out of the steady phase
            evaluation_s += now() - began

    model.train()
    for epoch in range(training.plan["epochs"]):
        training.train_loader.set_epoch(epoch)
        batches = iter(training.train_loader)
        while step < total and (batch := next(batches, None)) is not None:
            in_window = window_started is not None
            _, labels = task.train_step(
                accelerator, model, batch, training.optimizer, training.scheduler, task.unmeasured,
                settings.max_grad_norm,
            )  # fmt: skip
            samples += labels.shape[0] if in_window else 0
            if accelerator.sync_gradients:
                step += 1
                if step == warmup:
                    window_started = now()
        evaluate(training.validation_loader)
        if step >= total:
            break
    evaluate(training.test_loader)
    return samples, now() - window_started - evaluation_s


def instruments_alone(argv: list[str]) -> None:
    """The second instrument, direct: trainscope.Run's own time per optimizer step, its calls around steps that do
    next to nothing (batches of train.py's shape already in memory, a forward of a 5-weight model and an optimizer
    step with no gradients, so that its forward and step hooks run), over --max-steps steps with train.py's
    --log-every and --threads; prints microseconds per step as JSON. What train.py's instruments add to a step (with
    those two calls' microsecond: an upper bound), without taking the difference of two noisy totals."""
    import torch
    from accelerate import Accelerator

    from trainscope.instrument import Run  # deferred: it loads accelerate and torch's distributed modules

    (settings,) = parse_settings(argv=argv)
    if settings.threads.isdigit():
        torch.set_num_threads(int(settings.threads))
    accelerator = Accelerator()
    model = accelerator.prepare(torch.nn.Linear(4, 1))
    # torch's own SGD, not Accelerate's wrapper (its step looks lomo_optim up on every call, as the bare loop's does):
    # what is timed here is trainscope's own work (its step hook), not Accelerate's
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    steps, shape = settings.max_steps or 1000, (settings.per_device_batch_size, settings.max_seq_length)
    mask = torch.ones(shape, dtype=torch.long)
    mask[: shape[0] // 2, shape[1] // 2 :] = 0  # half the sequences padded, as a classifier's batches are
    batch = {"input_ids": torch.zeros(shape, dtype=torch.long), "attention_mask": mask}
    features = torch.zeros(1, 4)
    with tempfile.TemporaryDirectory() as scratch:
        run = Run(accelerator, model, optimizer, steps=steps, name="alone", output_dir=scratch, flops=0,
                  log_every=settings.log_every, threads="launcher")  # fmt: skip
        with run:
            began = time.perf_counter()
            for each in run.data([batch] * steps):
                with run.stage("forward"):
                    loss = model(features).sum()  # the forward pre-hook's call (a 5-weight model: about a microsecond)
                with run.stage("backward"):
                    pass
                with run.stage("optimizer"):
                    optimizer.step()  # the step hook's call, which ends the step (SGD without gradients: a no-op)
                run.count_micro_batch(each, loss)
            elapsed = time.perf_counter() - began
    print(json.dumps({"us_per_step": elapsed / steps * 1e6, "threads": torch.get_num_threads(), "steps": steps}))


def page(report: dict) -> list:
    found = report["scripts"]
    directs = [
        Paragraph(
            f"{script['script']}'s direct figure: trainscope.Run's own calls around near-empty steps (a forward of a "
            "5-weight model and an optimizer step, so that its forward and step hooks run, on batches of the script's "
            f"shape, its --log-every and threads), one child a round: {script['direct']['us_per_step']['median']:.1f} us "
            f"a step ({script['direct']['us_per_step']['min']:.1f}-{script['direct']['us_per_step']['max']:.1f}), "
            f"{script['direct']['share']:+.2%} of the steady step without trainscope."
        )
        for script in found
        if script["direct"]
    ]
    return [
        Heading("What trainscope costs the whole run (make bench-overhead)"),
        Paragraph(f"Status: {report['status']}." if report.get("status") else ""),
        Paragraph(
            "; ".join(f"{script['script']}: {script['what']}" for script in found)
            + f". train.py flags: `{' '.join(report['train_args'])}`, both by `accelerate launch --num_processes 1`; "
            f"the loop: `python examples/causal_lm.py {' '.join(LOOP_ARGS)}`. The bare loop is train.py's run less its "
            "instruments: the same start-up, set-up (trainscope.classifier.build_training), step "
            "(trainscope.workload.step.train_step) and evaluations."
        ),
        *whole_run.tables(found),
        whole_run.method(found, report["warm_rounds"]),
        *directs,
        Paragraph(
            "" if torch.cuda.is_available() else "GPU (the sync clock, per-stage memory every step): not measured."
        ),
    ]


def options() -> argparse.ArgumentParser:
    made = bench.driver_parser(__doc__, ROOT / "benchmarks" / "timing_overhead", "--bare", pairs=11)  # 98.8%
    made.add_argument("--alone", action="store_true", help=argparse.SUPPRESS)  # a child: the instruments alone
    made.add_argument("--warm-rounds", type=int, default=1, help="rounds run first and not counted (default 1)")
    made.add_argument("--scripts", nargs="+", default=["train", "loop"], choices=["train", "loop"],
                        help="the scripts measured (default both)")  # fmt: skip
    made.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES,
                        help="on a GPU, train.py's arms: its timing clocks (events, sync) and per-stage memory read "
                        "every step; and the direct figures (direct). Default: all; on a CPU the host clock")  # fmt: skip
    return made


def main() -> None:
    parser = options()
    args, train_args = parser.parse_known_args()
    if args.bare:
        return bare_loop(train_args)
    if args.alone:
        return instruments_alone(train_args)
    if args.pairs < 1 or args.warm_rounds < 0:
        parser.error("--pairs must be at least 1 and --warm-rounds at least 0")
    train_args = [*TRAIN_ARGS, *train_args]
    header = {"benchmark": "timing_overhead", "benchmark_version": 5, "train_args": train_args,
              "warm_rounds": args.warm_rounds}  # fmt: skip  # 5: the whole run's verdict, with and without trainscope
    done: list = []

    def partial(found: dict) -> None:  # the rounds so far, replaced by the next round's and the final results
        report = {
            **header,
            "scripts": [*done, found],
            "status": f"partial: {len(found['rounds'])} of {args.pairs} rounds",
        }
        bench.write_results(Path(args.out), report, markdown(page(report)))

    with tempfile.TemporaryDirectory() as scratch:
        runner = whole_run.launcher(Path(scratch))
        for name in args.scripts:
            script = scripts(train_args, args.modes)[name]
            done.append(whole_run.measure(script, args.pairs, args.warm_rounds, runner, on_round=partial))
    report = {**header, "scripts": done}
    bench.publish(Path(args.out), report, markdown(page(report)))
    whole_run.exit_if_failed(done)


if __name__ == "__main__":
    main()
