"""The time model: the steady step by stage (collate, forward and backward at each batch's length, the optimizer,
DDP's exposed all-reduce, the loop's own time), by kind (matrix products, other operators, the framework), every
step of the run (the first creates the optimizer state), evaluation batch by batch, and the run's time."""

import dataclasses

import numpy as np

from trainscope.predict import trace
from trainscope.predict.planned import Batches, PlannedRun
from trainscope.predict.step import PhaseModel, copy_seconds_per_byte, first_touch_seconds_per_byte, phase_models


@dataclasses.dataclass
class Phases:
    """Each phase's operators (PhaseModel), the framework's own time per phase (per operator dispatched, as
    calibrated), the calibrated factor on the operators other than matrix products, and the loop's time per step."""

    models: dict[str, PhaseModel]
    framework: dict[str, float]
    factor: float
    loop: float

    def micro(self, length: float) -> dict:
        """A micro-batch's forward and backward seconds at `length`."""
        return {
            phase: self.models[phase].seconds(length, self.factor) + self.framework.get(phase, 0.0)
            for phase in ("forward", "backward")
        }

    def optimizer(self, length: float, first: bool = False) -> float:
        """The optimizer step's seconds (the first one, which creates the optimizer state, with `first`)."""
        name = "optimizer_first" if first else "optimizer"
        model = self.models.get(name, self.models["optimizer"])
        return model.seconds(length, self.factor) + self.framework.get(name, 0.0)


def predict_time(
    planned: PlannedRun, batches: Batches, traced: trace.Trace, evaluated: trace.Trace, costs, notes, calibration: dict
) -> dict:
    """The prediction's `time` block (docs/RECORD.md), with the framework's time as `calibration` fitted it (none,
    and said in `notes`, when the machine has no calibration)."""
    if not calibration:
        notes.append(
            "the framework's own time (per operator dispatched, per step, per evaluation pass) is not "
            "calibrated on this machine: left out (python -m trainscope.predict --calibrate)"
        )
    models = {**phase_models(traced, costs), **phase_models(evaluated, costs)}
    # The framework's own time (Python, module calls, autograd, dispatch) per operator dispatched, as calibrated
    dispatches = {**traced.dispatches, **evaluated.dispatches}
    framework = {phase: calibration.get("dispatch_s", 0.0) * count for phase, count in dispatches.items()}
    phases = Phases(models, framework, calibration.get("operator_factor", 1.0), calibration.get("step_s", 0.0))
    per_length = {int(t): phases.micro(t) for t in np.unique(batches.train)}
    stages = _stages(planned, batches, phases, per_length, traced, costs, notes)
    step_seconds = _step_seconds(planned, batches, phases, per_length, stages, traced, costs)
    evaluation_s, evaluation_operators, eval_passes = _evaluation(planned, batches, phases, calibration)
    eval_batches = sum(passes * len(batches.evaluation[split][0]) for split, passes in eval_passes.items())
    accumulation = batches.accumulation
    return {
        "step_s": sum(stages.values()),
        "stages_s": stages,
        "kinds_s": _kinds(batches, phases, stages, traced),
        "first_step_s": step_seconds[0] if step_seconds else None,
        "warmup_s": sum(step_seconds[: batches.warmup]),
        "steady_steps": max(0, len(step_seconds) - batches.warmup),
        "evaluation_s": evaluation_s,
        "evaluation_passes": sum(eval_passes.values()),
        "evaluation_operator_s": evaluation_operators,
        "dispatches": {
            "step": sum(traced.dispatches.get(p, 0) for p in ("forward", "backward")) * accumulation
            + traced.dispatches.get("optimizer", 0),
            "evaluation": eval_batches * dispatches.get("eval", 0),
        },
        "run_s": sum(step_seconds) + evaluation_s,
        "collate_s": dict(planned.collate_s),
        "calibration": calibration or None,
    }


def collate_in_loop(planned: PlannedRun, split: str) -> float:
    """Seconds the loop waits for a batch of `split` ("train", "eval"): its collate, where the loop loads its own
    batches (--num-workers 0); taken as none with loader workers."""
    return planned.collate_s.get(split, 0.0) if planned.settings.num_workers == 0 else 0.0


def _stages(planned, batches: Batches, phases: Phases, per_length, traced, costs, notes) -> dict:
    """The steady step's seconds by stage: its micro-batches at their mean, the optimizer, DDP, the loop."""
    settings, accumulation, steady = planned.settings, batches.accumulation, batches.steady
    forward = float(np.mean([per_length[int(t)]["forward"] for t in steady]))
    backward = float(np.mean([per_length[int(t)]["backward"] for t in steady]))
    data = collate_in_loop(planned, "train")
    if settings.num_workers:
        notes.append(f"{settings.num_workers} loader workers: the data wait is taken as none")
    return {
        "data": data * accumulation,
        "forward": forward * accumulation,
        "backward": backward * accumulation,
        "optimizer": phases.optimizer(traced.length),
        "communication": communication_seconds(planned, traced, costs, notes),
        "other": phases.loop,
    }


