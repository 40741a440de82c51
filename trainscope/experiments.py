"""Experiments made of train.py runs, each arm launched by the README's command, in alternating rounds.

    python -m trainscope.experiments compare --runs runs/ckpt --config cpu --arm off= \\
        --arm on=--gradient-checkpointing --rounds 5 -- [train.py flags]
    python -m trainscope.experiments matrix --runs runs/matrix --variants cpu ddp cpu+ckpt --rounds 5 -- [flags]
    python -m trainscope.experiments batch-sweep --config cpu --runs runs/batch --batch-sizes 8 16 32 -- [flags]
    python -m trainscope.experiments amp --runs runs/amp --configs cpu bf16 -- [flags]
    python -m trainscope.experiments profile --runs runs/profile --config cpu -- [flags]

Every arm gets the same seed, data, steps and launcher; rounds alternate the order of the arms
(trainscope.bench), and each comparison with the first arm (the baseline) is a median of per-round
ratios with min-max and a verdict. A config that cannot run here (a 2-process DDP config with one
GPU) is skipped with its reason; a run that was planned and fails stops the experiment with a
non-zero exit. Each writes <runs>/comparison.{json,md} with provenance; the report reads them.
"""

import argparse
import json
import shlex
import sys
from dataclasses import dataclass, field
from pathlib import Path

from trainscope import batch_search, bench, launching
from trainscope.errors import UserError
from trainscope.records import read_record, read_steps
from trainscope.summary import peak_memory

SWITCHES = {"ckpt": ["--gradient-checkpointing"], "compile": ["--compile"], "lora": ["--lora"],
            "events": ["--timing", "events"], "sync": ["--timing", "sync"], "tf32": ["--tf32"]}
SMALL_EVAL = ["--max-eval-samples", "64", "--max-test-samples", "64"]
COMMUNICATION_FIGURES = ("exposed_s", "exposed_share", "total_allreduce_s", "overlap", "bus_bandwidth_gbs",
                         "allreduces_per_optimizer_step", "allreduce_bytes_per_step", "gradient_bytes")
# The DDP settings `make ddp-cost` compares with DDP's defaults (25 MB buckets, no flags, no compression).
DDP_SETTINGS = {"default": [], "bucket1": ["--ddp-bucket-cap-mb", "1"], "bucket5": ["--ddp-bucket-cap-mb", "5"],
                "bucket100": ["--ddp-bucket-cap-mb", "100"], "bucket_view": ["--ddp-gradient-as-bucket-view"],
                "static_graph": ["--ddp-static-graph"], "fp16_hook": ["--ddp-comm-hook", "fp16"],
                "bf16_hook": ["--ddp-comm-hook", "bf16"]}


class ExperimentFailed(Exception):
    """A planned run failed: the experiment stops and says which and why."""


@dataclass
class Arm:
    name: str
    config: str | None
    flags: list = field(default_factory=list)
    skipped: str | None = None  # why this arm cannot run here
    launcher: str = "accelerate"
    script: Path = launching.TRAIN_SCRIPT


# ---------------------------------------------------------------- running arms in rounds


def run_arm(arm: Arm, train_args: list[str], runs: Path, round_index: int) -> dict:
    """One train.py run of an arm; its record's headline figures."""
    name = f"{arm.name}-r{round_index}"
    on_cpu = launching.plan(arm.config).on_cpu if arm.config else None
    result = launching.run_training([*train_args, *arm.flags, "--output-dir", str(runs), "--run-name", name,
                                     "--overwrite"], config=arm.config, launcher=arm.launcher,
                                    env=launching.training_env(on_cpu), script=arm.script)
    if result.returncode != 0:
        raise ExperimentFailed(f"{name} ({arm.config or 'no config'} {' '.join(arm.flags)}) failed: "
                               f"{launching.failure_reason(result)}")
    return headline(read_record(runs / name))


def headline(record: dict) -> dict:
    """The figures an experiment compares, from one run record."""
    summary = record["summary"]
    validation = summary["validation"][-1] if summary["validation"] else {}
    peak, kind = peak_memory(summary["memory"])
    communication = summary.get("communication") or {}
    return {"run": record["run_name"], "wall_s": summary["wall_s"], "samples_per_s": summary["throughput"]["samples_per_s"],
            "communication": {k: communication.get(k) for k in COMMUNICATION_FIGURES} if communication.get("measured") else None,
            "tokens_per_s": summary["throughput"]["tokens_per_s"], "step_s": summary["throughput"]["step_s"],
            "peak_memory_gib": peak, "memory_kind": kind, "test_accuracy": summary["test"]["accuracy"],
            "validation_accuracy": validation.get("accuracy"), "validation_loss": validation.get("loss"),
            "precision": record["environment"]["effective_precision"], "world_size": summary["world_size"],
            "warnings": [w["code"] for w in record.get("warnings", [])]}


