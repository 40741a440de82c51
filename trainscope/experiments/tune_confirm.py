"""make tune-confirm: make tune's final command against make train's, on the full make train job.

make tune decides on a 30-step proxy of the job; this runs the whole job both ways: make train's command (the
Makefile's TRAIN_ARGS, trackers off in both arms) and the same with make tune's kept flags and config, in
alternating rounds with paired seeds (round r: seed S + r in both arms, the data seed held). Speed: training
samples/s by the project's test (trainscope.measure.bench, one test, one look after the last round), the whole job's
wall time beside it; the result: two one-sided tests of the paired differences of test (and validation)
accuracy and loss at the margins make tune stated (trainscope.advice.judge.equivalent).

A full job takes about 3.5-4 minutes in fp32 on 2 CPU cores and about 3 tuned with --unpad (machine A of the
README: 5 rounds took 34 minutes); where bf16 is native and kept, a tuned job is about 1 minute.
"""

import json
import shlex
from pathlib import Path

from trainscope.advice.design import ACCURACY_MARGIN, LOSS_MARGIN, Design
from trainscope.advice.judge import equivalent, merge_flags
from trainscope.core import launching
from trainscope.core.errors import UserError
from trainscope.experiments.base import Arm, Experiment, run_arm, summarize
from trainscope.measure import bench
from trainscope.report.tables import Table

MIN_ROUNDS = 5
BASELINE, TUNED = "make-train", "make-tune"


def arguments(parser) -> None:
    parser.add_argument("--runs", required=True, help="where the runs and comparison.{json,md} go")
    parser.add_argument(
        "--rounds",
        type=int,
        default=MIN_ROUNDS,
        help=f"alternating rounds, one seed each (at least {MIN_ROUNDS}; default {MIN_ROUNDS}: about "
        "35 minutes on 2 CPU cores, a full job being ~4 min in fp32 and ~3 min tuned with --unpad)",
    )
    parser.add_argument("--config", default=None, help="make train's Accelerate config (default: none, as make train)")
    parser.add_argument(
        "--tune",
        default="runs/tune/comparison.json",
        help="make tune's result, whose final flags, config and margins are confirmed "
        "(default runs/tune/comparison.json)",
    )
    parser.add_argument(
        "--tuned-flags",
        default=None,
        help="the tuned train.py flags, stated instead of read from --tune, as one argument with '=' "
        "(e.g. --tuned-flags='--group-by-length')",
    )
    parser.add_argument("--tuned-config", default=None, help="the tuned Accelerate config, with --tuned-flags")
    parser.add_argument(
        "--accuracy-margin",
        type=float,
        default=None,
        help=f"equivalence margin of accuracy (default: make tune's, else {ACCURACY_MARGIN:g})",
    )
    parser.add_argument(
        "--loss-margin",
        type=float,
        default=None,
        help=f"equivalence margin of loss in nats (default: make tune's, else {LOSS_MARGIN:g})",
    )


def tuned_command(args) -> tuple[str | None, list[str], str | None, dict]:
    """(config, flags, mixed precision, make tune's design) of the command to confirm: stated, or make tune's final
    choice (its mixed precision is the launcher's --mixed_precision)."""
    if args.tuned_flags is not None or args.tuned_config is not None:
        return args.tuned_config or args.config, shlex.split(args.tuned_flags or ""), None, {}
    path = Path(args.tune)
    try:
        result = json.loads(path.read_text())
    except (OSError, ValueError) as error:
        raise UserError(
            f"no make tune result at {path} ({type(error).__name__}): run make tune first, or state the "
            "command with --tuned-flags/--tuned-config"
        ) from None
    if not isinstance(result, dict) or "final_flags" not in result:
        raise UserError(f"{path} is not a make tune result (no final_flags)")
    precision = result.get("final_mixed_precision")
    if not result["final_flags"] and not precision and result.get("final_config") == args.config:
        raise UserError(f"make tune kept no change ({path}): its final command is make train's, nothing to confirm")
    tuned_on = ["--tuned-on", result["tuned_on"]] if result.get("tuned_on") else []  # warns on another kind of machine
    return result.get("final_config"), list(result["final_flags"]) + tuned_on, precision, result.get("design") or {}


def run(args, train_args: list[str]) -> dict:
    if args.rounds < MIN_ROUNDS:
        raise UserError(
            f"--rounds must be at least {MIN_ROUNDS}: fewer cannot show a speed-up at 0.05 with room to spare"
        )
    if any(m is not None and m <= 0 for m in (args.accuracy_margin, args.loss_margin)):
        raise UserError("--accuracy-margin and --loss-margin must be positive")
    config, flags, precision, tune_design = tuned_command(args)
    design = Design(
        rounds=args.rounds,
        trials=1,
        seed=flag_value(train_args, "--seed", 42),
        data_seed=flag_value(train_args, "--data-seed", flag_value(train_args, "--seed", 42)),
        accuracy_margin=args.accuracy_margin or tune_design.get("accuracy_margin", ACCURACY_MARGIN),
        loss_margin=args.loss_margin or tune_design.get("loss_margin", LOSS_MARGIN),
    )
    runs = Path(args.runs)
    arms = [Arm(BASELINE, args.config, []), Arm(TUNED, config, flags, mixed_precision=precision)]
    print(
        f"design: {args.rounds} alternating rounds of the full job, seeds {design.seed}-"
        f"{design.seed + args.rounds - 1} (data seed {design.data_seed}); speed: {bench.METHOD} on training "
        f"samples/s, one look; same result: {design.to_dict()['equivalence']}",
        flush=True,
    )
    measured = bench.alternate(
        {arm.name: (lambda i, arm=arm: run_arm(arm, train_args, runs, i, design.flags(i))) for arm in arms}, args.rounds
    )
    results = {arm.name: [r[arm.name] for r in measured] for arm in arms}
    report = judge_confirm(design, arms, results)
    report.update(
        experiment="tune-confirm",
        rounds=args.rounds,
        train_args=train_args,
        design=design.to_dict(),
        commands={
            BASELINE: command(args.config, train_args),
            TUNED: command(config, merge_flags(train_args, flags), precision),
        },
        tune_result=None if args.tuned_flags is not None or args.tuned_config is not None else str(args.tune),
    )
    bench.write_results(runs / "comparison", report, markdown(report))
    print((runs / "comparison.md").read_text())
    return report


