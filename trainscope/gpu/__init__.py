"""make gpu-check: what only a GPU can show. `plan` (the checks, in order, with their budgets), `check` (running
them), `results` (each check's goals and verdicts, the Markdown).
"""

__all__ = ["plan", "check", "results"]
