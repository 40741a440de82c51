"""The in-run check: the measured counterpart of each predicted term, taken in the run it predicts (real tensors,
DTensor shards under FSDP2 read as this rank's bytes), the error of each predicted quantity at the run's end, and the
all-reduce a multi-process run measured, kept for the next prediction on this machine."""

import torch

from trainscope.core import environment
from trainscope.core.paths import GIB
from trainscope.core.record_view import RunView
from trainscope.core.records import now_iso
from trainscope.measure.memory import is_sharded, local_bytes, local_tensor
from trainscope.predict import op_costs
from trainscope.predict.memory_model import saved_bytes_at


class PredictionCheck:
    """The measured counterpart of each predicted term, taken in the run it predicts (trainscope.run.metrics owns
    it): the parameters' and optimizer state's bytes (real tensors, after the first optimizer step), the bytes
    autograd saves for backward in the first micro-batch (saved-tensor hooks, each storage once, the parameters
    left out: as predicted), and at the end the error of each predicted quantity. With --compile or --resume the
    saved bytes are not measured (the hooks would break the graph; the first step already ran), nor under FSDP2
    (see first_micro_batch); there the bytes are this rank's shards."""

    def __init__(self, block: dict | None, settings):
        self.block = block if block and not block.get("error") else None
        self.settings = settings
        self.model = self.optimizer = None
        self.measured: dict = {}
        self._hooks = None
        self._seen: set = set()
        self._params: set = set()
        self._sharded = False  # FSDP2: DTensor parameters

    def attach(self, model, optimizer) -> None:
        """This rank's bytes: under FSDP2 the parameters, gradients and optimizer state are DTensors, and their local
        shards are what the rank holds (and what has a storage to read)."""

        self.model, self.optimizer = model, optimizer
        if self.block is None:
            return
        params = list(model.parameters())
        self.measured["parameters"] = sum(local_bytes(p) for p in params)
        self.measured["gradients"] = sum(local_bytes(p) for p in params if p.requires_grad)
        self._params = {local_tensor(p).untyped_storage().data_ptr() for p in params}
        self._sharded = any(is_sharded(p) for p in params)

    def first_micro_batch(self) -> None:
        """Before the run's first micro-batch: count what autograd saves for backward (not under FSDP2: its gathered
        weights are saved too, in storages of their own that are not the sharded parameters')."""
        if self.block is None or self.settings.compile or self.settings.resume or self._sharded:
            return
        self.measured["saved"] = 0
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda tensor: tensor)
        self._hooks.__enter__()

    def _pack(self, tensor):
        storage = tensor.untyped_storage()
        pointer = storage.data_ptr()
        if pointer not in self._params and pointer not in self._seen:
            self._seen.add(pointer)
            self.measured["saved"] += storage.nbytes()
        return tensor

    def micro_batch_done(self, batch: dict, stepped: bool) -> None:
        """After a micro-batch: the hooks come off after the first; the optimizer state is read after its first step."""
        if self._hooks is not None:
            self._hooks.__exit__(None, None, None)
            self._hooks, self._seen = None, set()
            self.measured["saved_at"] = list(batch["input_ids"].shape)
        if stepped and self.block is not None and "optimizer" not in self.measured and self.optimizer is not None:
            tensors = [
                local_tensor(t)
                for state in self.optimizer.state.values()
                for t in state.values()
                if isinstance(t, torch.Tensor)
            ]
            storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
            self.measured["optimizer"] = sum(storages.values())

    def errors(self, summary: dict) -> dict | None:
        """summary `prediction_error` (docs/RECORD.md)."""
        return prediction_errors(self.block, summary, self.measured) if self.block else None


def _error(predicted, measured) -> dict | None:
    if predicted is None or measured is None:
        return None
    return {
        "predicted": predicted,
        "measured": measured,
        "error": (predicted - measured) / measured if measured else None,
    }


