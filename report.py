"""Every figure and table from what has been run: reports/report.md, reports/report.pdf and the parts.

Reads the run records under --runs (runs/profile, runs/amp, runs/ckpt, runs/batch, runs/matrix and
any other run, with each experiment's comparison.json) and the results under --results (loaders/,
compare_dp/, ddp_cost/, tune/). Rows come from the pure functions in trainscope.reporting; this script
only formats them: PNG and PDF figures, booktabs LaTeX tables, one Markdown report and one PDF report
(matplotlib, no TeX needed). Every figure is followed by the health warnings of the runs it shows.
An experiment that has not been run becomes a line naming the make target that produces it; a
corrupt, foreign or unknown-schema record is skipped with a one-line reason, listed in the report.
reports/inputs.json lists every file read with its sha256, and the report's provenance.

    python report.py [--runs runs] [--results results] [--out reports]
    python report.py --advise RUN_FOLDER          # what to try next for one run (no report written)
"""

import argparse
import shutil
import statistics
import sys
from datetime import date
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.backends.backend_pdf import PdfPages  # noqa: E402

from trainscope import advisor, bench, figures, provenance, reporting  # noqa: E402
from trainscope.records import read_record, write_json_atomic, write_text_atomic  # noqa: E402

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

    def begin(self, title: str, inputs, experiment: str) -> bool:
        """Open a section; when its inputs are missing, say which make target produces them and return False."""
        self.markdown += [f"## {title}", ""]
        self.book.heading(title)
        if not inputs:
            self.text(reporting.missing(experiment))
            return False
        return True

    def text(self, line: str):
        self.markdown += [line, ""]
        self.book.text(line)

    def figure(self, figure, name: str, caption: str, records=()):
        """A figure, then the health warnings of the runs it shows."""
        self.markdown += [f"![{caption}]({name}.png)", ""]
        self.book.image(figure)
        self.files += figures.save_figure(figure, self.out / name, bbox_inches="tight")
        self.figure_runs.setdefault(name, []).extend(records)
        self.warnings(records)

    def warnings(self, records):
        lines = reporting.warnings_of(records)
        if lines:
            self.text("Warnings for these figures:\n" + "\n".join(f"- {line}" for line in lines))

    def table(self, table: Table):
        path = self.out / f"{table.label}.tex"
        write_text_atomic(path, table.latex())
        self.files.append(path)
        self.markdown += [f"**{table.title}** (LaTeX: `{path.name}`)", "", table.markdown(), ""]
        self.book.table(table)

    def code(self, text: str, language: str = ""):
        self.markdown += [f"```{language}", text, "```", ""]
        self.book.text(text, size=6, monospace=True)


def ranged(value, bounds, digits=2) -> str:
    """'12.34 (12.01-12.80)': a median with its min-max over rounds."""
    if value is None:
        return "n/a"
    return num(value, digits) + (f" ({num(bounds[0], digits)}-{num(bounds[1], digits)})" if bounds and bounds[0] != bounds[1] else "")


def speed_cells(row: dict) -> list[str]:
    speed = row.get("speed")
    return [bench.ratio_text(speed), speed["verdict"]] if speed else ["baseline", ""]


def open_on_main_run(report: Report, found: reporting.Collected, title: str) -> dict | None:
    """Open a section about the report's main run (the unprofiled one); None when there is no such run."""
    record = reporting.pick_breakdown_run(found)
    return record if report.begin(title, record, "profile") else None


def time_section(report: Report, found: reporting.Collected):
    record = open_on_main_run(report, found, "Where the time went")
    if record is None:
        return
    breakdown = reporting.time_breakdown(record)
    report.text(f"From run `{breakdown['run']}`, which ran without the profiler"
                + ("." if "profile" in found.runs else f" ({reporting.missing('profile')})"))
    figure, axis = plt.subplots(figsize=(6.5, 4.5))
    shown = [c for c in breakdown["categories"] if c["percent"] > 0]
    axis.pie([c["seconds"] for c in shown], labels=[f"{c['name']}\n{c['percent']:.1f}%" for c in shown],
             startangle=90, counterclock=False, wedgeprops={"linewidth": 1, "edgecolor": "white"})
    axis.set_title(f"{breakdown['run']}: {breakdown['wall_s']:.1f} s on {breakdown['world_size']} x "
                   f"{breakdown['device']} ({breakdown['precision']}, profiler off)", fontsize=9)
    report.figure(figure, "time_breakdown", "Share of wall time per category", [record])
    rows = [[c["name"], num(c["seconds"]), num(c["percent"], 1) + "%"] for c in breakdown["categories"]]
    rows += [[f"  stage: {s['name']}", num(s["seconds"]), num(s["percent"], 1) + "%"] for s in breakdown["stages"]]
    rows.append(["wall time", num(breakdown["wall_s"]), "100.0%"])
    report.table(Table("Where the time went (median over ranks, profiler off): the five categories, then the stages",
                       ["category / stage", "seconds", "share"], rows, "time_breakdown"))
    top_operators_part(report, found)


