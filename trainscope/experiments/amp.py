"""make amp-compare: the same run in fp32 and in mixed precision (fp16 on GPUs, bf16 on a CPU), whole runs in
alternating rounds (trainscope.measure.bench, like every other comparison): speed judged over the rounds' runs, loss
curves of the first round's (one W&B group), accuracy and peak memory per arm.

Speed is never judged from the logged intervals of one run: the intervals of one run share its process, its
memory layout and whatever else ran beside it, so they are not independent measurements; a comparison with
fewer than bench.MIN_PAIRS rounds says "too few pairs" and gives no verdict."""

from pathlib import Path

from trainscope.core.record_view import RunView
from trainscope.core.results_view import results_machine
from trainscope.experiments.base import Experiment, arms_headline, experiment, planned_arm, runs_option, speed_cells
from trainscope.measure import bench
from trainscope.report import sections
from trainscope.report.sections import Headline
from trainscope.report.tables import Table, num, pyplot


def arguments(parser) -> None:
    runs_option(parser, rounds=bench.MIN_PAIRS, config=None)
    parser.add_argument("--configs", nargs="+", default=["cpu", "bf16"], help="configs; the first is the baseline")
    parser.add_argument("--group", default=None, help="W&B group of every run (default: amp)")


def run(args, train_args: list[str]) -> dict:
    arms = [planned_arm(config, config, ["--tracker-group", args.group or "amp"]) for config in args.configs]
    return experiment(Path(args.runs), "amp", arms, train_args, args.rounds)


def section(report, found: sections.Collected) -> None:
    """One part per machine: each CPU's alternating rounds (its folder), then each GPU's single runs (make
    gpu-check's results: one run per precision, an observation)."""
    folders, gpu = cpu_folders(found), gpu_runs(found)
    if not report.begin(EXPERIMENT.title, folders or gpu, EXPERIMENT.missing()):
        return
    for folder, machine in folders:
        report.part(
            f"Measured on {machine.text}" if machine else folder.name, {machine: [folder.name]} if machine else {}
        )
        rounds_part(report, folder)
    for path, machine, rows in gpu:
        report.part(f"Measured on {machine.text} ({path})", {machine: [path]} if machine else {})
        gpu_part(report, path, rows)


def cpu_folders(found: sections.Collected) -> list[tuple]:
    """(folder, its machine) of each make amp-compare kept: its own folder and those kept beside it (amp_<suffix>)."""
    out = []
    for folder in sections.folders_of(found, EXPERIMENT):
        if folder.comparison is None or not folder.runs or EXPERIMENT.unreadable_folder(folder):
            continue
        machines = sections.machines(folder.runs.items())
        out.append((folder, next(iter(machines)) if len(machines) == 1 else None))
    return out


def gpu_runs(found: sections.Collected) -> list[tuple]:
    """(results file, its machine, the precision checks that ran to their end) of each make gpu-check kept."""
    out = []
    for path, checks in sorted(found.gpu_checks.items()):
        rows = [
            c
            for c in checks.get("checks", [])
            if c.get("name", "").startswith("precision-") and c.get("exit") == 0 and c.get("throughput")
        ]
        if rows:
            out.append((path, results_machine(checks), rows))
    return out


def rounds_part(report, folder) -> None:
    comparison, runs = folder.comparison, folder.runs
    records = sections.first_round_runs(comparison, runs)
    figure, axis = pyplot().subplots(figsize=(7, 4))
    for name, record in records.items():
        steps, losses = RunView(record).losses
        axis.plot(steps, losses, marker=".", label=f"{name} ({RunView(record).precision})")
    axis.set_xlabel("optimizer step")
    axis.set_ylabel("training loss")
    axis.grid(alpha=0.3)
    axis.legend()
    report.figure(
        figure,
        f"amp_loss_{folder.name}",
        "Training loss, FP32 and mixed precision (first round)",
        list(records.values()),
    )
    rows = [
        [
            r["arm"],
            r.get("precision", "-"),
            num(r.get("validation_accuracy"), 4),
            num(r.get("test_accuracy"), 4),
            num(r.get("samples_per_s"), 1),
            num(r.get("peak_memory_gib")),
            *speed_cells(r),
        ]
        for r in sections.arm_rows(comparison)
    ]
    rounds = comparison.get("rounds", 1)
    report.table(
        Table(
            f"Mixed precision vs FP32 ({rounds} alternating round{'s' * (rounds != 1)} of whole runs, "
            "same seed, steps and threads; medians)",
            ["config", "precision", "val acc", "test acc", "samples/s", "peak GiB", "speed vs fp32", "verdict"],
            rows,
            f"amp_{folder.name}",
            align="llrrrrrl",
        )
    )
    few = [
        name
        for name, against in comparison["comparisons"].items()
        if against.get("speed") and against["speed"]["pairs"] < bench.MIN_PAIRS
    ]
    if few:
        report.text(
            f"{', '.join(f'`{n}`' for n in few)} against `{comparison['baseline']}`: too few pairs for a "
            f"verdict ({rounds} round{'s' * (rounds != 1)} of whole runs; a verdict needs {bench.MIN_PAIRS}, as "
            f"`{EXPERIMENT.target}` runs)."
        )


GPU_CLAIM = (
    "One run per precision (make gpu-check, each run a check of the GPU path): a ratio of two single runs is an "
    "observation, not a verdict, since one run each measures no noise. At batch 32 x 128 tokens the step is bound by "
    "the host (the MFU column: a few percent of the tensor-core peak), so the ratio says what this model at this "
    "size gets from the precision, not what the precision's peak would give a model that fills the GPU."
)


