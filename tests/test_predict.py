"""The predictor (trainscope.predict, trace, op_costs) on planted shapes, planted machines and tiny traces; --predict
and a run's recorded prediction through train.py in this process."""

import functools
import json
import math
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import ONE_THREAD, ROOT, TINY, assert_ok, run_in_process

from trainscope import predict
from trainscope.core import environment, paths
from trainscope.experiments import batch_search
from trainscope.experiments import prediction as predict_check
from trainscope.measure import peak
from trainscope.predict import calibration, op_costs, trace
from trainscope.predict import planned as planned_runs
from trainscope.run.table import prediction_lines
from trainscope.workload import modeling
from trainscope.workload.modeling import classification_loss
from trainscope.workload.settings import parse_settings

CPU = torch.device("cpu")
INPUTS = ["input_ids", "attention_mask", "token_type_ids"]
LABELS = ["a", "b", "c"]


def tiny(*flags, layers=None, dropout=None, width=None):
    """Settings of the tiny model and a builder of it (layers, dropout, width planted into its config)."""
    (settings,) = parse_settings(argv=["--model", "embedded:tiny-bert", *flags])
    config = modeling.model_config(settings, LABELS)
    if layers is not None:
        config.num_hidden_layers = layers
    if dropout is not None:
        config.hidden_dropout_prob = config.attention_probs_dropout_prob = dropout
    if width is not None:
        config.hidden_size, config.intermediate_size = width, 4 * width

    def build(device="meta"):
        with torch.device(device):
            return modeling.build_architecture(settings, LABELS, config=config)

    return settings, build


AVOID = {1, 2, 3, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 30522}  # the tiny model's and batches' sizes


def traced(build, batch=4, length=23, precision="fp32", settings=None):
    return trace.trace_training(build, INPUTS, batch, length, precision, CPU, settings or tiny()[0], avoid=AVOID)


@functools.lru_cache(maxsize=None)
def traced_tiny(*flags, layers=None, dropout=None, width=None, batch=4, length=23, precision="fp32"):
    """A trace of the tiny model, shared by the tests that read the same one (tracing takes a fraction of a second)."""
    settings, build = tiny(*flags, layers=layers, dropout=dropout, width=width)
    return traced(build, batch, length, precision, settings)


def layer_bytes(t):
    return sum(v for k, v in t.saved_at(t.length).items() if k.startswith("layer"))


# ---------------------------------------------------------------- the traced step


def test_a_model_twice_as_deep_keeps_twice_the_activations_of_its_layers():
    shallow, deep = traced_tiny(dropout=0.1), traced_tiny(layers=4, dropout=0.1)
    assert layer_bytes(shallow) > 0 and layer_bytes(deep) == 2 * layer_bytes(shallow)
    assert sorted(k for k in deep.saved if k.startswith("layer")) == [f"layer {i}" for i in range(4)]
    activations = lambda t: t.memory_at(t.length)["activations"]  # noqa: E731
    assert 1.6 < activations(deep) / activations(shallow) <= 2.0  # embeddings and head do not grow


def test_the_traced_step_steps_the_optimizer_the_run_builds():
    """The traced optimizer step is the run's own optimizer (trainscope.workload.modeling.build_optimizer, as
    --optimizer-implementation says), not the fused AdamW the trace used to build whatever the run's."""

    def optimizer_ops(*flags):
        return {op.name for op in traced_tiny(*flags).ops if op.phase == "optimizer"}

    fused, foreach = optimizer_ops(), optimizer_ops("--optimizer-implementation", "foreach")
    assert any("_fused_adamw" in name for name in fused)
    assert not any("_fused_adamw" in name for name in foreach) and any("_foreach_" in name for name in foreach)
    loop = optimizer_ops("--optimizer-implementation", "for-loop")  # one kernel per parameter, no foreach kernel
    assert not any("_fused_adamw" in name or "_foreach_" in name for name in loop)


def test_the_traced_activations_are_what_autograd_keeps_in_a_real_step():
    """The second instrument: saved-tensor hooks on a real step of the same model count what the trace predicted."""
    _, build = tiny(dropout=0.1)
    predicted = traced(build, batch=3, length=19).saved_bytes
    with torch.random.fork_rng():
        model = build("cpu")
        model.train()
        params = {p.untyped_storage().data_ptr() for p in model.parameters()}
        seen = {}

        def pack(tensor):
            storage = tensor.untyped_storage()
            if storage.data_ptr() not in params:
                seen[storage.data_ptr()] = storage.nbytes()
            return tensor

        inputs = {
            "input_ids": torch.randint(5, 100, (3, 19)),
            "attention_mask": torch.ones(3, 19, dtype=torch.long),
            "token_type_ids": torch.zeros(3, 19, dtype=torch.long),
        }
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            classification_loss(model(**inputs).logits, torch.zeros(3, dtype=torch.long)).backward()
    assert sum(seen.values()) == predicted


def test_attention_keeps_its_probabilities_only_with_dropout_in_training():
    """On a CPU, SDPA with attention dropout in training takes the math path (B x H x T^2 kept for backward); without
    dropout, and in evaluation, the flash kernel (a logsumexp): the fake trace chooses as the real kernels do."""
    names = lambda t: {op.name.split(".")[1] for op in t.ops}  # noqa: E731
    with_dropout, without = traced_tiny(dropout=0.1), traced_tiny(dropout=0.0)
    assert "_safe_softmax" in names(with_dropout) and "_scaled_dot_product_flash_attention_for_cpu" in names(without)
    assert with_dropout.saved_bytes > without.saved_bytes
    evaluation = trace.trace_evaluation(tiny(dropout=0.1)[1], INPUTS, 4, 23, "fp32", CPU, AVOID)
    assert "_scaled_dot_product_flash_attention_for_cpu" in names(evaluation) and "_safe_softmax" not in names(
        evaluation
    )