def top_operators_part(report: Report, found: reporting.Collected):
    profiled = found.runs.get("profile", {}).get("profiled-r0")
    top = ((profiled or {}).get("summary", {}).get("profile") or {}).get("top_operators")
    if not top:
        return
    rows = [[op["name"][:60], str(op["calls"]), num((op["self_device_s"] if op["self_device_s"] is not None
                                                     else op["self_cpu_s"]) * 1e3)] for op in top[:10]]
    report.table(Table("Top operators by self time (torch.profiler window of a separate, profiled run)",
                       ["operator", "calls", "ms"], rows, "top_operators"))
    overhead = (found.comparisons.get("profile") or {}).get("profiler_overhead")
    if overhead:
        window = profiled["summary"]["profile"]["window"]
        report.text(f"Profiler overhead on the traced steps {window['first_step']}-{window['last_step']}: profiled / "
                    f"unprofiled step time {overhead['total_ratio']:.2f}x (per step {overhead['median']:.2f}x, "
                    f"{overhead['min']:.2f}-{overhead['max']:.2f}); the same steps and batches in both runs.")


def loaders_section(report: Report, found: reporting.Collected):
    sweep = found.results.get("loaders")
    if not report.begin("DataLoader num_workers", sweep, "loaders"):
        return
    machine = sweep["machine"]
    report.text(f"{machine['device_name']}, {machine['usable_cores']} usable cores "
                f"({machine['cpu_budget_per_process']} per training process), {sweep['dataset_rows']} training rows, "
                f"{sweep['sweep']['repeats']} repeats in alternating order. PyTorch's default is num_workers="
                f"{sweep['pytorch_default_num_workers']} (loading in the training process).")
    report.figure(figures.loaders_figure(sweep), "loaders", "Pass time against num_workers")
    rows = []
    for s in sweep["summary"]["settings"]:
        passes = s["metric"] == "pass_s"
        cell = (lambda v: num(v, 3)) if passes else (lambda v: num(v, 1, percent=True))
        rows.append([s["mode"], str(s["batch_size"]), "on" if s["pin_memory"] else "off", str(s["num_workers"]),
                     f"{cell(s['median'])} ({'s/pass' if passes else 'data share'})", f"{cell(s['min'])} - {cell(s['max'])}",
                     num(s.get("median_first_batch_s"), 3)])
    report.table(Table("DataLoader sweep: median over repeats, min - max", ["mode", "batch", "pin", "workers",
                       "median", "range", "first batch s"], rows, "loaders", align="lrlrrrr"))
    for name, curve in sweep["summary"]["curves"].items():
        against = curve.get("knee_against_default")
        report.text(f"- {name}: knee at {curve['knee_workers']} workers, best {curve['best_workers']}"
                    + (f"; knee against the default: {bench.describe(against)}" if against else "")
                    + f" (`{curve['flags']}`)")


def amp_section(report: Report, found: reporting.Collected):
    comparison, runs = found.comparisons.get("amp"), found.runs.get("amp", {})
    if not report.begin("Mixed precision vs FP32", comparison and runs, "amp"):
        return
    records = reporting.first_round_runs(comparison, runs)
    figure, axis = plt.subplots(figsize=(7, 4))
    for name, (steps, losses) in reporting.loss_curves(records).items():
        axis.plot(steps, losses, marker=".", label=f"{name} ({records[name]['environment']['effective_precision']})")
    axis.set_xlabel("optimizer step")
    axis.set_ylabel("training loss")
    axis.grid(alpha=0.3)
    axis.legend()
    report.figure(figure, "amp_loss", "Training loss, FP32 and mixed precision", list(records.values()))
    rows = reporting.arm_rows(comparison)
    table_rows = [[r["arm"], r.get("precision", "-"), num(r.get("validation_accuracy"), 4), num(r.get("test_accuracy"), 4),
                   num(r.get("samples_per_s"), 1), num(r.get("peak_memory_gib")), *speed_cells(r)] for r in rows]
    report.table(Table("Mixed precision vs FP32 (one run each, same seed, steps and threads)",
                       ["config", "precision", "val acc", "test acc", "samples/s", "peak GiB", "speed vs fp32", "verdict"],
                       table_rows, "amp", align="llrrrrrl"))
    for name, against in comparison["comparisons"].items():
        by_interval = against.get("speed_by_interval")
        if by_interval:
            report.text(f"`{name}` against `{comparison['baseline']}`, per logged interval (the same steps and batches): "
                        f"{bench.describe(by_interval)}.")