def run_rounds(arms: list[Arm], train_args: list[str], runs: Path, rounds: int) -> dict:
    """Every runnable arm once per round, alternating order; the figures of each run, by arm."""
    runnable = [arm for arm in arms if arm.skipped is None]
    by_name = {arm.name: arm for arm in runnable}
    measured = bench.alternate({arm.name: (lambda i, arm=arm: run_arm(arm, train_args, runs, i)) for arm in runnable},
                               rounds)
    return {name: [r[name] for r in measured] for name in by_name}


def summarize(arms: list[Arm], results: dict, baseline: str) -> dict:
    """Per arm: spreads of its figures; per other arm: speed ratios to the baseline with a verdict."""
    summary = {"baseline": baseline, "arms": {}, "comparisons": {}}
    for arm in arms:
        entry = {"config": arm.config, "flags": arm.flags}
        if arm.skipped:
            summary["arms"][arm.name] = {**entry, "status": "skipped", "reason": arm.skipped}
            continue
        rows = results[arm.name]
        entry.update(status="complete", runs=[r["run"] for r in rows], precision=rows[0]["precision"],
                     world_size=rows[0]["world_size"], memory_kind=rows[0]["memory_kind"],
                     warnings=sorted({w for r in rows for w in r["warnings"]}))
        for metric in ("samples_per_s", "tokens_per_s", "step_s", "peak_memory_gib", "test_accuracy",
                       "validation_accuracy"):
            values = [r[metric] for r in rows if r[metric] is not None]
            entry[metric] = bench.spread(values) if values else None
        summary["arms"][arm.name] = entry
    if baseline in results:
        for name, rows in results.items():
            if name != baseline:
                speed = [r["samples_per_s"] / b["samples_per_s"] for r, b in zip(rows, results[baseline])]
                memory = [r["peak_memory_gib"] / b["peak_memory_gib"] for r, b in zip(rows, results[baseline])]
                summary["comparisons"][name] = {"speed": bench.compare(speed), "memory_ratio": bench.spread(memory)}
    return summary


def write(runs: Path, experiment: str, summary: dict, train_args: list[str], rounds: int) -> None:
    report = {"experiment": experiment, "rounds": rounds, "train_args": train_args, **summary}
    lines = [f"# Experiment: {experiment}", "", f"train.py flags: `{shlex.join(train_args)}`; {rounds} alternating "
             "round(s); ratios are per round against the baseline arm.", "",
             "| arm | config + flags | samples/s (median, min-max) | speed vs baseline | verdict |",
             "|---|---|---:|---:|---|"]
    for name, arm in summary["arms"].items():
        if arm["status"] != "complete":
            lines.append(f"| {name} | {arm['config']} {' '.join(arm['flags'])} | skipped: {arm['reason']} | | |")
            continue
        speed = arm["samples_per_s"]
        comparison = summary["comparisons"].get(name, {}).get("speed")
        lines.append(f"| {name} | {arm['config']} {' '.join(arm['flags'])} | {speed['median']:.2f} "
                     f"({speed['min']:.2f}-{speed['max']:.2f}) | "
                     + (f"{bench.ratio_text(comparison)} | {comparison['verdict']} |" if comparison else "baseline | |"))
    bench.write_results(runs / "comparison", report, lines)


# ---------------------------------------------------------------- the experiments


def parse_variant(variant: str) -> Arm:
    """'bf16+ckpt+compile' -> Arm(config bf16, flags --gradient-checkpointing --compile), planned for here."""
    config, *switches = variant.split("+")
    unknown = [s for s in switches if s not in SWITCHES]
    if unknown:
        raise SystemExit(f"error: unknown switch(es) {unknown} in {variant!r}: choose from {', '.join(SWITCHES)}")
    if not launching.config_path(config).exists():
        raise SystemExit(f"error: no accelerate_configs/{config}.yaml for variant {variant!r}")
    plan = launching.plan(config)
    return Arm(variant, config, [flag for s in switches for flag in SWITCHES[s]], None if plan.runnable else plan.reason)


def parse_arm(text: str, config: str) -> Arm:
    """'on=--gradient-checkpointing --lora' -> Arm('on', config, [...])."""
    name, _, flags = text.partition("=")
    if not name:
        raise SystemExit(f"error: --arm takes NAME=FLAGS, got {text!r}")
    plan = launching.plan(config)
    return Arm(name, config, shlex.split(flags), None if plan.runnable else plan.reason)


