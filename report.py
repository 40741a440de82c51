"""Every figure and table from what has been run: reports/report.md, reports/report.pdf and the parts.

Reads the run records under --runs (runs/profile, runs/amp, runs/ckpt, runs/batch, runs/matrix and
any other run) and the sweep results under --results (loaders/, compare_dp/). Rows come from the
pure functions in trainscope.reporting; this script only formats them: PNG and PDF figures,
booktabs LaTeX tables, one Markdown report and one PDF report (matplotlib, no TeX needed).
An experiment that has not been run becomes a line naming the make target that produces it; a
corrupt or foreign record is skipped with a warning naming the file.

    python report.py [--runs runs] [--results results] [--out reports]
"""

import argparse
import shutil
import sys
from datetime import date
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.backends.backend_pdf import PdfPages  # noqa: E402

from trainscope import reporting  # noqa: E402
from trainscope.records import write_json_atomic  # noqa: E402

LATEX_SPECIALS = {"\\": r"\textbackslash{}", "&": r"\&", "%": r"\%", "$": r"\$", "#": r"\#", "_": r"\_",
                  "{": r"\{", "}": r"\}", "~": r"\textasciitilde{}", "^": r"\textasciicircum{}"}


# ---------------------------------------------------------------- table formatting


class Table:
    """Headers and string cells, written as Markdown or booktabs LaTeX (and drawn into the PDF)."""

    def __init__(self, title: str, headers: list[str], rows: list[list[str]], label: str, align: str | None = None):
        self.title, self.headers, self.rows, self.label = title, headers, rows, label
        self.align = align or "l" + "r" * (len(headers) - 1)

    def markdown(self) -> str:
        lines = ["| " + " | ".join(self.headers) + " |",
                 "|" + "|".join("---" if a == "l" else "---:" for a in self.align) + "|"]
        lines += ["| " + " | ".join(row) + " |" for row in self.rows]
        return "\n".join(lines)

    def latex(self) -> str:
        escape = lambda text: "".join(LATEX_SPECIALS.get(ch, ch) for ch in str(text))  # noqa: E731
        lines = [r"\begin{table}[t]", r"\centering", rf"\begin{{tabular}}{{{self.align}}}", r"\toprule",
                 " & ".join(escape(h) for h in self.headers) + r" \\", r"\midrule"]
        lines += [" & ".join(escape(cell) for cell in row) + r" \\" for row in self.rows]
        lines += [r"\bottomrule", r"\end{tabular}", rf"\caption{{{escape(self.title)}}}",
                  rf"\label{{tab:{self.label}}}", r"\end{table}"]
        return "\n".join(lines) + "\n"


def num(value, digits=2, percent=False) -> str:
    if value is None:
        return "n/a"
    return f"{100 * value:.{digits}f}%" if percent else f"{value:.{digits}f}"