def _kinds(batches: Batches, phases: Phases, stages: dict, traced) -> dict:
    """The steady step's seconds by kind: matrix products, other operators, the framework, data, communication."""
    factor, accumulation = phases.factor, batches.accumulation
    kinds = {"matmul": 0.0, "operator": 0.0}
    for phase in ("forward", "backward"):
        for kind, seconds in phases.models[phase].by_kind(float(batches.steady.mean())).items():
            kinds[kind] += seconds * accumulation * (factor if kind == "operator" else 1.0)
    for kind, seconds in phases.models["optimizer"].by_kind(traced.length).items():
        kinds[kind] += seconds * (factor if kind == "operator" else 1.0)
    kinds["framework"] = (
        sum(phases.framework.get(p, 0.0) for p in ("forward", "backward")) * accumulation
        + phases.framework.get("optimizer", 0.0)
        + phases.loop
    )
    kinds["data"], kinds["communication"] = stages["data"], stages["communication"]
    return kinds


def _step_seconds(planned, batches: Batches, phases: Phases, per_length, stages, traced, costs) -> list[float]:
    """Every optimizer step's seconds, in order, at its micro-batches' lengths."""
    train, accumulation = batches.train, batches.accumulation
    optimizer, communication, loop = stages["optimizer"], stages["communication"], phases.loop
    data = collate_in_loop(planned, "train")
    # The first step creates the optimizer state, and touches fresh memory for everything it holds.
    touch = first_touch_seconds_per_byte(costs) if planned.device.type == "cpu" else 0.0
    first_extra = (
        phases.optimizer(traced.length, first=True) - optimizer + touch * traced.peak_at(float(batches.steady.mean()))
    )
    train_lengths_by_step = train.reshape(-1, accumulation) if len(train) % accumulation == 0 else None
    step_seconds = []
    for index in range(len(train) // accumulation):
        lengths = train_lengths_by_step[index] if train_lengths_by_step is not None else [train[index]]
        seconds = (
            sum(per_length[int(t)]["forward"] + per_length[int(t)]["backward"] + data for t in lengths)
            + optimizer
            + communication
            + loop
        )
        step_seconds.append(seconds + (first_extra if index == 0 else 0.0))
    return step_seconds


def _evaluation(planned, batches: Batches, phases: Phases, calibration: dict) -> tuple[float, float, dict]:
    """(seconds of every evaluation pass of the run, of it the operators other than matrix products, passes per
    split). A batch's operators scale with its rows (a last, partial batch costs its share); the framework's per
    batch."""
    settings, evaluation = planned.settings, batches.evaluation
    eval_forward = phases.models["eval"]
    eval_collate = collate_in_loop(planned, "eval")
    eval_passes = {"validation": max(1, planned.plan.get("epochs", 1)), "test": 1}
    eval_batch = settings.resolved_eval_batch_size
    evaluation_s = sum(
        passes
        * (
            calibration.get("evaluation_pass_s", 0.0)
            + sum(
                (eval_forward.seconds(t) + eval_collate) * rows / eval_batch + phases.framework.get("eval", 0.0)
                for t, rows in zip(*evaluation[split])
            )
        )
        for split, passes in eval_passes.items()
    )
    evaluation_operators = sum(
        passes
        * sum(eval_forward.by_kind(t).get("operator", 0.0) * rows / eval_batch for t, rows in zip(*evaluation[split]))
        for split, passes in eval_passes.items()
    )
    return evaluation_s, evaluation_operators, eval_passes


def communication_seconds(planned, traced, costs, notes) -> float:
    """DDP's exposed all-reduce per optimizer step, from this machine's measured bandwidth and exposed share (the
    last multi-process run with these processes and threads recorded them); 0 and said when none did."""
    if planned.processes < 2:
        return 0.0
    measured = costs.cached.get("communication")
    if not measured:
        notes.append(
            "DDP communication: this machine has not measured its all-reduce yet (no multi-process run with "
            "these processes and threads): left out"
        )
        return 0.0
    gradient_bytes = traced.trainable_bytes
    ring = 2 * (planned.processes - 1) / planned.processes
    total = ring * gradient_bytes / (measured["bus_bandwidth_gbs"] * 1e9)
    resolved = "" if measured.get("exposed_resolved", True) else " (the median of an exposed time not resolved)"
    notes.append(
        f"DDP communication from this machine's last measurement ({measured['bus_bandwidth_gbs']:.2f} GB/s, "
        f"{measured['exposed_fraction']:.0%} of it exposed{resolved}) and the buckets' copies"
    )
    # DDP copies the gradients into its buckets and back (without --ddp-gradient-as-bucket-view): two copies
    copies = 0 if planned.settings.ddp_gradient_as_bucket_view else 2 * gradient_bytes * copy_seconds_per_byte(costs)
    return total * measured["exposed_fraction"] + copies
