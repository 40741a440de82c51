"""The report: what its sections share (their inputs, headlines, answers and rows), the section writer, the one
table layer, the document writer, and the PDF book."""

__all__ = ["sections", "writer", "tables", "document", "book"]