class PdfBook:
    """A4 pages filled top to bottom with headings, text, figures (rasterized) and tables."""

    WIDTH, HEIGHT, MARGIN = 8.27, 11.69, 0.6

    def __init__(self, path: Path):
        self.pdf = PdfPages(path)
        self.page = None
        self._new_page()

    def _new_page(self):
        if self.page is not None:
            self.pdf.savefig(self.page)
            plt.close(self.page)
        self.page = plt.figure(figsize=(self.WIDTH, self.HEIGHT))
        self.y = self.HEIGHT - self.MARGIN

    def _reserve(self, height: float) -> float:
        """Top y (inches) of a block of `height`, on a new page if this one is full."""
        if self.y - height < self.MARGIN and self.y < self.HEIGHT - self.MARGIN:
            self._new_page()
        top = self.y
        self.y -= height
        return top

    def heading(self, text: str, size: int = 14):
        top = self._reserve(0.5)
        self.page.text(self.MARGIN / self.WIDTH, (top - 0.35) / self.HEIGHT, text, fontsize=size, weight="bold")

    def text(self, text: str, size: float = 8.5, monospace: bool = False):
        import textwrap

        width = 150 if monospace else 115
        lines = [piece for line in text.replace("`", "").splitlines()
                 for piece in (textwrap.wrap(line, width) or [""])]
        step = size / 72 * 1.35
        for start in range(0, len(lines), 60):
            chunk = lines[start:start + 60]
            top = self._reserve(step * len(chunk) + 0.1)
            self.page.text(self.MARGIN / self.WIDTH, (top - step) / self.HEIGHT, "\n".join(chunk), fontsize=size,
                           family="monospace" if monospace else None, va="top")

    def image(self, figure):
        import numpy as np

        figure.canvas.draw()
        pixels = np.asarray(figure.canvas.buffer_rgba())
        width = self.WIDTH - 2 * self.MARGIN
        height = min(width * pixels.shape[0] / pixels.shape[1], 5.0)
        top = self._reserve(height + 0.15)
        axes = self.page.add_axes([self.MARGIN / self.WIDTH, (top - height) / self.HEIGHT, width / self.WIDTH,
                                   height / self.HEIGHT])
        axes.imshow(pixels)
        axes.axis("off")

    def table(self, table: Table):
        row_height, title_height = 0.22, 0.3
        for start in range(0, max(len(table.rows), 1), 40):
            rows = table.rows[start:start + 40]
            height = row_height * (len(rows) + 1)
            top = self._reserve(title_height + height + 0.2)  # the title stays with its table
            self.page.text(self.MARGIN / self.WIDTH, (top - 0.2) / self.HEIGHT,
                           table.title + (" (continued)" if start else ""), fontsize=9)
            axes = self.page.add_axes([self.MARGIN / self.WIDTH, (top - title_height - height) / self.HEIGHT,
                                       (self.WIDTH - 2 * self.MARGIN) / self.WIDTH, height / self.HEIGHT])
            axes.axis("off")
            if rows:
                drawn = axes.table(cellText=rows, colLabels=table.headers, loc="upper center", cellLoc="center",
                                   bbox=[0, 0, 1, 1])
                drawn.auto_set_font_size(False)
                drawn.set_fontsize(6.5)

    def close(self):
        self.pdf.savefig(self.page)
        plt.close(self.page)
        self.pdf.close()


# ---------------------------------------------------------------- sections


class Report:
    """Each section goes to report.md, to report.pdf, and to its own PNG/PDF figures and .tex tables."""

    def __init__(self, out: Path, book: PdfBook):
        self.out = out
        self.book = book
        self.markdown: list[str] = []
        self.files: list[Path] = []
        self.figure_runs: dict[str, list[dict]] = {}  # figure name -> the records it shows

    def shows(self, name: str, records):
        self.figure_runs.setdefault(name, []).extend(records)

    def section(self, title: str):
        self.markdown += [f"## {title}", ""]
        self.book.heading(title)

    def text(self, line: str):
        self.markdown += [line, ""]
        self.book.text(line)

    def missing(self, experiment: str):
        self.text(reporting.missing(experiment))

    def figure(self, figure, name: str, caption: str):
        self.markdown += [f"![{caption}]({name}.png)", ""]
        self.book.image(figure)
        self.files += reporting.save_figure(figure, self.out / name, bbox_inches="tight")

    def table(self, table: Table):
        path = self.out / f"{table.label}.tex"
        path.write_text(table.latex())
        self.files.append(path)
        self.markdown += [f"**{table.title}** (LaTeX: `{path.name}`)", "", table.markdown(), ""]
        self.book.table(table)

    def code(self, text: str, language: str = ""):
        self.markdown += [f"```{language}", text, "```", ""]
        self.book.text(text, size=6, monospace=True)