def dp_section(report: Report, found: reporting.Collected):
    result = found.results.get("compare_dp")
    if not report.begin("DataParallel vs DDP", result, "compare_dp"):
        return
    report.text(result["machine"]["hardware"]["note"])
    report.figure(figures.compare_dp_figure(result), "compare_dp", "Throughput and per-device memory")
    rows = []
    for row in figures.compare_dp_rows(result):
        if "status" in row:
            rows.append([row["variant"], "not measurable here", "", "", "", ""])
        else:
            rows.append([row["variant"], row["runs_on"], ranged(row["samples_per_s"], (row["samples_per_s_min"],
                         row["samples_per_s_max"]), 1), row["speed"], row["verdict"], num(row["final_loss"], 4)])
    report.table(Table(f"DataParallel vs DDP on {result['machine']['device_name']} ({result['compare']['rounds']} "
                       "alternating rounds)", ["variant", "runs on", "samples/s", "speed vs single", "verdict",
                                               "final loss"], rows, "compare_dp", align="llrrll"))
    reconcile_with_matrix(report, result, found.comparisons.get("matrix"))
    for diff in result["code_changes"]:
        report.text(f"From `single_device` to `{diff['to']}`: {diff['changed_lines']} changed lines "
                    f"(+{diff['added']} -{diff['removed']}).")
        report.code(diff["diff"], "diff")
    report.text(result["projection"]["assumptions"])


def reconcile_with_matrix(report: Report, result: dict, matrix: dict | None):
    """compare_dp.py and `make matrix` both ask what DDP gives here: show both answers and why they differ."""
    ddp = result["comparison"].get("ddp")
    against = ((matrix or {}).get("comparisons") or {}).get("ddp", {}).get("speed")
    if not (ddp and against):
        return
    report.text(f"The same question twice: compare_dp.py's bare loops put DDP at {bench.describe(ddp['speed'])}; "
                f"`make matrix` (train.py, `ddp` against `{matrix['baseline']}`) at {bench.describe(against)}. Both give "
                "the two sides the same cores; they differ in what they time: compare_dp.py times the loop alone "
                "(no Accelerate, dropout off, a fixed global batch split over the processes), the matrix times "
                "train.py's steady steps with the per-process batch kept (each DDP step trains twice the samples).")


def arm_table(report: Report, comparison: dict, title: str, label: str):
    rows = []
    for r in reporting.arm_rows(comparison):
        if r["status"] != "complete":
            rows.append([r["arm"], f"{r['config']} {r['flags']}".strip(), f"skipped: {r['reason']}", "", "", "", ""])
            continue
        rows.append([r["arm"], f"{r['config']} {r['flags']}".strip(), ranged(r["samples_per_s"], r["samples_per_s_range"], 1),
                     ranged(r["step_s"], r["step_s_range"], 3), *speed_cells(r), num(r["peak_memory_gib"])])
    report.table(Table(title, ["arm", "config + flags", "samples/s", "s/step", "speed vs baseline", "verdict",
                               "peak GiB"], rows, label, align="llrrrlr"))


