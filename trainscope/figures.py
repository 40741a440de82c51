"""Figures and table rows of the sweep and comparison results, shared by the scripts that write those
results (loaders_bench.py, compare_dp.py) and by report.py, which draws them again into the report.
Rows are pure; figures are matplotlib (Agg) and written by `save_figure`."""

from pathlib import Path

from trainscope import bench

VARIANTS = (("single", "single device"), ("data_parallel", "nn.DataParallel"), ("ddp", "DDP"))


def save_figure(figure, stem: Path, **savefig_options) -> list[Path]:
    """Write a matplotlib figure as stem.png and stem.pdf and close it."""
    import matplotlib.pyplot as plt

    paths = [Path(f"{stem}.{suffix}") for suffix in ("png", "pdf")]
    for path in paths:
        figure.savefig(path, dpi=150, **savefig_options)
    plt.close(figure)
    return paths


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


# ---------------------------------------------------------------- DataParallel vs DDP


def compare_dp_rows(report: dict) -> list[dict]:
    """One row per variant: what the Markdown and LaTeX tables show (medians over rounds)."""
    rows = []
    for name, label in VARIANTS:
        result = report["results"][name]
        if result.get("status") != "measured":
            rows.append({"variant": label, "status": result.get("reason", "not measured")})
            continue
        comparison = report["comparison"].get(name)
        speed = comparison["speed"] if comparison else None
        rows.append({
            "variant": label, "runs_on": report["machine"]["hardware"].get(name, ""),
            "wall_s": result["wall_s"]["median"], "samples_per_s": result["samples_per_s"]["median"],
            "samples_per_s_min": result["samples_per_s"]["min"], "samples_per_s_max": result["samples_per_s"]["max"],
            "speed": bench.ratio_text(speed) if speed else "baseline", "speed_median": speed["median_ratio"] if speed else 1.0,
            "verdict": speed["verdict"] if speed else "", "efficiency": comparison["scaling_efficiency"] if comparison else 1.0,
            "peak_memory": ", ".join(f"{k} {v:.2f}" for k, v in result["peak_memory_gib"].items()),
            "final_loss": result["final_loss"],
        })
    return rows


def compare_dp_figure(report: dict):
    """Throughput per variant (median, min-max whiskers) and peak memory per device."""
    plt = _pyplot()
    rows = [r for r in compare_dp_rows(report) if "status" not in r]
    figure, (speed, memory) = plt.subplots(1, 2, figsize=(10, 3.8))
    medians = [r["samples_per_s"] for r in rows]
    errors = [[m - r["samples_per_s_min"] for m, r in zip(medians, rows)],
              [r["samples_per_s_max"] - m for m, r in zip(medians, rows)]]
    speed.bar([f"{r['variant']}\n{r['runs_on']}" for r in rows], medians, yerr=errors, capsize=4, color="tab:blue")
    speed.set_ylabel("samples/s (median, min-max)")
    speed.set_title("throughput")
    speed.tick_params(axis="x", labelsize=7)
    labels, values = [], []
    for name, _ in VARIANTS:
        result = report["results"][name]
        if result.get("status") == "measured":
            for device, gib in result["peak_memory_gib"].items():
                labels.append(f"{name}\n{device}")
                values.append(gib)
    memory.bar(labels, values, color="tab:orange")
    memory.set_ylabel("peak memory (GiB)")
    memory.set_title("per device")
    memory.tick_params(axis="x", labelsize=7)
    missing = [name for name, result in report["results"].items() if result.get("status") != "measured"]
    if missing:
        speed.set_xlabel(f"not measurable here: {', '.join(missing)}", fontsize=8)
    figure.tight_layout()
    return figure


# ---------------------------------------------------------------- DataLoader sweep


def loader_curve_name(entry: dict) -> str:
    return (f"{entry['mode']} (batch {entry['batch_size']}, pin {'on' if entry['pin_memory'] else 'off'}, "
            f"persistent {'on' if entry['persistent_workers'] else 'off'}, prefetch {entry['prefetch_factor']})")