def judge_confirm(design: Design, arms: list[Arm], results: dict[str, list[dict]]) -> dict:
    """The arms' figures and the tuned command against make train's: speed (samples/s, the project's test), the
    whole job's wall time (descriptive) and the result's equivalence on the paired seeds."""
    summary = summarize(arms, results, BASELINE)
    base, tuned = results[BASELINE], results[TUNED]
    against = summary["comparisons"][TUNED]
    against["whole_job"] = bench.compare_samples(
        [r["wall_s"] for r in base], [r["wall_s"] for r in tuned], higher_is_better=False
    )
    against["equivalence"] = equivalent(design, base, tuned)
    return summary


def command(config: str | None, flags: list[str], precision: str | None = None) -> str:
    launch = [launching.config_argument(config)] if config else []
    launch += [f"--mixed_precision {precision}"] if precision else []
    return " ".join(["accelerate launch", *launch, "train.py", shlex.join(flags)])


def flag_value(flags: list[str], name: str, default: int) -> int:
    """The last value given to a train.py flag (argparse keeps the last), else the default."""
    values = [flags[i + 1] for i, flag in enumerate(flags[:-1]) if flag == name]
    try:
        return int(values[-1]) if values else default
    except ValueError:
        raise UserError(f"{name} must be a whole number, not {values[-1]!r}") from None


def tuned_what(comparison: dict) -> str:
    """What the tuned arm ran: make tune's final command (read from its result), or the command stated with
    --tuned-flags/--tuned-config (the result then names no make tune result)."""
    stated = "tune_result" in comparison and comparison["tune_result"] is None
    return "the command stated on its command line" if stated else "make tune's command"


def confirm_table(comparison: dict, label: str = "tune_confirm") -> Table:
    """make train against make tune's command (or a stated one) on the full job: speed, whole-job wall time, test
    accuracy with the equivalence test."""
    arms, against = comparison["arms"], comparison["comparisons"][TUNED]
    equivalence = against.get("equivalence") or {}
    rows = []
    for name in (BASELINE, TUNED):
        arm = arms[name]
        accuracy = arm.get("test_accuracy") or {}
        rows.append(
            [
                name,
                comparison.get("commands", {}).get(name, ""),
                _ranged(arm.get("samples_per_s"), 1),
                _ranged(accuracy, 4),
            ]
        )
    speed = against["speed"]
    metrics = equivalence.get("metrics", {})
    rows.append(
        [
            "make-tune / make-train",
            f"speed {bench.describe(speed)}; whole job {bench.ratio_text(against['whole_job'])}",
            f"{speed['median_ratio']:.3f}x",
            _equivalence_cell(metrics.get("test_accuracy"), equivalence),
        ]
    )
    return Table(
        f"The full make train job: make train against {tuned_what(comparison)} ({comparison['rounds']} "
        "alternating rounds, paired seeds)",
        ["arm", "command / comparison", "samples/s", "test accuracy"],
        rows,
        label,
        align="llrl",
    )


def _ranged(spread: dict | None, digits: int) -> str:
    if not spread:
        return "-"
    return f"{spread['median']:.{digits}f} ({spread['min']:.{digits}f}-{spread['max']:.{digits}f})"


def _equivalence_cell(entry: dict | None, equivalence: dict) -> str:
    if not entry:
        return "not measured"
    if entry["interval"] is None:
        return f"difference {entry['mean']:+.4f}: one seed, undecided"
    low, high = entry["interval"]
    return (
        f"difference {entry['mean']:+.4f}, 90% [{low:+.4f}, {high:+.4f}] against +-{entry['margin']:g}: "
        f"{entry['verdict']} ({len(equivalence.get('seeds', []))} seeds)"
    )


def markdown(report: dict) -> list[str]:
    against = report["comparisons"][TUNED]
    return [
        "# make tune-confirm",
        "",
        f"make train: `{report['commands'][BASELINE]}`",
        "",
        f"make tune's command: `{report['commands'][TUNED]}`",
        "",
        f"Design: {report['rounds']} alternating rounds, seeds {report['design']['seed']}-"
        f"{report['design']['seed'] + report['rounds'] - 1} (data seed {report['design']['data_seed']}); speed: "
        f"{bench.METHOD} on training samples/s, one look; same result: {report['design']['equivalence']}.",
        "",
        *confirm_table(report).markdown_lines(),
        "",
        f"Result over the paired seeds (every metric): {against['equivalence']['text']}",
    ]


EXPERIMENT = Experiment(
    name="tune-confirm",
    title="make tune on the full job",
    target="make tune-confirm",
    folder="tune_confirm",
    section=None,
    arguments=arguments,
    run=run,
    help="make tune's final command against make train's on the full job (about 35 min on 2 cores)",
    needs=("experiment", "arms", "comparisons", "commands"),
    kept_beside=True,
)
