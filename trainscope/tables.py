"""The one table layer: Markdown and booktabs LaTeX tables, the PDF book, the report's section writer, and
saving a figure as PNG and PDF.

Every script and report that shows a table builds a `Table` (headers and string cells, computed from
rows elsewhere) and asks it for Markdown or LaTeX; the report draws the same tables into its PDF.

    table = Table("DDP settings", ["setting", "s/step"], [["default", "0.41"]], label="ddp_cost")
    table.markdown(); table.latex()
"""

import textwrap
from pathlib import Path

LATEX_SPECIALS = {"\\": r"\textbackslash{}", "&": r"\&", "%": r"\%", "$": r"\$", "#": r"\#", "_": r"\_",
                  "{": r"\{", "}": r"\}", "~": r"\textasciitilde{}", "^": r"\textasciicircum{}"}


def latex_escape(text) -> str:
    return "".join(LATEX_SPECIALS.get(ch, ch) for ch in str(text))


class Table:
    """Headers and string cells, written as Markdown or booktabs LaTeX (and drawn into the PDF book).

    `align` has one letter per column: l (left) or r (right); by default the first column is left.
    """

    def __init__(self, title: str, headers: list[str], rows: list[list[str]], label: str, align: str | None = None):
        self.title, self.headers, self.rows, self.label = title, headers, rows, label
        self.align = align or "l" + "r" * (len(headers) - 1)
        if len(self.align) != len(headers) or any(len(row) != len(headers) for row in rows):
            raise ValueError(f"table {label!r}: every row and the alignment need {len(headers)} cells")

    def markdown_lines(self) -> list[str]:
        lines = ["| " + " | ".join(self.headers) + " |",
                 "|" + "|".join("---" if a == "l" else "---:" for a in self.align) + "|"]
        return lines + ["| " + " | ".join(str(cell) for cell in row) + " |" for row in self.rows]

    def markdown(self) -> str:
        return "\n".join(self.markdown_lines())

    def latex(self) -> str:
        lines = [r"\begin{table}[t]", r"\centering", rf"\begin{{tabular}}{{{self.align}}}", r"\toprule",
                 " & ".join(latex_escape(h) for h in self.headers) + r" \\", r"\midrule"]
        lines += [" & ".join(latex_escape(cell) for cell in row) + r" \\" for row in self.rows]
        lines += [r"\bottomrule", r"\end{tabular}", rf"\caption{{{latex_escape(self.title)}}}",
                  rf"\label{{tab:{self.label}}}", r"\end{table}"]
        return "\n".join(lines) + "\n"


# ---------------------------------------------------------------- cells


def num(value, digits=2, percent=False) -> str:
    if value is None:
        return "n/a"
    return f"{100 * value:.{digits}f}%" if percent else f"{value:.{digits}f}"


def ranged(value, bounds, digits=2) -> str:
    """'12.34 (12.01-12.80)': a median with its min-max over rounds."""
    if value is None:
        return "n/a"
    return num(value, digits) + (f" ({num(bounds[0], digits)}-{num(bounds[1], digits)})"
                                 if bounds and bounds[0] != bounds[1] else "")


def spread_cell(spread: dict | None, digits=2) -> str:
    """A {median, min, max} spread as '12.34 (12.01-12.80)'."""
    if not spread:
        return "n/a"
    return ranged(spread["median"], (spread["min"], spread["max"]), digits)


# ---------------------------------------------------------------- the PDF book


class PdfBook:
    """A4 pages filled top to bottom with headings, text, figures (rasterized) and tables."""

    WIDTH, HEIGHT, MARGIN = 8.27, 11.69, 0.6

    def __init__(self, path: Path):
        from matplotlib.backends.backend_pdf import PdfPages

        self.plt = pyplot()
        self.pdf = PdfPages(path)
        self.page = None
        self._new_page()

    def _new_page(self):
        if self.page is not None:
            self.pdf.savefig(self.page)
            self.plt.close(self.page)
        self.page = self.plt.figure(figsize=(self.WIDTH, self.HEIGHT))
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
        self.plt.close(self.page)
        self.pdf.close()


class ReportWriter:
    """Each section goes to report.md, to report.pdf, and to its own PNG/PDF figures and .tex tables."""

    def __init__(self, out: Path, book: PdfBook):
        self.out = out
        self.book = book
        self.markdown: list[str] = []
        self.files: list[Path] = []
        self.figure_runs: dict[str, list[dict]] = {}  # figure name -> the records it shows

    def begin(self, title: str, inputs, missing_line: str) -> bool:
        """Open a section; when its inputs are missing, write `missing_line` (which make target produces
        them) and return False."""
        self.markdown += [f"## {title}", ""]
        self.book.heading(title)
        if not inputs:
            self.text(missing_line)
            return False
        return True

    def text(self, line: str):
        self.markdown += [line, ""]
        self.book.text(line)

    def figure(self, figure, name: str, caption: str, records=()):
        """A figure, then the health warnings of the runs it shows."""
        from trainscope.record_view import warning_lines

        self.markdown += [f"![{caption}]({name}.png)", ""]
        self.book.image(figure)
        self.files += save_figure(figure, self.out / name, bbox_inches="tight")
        self.figure_runs.setdefault(name, []).extend(records)
        lines = warning_lines(records)
        if lines:
            self.text("Warnings for these figures:\n" + "\n".join(f"- {line}" for line in lines))

    def table(self, table: Table):
        from trainscope.records import write_text_atomic

        path = self.out / f"{table.label}.tex"
        write_text_atomic(path, table.latex())
        self.files.append(path)
        self.markdown += [f"**{table.title}** (LaTeX: `{path.name}`)", "", table.markdown(), ""]
        self.book.table(table)

    def code(self, text: str, language: str = ""):
        self.markdown += [f"```{language}", text, "```", ""]
        self.book.text(text, size=6, monospace=True)


# ---------------------------------------------------------------- figures


def pyplot():
    """matplotlib's pyplot on the Agg backend (no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(figure, stem: Path, **savefig_options) -> list[Path]:
    """Write a matplotlib figure as stem.png and stem.pdf and close it."""
    paths = [Path(f"{stem}.{suffix}") for suffix in ("png", "pdf")]
    for path in paths:
        figure.savefig(path, dpi=150, **savefig_options)
    pyplot().close(figure)
    return paths
