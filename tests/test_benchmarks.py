"""The benchmark drivers run end to end in CI-sized time (their figures come from `make bench-*`)."""

import hashlib
import importlib
import json
import sys
import time

import pytest
import torch
from conftest import fork_launches, read_record, run_in_process

from trainscope.experiments.benchmarks import trainer_peer
from trainscope.measure import bench

TINY = [
    "--model",
    "embedded:tiny-bert",
    "--max-train-samples",
    "256",
    "--per-device-batch-size",
    "16",
    "--max-steps",
    "8",
    "--timing-warmup-steps",
    "2",
    "--threads",
    "1",
]


def one_round_of(module: str, out, monkeypatch, *extra) -> dict:
    """`python -m trainscope.experiments.benchmarks.<module> --pairs 1` on the tiny model, the driver in this process; its arms
    (one process each, by `accelerate launch` or `python`) run forked from this process with the command and
    environment their launcher gives them (conftest.fork_launches); its results file."""
    fork_launches(monkeypatch)
    driver = importlib.import_module(f"trainscope.experiments.benchmarks.{module}")
    monkeypatch.setattr(sys, "argv", [f"{module}.py", "--pairs", "1", "--out", str(out), *extra, *TINY])
    completed = run_in_process([], main=lambda _: driver.main())
    assert completed.returncode == 0, completed.stderr[-3000:]
    return json.loads(out.with_suffix(".json").read_text())


def test_trainer_peer_runs_the_same_batches_by_each_launcher(tmp_path, monkeypatch):
    out = tmp_path / "peer"
    report = one_round_of("trainer_peer", out, monkeypatch, "--cost-steps", "4", "--cost-pairs", "1")
    (round_,) = report["rounds"]
    assert set(round_) == {"trainer", "trainer+callback", "accelerate", "python"}
    # the stage splits side by side: train.py's record's and the callback's, each summing to the steady wall time
    shares = report["stage_shares"]
    assert all(sum(split.values()) == pytest.approx(1.0, abs=1e-6) for split in shares.values())
    cost = report["callback_cost"]
    assert set(cost["rounds"][0]) == {"trainer", "trainer+callback", "callback-alone"} and cost["meets_target"] is None
    # the direct figure: the callback's own time around near-empty Trainer steps, against the Trainer's tiny step
    alone, trainer = cost["rounds"][0]["callback-alone"], cost["rounds"][0]["trainer"]
    assert alone["trainer_us_per_step"] > 0 and alone["threads"] == trainer["threads"] == 1
    direct = cost["direct"]
    assert direct["cost"] == pytest.approx(alone["us_per_step"] * 1e-6 / (16 / trainer["samples_per_s"]))
    assert (
        direct["meets_target"] is None
        and "Measured directly (the callback's own calls" in out.with_suffix(".md").read_text()
    )
    assert "callback's cost" in out.with_suffix(".md").read_text()
    assert report["same_batches"] is True  # the Trainer saw train.py's batches, step for step
    # every arm ran with the same threads, the Trainer included
    assert {arm["threads"][0] for arm in report["arms"].values()} == {1}
    ratio = report["comparisons"]["accelerate_over_trainer"]
    assert ratio["verdict"] == "too few pairs" and ratio["test"] == bench.METHOD  # one round decides nothing
    assert report["provenance"]["commit"] and "not measured on GPU" in out.with_suffix(".md").read_text()


def test_the_callbacks_direct_figure_finds_a_delay_planted_in_the_callback(monkeypatch):
    """A planted 5 ms in the callback's step end (a second instrument: the sleep's own length) shows up in the
    callback-alone figure, the difference of the blocks with and without it, and not in the Trainer's own step."""
    from trainscope.trainer import TrainscopeCallback

    planted_s, on_step_end = 0.005, TrainscopeCallback.on_step_end

    def slowed(self, *args, **kwargs):
        time.sleep(planted_s)
        return on_step_end(self, *args, **kwargs)

    monkeypatch.setattr(TrainscopeCallback, "on_step_end", slowed)
    args = [*trainer_peer.COST_ARGS, "--max-steps", "25", "--timing-warmup-steps", "5", "--log-every", "5"]
    completed = run_in_process([], main=lambda _: trainer_peer.callback_alone(args))  # its threads put back
    assert completed.returncode == 0, completed.stderr[-3000:]
    found = json.loads(completed.stdout.strip().splitlines()[-1])
    assert planted_s * 1e6 <= found["us_per_step"] < planted_s * 1e6 * 1.5, found
    assert found["trainer_us_per_step"] < planted_s * 1e6, found


