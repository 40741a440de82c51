"""The instruments: stage clocks, memory, model FLOPs and where they come from (a model's shape and repeated layers
read from the model itself), DDP communication, the profiler's windows, the machine's measured peak and the gap to
it, the health warnings, and the benchmark harness that judges two arms in alternating rounds.
"""

__all__ = ["timing", "memory", "summary", "flops", "flops_source", "shapes", "layers", "communication",
           "profiling", "peak", "gap", "health", "machine_kinds", "bench"]  # fmt: skip