def test_lora_keeps_less_optimizer_state_and_checkpointing_fewer_activations():
    _, build = tiny(dropout=0.1)
    full, lora = traced_tiny(dropout=0.1), traced_tiny("--lora", dropout=0.1)
    state = lambda t: t.memory_at(t.length)["optimizer"]  # noqa: E731
    assert 0 < state(lora) < state(full) / 10
    weights = len(list(build().parameters()))
    assert state(full) == 2 * full.trainable_bytes + 4 * weights  # AdamW: two fp32 states and a step
    assert lora.parameter_bytes > full.parameter_bytes  # the frozen weights stay, the adapters add
    checkpointed = traced_tiny("--gradient-checkpointing", dropout=0.1, batch=8, length=31)
    plain = traced_tiny(dropout=0.1, batch=8, length=31)
    assert checkpointed.saved_bytes < plain.saved_bytes / 3


# ---------------------------------------------------------------- time on a planted machine


class PlantedCosts(op_costs.OpCosts):
    """The machine's costs planted: matrix products at `rates` (TFLOP/s per precision), every other operator
    0.1 ns per byte of its largest tensor."""

    def __init__(self, rates):
        super().__init__(CPU, 1, 1, store=False)
        self.rates = rates

    def seconds(self, op):
        if op.gemm is not None:
            return (
                2 * op.gemm[0] * op.gemm[1] * op.gemm[2] / (self.rates[op_costs.gemm_precision(op.dtype, CPU)] * 1e12)
            )
        return op.work * (2 if op.dtype == "bfloat16" else 4) * 1e-10


def step_seconds(precision, rates):
    t = traced_tiny(dropout=0.1, width=256, batch=16, length=41, precision=precision)
    models = predict.phase_models(t, PlantedCosts(rates))
    return sum(models[p].seconds(41) for p in ("forward", "backward")), models


def test_a_machine_whose_bf16_peak_is_twice_its_fp32_predicts_a_faster_bf16_step():
    fp32, _ = step_seconds("fp32", {"fp32": 0.1, "bf16": 0.2})
    bf16, models = step_seconds("bf16", {"fp32": 0.1, "bf16": 0.2})
    same, _ = step_seconds("bf16", {"fp32": 0.1, "bf16": 0.1})
    assert bf16 < 0.9 * fp32 and bf16 < same  # the bf16 matmuls at twice the rate
    matmul = models["forward"].by_kind(41)["matmul"]
    assert matmul > 0 and models["forward"].by_kind(41)["operator"] > 0


def test_the_peak_cache_feeds_the_matmul_costs(tmp_path, monkeypatch):
    """A planted peak cache file: a matrix product costs its FLOPs over the cached rate, nothing is measured."""
    monkeypatch.setenv(paths.CACHE_ENV, str(tmp_path))
    monkeypatch.setattr(peak, "measure", lambda *a, **k: pytest.fail("measured although cached"))
    shape = (64, 32, 48)
    key = peak.machine_key(CPU, threads=1, processes=1)
    rate = peak.Rate("fp32", shape, 0.5, 0.5, 0.5, 3, "2026-01-01T00:00:00+00:00", 0.1)
    peak._store(key, "rates", {peak._entry("fp32", shape): rate.to_dict()})
    op = trace.Op("forward", "aten.mm.default", "k", ((), {}), gemm=shape, dtype="float32")
    assert op_costs.OpCosts(CPU, 1, 1, store=False).seconds(op) == pytest.approx(2 * 64 * 32 * 48 / 0.5e12)


def test_an_operator_cost_and_a_tensor_grow_with_the_power_of_the_length_in_their_shapes():
    t = traced_tiny(dropout=0.1)
    powers = {}
    for op in t.ops:
        powers.setdefault(op.name.split(".")[1], set()).add(op.power)
    assert powers["_safe_softmax"] == {2} and powers["native_layer_norm"] == {1}
    assert powers["addmm"] == {0, 1}  # the encoder's linear layers, and the pooler and classifier on [CLS]
    assert trace.length_power((4, 2, 23, 23), 4, 23, AVOID) == 2 and trace.length_power((92, 32), 4, 23, AVOID) == 1
    model = predict.PhaseModel(10, [(1.0, 1, "matmul"), (2.0, 2, "operator")])
    assert model.seconds(20) == pytest.approx(2 + 8) and model.by_kind(20) == {"matmul": 2.0, "operator": 8.0}
    longer = traced_tiny(dropout=0.1, length=47)  # one trace tells the other length: the same bytes
    assert t.saved_at(47) == pytest.approx({k: float(v) for k, v in longer.saved_at(47).items()})
    wider = traced_tiny(dropout=0.1, batch=32, length=47)  # where activations, not gradients, make the peak
    for other, batch in ((longer, 4), (wider, 32)):
        assert t.peak_at(47, batch) == pytest.approx(other.peak_at(47), rel=0.02)


# ---------------------------------------------------------------- the batches the run will see


