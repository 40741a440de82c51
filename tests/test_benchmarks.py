"""The benchmark drivers run end to end in CI-sized time (their figures come from `make bench-*`)."""

import hashlib
import importlib
import json
import math
import random
import re
import runpy
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import binomial_quantile, fork_launches, read_record, run_in_process

from trainscope.experiments.benchmarks import trainer_peer, whole_run
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
    report = one_round_of(
        "trainer_peer", out, monkeypatch, "--cost-steps", "4", "--cost-pairs", "1", "--warm-rounds", "0"
    )
    (round_,) = report["rounds"]
    assert set(round_) == {"trainer", "trainer+callback", "accelerate", "python"}
    # the stage splits side by side: train.py's record's and the callback's, each summing to the steady wall time
    shares = report["stage_shares"]
    assert all(sum(split.values()) == pytest.approx(1.0, abs=1e-6) for split in shares.values())
    # the callback's cost: the Trainer script with and without it, its whole run timed from outside, its steps stamped
    cost = report["callback_cost"]
    (cost_round,) = cost["rounds"]
    assert set(cost_round) == {whole_run.BASELINE, "TrainscopeCallback", whole_run.DIRECT}
    bare, with_callback = cost_round[whole_run.BASELINE], cost_round["TrainscopeCallback"]
    assert bare["steps"] == with_callback["steps"] == 4 and bare["threads"] == with_callback["threads"] == 1
    assert 0 < bare["step_s"] * 4 < bare["wall_s"]
    arm = cost["arms"]["TrainscopeCallback"]
    assert arm["step_met"] is None and arm["fixed_met"] is None and arm["agreement"] == "undecided"  # one round
    # the direct figure: the callback's own time around near-empty Trainer steps, against the Trainer's tiny step
    alone = cost_round[whole_run.DIRECT]
    assert alone["trainer_us_per_step"] > 0 and alone["threads"] == 1
    assert cost["direct"]["share"] == pytest.approx(alone["us_per_step"] * 1e-6 / bare["step_s"])
    text = out.with_suffix(".md").read_text()
    assert "What trainscope's callback costs a Trainer script's whole run" in text and "The direct figure" in text
    (command,) = [line for line in text.splitlines() if "--with-callback" in line]
    assert "--max-train-samples 1600" not in command  # its own short run's flags, not the peer's defaults before them
    assert report["same_batches"] is True  # the Trainer saw train.py's batches, step for step
    # every arm ran with the same threads, the Trainer included
    assert {arm["threads"][0] for arm in report["arms"].values()} == {1}
    ratio = report["comparisons"]["accelerate_over_trainer"]
    assert ratio["verdict"] == "too few pairs" and ratio["test"] == bench.METHOD  # one round decides nothing
    assert report["provenance"]["commit"] and "not measured on GPU" in text


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


def test_overhead_benchmark_pairs_each_script_with_itself_without_trainscope(tmp_path, monkeypatch):
    """One round of each script (train.py against its bare loop, examples/causal_lm.py against itself with
    --without-trainscope), each launch timed from outside and its steps stamped, the direct figure beside."""
    loop = ["--steps", "3", "--batch-size", "2", "--seq-length", "32", "--max-texts", "200", "--log-every", "1"]
    monkeypatch.setattr("trainscope.experiments.benchmarks.overhead.LOOP_ARGS", loop)
    report = one_round_of("overhead", tmp_path / "overhead", monkeypatch, "--warm-rounds", "0")
    train, causal = report["scripts"]
    (round_,) = train["rounds"]
    bare, timed = round_[whole_run.BASELINE], round_["train.py"]
    assert bare["steps"] == timed["steps"] == 8 and bare["threads"] == timed["threads"] == 1
    assert 0 < 6 * timed["step_s"] < timed["wall_s"] and train["warmup_steps"] == 2
    arm = train["arms"]["train.py"]
    assert arm["whole_run"]["verdict"] == "too few pairs" and arm["step_met"] is None  # one round judges nothing
    assert arm["fixed_s"]["median"] == pytest.approx(
        timed["wall_s"] - bare["wall_s"] - 8 * (timed["step_s"] - bare["step_s"])
    )
    # the direct figure: trainscope.Run's own calls around empty steps, against the bare loop's step
    alone = round_[whole_run.DIRECT]
    assert alone["us_per_step"] > 0 and alone["threads"] == bare["threads"]
    assert train["direct"]["share"] == pytest.approx(alone["us_per_step"] * 1e-6 / bare["step_s"])
    (loop_round,) = causal["rounds"]
    assert loop_round[whole_run.BASELINE]["steps"] == loop_round["trainscope.Run"]["steps"] == 3
    text = (tmp_path / "overhead.md").read_text()
    assert "train.py: train.py" in text and "a Run loop: trainscope.Run" in text and "direct figure" in text


