"""make batch-sweep: samples/s and peak memory against the batch size, the largest batch that fits, the fastest,
and the accumulation that keeps the user's effective batch.

On a GPU the largest batch that fits is searched in a child process launched with the config (its
precision), so nothing stays allocated in the orchestrating process: `find-batch` is that child.
"""

import argparse
import json
from pathlib import Path

from trainscope.core import launching
from trainscope.experiments import batch_search
from trainscope.experiments.base import (
    Experiment,
    ExperimentFailed,
    arm_table,
    errors,
    experiment,
    planned_arm,
    runs_option,
    write,
)
from trainscope.measure import bench
from trainscope.report import sections
from trainscope.report.sections import Headline
from trainscope.report.tables import pyplot
from trainscope.workload.settings import parse_settings

SMALL_EVAL = ["--max-eval-samples", "64", "--max-test-samples", "64"]


def arguments(parser) -> None:
    runs_option(parser)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[8, 16, 32, 64, 128], help="batch sizes")
    parser.add_argument("--steps", type=int, default=12, help="optimizer steps per run (2 of them timing warm-up)")
    parser.add_argument(
        "--search-from",
        type=int,
        default=4096,
        help="on a GPU, find the largest batch that fits by halving from this (0: skip); single-process configs only",
    )


def run(args, train_args: list[str]) -> dict:
    """Samples/s and peak memory against the batch size, the user's batch as the baseline arm."""
    if args.steps < 3 or min(args.batch_sizes) < 1:
        raise ExperimentFailed("batch sizes must be positive and --steps at least 3")
    (user,) = parse_settings(argv=train_args)
    largest, predicted = largest_and_predicted(args, train_args, user)
    arms = batch_arms(args, user.per_device_batch_size, largest)
    summary = experiment(Path(args.runs), "batch", arms, [*train_args, *SMALL_EVAL], args.rounds)
    summary.update(
        largest_fitting_batch=largest,
        search=search_description(largest, predicted),
        predicted_largest_batch=predicted["batch"] if predicted else None,
        prediction_error=(predicted["batch"] - largest) / largest if predicted and largest else None,
        recommendation=recommend(summary, user.per_device_batch_size * user.gradient_accumulation_steps),
    )
    write(Path(args.runs), "batch", summary, [*train_args, *SMALL_EVAL], args.rounds)
    return summary


def largest_and_predicted(args, train_args: list[str], user) -> tuple[int | None, dict | None]:
    """(largest batch that fits, predicted largest batch), each printed when known: on a GPU both from the search's
    child (no CUDA context here while the runs use the GPU; neither with --search-from 0), on a CPU only the
    prediction, made here."""
    searching = launching.cuda_devices() and args.search_from
    largest, predicted = None, None
    if searching:
        found = largest_fitting_batch(args.config, [*train_args, *SMALL_EVAL], args.search_from)
        largest, predicted, start = found["largest_batch"], found.get("predicted"), found.get("start", args.search_from)
    elif not launching.cuda_devices():
        predicted = predicted_largest_batch(args.config, user)
    if predicted:
        print(
            f"predicted largest batch that fits: {predicted['batch']} (at length {predicted['length']}, "
            f"{predicted['capacity_bytes'] / 2**30:.1f} GiB)"
        )
    if searching:
        print(
            f"largest batch that fits ({'from the prediction, doubling or halving' if predicted else 'halving'} "
            f"from {start}): {largest}"
        )
    return largest, predicted


def batch_arms(args, user_batch: int, largest: int | None) -> list:
    """One arm per swept batch size, the user's first (the baseline); those above the largest that fits skipped."""
    sizes = sorted(args.batch_sizes, key=lambda b: (b != user_batch, b))
    flags = f"--gradient-accumulation-steps 1 --max-steps {args.steps} --log-every {args.steps}".split()
    arms = [planned_arm(f"bs{b}", args.config, ["--per-device-batch-size", str(b), *flags]) for b in sizes]
    for arm, b in zip(arms, sizes):
        if largest and b > largest and arm.skipped is None:
            arm.skipped = f"above the largest batch that fits ({largest})"
    return arms


def search_description(largest: int | None, predicted: dict | None) -> str:
    """How the largest batch that fits was found, for the summary."""
    if largest is None:
        return "no device-memory limit to search on a CPU: the largest swept batch stands"
    if predicted:
        return "from the predicted largest batch, doubling while it fits, else halving"
    return "find_executable_batch_size, halving"