def test_padded_lengths_follow_the_batching():
    lengths = np.array([5, 7, 30, 6, 8, 31, 5, 29] * 10)
    random = predict.training_lengths(lengths, 4, 20, seed=1)
    grouped = predict.training_lengths(lengths, 4, 20, group_by_length=True, seed=1)
    assert len(random) == len(grouped) == 20 and random.max() <= 31 and grouped.min() >= 5
    assert grouped.mean() < random.mean()  # grouping by length pads less
    assert set(predict.training_lengths(lengths, 4, 5, pad_to_max_length=True, max_seq_length=64)) == {64}
    assert predict.training_lengths(lengths, 4, 6, processes=2, pad_to_multiple_of=8, seed=1).tolist() == [
        ((x + 7) // 8) * 8 for x in predict.training_lengths(lengths, 4, 12, seed=1)[::2]
    ]
    padded, rows = predict.evaluation_lengths(np.array([3, 9, 4, 2, 7]), 2)
    assert padded.tolist() == [9, 4, 7] and rows.tolist() == [2, 2, 1]
    padded, rows = predict.evaluation_lengths(np.array([3, 9, 4, 2, 7]), 2, processes=2, group_by_length=True)
    assert padded.tolist() == [3, 9] and rows.tolist() == [2, 1]


def test_saved_bytes_at_another_batch_and_length_follow_each_powers_term():
    block = {
        "memory": {
            "saved_by_power": {"layer 0": {"1": 30, "2": 200}, "classifier": {"0": 7}},
            "traced": {"batch": 4, "length": 10},
        }
    }
    assert predict.saved_bytes_at(block, 4, 20) == pytest.approx(60 + 800 + 7)
    assert predict.saved_bytes_at(block, 8, 20) == pytest.approx(2 * (60 + 800) + 7)


def test_the_allocator_share_is_a_least_squares_line_through_the_calibration_runs():
    fitted = calibration.fit_allocator([(1e8, 0.4 * 1e8 + 5e7), (3e8, 0.4 * 3e8 + 5e7), (6e8, 0.4 * 6e8 + 5e7)])
    assert fitted["factor"] == pytest.approx(0.4) and fitted["constant_bytes"] == pytest.approx(5e7)
    assert fitted["runs"] == 3 and fitted["residual_bytes"] == pytest.approx(0, abs=1)


def test_the_batch_search_starts_from_the_prediction_and_corrects_it_both_ways(monkeypatch):
    import accelerate.utils.memory

    monkeypatch.setattr(accelerate.utils.memory, "clear_device_cache", lambda garbage_collection=False: None)

    def fits_up_to(limit):
        def trial(size):
            if size > limit:
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

        return trial

    assert batch_search.search(fits_up_to(100), 12, grow=True) == 96  # too low a prediction: doubled
    assert batch_search.search(fits_up_to(100), 400, grow=True) == 100  # too high: halved
    assert batch_search.search(fits_up_to(100), 64, grow=True) == 64


# ---------------------------------------------------------------- errors, the report's rows


def planted_block(peak_gib=1.0, step=1.0):
    return {
        "memory": {
            "peak_gib": peak_gib,
            "gradients_gib": 0.1,
            "saved_by_power": {"layer 0": {"1": 0.3 * 2**30}},
            "traced": {"batch": 8, "length": 50},
            "terms_gib": {
                "baseline": 0.4,
                "parameters": 0.1,
                "optimizer": 0.2,
                "activations": 0.3,
                "temporaries": 0.0,
                "allocator": 0.0,
            },
        },
        "time": {
            "step_s": step,
            "warmup_s": 2.5,
            "evaluation_s": 3.0,
            "run_s": 20.0,
            "stages_s": {"data": 0.01, "forward": 0.39, "backward": 0.5, "optimizer": 0.1, "communication": 0.0},
        },
    }


def planted_summary(peak_gib=1.2, step=1.0):
    table = lambda wall, seconds: {
        "wall_s": {"median": wall, "max": wall},  # noqa: E731
        "seconds": {k: {"median": v, "max": v} for k, v in seconds.items()},
    }
    stages = {"data": 0.01, "forward": 0.4, "backward": 0.48, "optimizer": 0.1, "eval": 0.0, "other": 0.01}
    return {
        "memory": {"peak_rss_gib": {"median": peak_gib, "max": peak_gib}},
        "throughput": {"step_s": step, "optimizer_steps": 10},
        "timing": {
            "across_ranks": {
                "steady": table(10 * step, {k: 10 * v for k, v in stages.items()}),
                "warmup": table(2.4, stages),
                "run": table(21.0, {**stages, "eval": 3.3}),
            }
        },
        "wall_s": 21.0,
    }


def test_each_predicted_quantity_and_term_gets_its_error_and_the_furthest_is_named():
    measured = {
        "parameters": 0.1 * 2**30,
        "gradients": 0.1 * 2**30,
        "optimizer": 0.2 * 2**30,
        "saved": 0.3 * 2**30,
        "saved_at": [8, 50],
    }
    errors = predict.prediction_errors(planted_block(), planted_summary(), measured)
    assert errors["peak_memory_gib"]["error"] == pytest.approx(1.0 / 1.2 - 1)
    assert errors["run_s"]["error"] == pytest.approx(20 / 21 - 1) and errors["step_s"]["error"] == pytest.approx(0)
    assert errors["memory_terms"]["parameters"]["error"] == 0 and errors["memory_terms"]["activations"]["error"] == 0
    # the memory before the model is measured in the run: on both sides of the error of what was predicted
    assert errors["peak_above_baseline_gib"]["error"] == pytest.approx((1.0 - 0.4) / (1.2 - 0.4) - 1)
    # what the measured peak leaves after the measured terms is the residual, never a term "furthest off"
    assert "rest" not in errors["memory_terms"]
    assert errors["memory_residual"]["measured"] == pytest.approx(1.2 - 0.4 - 0.3 - 0.3)
    assert errors["furthest"]["term"] == "time: backward" and errors["furthest"]["share_of_total"] == pytest.approx(
        0.02
    )
    assert errors["time_terms"]["backward"]["error"] == pytest.approx(0.5 / 0.48 - 1)
    lines = prediction_lines(errors)
    assert any("furthest off: time: backward" in line for line in lines)
    assert any(
        "peak above the memory before the model 0.60 GiB predicted, 0.80 measured (-25%)" in line and "residual" in line
        for line in lines
    )


def test_the_report_rows_give_median_and_worst_error_and_the_term_furthest_off():
    records = {}
    for name, peak_gib in (("a-r0", 1.1), ("b-r0", 1.0), ("c-r0", 1.5)):
        errors = predict.prediction_errors(
            planted_block(),
            planted_summary(peak_gib),
            {"parameters": 0.1 * 2**30, "gradients": 0.1 * 2**30, "optimizer": 0.2 * 2**30},
        )
        records[name] = {
            "run_name": name,
            "settings": {"per_device_batch_size": 8},
            "summary": {**planted_summary(peak_gib), "prediction_error": errors},
        }
    rows = predict_check.run_rows(records)
    summary = predict_check.summarize(rows)
    assert [r["run"] for r in rows] == ["a", "b", "c"]
    assert summary["peak_memory_gib"]["median_abs_error"] == pytest.approx(1 - 1 / 1.1)
    assert summary["peak_memory_gib"]["worst_run"] == "c" and summary["furthest_term"] == "time: backward"
    assert summary["peak_above_baseline_gib"]["worst_run"] == "c" and summary["residual"]["runs"] == 3
    text = predict_check.summary_text(summary, "calibrated")
    assert "measured term furthest off: time: backward" in text and "the residual (the peak less" in text
    assert "peak above the start: median |error|" in text and "worst -45.5% (c)" in text
    goals = predict_check.goals_text({"summary": summary, "first_use": {"summary": summary}})
    assert "calibrated: median |error| peak memory 9.1% (within 10%)" in goals and "first use:" in goals


def test_a_run_predicted_again_keeps_the_memory_it_held_before_its_model(monkeypatch):
    """make predict-check's first-use pass (repredicted): the memory the run held before its model, as its own
    prediction measured it, goes into the new prediction, which is judged on the run's summary; the record's copy
    carries the new error, the record itself is left as it was."""
    from types import SimpleNamespace

    from trainscope.core.record_view import RunView

    record = {
        "run_name": "a-r0",
        "settings": {"per_device_batch_size": 8, "no_such_setting": 1},
        "prediction": planted_block(),
        "summary": planted_summary(),
    }
    seen = {}
    monkeypatch.setattr(predict, "planned_run_of", lambda record, settings: SimpleNamespace(rss_bytes=None))

    def planted_predict(planned, store, fitted):
        seen["rss_bytes"], seen["fitted"] = planned.rss_bytes, fitted
        return planted_block(peak_gib=1.1)

    monkeypatch.setattr(predict, "predict", planted_predict)
    errors = predict_check.repredicted(record, {"method": "first use"})
    assert seen == {"rss_bytes": int(0.4 * 2**30), "fitted": {"method": "first use"}}
    assert errors["peak_memory_gib"]["predicted"] == 1.1 and errors["peak_memory_gib"]["measured"] == pytest.approx(1.2)
    again = RunView(record).with_prediction_error(errors)
    assert RunView(again).prediction_error is errors and "prediction_error" not in record["summary"]
    assert RunView({"summary": {}}).prediction_baseline_gib == 0.0


def test_the_advisor_never_asks_the_predictor_even_where_the_run_has_a_prediction(monkeypatch):
    """The predictor's speed-ups come from the reading machine's measured rates; the advisor reads the record alone
    (issue 60: the same record gave 2.42x under one machine's cache and 12.00x under another's)."""
    from test_advisor import record

    from trainscope.advice import advisor

    planted = record(
        environment__cpu_native_bf16=True,
        environment__cpu_capability="AVX512 + avx512_bf16",
        environment__cpu_bf16_matmul={"size": 1024, "threads": 2, "speedup": 3.0},
    )
    (plain,) = [s for s in advisor.advise(planted) if s.rule == "cpu_precision"]
    monkeypatch.setattr(predict, "speedup", lambda *args, **kwargs: pytest.fail("the advisor asked the predictor"))
    planted["prediction"] = planted_block()
    (with_prediction,) = [s for s in advisor.advise(planted) if s.rule == "cpu_precision"]
    assert with_prediction.gain_text() == plain.gain_text() and "predicted by" not in plain.gain_text()


# ---------------------------------------------------------------- through train.py


def test_predict_prints_one_screen_exits_0_and_trains_nothing(runs, monkeypatch):
    import trainscope.classifier

    monkeypatch.setattr(trainscope.classifier, "build_model", lambda *a, **k: pytest.fail("--predict built a model"))
    result = run_in_process([*TINY, *ONE_THREAD, "--output-dir", str(runs), "--predict", "--max-steps", "6"])
    assert_ok(result)
    screen = result.stdout
    assert "prediction: embedded:tiny-bert on embedded:tweets" in screen and "steady step" in screen
    assert "peak RSS" in screen and "fits" in screen and "nothing trained, no run record written" in screen
    assert not runs.exists()
    # the tests switch the first-use calibration off: the prediction says it is uncalibrated, and what it rests on
    assert "UNCALIBRATED: this machine has no calibration (switched off (TRAINSCOPE_CALIBRATION=off))" in screen
    assert "rests on    peak:" in screen and "0% fitted" in screen and "measured in this run" in screen


def test_a_changes_predicted_speedup_is_judged_on_the_same_work(monkeypatch):
    """predict.speedup (what make tune shows beside its measured speed-up), on a planted machine: no change is 1x;
    grouping by length, which pads less, is predicted faster per real token."""
    planted = PlantedCosts({"fp32": 0.01, "bf16": 0.02})
    monkeypatch.setattr(op_costs.OpCosts, "seconds", lambda self, op: planted.seconds(op))
    monkeypatch.setattr(planned_runs, "collate_seconds", lambda *args, **kwargs: 1e-3)
    (settings,) = parse_settings(argv=[*TINY, *ONE_THREAD, "--max-steps", "8"])
    same = predict.speedup(settings)
    grouped = predict.speedup(settings, ["--group-by-length"])
    assert same["ratio"] == pytest.approx(1.0)
    assert grouped["ratio"] > 1.05 and grouped["changed_s"] < grouped["baseline_s"]


def test_a_records_launch_is_the_workload_predicted_for_it(monkeypatch):
    """predict.planned_run_of: the device, processes, precision and threads of the run a record describes (read through
    its typed view); a config given beside it sets the processes and precision."""
    monkeypatch.setattr(planned_runs, "collate_seconds", lambda *args, **kwargs: 1e-3)
    (settings,) = parse_settings(argv=[*TINY, *ONE_THREAD])
    environment_block = {
        "device": "cpu",
        "world_size": 2,
        "effective_precision": "bf16",
        "threads": {"torch_threads": 3},
    }
    planned = predict.planned_run_of({"environment": environment_block}, settings)
    assert (planned.device.type, planned.processes, planned.precision, planned.threads) == ("cpu", 2, "bf16", 3)
    assert planned.collate_s == {"train": 1e-3, "eval": 1e-3}
    assert predict.planned_run_of({"environment": environment_block}, settings, "cpu").processes == 1


def test_the_machines_load_counts_other_processes_not_the_runs_it_launched():
    """A spinning process started beside the shapes is interference; a child the command waited for is its own."""
    import subprocess
    import sys
    import time

    # spins for 0.6 s of its own CPU time (however long a loaded machine takes to give it that)
    spin = [sys.executable, "-c", "import time\nwhile time.process_time() < 0.6: pass"]
    before = predict_check.machine_load()
    subprocess.run(spin, check=True)  # a run of our own, waited for
    after = predict_check.machine_load()
    assert after["own_cpu_s"] - before["own_cpu_s"] >= 0.5
    before = predict_check.machine_load()
    other = subprocess.Popen(spin)
    time.sleep(1.0)
    after = predict_check.machine_load()  # before it is waited for: not ours
    other.wait()
    assert predict_check.other_cores({"before": before, "after": after}) >= 0.3
    quiet = {
        "before": {"machine_cpu_s": 100.0, "own_cpu_s": 10.0, "monotonic_s": 0.0, "load_average_1min": 1.9},
        "after": {
            "machine_cpu_s": 302.0,
            "own_cpu_s": 205.0,
            "monotonic_s": 100.0,
            "load_average_1min": 2.0,
            "usable_cores": 2,
        },
    }
    assert predict_check.other_cores(quiet) == pytest.approx(0.07)  # its own two threads do not make it busy
    assert "a quiet machine" in predict_check.load_text(quiet)
    quiet["after"]["machine_cpu_s"] = 360.0
    assert "a busy machine" in predict_check.load_text(quiet)
    old = {"before": {"load_average_1min": 1.7}, "after": {"load_average_1min": 1.6, "usable_cores": 2}}
    assert "busy" not in predict_check.load_text(old) and "not told apart" in predict_check.load_text(old)


# ---------------------------------------------------------------- DDP's communication, remembered for the next prediction


def test_a_ddp_runs_measured_all_reduce_is_remembered_and_enters_the_next_prediction(tmp_path, monkeypatch):
    """The summary's communication block as trainscope.measure.communication.measured writes it (transfer_s, bus bandwidth, the exposed
    median) is stored for this machine; a 2-process prediction then charges its exposed share, and no longer says the
    all-reduce was never measured."""
    from types import SimpleNamespace

    from test_communication import planted_rank

    from trainscope.measure.communication import block as communication_block

    monkeypatch.setenv(paths.CACHE_ENV, str(tmp_path))
    transfer = [[0.040, 0.041, 0.039]]
    ranks = [planted_rank(r, [0.010, 0.011, 0.009, 0.010, 0.012, 0.010, 0.011], transfer=transfer) for r in (0, 1)]
    summary = {"communication": communication_block.combine(ranks, {"step_s": 0.5})}
    started = SimpleNamespace(state=SimpleNamespace(is_main_process=True))
    block = {"machine": {"device": "cpu", "threads": 1}}
    monkeypatch.setattr(environment, "local_processes", lambda: 2)
    predict.remember_communication(block, summary, None, started)
    stored = op_costs.OpCosts(CPU, 1, 2, store=False).cached["communication"]
    assert stored["bus_bandwidth_gbs"] == pytest.approx(summary["communication"]["bus_bandwidth_gbs"])
    assert stored["exposed_fraction"] == pytest.approx(0.010 / 0.040) and stored["exposed_resolved"]
    planned = SimpleNamespace(processes=2, settings=SimpleNamespace(ddp_gradient_as_bucket_view=True))
    notes = []
    seconds = predict.communication_seconds(
        planned, SimpleNamespace(trainable_bytes=100e6), op_costs.OpCosts(CPU, 1, 2), notes
    )
    assert seconds == pytest.approx(0.010, rel=0.05)  # the same bytes: the measured exposed time
    assert not any("not measured" in note for note in notes) and "25% of it exposed" in notes[0]


# ---------------------------------------------------------------- texts longer than the model's positions


def test_the_traced_length_stays_within_the_models_positions():
    avoid = {1, 4, 32, 128, 512, 2048}
    assert predict.traced_length(512.0, 4, avoid, limit=512) == 511  # 512 is a size of the model: the nearest below
    assert predict.traced_length(600.0, 4, avoid, limit=512) == 511
    assert predict.traced_length(40.0, 4, avoid, limit=512) == 40
    assert predict.traced_length(32.0, 4, avoid) in (31, 33) and predict.traced_length(3.0, 3, avoid) == 8


def test_texts_longer_than_the_models_positions_are_predicted_and_no_traceback_is_printed(tmp_path, runs, capfd):
    """--max-seq-length above the model's 512 positions and texts of hundreds of words: every batch is 512 long, a
    length the model has as a size (its positions); the prediction traces a length it accepts and nothing prints a
    traceback (torch's fake-tensor logger included)."""
    import csv
    import json

    words = ["alpha", "beta", "gamma", "delta", "river", "stone", "cloud", "light"]
    with open(tmp_path / "long.csv", "w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["text", "label"])
        for row in range(48):
            writer.writerow([" ".join(words[(row * 7 + i) % 8] for i in range(700)), row % 2])
    result = run_in_process(
        [
            "--model",
            "embedded:tiny-bert",
            "--dataset",
            str(tmp_path / "long.csv"),
            "--max-seq-length",
            "1024",
            "--per-device-batch-size",
            "4",
            "--max-steps",
            "3",
            "--report-to",
            "none",
            *ONE_THREAD,
            "--output-dir",
            str(runs),
            "--run-name",
            "long",
        ]
    )
    assert_ok(result)
    captured = capfd.readouterr()
    for text in (result.stdout, result.stderr, captured.out, captured.err):
        assert "Traceback" not in text
    block = json.loads((runs / "long" / "record.json").read_text())["prediction"]
    assert "error" not in block, block.get("error")
    assert block["batches"]["longest"] == 512 and block["batches"]["traced_length"] <= 512
    assert block["memory"]["traced"]["length"] <= 512


def test_a_step_that_cannot_be_traced_is_an_error_without_the_fake_tensor_loggers_traceback():
    import logging

    class Kept(logging.Handler):
        def __init__(self):
            super().__init__()
            self.records = []

        def emit(self, record):
            self.records.append(record)

    kept, logger = Kept(), logging.getLogger("torch._subclasses.fake_tensor")  # torch's own handler prints them
    logger.addHandler(kept)
    try:
        with pytest.raises(RuntimeError, match="broadcast"), predict.quiet_fake_tensors():
            traced(tiny()[1], batch=4, length=513)  # past the tiny model's 512 positions
        assert kept.records == []
        with pytest.raises(RuntimeError, match="broadcast"):
            traced(tiny()[1], batch=4, length=513)
        assert kept.records and kept.records[0].exc_info  # what the quiet mode keeps off the terminal
    finally:
        logger.removeHandler(kept)


# ---------------------------------------------------------------- what a prediction rests on, and its calibration


def test_a_prediction_says_what_is_derived_fitted_and_measured():
    block = planted_block()
    block["memory"]["terms_gib"]["allocator"] = 0.2
    block["time"]["kinds_s"] = {"matmul": 0.4, "operator": 0.3, "framework": 0.1, "data": 0.05, "communication": 0.05}
    block["time"]["calibration"] = {"operator_factor": 1.5}
    found = predict.sources(block["memory"], block["time"])
    assert found["peak_gib"] == pytest.approx({"measured": 0.4, "derived": 0.6, "fitted": 0.2})
    # the operators timed alone (0.2) are derived, what the fitted factor adds (0.1) and the framework are fitted
    assert found["step_s"] == pytest.approx({"derived": 0.4 + 0.2 + 0.05, "fitted": 0.1 + 0.1, "measured": 0.05})
    assert sum(found["step_share"].values()) == pytest.approx(1.0) and found["peak_share"]["fitted"] == pytest.approx(
        0.2 / 1.2
    )


def test_a_fit_held_at_its_bound_is_named_and_warned_of():
    """Steps whose residual wants the operators 3x slower than timed alone: the factor is held at its upper bound 2,
    the calibration says so, and a run predicted with it carries the warning."""
    from trainscope.measure import health

    points = [
        {
            "step_s": 1.0 + 2 * op,
            "step_residual_s": 2 * op,
            "step_operator_s": op,
            "step_dispatches": 1000 * k,
            "evaluation_residual_s": 0.1,
            "evaluation_passes": 2,
            "evaluation_operator_s": 0.0,
            "evaluation_dispatches": 0,
        }
        for k, op in ((1, 0.1), (2, 0.3), (3, 0.2), (4, 0.5))
    ]
    fitted = calibration.fit_time(points)
    assert (
        fitted["operator_factor"] == pytest.approx(2.0) and "operator_factor at its upper bound 2" in fitted["at_bound"]
    )
    state = predict.calibration_state({"key": {"device": "cpu"}, "time": fitted, "method": "full"}, CPU)
    assert state["state"] == "calibrated" and state["at_bound"] == fitted["at_bound"]
    record = {"settings": {}, "environment": {}, "summary": {}, "prediction": {**planted_block(), "calibration": state}}
    (warning,) = [w for w in health.check(record) if w["code"] == "prediction_fit_at_bound"]
    assert "operator_factor at its upper bound 2" in warning["message"]
    lines = predict.source_lines(
        {"sources": predict.sources(planted_block()["memory"], {"kinds_s": {"matmul": 1.0}}), "calibration": state}
    )
    assert any(line.startswith("warning: the calibration's operator_factor at its upper bound 2") for line in lines)
    plain = calibration.fit_time([{**p, "step_residual_s": 0.2 * p["step_operator_s"]} for p in points])
    assert "operator_factor" not in " ".join(plain["at_bound"])


def few_time_points(*residuals: float) -> list[dict]:
    """The time points of a first-use calibration its budget cut to len(residuals) shapes."""
    return [
        {
            "step_s": 0.5,
            "step_residual_s": residual,
            "step_operator_s": 0.1 * (k + 1),
            "step_dispatches": 1000 * (k + 1),
            "evaluation_residual_s": 0.1,
            "evaluation_passes": 2,
            "evaluation_operator_s": 0.0,
            "evaluation_dispatches": 0,
        }
        for k, residual in enumerate(residuals)
    ]


def calibrated_with(fitted: dict) -> tuple[dict, list[dict]]:
    """A run's record predicted with the time calibration `fitted`, and its prediction_fit_at_bound warnings."""
    from trainscope.measure import health

    state = predict.calibration_state({"key": {"device": "cpu"}, "time": fitted, "method": "first use"}, CPU)
    block = planted_block()
    block["time"]["calibration"] = fitted  # as trainscope.predict.time_model stores the calibration it used
    record = {"settings": {}, "environment": {}, "summary": {}, "prediction": {**block, "calibration": state}}
    return state, [w for w in health.check(record) if w["code"] == "prediction_fit_at_bound"]


def test_a_fit_held_at_a_bound_is_said_only_where_the_step_missed_its_goal():
    """A fresh clone's make train on a quiet machine (machine B): the first-use fit held step_s at 0 and the steady step
    came within 4% of its prediction, yet the run ended in prediction_fit_at_bound, a warning its reader could not
    act on; at +15.2% (another first use) the warning stands."""
    from trainscope.measure import health

    fitted = calibration.fit_time(few_time_points(-0.004))
    _, (warning,) = calibrated_with(fitted)  # no error measured (an interrupted run): said
    state = predict.calibration_state({"key": {"device": "cpu"}, "time": fitted, "method": "first use"}, CPU)
    for error, warned in ((0.0375, False), (-0.12, False), (0.1525, True)):
        record = {
            "settings": {},
            "environment": {},
            "summary": {"prediction_error": {"step_s": {"error": error}}},
            "prediction": {**planted_block(), "calibration": state},
        }
        codes = [w["code"] for w in health.check(record)]
        assert ("prediction_fit_at_bound" in codes) is warned, error


@pytest.mark.parametrize("residuals", [(-0.004,), (-0.006, -0.002), (-0.006, 0.002)], ids=["1 shape", "2", "2 mixed"])
def test_a_calibration_from_one_or_two_shapes_says_its_constant_is_held_at_0(residuals):
    """A first-use calibration cut to 1-2 shapes fits only the per-step constant, as their median residual; where that
    median is below 0 the constant is clamped at 0 -- held at its bound, said as the bounded fit of 3+ shapes says it
    (time.at_bound, warning prediction_fit_at_bound, the prediction's screen); the operators' factor and the cost per
    dispatch were not fitted, and are said as such, not as at a bound."""
    fitted = calibration.fit_time(few_time_points(*residuals))
    shapes = f"{len(residuals)} shape{'s' if len(residuals) > 1 else ''}"
    assert fitted["step_s"] == 0.0 and fitted["operator_factor"] == 1.0 and fitted["dispatch_s"] == 0.0
    (held,) = fitted["at_bound"]
    assert held.startswith(f"step_s at its lower bound 0 (fitted from {shapes}: their median residual -")
    assert "make predict-calibrate for a full fit" in held
    assert [term.split(" (")[0] for term in fitted["not_fitted"]] == [
        "operator_factor not fitted",
        "dispatch_s not fitted",
    ]
    assert not any("bound" in term for term in fitted["not_fitted"])
    state, (warning,) = calibrated_with(fitted)
    assert state["at_bound"] == [held]
    assert "step_s at its lower bound 0" in warning["message"] and "the fit wanted beyond it" in warning["message"]
    assert "operator_factor not fitted" in warning["message"] and "dispatch_s not fitted" in warning["message"]
    lines = predict.source_lines(
        {"sources": predict.sources(planted_block()["memory"], {"kinds_s": {"matmul": 1.0}}), "calibration": state}
    )
    assert any(line.startswith("warning: the calibration's step_s at its lower bound 0 (fitted from") for line in lines)
    said = calibration.summary_lines({"method": "first use", "seconds": 40, "time": fitted})
    assert f"warning: {held} (the fit wanted beyond it)" in said
    assert any(line.startswith("warning: operator_factor not fitted") for line in said)


def test_a_calibration_from_two_shapes_with_a_positive_residual_says_only_what_it_did_not_fit():
    """Two shapes whose median residual is above 0: the constant is fitted within its bounds (nothing held at one),
    and what the calibration says is that the operators' factor and the cost per dispatch were not fitted (held at
    1 and 0) -- not that the fit wanted beyond a bound."""
    fitted = calibration.fit_time(few_time_points(0.002, 0.006))
    assert fitted["step_s"] == pytest.approx(0.004) and fitted["at_bound"] == []
    assert fitted["not_fitted"] == [
        "operator_factor not fitted (from 2 shapes, 3 needed): held at 1, the operators as timed alone",
        "dispatch_s not fitted (from 2 shapes, 3 needed): held at 0, nothing per operator dispatched",
    ]
    state, (warning,) = calibrated_with(fitted)
    assert state["at_bound"] == [] and "bound" not in warning["message"] and "wanted beyond" not in warning["message"]
    assert warning["message"].startswith("the prediction's calibration has operator_factor not fitted (from 2 shapes")
    assert "make predict-calibrate fits them" in warning["message"]
    full = calibration.fit_time(
        [
            {**p, "step_residual_s": 0.001 + 0.01 * p["step_operator_s"] + 2e-6 * d, "step_dispatches": d}
            for p, d in zip(few_time_points(0, 0, 0, 0), (1000, 1500, 3000, 2000))
        ]
    )  # 4 shapes, a residual the model fits within its bounds: every term fitted, nothing said
    assert full["operator_factor"] == pytest.approx(1.01) and full["dispatch_s"] == pytest.approx(2e-6)
    assert full["not_fitted"] == full["at_bound"] == [] and calibrated_with(full)[1] == []


def test_a_new_machine_calibrates_itself_on_first_use_within_its_budget_and_caches_it(tmp_path, monkeypatch):
    """A prediction on a machine with no calibration runs the first-use calibration (here two tiny shapes), within
    its budget, caches it, and says it calibrated now; the next prediction reads the cache and runs nothing. (The
    budget is 60 s; a test worker on a loaded 2-core machine gets 300: that a quiet machine calibrates in 60 s is
    what make predict-check measures and reports. The test's machine is a busy one, which a calibration is not cached
    from: here the busy check is off, and the two shapes' lengths differ, so their steps are not compared.)"""
    import subprocess

    monkeypatch.setenv(paths.CACHE_ENV, str(tmp_path))
    monkeypatch.delenv(calibration.SWITCH_ENV)
    monkeypatch.setattr(calibration, "FIRST_USE_BUDGET_S", 300.0)
    monkeypatch.setattr(calibration, "BUSY_CORES", math.inf)
    monkeypatch.setattr(
        calibration,
        "QUICK_SHAPES",
        {
            "tiny-bs8": ["--model", "embedded:tiny-bert", "--per-device-batch-size", "8", "--threads", "1"],
            "tiny-bs32": ["--model", "embedded:tiny-bert", "--per-device-batch-size", "32", "--threads", "1"]
            + ["--max-seq-length", "64"],
        },
    )
    monkeypatch.setattr(planned_runs, "collate_seconds", lambda *args, **kwargs: 1e-3)
    (settings,) = parse_settings(argv=[*TINY, *ONE_THREAD, "--max-steps", "4"])
    block = predict.predict(predict.planned_run_of(None, settings), store=False)
    state = block["calibration"]
    assert state["state"] == "first use" and state["seconds"] <= calibration.FIRST_USE_BUDGET_S
    stored = calibration.read_calibration(CPU)
    # two shapes, or on a busy machine the first alone: the budget holds whatever the machine's load
    assert stored["method"].startswith("first use: ") and stored["allocator"]["runs"] == len(stored["shapes"]) >= 1
    assert block["memory"]["terms_gib"]["allocator"] != 0 and block["sources"]["peak_gib"]["fitted"] != 0
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: pytest.fail("calibrated again"))
    again = predict.predict(predict.planned_run_of(None, settings), store=False)
    assert again["calibration"]["state"] == "calibrated" and again["calibration"]["method"] == stored["method"]


PLANTED_SHAPES = {"bs16": ["--per-device-batch-size", "16"], "bs32": ["--per-device-batch-size", "32"]}


def planted_worker(monkeypatch, records: dict, spinners: int = 0, faster: str | None = None):
    """A stand-in for the first-use calibration's worker process: it plants the committed make predict-check runs
    `records` ({shape: run}) as the runs it made (`faster`'s steady step planted below every other's), while
    `spinners` processes keep cores busy for a second; the calibration's own code does the rest. Returns, per call,
    the spinners it left to reap."""
    import shutil
    import subprocess
    import sys

    calls = []  # per call: the spinners it started, to reap

    def worker(command, **kwargs):
        runs = Path(command[command.index("--worker") + 1])
        for shape, run in records.items():
            shutil.copytree(ROOT / "benchmarks" / "runs" / "predict" / run, runs / shape)
        if faster:
            record = json.loads((runs / faster / "record.json").read_text())
            record["summary"]["throughput"]["step_s"] = 0.05  # the planted contradiction
            (runs / faster / "record.json").write_text(json.dumps(record))
        busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(spinners)]
        time.sleep(1.0)
        for process in busy:
            process.kill()  # reaped later (calls): a reaped child's CPU would count as the calibration's own
        calls.append(busy)
        return subprocess.CompletedProcess(command, 0)

    monkeypatch.setattr(calibration.subprocess, "run", worker)
    return calls