def ckpt_section(report: Report, found: reporting.Collected):
    comparison, runs = found.comparisons.get("ckpt"), found.runs.get("ckpt", {})
    if not report.begin("Activation checkpointing", comparison and runs, "ckpt"):
        return
    rows = [r for r in reporting.arm_rows(comparison) if r["status"] == "complete"]
    figure, (time_axis, memory_axis) = plt.subplots(1, 2, figsize=(8, 3.5))
    labels = [r["arm"] for r in rows]
    time_axis.bar(labels, [r["step_s"] for r in rows], yerr=_errors(rows, "step_s"), capsize=4, color="tab:blue")
    time_axis.set_ylabel("seconds per optimizer step (median, min-max)")
    memory_axis.bar(labels, [r["peak_memory_gib"] for r in rows], color="tab:orange")
    memory_axis.set_ylabel(f"peak memory GiB ({rows[0]['memory_kind']})")
    figure.tight_layout()
    report.figure(figure, "ckpt", "Activation checkpointing: time and memory",
                  list(reporting.first_round_runs(comparison, runs).values()))
    arm_table(report, comparison, f"Activation checkpointing off and on ({comparison['rounds']} alternating rounds)", "ckpt")
    for name, against in comparison["comparisons"].items():
        report.text(f"`{name}`: memory {against['memory_ratio']['median']:.2f}x the baseline's, speed "
                    f"{bench.describe(against['speed'])}.")
    if rows[0]["memory_kind"] == "peak RSS":
        report.text("On a CPU the memory column is the process's peak RSS, which includes the Python runtime and "
                    "libraries; activation savings show in full as device memory on a GPU.")


def _errors(rows: list[dict], metric: str) -> list[list[float]]:
    return [[r[metric] - r[f"{metric}_range"][0] for r in rows], [r[f"{metric}_range"][1] - r[metric] for r in rows]]


def batch_section(report: Report, found: reporting.Collected):
    comparison = found.comparisons.get("batch")
    if not report.begin("Batch size", comparison, "batch"):
        return
    rows = sorted([r for r in reporting.arm_rows(comparison) if r["status"] == "complete"], key=lambda r: int(r["arm"][2:]))
    if rows:
        figure, axis = plt.subplots(figsize=(7, 4))
        sizes = [int(r["arm"][2:]) for r in rows]
        axis.errorbar(sizes, [r["samples_per_s"] for r in rows], yerr=_errors(rows, "samples_per_s"), marker="o",
                      capsize=4, color="tab:blue")
        axis.set_xscale("log", base=2)
        axis.set_xlabel("per-device batch size")
        axis.set_ylabel("samples/s (median, min-max)", color="tab:blue")
        twin = axis.twinx()
        twin.plot(sizes, [r["peak_memory_gib"] for r in rows], marker="s", color="tab:orange")
        twin.set_ylabel(f"peak memory GiB ({rows[0]['memory_kind']})", color="tab:orange")
        axis.set_ylim(bottom=0)
        twin.set_ylim(bottom=0)
        report.figure(figure, "batch", "Throughput and memory against batch size",
                      list(reporting.first_round_runs(comparison, found.runs.get("batch", {})).values()))
    arm_table(report, comparison, f"Batch-size sweep ({comparison['rounds']} alternating rounds; baseline: the "
              "configured batch)", "batch")
    advice = comparison.get("recommendation") or {}
    report.text(f"Largest batch that fits: {comparison.get('largest_fitting_batch') or advice.get('largest_swept_that_fits')}"
                f" ({comparison.get('search')}). Fastest: {advice.get('fastest_batch_size')} "
                f"({advice.get('fastest_verdict')} against the baseline). Keeping the effective batch of "
                f"{advice.get('effective_batch')}: `{advice.get('flags', 'no swept batch divides it')}`.")


def matrix_section(report: Report, found: reporting.Collected):
    comparison, runs = found.comparisons.get("matrix"), found.runs.get("matrix", {})
    if not report.begin("Configs and switches side by side", comparison and runs, "matrix"):
        return
    records = reporting.first_round_runs(comparison, runs)
    names = list(records)
    stages = ("data", "forward", "backward", "optimizer", "other")
    per_step = {name: reporting.stage_seconds_per_step(records[name]) for name in names}
    figure, axis = plt.subplots(figsize=(8, 4))
    bottom = [0.0] * len(names)
    for stage in stages:
        values = [per_step[n][stage] for n in names]
        axis.bar(names, values, bottom=bottom, label=stage)
        bottom = [b + v for b, v in zip(bottom, values)]
    axis.set_ylabel("seconds per optimizer step (steady, first round)")
    axis.legend(fontsize=8)
    axis.tick_params(axis="x", labelsize=8)
    report.figure(figure, "matrix", "Stage time per step for each variant", list(records.values()))
    arm_table(report, comparison, f"Variants (same seed and steps, {comparison['rounds']} alternating rounds)", "matrix")
    attribution_rows = []
    for name in names[1:]:
        for part in reporting.attribution(records[names[0]], records[name]):
            attribution_rows.append([f"{names[0]} -> {name}", part["stage"], num(part["baseline_s"], 4),
                                     num(part["other_s"], 4), f"{part['delta_s']:+.4f}",
                                     num(part["share_of_change"], 1, percent=True)])
    if attribution_rows:
        report.table(Table("Speed-up attribution: per-step stage seconds against the first variant (first round)",
                           ["comparison", "stage", "before s", "after s", "change s", "share of change"],
                           attribution_rows, "attribution", align="llrrrr"))


