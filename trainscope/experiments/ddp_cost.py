"""make ddp-cost: what DDP communication costs here, and which bucket size, flag or compression hook hides it: each
setting against DDP's defaults (no communication hook) in alternating rounds; what is measured: docs/ddp.md."""

from pathlib import Path

from trainscope.core import launching
from trainscope.core.communication_view import COMMUNICATION_FIGURES, exposed_above_transfer
from trainscope.core.record_view import RunView
from trainscope.core.records import read_record
from trainscope.experiments.base import Experiment, experiment, planned_arm, runs_option, speed_cells, write
from trainscope.measure import bench
from trainscope.measure.communication.measured import INTERCONNECTS, ring_allreduce_seconds
from trainscope.report import sections
from trainscope.report.sections import Headline
from trainscope.report.tables import Table, num, pyplot, ranged

# The DDP settings compared with DDP's defaults (25 MB buckets, no flags, no communication hook).
SETTINGS = {
    "default": [],
    "bucket1": ["--ddp-bucket-cap-mb", "1"],
    "bucket5": ["--ddp-bucket-cap-mb", "5"],
    "bucket100": ["--ddp-bucket-cap-mb", "100"],
    "bucket_view": ["--ddp-gradient-as-bucket-view"],
    "static_graph": ["--ddp-static-graph"],
    "fp16_hook": ["--ddp-comm-hook", "fp16"],
    "bf16_hook": ["--ddp-comm-hook", "bf16"],
}
# the figures of each setting its rows keep
PICKED = "exposed_s exposed_share transfer_s hidden_share overlap ddp_exposed_s ddp_overlap bus_bandwidth_gbs".split()


def arguments(parser) -> None:
    runs_option(parser, config="ddp")
    parser.add_argument("--settings", nargs="+", choices=list(SETTINGS), help="settings (default: all)")
    parser.add_argument(
        "--samples",
        type=int,
        default=5,
        help="times each bucket's all-reduce is timed alone after training, per run (default 5)",
    )


def run(args, train_args: list[str]) -> dict:
    runs = Path(args.runs)
    names = args.settings or list(SETTINGS)
    arms = [
        planned_arm(name, args.config, SETTINGS[name]) for name in ["default"] + [n for n in names if n != "default"]
    ]
    for arm in arms:
        if arm.name == "bf16_hook" and launching.plan(args.config).on_cpu and arm.skipped is None:
            arm.skipped = "on the CPU: DDP takes the bf16 hook only from a CUDA (NCCL 2.10+) or XPU build of torch"
    summary = experiment(
        runs, "ddp_cost", arms, [*train_args, "--communication-samples", str(args.samples)], args.rounds
    )
    records = {run: read_record(runs / run) for arm in summary["arms"].values() for run in arm.get("runs", [])}
    summary["communication"] = setting_figures(summary, records)
    faster = [n for n, c in summary["comparisons"].items() if c["speed"]["verdict"] == "faster"]
    best = max(faster, key=lambda n: summary["comparisons"][n]["speed"]["median_ratio"]) if faster else "default"
    summary["best"] = {
        "setting": best,
        "flags": SETTINGS[best],
        "speed": summary["comparisons"].get(best, {}).get("speed"),
    }
    summary["ring_model"] = ring_model(summary["communication"].get("default", {}), args.config)
    write(runs, "ddp_cost", summary, train_args, args.rounds)
    return summary


def aggregate(rows: list[dict | None]) -> dict:
    """One setting's communication over its rounds (rows: RunView.headline()'s communication figures): every
    figure as {median, min, max, n} where every round has it; the exposed time only where every round resolved it,
    else the range its rounds allow; how many rounds' instruments agreed."""
    rows = [r for r in rows if r]
    out = {
        k: bench.spread([r[k] for r in rows])
        for k in COMMUNICATION_FIGURES
        if rows and all(r.get(k) is not None for r in rows)
    }
    intervals = [r["exposed_interval"] for r in rows if r.get("exposed_interval")]
    out["rounds"], out["resolved_rounds"] = len(rows), sum(1 for r in rows if r.get("resolved"))
    out["exposed_range"] = [max(0.0, min(i[0] for i in intervals)), max(i[1] for i in intervals)] if intervals else None
    out["verdicts"] = [r.get("agreement") for r in rows]
    out["method"] = rows[0].get("method") if rows else None
    return out