def time_section(report: Report, found: reporting.Collected):
    report.section("Where the time went")
    record = reporting.pick_profile_run(found)
    if record is None:
        return report.missing("profile")
    breakdown = reporting.time_breakdown(record)
    if "profile" not in found.runs:
        report.text(f"From run `{breakdown['run']}` ({reporting.missing('profile')})")
    figure, axis = plt.subplots(figsize=(6.5, 4.5))
    shown = [c for c in breakdown["categories"] if c["percent"] > 0]
    axis.pie([c["seconds"] for c in shown], labels=[f"{c['name']}\n{c['percent']:.1f}%" for c in shown],
             startangle=90, counterclock=False, wedgeprops={"linewidth": 1, "edgecolor": "white"})
    axis.set_title(f"{breakdown['run']}: {breakdown['wall_s']:.1f} s on {breakdown['world_size']} x "
                   f"{breakdown['device']} ({breakdown['precision']})", fontsize=9)
    report.figure(figure, "time_breakdown", "Share of wall time per category")
    report.shows("time_breakdown", [record])
    rows = [[c["name"], num(c["seconds"]), num(c["percent"], 1) + "%"] for c in breakdown["categories"]]
    rows += [[f"  stage: {s['name']}", num(s["seconds"]), num(s["percent"], 1) + "%"] for s in breakdown["stages"]]
    rows.append(["wall time", num(breakdown["wall_s"]), "100.0%"])
    report.table(Table("Where the time went (median over ranks): the five categories, then the stages",
                       ["category / stage", "seconds", "share"], rows, "time_breakdown"))
    top = (record["summary"].get("profile") or {}).get("top_operators")
    if top:
        rows = [[op["name"][:60], str(op["calls"]), num((op["self_device_s"] if op["self_device_s"] is not None
                                                         else op["self_cpu_s"]) * 1e3)] for op in top[:10]]
        report.table(Table("Top operators by self time (torch.profiler window)", ["operator", "calls", "ms"],
                           rows, "top_operators"))


def loaders_section(report: Report, found: reporting.Collected):
    import loaders_bench

    report.section("DataLoader num_workers")
    sweep = found.results.get("loaders")
    if sweep is None:
        return report.missing("loaders")
    machine = sweep["machine"]
    report.text(f"{machine['device_name']}, {machine['usable_cores']} usable cores "
                f"({machine['cpu_budget_per_process']} per training process), {sweep['dataset_rows']} training rows. "
                f"PyTorch's default is num_workers={sweep['pytorch_default_num_workers']} (loading in the training "
                "process).")
    report.figure(loaders_bench.plot_figure(sweep), "loaders", "Pass time against num_workers")
    rows = []
    for s in sweep["summary"]["settings"]:
        unit = "s/pass" if s["metric"] == "pass_s" else "data share"
        value = num(s["median"], 3) if s["metric"] == "pass_s" else num(s["median"], 1, percent=True)
        low = num(s["min"], 3) if s["metric"] == "pass_s" else num(s["min"], 1, percent=True)
        high = num(s["max"], 3) if s["metric"] == "pass_s" else num(s["max"], 1, percent=True)
        rows.append([s["mode"], str(s["batch_size"]), "on" if s["pin_memory"] else "off", str(s["num_workers"]),
                     f"{value} ({unit})", f"{low} - {high}", num(s.get("median_first_batch_s"), 3)])
    report.table(Table("DataLoader sweep: median over repeats, min - max", ["mode", "batch", "pin", "workers",
                       "median", "range", "first batch s"], rows, "loaders", align="lrlrrrr"))
    for name, curve in sweep["summary"]["curves"].items():
        report.text(f"- {name}: knee at {curve['knee_workers']} workers, best {curve['best_workers']}"
                    + (f", {curve['knee_speedup_over_default']:.2f}x the default" if
                       curve.get("knee_speedup_over_default") else "") + f" (`{curve['flags']}`)")


