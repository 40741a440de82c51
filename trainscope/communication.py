"""DDP communication in multi-process runs (filled in by the DDP-cost measurement)."""


class NoCommunication:
    """Single-process runs (or --measure-communication off): nothing to measure."""

    def settings_in_effect(self) -> dict | None:
        return None

    def calibration_for(self, step: int, phase: str):
        return None

    def rank_summary(self, timer) -> dict | None:
        return None


def build(settings, accelerator, model):
    return NoCommunication()


def combine(per_rank: list[dict], throughput: dict) -> dict | None:
    return None


def table_lines(block: dict | None) -> list[str]:
    return []
