"""The PDF book: A4 pages of headings, text, code, figures and tables, laid out before anything is drawn."""

from dataclasses import dataclass
from pathlib import Path

from trainscope.report.pdf.layout import (
    BODY,
    CODE,
    SMALL,
    Block,
    Canvas,
    Figure,
    Lines,
    PageBreak,
    TableBlock,
    table_blocks,
)
from trainscope.report.pdf.text import POINT, Font
from trainscope.report.tables import Table, pyplot


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
