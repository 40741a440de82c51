"""The report's PDF, typeset by Typst (the `typst` package: the compiler in one wheel, fonts included, offline):
the book writes report.typ, a readable source beside the PDF, and compiles it. Typst wraps text, breaks pages,
keeps a heading with what follows it, repeats a long table's header on every page it runs over, resolves the page
numbers the first page cites, and embeds the figures' PDFs as vectors (docs/design.md, "The report's PDF")."""

import json
from pathlib import Path

import typst

from trainscope.report.tables import Table

BODY, SMALL, CODE = 9.0, 7.5, 7.0  # points
MONO_ADVANCE = 0.602  # DejaVu Sans Mono's advance, in ems: how many characters a code line holds
PORTRAIT_WIDTH_PT, MARGIN_PT = 8.27 * 72, 0.6 * 72
CONTENT_PT = PORTRAIT_WIDTH_PT - 2 * MARGIN_PT
BREAK_AFTER = "/_=,"  # a cell's long token may break after these (a zero-width space follows each)
LONG_TOKEN = 16  # characters: a shorter token (a number, a word) never breaks
FIGURE_HEIGHT = 0.42  # the tallest a figure is drawn, as a share of the page's content height
CONTENT_HEIGHT_PT = 11.69 * 72 - 2 * 0.6 * 72

PREAMBLE = """#set document(title: {title}, author: "trainscope", date: none)
#set page(paper: "a4", margin: {margin}pt, footer: context align(center, text(size: {small}pt, fill: luma(40%),
  {title} + " - page " + counter(page).display("1 of 1", both: true))))
#set text(font: "DejaVu Sans", size: {body}pt, lang: "en")
#set par(justify: false, leading: 0.5em, spacing: 0.9em)
#show raw: set text(font: "DejaVu Sans Mono", size: {code}pt)
#show heading: set block(above: 1.1em, below: 0.6em)
#show heading.where(level: 1): set text(size: 20pt)
#show heading.where(level: 2): set text(size: 14pt)
#show heading.where(level: 3): set text(size: 12pt)
#set table(stroke: (x, y) => if y == 0 {{ (bottom: 0.6pt) }} else {{ (bottom: 0.2pt + luma(80%)) }}, inset: (x: 3pt, y: 2.2pt))
#show table: set par(leading: 0.4em)
#show table.cell.where(y: 0): strong
#let pagemark(key) = context [#metadata((anchor: key, page: here().page())) <trainscope-anchor>]
#let pageof(key) = context counter(page).at(label(key)).first()
"""


def string(text) -> str:
    """A Typst string literal: its text is set as written, never read as markup."""
    return json.dumps(str(text), ensure_ascii=False)


def inline(text: str) -> str:
    """Markup for one line: `**bold**` and `` `code` `` as in the Markdown report, everything else literal."""
    out, bold = [], False
    for index, part in enumerate(str(text).split("**")):
        bold = index % 2 == 1
        for n, piece in enumerate(part.split("`")):
            if not piece:
                continue
            literal = f"raw({string(piece)})" if n % 2 else string(piece)
            out.append(f"#strong({literal})" if bold else f"#{literal}")
    return "".join(out)


def breakable(text: str) -> str:
    """A cell's text with a zero-width space after each of BREAK_AFTER, so that a path or a flag longer than its
    column breaks there instead of running into the next cell."""
    return " ".join(
        "".join(ch + "\u200b" if ch in BREAK_AFTER else ch for ch in token) if len(token) > LONG_TOKEN else token
        for token in str(text).split(" ")
    )