def amp_section(report: Report, found: reporting.Collected):
    report.section("Mixed precision vs FP32")
    runs = found.runs.get("amp")
    if not runs:
        return report.missing("amp")
    rows = reporting.amp_rows(runs)
    figure, axis = plt.subplots(figsize=(7, 4))
    for name, (steps, losses) in reporting.loss_curves(runs).items():
        precision = runs[name]["environment"]["effective_precision"]
        axis.plot(steps, losses, marker=".", label=f"{name} ({precision})")
    axis.set_xlabel("optimizer step")
    axis.set_ylabel("training loss")
    axis.grid(alpha=0.3)
    axis.legend()
    report.figure(figure, "amp_loss", "Training loss, FP32 and mixed precision")
    report.shows("amp_loss", runs.values())
    table_rows = [[r["run"], r["precision"], num(r["validation_accuracy"], 4), num(r["test_accuracy"], 4),
                   num(r["wall_s"], 1), num(r["samples_per_s"], 1), f"{num(r['peak_memory_gib'])} ({r['memory_kind']})",
                   num(r["speedup"], 3), num(r["memory_ratio"], 3)] for r in rows]
    report.table(Table("Mixed precision vs FP32 (ratios to the FP32 run)",
                       ["run", "precision", "val acc", "test acc", "wall s", "samples/s", "peak GiB",
                        "speed-up", "memory ratio"], table_rows, "amp", align="llrrrrrrr"))
    for r in rows:
        if r["requested_precision"] not in ("no", r["precision"]):
            report.text(f"`{r['run']}` asked for {r['requested_precision']} but ran {r['precision']} on this device.")


def dp_section(report: Report, found: reporting.Collected):
    import compare_dp

    report.section("DataParallel vs DDP")
    result = found.results.get("compare_dp")
    if result is None:
        return report.missing("compare_dp")
    report.figure(compare_dp.plot_figure(result), "compare_dp", "Throughput and per-device memory")
    rows = []
    for row in compare_dp.table_rows(result):
        if "status" in row:
            rows.append([row["variant"], "not measurable here", "", "", "", ""])
        else:
            rows.append([row["variant"], str(row["devices"]), num(row["wall_s"]), num(row["samples_per_s"], 1),
                         num(row["efficiency"], 1, percent=True), num(row["final_loss"], 4)])
    report.table(Table(f"DataParallel vs DDP on {result['machine']['device_name']}",
                       ["variant", "devices", "wall s", "samples/s", "efficiency", "final loss"], rows, "compare_dp"))
    for diff in result["code_changes"]:
        report.text(f"From `single_device` to `{diff['to']}`: {diff['changed_lines']} changed lines "
                    f"(+{diff['added']} -{diff['removed']}).")
        report.code(diff["diff"], "diff")
    report.text(result["projection"]["assumptions"])


def ckpt_section(report: Report, found: reporting.Collected):
    report.section("Activation checkpointing")
    runs = found.runs.get("ckpt")
    if not runs:
        return report.missing("ckpt")
    rows = reporting.ckpt_rows(runs)
    figure, (time_axis, memory_axis) = plt.subplots(1, 2, figsize=(8, 3.5))
    labels = [r["run"] for r in rows]
    time_axis.bar(labels, [r["step_s"] for r in rows], color="tab:blue")
    time_axis.set_ylabel("seconds per optimizer step")
    memory_axis.bar(labels, [r["peak_memory_gib"] for r in rows], color="tab:orange")
    memory_axis.set_ylabel(f"peak memory GiB ({rows[0]['memory_kind']})")
    figure.tight_layout()
    report.figure(figure, "ckpt", "Activation checkpointing: time and memory")
    report.shows("ckpt", runs.values())
    report.table(Table("Activation checkpointing off and on", ["run", "checkpointing", "s/step", "peak GiB",
                                                                "step ratio", "memory ratio"],
                       [[r["run"], "on" if r["gradient_checkpointing"] else "off", num(r["step_s"], 3),
                         num(r["peak_memory_gib"]), num(r.get("step_ratio"), 3), num(r.get("memory_ratio"), 3)]
                        for r in rows], "ckpt"))
    if rows[0]["memory_kind"] == "peak RSS":
        report.text("On a CPU the memory column is the process's peak RSS, which includes the Python runtime and "
                    "libraries; activation savings show in full as device memory on a GPU.")


