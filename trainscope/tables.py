"""The one table layer: Markdown and booktabs LaTeX tables, the PDF book, the report's section writer, and
saving a figure as PNG and PDF.

Every script and report that shows a table builds a `Table` (headers and string cells, computed from
rows elsewhere) and asks it for Markdown or LaTeX; the report draws the same tables into its PDF.

    table = Table("DDP settings", ["setting", "s/step"], [["default", "0.41"]], label="ddp_cost")
    table.markdown(); table.latex()
"""

from dataclasses import dataclass
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


# ---------------------------------------------------------------- the PDF book: fonts and line breaking

POINT = 1 / 72  # inch
LEADING = 1.3  # line height / font size
ASCENT, DESCENT = 0.928, 0.236  # DejaVu's ascender and descender, in font sizes
CONTINUED = "\u21aa "  # the mark of a code line broken to fit the page


@dataclass(frozen=True)
class Font:
    """A face and size the book draws with. Widths come from the font's own unhinted glyph advances and
    kerning (matplotlib's TextToPath), which is how the PDF backend places the glyphs, plus a margin
    for rounding; the tests hold them to the drawn glyphs' boxes."""

    size: float
    family: str = "DejaVu Sans"
    weight: str = "normal"
    style: str = "normal"

    @property
    def line(self) -> float:
        return self.size * LEADING

    def advances(self) -> "Advances":
        if self not in _ADVANCES:
            _ADVANCES[self] = Advances(self)
        return _ADVANCES[self]

    def width(self, text: str) -> float:
        """Points that `text` takes on one line."""
        return self.advances().width(text)

    def baseline(self, top: float, index: int) -> float:
        """The baseline of line `index` of a block whose top is `top` (points from the page's bottom)."""
        return top - index * self.line - (self.line - (ASCENT + DESCENT) * self.size) / 2 - ASCENT * self.size

    def properties(self):
        from matplotlib.font_manager import FontProperties

        return FontProperties(family=self.family, weight=self.weight, style=self.style, size=self.size)


class Advances(dict):
    """A font's advance (points) of each word measured, measured once; a line is its words' advances and its
    spaces' (kerning across a space is nil), with the margin."""

    MARGIN = (1.01, 0.5)  # times, plus points

    SCALE = 100.0  # the size (points at 72 dpi) measured at, as matplotlib's TextToPath does

    def __init__(self, font: Font):
        from matplotlib.font_manager import findfont, get_font

        super().__init__()
        self.face = get_font(findfont(font.properties()))
        self.scale = font.size / self.SCALE
        self.space = self[" "]

    def __missing__(self, word: str) -> float:
        from matplotlib.ft2font import LoadFlags

        self.face.set_size(self.SCALE, 72)  # the face is shared: sized on every use, as matplotlib does
        self.face.set_text(word, 0.0, flags=LoadFlags.NO_HINTING)
        value = self[word] = self.face.get_width_height()[0] / 64 * self.scale
        return value

    def fits(self, raw: float, width: float) -> bool:
        """Whether a line of `raw` advances fits `width`, the margin added."""
        return raw * self.MARGIN[0] + self.MARGIN[1] <= width + 1e-6

    def raw(self, text: str) -> float:
        words = text.split(" ")
        return sum(self[word] for word in words if word) + (len(words) - 1) * self.space

    def width(self, text: str) -> float:
        return self.raw(text) * self.MARGIN[0] + self.MARGIN[1] if text else 0.0


_ADVANCES: dict[Font, Advances] = {}


def wrap(text: str, width: float, font: Font) -> list[str]:
    """The lines of `text` within `width` points: words whole where they fit, a word wider than a line broken
    (after a '/', '-', '_', ',' or '=' near its end where there is one); a line's indent kept and a list
    item's text hung under its first word."""
    advances, lines = font.advances(), []
    for paragraph in text.split("\n"):
        body = paragraph.lstrip(" ")
        indent = paragraph[: len(paragraph) - len(body)]
        hang = indent + ("  " if body.startswith(("- ", "* ")) else "")
        limit = max(width - advances.width(hang), font.size)
        prefix, words, used = indent, [], advances.raw(indent)
        for word in body.split():
            if not advances.fits(advances[word], limit):  # alone it is too wide: lines of its own pieces
                if words:
                    lines.append(prefix + " ".join(words))
                    prefix, words = hang, []
                *whole, word = _break(word, limit, font)
                for piece in whole:
                    lines.append(prefix + piece)
                    prefix = hang
                used = advances.raw(prefix)
            elif words and not advances.fits(used + advances.space + advances[word], width):
                lines.append(prefix + " ".join(words))
                prefix, words, used = hang, [], advances.raw(hang)
            used += (advances.space if words else 0.0) + advances[word]
            words.append(word)
        lines.append(prefix + " ".join(words))
    return lines


