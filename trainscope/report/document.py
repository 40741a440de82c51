"""Results pages built as data: a benchmark, sweep or check says what its page holds (headings, paragraphs, bullet
lists, `Table`s), and this one writer turns the blocks into Markdown. A page's content is then a list a test can
read, and how a page is written lives here once.

    page = [Heading("Stage-timing overhead"), Paragraph(f"{rounds} alternating rounds."), table]
    markdown(page)  # -> the page's lines
"""

from dataclasses import dataclass, field

from trainscope.report.tables import Table


@dataclass(frozen=True)
class Heading:
    text: str
    level: int = 1


@dataclass(frozen=True)
class Paragraph:
    text: str


@dataclass(frozen=True)
class Bullets:
    items: list = field(default_factory=list)


@dataclass(frozen=True)
class Code:
    text: str
    language: str = ""


Block = Heading | Paragraph | Bullets | Code | Table


def _lines(block) -> list[str]:
    if isinstance(block, Heading):
        return [f"{'#' * block.level} {block.text}"]
    if isinstance(block, Paragraph):
        return [block.text]
    if isinstance(block, Bullets):
        return [f"- {item}" for item in block.items]
    if isinstance(block, Code):
        return [f"```{block.language}", *block.text.rstrip("\n").split("\n"), "```"]
    if isinstance(block, Table):
        return block.markdown_lines()
    if isinstance(block, str):  # lines already written (a provenance footer)
        return [block]
    raise TypeError(f"not a page block: {type(block).__name__}")


def markdown(blocks) -> list[str]:
    """The page's Markdown lines: each block, a blank line between blocks; empty blocks (None, an empty paragraph or
    list) left out, so a page can hold what applies only."""
    lines: list[str] = []
    for block in blocks:
        if block is None or (
            isinstance(block, Paragraph | Bullets) and not (block.text if isinstance(block, Paragraph) else block.items)
        ):
            continue
        if lines:
            lines.append("")
        lines += _lines(block)
    return lines
