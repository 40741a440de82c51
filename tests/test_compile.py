"""--compile with eager's random numbers: compiled training draws the dropout masks eager training draws, so a seeded
compiled run's per-step losses match the eager run's to fp32 rounding.

Inductor compiles for minutes on two cores, so the suite compiles one small module (a linear layer, dropout, a layer
norm: the mechanism); train.py's tiny model compiled padded and padding-free against eager runs only with
TRAINSCOPE_SLOW_TESTS=1 (about 10 minutes on two shared cores).

The tolerance is the one of tests/test_unpad.py: a compiled step computes the same values in a possibly different order
of fp32 sums (fused kernels), k (n - 1) u of the loss at step k for sums of at most n terms, u = 2^-24.
"""

import copy
import json
import os

import pytest
import torch
import torch._inductor.config as inductor_config
import torch.nn.functional as F
from conftest import ONE_THREAD, TINY, assert_ok, launch, read_steps

from trainscope.run import startup
from trainscope.workload.settings import parse_settings

U = 2.0**-24


@pytest.fixture
def eager_random_numbers_undone():
    """What a compiled run sets process-wide (the switch, inductor's own environment variables), put back after."""
    before, environ = inductor_config.fallback_random, dict(os.environ)
    inductor_config.fallback_random = False
    yield
    inductor_config.fallback_random = before
    torch._dynamo.reset()
    os.environ.clear()
    os.environ.update(environ)


def test_a_compiled_run_takes_eager_random_numbers(tmp_path, eager_random_numbers_undone):
    from accelerate.state import AcceleratorState

    (settings,) = parse_settings(argv=["--compile", "--report-to", "none"])
    launch_ = startup.Startup(
        state=None,
        settings=settings,
        threads={},
        run_dir=tmp_path,
    )
    launch_.state = type("State", (), {"device": torch.device("cpu")})()
    tf32 = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    try:
        startup.build_accelerator(settings, launch_)
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = tf32
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = tf32
    assert inductor_config.fallback_random


def losses_of(model, steps=((8, 16), (12, 16), (10, 16))) -> list[float]:
    """A few SGD steps on batches of changing size (dynamic shapes), dropout drawn from one seed."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    generator = torch.Generator().manual_seed(1)
    torch.manual_seed(3)
    out = []
    for rows, width in steps:
        features = torch.randn(rows, width, generator=generator)
        labels = torch.randint(0, 3, (rows,), generator=generator)
        loss = F.cross_entropy(model(features), labels)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        out.append(loss.item())
    return out


def test_compiled_training_draws_the_eager_dropout_masks(eager_random_numbers_undone):
    """Without eager's random numbers inductor draws its own (the losses differ from the first step)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(16, 16), torch.nn.Dropout(0.3), torch.nn.LayerNorm(16), torch.nn.Linear(16, 3)
    )
    twin = copy.deepcopy(model)
    eager = losses_of(model)
    startup.eager_random_numbers()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        compiled = losses_of(torch.compile(twin, dynamic=True))
    finally:
        torch.set_num_threads(threads)
    for step, (a, b) in enumerate(zip(eager, compiled), start=1):
        assert abs(a - b) <= step * 16 * U * abs(a), (step, eager, compiled)


@pytest.mark.skipif(
    os.environ.get("TRAINSCOPE_SLOW_TESTS") != "1",
    reason="compiles the tiny model with inductor (minutes on two cores): TRAINSCOPE_SLOW_TESTS=1",
)
def test_compiled_runs_match_the_eager_run_step_by_step(tmp_path):
    """train.py's tiny model with dropout: eager, compiled, and compiled padding-free, per-step losses within the
    rounding bound over a batch's B x T positions (16 x 128); no recompiles over the changing lengths."""
    runs = tmp_path / "runs"
    flags = [
        *TINY,
        *ONE_THREAD,
        "--hidden-dropout",
        "0.1",
        "--attention-dropout",
        "0.1",
        "--max-steps",
        "4",
        "--log-every",
        "1",
        "--output-dir",
        str(runs),
    ]
    for name, extra in (("eager", []), ("compiled", ["--compile"]), ("compiled-unpad", ["--compile", "--unpad"])):
        assert_ok(launch("train.py", [*flags, "--run-name", name, *extra], launcher="python", timeout=900))
    eager = [s["loss"] for s in read_steps(runs / "eager")]
    n = 16 * 128
    for name in ("compiled", "compiled-unpad"):
        compiled = [s["loss"] for s in read_steps(runs / name)]
        assert len(compiled) == len(eager) == 4
        for step, (a, b) in enumerate(zip(eager, compiled), start=1):
            assert abs(a - b) <= step * (n - 1) * U * abs(a), (name, step, eager, compiled)
        block = json.loads((runs / name / "record.json").read_text())["summary"]["compile"]
        assert block["dynamic"] and block["compile_s"] > 0 and block["recompiles"] == 0


def test_the_compile_mode_reaches_accelerates_dynamo_plugin_with_eager_random_numbers(
    tmp_path, eager_random_numbers_undone
):
    """train.py --compile --compile-mode reduce-overhead: Accelerate's own dynamo plugin takes the mode (torch.compile
    gets it at `prepare`: on a GPU, CUDA graphs of the forward and backward), and compiled code draws eager's random
    numbers; without --compile-mode, Accelerate's default mode."""
    from accelerate.state import AcceleratorState, PartialState

    from trainscope.run import startup
    from trainscope.workload.settings import Settings

    tf32 = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32  # what the build sets, put back
    try:
        for mode, expected in (("reduce-overhead", "reduce-overhead"), (None, "default")):
            settings = Settings(compile=True, compile_mode=mode)
            started = startup.Startup(PartialState(cpu=True), settings, {}, tmp_path)
            accelerator = startup.build_accelerator(settings, started)
            assert accelerator.state.dynamo_plugin.mode == expected and inductor_config.fallback_random
            AcceleratorState._reset_state(reset_partial_state=True)
            inductor_config.fallback_random = False
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = tf32
