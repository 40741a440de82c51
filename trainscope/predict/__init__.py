"""Predict a run before it runs -- peak memory per process, the steady step time and the run's time, "fits" or
"does not fit" -- and, once it has run, how far off each predicted quantity was (docs/predict.md): the names the rest
of trainscope uses. `python -m trainscope.predict --calibrate` is make predict-calibrate.
"""

from trainscope.predict.block import MEMORY_SOURCES, before_run, calibration_state, predict, sources
from trainscope.predict.change import same_work_seconds, speedup
from trainscope.predict.check import PredictionCheck, furthest_term, prediction_errors, remember_communication
from trainscope.predict.memory_model import largest_batch, peak_memory, saved_bytes_at
from trainscope.predict.planned import (
    PlannedRun,
    changed_settings,
    current_rss_bytes,
    data_for,
    device_memory_bytes,
    evaluation_lengths,
    planned_run_for,
    planned_run_of,
    precision_from_environment,
    settings_of,
    token_lengths,
    training_lengths,
)
from trainscope.predict.screen import screen_lines, show, source_lines
from trainscope.predict.step import VERSION, PhaseModel, phase_models, quiet_fake_tensors, traced_length, traced_step
from trainscope.predict.time_model import communication_seconds, predict_time

__all__ = ["MEMORY_SOURCES", "VERSION", "PredictionCheck", "PhaseModel", "PlannedRun", "before_run",
           "calibration_state", "changed_settings", "communication_seconds", "current_rss_bytes",
           "data_for", "device_memory_bytes", "evaluation_lengths", "furthest_term", "largest_batch",
           "peak_memory", "phase_models", "precision_from_environment", "predict", "predict_time",
           "prediction_errors", "quiet_fake_tensors", "remember_communication", "same_work_seconds",
           "saved_bytes_at", "screen_lines", "settings_of", "show", "source_lines", "sources", "speedup",
           "token_lengths", "traced_length", "traced_step", "training_lengths", "planned_run_for",
           "planned_run_of"]  # fmt: skip
