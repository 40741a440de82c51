"""make ddp-cost: what DDP communication costs here, and which bucket size, flag or compression hook hides it.

Each DDP setting runs against DDP's defaults in alternating rounds; every run measures its communication in
the run (trainscope.communication: exposed and total all-reduce time, beside DDP's own figures). The
report shows, per setting, where a step goes (compute / exposed communication / the rest) and, per rank,
compute and the wait at the collective, so a straggler shows at a glance.
"""

import statistics
from pathlib import Path

from trainscope import bench, launching, reporting
from trainscope.communication import INTERCONNECTS, ring_allreduce_seconds
from trainscope.experiments.base import Experiment, experiment, planned_arm, runs_option, speed_cells, write
from trainscope.record_view import COMMUNICATION_FIGURES, RunView
from trainscope.records import read_record
from trainscope.reporting import Headline
from trainscope.tables import Table, num, pyplot, ranged

# The DDP settings compared with DDP's defaults (25 MB buckets, no flags, no compression).
SETTINGS = {"default": [], "bucket1": ["--ddp-bucket-cap-mb", "1"], "bucket5": ["--ddp-bucket-cap-mb", "5"],
            "bucket100": ["--ddp-bucket-cap-mb", "100"], "bucket_view": ["--ddp-gradient-as-bucket-view"],
            "static_graph": ["--ddp-static-graph"], "fp16_hook": ["--ddp-comm-hook", "fp16"],
            "bf16_hook": ["--ddp-comm-hook", "bf16"]}


def arguments(parser) -> None:
    runs_option(parser, config="ddp")
    parser.add_argument("--settings", nargs="+", choices=list(SETTINGS), help="settings (default: all)")
    parser.add_argument("--samples", type=int, default=5, help="communication calibration steps per run (default 5)")


def run(args, train_args: list[str]) -> dict:
    runs = Path(args.runs)
    names = args.settings or list(SETTINGS)
    arms = [planned_arm(name, args.config, SETTINGS[name]) for name in ["default"] + [n for n in names if n != "default"]]
    for arm in arms:
        if arm.name == "bf16_hook" and launching.plan(args.config).on_cpu and arm.skipped is None:
            arm.skipped = "gloo cannot all-reduce bf16 (the bf16 hook needs NCCL or XCCL)"
    summary = experiment(runs, "ddp_cost", arms, [*train_args, "--communication-samples", str(args.samples)], args.rounds)
    results = {arm.name: [RunView(read_record(runs / run)).headline() for run in summary["arms"][arm.name]["runs"]]
               for arm in arms if arm.skipped is None}
    summary["communication"] = {name: {k: bench.spread([r["communication"][k] for r in rows])
                                       for k in COMMUNICATION_FIGURES
                                       if all(r["communication"] and r["communication"].get(k) is not None for r in rows)}
                                for name, rows in results.items()}
    faster = [n for n, c in summary["comparisons"].items() if c["speed"]["verdict"] == "faster"]
    best = max(faster, key=lambda n: summary["comparisons"][n]["speed"]["median_ratio"]) if faster else "default"
    summary["best"] = {"setting": best, "flags": SETTINGS[best], "speed": summary["comparisons"].get(best, {}).get("speed")}
    summary["ring_model"] = ring_model(summary["communication"].get("default", {}), args.config)
    write(runs, "ddp_cost", summary, train_args, args.rounds)
    return summary


def ring_model(measured: dict, config: str) -> dict | None:
    """The measured all-reduce against the ring model's time for the same bytes with compare_dp.py's presets."""
    if not measured.get("total_allreduce_s"):
        return None
    world = launching.config_facts(launching.config_path(config))["num_processes"]
    size, seconds = measured["allreduce_bytes_per_step"]["median"], measured["total_allreduce_s"]["median"]
    presets = {}
    for name, p in INTERCONNECTS.items():
        model = ring_allreduce_seconds(size, world, p["bandwidth_gbs"], p["latency_us"])
        presets[name] = {"model_s": model, "measured_over_model": seconds / model}
    return {"gradient_bytes": size, "world_size": world, "measured_s": seconds,
            "measured_bus_bandwidth_gbs": measured["bus_bandwidth_gbs"]["median"], "presets": presets}