def gpu_part(report, path: str, rows: list[dict]) -> None:
    report.table(
        Table(
            f"One run per precision ({path})",
            ["check", "precision", "samples/s", "tokens/s", "MFU on real tokens", "peak GiB"],
            [
                [
                    c["name"],
                    c["name"].removeprefix("precision-"),
                    num(c["throughput"]["samples_per_s"], 1),
                    num(c["throughput"].get("tokens_per_s"), 0),
                    mfu_on_real_tokens(c),
                    num(((c.get("memory") or {}).get("max_allocated_gib") or {}).get("max")),
                ]
                for c in rows
            ],
            f"amp_{path.replace('/', '_').removesuffix('.json').replace('.', '_')}",
            align="llrrrr",
        )
    )
    report.text(GPU_CLAIM)


def mfu_on_real_tokens(check: dict) -> str:
    """The run's MFU on real tokens (the counted MFU less its padding share), or '-'."""
    mfu, padding = check.get("mfu"), (check.get("throughput") or {}).get("padding_flops_share")
    if mfu is None:
        return "-"
    return f"{mfu * (1 - (padding or 0)):.2%}"


def gpu_observation(rows: list[dict]) -> str:
    """'bf16 802.5 samples/s against fp32's 535.8 (1.50 times)': each precision against fp32 (or bf16 where no fp32
    ran), one run each."""
    speed = {c["name"].removeprefix("precision-"): c["throughput"]["samples_per_s"] for c in rows}
    base = "fp32" if "fp32" in speed else "bf16" if "bf16" in speed else None
    if base is None or len(speed) < 2:
        return "; ".join(f"{name} {num(value, 1)} samples/s" for name, value in speed.items())
    return "; ".join(
        f"{name} {num(value, 1)} samples/s against {base}'s {num(speed[base], 1)} ({value / speed[base]:.2f} times)"
        for name, value in speed.items()
        if name != base
    )


def emulated(folder) -> bool:
    return any("bf16_emulated" in (arm.get("warnings") or []) for arm in folder.comparison["arms"].values())


def headline(found: sections.Collected):
    """Per machine: a CPU's mixed-precision speed against fp32 over its rounds, as its table gives it (with its runs'
    warnings); a GPU's single runs, as an observation."""

    answers = {}
    for folder, machine in cpu_folders(found):
        comparison = folder.comparison

        def warned(name: str, against: dict, comparison=comparison) -> str:
            warnings = comparison["arms"][name].get("warnings")
            return f" (warned: {', '.join(warnings)})" if warnings else ""

        answers.setdefault(machine, arms_headline(comparison, folder.runs, warned))
    for path, machine, rows in gpu_runs(found):
        answers.setdefault(
            machine, Headline(f"one run each ({path}): {gpu_observation(rows)}", "an observation: one run each")
        )
    if not answers:
        return None
    return answers if len(answers) > 1 else next(iter(answers.values()))


def answer(found: sections.Collected) -> list[sections.Answer] | None:
    """Mixed precision against fp32 in words: first where it means something (a CPU with native bf16, a GPU), then
    a CPU that emulates bf16, said as such."""
    native, emulating = [], []
    for folder, machine in cpu_folders(found):
        for name, against in folder.comparison["comparisons"].items():
            if not against.get("speed"):
                continue
            arm, base = folder.comparison["arms"][name], folder.comparison["arms"][folder.comparison["baseline"]]
            accuracy = ""
            if arm.get("test_accuracy") and base.get("test_accuracy"):
                accuracy = (
                    f"; test accuracy {arm['test_accuracy']['median']:.3f} against "
                    f"{base['test_accuracy']['median']:.3f} (runs too short to judge learning)"
                )
            said = f"{arm.get('precision', name)} autocast trained " + sections.ratio_words(against["speed"], "fp32")
            if emulated(folder):
                emulating.append(
                    sections.Answer(
                        f"Where bf16 is emulated in software (no AVX512-BF16 or AMX), {said}: it says "
                        "nothing of bf16 on other hardware",
                        machine,
                    )  # fmt: skip
                )
            else:
                native.append(sections.Answer(said + accuracy, machine))
    seen = {}  # a GPU's results files in one sentence: each file one run per precision
    for _, machine, rows in gpu_runs(found):
        seen.setdefault(machine, []).append(gpu_observation(rows))
    gpus = [
        sections.Answer(
            f"On a GPU, one run per precision in each check: {'; in another: '.join(observed)}; observations "
            "without an interval, at a size where the host bounds the step",
            machine,
        )
        for machine, observed in seen.items()
    ]
    return [*native, *gpus, *emulating] or None


EXPERIMENT = Experiment(
    name="amp",
    title="Mixed precision vs FP32",
    target="make amp-compare",
    folder="amp",
    section=section,
    headline=headline,
    arguments=arguments,
    run=run,
    help="fp32 and mixed precision: whole runs in alternating rounds",
    one_machine=False,
    kept_beside=True,
    sources=lambda found: [
        *((name, record) for folder, _ in cpu_folders(found) for name, record in folder.runs.items()),
        *((path, found.gpu_checks[path]) for path, _, _ in gpu_runs(found)),
    ],
    question="Mixed precision against FP32: faster, and at what cost?",
    answer=answer,
)