def experiment(runs: Path, name: str, arms: list[Arm], train_args: list[str], rounds: int) -> dict:
    for arm in arms:
        if arm.skipped:
            print(f"skipped {arm.name}: {arm.skipped}", flush=True)
    results = run_rounds(arms, train_args, runs, rounds)
    summary = summarize(arms, results, arms[0].name)
    write(runs, name, summary, train_args, rounds)
    print((runs / "comparison.md").read_text())
    return summary


def interval_ratios(baseline_run: Path, other_run: Path) -> list[float]:
    """Speed of `other` over `baseline` per logged interval: the same optimizer steps, hence the same batches."""
    base = {line["step"]: line["wall_s"] for line in read_steps(baseline_run)}
    other = {line["step"]: line["wall_s"] for line in read_steps(other_run)}
    return [base[step] / other[step] for step in sorted(base.keys() & other.keys()) if other[step] > 0]


def amp(args, train_args: list[str]) -> dict:
    """One long run per precision (accuracy and loss curves, one W&B group); speed paired by log interval."""
    runs = Path(args.runs)
    group = args.group or "amp"
    arms = [Arm(config, config, ["--tracker-group", group], None if launching.plan(config).runnable
                else launching.plan(config).reason) for config in args.configs]
    summary = experiment(runs, "amp", arms, train_args, rounds=1)
    base = arms[0].name
    for arm in arms[1:]:
        if arm.skipped is None:
            ratios = interval_ratios(runs / f"{base}-r0", runs / f"{arm.name}-r0")
            summary["comparisons"][arm.name]["speed_by_interval"] = bench.compare(ratios) if ratios else None
    write(runs, "amp", summary, train_args, rounds=1)
    return summary


def profiler_overhead(default_run: Path, profiled_run: Path, window: dict) -> dict | None:
    """Profiled / unprofiled wall time of the traced steps (the same steps and batches in both runs)."""
    default = {line["step"]: line["wall_s"] for line in read_steps(default_run)}
    traced = {line["step"]: line["wall_s"] for line in read_steps(profiled_run)}
    steps = [s for s in range(window["first_step"], window["last_step"] + 1) if s in default and s in traced]
    if not steps:
        return None
    return {"steps": steps, **bench.spread([traced[s] / default[s] for s in steps]),
            "total_ratio": sum(traced[s] for s in steps) / sum(default[s] for s in steps)}


def profile(args, train_args: list[str]) -> dict:
    """The time breakdown from a run without the profiler, the top operators from one with it."""
    runs = Path(args.runs)
    flags = ["--log-every", "1"]
    arms = [Arm("default", args.config, flags), Arm("profiled", args.config, [*flags, "--profile"])]
    summary = experiment(runs, "profile", arms, train_args, rounds=1)
    window = read_record(runs / "profiled-r0")["summary"]["profile"]["window"]
    summary["profiler_overhead"] = profiler_overhead(runs / "default-r0", runs / "profiled-r0", window)
    write(runs, "profile", summary, train_args, rounds=1)
    return summary


def largest_fitting_batch(config: str, train_args: list[str], start: int) -> int:
    """The largest batch (halving from `start`) whose training steps fit in device memory, found in a child
    process launched with the config (its precision), so nothing stays allocated here. A multi-process
    config is refused before anything is launched (see trainscope.batch_search)."""
    batch_search.refuse_multi_process(config, launching.config_facts(launching.config_path(config))["num_processes"])
    command = [*launching.accelerate_launch(config), "-m", "trainscope.experiments", "find-batch",
               "--start", str(start), "--", *train_args]
    result = launching.run_captured(command, launching.training_env())
    if result.returncode != 0:
        raise ExperimentFailed(f"the batch-size search failed: {launching.failure_reason(result)}")
    return json.loads(result.stdout.strip().splitlines()[-1])["largest_batch"]


def find_batch(start: int, train_args: list[str]) -> None:
    """The child of `largest_fitting_batch`: batch_search.search halves the batch on every out-of-memory
    error; each try trains two steps on full-length (worst-case) sequences."""
    import dataclasses

    import torch
    from accelerate import Accelerator

    from trainscope import startup
    from trainscope.loop import train_step
    from trainscope.modeling import build_model, build_optimizer, build_scheduler, build_tokenizer
    from trainscope.settings import parse_settings

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
            batch = {"input_ids": torch.randint(1000, 2000, shape, device=accelerator.device),
                     "attention_mask": torch.ones(shape, dtype=torch.long, device=accelerator.device),
                     "labels": torch.zeros(batch_size, dtype=torch.long, device=accelerator.device)}
            train_step(accelerator, model, batch, optimizer, scheduler, _untimed, trial.max_grad_norm)
        del model, optimizer, scheduler

    print(json.dumps({"largest_batch": batch_search.search(two_steps, start)}))


