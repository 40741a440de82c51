"""The instruments: stage clocks, memory, model FLOPs and where they come from, DDP communication, the profiler's
windows, the machine's measured peak and the gap to it, the health warnings, and the benchmark harness that
judges two arms in alternating rounds.
"""

__all__ = [
    "timing",
    "memory",
    "summary",
    "flops",
    "flops_source",
    "communication",
    "profiling",
    "peak",
    "gap",
    "health",
    "machine_kinds",
    "bench",
]
