"""nn.DataParallel against DDP (compare_dp.py, `make compare-dp`): the rows, figure and tables its results
file gives, shared by the script (its own Markdown and LaTeX) and the report's section."""

from trainscope.core.results_view import machines_text, results_machine
from trainscope.experiments.base import Experiment, verdicts_text
from trainscope.measure import bench
from trainscope.report import sections
from trainscope.report.sections import Headline
from trainscope.report.tables import Table, num, pyplot, ranged

VARIANTS = (("single", "single device"), ("data_parallel", "nn.DataParallel"), ("ddp", "DDP"))


def rows(result: dict) -> list[dict]:
    """One row per variant (medians over rounds); a variant this machine cannot run says why."""
    out = []
    for name, label in VARIANTS:
        measured = result["results"][name]
        if measured.get("status") != "measured":
            out.append({"variant": label, "status": measured.get("reason", "not measured")})
            continue
        comparison = result["comparison"].get(name)
        speed = judged(result, name) if comparison else None
        out.append(
            {
                "variant": label,
                "runs_on": result["machine"]["hardware"].get(name, ""),
                "wall_s": measured["wall_s"]["median"],
                "samples_per_s": measured["samples_per_s"]["median"],
                "samples_per_s_min": measured["samples_per_s"]["min"],
                "samples_per_s_max": measured["samples_per_s"]["max"],
                "speed": bench.ratio_text(speed) if speed else "baseline",
                "speed_median": speed["median_ratio"] if speed else 1.0,
                "verdict": speed["verdict"] if speed else "",
                "efficiency": comparison["scaling_efficiency"] if comparison else 1.0,
                "peak_memory": ", ".join(f"{k} {v:.2f}" for k, v in measured["peak_memory_gib"].items()),
                "final_loss": measured["final_loss"],
            }
        )
    return out


def judged(result: dict, name: str) -> dict:
    """A variant's speed against the single device, judged by today's test from the per-round figures the
    results file keeps (the verdict it was written with when they are not there)."""
    rounds = {
        variant: [r["samples_per_s"] for r in result["results"][variant].get("rounds", [])]
        for variant in ("single", name)
    }
    if rounds["single"] and len(rounds["single"]) == len(rounds[name]):
        return bench.compare_samples(rounds["single"], rounds[name])
    return result["comparison"][name]["speed"]


def results_table(result: dict) -> Table:
    cells = []
    for row in rows(result):
        if "status" in row:
            cells.append([row["variant"], f"not measurable here: {row['status']}", "", "", "", "", "", ""])
            continue
        cells.append(
            [
                row["variant"],
                row["runs_on"],
                num(row["wall_s"]),
                ranged(row["samples_per_s"], (row["samples_per_s_min"], row["samples_per_s_max"]), 1),
                row["speed"],
                row["verdict"],
                num(row["efficiency"], 1, percent=True),
                num(row["final_loss"], 4),
            ]
        )
    return Table(
        f"DataParallel vs DDP on {result['machine']['device_name']} ({result['compare']['rounds']} alternating rounds)",
        ["variant", "runs on", "wall s", "samples/s", "speed vs single", "verdict", "scaling efficiency", "final loss"],
        cells,
        "compare_dp",
        align="llrrrlrr",
    )


def projection_table(result: dict) -> Table:
    cells = [
        [
            name,
            str(row["gpus"]),
            num(row["step_s"], 4),
            num(row["allreduce_s"], 4),
            num(row["samples_per_s"], 1),
            num(row["efficiency"], 1, percent=True),
        ]
        for name, preset in result["projection"]["interconnects"].items()
        for row in preset["rows"]
    ]
    return Table(
        "Projected DDP scaling",
        ["interconnect", "GPUs", "step s", "all-reduce s", "samples/s", "efficiency"],
        cells,
        "compare_dp_projection",
    )


def figure(result: dict):
    """Throughput per variant (median, min-max whiskers) and peak memory per device."""
    measured = [r for r in rows(result) if "status" not in r]
    drawn, (speed, memory) = pyplot().subplots(1, 2, figsize=(10, 3.8))
    medians = [r["samples_per_s"] for r in measured]
    errors = [
        [m - r["samples_per_s_min"] for m, r in zip(medians, measured)],
        [r["samples_per_s_max"] - m for m, r in zip(medians, measured)],
    ]
    speed.bar([f"{r['variant']}\n{r['runs_on']}" for r in measured], medians, yerr=errors, capsize=4, color="tab:blue")
    speed.set_ylabel("samples/s (median, min-max)")
    speed.set_title("throughput")
    speed.tick_params(axis="x", labelsize=7)
    labels, values = [], []
    for name, _ in VARIANTS:
        variant = result["results"][name]
        if variant.get("status") == "measured":
            for device, gib in variant["peak_memory_gib"].items():
                labels.append(f"{name}\n{device}")
                values.append(gib)
    memory.bar(labels, values, color="tab:orange")
    memory.set_ylabel("peak memory (GiB)")
    memory.set_title("per device")
    memory.tick_params(axis="x", labelsize=7)
    missing = [name for name, variant in result["results"].items() if variant.get("status") != "measured"]
    if missing:
        speed.set_xlabel(f"not measurable here: {', '.join(missing)}", fontsize=8)
    drawn.tight_layout()
    return drawn