def rows(comparison: dict) -> list[dict]:
    """One row per DDP setting: step time, its verdict against DDP's defaults, the communication figures."""
    out = []
    for row in reporting.arm_rows(comparison):
        if row["status"] != "complete":
            out.append({"setting": row["arm"], "flags": row["flags"], "skipped": row["reason"]})
            continue
        figures = comparison.get("communication", {}).get(row["arm"], {})
        pick = lambda key: figures[key]["median"] if key in figures else None  # noqa: E731
        out.append({"setting": row["arm"], "flags": row["flags"], "step_s": row["step_s"],
                    "step_s_range": row["step_s_range"], "speed": row["speed"],
                    **{key: pick(key) for key in ("exposed_s", "exposed_share", "total_allreduce_s", "overlap",
                                                  "compute_s", "ddp_exposed_s", "ddp_overlap")}})
    return out


def figure(comparison: dict, default_record: dict | None):
    """Per setting, a step split into compute / exposed communication / the rest (stacked, median over rounds);
    per rank of the defaults' first round, compute and the wait at the collective."""
    measured = [r for r in rows(comparison) if "skipped" not in r and r["compute_s"] is not None]
    drawn, (steps, ranks) = pyplot().subplots(1, 2, figsize=(10, 3.8), gridspec_kw={"width_ratios": [3, 2]})
    names = [r["setting"] for r in measured]
    compute = [r["compute_s"] for r in measured]
    exposed = [max(0.0, r["exposed_s"] or 0.0) for r in measured]
    rest = [max(0.0, r["step_s"] - c - e) for r, c, e in zip(measured, compute, exposed)]
    steps.bar(names, compute, label="compute (forward + backward, no all-reduce)", color="tab:blue")
    steps.bar(names, exposed, bottom=compute, label="exposed communication", color="tab:red")
    steps.bar(names, rest, bottom=[c + e for c, e in zip(compute, exposed)], label="the rest (optimizer, data, ...)",
              color="tab:gray")
    steps.set_ylabel("seconds per optimizer step (median)")
    steps.tick_params(axis="x", labelsize=7)
    steps.legend(fontsize=7)
    per_rank = ((RunView(default_record).communication or {}).get("per_rank") or []) if default_record else []
    labels = [f"rank {r['rank']}" for r in per_rank]
    ranks.bar(labels, [r["compute_s"] for r in per_rank], label="compute", color="tab:blue")
    ranks.bar(labels, [r["wait_s"] for r in per_rank], bottom=[r["compute_s"] for r in per_rank],
              label="wait for the slowest rank", color="tab:orange")
    ranks.set_ylabel("seconds per calibration step (defaults)")
    ranks.legend(fontsize=7)
    drawn.tight_layout()
    return drawn


def settings_table(comparison: dict) -> Table:
    cells = []
    for r in rows(comparison):
        if "skipped" in r:
            cells.append([r["setting"], r["flags"], f"skipped: {r['skipped']}", "", "", "", "", "", "", ""])
            continue
        ms = lambda v: num(v * 1e3, 1) if v is not None else "n/a"  # noqa: E731
        cells.append([r["setting"], r["flags"], ranged(r["step_s"], r["step_s_range"], 3), *speed_cells(r),
                      ms(r["exposed_s"]), ms(r["ddp_exposed_s"]), ms(r["total_allreduce_s"]),
                      num(r["overlap"], 0, percent=True), num(r["ddp_overlap"], 0, percent=True)])
    return Table(f"DDP settings against DDP's defaults ({comparison['rounds']} alternating rounds)",
                 ["setting", "flags", "s/step", "speed vs default", "verdict", "exposed ms", "DDP's exposed ms",
                  "all-reduce ms", "overlap", "DDP's overlap"], cells, "ddp_cost", align="llrrlrrrrr")