def _untimed(stage: str):
    import contextlib

    return contextlib.nullcontext()


def batch_sweep(args, train_args: list[str]) -> dict:
    """Samples/s and peak memory against the batch size, the user's batch as the baseline arm."""
    from trainscope.settings import parse_settings

    (user,) = parse_settings(argv=train_args)
    largest = None
    if launching.cuda_devices() and args.search_from:
        largest = largest_fitting_batch(args.config, [*train_args, *SMALL_EVAL], args.search_from)
        print(f"largest batch that fits (halving from {args.search_from}): {largest}")
    sizes = sorted(args.batch_sizes, key=lambda b: (b != user.per_device_batch_size, b))
    arms = [Arm(f"bs{b}", args.config, ["--per-device-batch-size", str(b), "--gradient-accumulation-steps", "1",
                                        "--max-steps", str(args.steps), "--log-every", str(args.steps)],
                f"above the largest batch that fits ({largest})" if largest and b > largest else None) for b in sizes]
    summary = experiment(Path(args.runs), "batch", arms, [*train_args, *SMALL_EVAL], args.rounds)
    summary.update(largest_fitting_batch=largest, search=(
        "find_executable_batch_size, halving" if largest is not None
        else "no device-memory limit to search on a CPU: the largest swept batch stands"),
        recommendation=recommend(summary, user.per_device_batch_size * user.gradient_accumulation_steps))
    write(Path(args.runs), "batch", summary, [*train_args, *SMALL_EVAL], args.rounds)
    return summary


def recommend(summary: dict, effective_batch: int) -> dict:
    """Fastest batch (with its verdict against the baseline), and the fastest that keeps the user's
    effective batch through gradient accumulation."""
    fitted = {int(n[2:]): a for n, a in summary["arms"].items() if a["status"] == "complete"}
    if not fitted:
        return {}
    fastest = max(fitted, key=lambda b: fitted[b]["samples_per_s"]["median"])
    comparison = summary["comparisons"].get(f"bs{fastest}", {}).get("speed")
    result = {"fastest_batch_size": fastest, "fastest_verdict": comparison["verdict"] if comparison else "baseline",
              "largest_swept_that_fits": max(fitted), "effective_batch": effective_batch}
    dividing = [b for b in fitted if effective_batch % b == 0]
    if dividing:
        keep = max(dividing, key=lambda b: fitted[b]["samples_per_s"]["median"])
        result.update(keep_effective_batch_size=keep, gradient_accumulation_steps=effective_batch // keep,
                      flags=f"--per-device-batch-size {keep} --gradient-accumulation-steps {effective_batch // keep}")
    return result


def ddp_cost(args, train_args: list[str]) -> dict:
    """DDP's settings against its defaults: step time, exposed communication, the best setting here."""
    from trainscope.communication import INTERCONNECTS, ring_allreduce_seconds

    runs = Path(args.runs)
    names = args.settings or list(DDP_SETTINGS)
    plan = launching.plan(args.config)
    arms = [Arm(name, args.config, DDP_SETTINGS[name], None if plan.runnable else plan.reason)
            for name in (["default"] + [n for n in names if n != "default"])]
    for arm in arms:
        if arm.name == "bf16_hook" and plan.on_cpu and arm.skipped is None:
            arm.skipped = "gloo cannot all-reduce bf16 (the bf16 hook needs NCCL or XCCL)"
    summary = experiment(runs, "ddp_cost", arms, [*train_args, "--communication-samples", str(args.samples)], args.rounds)
    results = {arm.name: [headline(read_record(runs / run)) for run in summary["arms"][arm.name]["runs"]]
               for arm in arms if arm.skipped is None}
    summary["communication"] = {name: {k: bench.spread([r["communication"][k] for r in rows if r["communication"]])
                                       for k in COMMUNICATION_FIGURES if all(r["communication"] for r in rows)}
                                for name, rows in results.items()}
    faster = [n for n, c in summary["comparisons"].items() if c["speed"]["verdict"] == "faster"]
    best = max(faster, key=lambda n: summary["comparisons"][n]["speed"]["median_ratio"]) if faster else "default"
    summary["best"] = {"setting": best, "flags": DDP_SETTINGS[best],
                       "speed": summary["comparisons"].get(best, {}).get("speed")}
    measured = summary["communication"].get("default", {})
    if measured.get("total_allreduce_s"):
        world, size = launching.config_facts(launching.config_path(args.config))["num_processes"], measured["gradient_bytes"]["median"]
        seconds = measured["total_allreduce_s"]["median"]
        summary["ring_model"] = {"gradient_bytes": size, "world_size": world, "measured_s": seconds,
                                 "measured_bus_bandwidth_gbs": measured["bus_bandwidth_gbs"]["median"],
                                 "presets": {name: {"model_s": ring_allreduce_seconds(size, world, p["bandwidth_gbs"], p["latency_us"]),
                                                    "measured_over_model": seconds / ring_allreduce_seconds(
                                                        size, world, p["bandwidth_gbs"], p["latency_us"])}
                                             for name, p in INTERCONNECTS.items()}}
    write(runs, "ddp_cost", summary, train_args, args.rounds)
    return summary