def test_a_first_use_calibration_on_a_busy_machine_is_kept_for_its_run_only(tmp_path, monkeypatch):
    """Two processes spin on the cores while the first-use calibration's runs are made: the calibration is used by
    the prediction that made it and not cached (as the matmul peak's rates are not), so the next run makes its own."""
    monkeypatch.setenv(paths.CACHE_ENV, str(tmp_path))
    monkeypatch.delenv(calibration.SWITCH_ENV)
    calls = planted_worker(monkeypatch, {"bs16": "minilm-bs16-r0", "bs32": "minilm-bs32-r0"}, spinners=2)
    fitted = calibration.ensure(CPU, shapes=PLANTED_SHAPES)
    for process in calls[0]:
        process.wait()
    assert fitted["made_now"] and fitted["others_cores"] > calibration.BUSY_CORES, fitted.get("others_cores")
    assert "kept for this run only" in fitted["not_cached"]
    assert calibration.read_calibration(CPU) == {} and not list(tmp_path.rglob("*.json"))  # no failure remembered
    state = predict.calibration_state(fitted, CPU)
    assert state["state"] == "first use" and state["path"] is None and state["not_cached"] == fitted["not_cached"]
    calibration.ensure(CPU, shapes=PLANTED_SHAPES)
    assert len(calls) == 2  # the next run calibrates again
    for process in calls[1]:
        process.wait()


