"""The instruments: clocks, memory, FLOPs, communication, profiles, the measured peak, health and the benchmark harness
(each module's part: docs/design.md)."""

__all__ = ["timing", "memory", "summary", "flops", "flops_source", "shapes", "layers", "communication",
           "profiling", "peak", "gap", "health", "machine_kinds", "bench"]  # fmt: skip