def _break(word: str, width: float, font: Font) -> list[str]:
    pieces = []
    while font.width(word) > width + 1e-6:
        low, high = 1, len(word) - 1  # the longest head that fits (at least one character)
        while low < high:
            middle = (low + high + 1) // 2
            low, high = (middle, high) if font.width(word[:middle]) <= width else (low, middle - 1)
        fit = low
        after = max(word.rfind(mark, 0, fit) for mark in "/-_,=")
        cut = after + 1 if after + 1 >= fit * 0.6 else fit
        pieces.append(word[:cut])
        word = word[cut:]
    return [*pieces, word]


def wrap_code(text: str, width: float, font: Font) -> list[str]:
    """Monospace lines within `width`, spaces kept; a longer line goes on, marked, on the next (broken at a
    space in its second half where there is one)."""
    per_line = max(20, int((width - 1.0) / (font.width("x" * 100) / 100)))
    lines = []
    for line in text.expandtabs(4).split("\n"):
        mark = ""
        while len(mark) + len(line) > per_line:
            room = per_line - len(mark)
            space = line.rfind(" ", room // 2, room)
            cut = space + 1 if space > 0 else room
            lines.append(mark + line[:cut])
            line, mark = line[cut:], CONTINUED
        lines.append(mark + line)
    return lines


def plain(text: str) -> str:
    """Markdown's inline marks as a reader sees them: code spans and emphasis without their backticks and stars."""
    return text.replace("`", "").replace("**", "")


# ---------------------------------------------------------------- the PDF book: blocks laid out on pages


BODY, CODE, SMALL = Font(9.0), Font(7.0, "DejaVu Sans Mono"), Font(7.5)
SMALL_BOLD, CAPTION, TITLE_BOLD = Font(7.5, weight="bold"), Font(8.0, style="italic"), Font(8.5, weight="bold")


class Canvas:
    """One page: matplotlib draws on a figure of the page's size; positions in points from its bottom left
    (PDF coordinates). Every table cell drawn is noted (page, rectangle, text) for the tests."""

    def __init__(self, plt, size: tuple[float, float], number: int):
        self.figure = plt.figure(figsize=size)
        self.width, self.height = size[0] / POINT, size[1] / POINT
        self.number = number
        self.cells: list[dict] = []

    def _at(self, x: float, y: float) -> tuple[float, float]:
        return x / self.width, y / self.height

    def text(self, x: float, baseline: float, text: str, font: Font, align: str = "left", color="black"):
        self.figure.text(
            *self._at(x, baseline),
            text,
            fontproperties=font.properties(),
            ha=align,
            va="baseline",
            color=color,
            parse_math=False,
        )

    def rule(self, x0: float, x1: float, y: float, width: float = 0.5, color="black"):
        from matplotlib.lines import Line2D

        self.figure.add_artist(
            Line2D(
                [x0 / self.width, x1 / self.width],
                [y / self.height] * 2,
                linewidth=width,
                color=color,
                transform=self.figure.transFigure,
            )
        )

    def fill(self, x0: float, y0: float, x1: float, y1: float, color):
        from matplotlib.patches import Rectangle

        self.figure.add_artist(
            Rectangle(
                self._at(x0, y0),
                (x1 - x0) / self.width,
                (y1 - y0) / self.height,
                facecolor=color,
                edgecolor="none",
                transform=self.figure.transFigure,
                zorder=-1,
            )
        )

    def image(self, pixels, x0: float, y0: float, x1: float, y1: float):
        axes = self.figure.add_axes(
            [x0 / self.width, y0 / self.height, (x1 - x0) / self.width, (y1 - y0) / self.height]
        )
        axes.imshow(pixels, interpolation="none", aspect="auto")  # embedded as rendered, not resampled
        axes.set_axis_off()


class Block:
    """Something laid out top to bottom: its height at a width; the least of it that may end a page (what a
    heading kept with it needs below); and a split into what fits a page's rest and what goes on."""

    keep_with_next = False
    landscape = False
    anchor = None

    def height(self, width: float) -> float:
        raise NotImplementedError

    def smallest(self, width: float) -> float:
        return self.height(width)

    def split(self, width: float, room: float):
        """(the part that fits `room`, the rest); (None, self) when no part of it fits."""
        return (self, None) if self.height(width) <= room else (None, self)

    def draw(self, canvas: Canvas, x: float, top: float, width: float):
        raise NotImplementedError


class Lines(Block):
    """Text wrapped to the width: a paragraph, a heading (kept with what follows), a code block (monospace, its
    broken lines marked), any of them on a tint. A page break falls between lines, never leaving one alone."""

    PAD = 3.0  # around the text on a tint

    def __init__(
        self,
        text: str,
        font: Font = BODY,
        space_before: float = 0.0,
        space_after: float = 6.0,
        code: bool = False,
        heading: bool = False,
        anchor: str | None = None,
        tint: str | None = None,
        fixed=None,
    ):
        self.text, self.font, self.code, self.tint = text, font, code, tint
        self.space_before, self.space_after = space_before, space_after
        self.keep_with_next, self.anchor = heading, anchor
        self.fixed = fixed  # (width, lines) of a part split off at that width

    def lines(self, width: float) -> list[str]:
        if self.fixed and self.fixed[0] == width:
            return self.fixed[1]
        inner = width - 2 * self.PAD if self.tint else width
        return wrap_code(self.text, inner, self.font) if self.code else wrap(plain(self.text), inner, self.font)

    def _frame(self) -> float:
        return self.space_before + self.space_after + (2 * self.PAD if self.tint else 0.0)

    def height(self, width: float) -> float:
        return self._frame() + len(self.lines(width)) * self.font.line

    def smallest(self, width: float) -> float:
        lines = len(self.lines(width))
        return self._frame() + (2 if lines >= 4 else lines) * self.font.line  # split() leaves two on each side

    def split(self, width: float, room: float):
        lines = self.lines(width)
        fit = min(len(lines), int((room - self._frame()) // self.font.line))
        if fit == len(lines):
            return self, None
        if len(lines) - fit == 1:  # no line alone at the top of the next page
            fit -= 1
        if fit < 2 or self.keep_with_next:  # nor at the foot of this one
            return None, self
        part = lambda chunk, before, after: Lines(
            self.text,
            self.font,
            before,
            after,
            self.code,  # noqa: E731
            tint=self.tint,
            fixed=(width, chunk),
        )
        return part(lines[:fit], self.space_before, 0.0), part(lines[fit:], 0.0, self.space_after)

    def draw(self, canvas: Canvas, x: float, top: float, width: float):
        lines = self.lines(width)
        top -= self.space_before
        if self.tint:
            canvas.fill(x, top - 2 * self.PAD - len(lines) * self.font.line, x + width, top, self.tint)
            x, top = x + self.PAD, top - self.PAD
        for index, line in enumerate(lines):
            canvas.text(x, self.font.baseline(top, index), line, self.font)


class PageBreak(Block):
    def height(self, width: float) -> float:
        return 0.0


class Figure(Block):
    """A figure rendered once at 200 dpi (its tight bounding box), drawn at its own size or narrowed to the
    page's width, shrunk (to 3/4 at most) to fit what is left of a page, its caption under it. A figure so
    wide that its text would shrink below 4/5 on the page is laid out narrower for the page before it is
    rendered (its own size restored after, for its own files)."""

    DPI, GAP, SHRINK, NARROWEST = 200, 4.0, 0.75, 0.8
    TALLEST = 8.0 / POINT  # of a portrait page's 10.5 inches: room for its caption and a heading

    def __init__(self, figure, caption: str, page_width: float = 0.0, scale: float = 1.0):
        if figure is not None:
            wide = figure.get_size_inches()[0] / POINT  # about its tight width, known before it is drawn
            factor = page_width / self.NARROWEST / wide if page_width else 1.0
            self.pixels = self._narrowed(figure, factor) if factor < 1 else self._render(figure)
        self.caption, self.scale = caption, scale
        self.space_after = 8.0

    def _render(self, figure):
        import io

        from matplotlib.image import imread

        buffer = io.BytesIO()
        figure.savefig(buffer, format="png", dpi=self.DPI, bbox_inches="tight", pil_kwargs={"compress_level": 0})
        buffer.seek(0)
        return (imread(buffer)[..., :3] * 255).round().astype("uint8")

    def _narrowed(self, figure, factor: float):
        import warnings

        size = figure.get_size_inches().copy()
        margins = {k: getattr(figure.subplotpars, k) for k in ("left", "right", "bottom", "top", "wspace", "hspace")}
        figure.set_size_inches(size[0] * factor, size[1])
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # a figure tight_layout cannot arrange keeps its margins
            figure.tight_layout()
        try:
            return self._render(figure)
        finally:
            figure.set_size_inches(size)
            figure.subplots_adjust(**margins)

    def _size(self, width: float) -> tuple[float, float]:
        rows, columns = self.pixels.shape[:2]
        wide = min(width, columns / self.DPI / POINT)
        high = min(wide * rows / columns, self.TALLEST)
        return high * columns / rows * self.scale, high * self.scale

    def _caption(self, width: float) -> list[str]:
        return wrap(plain(self.caption), width, CAPTION)

    def height(self, width: float) -> float:
        return self._size(width)[1] + self.GAP + len(self._caption(width)) * CAPTION.line + self.space_after

    def smallest(self, width: float) -> float:
        return self.height(width) - self._size(width)[1] * (1 - self.SHRINK)

    def split(self, width: float, room: float):
        if self.height(width) <= room:
            return self, None
        needed = self.height(width) - room
        scale = 1 - needed / self._size(width)[1]
        if scale < self.SHRINK:
            return None, self
        shrunk = Figure(None, self.caption, scale=self.scale * scale)
        shrunk.pixels = self.pixels
        return shrunk, None

    def draw(self, canvas: Canvas, x: float, top: float, width: float):
        wide, high = self._size(width)
        left = x + (width - wide) / 2
        canvas.image(self.pixels, left, top - high, left + wide, top)
        caption_top = top - high - self.GAP
        for index, line in enumerate(self._caption(width)):
            canvas.text(x + width / 2, CAPTION.baseline(caption_top, index), line, CAPTION, align="center")


@dataclass
class TableLayout:
    widths: list[float]  # per column, padding included
    header: list[list[str]]  # wrapped lines per header cell
    rows: list[list[list[str]]]  # wrapped lines per cell, per row


class TableBlock(Block):
    """A Table drawn booktabs-style: its title above; every cell wrapped within its column; columns as wide as
    their longest text where the page allows, else as `widths` shares the page out (none narrower than its
    longest word, up to a limit past which a word breaks); right-aligned columns as Table.align says (a
    table too wide for a portrait page: `table_blocks`). A long table goes on over pages, its header
    repeated under its title '(continued)', never one row alone; a short one moves to the next page whole."""

    PAD_X, PAD_Y, WORD_LIMIT, STEPS = 3.0, 2.0, 96.0, 48
    WHOLE = 12  # rows: a table this short is never split (it goes to the next page whole)
    GAP_TITLE, SPACE_AFTER = 3.0, 10.0

    def __init__(
        self,
        table: Table,
        font: Font = SMALL,
        landscape: bool = False,
        rows: range | None = None,
        part: str = "",
        continued: bool = False,
    ):
        self.table, self.font, self.landscape = table, font, landscape
        self.bold = Font(font.size, font.family, "bold")
        self.rows = rows if rows is not None else range(len(table.rows))
        self.part, self.continued = part, continued
        self._layouts: dict[float, TableLayout] = {}

    # -- columns

    def _cells(self, column: int) -> list[tuple[str, Font]]:
        return [(plain(self.table.headers[column]), self.bold)] + [
            (plain(row[column]), self.font) for row in self.table.rows
        ]

    def natural(self, column: int) -> float:
        """The column's width with every cell on one line."""
        return max(font.width(line) for text, font in self._cells(column) for line in text.split("\n")) + 2 * self.PAD_X

    def least(self, column: int) -> float:
        """The column's narrowest: its longest word (up to the limit)."""
        return (
            min(
                self.WORD_LIMIT,
                max((font.width(word) for text, font in self._cells(column) for word in text.split()), default=0.0),
            )
            + 2 * self.PAD_X
        )

    def widths(self, width: float) -> list[float] | None:
        """Column widths within `width`: natural where they all fit; else, from every column at its longest
        word, the room left goes, a widening at a time, where it lowers the table most per point (then saves
        the most lines per point; then to the column furthest from its natural width: the widest text wraps
        first); what no widening can use is shared out. None when the longest words alone do not fit."""
        columns = range(len(self.table.headers))
        natural = [self.natural(c) for c in columns]
        least = [min(n, self.least(c)) for c, n in enumerate(natural)]
        if sum(natural) <= width:
            return natural
        if sum(least) > width:
            return None
        step = (width - sum(least)) / self.STEPS
        width_of = lambda c, k: min(natural[c], least[c] + k * step)  # noqa: E731
        counted: dict[tuple[int, int], list[int]] = {}

        def count(c: int, k: int) -> list[int]:  # lines per cell of column c at widening k
            if (c, k) not in counted:
                inner = width_of(c, k) - 2 * self.PAD_X
                counted[c, k] = [len(wrap(text, inner, font)) for text, font in self._cells(c)]
            return counted[c, k]

        steps = [0] * len(natural)

        def height(c: int, lines: list[int]) -> int:  # the table's lines with column c's lines as given
            return sum(max(lines[r] if k == c else count(k, steps[k])[r] for k in columns) for r in range(len(lines)))

        while (left := self.STEPS - sum(steps)) > 0:
            best = None
            for c in columns:
                now, more = count(c, steps[c]), 0
                while more < left and width_of(c, steps[c] + more) < natural[c]:  # to the next line saved
                    more += 1
                    if count(c, steps[c] + more) != now:
                        break
                if not more or count(c, steps[c] + more) == now:
                    continue
                wider = count(c, steps[c] + more)
                key = (
                    (height(c, wider) - height(c, now)) / more,
                    (sum(wider) - sum(now)) / more,
                    width_of(c, steps[c]) - natural[c],
                )
                if best is None or key < best[0]:
                    best = (key, c, more)
            if best is None:  # no widening saves a line: the rest is shared out
                break
            steps[best[1]] += best[2]
        widths = [width_of(c, steps[c]) for c in columns]
        open_ = [c for c in columns if widths[c] < natural[c]] or list(columns)
        return [w + (width - sum(widths)) / len(open_) if c in open_ else w for c, w in enumerate(widths)]

    def layout(self, width: float) -> TableLayout:
        if width not in self._layouts:
            widths = self.widths(width) or [width / len(self.table.headers)] * len(self.table.headers)
            cell = lambda text, font, w: wrap(plain(text), w - 2 * self.PAD_X, font)  # noqa: E731
            self._layouts[width] = TableLayout(
                widths,
                [cell(h, self.bold, w) for h, w in zip(self.table.headers, widths)],
                [[cell(text, self.font, w) for text, w in zip(row, widths)] for row in self.table.rows],
            )
        return self._layouts[width]

    # -- rows

    def title_lines(self, width: float) -> list[str]:
        return wrap(plain(self.table.title) + self.part + (" (continued)" if self.continued else ""), width, TITLE_BOLD)

    def _row_height(self, lines: list[list[str]]) -> float:
        return max(len(cell) for cell in lines) * self.font.line + 2 * self.PAD_Y

    def _head(self, width: float) -> float:
        return (
            len(self.title_lines(width)) * TITLE_BOLD.line
            + self.GAP_TITLE
            + self._row_height(self.layout(width).header)
            + self.SPACE_AFTER
        )

    def height(self, width: float) -> float:
        rows = self.layout(width).rows
        return self._head(width) + sum(self._row_height(rows[r]) for r in self.rows)

    def smallest(self, width: float) -> float:
        if len(self.table.rows) <= self.WHOLE:
            return self.height(width)
        rows = self.layout(width).rows
        return self._head(width) + sum(self._row_height(rows[r]) for r in list(self.rows)[:2])

    def split(self, width: float, room: float):
        rows = self.layout(width).rows
        used, fit = self._head(width), 0
        for r in self.rows:
            used += self._row_height(rows[r])
            if used > room:
                break
            fit += 1
        if fit == len(self.rows):
            return self, None
        if len(self.table.rows) <= self.WHOLE:
            return None, self
        if len(self.rows) - fit == 1:  # no row alone at the top of the next page
            fit -= 1
        if fit < 2:  # nor at the foot of this one
            return None, self
        first = TableBlock(self.table, self.font, self.landscape, self.rows[:fit], self.part, self.continued)
        rest = TableBlock(self.table, self.font, self.landscape, self.rows[fit:], self.part, True)
        first._layouts = rest._layouts = self._layouts
        return first, rest

    def draw(self, canvas: Canvas, x: float, top: float, width: float):
        layout = self.layout(width)
        right = x + sum(layout.widths)
        for index, line in enumerate(self.title_lines(width)):
            canvas.text(x, TITLE_BOLD.baseline(top, index), line, TITLE_BOLD)
        y = top - len(self.title_lines(width)) * TITLE_BOLD.line - self.GAP_TITLE
        canvas.rule(x, right, y, 0.8)
        y = self._draw_row(canvas, x, y, layout, layout.header, self.bold)
        canvas.rule(x, right, y, 0.5)
        for position, r in enumerate(self.rows):
            if position:
                canvas.rule(x, right, y, 0.3, color="0.8")
            y = self._draw_row(canvas, x, y, layout, layout.rows[r], self.font)
        canvas.rule(x, right, y, 0.8)

    def _draw_row(self, canvas: Canvas, x: float, top: float, layout: TableLayout, cells, font: Font) -> float:
        bottom = top - self._row_height(cells)
        for lines, width, align in zip(cells, layout.widths, self.table.align):
            for index, line in enumerate(lines):
                at = x + width - self.PAD_X if align == "r" else x + self.PAD_X
                canvas.text(at, font.baseline(top - self.PAD_Y, index), line, font, "right" if align == "r" else "left")
            canvas.cells.append({"rect": (x, bottom, x + width, top), "text": " ".join(lines), "align": align})
            x += width
        return bottom


def table_blocks(table: Table, font: Font, portrait: float, landscape: float) -> list[TableBlock]:
    """The blocks a table is drawn as: one on portrait pages where its columns' least widths fit and no cell
    wraps to more than six lines; else one on landscape pages; else groups of columns on landscape pages."""
    block = TableBlock(table, font)
    if block.widths(portrait) is not None:
        lines = max((len(cell) for row in block.layout(portrait).rows for cell in row), default=1)
        if lines <= 6 or block.widths(landscape) is None:
            return [block]
    if block.widths(landscape) is not None:
        return [TableBlock(table, font, landscape=True)]
    groups, current = [], [0]
    for column in range(1, len(table.headers)):
        trial = TableBlock(_columns(table, [*current, column]), font)
        if trial.widths(landscape) is None and len(current) > 1:
            groups.append(current)
            current = [0]
        current.append(column)
    groups.append(current)
    named = lambda group: (
        f"column {group[1] + 1}"
        if len(group) == 2  # noqa: E731
        else f"columns {group[1] + 1}-{group[-1] + 1}"
    )
    return [
        TableBlock(_columns(table, group), font, landscape=True, part=f" ({named(group)} of {len(table.headers)})")
        for group in groups
    ]


def _columns(table: Table, columns: list[int]) -> Table:
    return Table(
        table.title,
        [table.headers[c] for c in columns],
        [[row[c] for c in columns] for row in table.rows],
        table.label,
        "".join(table.align[c] for c in columns),
    )


@dataclass
class Deferred:
    make: object  # anchors -> Table
    font: Font


class PdfBook:
    """A4 pages of headings, text, code, figures and tables, laid out before anything is drawn: a heading
    never ends a page (it goes on with the least of what follows it), text and tables continue across
    pages, a wide table gets landscape pages, and every page is numbered. A table may be given as a
    function of the pages the headings landed on (`anchors`): the layout is repeated until those pages
    stand, so a page that cites them can come first."""

    PORTRAIT, MARGIN = (8.27, 11.69), 0.6 / POINT

    def __init__(self, path: Path, title: str = "trainscope report"):
        self.path, self.title = path, title
        self.blocks: list = []
        self.anchors: dict[str, int] = {}  # a heading's anchor -> its page (1-based), once laid out
        self.pages: list[Canvas] = []  # once drawn: every page, with the table cells drawn on it

    def _content(self, landscape: bool) -> tuple[float, float]:
        width, height = self.PORTRAIT[::-1] if landscape else self.PORTRAIT
        return width / POINT - 2 * self.MARGIN, height / POINT - 2 * self.MARGIN

    def heading(self, text: str, size: float = 14, anchor: str | None = None):
        self.blocks.append(
            Lines(
                text,
                Font(size, weight="bold"),
                space_before=size * 0.6,
                space_after=size * 0.35,
                heading=True,
                anchor=anchor,
            )
        )

    def text(self, text: str, size: float = BODY.size, tint: str | None = None):
        self.blocks.append(Lines(text, Font(size), tint=tint))

    def code(self, text: str):
        self.blocks.append(Lines(text, CODE, code=True, tint="0.95", space_after=8.0))

    def image(self, figure, caption: str):
        self.blocks.append(Figure(figure, caption, self._content(False)[0]))

    def table(self, table: Table, font: Font = SMALL):
        self.blocks.append(self._table_blocks(table, font))

    def table_of_pages(self, make, font: Font = SMALL):
        """A table (or several) made from the pages the anchored headings landed on (`make(anchors) -> Table or a
        list of them`): drawn where it stands, made again at every layout until those pages stand."""
        self.blocks.append(Deferred(make, font))

    def page_break(self):
        self.blocks.append(PageBreak())

    def _table_blocks(self, table: Table, font: Font) -> list[TableBlock]:
        return table_blocks(table, font, self._content(False)[0], self._content(True)[0])

    def _blocks(self) -> list[Block]:
        out = []
        for block in self.blocks:
            if isinstance(block, Deferred):
                made = block.make(dict(self.anchors))
                block = [
                    part
                    for table in (made if isinstance(made, list) else [made])
                    for part in self._table_blocks(table, block.font)
                ]
            out += block if isinstance(block, list) else [block]
        return out

    def layout(self) -> list[tuple[bool, list]]:
        """Pages as (landscape, [(block, its top's offset under the margin)]); each anchored heading's page
        noted in `anchors`."""
        pages: list[tuple[bool, list]] = []
        blocks = self._blocks()
        used = 0.0

        def new_page(landscape: bool):
            nonlocal used
            pages.append((landscape, []))
            used = 0.0

        for index, block in enumerate(blocks):
            if isinstance(block, PageBreak):
                if pages and pages[-1][1]:
                    new_page(False)
                continue
            following = (
                next((b for b in blocks[index + 1 :] if not b.keep_with_next), None) if block.keep_with_next else None
            )
            landscape = (following or block).landscape
            if not pages or pages[-1][0] != landscape:
                if pages and not pages[-1][1]:
                    pages[-1] = (landscape, [])
                else:
                    new_page(landscape)
            width, height = self._content(landscape)
            if block.keep_with_next:
                needed = block.height(width) + (following.smallest(width) if following else 0.0)
                if used + needed > height and pages[-1][1]:
                    new_page(landscape)
                if block.anchor:
                    self.anchors[block.anchor] = len(pages)
            part = block
            while part is not None:
                fits, rest = part.split(width, height - used)
                if fits is None and not pages[-1][1]:  # taller than a page: drawn anyway
                    fits, rest = part, None
                if fits is not None:
                    pages[-1][1].append((fits, used))
                    used += fits.height(width)
                if rest is not None:
                    new_page(landscape)
                part = rest
        return pages

    def close(self):
        """Lay out (again, until the cited pages stand), then draw every page into the PDF."""
        from matplotlib.backends.backend_pdf import PdfPages

        for _ in range(5):
            before = dict(self.anchors)
            pages = self.layout()
            if self.anchors == before:
                break
        plt = pyplot()
        with PdfPages(self.path, metadata={"Title": self.title, "Creator": "trainscope"}) as pdf:
            for number, (landscape, placed) in enumerate(pages, 1):
                size = self.PORTRAIT[::-1] if landscape else self.PORTRAIT
                canvas = Canvas(plt, size, number)
                width, height = self._content(landscape)
                for block, offset in placed:
                    block.draw(canvas, self.MARGIN, canvas.height - self.MARGIN - offset, width)
                canvas.text(
                    canvas.width / 2,
                    self.MARGIN / 2,
                    f"{self.title} - page {number} of {len(pages)}",
                    SMALL,
                    align="center",
                    color="0.4",
                )
                pdf.savefig(canvas.figure)
                plt.close(canvas.figure)
                canvas.figure = None
                self.pages.append(canvas)


class ReportWriter:
    """Each section goes to report.md, to report.pdf, and to its own PNG/PDF figures and .tex tables.

    A section's answer (a `Headline`: its headline figure and its verdict, or the line saying why it has
    none) and the machines its figures come from are declared before the section is written: the machines head
    the section and follow every figure's caption and table's title; the answer goes under the section's heading
    ('In short') and, with the page the section landed on, to the report's first page of answers, grouped by
    machine."""

    ANSWERS = "At a glance"
    SEVERAL = "Measured on several machines (each section says which figure comes from which)"
    UNNAMED = "Measured on a machine its inputs do not name"
    NONE = "Not measured (not run yet, or skipped)"

    def __init__(self, out: Path, book: PdfBook):
        self.out = out
        self.book = book
        self.markdown: list[str] = []
        self.files: list[Path] = []
        self.figure_runs: dict[str, list[dict]] = {}  # figure name -> the records it shows
        self.answers: dict[str, object] = {}  # section title -> its Headline, or the line saying why there is none
        self.machines: dict[str, dict] = {}  # section title -> {Machine: what it measured}
        self.current: dict = {}  # the machines of the section being written
        self._answers_at: int | None = None  # where the answers go in the Markdown

    def title(self, title: str, line: str):
        self.markdown += [f"# {title}", "", line, ""]
        self.book.heading(title, size=20)
        self.book.text(line)

    def answers_page(self):
        """The first page: one line per section, grouped by the machine that measured it, filled in once every
        section is written."""
        intro = (
            "What each experiment found: its headline figure and its verdict, worded as its section words them "
            "(under the section's heading, 'In short'), and the page the section is on; grouped by the machine "
            "that measured it, since figures from different machines are not comparable."
        )
        self.markdown += [f"## {self.ANSWERS}", "", intro.replace(", and the page the section is on", ""), ""]
        self._answers_at = len(self.markdown)
        self.book.heading(self.ANSWERS)
        self.book.text(intro)
        self.book.table_of_pages(self.answers_tables, Font(8.0))
        self.book.page_break()

    def answer(self, title: str, headline, machines: dict | None = None):
        """Declare a section's answer (a Headline, or the line saying why it has none) and the machines its
        figures come from ({Machine: what it measured}) before it is written."""
        self.answers[title] = headline
        self.machines[title] = machines or {}

    def answer_groups(self) -> list[tuple[str, list[str]]]:
        """(what measured them, section titles): one group per machine in the order the sections first name it,
        then the sections measured on several machines, those whose inputs name none, and those not measured."""
        groups: dict[str, list[str]] = {}
        for title, answer in self.answers.items():
            machines = self.machines.get(title) or {}
            label = (
                f"Measured on {next(iter(machines)).text}"
                if len(machines) == 1
                else self.SEVERAL
                if machines
                else self.UNNAMED
                if hasattr(answer, "verdict")
                else self.NONE
            )
            groups.setdefault(label, []).append(title)
        last = (self.SEVERAL, self.UNNAMED, self.NONE)
        order = [label for label in groups if label not in last] + [label for label in last if label in groups]
        return [(label, groups[label]) for label in order]

    def answers_tables(self, pages: dict | None = None) -> list[Table]:
        """One table per group of `answer_groups`, titled by its machine; with `pages`, the page of each section."""
        from trainscope.record_view import machines_text

        tables = []
        for label, titles in self.answer_groups():
            rows = []
            for title in titles:
                answer = self.answers[title]
                text, verdict = (answer.text, answer.verdict) if hasattr(answer, "verdict") else (answer, "")
                if len(self.machines.get(title) or {}) > 1:
                    text += f" (measured on {machines_text(self.machines[title])})"
                rows.append([title, text, verdict] + ([str(pages.get(title, "?"))] if pages is not None else []))
            headers = ["experiment", "answer", "verdict"] + (["page"] if pages is not None else [])
            tables.append(
                Table(
                    f"{label}: what each experiment found",
                    headers,
                    rows,
                    "answers",
                    "lllr" if pages is not None else "lll",
                )
            )
        return tables

    def begin(self, title: str, inputs, missing_line: str) -> bool:
        """Open a section; when its inputs are missing, write `missing_line` (which make target produces
        them) and return False. Else the machines its figures come from, then its answer."""
        from trainscope.record_view import machines_text

        self.markdown += [f"## {title}", ""]
        self.book.heading(title, anchor=title)
        self.current = self.machines.get(title) or {}
        if not inputs:
            self.text(missing_line)
            return False
        if self.current:
            line = f"**Measured on:** {machines_text(self.current)}."
            self.markdown += [line, ""]
            self.book.text(line)
        answer = self.answers.get(title)
        if hasattr(answer, "verdict"):
            line = f"**In short:** {answer.text}. Verdict: {answer.verdict}."
            self.markdown += [line, ""]
            self.book.text(line, tint="#e9f0f8")
        return True

    def measured_on(self, records=None) -> str:
        """'measured on AMD EPYC, AVX2, bf16 emulated, 2 cores': the machines of `records` where given, else the
        section's; '' where none is known."""
        from trainscope.record_view import RunView, machines_text
        from trainscope.reporting import machines

        grouped = machines([(RunView(r).name, r) for r in records]) if records else self.current
        return f"measured on {machines_text(grouped)}" if grouped else ""

    def text(self, line: str):
        self.markdown += [line, ""]
        self.book.text(line)

    def figure(self, figure, name: str, caption: str, records=()):
        """A figure, then the health warnings of the runs it shows."""
        from trainscope.record_view import warning_lines

        on = self.measured_on(records)
        caption = f"{caption} ({on})" if on else caption
        self.markdown += [f"![{caption}]({name}.png)", "", f"*{caption}*", ""]
        self.book.image(figure, caption)
        self.files += save_figure(figure, self.out / name, bbox_inches="tight")
        self.figure_runs.setdefault(name, []).extend(records)
        lines = warning_lines(records)
        if lines:
            self.text("Warnings for these figures:\n" + "\n".join(f"- {line}" for line in lines))

    def table(self, table: Table):
        from trainscope.records import write_text_atomic

        on = self.measured_on()
        if on:
            table = Table(f"{table.title} ({on})", table.headers, table.rows, table.label, table.align)
        path = self.out / f"{table.label}.tex"
        write_text_atomic(path, table.latex())
        self.files.append(path)
        self.markdown += [f"**{table.title}** (LaTeX: `{path.name}`)", "", table.markdown(), ""]
        self.book.table(table)

    def code(self, text: str, language: str = ""):
        self.markdown += [f"```{language}", text, "```", ""]
        self.book.code(text)

    def appendix(self, lines: list[str]):
        """A closing part given as Markdown lines: its '## ' heading, then its lines as one block of text."""
        self.markdown += lines
        self.book.heading(lines[0].lstrip("# "))
        self.book.text("\n".join(line for line in lines[1:] if line))

    def close(self):
        """Fill in the answers, then lay out and draw the PDF."""
        if self._answers_at is not None:
            self.markdown[self._answers_at : self._answers_at] = [
                line for table in self.answers_tables() for line in (f"**{table.title}**", "", table.markdown(), "")
            ]
        self.book.close()


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