def batch_section(report: Report, found: reporting.Collected):
    report.section("Batch size")
    sweep = found.results.get("batch_sweep")
    if sweep is None:
        return report.missing("batch")
    rows = reporting.batch_rows(sweep)
    fitted = [r for r in rows if r["status"] == "complete"]
    if fitted:
        figure, axis = plt.subplots(figsize=(7, 4))
        axis.plot([r["batch_size"] for r in fitted], [r["samples_per_s"] for r in fitted], marker="o",
                  color="tab:blue")
        axis.set_xscale("log", base=2)
        axis.set_xlabel("per-device batch size")
        axis.set_ylabel("samples/s", color="tab:blue")
        twin = axis.twinx()
        twin.plot([r["batch_size"] for r in fitted], [r["peak_memory_gib"] for r in fitted], marker="s",
                  color="tab:orange")
        twin.set_ylabel(f"peak memory GiB ({fitted[0]['memory_kind']})", color="tab:orange")
        axis.set_ylim(bottom=0)
        twin.set_ylim(bottom=0)
        report.figure(figure, "batch", "Throughput and memory against batch size")
    report.table(Table("Batch-size sweep", ["batch", "status", "samples/s", "s/step", "peak GiB"],
                       [[str(r["batch_size"]), r["status"], num(r.get("samples_per_s"), 1), num(r.get("step_s"), 3),
                         num(r.get("peak_memory_gib"))] for r in rows], "batch", align="rlrrr"))
    advice = sweep.get("recommendation") or {}
    report.text(f"Largest batch that fits: {sweep.get('largest_fitting_batch') or advice.get('largest_swept_that_fits')}"
                f" ({sweep['largest_search']}). Fastest: {advice.get('fastest_batch_size')}. Keeping the effective "
                f"batch of {advice.get('effective_batch')}: `{advice.get('flags', 'no swept batch divides it')}`.")
    speeds = [r["samples_per_s"] for r in fitted if r.get("samples_per_s")]
    if len(speeds) > 1 and max(speeds) < 1.1 * min(speeds):
        report.text(f"Throughput stays within {100 * (max(speeds) / min(speeds) - 1):.0f}% across the sweep (one run per "
                    "batch size): here the batch size buys memory headroom or convergence behaviour, not speed.")


def matrix_section(report: Report, found: reporting.Collected):
    report.section("Configs and switches side by side")
    runs = found.runs.get("matrix")
    if not runs:
        return report.missing("matrix")
    order = [v["variant"] for v in (found.results.get("matrix") or {}).get("variants", [])]
    rows = reporting.matrix_rows(runs, order)
    stages = ("data", "forward", "backward", "optimizer", "other")
    figure, axis = plt.subplots(figsize=(8, 4))
    bottom = [0.0] * len(rows)
    for stage in stages:
        values = [r[f"{stage}_s_per_step"] for r in rows]
        axis.bar([r["run"] for r in rows], values, bottom=bottom, label=stage)
        bottom = [b + v for b, v in zip(bottom, values)]
    axis.set_ylabel("seconds per optimizer step (steady)")
    axis.legend(fontsize=8)
    axis.tick_params(axis="x", labelsize=8)
    report.figure(figure, "matrix", "Stage time per step for each variant")
    report.shows("matrix", runs.values())
    report.table(Table("Variants (same seed and steps)", ["run", "precision", "processes", "samples/s", "speed-up",
                                                          "s/step", "test acc", "peak GiB"],
                       [[r["run"], r["precision"], str(r["world_size"]), num(r["samples_per_s"], 1),
                         num(r["speedup"], 3), num(r["step_s"], 3), num(r["test_accuracy"], 4),
                         num(r["peak_memory_gib"])] for r in rows], "matrix", align="llrrrrrr"))
    baseline = runs[rows[0]["run"]]
    attribution_rows = []
    for row in rows[1:]:
        for part in reporting.attribution(baseline, runs[row["run"]]):
            attribution_rows.append([f"{rows[0]['run']} -> {row['run']}", part["stage"],
                                     num(part["baseline_s"], 4), num(part["other_s"], 4), f"{part['delta_s']:+.4f}",
                                     num(part["share_of_change"], 1, percent=True)])
    if attribution_rows:
        report.table(Table("Speed-up attribution: per-step stage seconds against the first variant",
                           ["comparison", "stage", "before s", "after s", "change s", "share of change"],
                           attribution_rows, "attribution", align="llrrrr"))