def test_overhead_benchmark_pairs_a_bare_loop_with_train_py(tmp_path, monkeypatch):
    report = one_round_of("overhead", tmp_path / "overhead", monkeypatch)
    (round_,) = report["rounds"]
    assert round_["bare"]["samples_per_s"] > 0 and round_["host"]["samples_per_s"] > 0
    assert round_["bare"]["threads"] == round_["host"]["threads"]
    host = report["results"]["host"]
    assert host["verdict"] == "too few pairs" and host["target_overhead"] == 0.03 and "p_value" in host
    assert host["meets_target"] is None and "not judged (too few pairs)" in (tmp_path / "overhead.md").read_text()
    assert host["overhead_interval"]["confidence"] == 0.0  # one round: an interval of no confidence
    # the direct figure: trainscope.Run's own calls around empty steps, against the bare loop's step
    alone = round_["instruments-alone"]
    assert alone["us_per_step"] > 0 and alone["threads"] == round_["bare"]["threads"]
    step_s = round_["bare"]["train_wall_s"] / round_["bare"]["optimizer_steps"]
    assert report["direct"]["overhead"] == pytest.approx(alone["us_per_step"] * 1e-6 / step_s)
    assert "Measured directly" in (tmp_path / "overhead.md").read_text()


def planted_rounds(ratios: list[float], us_per_step: float = 45.0) -> list[dict]:
    """Rounds of the overhead benchmark with train.py / bare ratios planted (the bare loop at 1000 samples/s, 100
    steps a second)."""
    return [
        {
            "bare": {"samples_per_s": 1000.0, "optimizer_steps": 100, "train_wall_s": 1.0, "threads": 1},
            "host": {"samples_per_s": 1000.0 * ratio, "threads": 1},
            "instruments-alone": {"us_per_step": us_per_step, "threads": 1},
        }
        for ratio in ratios
    ]


def test_the_overhead_verdict_comes_from_the_medians_interval_and_the_agreement_can_fail():
    """The committed 5 rounds had ratios 0.926-1.118: their median's overhead 2.27% was called "met" (<= 3%) though
    the rounds bound it only at 7.4%. Judged on the median's distribution-free interval: undecided there; met only
    when the interval's upper end is within 3%. The direct figure agrees only when a narrow enough interval holds it."""
    from trainscope.experiments.benchmarks import overhead

    arms = {"bare": None, "host": None, "instruments-alone": None}
    committed = overhead.figures(planted_rounds([0.926, 0.95, 0.9773, 1.05, 1.118]), arms)
    host = committed["results"]["host"]
    assert host["overhead"] == pytest.approx(0.0227) and host["overhead_interval"]["high"] == pytest.approx(0.074)
    assert host["meets_target"] is None and not host["resolved"]
    assert committed["direct"]["agrees"] is None  # an interval 19 points wide checks nothing
    tight = overhead.figures(planted_rounds([0.985, 0.99, 0.992, 0.995, 0.998, 1.0, 1.002, 1.004, 1.01]), arms)
    assert tight["results"]["host"]["meets_target"] is True and tight["results"]["host"]["resolved"]
    assert tight["direct"]["agrees"] is True  # 45 us of a 10 ms step: 0.45%, inside -0.4% to +1.0%
    slow = overhead.figures(planted_rounds([0.95, 0.955, 0.96, 0.96, 0.962, 0.965, 0.97, 0.97, 0.975]), arms)
    assert slow["results"]["host"]["meets_target"] is False
    assert slow["direct"]["agrees"] is False  # the rounds say 3-5%, the direct figure 0.45%: one of them is wrong
    assert "undecided" in "\n".join(overhead.markdown({**committed, "train_args": []}))


def digest(tensor) -> str:
    return hashlib.sha256(tensor.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes()).hexdigest()


def record_the_work(monkeypatch) -> list:
    """What every training step of runs in this process works on, recorded where any loop's work passes whatever the
    loop's own code: the built model's forward in training mode (the batch's shape and a digest of every input, the
    threads; the initial weights and the configuration once), the training loss (a digest of the labels, the logits'
    dtype), the clipping (its norm, Accelerate's accumulation steps and precision) and each optimizer step (the class,
    its settings, every group's learning rate: the scheduler's)."""
    import accelerate
    import torch.nn.functional as F

    from trainscope import classifier
    from trainscope.experiments.benchmarks import overhead
    from trainscope.workload import modeling

    work = []
    built_model, built_optimizer, cross_entropy = modeling.build_model, modeling.build_optimizer, F.cross_entropy
    clip = accelerate.Accelerator.clip_grad_norm_

    def forward(module, args, kwargs):
        if not module.training:
            return
        if not work:
            weights = torch.cat([p.detach().flatten() for p in module.parameters()])
            work.append(("model", type(module).__name__, module.config.to_json_string(), digest(weights)))
        shape = tuple(kwargs["input_ids"].shape)
        work.append(("batch", shape, {k: digest(v) for k, v in sorted(kwargs.items())}, torch.get_num_threads()))

    def build_model(*args, **kwargs):
        model, facts = built_model(*args, **kwargs)
        model.register_forward_pre_hook(forward, with_kwargs=True)
        return model, facts

    def build_optimizer(*args, **kwargs):
        optimizer = built_optimizer(*args, **kwargs)
        optimizer.register_step_pre_hook(
            lambda o, *_: work.append(
                ("step", type(o).__name__, repr(sorted(o.defaults.items())), [g["lr"] for g in o.param_groups])
            )
        )
        return optimizer

    def loss(logits, target, *args, **kwargs):
        if torch.is_grad_enabled() and kwargs.get("reduction", "mean") == "mean":  # evaluation's is per sample
            work.append(("labels", digest(target), str(logits.dtype)))
        return cross_entropy(logits, target, *args, **kwargs)

    def clip_grad_norm_(self, parameters, max_norm, *args, **kwargs):
        work.append(("clip", max_norm, self.gradient_accumulation_steps, self.mixed_precision))
        return clip(self, parameters, max_norm, *args, **kwargs)

    for module in (modeling, classifier, overhead):
        monkeypatch.setattr(module, "build_model", build_model, raising=module is modeling)
        monkeypatch.setattr(module, "build_optimizer", build_optimizer, raising=module is modeling)
    monkeypatch.setattr(F, "cross_entropy", loss)
    monkeypatch.setattr(accelerate.Accelerator, "clip_grad_norm_", clip_grad_norm_)
    return work