def parser() -> argparse.ArgumentParser:
    root = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = root.add_subparsers(dest="command", required=True)
    compare = commands.add_parser("compare", help="arms of one config, in alternating rounds")
    compare.add_argument("--arm", action="append", required=True, help="NAME=train.py flags; the first is the baseline")
    matrix = commands.add_parser("matrix", help="train.py under each config and switch")
    matrix.add_argument("--variants", nargs="+", required=True,
                        help=f"config[+switch...], switches: {', '.join(SWITCHES)}; the first is the baseline")
    batch = commands.add_parser("batch-sweep", help="throughput and memory against batch size")
    batch.add_argument("--batch-sizes", type=int, nargs="+", default=[8, 16, 32, 64, 128], help="batch sizes")
    batch.add_argument("--steps", type=int, default=12, help="optimizer steps per run (2 of them timing warm-up)")
    batch.add_argument("--search-from", type=int, default=4096,
                       help="on a GPU, find the largest batch that fits by halving from this (0: skip); "
                       "single-process configs only")
    amp_parser = commands.add_parser("amp", help="fp32 and mixed precision: one long run each")
    amp_parser.add_argument("--configs", nargs="+", default=["cpu", "bf16"], help="configs; the first is the baseline")
    amp_parser.add_argument("--group", default=None, help="W&B group of both runs (default: amp)")
    profile_parser = commands.add_parser("profile", help="a run without and a run with the profiler")
    cost = commands.add_parser("ddp-cost", help="DDP settings against DDP's defaults: exposed communication, speed")
    cost.add_argument("--settings", nargs="+", choices=list(DDP_SETTINGS), help="settings (default: all)")
    cost.add_argument("--samples", type=int, default=5, help="communication calibration steps per run (default 5)")
    find = commands.add_parser("find-batch", help=argparse.SUPPRESS)
    find.add_argument("--start", type=int, required=True)
    for sub, rounds in ((compare, 5), (matrix, 5), (batch, 5), (amp_parser, None), (profile_parser, None), (cost, 5)):
        sub.add_argument("--runs", required=True, help="where the runs and comparison.{json,md} go")
        if sub is cost:
            sub.add_argument("--config", default="ddp", help="Accelerate config of the DDP runs (default ddp)")
        if sub in (compare, batch, profile_parser):
            sub.add_argument("--config", default="cpu", help="Accelerate config name or path")
        if rounds:
            sub.add_argument("--rounds", type=int, default=rounds, help=f"alternating rounds (default {rounds})")
    return root


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    ours, train_args = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    args = parser().parse_args(ours)
    if getattr(args, "rounds", 1) < 1 or (args.command == "batch-sweep" and (args.steps < 3 or min(args.batch_sizes) < 1)):
        parser().error("--rounds must be at least 1; batch sizes positive and --steps at least 3")
    commands = {
        "compare": lambda: experiment(Path(args.runs), Path(args.runs).name,
                                      [parse_arm(a, args.config) for a in args.arm], train_args, args.rounds),
        "matrix": lambda: experiment(Path(args.runs), "matrix", [parse_variant(v) for v in args.variants],
                                     train_args, args.rounds),
        "batch-sweep": lambda: batch_sweep(args, train_args),
        "amp": lambda: amp(args, train_args),
        "profile": lambda: profile(args, train_args),
        "ddp-cost": lambda: ddp_cost(args, train_args),
        "find-batch": lambda: find_batch(args.start, train_args),
    }
    try:
        commands[args.command]()
    except (ExperimentFailed, UserError) as error:
        print(f"error: {error}", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