class Book:
    """Headings, text, code, figures and tables, in the order given, as Typst source; `close` compiles it.
    `anchors` (an anchored heading -> its page, 1-based) is read back from the compiled document."""

    def __init__(self, path: Path, title: str = "trainscope report"):
        self.path, self.title = Path(path), title
        self.source: list[str] = []
        self.labels: dict[str, str] = {}  # an anchor (a section's title) -> its Typst label
        self.anchors: dict[str, int] = {}
        self._tables = 0

    def _label(self, anchor: str) -> str:
        return self.labels.setdefault(anchor, f"section-{len(self.labels) + 1}")

    def heading(self, text: str, level: int = 2, anchor: str | None = None):
        """A heading: 1 the title (20 pt), 2 a section (14 pt), 3 a part (12 pt); `anchor`: its page is noted."""
        label = f"<{self._label(anchor)}>" if anchor else ""
        mark = f"\n#pagemark({string(self._label(anchor))})" if anchor else ""
        self.source.append(f"#heading(level: {level}, outlined: {str(level < 3).lower()})[{inline(text)}]{label}{mark}")

    def text(self, text: str, tint: str | None = None):
        body = " \\\n".join(inline(line) for line in str(text).split("\n"))
        if tint:
            body = f"#block(fill: rgb({string(tint)}), inset: 4pt, width: 100%)[{body}]"
        self.source.append(body)

    def code(self, text: str):
        per_line = int(CONTENT_PT / (MONO_ADVANCE * CODE)) - 2
        lines = [
            line[i : i + per_line] for line in str(text).split("\n") for i in range(0, max(len(line), 1), per_line)
        ]
        self.source.append(
            f"#block(fill: luma(95%), inset: 4pt, width: 100%, raw(block: true, {string(chr(10).join(lines))}))"
        )

    def image(self, path: Path, caption: str, aspect: float = 0.5):
        """A figure from its PDF (a vector, as drawn), its caption under it: as wide as the page, unless that would
        make it taller than FIGURE_HEIGHT of the page (`aspect`: its height over its width)."""
        relative = Path(path).resolve().relative_to(self.path.parent.resolve())
        width = min(CONTENT_PT, FIGURE_HEIGHT * CONTENT_HEIGHT_PT / max(aspect, 1e-3))
        self.source.append(
            f"#figure(image({string(relative.as_posix())}, width: {width:.1f}pt), "
            f'caption: text(size: {BODY - 1}pt, style: "italic", {string(caption)}), supplement: none, numbering: none)'
        )

    def table(self, table: Table, size: float = SMALL):
        self.source.append(self._table(table, size))

    def table_of_pages(self, make, size: float = SMALL):
        """Tables whose last column is the page an anchored heading lands on (`make(pages) -> Table or a list`,
        `pages`: anchor -> the Typst code of its page number, resolved by Typst when it lays the pages out)."""
        self.source.append(("deferred", make, size))

    def page_break(self):
        self.source.append("#pagebreak(weak: true)")

    def _table(self, table: Table, size: float, code_cells: set[int] = frozenset()) -> str:
        columns, key = len(table.headers), f"table-{len(self.source)}-{self._tables}"
        self._tables += 1
        # the longest word of each column, at the cell's size: too wide for a portrait page -> a landscape one
        longest = [
            max(len(word) for cell in [header, *(row[c] for row in table.rows)] for word in str(cell).split() or [""])
            for c, header in enumerate(table.headers)
        ]
        wide = sum(min(n, 24) * 0.55 * size + 6 for n in longest) > CONTENT_PT
        align = ", ".join("left" if a == "l" else "right" for a in table.align)

        def cell(text, column):
            return f"[{text}]" if column in code_cells else f"[{inline(breakable(text))}]"

        title = string(table.title)
        header = ", ".join(f"[{inline(breakable(h))}]" for h in table.headers)
        rows = ",\n  ".join(", ".join(cell(text, c) for c, text in enumerate(row)) for row in table.rows)
        body = (
            f'#block(breakable: true, width: 100%)[#text(size: {size + 1}pt, weight: "bold", {title})\n'
            f"#set text(size: {size}pt)\n"
            f"#table(columns: {columns}, align: ({align},),\n"
            f"  table.header(repeat: true, table.cell(colspan: {columns}, stroke: none, inset: (x: 0pt, y: 2pt),"
            f' context if here().page() != locate(label("{key}")).page() '
            f'{{ text(weight: "regular", style: "italic", {string(table.title + " (continued)")}) }}), {header}),\n'
            f"  {rows})<{key}>]"
        )
        return f"#page(flipped: true)[{body}]" if wide else body

    def render(self) -> str:
        parts = [PREAMBLE.format(title=string(self.title), margin=MARGIN_PT, small=SMALL, body=BODY, code=CODE)]
        for block in self.source:
            if isinstance(block, tuple):
                _, make, size = block
                made = make({anchor: f"#pageof({string(label)})" for anchor, label in self.labels.items()})
                for table in made if isinstance(made, list) else [made]:
                    parts.append(self._table(table, size, code_cells={len(table.headers) - 1}))
            else:
                parts.append(block)
        return "\n\n".join(parts) + "\n"

    def close(self):
        """Write report.typ beside the PDF, compile it, and read back the page each anchored heading landed on."""
        source = self.path.with_suffix(".typ")
        source.write_text(self.render())
        typst.compile(str(source), output=str(self.path), root=str(self.path.parent))
        marks = json.loads(typst.query(str(source), "<trainscope-anchor>", field="value", root=str(self.path.parent)))
        pages = {mark["anchor"]: mark["page"] for mark in marks}
        self.anchors = {anchor: pages[label] for anchor, label in self.labels.items() if label in pages}