@pytest.mark.parametrize(
    "flags,padded,steps",
    [
        pytest.param([], False, 8, id="defaults"),
        pytest.param(  # 3 epochs of 2 steps of 2 micro-batches, a validation after each
            ["--max-train-samples", "64", "--gradient-accumulation-steps", "2", "--max-steps", "5"],
            False,
            5,
            id="accumulation-over-epochs",
        ),
        pytest.param([], True, 8, id="cuda-mixed-precision-padding"),
    ],
)
def test_both_arms_of_the_overhead_benchmark_do_the_same_work(tmp_path, monkeypatch, flags, padded, steps):
    """The bare loop and train.py, each run in this process, train the same model on the same batches of the same
    shapes with the same optimizer, schedule, clipping, accumulation, precision and threads, step for step, and time
    the same steady steps and samples. The bare loop once padded nothing where train.py pads to multiples of 8 (CUDA
    fp16/bf16: trainscope.run.startup.device_loader_options, whose answer there is given to both arms here), stepped
    every micro-batch under accumulation and stopped at the first epoch's end."""
    from trainscope import classifier
    from trainscope.experiments.benchmarks import overhead
    from trainscope.run import startup

    if padded:
        options = startup.device_loader_options
        for module in (startup, classifier):  # the bare loop's name for it, and train.py's
            monkeypatch.setattr(module, "device_loader_options", lambda *a: {**options(*a), "pad_to_multiple_of": 8})
    args = [*overhead.DEFAULT_TRAIN_ARGS, *TINY, *flags]
    work = record_the_work(monkeypatch)
    bare = run_in_process(args, main=overhead.bare_loop)
    assert bare.returncode == 0, bare.stderr[-3000:]
    bare_work = list(work)
    work.clear()
    timed = run_in_process([*args, "--output-dir", str(tmp_path), "--run-name", "timed"])
    assert timed.returncode == 0, timed.stderr[-3000:]
    timed_work = list(work)

    shapes = [[entry[1] for entry in arm if entry[0] == "batch"] for arm in (bare_work, timed_work)]
    assert shapes[0] == shapes[1]  # (batch, sequence length) of every micro-batch, in order
    if padded:
        assert all(length % 8 == 0 for _, length in shapes[1])
    assert len([entry for entry in timed_work if entry[0] == "step"]) == steps
    first = next((i for i, (ours, theirs) in enumerate(zip(bare_work, timed_work)) if ours != theirs), None)
    assert bare_work == timed_work, (
        f"at {first}: bare {bare_work[first : first + 1]}, train.py {timed_work[first : first + 1]}"
    )
    measured = json.loads(bare.stdout.strip().splitlines()[-1])  # the same window: steady steps and their samples
    throughput = read_record(tmp_path / "timed")["summary"]["throughput"]
    assert (measured["samples"], measured["optimizer_steps"]) == (throughput["samples"], throughput["optimizer_steps"])


def test_same_batches_catches_a_trainer_that_saw_other_batches():
    accelerate = {"tokens_at": {"5": 900, "10": 1800}}
    same = [{"accelerate": accelerate, "trainer": {"tokens_at": {"5": 900, "10": 1800, "2": 300}}}]
    shifted = [{"accelerate": accelerate, "trainer": {"tokens_at": {"5": 900, "10": 1795}}}]
    missing = [{"accelerate": accelerate, "trainer": {"tokens_at": {"5": 900}}}]
    assert trainer_peer.same_batches(same) and not trainer_peer.same_batches(shifted)
    assert not trainer_peer.same_batches(missing)
