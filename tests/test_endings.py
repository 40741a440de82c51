"""Runs that end badly still leave a true record: Ctrl-C, SIGTERM to one rank during the final test evaluation, a
killed main process, a rank that fails during evaluation, a second Ctrl-C, and --save-on-interrupt with --resume continuing
with the same losses. (Faults that need no launch of their own: tests/test_faults.py.)"""

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import slow_loader
import torch
from conftest import (
    ACCELERATE,
    ONE_THREAD,
    ROOT,
    TINY,
    cpu_env,
    error_lines,
    rank_tracebacks,
    read_record,
    read_steps,
    run_in_forked_ranks,
    run_in_process,
    signal_at_training_batch,
)

from trainscope.core.launching import kill_tree

DDP = ROOT / "accelerate_configs" / "ddp.yaml"
# Every batch waits 30 ms in the loader (tests/slow_loader.py): a run long enough to be interrupted in its middle.
SLOW = """import sys, time
sys.path[:0] = [{root!r}, {tests!r}]
{patch}
import slow_loader
slow_loader.every_batch_waits()
import train
import trainscope.classifier
train.main(sys.argv[1:])
"""
ARGS = [*TINY, *ONE_THREAD, "--max-train-samples", "4096", "--log-every", "5", "--epochs", "3"]


# Writing a checkpoint takes 10 s: an ending slow enough for a second Ctrl-C to arrive in it.
SLOW_SAVE = """import trainscope.run.checkpoints as checkpoints
save = checkpoints.save
checkpoints.save = lambda *args, **kwargs: (time.sleep(10), save(*args, **kwargs))[1]"""


def slow_test_evaluation(argv: list[str]) -> None:
    """train.py's main in a forked rank, the test split's batches waiting 0.3 s each, the first leaving a marker per
    rank holding its process id: a window in the final test evaluation, after the last optimizer step's vote, for a
    signal to arrive in."""
    import train
    import trainscope.classifier

    evaluate, evaluations = trainscope.classifier.evaluate_split, []

    def evaluate_split(model, loader, accelerator, metric, between_batches=None):
        evaluations.append(loader)
        if len(evaluations) == 1:  # the validation (at the end of the only epoch); then the final test
            return evaluate(model, loader, accelerator, metric, between_batches)
        marker = Path(argv[argv.index("--output-dir") + 1]) / f"test-evaluation-rank{accelerator.process_index}"

        def between():
            marker.write_text(str(os.getpid()))
            time.sleep(0.3)
            between_batches()

        return evaluate(model, loader, accelerator, metric, between)

    trainscope.classifier.evaluate_split = evaluate_split
    train.main(argv)


def out_of_memory_in_evaluation(argv: list[str]) -> None:
    """train.py's main in a forked rank; rank 1 runs out of memory in the validation's first batch (a rank that
    errs: it does not vanish)."""
    import train
    import trainscope.classifier

    evaluate = trainscope.classifier.evaluate_split

    def evaluate_split(model, loader, accelerator, metric, between_batches=None):
        def between():
            if accelerator.process_index == 1:
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
            between_batches()

        return evaluate(model, loader, accelerator, metric, between)

    trainscope.classifier.evaluate_split = evaluate_split
    train.main(argv)


@pytest.fixture(scope="module")
def slow_script(tmp_path_factory):
    path = tmp_path_factory.mktemp("endings") / "slow_train.py"
    path.write_text(SLOW.format(root=str(ROOT), tests=str(ROOT / "tests"), patch=""))
    return path


def start(command: list[str], log: Path) -> subprocess.Popen:
    with open(log, "w") as out:
        return subprocess.Popen(
            command, cwd=ROOT, env=cpu_env(), stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )


# Hang guards, not measurements: a whole DDP launch (two ranks importing torch) took 120 s on a 2-core machine kept busy.
HANG_S = 300