def ring_model(measured: dict, config: str) -> dict | None:
    """The measured transfer against the ring model's time for the same bytes with compare_dp.py's presets."""
    transfer = measured.get("transfer_s")
    if not transfer or not measured.get("allreduce_bytes_per_step") or not measured.get("bus_bandwidth_gbs"):
        return None
    world = launching.config_facts(launching.config_path(config))["num_processes"]
    size, seconds = measured["allreduce_bytes_per_step"]["median"], transfer["median"]
    presets = {}
    for name, p in INTERCONNECTS.items():
        model = ring_allreduce_seconds(size, world, p["bandwidth_gbs"], p["latency_us"])
        presets[name] = {"model_s": model, "measured_over_model": seconds / model}
    return {
        "gradient_bytes": size,
        "world_size": world,
        "measured_s": seconds,
        "measured_bus_bandwidth_gbs": measured["bus_bandwidth_gbs"]["median"],
        "presets": presets,
    }


def setting_figures(comparison: dict, runs: dict) -> dict:
    """arm -> its communication over rounds: from the runs' own records where they are all here (so the figures
    are read by today's rules, schema 3 estimates included), else as the comparison wrote them."""
    found = {}
    for name, arm in comparison["arms"].items():
        if arm["status"] != "complete":
            continue
        if all(run in runs for run in arm["runs"]):
            found[name] = aggregate([RunView(runs[run]).headline()["communication"] for run in arm["runs"]])
        else:
            found[name] = comparison.get("communication", {}).get(name, {})
    return found


def rows(comparison: dict, runs: dict | None = None) -> list[dict]:
    """One row per DDP setting: step time, its verdict against DDP's defaults, the communication figures."""
    figures = setting_figures(comparison, runs or {})
    out = []
    for row in sections.arm_rows(comparison):
        if row["status"] != "complete":
            out.append({"setting": row["arm"], "flags": row["flags"], "skipped": row["reason"]})
            continue
        found = figures.get(row["arm"], {})
        pick = lambda key, found=found: found[key]["median"] if key in found else None
        rounds = found.get("rounds") or 0
        out.append(
            {
                "setting": row["arm"],
                "flags": row["flags"],
                "step_s": row["step_s"],
                "step_s_range": row["step_s_range"],
                "speed": row["speed"],
                "resolved": bool(rounds) and found.get("resolved_rounds") == rounds,
                "resolved_rounds": found.get("resolved_rounds") or 0,
                "exposed_range": found.get("exposed_range"),
                "rounds": rounds,
                "method": found.get("method"),
                "verdicts": found.get("verdicts") or [],
                **{key: pick(key) for key in PICKED},
            }
        )
    return out


def stacked(row: dict) -> dict | None:
    """A setting's step split into the rest, the transfer hidden behind backward, and exposed communication
    (seconds, median over rounds); None where the exposed time is not resolved."""
    if not row["resolved"] or row["exposed_s"] is None or not row["step_s"]:
        return None
    exposed = row["exposed_s"]
    hidden = min(max(0.0, (row["transfer_s"] or 0.0) - exposed), max(0.0, row["step_s"] - exposed))
    return {"rest": max(0.0, row["step_s"] - exposed - hidden), "hidden": hidden, "exposed": exposed}


