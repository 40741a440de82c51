"""DDP communication: measured in the run at the events that bound it (`measured`), checked against DDP's own logger
and the profiler's trace (`agreement`), and combined across ranks into the summary's block (`block`).
"""

__all__ = ["measured", "agreement", "block"]