def wait_for_steps(run_dir: Path, lines: int, process: subprocess.Popen, timeout: float = HANG_S) -> None:
    """Until the run has written `lines` step lines (it is in the middle of training)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if (run_dir / "steps.jsonl").exists() and len(read_steps(run_dir)) >= lines:
            return
        assert process.poll() is None, f"the run ended early with {process.returncode}"
        time.sleep(0.1)
    raise AssertionError(f"no {lines} step lines in {timeout} s")


def finish(process: subprocess.Popen, timeout: float = HANG_S) -> int:
    try:
        return process.wait(timeout)
    except subprocess.TimeoutExpired:
        kill_tree(process.pid)
        raise AssertionError(f"the run did not end within {timeout} s") from None


def assert_partial(record: dict, step_at_least: int) -> None:
    summary = record["summary"]
    assert summary["partial"] is True and summary["optimizer_steps"] >= step_at_least
    assert (
        summary["throughput"]["samples_per_s"] > 0 and summary["timing"]["across_ranks"]["run"]["wall_s"]["median"] > 0
    )


def test_ctrl_c_of_a_single_process_records_the_interruption_and_exits_130(runs, monkeypatch):
    """In this process (no launch to pay for): SIGINT, as a terminal's Ctrl-C sends it, while the 12th batch loads."""
    signal_at_training_batch(monkeypatch, 12, signal.SIGINT)
    result = run_in_process([*TINY, *ONE_THREAD, "--max-steps", "30", "--output-dir", str(runs), "--run-name", "one"])
    assert result.returncode == 130
    record = read_record(runs / "one")
    assert record["status"] == "interrupted" and record["interruption"]["signal"] == "SIGINT"
    step = record["interruption"]["step"]  # the batch in flight (Accelerate's loader loads one ahead) is trained
    assert 10 <= step <= 12 and record["interruption"]["checkpoint"] is None
    assert_partial(record, 10)
    assert "Traceback" not in result.stderr and f"interrupted by SIGINT after optimizer step {step}:" in result.stderr


def test_a_second_ctrl_c_exits_at_once_and_still_marks_the_record(tmp_path):
    script, runs = tmp_path / "slow_train.py", tmp_path / "runs"
    script.write_text(SLOW.format(root=str(ROOT), tests=str(ROOT / "tests"), patch=SLOW_SAVE))
    process = start(
        [sys.executable, str(script), *ARGS, "--output-dir", str(runs), "--run-name", "twice", "--save-on-interrupt"],
        tmp_path / "log",
    )
    wait_for_steps(runs / "twice", 2, process)
    process.send_signal(signal.SIGINT)  # the run stops and starts its 10 s checkpoint
    time.sleep(1.5)  # more than the window in which a launcher's forwarded copy of the same Ctrl-C is ignored
    asked = time.monotonic()
    process.send_signal(signal.SIGINT)
    assert finish(process, timeout=30) == 130 and time.monotonic() - asked < 5  # not after the checkpoint
    record = read_record(runs / "twice")
    assert record["status"] == "interrupted" and record["interruption"]["signal"] == "SIGINT"
    assert record["interruption"]["forced"] is True and not list((runs / "twice" / "checkpoints").glob("step_*"))


