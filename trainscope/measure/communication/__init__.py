"""DDP communication: measured in the run (`measured`), checked against two other instruments (`agreement`), and
combined across ranks into the summary's block (`block`)."""

__all__ = ["measured", "agreement", "block"]