class Machine:
    """Simulated launches of a script with and without trainscope (the runner `whole_run.measure` takes): the baseline's
    steps of 10 ms and its 10 s of start-up, each with its noise; the arm with trainscope a step `cost` dearer and
    `fixed` seconds longer; the direct figure `direct` of the step (None: no direct figure)."""

    def __init__(self, rng, cost=0.0, fixed=0.0, direct=None, noise=0.01, steps=1000):
        self.rng, self.cost, self.fixed, self.direct, self.noise, self.steps = rng, cost, fixed, direct, noise, steps

    def __call__(self, script, label: str, index: int) -> dict:
        if label == whole_run.DIRECT:
            return {"us_per_step": self.direct * 0.01 * 1e6}
        with_ = label != whole_run.BASELINE
        step = 0.01 * (1 + self.cost * with_) * math.exp(self.rng.gauss(0, self.noise))
        wall = 10 + self.fixed * with_ + self.rng.gauss(0, 0.3) + self.steps * step
        return {"wall_s": wall, "steps": self.steps, "step_s": step, "threads": 1}


def simulated(machine, rounds: int) -> dict:
    script = whole_run.Script("s", "simulated", [], {whole_run.BASELINE: [], "with": []}, warmup=20,
                              direct=[] if machine.direct is not None else None)  # fmt: skip
    return whole_run.measure(script, rounds, 0, machine, log=lambda line: None)["arms"]["with"]


def outside_rate(rounds: int) -> float:
    """How often the true median lies outside bench.median_interval of `rounds` values, on each side."""
    confidence = bench.median_interval(list(range(rounds)))["confidence"]
    return (1 - confidence) / 2


def test_the_whole_runs_verdicts_hold_their_error_rates_under_simulation():
    """The whole decision path (rounds, the fixed and per-step costs, their intervals and targets, the whole run's
    test, the agreement) driven by simulated launches 4,000 times each: a cost exactly at its target is called met,
    or NOT met, no more often than the median's interval misses it on that side ((1 - confidence) / 2: 12 of 2,048
    at 11 rounds); no cost at all is called faster or slower no more often than the test's exact size (7 rounds: the
    exact p); a direct figure equal to the true per-step cost is called outside the interval no more often than the
    interval misses (2 of 128 at 7 rounds). Each count within the one-sided 99% binomial bound of its rate."""
    repetitions, rng = 4000, random.Random(7)
    at_target = [simulated(Machine(rng, cost=whole_run.STEP_TARGET, fixed=1.0), 11) for _ in range(repetitions)]
    side = binomial_quantile(outside_rate(11), repetitions, 0.99)
    for key in ("step_met", "fixed_met"):  # the budget: 1 s, more than 2% of the baseline's 20 s
        assert sum(found[key] is True for found in at_target) <= side, key
        assert sum(found[key] is False for found in at_target) <= side, key
    nothing = [simulated(Machine(rng, direct=0.0), 7) for _ in range(repetitions)]
    size = binomial_quantile(bench.rejection_rate(7, 7, bench.ALPHA), repetitions, 0.99)
    assert sum(found["whole_run"]["verdict"] in ("faster", "slower") for found in nothing) <= size
    agreeing = [simulated(Machine(rng, cost=0.01, direct=0.01), 7) for _ in range(repetitions)]
    assert sum(found["agreement"] == "undecided" for found in agreeing) == 0  # 1% noise: a narrow interval
    missed = binomial_quantile(2 * outside_rate(7), repetitions, 0.99)
    assert sum(found["agreement"] in ("below", "above") for found in agreeing) <= missed
    # and a real cost is seen: 10% a step, 3 s fixed, both NOT met in (nearly) every repetition
    costly = [simulated(Machine(rng, cost=0.10, fixed=3.0), 11) for _ in range(200)]
    assert sum(f["step_met"] is False and f["fixed_met"] is False for f in costly) >= 198