def test_ctrl_c_of_a_ddp_launch_then_resume_gives_the_same_losses_as_an_uninterrupted_run(slow_script, tmp_path):
    """Every rank stops at the same step, the checkpoint is written, and --resume continues with the same data
    order, losses and tokens as a run that was never interrupted."""
    runs = tmp_path / "runs"
    args = [*ARGS, "--max-steps", "40", "--log-every", "1", "--output-dir", str(runs)]
    launch = [ACCELERATE, "launch", "--config_file", str(DDP), str(slow_script), *args]
    # the uninterrupted run: what it trains is compared, not how it was launched (its loader need not be slow)
    assert run_in_forked_ranks([*args, "--run-name", "whole"]) == 0
    launcher = start([*launch, "--run-name", "cut", "--save-on-interrupt"], tmp_path / "log")
    wait_for_steps(runs / "cut", 12, launcher)
    launcher.send_signal(signal.SIGINT)  # what a terminal's Ctrl-C does to the launcher; it forwards to the ranks
    finish(launcher)
    record = read_record(runs / "cut")
    assert record["status"] == "interrupted" and record["interruption"]["signal"] == "SIGINT"
    interruption = record["interruption"]
    assert interruption["checkpoint"] == f"step_{interruption['step']:08d}" and interruption["step"] < 40
    assert_partial(record, 12)
    assert record["summary"]["ranks_summarized"] == [0, 1]  # both ranks stopped together and were summarized
    # resumed on forked ranks: what it trains is compared, and the Ctrl-C to the launcher was the launch's part
    assert run_in_forked_ranks([*args, "--run-name", "cut", "--resume"]) == 0
    record = read_record(runs / "cut")
    assert record["status"] == "complete" and record["resumed_from"] == [interruption["checkpoint"]]
    assert record["summary"]["optimizer_steps"] == 40 and record["summary"]["world_size"] == 2
    whole_steps, cut_steps = read_steps(runs / "whole"), read_steps(runs / "cut")
    assert [line["step"] for line in cut_steps] == list(range(1, 41)) == [line["step"] for line in whole_steps]
    for a, b in zip(whole_steps, cut_steps):  # same weights, batches on each rank, dropout: the same losses
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-4) and b["tokens"] == a["tokens"], a["step"]
    assert record["summary"]["test"] == pytest.approx(read_record(runs / "whole")["summary"]["test"])


def test_sigterm_to_one_rank_during_the_final_test_evaluation_stops_both_and_is_recorded(tmp_path, capfd):
    """After the last optimizer step's vote, the ranks vote between evaluation batches and once more before the
    run is complete: a signal to one rank there is not lost. (Forked ranks, run_in_forked_ranks: the ranks' vote is
    the subject.)"""
    runs = tmp_path / "runs"
    args = [*TINY, *ONE_THREAD, "--max-steps", "4", "--max-test-samples", "512", "--output-dir", str(runs)]

    def terminate_rank_1_in_the_test_evaluation():
        deadline = time.monotonic() + 120
        marker = runs / "test-evaluation-rank1"
        while not (marker.exists() and marker.read_text()) and time.monotonic() < deadline:
            time.sleep(0.05)
        os.kill(int(marker.read_text()), signal.SIGTERM)  # as a scheduler pre-empting one node would

    sender = threading.Thread(target=terminate_rank_1_in_the_test_evaluation, daemon=True)
    sender.start()
    assert run_in_forked_ranks([*args, "--run-name", "term"], main=slow_test_evaluation) != 0
    sender.join()
    record = read_record(runs / "term")
    assert record["status"] == "interrupted" and record["interruption"]["signal"] == "SIGTERM", record.get("status")
    assert record["interruption"]["received_here"] is False  # rank 0 stopped because rank 1 voted to
    assert record["interruption"]["received_by"] == 1 and record["interruption"]["step"] == 4
    assert_partial(record, 4)
    log = "".join(capfd.readouterr())
    assert not rank_tracebacks(log) and "interrupted by SIGTERM after optimizer step 4" in log


# The stop vote's interval in the runs below (--log-every 5: K = 5) and the step whose end rank 1 signals itself at,
# between the votes of steps 5 and 10.
VOTE_EVERY, SIGNAL_AT_STEP = 5, 6


