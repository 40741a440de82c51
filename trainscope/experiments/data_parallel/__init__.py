"""nn.DataParallel against DDP: `loops` runs the three loops (compare_dp.py), `results` reads them (rows, figure,
tables, report section).
"""

__all__ = ["loops", "results"]