def loaders_figure(report: dict):
    """Time per pass against num_workers (median, min-max band), one line per mode; data share in training."""
    plt = _pyplot()
    settings = report["summary"]["settings"]
    panels = [m for m in ("pass_s", "data_share") if any(s["metric"] == m for s in settings)]
    figure, axes = plt.subplots(1, len(panels), figsize=(6.5 * len(panels), 4.2), squeeze=False)
    for axis, metric in zip(axes[0], panels):
        curves = {}
        for entry in settings:
            if entry["metric"] == metric:
                curves.setdefault(loader_curve_name(entry), []).append(entry)
        scale = 100 if metric == "data_share" else 1
        for name, points in curves.items():
            points.sort(key=lambda p: p["num_workers"])
            x = [p["num_workers"] for p in points]
            line, = axis.plot(x, [p["median"] * scale for p in points], marker="o", label=name)
            axis.fill_between(x, [p["min"] * scale for p in points], [p["max"] * scale for p in points],
                              alpha=0.2, color=line.get_color())
        axis.set_xlabel("num_workers (PyTorch default: 0)")
        axis.set_ylabel("pass over all training batches (s)" if metric == "pass_s" else "data share of step time (%)")
        axis.set_ylim(bottom=0)
        axis.grid(alpha=0.3)
        axis.legend(fontsize=7)
    machine = report["machine"]
    figure.suptitle(f"DataLoader sweep: {report['dataset_rows']} rows, {machine['device_name']}, "
                    f"{machine['usable_cores']} cores (median, min-max band)", fontsize=9)
    figure.tight_layout()
    return figure


# ---------------------------------------------------------------- DDP communication cost

BUCKET_SETTINGS = {"bucket1": 1, "bucket5": 5, "default": 25, "bucket100": 100}


def ddp_cost_rows(comparison: dict) -> list[dict]:
    """One row per DDP setting: step time, its verdict against DDP's defaults, exposed and total communication."""
    rows = []
    for name, arm in comparison["arms"].items():
        if arm["status"] != "complete":
            rows.append({"setting": name, "flags": " ".join(arm["flags"]), "skipped": arm["reason"]})
            continue
        figures = comparison.get("communication", {}).get(name, {})
        speed = comparison["comparisons"].get(name, {}).get("speed")
        pick = lambda key: figures[key]["median"] if key in figures else None  # noqa: E731
        rows.append({"setting": name, "flags": " ".join(arm["flags"]), "step_s": arm["step_s"]["median"],
                     "step_s_range": (arm["step_s"]["min"], arm["step_s"]["max"]), "speed": speed,
                     "exposed_s": pick("exposed_s"), "exposed_share": pick("exposed_share"),
                     "total_allreduce_s": pick("total_allreduce_s"), "overlap": pick("overlap")})
    return rows


def ddp_cost_figure(comparison: dict):
    """Step time and exposed communication against the bucket size; the flag settings at 25 MB beside them."""
    plt = _pyplot()
    rows = {r["setting"]: r for r in ddp_cost_rows(comparison) if "skipped" not in r}
    figure, (steps, exposed) = plt.subplots(1, 2, figsize=(10, 3.8))
    buckets = [(mb, rows[name]) for name, mb in BUCKET_SETTINGS.items() if name in rows]
    for axis, key, label, scale in ((steps, "step_s", "seconds per optimizer step (median)", 1),
                                    (exposed, "exposed_s", "exposed communication per step (ms, median)", 1e3)):
        axis.plot([mb for mb, _ in buckets], [(r[key] or 0) * scale for _, r in buckets], marker="o", label="bucket size")
        for name, row in rows.items():
            if name not in BUCKET_SETTINGS:
                axis.scatter([25], [(row[key] or 0) * scale], marker="s", label=name)
        axis.set_xscale("log")
        axis.set_xlabel("DDP bucket size (MB)")
        axis.set_ylabel(label)
        axis.set_ylim(bottom=0)
        axis.grid(alpha=0.3)
    steps.legend(fontsize=7)
    figure.tight_layout()
    return figure