def section(report, found: reporting.Collected) -> None:
    comparison, runs = found.comparisons.get(EXPERIMENT.name), found.runs.get(EXPERIMENT.name, {})
    if not report.begin(EXPERIMENT.title, comparison and runs, EXPERIMENT.missing()):
        return
    records = reporting.first_round_runs(comparison, runs)
    default = RunView(records["default"]).communication if "default" in records else None
    if default and default.get("measured"):
        report.text(summary_text(RunView(records["default"])))
    report.text(agreement_text(runs))
    report.figure(figure(comparison, records.get("default")), "ddp_cost",
                  "Where a DDP step goes, per setting; compute and wait per rank", list(records.values()))
    report.table(settings_table(comparison))
    report.text(f"Best setting here: {best_text(comparison.get('best') or {})}.")
    ring = comparison.get("ring_model")
    if ring:
        report.text(f"The measured all-reduce of {ring['gradient_bytes'] / 1e6:.1f} MB over {ring['world_size']} processes "
                    f"took {ring['measured_s'] * 1e3:.1f} ms ({ring['measured_bus_bandwidth_gbs']:.2f} GB/s); the ring "
                    "model with compare_dp.py's presets predicts "
                    + ", ".join(f"{name} {p['model_s'] * 1e3:.2f} ms (measured {p['measured_over_model']:.0f}x)"
                                for name, p in ring["presets"].items())
                    + ". `compare_dp.py --ddp-cost` projects with the measured bandwidth beside the presets.")


def best_text(best: dict) -> str:
    return f"`{best.get('setting')}`" + (f" (`{' '.join(best['flags'])}`), {bench.describe(best['speed'])}"
                                         if best.get("speed") else ": no setting was faster than DDP's defaults outside noise")


def headline(found: reporting.Collected) -> Headline | None:
    """What communication costs a step with DDP's defaults (the section's first sentence) and the best setting."""
    comparison, runs = found.comparisons.get(EXPERIMENT.name), found.runs.get(EXPERIMENT.name, {})
    if not (comparison and runs):
        return None
    default = reporting.first_round_runs(comparison, runs).get("default")
    view = RunView(default) if default else None
    best = comparison.get("best") or {}
    cost = (f"with DDP's defaults ({view.communication['world_size']} processes): {step_text(view)}; "
            if view and (view.communication or {}).get("measured") else "")
    return Headline(f"{cost}best setting: {best_text(best)}",
                    best["speed"]["verdict"] if best.get("speed") else "the defaults stand")


def step_text(view: RunView) -> str:
    """'1854.6 ms per step, of which exposed communication 50.7 ms (2.7%)'."""
    block = view.communication
    return (f"{view.step_s * 1e3:.1f} ms per step, of which exposed communication {block['exposed_s'] * 1e3:.1f} ms "
            f"({block['exposed_share']:.1%})")


def agreement_text(runs: dict) -> str:
    """How often trainscope's exposed communication and DDP's own agreed, over every run of the study."""
    views = [RunView(record) for record in runs.values() if (RunView(record).communication or {}).get("measured")]
    disagree = [v.name for v in views if "comm_instruments_disagree" in v.warning_codes]
    above = [v.name for v in views if "comm_exposed_above_total" in v.warning_codes]
    return (f"The two instruments -- trainscope's calibration pair and DDP's own logger -- agree within the stated "
            f"tolerance in {len(views) - len(disagree)} of {len(views)} runs"
            + (f" (not in {', '.join(sorted(disagree))})" if disagree else "")
            + f"; the exposed figure is above the buckets' all-reduces alone in {len(above)}. The calibration pair is "
            "the difference of two passes' times, so its per-run spread is that of a forward + backward; DDP's "
            "logger times only the wait at the end of backward and is the steadier of the two, while the pair also "
            "counts what DDP's all-reduces cost the compute running beside them.")


def summary_text(view: RunView) -> str:
    block = view.communication
    compute = statistics.median(r["compute_s"] for r in block["per_rank"])
    ddp = (f"; DDP's own logger, over its steady iterations, puts the exposed part at {block['ddp_exposed_s'] * 1e3:.1f} "
           f"ms and its overlap at {block['ddp_overlap']:.0%}" if block.get("ddp_exposed_s") is not None else "")
    return (f"Where a DDP step goes with DDP's defaults ({block['world_size']} processes, first round): "
            f"{step_text(view)}; the same buckets' all-reduces alone take {block['total_allreduce_s'] * 1e3:.1f} "
            f"ms ({block['bus_bandwidth_gbs']:.2f} GB/s bus bandwidth), so {block['overlap']:.0%} of it hides behind "
            f"backward{ddp}. Compute (forward and backward without the all-reduce): {compute * 1e3:.1f} ms per rank.")


EXPERIMENT = Experiment(name="ddp-cost", title="What DDP communication costs", target="make ddp-cost",
                        folder="ddp_cost", section=section, headline=headline, arguments=arguments, run=run,
                        help="DDP settings against DDP's defaults: exposed communication, speed")
