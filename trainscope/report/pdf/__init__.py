"""The PDF book: its text (fonts, line breaking), its blocks and pages, and the book that lays them out."""

__all__ = ["text", "layout", "book"]