def figure(comparison: dict, runs: dict, default_record: dict | None):
    """Per setting, a step stacked as the rest / the transfer hidden behind backward / exposed communication
    (medians over rounds; a setting whose exposed time is not resolved is one hatched bar); per rank of the
    defaults' first round, the communication's exposure and the wait for the last rank to arrive."""
    measured = [r for r in rows(comparison, runs) if "skipped" not in r and r["step_s"]]
    drawn, (steps, ranks) = pyplot().subplots(1, 2, figsize=(10, 3.8), gridspec_kw={"width_ratios": [3, 2]})
    names = [r["setting"] for r in measured]
    parts = [stacked(r) for r in measured]
    rest = [p["rest"] if p else 0.0 for p in parts]
    hidden = [p["hidden"] if p else 0.0 for p in parts]
    exposed = [p["exposed"] if p else 0.0 for p in parts]
    if any(parts):
        steps.bar(names, rest, label="the rest of the step (no transfer beside it)", color="tab:blue")
        steps.bar(names, hidden, bottom=rest, label="transfer hidden behind backward", color="tab:green")
        steps.bar(
            names, exposed, bottom=[a + b for a, b in zip(rest, hidden)], label="exposed communication", color="tab:red"
        )
    unresolved = [r["step_s"] if p is None else 0.0 for r, p in zip(measured, parts)]
    if any(unresolved):
        steps.bar(
            names, unresolved, label="step; communication not resolved", color="none", edgecolor="tab:gray", hatch="//"
        )
    steps.set_ylabel("seconds per optimizer step (median)")
    steps.tick_params(axis="x", labelsize=7)
    steps.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.1), ncol=2)
    figures = RunView(default_record).communication_figures if default_record else None
    per_rank = (figures or {}).get("per_rank") or []
    if per_rank and figures.get("resolved"):
        labels = [f"rank {r['rank']}" for r in per_rank]
        ranks.bar(labels, [figures["exposed_s"]] * len(per_rank), label="exposed communication", color="tab:red")
        ranks.bar(
            labels,
            [r["wait_s"] for r in per_rank],
            bottom=[figures["exposed_s"]] * len(per_rank),
            label="wait for the last rank to arrive",
            color="tab:orange",
        )
        ranks.set_ylabel("seconds per step, median (defaults)")
        ranks.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.1))
    else:
        ranks.text(
            0.5,
            0.5,
            "per rank: not measured per step\n(" + ((figures or {}).get("method") or "no record") + ")",
            ha="center",
            va="center",
            fontsize=8,
            transform=ranks.transAxes,
        )
        ranks.set_axis_off()
    drawn.tight_layout()
    return drawn


def exposed_cell(row: dict) -> str:
    """The exposed time as a physical figure: the median over rounds where every round resolved it, else the
    range the rounds allow (never below 0)."""
    if row["resolved"]:
        return num(row["exposed_s"] * 1e3, 1)
    if row["exposed_range"]:
        low, high = row["exposed_range"]
        return f"not resolved: {low * 1e3:.0f}-{high * 1e3:.0f}"
    return "n/a"


def agreement_cell(row: dict) -> str:
    """How many rounds' exposed time agreed with DDP's logger on the same iterations."""
    verdicts = [v for v in row["verdicts"] if v]
    if not verdicts:
        return "not compared" + (" (schema 3: other steps)" if row["method"] and "schema 3" in row["method"] else "")
    return f"{verdicts.count('agree')} of {row['rounds']} agree"


def settings_table(comparison: dict, runs: dict | None = None) -> Table:
    cells = []
    for r in rows(comparison, runs):
        if "skipped" in r:
            cells.append([r["setting"], r["flags"], f"skipped: {r['skipped']}", "", "", "", "", "", "", "", "", ""])
            continue
        ms = lambda v: num(v * 1e3, 1) if v is not None else "n/a"  # noqa: E731
        cells.append(
            [
                r["setting"],
                r["flags"],
                ranged(r["step_s"], r["step_s_range"], 3),
                *speed_cells(r),
                exposed_cell(r),
                ms(r["ddp_exposed_s"]),
                agreement_cell(r),
                ms(r["transfer_s"]),
                num(r["hidden_share"] if r["resolved"] else None, 0, percent=True),
                num(r["overlap"], 0, percent=True),
                num(r["ddp_overlap"], 0, percent=True),
            ]
        )
    columns = ["setting", "flags", "s/step", "speed vs default", "verdict", "exposed ms", "DDP's exposed ms",
               "agreement", "transfer ms", "hidden", "overlap", "DDP's overlap"]  # fmt: skip
    return Table(
        f"DDP settings against DDP's defaults ({comparison['rounds']} alternating rounds)",
        columns,
        cells,
        "ddp_cost",
        align="llrrlrrlrrrr",
    )