def ddp_cost_section(report: Report, found: reporting.Collected):
    comparison, runs = found.comparisons.get("ddp_cost"), found.runs.get("ddp_cost", {})
    if not report.begin("What DDP communication costs", comparison and runs, "ddp_cost"):
        return
    records = reporting.first_round_runs(comparison, runs)
    default = (records.get("default") or {}).get("summary", {}).get("communication") or {}
    if default.get("measured"):
        step = records["default"]["summary"]["throughput"]["step_s"]
        compute = statistics.median(r["compute_s"] for r in default["per_rank"])
        report.text(f"Where a DDP step goes with DDP's defaults ({default['world_size']} processes, first round): "
                    f"{step * 1e3:.1f} ms per step, of which exposed communication {default['exposed_s'] * 1e3:.1f} ms "
                    f"({default['exposed_share']:.1%}); the same all-reduce alone takes {default['total_allreduce_s'] * 1e3:.1f} ms "
                    f"({default['bus_bandwidth_gbs']:.2f} GB/s bus bandwidth), so {default['overlap']:.0%} of it hides behind "
                    f"backward. Compute (forward and backward without the all-reduce): {compute * 1e3:.1f} ms per rank.")
    report.figure(figures.ddp_cost_figure(comparison), "ddp_cost", "Step time and exposed communication by DDP setting",
                  list(records.values()))
    rows = []
    for r in figures.ddp_cost_rows(comparison):
        if "skipped" in r:
            rows.append([r["setting"], r["flags"], f"skipped: {r['skipped']}", "", "", "", "", ""])
            continue
        rows.append([r["setting"], r["flags"], ranged(r["step_s"], r["step_s_range"], 3), *speed_cells(r),
                     num((r["exposed_s"] or 0) * 1e3, 1) if r["exposed_s"] is not None else "n/a",
                     num((r["total_allreduce_s"] or 0) * 1e3, 1) if r["total_allreduce_s"] is not None else "n/a",
                     num(r["overlap"], 0, percent=True)])
    report.table(Table(f"DDP settings against DDP's defaults ({comparison['rounds']} alternating rounds)",
                       ["setting", "flags", "s/step", "speed vs default", "verdict", "exposed ms", "all-reduce ms",
                        "overlap"], rows, "ddp_cost", align="llrrlrrr"))
    best = comparison.get("best") or {}
    report.text(f"Best setting here: `{best.get('setting')}`" + (f" (`{' '.join(best['flags'])}`), "
                f"{bench.describe(best['speed'])}" if best.get("speed") else ": no setting was faster than DDP's "
                "defaults outside noise") + ".")
    ring = comparison.get("ring_model")
    if ring:
        report.text(f"The measured all-reduce of {ring['gradient_bytes'] / 1e6:.1f} MB over {ring['world_size']} processes "
                    f"took {ring['measured_s'] * 1e3:.1f} ms ({ring['measured_bus_bandwidth_gbs']:.2f} GB/s); the ring "
                    "model with compare_dp.py's presets predicts "
                    + ", ".join(f"{name} {p['model_s'] * 1e3:.2f} ms (measured {p['measured_over_model']:.0f}x)"
                                for name, p in ring["presets"].items())
                    + ". `compare_dp.py --ddp-cost` projects with the measured bandwidth beside the presets.")


def optimization_section(report: Report, found: reporting.Collected):
    """The homework's 'propose one way to optimize', from the measured shares of the report's main run."""
    record = open_on_main_run(report, found, "Optimization: what to try next")
    if record is None:
        return
    suggestions = advisor.advise(record)
    report.text(f"From run `{record['run_name']}` (`python report.py --advise {record['path']}`); each bound is "
                "Amdahl's law on the measured share it would shrink. `make tune` tries them and keeps what is faster.")
    report.code("\n".join(advisor.lines(suggestions[:6])))
    tune = found.comparisons.get("tune")
    if tune:
        report.table(Table("make tune: each suggestion against the baseline, then the kept ones together",
                           ["trial", "flags", "bound", "speed (wall)", "verdict", "result"],
                           [[t["name"], " ".join(t["flags"]), num(t.get("bound")), t["speed_text"], t["verdict"],
                             t["result"]] for t in tune["trials"]], "tune", align="llrrll"))
        report.text(f"Kept: `{tune['final_command']}`. {tune['summary']}")


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