# ---------------------------------------------------------------- W&B


def log_figures_to_wandb(report: Report, out: Path) -> list[str]:
    """Add each figure to the W&B runs it shows, for runs that used W&B (offline ones stay offline)."""
    by_run = {}
    for name, records in report.figure_runs.items():
        for record in records:
            if "wandb" in (record.get("trackers") or {}):
                by_run.setdefault(record["path"], (record, []))[1].append(name)
    logged = []
    for path, (record, names) in by_run.items():
        previous = sorted(Path(path).glob("wandb/*run-*"))
        if not previous:
            continue
        import wandb

        run_id = previous[-1].name.rsplit("-", 1)[-1]
        run = wandb.init(project="trainscope", id=run_id, resume="allow", dir=path,
                         mode=record["trackers"]["wandb"]["mode"],
                         settings=wandb.Settings(x_disable_meta=True, disable_git=True, save_code=False, silent=True))
        run.log({f"report/{name}": wandb.Image(str(out / f"{name}.png")) for name in names})
        run.finish()
        logged.append(record["run_name"])
    return logged


# ---------------------------------------------------------------- main


def build(runs: Path, results: Path, out: Path) -> Report:
    found = reporting.collect(runs, results)
    # Built beside the old report and swapped in at the end: a failure leaves the old one whole.
    staging = out.with_name(f".{out.name}.building")
    if staging.exists():
        shutil.rmtree(staging)
    staging.mkdir(parents=True)
    book = PdfBook(staging / "report.pdf")
    report = Report(staging, book)
    report.markdown += ["# trainscope report", ""]
    book.heading("trainscope report", size=18)
    report.text(f"Built {date.today().isoformat()} from {runs} and {results}.")
    for section in (time_section, loaders_section, amp_section, dp_section, ckpt_section, batch_section,
                    matrix_section):
        section(report, found)
    if found.warnings:
        report.section("Skipped inputs")
        for warning in found.warnings:
            report.text(f"- {warning}")
    book.close()
    (staging / "report.md").write_text("\n".join(report.markdown))
    write_json_atomic(staging / "inputs.json", {"runs": {k: sorted(v) for k, v in found.runs.items()},
                                                "results": {k: v is not None for k, v in found.results.items()},
                                                "warnings": found.warnings})
    if out.exists():
        shutil.rmtree(out)
    staging.rename(out)
    for run_name in log_figures_to_wandb(report, out):
        print(f"logged the report's figures to W&B run {run_name}")
    return report


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", default="runs", help="run records (default runs/)")
    parser.add_argument("--results", default="results", help="sweep results (default results/)")
    parser.add_argument("--out", default="reports", help="output folder, replaced (default reports/)")
    args = parser.parse_args(argv)
    if not Path(args.runs).is_dir() and not Path(args.results).is_dir():
        parser.error(f"neither {args.runs} nor {args.results} exists: run experiments first (make experiments)")
    build(Path(args.runs), Path(args.results), Path(args.out))
    print(f"wrote {Path(args.out) / 'report.md'} and {Path(args.out) / 'report.pdf'}")


if __name__ == "__main__":
    sys.exit(main())