def headline(found: sections.Collected) -> Headline | None:
    """Each variant's speed against the single device, as the results table gives it."""
    result = found.results.get("data_parallel")
    if not result:
        return None
    parts, verdicts = [], {}
    for row in rows(result):
        if "status" in row:
            parts.append(f"{row['variant']}: not measurable here")
        elif row["verdict"]:
            parts.append(f"{row['variant']} ({row['runs_on']}) against the single device: {row['speed']}")
            verdicts[row["variant"]] = row["verdict"]
    return Headline("; ".join(parts), verdicts_text(verdicts) if verdicts else "nothing compared")


def answer(found: sections.Collected) -> list[sections.Answer] | None:
    """DataParallel against DDP, in words: what could be measured here, and why the rest needs GPUs."""
    result = found.results.get("data_parallel")
    if not result:
        return None
    hardware, parts = result["machine"]["hardware"], []
    for row in rows(result):
        if "status" in row and row["variant"].startswith("nn.DataParallel"):
            parts.append(
                "nn.DataParallel could not run here: it splits each batch over several GPUs inside one process "
                f"({row['status']}), so it needs a machine with 2 GPUs or more"
            )
    ddp = result["comparison"].get("ddp")
    if ddp:
        parts.append(
            f"DDP on {hardware.get('ddp', 'several processes')} trained "
            + sections.ratio_words(judged(result, "ddp"), f"one process ({hardware.get('single', 'the same cores')})")
            + ": both sides had the same cores, so this is DDP's cost of "
            "communication and bookkeeping, not the speed-up separate devices would give; that, and DataParallel "
            "beside it, needs a multi-GPU machine (`make compare-dp` there)"
        )
    return [sections.Answer(". ".join(parts), results_machine(result))] if parts else None


def section(report, found: sections.Collected) -> None:
    result = found.results.get("data_parallel")
    if not report.begin(EXPERIMENT.title, result, EXPERIMENT.missing()):
        return
    report.text(result["machine"]["hardware"]["note"])
    report.figure(figure(result), "compare_dp", "Throughput and per-device memory")
    report.table(results_table(result))
    reconcile_with_matrix(
        report, result, found.comparisons.get("matrix"), sections.machines(found.runs.get("matrix", {}).items())
    )
    for diff in result["code_changes"]:
        report.text(
            f"From `single_device` to `{diff['to']}`: {diff['changed_lines']} changed lines "
            f"(+{diff['added']} -{diff['removed']})."
        )
        report.code(diff["diff"], "diff")
    report.text(result["projection"]["assumptions"])


def reconcile_with_matrix(report, result: dict, matrix: dict | None, matrix_machines: dict) -> None:
    """compare_dp.py and `make matrix` both ask what DDP gives here: show both answers and why they differ, where
    one machine measured both (else say that they are not set side by side)."""
    ddp = result["comparison"].get("ddp")
    against = ((matrix or {}).get("comparisons") or {}).get("ddp", {}).get("speed")
    if not (ddp and against):
        return
    mine = results_machine(result)
    if set(matrix_machines) != {mine}:
        report.text(
            f"`make matrix` also compares DDP with one process, measured on "
            f"{machines_text(matrix_machines) if matrix_machines else 'a machine its runs do not name'}, not "
            f"on {mine.text if mine else 'the machine of this comparison'}: its answer is not set beside this one."
        )
        return
    report.text(
        f"The same question twice: compare_dp.py's bare loops put DDP at {bench.describe(judged(result, 'ddp'))}; "
        f"`make matrix` (train.py, `ddp` against `{matrix['baseline']}`) at {bench.describe(against)}. Both give "
        "the two sides the same cores; they differ in what they time: compare_dp.py times the loop alone "
        "(no Accelerate, dropout off, a fixed global batch split over the processes), the matrix times "
        "train.py's steady steps with the per-process batch kept (each DDP step trains twice the samples)."
    )


EXPERIMENT = Experiment(
    name="data_parallel",
    title="DataParallel vs DDP",
    target="make compare-dp",
    results="compare_dp/compare_dp.json",
    section=section,
    headline=headline,
    question="DataParallel against DistributedDataParallel?",
    answer=answer,
    needs=("benchmark", "machine", "compare", "results", "comparison", "code_changes", "projection"),
)
