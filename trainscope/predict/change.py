"""What a change would do: the predicted speed-up of train.py flags or an Accelerate config against a baseline run,
on the same work (make tune's measure, trainscope.advice.judge.work_seconds), from two predictions on this machine."""

from trainscope.predict import calibration
from trainscope.predict.block import predict
from trainscope.predict.planned import PlannedRun, changed_settings, planned_run_of, settings_of


def same_work_seconds(block: dict, planned: PlannedRun) -> tuple[float, float, float]:
    """(seconds of the run for its training tokens and evaluation, training tokens): what make tune compares, the
    training part per real token (trainscope.advice.judge.work_seconds)."""
    timing = block["time"]
    settings = planned.settings
    tokens = (
        block["batches"]["micro_batches"]
        * settings.per_device_batch_size
        * planned.processes
        * block["batches"]["mean_real_length"]
    )
    return timing["run_s"] - timing["evaluation_s"], timing["evaluation_s"], tokens


def speedup(baseline, flags=(), config: str | None = None) -> dict:
    """The predicted speed-up of a change against a baseline run, on the same work (make tune's measure: training
    time per real training token, evaluation as it is): `baseline` a run record (its machine, launch and settings)
    or Settings (this machine, this launch); `flags` train.py flags and/or `config` an Accelerate config to launch
    with. {"ratio": baseline seconds / changed seconds (above 1: faster), "baseline_s", "changed_s"}."""
    record = baseline if isinstance(baseline, dict) else None
    before_settings = settings_of(baseline)
    after_settings = changed_settings(before_settings, flags)
    before_work = planned_run_of(record, before_settings)
    after_work = planned_run_of(record, after_settings, config)
    # a ratio of two predictions on this machine: its calibration if it has one, none made for it (the report and
    # the advisor ask for speed-ups; only a run's own prediction calibrates a new machine)
    fitted = calibration.read_calibration(before_work.device)
    before, after = predict(before_work, fitted=fitted), predict(after_work, fitted=fitted)
    train_b, eval_b, tokens_b = same_work_seconds(before, before_work)
    train_a, eval_a, tokens_a = same_work_seconds(after, after_work)
    baseline_s = train_b + eval_b
    changed_s = train_a * (tokens_b / tokens_a if tokens_a else 1.0) + eval_a
    return {
        "ratio": baseline_s / changed_s if changed_s else None,
        "baseline_s": baseline_s,
        "changed_s": changed_s,
        "flags": list(flags),
        "config": config,
    }