def section(report, found: sections.Collected) -> None:
    comparison, runs = found.comparisons.get(EXPERIMENT.name), found.runs.get(EXPERIMENT.name, {})
    if not report.begin(EXPERIMENT.title, comparison and runs, EXPERIMENT.missing()):
        return
    records = sections.first_round_runs(comparison, runs)
    if "default" in records:
        report.text(summary_text(RunView(records["default"])))
    report.text(agreement_text(rows(comparison, runs)))
    report.figure(
        figure(comparison, runs, records.get("default")),
        "ddp_cost",
        "Where a DDP step goes, per setting; the exposure and the wait per rank",
        list(records.values()),
    )
    report.table(settings_table(comparison, runs))
    report.text(f"Best setting here: {best_text(comparison.get('best') or {})}.")
    ring = comparison.get("ring_model")
    if ring:
        report.text(
            f"The measured all-reduce of {ring['gradient_bytes'] / 1e6:.1f} MB over {ring['world_size']} processes "
            f"took {ring['measured_s'] * 1e3:.1f} ms ({ring['measured_bus_bandwidth_gbs']:.2f} GB/s); the ring "
            "model with compare_dp.py's presets predicts "
            + ", ".join(
                f"{name} {p['model_s'] * 1e3:.2f} ms (measured {p['measured_over_model']:.0f}x)"
                for name, p in ring["presets"].items()
            )
            + ". `compare_dp.py --ddp-cost` projects with the measured bandwidth beside the presets."
        )


def agreement_text(setting_rows: list[dict]) -> str:
    """Per setting, whether the exposed time agreed with DDP's logger on the same iterations, and whether it was
    resolved at all: computed from the rows the table shows."""
    parts = []
    for r in setting_rows:
        if "skipped" in r:
            continue
        parts.append(
            f"`{r['setting']}` {agreement_cell(r)}, exposed time resolved in {r['resolved_rounds']} of "
            f"{r['rounds']} rounds"
        )
    return (
        "Per setting, trainscope's per-step exposed time against DDP's own logger on the iterations DDP sampled "
        "(agree: the 95% interval of the median paired difference within +-max(30%, 15 ms)): "
        + "; ".join(parts)
        + ". Runs measured by the two-pass estimate of schema 3 are not compared (the instruments sampled other "
        "steps) and their exposed time is shown only where its interval resolves it."
    )


def hidden_text(figures: dict) -> str:
    """How much of the transfer hides behind backward: a share, contention (the exposed time's whole interval above
    the transfer), or not resolved (the transfer inside that interval)."""
    interval = figures.get("exposed_interval")
    if figures.get("hidden_share") is not None:
        return f", so {figures['hidden_share']:.0%} of the transfer hides behind backward"
    if exposed_above_transfer(interval, figures.get("transfer_s")):
        return ", less than the exposed time (backward waited for more than the transfer: contention)"
    return (
        f", inside the exposed time's interval ({interval[0] * 1e3:.1f}-{interval[1] * 1e3:.1f} ms): how much "
        "of it hides is not resolved"
    )


def summary_text(view: RunView) -> str:
    """The defaults' first round in words, each number the one its figure shows."""
    figures = view.communication_figures
    if not figures or not figures.get("measured"):
        return "DDP's defaults, first round: communication not measured."
    head = f"Where a DDP step goes with DDP's defaults ({figures['world_size']} processes, first round, {figures['method']}): "
    transfer = figures.get("transfer_s")
    text = step_text(view)
    if figures["resolved"]:
        if transfer:
            text += (
                f"; the same buckets' all-reduces alone take {transfer * 1e3:.1f} ms"
                + (
                    f" ({figures['bus_bandwidth_gbs']:.2f} GB/s bus bandwidth)"
                    if figures.get("bus_bandwidth_gbs")
                    else ""
                )
                + hidden_text(figures)
            )
        if figures.get("overlap") is not None:
            text += f"; the compute overlaps {figures['overlap']:.0%} of the communication window"
    if figures.get("ddp_exposed_s") is not None:
        text += (
            f". DDP's own logger, over its steady iterations, puts the exposed part at "
            f"{figures['ddp_exposed_s'] * 1e3:.1f} ms and its overlap at {figures['ddp_overlap']:.0%}"
            + (f" ({figures['agreement']} on the same iterations)" if figures.get("agreement") else "")
        )
    return head + text + "."


