"""make gpu-check: what only a GPU can show. `plan` (the checks, in order), `estimates` (what their durations rest
on, the plan's total, budget and parts), `check` (running them), `results` (each check's goals and verdicts, the
Markdown).
"""

__all__ = ["plan", "estimates", "check", "results"]