def prediction_errors(block: dict, summary: dict, measured: dict) -> dict:
    """Each predicted quantity and term against the run's measurement, the residual and the measured term furthest
    off (summary.prediction_error: docs/predict.md)."""

    view = RunView({"summary": summary})
    memory, timing = block["memory"], block["time"]
    peak, kind = view.peak_memory
    baseline = memory["terms_gib"].get("baseline", 0.0)
    result = {
        "peak_memory_gib": _error(memory["peak_gib"], peak),
        "memory_kind": kind,
        "peak_above_baseline_gib": _error(memory["peak_gib"] - baseline, peak - baseline if peak else None),
        "step_s": _error(timing["step_s"], view.step_s),
        "evaluation_s": _error(timing["evaluation_s"], view.eval_s or None),
        "warmup_s": _error(timing["warmup_s"], view.wall_median("warmup")),
        "run_s": _error(timing["run_s"], view.wall_s),
    }
    per_step = view.stage_seconds_per_step() if view.step_s else {}
    stages = dict(timing["stages_s"])
    stages["backward"] = stages.get("backward", 0.0) + stages.pop("communication", 0.0)  # measured inside backward
    stages.setdefault("other", 0.0)
    time_terms = {stage: _error(stages.get(stage, 0.0), per_step.get(stage)) for stage in per_step}
    gib = {**memory["terms_gib"], "gradients": memory["gradients_gib"]}
    memory_terms = {}
    for term in ("parameters", "gradients", "optimizer"):
        if term in measured:
            memory_terms[term] = _error(gib[term], measured[term] / GIB)
    if measured.get("saved_at"):
        batch, length = measured["saved_at"]
        predicted_saved = saved_bytes_at(block, batch, length)
        memory_terms["activations"] = _error(
            predicted_saved / GIB if predicted_saved else None, measured["saved"] / GIB
        )
    if peak is not None and all(t in memory_terms for t in ("parameters", "optimizer")):
        # The residual (gradients and temporaries at the peak, the allocator's share) is what the measured peak leaves
        # after the measured terms, the activations at the longest batch scaled by their measured error.
        ratio = 1.0
        if memory_terms.get("activations") and memory_terms["activations"]["predicted"]:
            ratio = memory_terms["activations"]["measured"] / memory_terms["activations"]["predicted"]
        held = sum(memory_terms[t]["measured"] for t in ("parameters", "optimizer"))
        remainder = peak - gib.get("baseline", 0.0) - held - gib["activations"] * ratio
        result["memory_residual"] = _error(
            gib["temporaries"] + gib.get("allocator", 0.0) + gib.get("ddp_buckets", 0.0), remainder
        )
    result["memory_terms"] = memory_terms
    result["time_terms"] = time_terms
    result["calibration"] = (block.get("calibration") or {}).get("state")
    result["furthest"] = furthest_term(result, peak, view.step_s)
    return result


def furthest_term(result: dict, peak: float | None, step: float | None) -> dict | None:
    """The measured term whose error moves its total most: |predicted - measured| over the measured total (memory
    terms over the peak, stage terms over the steady step). The residual is not a term: it is what is left."""
    totals = (("memory", result.get("memory_terms"), peak), ("time", result.get("time_terms"), step))
    candidates = [
        (abs(entry["predicted"] - entry["measured"]) / total, f"{kind}: {name}", entry)
        for kind, terms, total in totals
        for name, entry in (terms or {}).items()
        if entry and total
    ]
    if not candidates:
        return None
    share, name, entry = max(candidates, key=lambda c: c[0])
    return {"term": name, "share_of_total": share, "error": entry["error"]}


def remember_communication(block: dict | None, summary: dict, settings, started) -> None:
    """After a multi-process run: its all-reduce bandwidth and the share of it backward waited for, for the next
    prediction on this machine with these processes and threads (main process)."""

    if not block or block.get("error") or not started.state.is_main_process:
        return
    figures = RunView({"summary": summary or {}}).communication_figures or {}
    bandwidth, transfer = figures.get("bus_bandwidth_gbs"), figures.get("transfer_s")
    if not figures.get("measured") or not bandwidth or not transfer:
        return
    # The median exposed time, resolved or not: the best estimate there is (a note says when it was not resolved).
    exposed = figures.get("exposed_median_s") or 0.0
    device = torch.device(block["machine"]["device"].split(":")[0])
    costs = op_costs.OpCosts(device, block["machine"]["threads"], environment.local_processes())
    costs.cached["communication"] = {
        "bus_bandwidth_gbs": bandwidth,
        "exposed_fraction": min(1.0, max(0.0, exposed / transfer)),
        "exposed_resolved": bool(figures.get("resolved")),
        "measured": now_iso(),
    }
    costs.measured += 1
    costs.save()