def best_text(best: dict) -> str:
    return f"`{best.get('setting')}`" + (
        f" (`{' '.join(best['flags'])}`), {bench.describe(best['speed'])}"
        if best.get("speed")
        else ": no setting was faster than DDP's defaults outside noise"
    )


def headline(found: sections.Collected) -> Headline | None:
    """What communication costs a step with DDP's defaults (the section's first sentence) and the best setting."""
    comparison, runs = found.comparisons.get(EXPERIMENT.name), found.runs.get(EXPERIMENT.name, {})
    if not (comparison and runs):
        return None
    default = sections.first_round_runs(comparison, runs).get("default")
    view = RunView(default) if default else None
    best = comparison.get("best") or {}
    figures = view.communication_figures if view else None
    cost = (
        f"with DDP's defaults ({figures['world_size']} processes): {step_text(view)}; "
        if figures and figures.get("measured")
        else ""
    )
    return Headline(
        f"{cost}best setting: {best_text(best)}",
        best["speed"]["verdict"] if best.get("speed") else "the defaults stand",
    )


def answer(found: sections.Collected) -> list[sections.Answer] | None:
    """What DDP's communication costs, in words: the exposed share of a step with DDP's defaults, the transfer, and
    whether a bucket or flag setting hid more of it."""
    comparison, runs = found.comparisons.get(EXPERIMENT.name), found.runs.get(EXPERIMENT.name, {})
    if not (comparison and runs):
        return None
    default = sections.first_round_runs(comparison, runs).get("default")
    if default is None:
        return None
    view, best = RunView(default), comparison.get("best") or {}
    figures = view.communication_figures or {}
    if not figures.get("measured"):
        return [sections.Answer("DDP's communication was not measured in its default run", view.machine)]
    step = f"{view.step_s * 1e3:,.0f} ms" if view.step_s else "a time not recorded"
    if figures["resolved"]:
        exposed = (
            f"{figures['exposed_s'] * 1e3:,.1f} ms of it ({figures['exposed_share']:.1%}) waiting for the gradients' "
            "all-reduce after backward's own work was done (the rest of the all-reduce ran hidden behind backward)"
        )
    else:
        low, high = figures["exposed_interval"] or (0.0, 0.0)
        exposed = (
            f"between {max(0.0, low) * 1e3:.1f} and {high * 1e3:.1f} ms of it waiting for the gradients' all-reduce "
            "(the steps' noise leaves it unresolved)"
        )
    said = f"With DDP's defaults on {figures['world_size']} processes, a training step took {step}, {exposed}"
    if best.get("speed"):
        said += (
            f"; the best setting, `{best.get('setting')}` (`{' '.join(best['flags'])}`), trained "
            + sections.ratio_words(best["speed"], "the defaults")
        )
    else:
        said += "; no bucket size or DDP flag trained faster than the defaults outside noise"
    return [sections.Answer(said, view.machine)]


def step_text(view: RunView) -> str:
    """'1854.6 ms per step, of which exposed communication 50.7 ms (2.7%)', or the interval where it is not resolved."""
    figures = view.communication_figures
    step = f"{view.step_s * 1e3:.1f} ms per step" if view.step_s else "step time unknown"
    if not figures["resolved"]:
        low, high = figures["exposed_interval"] or (0.0, 0.0)
        return (
            f"{step}; exposed communication not resolved: between {max(0.0, low) * 1e3:.1f} and {high * 1e3:.1f} "
            "ms per step, so no share of the step or of the transfer is given"
        )
    return (
        f"{step}, of which exposed communication {figures['exposed_s'] * 1e3:.1f} ms ({figures['exposed_share']:.1%})"
    )


EXPERIMENT = Experiment(
    name="ddp-cost",
    title="What DDP communication costs",
    target="make ddp-cost",
    folder="ddp_cost",
    section=section,
    headline=headline,
    arguments=arguments,
    run=run,
    help="DDP settings against DDP's defaults: exposed communication, speed",
    question="What does DDP's gradient communication cost, and can a setting hide it?",
    answer=answer,
)
