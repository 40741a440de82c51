"""The one table layer: a `Table` (headers and string cells, computed from rows elsewhere) written as Markdown or
booktabs LaTeX and set in the report's PDF (trainscope.report.book), its cells, and saving a figure as PNG and PDF."""

from pathlib import Path

LATEX_SPECIALS = {
    "\\": r"\textbackslash{}",
    "&": r"\&",
    "%": r"\%",
    "$": r"\$",
    "#": r"\#",
    "_": r"\_",
    "{": r"\{",
    "}": r"\}",
    "~": r"\textasciitilde{}",
    "^": r"\textasciicircum{}",
}


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
        lines = [
            "| " + " | ".join(markdown_cell(h) for h in self.headers) + " |",
            "|" + "|".join("---" if a == "l" else "---:" for a in self.align) + "|",
        ]
        return lines + ["| " + " | ".join(markdown_cell(cell) for cell in row) + " |" for row in self.rows]

    def markdown(self) -> str:
        return "\n".join(self.markdown_lines())

    def latex(self) -> str:
        lines = [
            r"\begin{table}[t]",
            r"\centering",
            rf"\begin{{tabular}}{{{self.align}}}",
            r"\toprule",
            " & ".join(latex_escape(h) for h in self.headers) + r" \\",
            r"\midrule",
        ]
        lines += [" & ".join(latex_escape(cell) for cell in row) + r" \\" for row in self.rows]
        lines += [
            r"\bottomrule",
            r"\end{tabular}",
            rf"\caption{{{latex_escape(self.title)}}}",
            rf"\label{{tab:{self.label}}}",
            r"\end{table}",
        ]
        return "\n".join(lines) + "\n"


# ---------------------------------------------------------------- cells


def markdown_cell(cell) -> str:
    """A cell's text with its pipes escaped: a `|` (as in "median |error|") would end the cell."""
    return str(cell).replace("\\|", "|").replace("|", "\\|")


def num(value, digits=2, percent=False) -> str:
    if value is None:
        return "n/a"
    return f"{100 * value:.{digits}f}%" if percent else f"{value:.{digits}f}"


def ranged(value, bounds, digits=2) -> str:
    """'12.34 (12.01-12.80)': a median with its min-max over rounds."""
    if value is None:
        return "n/a"
    return num(value, digits) + (
        f" ({num(bounds[0], digits)}-{num(bounds[1], digits)})" if bounds and bounds[0] != bounds[1] else ""
    )


def spread_cell(spread: dict | None, digits=2) -> str:
    """A {median, min, max} spread as '12.34 (12.01-12.80)'."""
    if not spread:
        return "n/a"
    return ranged(spread["median"], (spread["min"], spread["max"]), digits)


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