def test_a_first_use_calibration_whose_runs_contradict_each_other_is_refused_not_cached(tmp_path, monkeypatch):
    """The larger batch's step planted faster than the smaller one's (what a busy minute did to a cached calibration:
    batch 24 at 0.067 s, batch 8 at 0.353 s): no fit is made of it, nothing is cached or remembered as a failure, and
    the prediction says it is uncalibrated and why. The busy check is off here: the refusal is the contradiction's."""
    monkeypatch.setenv(paths.CACHE_ENV, str(tmp_path))
    monkeypatch.delenv(calibration.SWITCH_ENV)
    monkeypatch.setattr(calibration, "BUSY_CORES", math.inf)
    calls = planted_worker(monkeypatch, {"bs16": "minilm-bs16-r0", "bs32": "minilm-bs32-r0"}, faster="bs32")
    refused = calibration.ensure(CPU, shapes=PLANTED_SHAPES)
    assert "bs32's step 0.050 s at batch 32 below bs16's 0.507 s at batch 16" in refused["error"]
    assert calibration.read_calibration(CPU) == {} and not list(tmp_path.rglob("*.json"))
    assert predict.calibration_state(refused, CPU)["state"] == "uncalibrated"
    calibration.ensure(CPU, shapes=PLANTED_SHAPES)
    assert len(calls) == 2  # not remembered as failed: the next run tries again
    planted_worker(monkeypatch, {"bs16": "minilm-bs16-r0", "bs32": "minilm-bs32-r0"})  # the same runs, consistent
    consistent = calibration.ensure(CPU, shapes=PLANTED_SHAPES)
    assert consistent["made_now"] and calibration.read_calibration(CPU)["shapes"] == ["bs16", "bs32"]


def test_a_first_use_calibration_that_fails_is_said_and_not_tried_again_by_every_run(tmp_path, monkeypatch):
    monkeypatch.setenv(paths.CACHE_ENV, str(tmp_path))
    monkeypatch.delenv(calibration.SWITCH_ENV)
    tries = []

    def failing(*args, **kwargs):
        tries.append(1)
        raise RuntimeError("the first-use calibration finished no run within 60 s")

    monkeypatch.setattr(calibration, "first_use", failing)
    first, second = calibration.ensure(CPU), calibration.ensure(CPU)
    assert len(tries) == 1 and "finished no run within 60 s" in first["error"] and second["error"] == first["error"]
    state = predict.calibration_state(second, CPU)
    assert state["state"] == "uncalibrated" and "make predict-calibrate" in state["error"]