SECTIONS = [time_section, optimization_section, loaders_section, amp_section, dp_section, ddp_cost_section,
            ckpt_section, batch_section, matrix_section]


def write_section(report: Report, found: reporting.Collected, section) -> None:
    """One section; a results file of another shape (an older trainscope's, a hand-edited one) skips the
    section with its reason instead of ending the report. Its markdown is taken back; the PDF says why."""
    start = len(report.markdown)
    try:
        section(report, found)
    except (KeyError, TypeError, ValueError, IndexError) as error:
        name = section.__name__.removesuffix("_section")
        why = f"{type(error).__name__}: {error}"
        del report.markdown[start:]
        found.skipped.append(f"section {name}: its inputs lack what it reads ({why})")
        print(f"warning: skipped section {name}: {why}", file=sys.stderr)
        report.book.text(f"(section {name} skipped: {why})")


def build(runs: Path, results: Path, out: Path) -> Report:
    found = reporting.collect(runs, results)
    for line in found.skipped:
        print(f"warning: skipped {line}", file=sys.stderr)
    # Built beside the old report and swapped in at the end: a failure leaves the old one whole.
    staging = out.with_name(f".{out.name}.building")
    if staging.exists():
        shutil.rmtree(staging)
    staging.mkdir(parents=True)
    book = PdfBook(staging / "report.pdf")
    report = Report(staging, book)
    report.markdown += ["# trainscope report", ""]
    book.heading("trainscope report", size=18)
    report.text(f"Built {date.today().isoformat()} from {runs} and {results}: {len(found.inputs)} input files, listed "
                "with their sha256 in inputs.json.")
    for section in SECTIONS:
        write_section(report, found, section)
    if found.skipped:
        report.begin("Skipped inputs", True, "")
        for line in found.skipped:
            report.text(f"- {line}")
    block = provenance.collect(inputs=found.inputs)
    report.markdown += provenance.markdown(block)
    book.close()
    write_text_atomic(staging / "report.md", "\n".join(report.markdown) + "\n")
    write_json_atomic(staging / "inputs.json", {"provenance": block, "skipped": found.skipped,
                                                "runs": {k: sorted(v) for k, v in found.runs.items()},
                                                "results": {k: v is not None for k, v in found.results.items()}})
    if out.exists():
        shutil.rmtree(out)
    staging.rename(out)
    for run_name in log_figures_to_wandb(report, out):
        print(f"logged the report's figures to W&B run {run_name}")
    return report


def advise(run: str) -> None:
    """Print the ranked suggestions for one run (its folder or its record.json)."""
    folder = Path(run).parent if run.endswith(".json") else Path(run)
    try:
        record = read_record(folder)
        if record.get("status") != "complete":
            raise ValueError(f"{folder / 'record.json'}: status {record.get('status')!r}; advice needs a complete run")
    except ValueError as error:
        print(f"error: {' '.join(str(error).split())}", file=sys.stderr)
        sys.exit(2)
    print(f"What to try next for {record['run_name']} (ranked; bounds from the measured shares):")
    print("\n".join(advisor.lines(advisor.advise(record))))


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", default="runs", help="run records (default runs/)")
    parser.add_argument("--results", default="results", help="sweep and benchmark results (default results/)")
    parser.add_argument("--out", default="reports", help="output folder, replaced (default reports/)")
    parser.add_argument("--advise", metavar="RUN", help="print what to try next for one run (its folder) and stop")
    args = parser.parse_args(argv)
    if args.advise:
        return advise(args.advise)
    if not Path(args.runs).is_dir() and not Path(args.results).is_dir():
        parser.error(f"neither {args.runs} nor {args.results} exists: run experiments first (make experiments)")
    build(Path(args.runs), Path(args.results), Path(args.out))
    print(f"wrote {Path(args.out) / 'report.md'} and {Path(args.out) / 'report.pdf'}")


if __name__ == "__main__":
    sys.exit(main())
