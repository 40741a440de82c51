"""From a record to what to try next, and how a try is judged: the advisor's ranked suggestions, the catalogue of
changes make tune may try, and make tune's decision (pure).
"""

__all__ = ["advisor", "changes", "judge"]
