"""From a record to what to try next, and how a try is judged: the advisor's ranked suggestions (and its rules), the
catalogue of changes make tune may try, make tune's design and its decision (pure), and a committed make tune judged
again.
"""

__all__ = ["advisor", "changes", "design", "judge", "rejudge", "rules"]