def votes_written_down(argv: list[str]) -> None:
    """train.py's main in a forked rank, every all-reduce of its stop vote written down, one line each, as the
    boundary it was taken at (`step N`, `evaluation`, `finish`) in <output-dir>/votes-rank<RANK>.txt; with
    --run-name signalled, rank 1 sends itself SIGTERM at the end of step SIGNAL_AT_STEP, between two votes."""
    import types

    import train
    from trainscope.run import lifecycle, signals

    out, rank = Path(argv[argv.index("--output-dir") + 1]), os.environ["RANK"]
    signalled = argv[argv.index("--run-name") + 1] == "signalled"
    at = ["start"]
    make_vote, step_finished = signals.StopVote.__init__, lifecycle.RunLifecycle.step_finished
    between_batches, finish = lifecycle.RunLifecycle.between_batches, lifecycle.RunLifecycle.finish

    def counted_vote(self, *args, **kwargs):
        make_vote(self, *args, **kwargs)
        dist = self.dist

        def all_reduce(*args, **kwargs):
            with open(out / f"votes-rank{rank}.txt", "a") as votes:
                votes.write(at[0] + "\n")
            return dist.all_reduce(*args, **kwargs)

        self.dist = types.SimpleNamespace(all_reduce=all_reduce, ReduceOp=dist.ReduceOp)

    def at_step_end(self):
        at[0] = f"step {self.metrics.loop.step}"
        if signalled and rank == "1" and self.metrics.loop.step == SIGNAL_AT_STEP:
            os.kill(os.getpid(), signal.SIGTERM)  # as a scheduler pre-empting one node would
        step_finished(self)

    def between_evaluation_batches(self):
        at[0] = "evaluation"
        between_batches(self)

    def finishing(self, *args):
        at[0] = "finish"
        return finish(self, *args)

    signals.StopVote.__init__ = counted_vote
    lifecycle.RunLifecycle.step_finished = at_step_end
    lifecycle.RunLifecycle.between_batches = between_evaluation_batches
    lifecycle.RunLifecycle.finish = finishing
    train.main(argv)


def run_voting(runs: Path, name: str, steps: int) -> int:
    """Two forked ranks (run_in_forked_ranks: the ranks' vote is the subject) voting every VOTE_EVERY steps, their
    votes written down (votes_written_down)."""
    args = [
        *TINY,
        *ONE_THREAD,
        "--max-train-samples",
        "1024",
        "--log-every",
        str(VOTE_EVERY),
        "--max-steps",
        str(steps),
    ]
    return run_in_forked_ranks([*args, "--output-dir", str(runs), "--run-name", name], main=votes_written_down)


def votes(runs: Path, rank: int) -> list[str]:
    return (runs / f"votes-rank{rank}.txt").read_text().splitlines()


def test_the_stop_vote_is_one_all_reduce_every_k_steps_not_one_a_step(runs):
    """12 optimizer steps, K = 5: the vote's all-reduces at the ends of steps 5 and 10 (a vote at every step took 12),
    then between evaluation batches and one last one before the run is declared complete."""
    assert run_voting(runs, "complete", 12) == 0
    record = read_record(runs / "complete")
    assert record["status"] == "complete" and record["summary"]["optimizer_steps"] == 12
    for rank in (0, 1):
        taken = votes(runs, rank)
        assert [v for v in taken if v.startswith("step")] == ["step 5", "step 10"], taken
        assert "evaluation" in taken and taken[-1] == "finish", taken
    assert votes(runs, 0) == votes(runs, 1)  # the same collectives, in the same order, on both ranks


def test_a_signal_between_two_votes_stops_both_ranks_after_the_next_vote(runs, capfd):
    """Rank 1 receives SIGTERM at the end of step 6: no vote there; the vote of step 10 carries it and both ranks stop
    at the next boundary, step 11 (K - 1 = 4 steps after a vote at every step would have stopped them, at step 7)."""
    assert run_voting(runs, "signalled", 20) != 0
    record = read_record(runs / "signalled")
    assert record["status"] == "interrupted" and record["interruption"]["signal"] == "SIGTERM", record.get("status")
    interruption = record["interruption"]
    assert interruption["step"] == 11 and interruption["received_by"] == 1 and interruption["received_here"] is False
    assert record["summary"]["ranks_summarized"] == [0, 1] and record["summary"]["optimizer_steps"] == 11
    for rank in (0, 1):
        assert votes(runs, rank) == ["step 5", "step 10"]  # no vote after the one that stopped them
    log = "".join(capfd.readouterr())
    assert not rank_tracebacks(log) and "interrupted by SIGTERM after optimizer step 11" in log