def recommend(summary: dict, effective_batch: int) -> dict:
    """Fastest batch (with its verdict against the baseline), and the fastest that keeps the user's
    effective batch through gradient accumulation."""
    fitted = {int(n[2:]): a for n, a in summary["arms"].items() if a["status"] == "complete"}
    if not fitted:
        return {}
    fastest = max(fitted, key=lambda b: fitted[b]["samples_per_s"]["median"])
    comparison = summary["comparisons"].get(f"bs{fastest}", {}).get("speed")
    result = {
        "fastest_batch_size": fastest,
        "fastest_verdict": comparison["verdict"] if comparison else "baseline",
        "largest_swept_that_fits": max(fitted),
        "effective_batch": effective_batch,
    }
    dividing = [b for b in fitted if effective_batch % b == 0]
    if dividing:
        keep = max(dividing, key=lambda b: fitted[b]["samples_per_s"]["median"])
        result.update(
            keep_effective_batch_size=keep,
            gradient_accumulation_steps=effective_batch // keep,
            flags=f"--per-device-batch-size {keep} --gradient-accumulation-steps {effective_batch // keep}",
        )
    return result


def predicted_largest_batch(
    config: str | None, settings, device=None, precision_name: str | None = None
) -> dict | None:
    """The largest batch predicted to fit (trainscope.predict.largest_batch) at full-length sequences, as the search
    tries them, on this machine's device and in the config's precision (or the `device` and `precision_name` of the
    process asking: the search's child); None when it cannot be predicted."""
    import torch

    from trainscope import predict  # deferred: it loads transformers' models (through the predictor)
    from trainscope.workload.data import MODEL_INPUTS  # deferred: it loads datasets

    if device is None:
        facts = launching.config_facts(launching.config_path(config))
        device = torch.device("cuda" if torch.cuda.is_available() and not facts["use_cpu"] else "cpu")
        precision_name = predict.precision_from_environment(
            device, {"ACCELERATE_MIXED_PRECISION": facts["mixed_precision"]}
        )
    try:
        _, data = predict.data_for(settings)
        return predict.largest_batch(
            settings,
            data.label_names,
            [c for c in data.train.column_names if c in MODEL_INPUTS],
            device,
            precision_name,
            settings.max_seq_length,
            baseline_bytes=predict.current_rss_bytes() or 0 if device.type == "cpu" else 0,
        )
    except Exception as error:  # the sweep goes on with its own search
        print(f"no predicted largest batch: {' '.join(str(error).split())[:200]}")
        return None


