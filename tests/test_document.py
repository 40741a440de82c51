"""The one writer of results pages built as data (trainscope.report.document)."""

import pytest

from trainscope.report.document import Bullets, Code, Heading, Paragraph, markdown
from trainscope.report.tables import Table


def test_a_page_of_blocks_is_written_with_one_blank_line_between_blocks_and_empty_ones_left_out():
    page = [
        Heading("Overhead"),
        Paragraph("5 rounds."),
        None,
        Paragraph(""),
        Bullets([]),
        Heading("Rounds", level=2),
        Bullets(["a", "b"]),
        Table("t", ["arm", "s"], [["bare", "1.00"]], "t"),
        Code("make bench", "bash"),
    ]
    assert markdown(page) == [
        "# Overhead",
        "",
        "5 rounds.",
        "",
        "## Rounds",
        "",
        "- a",
        "- b",
        "",
        "| arm | s |",
        "|---|---:|",
        "| bare | 1.00 |",
        "",
        "```bash",
        "make bench",
        "```",
    ]


def test_a_block_the_writer_does_not_know_is_an_error():
    with pytest.raises(TypeError, match="not a page block"):
        markdown([Heading("x"), 3])