def test_warm_up_rounds_run_first_alternating_and_are_not_counted():
    """A warm-up round launches each arm once, before the counted rounds and in the alternating order, and its
    launches (a first launch's cold caches) are in no figure."""
    calls, machine = [], Machine(random.Random(1))

    def runner(script, label, index):
        calls.append((label, index))
        return machine(script, label, index)

    script = whole_run.Script("s", "simulated", [], {whole_run.BASELINE: [], "with": []}, warmup=20)
    found = whole_run.measure(script, 5, 2, runner, log=lambda line: None)
    assert calls[:4] == [(whole_run.BASELINE, -2), ("with", -2), ("with", -1), (whole_run.BASELINE, -1)]
    assert len(calls) == 14 and len(found["rounds"]) == 5 and found["arms"]["with"]["per_step"]["n"] == 5


@pytest.mark.parametrize("direct,answer", [(0.01, "below"), (0.09, "above"), (0.05, "agree")])
def test_a_direct_figure_outside_the_rounds_interval_fails_the_check_on_either_side(
    direct, answer, tmp_path, monkeypatch
):
    """The rounds put the per-step cost at 5% (4.6-5.4%); a direct figure planted at 1% (it misses a cost) or at 9% (it
    counts one the runs do not pay) lies outside that interval: make bench-overhead writes its results, says DISAGREE
    on the side it lies, and exits 1; at 5% it agrees and exits 0. (The old check passed any figure from 0 up to the
    interval's upper end.)"""
    from trainscope.experiments.benchmarks import overhead

    machine = Machine(random.Random(3), cost=0.05, direct=direct, noise=0.002)
    monkeypatch.setattr(whole_run, "launcher", lambda scratch, clock=None: machine)
    out = tmp_path / "overhead"
    argv = ["overhead", "--pairs", "7", "--warm-rounds", "0", "--scripts", "train", "--out", str(out)]
    monkeypatch.setattr(sys, "argv", argv)
    completed = run_in_process([], main=lambda _: overhead.main())
    assert completed.returncode == (0 if answer == "agree" else 1), completed.stderr[-2000:]
    (found,) = json.loads(out.with_suffix(".json").read_text())["scripts"]
    arm = found["arms"]["train.py"]
    assert arm["agreement"] == answer and found["direct"]["share"] == pytest.approx(direct, rel=0.01)
    assert 0.04 < arm["per_step"]["interval"]["low"] < 0.05 < arm["per_step"]["interval"]["high"] < 0.06
    text = out.with_suffix(".md").read_text()
    assert (f"**DISAGREE** ({answer})" in text) == (answer != "agree")
    assert ("lies " + answer in completed.stderr) == (answer != "agree")


def test_the_step_clock_stamps_every_step_of_the_optimizer_that_stepped_most_and_writes_on_a_failure(tmp_path):
    """The child side of the whole run's clock: a script's optimizer steps stamped by torch's global hook (a second
    optimizer's single step left out), written at the end even when the script fails; the steady step is the mean
    interval after the warm-up steps."""
    script = tmp_path / "loop.py"
    script.write_text(
        "import sys, time, torch\n"
        "w = torch.nn.Parameter(torch.zeros(1))\n"
        "main, other = torch.optim.SGD([w], lr=0.1), torch.optim.SGD([w], lr=0.1)\n"
        "other.step()\n"
        "for _ in range(6):\n"
        "    time.sleep(0.01)\n"
        "    main.step()\n"
        "sys.exit(int(sys.argv[1]))\n"
    )
    for code in (0, 3):
        stamps = tmp_path / f"stamps-{code}.json"
        completed = run_in_process(["--clock", str(stamps), str(script), str(code)], main=whole_run.main)
        assert completed.returncode == code
        found = json.loads(stamps.read_text())
        assert len(found["stamps"]) == 6 and found["threads"] == torch.get_num_threads()
        assert 0.01 <= whole_run.steady_step(found["stamps"], 2) < 0.05
    with pytest.raises(SystemExit, match="leave none after the 6 warm-up steps"):
        whole_run.steady_step(found["stamps"], 6)


