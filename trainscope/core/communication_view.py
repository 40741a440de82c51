"""How a run's communication block reads (trainscope.measure.communication writes it): the figures an experiment
sets side by side, the readings of a schema 3 two-pass estimate and of a schema 4 per-step measurement, whether a
measured time is resolved, and the share of the transfer hidden behind backward. RunView.communication_figures
(trainscope.core.record_view) reads a record's block through these.
"""

# The numeric communication figures an experiment sets side by side (RunView.communication_figures).
COMMUNICATION_FIGURES = tuple(
    "exposed_s exposed_share transfer_s hidden_share window_s overlap bus_bandwidth_gbs allreduces_per_optimizer_step "
    "allreduce_bytes_per_step gradient_bytes ddp_exposed_s ddp_comm_s ddp_overlap measurement_s".split()
)


# The communication block's figures RunView.communication_figures passes on as they were recorded.
COMMUNICATION_BLOCK_FIGURES = tuple(
    "measured world_size bus_bandwidth_gbs allreduce_bytes_per_step allreduces_per_optimizer_step gradient_bytes "
    "buckets ddp_exposed_s ddp_comm_s ddp_overlap measurement_s".split()
)


def two_pass_readings(block: dict) -> tuple:
    """(exposed time's interval, transfer, overlap, per rank, agreement with DDP's logger) of a schema 3 block: the
    interval of its calibration samples and its all-reduce total; no overlap, per rank or agreement."""
    spread = block.get("exposed_spread") or {}
    interval = (spread["min"], spread["max"]) if "min" in spread else None
    agreed = None  # the two instruments sampled different steps: not comparable
    return interval, block.get("total_allreduce_s"), None, None, agreed


def per_step_readings(block: dict) -> tuple:
    """(exposed time's interval, transfer, overlap, per rank, agreement with DDP's logger) of a block measured at
    every step (schema 4)."""
    interval = tuple(block["exposed_interval"]) if block.get("exposed_interval") else None
    per_rank = [
        {"rank": r["rank"], "exposed_s": r["exposed_s"], "wait_s": r["wait_s"]} for r in block.get("per_rank") or []
    ]
    agreed = ((block.get("agreement") or {}).get("ddp") or {}).get("verdict")
    return interval, block.get("transfer_s"), block.get("overlap"), per_rank, agreed


def resolved(value: float, interval) -> bool:
    """A measured time is resolved when its interval excludes 0 and spans no more than the time itself; else it is
    reported as "not resolved: between low and high"."""
    return interval is not None and interval[0] > 0 and interval[1] - interval[0] <= value


def hidden_share(exposed: float | None, interval, transfer: float | None) -> float | None:
    """The share of the transfer hidden behind backward, 1 - exposed / transfer, where the exposed time is resolved
    and its interval lies wholly below the transfer; an interval that reaches the transfer leaves it not resolved
    (it may be 0), one wholly above it is `exposed_above_transfer`."""
    if exposed is None or not transfer or not resolved(exposed, interval) or interval[1] >= transfer:
        return None
    return 1 - exposed / transfer


def exposed_above_transfer(interval, transfer: float | None) -> bool:
    """The exposed time's whole interval above the buckets' all-reduce alone: backward waited for more than the
    transfer takes (contention), not a median that noise put a hair above it."""
    return bool(interval and transfer and interval[0] > transfer)
