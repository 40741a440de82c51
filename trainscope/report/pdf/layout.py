"""The PDF book's blocks (lines, figures, tables, page breaks) and the page they are drawn on: each block measures
itself and splits where a page ends."""

from dataclasses import dataclass

from trainscope.report.pdf.text import POINT, Font, plain, wrap, wrap_code
from trainscope.report.tables import Table

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
