"""make gpu-check: what only a GPU can show. `checks` (each check declared once, with its goals), `plan` (the checks
in order, fitted to the GPUs, cut into parts), `estimates` (what their durations rest on), `check` (running them),
`goals` and `results` (each check's goals judged, the results page), `driver` (the torch that can see the GPU).
"""

__all__ = ["checks", "plan", "estimates", "check", "goals", "results", "driver"]