def test_the_launch_is_timed_by_the_clock_it_is_given(tmp_path, monkeypatch):
    """The runner's wall time is its clock's, read at the launch and at the exit (a test's clock here; by default
    time.perf_counter), and the command is the script's launcher, the step clock, then the arm's program."""
    from trainscope.core import launching

    launched = []

    def run_captured(command, env, timeout=None):
        launched.append(command)
        stamps = command[command.index("--clock") + 1]
        Path(stamps).write_text(json.dumps({"stamps": [0.0, 2.0, 4.0, 6.0], "threads": 1}))
        return subprocess.CompletedProcess(command, 0, "", "")

    monkeypatch.setattr(launching, "run_captured", run_captured)
    script = whole_run.Script("s", "a script", ["python"], {whole_run.BASELINE: ["s.py", "--bare"]}, warmup=1)
    found = whole_run.launcher(tmp_path, clock=iter([100.0, 112.5]).__next__)(script, whole_run.BASELINE, 0)
    assert found == {"wall_s": 12.5, "steps": 4, "step_s": 2.0, "threads": 1}
    assert launched[0][:4] == ["python", "-m", whole_run.__name__, "--clock"] and launched[0][-2:] == ["s.py", "--bare"]


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
    args = [*overhead.TRAIN_ARGS, *TINY, *flags]
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


PIECES_FLAGS = {
    "train": ["--max-train-samples", "256", "--timing-warmup-steps", "2"],
    "trainer": ["--max-train-samples", "256", "--timing-warmup-steps", "2"],
    "loop": ["--max-texts", "300", "--batch-size", "2", "--seq-length", "16", "--threads", "1"],
}


@pytest.mark.parametrize("script", list(PIECES_FLAGS))
def test_the_pieces_diagnostic_locates_a_delay_planted_in_one_piece(script, tmp_path, monkeypatch):
    """3 ms of CPU work (15 ms in the causal LM's step of about 50 ms) planted in trainscope's count of each micro-batch (RunMetrics.micro_batch; the second
    instrument: the process's CPU clock it spins on): the A/B by block inside one process finds it, in CPU time, in
    that piece and in the total, not in another piece switched off the same way; in train.py's loop, under the
    Trainer's callback and in examples/causal_lm.py's Run loop alike. (CPU time: the wall clock of blocks this short moves by more than the plant while the
    test's peers share the cores.)"""
    from trainscope.experiments.benchmarks import pieces
    from trainscope.run.metrics import RunMetrics

    planted_us, counted = 15000 if script == "loop" else 3000, RunMetrics.micro_batch  # the loop's step: ~50 ms

    def slowed(self, *args, **kwargs):
        until = time.process_time() + planted_us * 1e-6
        while time.process_time() < until:
            pass
        return counted(self, *args, **kwargs)

    monkeypatch.setattr(RunMetrics, "micro_batch", slowed)
    out = tmp_path / "pieces"
    args = [script, "--rounds", "5", "--block-steps", "16", "--pieces", "micro-batch counting", "stop checks",
            "--out", str(out), *PIECES_FLAGS[script]]  # fmt: skip
    completed = run_in_process(args, main=pieces.main)
    assert completed.returncode == 0, completed.stderr[-3000:]
    figures = json.loads(out.with_suffix(".json").read_text())["figures"]
    found = figures["cpu"]
    assert figures["rounds"] == 5 and set(found["pieces"]) == {"micro-batch counting", "stop checks"}
    assert 0.5 * planted_us < found["pieces"]["micro-batch counting"]["median"] < 2 * planted_us, found
    assert 0.5 * planted_us < found["total"]["median"], found
    assert abs(found["pieces"]["stop checks"]["median"]) < 0.5 * planted_us, found
    assert "| micro-batch counting: " in out.with_suffix(".md").read_text()