def largest_fitting_batch(config: str, train_args: list[str], start: int) -> dict:
    """{largest_batch, predicted, start}: the largest batch whose training steps fit in device memory, found in a
    child process launched with the config (its precision), so nothing stays allocated here; the child first
    predicts the largest batch and searches from it, doubling or halving (from `start`, halving, where it cannot
    predict). A multi-process config is refused before anything is launched (see
    trainscope.experiments.batch_search)."""
    batch_search.refuse_multi_process(config, launching.config_facts(launching.config_path(config))["num_processes"])
    child = f"-m trainscope.experiments find-batch --start {start} --predict --".split()
    command = [*launching.accelerate_launch(config), *child, *train_args]
    result = launching.run_captured(command, launching.training_env())
    if result.returncode != 0:
        raise ExperimentFailed(f"the batch-size search failed: {launching.failure_reason(result)}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def find_batch(args, train_args: list[str]) -> None:
    """The child of `largest_fitting_batch`: batch_search.search halves the batch on every out-of-memory
    error; each try trains two steps on full-length (worst-case) sequences."""
    import dataclasses

    import torch
    from accelerate import Accelerator

    from trainscope import predict  # deferred: it loads transformers' models (through the predictor)
    from trainscope.run import startup  # deferred: it loads transformers' models
    from trainscope.workload.modeling import (  # deferred: it loads transformers' models
        build_model,
        build_optimizer,
        build_scheduler,
        build_tokenizer,
    )
    from trainscope.workload.step import train_step, unmeasured  # deferred: it loads transformers' models

    (settings,) = parse_settings(argv=train_args)
    startup.configure_process(settings)
    tokenizer = build_tokenizer(settings)
    accelerator = Accelerator()  # precision and device from the launch's config
    batch_search.refuse_multi_process("this launch", accelerator.num_processes)

    def two_steps(batch_size):
        accelerator.free_memory()
        trial = dataclasses.replace(settings, per_device_batch_size=batch_size)
        model, _ = build_model(trial, ["0", "1"], tokenizer)
        optimizer = build_optimizer(model, trial, accelerator.device)
        model, optimizer, scheduler = accelerator.prepare(model, optimizer, build_scheduler(trial, optimizer, 2, 0))
        shape = (batch_size, trial.max_seq_length)
        for _ in range(2):
            batch = {
                "input_ids": torch.randint(1000, 2000, shape, device=accelerator.device),
                "attention_mask": torch.ones(shape, dtype=torch.long, device=accelerator.device),
                "labels": torch.zeros(batch_size, dtype=torch.long, device=accelerator.device),
            }
            train_step(accelerator, model, batch, optimizer, scheduler, unmeasured, trial.max_grad_norm)
        del model, optimizer, scheduler

    if not args.predict:
        print(json.dumps({"largest_batch": batch_search.search(two_steps, args.start)}))
        return

    predicted = predicted_largest_batch(
        None, settings, accelerator.device, predict.precision_from_environment(accelerator.device)
    )
    start = predicted["batch"] if predicted and predicted["batch"] >= 1 else args.start
    largest = batch_search.search(two_steps, start, grow=bool(predicted))
    print(json.dumps({"largest_batch": largest, "predicted": predicted, "start": start}))


def find_batch_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--start", type=int, required=True)
    parser.add_argument(
        "--predict",
        action="store_true",
        help="predict the largest batch first and search from it, "
        "doubling or halving (the prediction made here, in the search's process)",
    )


def section(report, found: sections.Collected) -> None:
    comparison = found.comparisons.get(EXPERIMENT.name)
    if not report.begin(EXPERIMENT.title, comparison, EXPERIMENT.missing()):
        return
    rows = sorted(
        [r for r in sections.arm_rows(comparison) if r["status"] == "complete"], key=lambda r: int(r["arm"][2:])
    )
    if rows:
        figure, axis = pyplot().subplots(figsize=(7, 4))
        sizes = [int(r["arm"][2:]) for r in rows]
        axis.errorbar(
            sizes,
            [r["samples_per_s"] for r in rows],
            yerr=errors(rows, "samples_per_s"),
            marker="o",
            capsize=4,
            color="tab:blue",
        )
        axis.set_xscale("log", base=2)
        axis.set_xlabel("per-device batch size")
        axis.set_ylabel("samples/s (median, min-max)", color="tab:blue")
        twin = axis.twinx()
        twin.plot(sizes, [r["peak_memory_gib"] for r in rows], marker="s", color="tab:orange")
        twin.set_ylabel(f"peak memory GiB ({rows[0]['memory_kind']})", color="tab:orange")
        axis.set_ylim(bottom=0)
        twin.set_ylim(bottom=0)
        report.figure(
            figure,
            "batch",
            "Throughput and memory against batch size",
            list(sections.first_round_runs(comparison, found.runs.get(EXPERIMENT.name, {})).values()),
        )
    report.table(
        arm_table(
            comparison,
            f"Batch-size sweep ({comparison['rounds']} alternating rounds; baseline: the configured batch)",
            "batch",
        )
    )
    advice = comparison.get("recommendation") or {}
    predicted = comparison.get("predicted_largest_batch")
    report.text(
        f"Largest batch that fits: {largest(comparison)} ({comparison.get('search')})"
        + (
            f"; predicted {predicted}"
            + (f" ({comparison['prediction_error']:+.0%})" if comparison.get("prediction_error") is not None else "")
            if predicted is not None
            else ""
        )
        + ". Fastest: "
        f"{advice.get('fastest_batch_size')} ({advice.get('fastest_verdict')} against the baseline). Keeping "
        f"the effective batch of {advice.get('effective_batch')}: `{keeping(advice)}`."
    )


def largest(comparison: dict):
    advice = comparison.get("recommendation") or {}
    return comparison.get("largest_fitting_batch") or advice.get("largest_swept_that_fits")


def keeping(advice: dict) -> str:
    return advice.get("flags", "no swept batch divides it")


def headline(found: sections.Collected) -> Headline | None:
    """The fastest batch against the configured one (as the table gives it), the largest that fits, and the
    flags that keep the effective batch: the section's closing sentence."""
    comparison = found.comparisons.get(EXPERIMENT.name)
    if not comparison:
        return None
    advice = comparison.get("recommendation") or {}
    if not advice:
        return Headline("no batch size completed", "nothing compared")
    speed = (comparison["comparisons"].get(f"bs{advice['fastest_batch_size']}") or {}).get("speed")
    fastest = (
        f"{advice['fastest_batch_size']}, {bench.ratio_text(speed)} against the configured {comparison['baseline'][2:]}"
        if speed
        else f"the configured {advice['fastest_batch_size']}"
    )
    return Headline(
        f"fastest: {fastest}; largest that fits: {largest(comparison)}; keeping the effective batch of "
        f"{advice['effective_batch']}: `{keeping(advice)}`",
        advice["fastest_verdict"],
    )


EXPERIMENT = Experiment(
    name="batch-sweep",
    title="Batch size",
    target="make batch-sweep",
    folder="batch",
    section=section,
    headline=headline,
    arguments=arguments,
    run=run,
    help="throughput and memory against batch size",
)
FIND_BATCH = Experiment(
    name="find-batch",
    title="",
    target="",
    section=None,
    arguments=find_batch_arguments,
    run=find_batch,
    help=argparse.SUPPRESS,
)
