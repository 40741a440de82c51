"""The report: its inputs and shared rows, the section writer, the one table layer, and the PDF book."""

__all__ = ["inputs", "writer", "tables", "book"]