def test_the_causal_lm_example_without_trainscope_trains_the_same_steps_to_the_same_loss(tmp_path):
    """examples/causal_lm.py --without-trainscope, make bench-overhead's baseline for a Run loop, is the loop less
    trainscope's lines: the same optimizer steps (torch's global step hook counts them) on the same batches, to the
    same held-out loss."""
    from torch.optim.optimizer import register_optimizer_step_post_hook

    example = runpy.run_path(str(Path(__file__).resolve().parent.parent / "examples" / "causal_lm.py"))
    flags = ["--steps", "4", "--batch-size", "2", "--seq-length", "32", "--max-texts", "200", "--log-every", "2",
             "--output-dir", str(tmp_path), "--run-name", "with"]  # fmt: skip
    steps, threads = [], torch.get_num_threads()
    handle = register_optimizer_step_post_hook(lambda optimizer, args, kwargs: steps.append(optimizer))
    try:
        without = example["train"](example["arguments"]([*flags, "--without-trainscope"]))
        taken = len(steps)
        measured = example["train"](example["arguments"](flags))
    finally:
        handle.remove()
        torch.set_num_threads(threads)
    assert taken == len(steps) - taken == 4 and (tmp_path / "with" / "record.json").exists()
    assert measured["test"]["loss"] == pytest.approx(without["loss"], rel=1e-6)
    assert measured["optimizer_steps"] == 4


ROOT = Path(__file__).resolve().parent.parent
MACHINE_LINE = re.compile(r"^- \*\*([A-Z])\*\* \(([^)]*)\)")
COMMITTED = re.compile(r"benchmarks/[\w/-]+(?:\.json)?")


def measured_by(path: Path) -> set[str]:
    """The machines ('AMD EPYC, AVX2, bf16 emulated') whose provenance the committed path's records and results
    files name (trainscope.report.sections.machine_of, as the report groups its figures)."""
    from trainscope.report.sections import machine_of

    found = set()
    for file in [path] if path.is_file() else sorted(path.rglob("*.json")):
        source = json.loads(file.read_text())
        if isinstance(source, dict) and ("run_name" in source or "provenance" in source):
            machine = machine_of(source)
            if machine is not None:
                found.add(f"{machine.cpu_text}, {machine.isa}")
    return found


def machines_named(text: str) -> dict[str, tuple[str, list[str]]]:
    """{letter: (the machine as its bullet describes it, the committed paths the bullet credits to it)} of a page's
    list of machines (`- **A** (AMD EPYC, AVX2, bf16 emulated): ... benchmarks/runs/tune/ ...`)."""
    named, letter = {}, None
    for line in text.splitlines():
        found = MACHINE_LINE.match(line)
        if found:
            letter = found[1]
            named[letter] = (found[2], [])
        elif not line.startswith("  "):
            letter = None
        if letter is not None:
            named[letter][1].extend(COMMITTED.findall(line))
    return named


def committed(path: str) -> Path:
    found = ROOT / path.rstrip("/.")
    return found if found.exists() else found.with_suffix(".json")


def test_the_machines_credited_with_the_committed_figures_are_those_their_files_name():
    """README.md credited machine A with the timing overhead and the Trainer benchmarks, which machine B measured
    (their provenance says AVX512 + avx512_bf16), and machine C with the prediction runs, also B's. Every committed
    path README.md's and docs/benchmarks.md's lists of machines name, and every row of the committed results that
    names one machine and its files, is read: the machine its files name is the one credited; README.md's list
    credits every committed benchmark."""
    readme = machines_named((ROOT / "README.md").read_text())
    page = (ROOT / "docs" / "benchmarks.md").read_text()
    assert set(readme) == set(machines_named(page)) == {"A", "B", "C"}
    for named in (readme, machines_named(page)):
        for letter, (machine, paths) in named.items():
            assert paths, letter
            for path in paths:
                assert measured_by(committed(path)) == {machine}, (letter, path)
    described = {letter: machine for letter, (machine, _) in readme.items()}
    rows, checked = [line.split(" | ") for line in page.splitlines() if line.startswith("| ")], 0
    where = []
    for row in rows:
        if len(row) == 4 and row[2] in described:
            written = row[3].rpartition("→")[2]  # what the command wrote, not the folders it was given
            where = COMMITTED.findall(written) or (where if row[3].startswith("same") else [])
            for path in where:
                assert measured_by(committed(path)) == {described[row[2]]}, (row[0][:80], path)
                checked += 1
    assert checked >= 20
    credited = {committed(path) for _, paths in readme.values() for path in paths}
    everything = [
        *(ROOT / "benchmarks").glob("*.json"),
        *(p for p in (ROOT / "benchmarks" / "runs").iterdir() if p.is_dir()),
    ]
    assert sorted(set(everything) - credited) == [], "a committed benchmark README.md credits to no machine"