def slowly_leaving_the_pid(argv: list[str]) -> None:
    """train.py's main in a forked rank, every batch waiting 30 ms in the loader (as slow_train.py), the rank's process
    id in <output-dir>/rank<RANK>.pid."""
    import train

    (Path(argv[argv.index("--output-dir") + 1]) / f"rank{os.environ['RANK']}.pid").write_text(str(os.getpid()))
    slow_loader.every_batch_waits()
    train.main(argv)


def test_a_killed_main_process_leaves_a_failed_record_naming_it(tmp_path, capfd):
    """Rank 0, the record's writer, is killed: rank 1 finds its heartbeat stopped in the store of torch's elastic
    agent (torchrun's; here it runs in the process that forked the ranks, run_in_forked_ranks), which outlives rank
    0, claims the record there and writes the failure."""
    runs = tmp_path / "runs"
    runs.mkdir()
    victim = []

    def kill_rank_0_in_training():
        deadline = time.monotonic() + HANG_S
        while time.monotonic() < deadline:
            if (runs / "killed" / "steps.jsonl").exists() and len(read_steps(runs / "killed")) >= 2:
                victim.append(int((runs / "rank0.pid").read_text()))
                os.kill(victim[0], signal.SIGKILL)
                return
            time.sleep(0.1)

    killer = threading.Thread(target=kill_rank_0_in_training, daemon=True)
    killer.start()
    assert run_in_forked_ranks([*ARGS, "--output-dir", str(runs), "--run-name", "killed"], slowly_leaving_the_pid) != 0
    killer.join()
    record = read_record(runs / "killed")
    assert record["status"] == "failed" and record["failed_at_step"] >= 10
    # named through the launcher's store (its heartbeat stopped), not the local process table
    name = f"rank 0 (pid {victim[0]} on {socket.gethostname()})"
    assert record["lost_ranks"] == [name] and record["failed_rank"] == 0
    assert record["error"].startswith(f"{name} vanished (no heartbeat for")
    assert_partial(record, 10)
    assert record["summary"]["ranks_summarized"] == [1]  # written by the survivor
    log = "".join(capfd.readouterr())
    assert not rank_tracebacks(log) and [line for line in error_lines(log) if "(rank 1) rank 0 (pid" in line]


def test_a_rank_that_errs_during_evaluation_is_named_with_its_error(tmp_path, capfd):
    """Rank 1 runs out of memory in the validation: it says so in one line, and rank 0's record names rank 1 and its
    error (it did not vanish), with the cause in one line and no traceback from either rank. (Forked ranks.)"""
    runs = tmp_path / "runs"
    args = [*TINY, *ONE_THREAD, "--max-steps", "3", "--output-dir", str(runs), "--run-name", "oom"]
    assert run_in_forked_ranks(args, main=out_of_memory_in_evaluation) != 0
    record = read_record(runs / "oom")
    assert record["status"] == "failed" and record["failed_rank"] == 1 and record["lost_ranks"] is None
    assert record["error"].startswith("rank 1 failed: out of memory at --per-device-batch-size 16")
    assert record["failed_at_step"] == 3 and record["summary"]["ranks_summarized"] == [0]
    log = "".join(capfd.readouterr())
    assert not rank_tracebacks(log), rank_tracebacks(log)
    # one line: rank 0's is rank 1's own, printed once on this host
    assert [line.split(":", 2)[1] for line in error_lines(log)] == [
        " (rank 1) out of memory at --per-device-batch-size 16 (step 4)"
    ]


def test_only_a_collectives_lost_connection_sends_a_rank_looking_for_a_dead_peer():
    import torch

    from trainscope.core.faults import NonFiniteLoss
    from trainscope.run.lifecycle import lost_a_peer

    assert lost_a_peer(RuntimeError("[gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.1]:5000"))
    assert lost_a_peer(RuntimeError("Watchdog caught collective operation timeout: WorkNCCL(SeqNum=7)"))
    assert not lost_a_peer(NonFiniteLoss("loss became [nan, nan] at optimizer step 12"))  # every rank raises it
    assert not lost_a_peer(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"))
    assert not lost_a_peer(ValueError("a connection string"))  # not a collective's error
