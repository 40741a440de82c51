"""Faults that end in one line and a true record, run in this process or on stand-ins: an unreadable checkpoint, a
resume under another number of processes, a full disk, a signal during a checkpoint, a corrupt record, a collective
that times out (the NCCL watchdog's path), the process group's set-up, the signal handler, and peers judged through
the launcher's store. (Faults that need a launch of several processes: tests/test_endings.py.)"""

import json
import os
import shutil
import signal
import socket
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from conftest import (
    ONE_THREAD,
    TINY,
    assert_ok,
    error_line,
    read_record,
    read_steps,
    run_in_process,
    signal_at_training_batch,
)

from trainscope.core import liveness
from trainscope.core.errors import UserError
from trainscope.core.liveness import PeerWatch, Verdict, root_cause
from trainscope.core.records import RunRecord
from trainscope.run import checkpoints, startup
from trainscope.run.lifecycle import RunLifecycle
from trainscope.run.signals import StopSignals, vote_of, vote_value
from trainscope.workload.settings import parse_settings

SAVED = [*TINY, *ONE_THREAD, "--max-steps", "6", "--save-every", "2", "--log-every", "1"]


@pytest.fixture(scope="module")
def saved_run(tmp_path_factory):
    """One run of 6 steps with checkpoints at steps 2 and 4; each test breaks a copy of it."""
    runs = tmp_path_factory.mktemp("saved") / "runs"
    assert_ok(run_in_process([*SAVED, "--output-dir", str(runs), "--run-name", "saved"]))
    return runs / "saved"


def copy_of(saved_run: Path, tmp_path: Path) -> Path:
    run_dir = tmp_path / "runs" / "saved"
    shutil.copytree(saved_run, run_dir)
    return run_dir


def resume(run_dir: Path, *extra: str):
    return run_in_process([*SAVED, "--output-dir", str(run_dir.parent), "--run-name", run_dir.name, "--resume", *extra])


def step_dir(run_dir: Path, step: int) -> Path:
    return run_dir / "checkpoints" / f"step_{step:08d}"


def truncate(path: Path, keep: int = 1000) -> None:
    with open(path, "r+b") as handle:
        handle.truncate(keep)


def assert_one_line(result, code: int) -> str:
    assert result.returncode == code, result.stderr[-3000:]
    assert "Traceback" not in result.stderr + result.stdout
    return error_line(result)


def no_partials(run_dir: Path) -> bool:
    return not list((run_dir / "checkpoints").glob(".*partial"))


# ---------------------------------------------------------------- checkpoints on --resume


def test_an_unreadable_latest_checkpoint_is_passed_over_for_the_one_before_with_a_warning(saved_run, tmp_path):
    run_dir = copy_of(saved_run, tmp_path)
    truncate(step_dir(run_dir, 4) / "model.safetensors")  # a weights file cut short (a disk that filled, a copy)
    (run_dir / "checkpoints" / ".step_00000006.partial").mkdir()  # what a save killed midway leaves
    result = resume(run_dir)
    assert_ok(result)
    assert (
        "warning [checkpoint_skipped]: --resume could not use step_00000004 (model.safetensors is unreadable"
        in result.stdout
    )
    record = read_record(run_dir)
    assert record["status"] == "complete" and record["resumed_from"] == ["step_00000002"]
    assert [s["checkpoint"] for s in record["checkpoints_skipped"]] == ["step_00000004"]
    assert "checkpoint_skipped" in [w["code"] for w in record["warnings"]]
    assert [line["step"] for line in read_steps(run_dir)] == [1, 2, 3, 4, 5, 6]  # 3 and 4 trained again, once each
    assert checkpoints.problem(step_dir(run_dir, 4)) is None and no_partials(run_dir)  # step 4 written again, whole

    # none usable: one line, exit 2, the record left as it was
    (step_dir(run_dir, 4) / "loop_state_rank0.json").unlink()
    truncate(step_dir(run_dir, 2) / "optimizer.bin")
    refused = resume(run_dir)
    line = assert_one_line(refused, 2)
    assert "--resume: no usable checkpoint" in line and "step_00000004: it has no loop_state" in line
    assert "step_00000002: optimizer.bin is unreadable" in line
    assert read_record(run_dir)["status"] == "complete"


def test_a_checkpoint_of_another_number_of_processes_is_refused_before_any_training(saved_run, tmp_path):
    """The table's case (1 process saved, 2 resume) and its mirror (2 saved, 1 resumes) are the same check."""
    run_dir = copy_of(saved_run, tmp_path)
    latest = step_dir(run_dir, 4)
    state = json.loads((latest / "loop_state_rank0.json").read_text())
    for rank in (0, 1):  # planted: the checkpoint of a 2-process run
        (latest / f"loop_state_rank{rank}.json").write_text(json.dumps({**state, "world_size": 2}))
    shutil.copy(latest / "random_states_0.pkl", latest / "random_states_1.pkl")
    steps_before = read_steps(run_dir)
    line = assert_one_line(resume(run_dir), 2)
    assert "step_00000004 was written by 2 processes and this launch has 1: resume with 2" in line
    assert read_steps(run_dir) == steps_before and read_record(run_dir)["status"] == "complete"

    # one rank's part missing: passed over, like any checkpoint that cannot be loaded whole
    (latest / "loop_state_rank1.json").unlink()
    result = resume(run_dir)
    assert_ok(result)
    assert read_record(run_dir)["checkpoints_skipped"] == [
        {"checkpoint": "step_00000004", "problem": "loop_state_rank1.json (rank 1's part) is missing"}
    ]


@pytest.mark.parametrize(
    "damage, problem",
    [
        (lambda d: (d / "random_states_0.pkl").unlink(), "random_states_0.pkl (rank 0's random state) is missing"),
        (lambda d: truncate(d / "scheduler.bin", 100), "scheduler.bin is unreadable (File is not a zip file)"),
        (lambda d: (d / "loop_state_rank0.json").write_text("{"), "loop_state_rank0.json is unreadable"),
        (lambda d: (d / "model.safetensors").unlink(), "it has no model weights"),
        (lambda d: None, None),
    ],
    ids=["random-state", "scheduler", "loop-state", "weights", "whole"],
)
def test_a_checkpoint_is_checked_part_by_part(damage, problem, saved_run, tmp_path):
    directory = shutil.copytree(step_dir(saved_run, 4), tmp_path / "step_00000004")
    damage(directory)
    found = checkpoints.problem(directory)
    assert found == problem if problem is None else found.startswith(problem), found


def test_a_corrupt_record_is_begun_again_and_the_run_resumes(saved_run, tmp_path):
    run_dir = copy_of(saved_run, tmp_path)
    (run_dir / "record.json").write_text('{"schema_version": 3, "status": "runn')  # cut short
    result = resume(run_dir)
    assert_ok(result)
    assert "warning [record_rebuilt]" in result.stdout
    record = read_record(run_dir)
    assert record["status"] == "complete" and "not a readable run record" in record["record_rebuilt"]
    assert record["summary"]["optimizer_steps"] == 6


# ---------------------------------------------------------------- saving


def test_a_full_disk_while_saving_ends_in_one_line_naming_the_folder_and_leaves_no_partial(runs, monkeypatch):
    """The output folder's disk fills while --save-every 1 writes: safetensors' own error, planted."""
    from accelerate import Accelerator
    from safetensors import SafetensorError

    def save_state(self, output_dir):
        Path(output_dir).mkdir(parents=True)
        (Path(output_dir) / "model.safetensors").write_bytes(b"\0" * 4096)  # half written
        raise SafetensorError(
            'Error while serializing: IoError(Os { code: 28, kind: StorageFull, message: "No space left on device" })'
        )

    monkeypatch.setattr(Accelerator, "save_state", save_state)
    result = run_in_process(
        [*TINY, *ONE_THREAD, "--max-steps", "3", "--save-every", "1", "--output-dir", str(runs), "--run-name", "full"]
    )
    line = assert_one_line(result, 1)
    folder = runs / "full" / "checkpoints"
    assert f"no space left on the disk of {folder} for checkpoint step_00000001: it needs about 0.01 GiB" in line
    record = read_record(runs / "full")
    assert record["status"] == "failed" and record["failed_rank"] == 0 and record["failed_at_step"] == 1
    assert record["error"] == line.removeprefix("error: ") and no_partials(runs / "full")


def test_a_disk_without_room_for_the_checkpoint_is_refused_before_writing(runs, monkeypatch):
    usage, calls = shutil.disk_usage, []

    def disk_usage(path):
        real = usage(path)
        return real._replace(free=5000) if "checkpoints" in str(path) else real

    monkeypatch.setattr(checkpoints.shutil, "disk_usage", disk_usage)
    from accelerate import Accelerator

    monkeypatch.setattr(Accelerator, "save_state", lambda *args: calls.append(args))
    result = run_in_process(
        [*TINY, *ONE_THREAD, "--max-steps", "3", "--save-every", "2", "--output-dir", str(runs), "--run-name", "small"]
    )
    line = assert_one_line(result, 1)
    assert "for checkpoint step_00000002: it needs about 0.01 GiB, 0.00 GiB free there" in line
    assert not calls and no_partials(runs / "small")  # nothing was written


def test_a_signal_during_a_checkpoint_stops_the_run_with_that_checkpoint_whole(runs, monkeypatch):
    from accelerate import Accelerator

    real = Accelerator.save_state

    def save_state(self, output_dir):
        os.kill(os.getpid(), signal.SIGTERM)  # arrives while the checkpoint is being written
        return real(self, output_dir)

    monkeypatch.setattr(Accelerator, "save_state", save_state)
    args = [*SAVED, "--save-on-interrupt", "--output-dir", str(runs), "--run-name", "cut"]
    result = run_in_process(args)
    assert result.returncode == 143 and "Traceback" not in result.stderr
    assert (
        result.stderr.count("SIGTERM received: stopping at the next step boundary") == 1
    )  # said by the training thread
    record = read_record(runs / "cut")
    assert record["status"] == "interrupted" and record["interruption"]["step"] == 2
    assert record["interruption"]["checkpoint"] == "step_00000002" and record["interruption"]["received_by"] == 0
    assert checkpoints.problem(step_dir(runs / "cut", 2)) is None and no_partials(runs / "cut")  # whole: resumable


def test_a_full_disk_on_save_on_interrupt_still_stops_as_asked_and_says_what_was_not_kept(runs, monkeypatch):
    from accelerate import Accelerator

    signal_at_training_batch(monkeypatch, 3, signal.SIGTERM)

    def save_state(self, output_dir):
        Path(output_dir).mkdir(parents=True)
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(Accelerator, "save_state", save_state)
    result = run_in_process(
        [*TINY, *ONE_THREAD, "--max-steps", "20", "--save-on-interrupt", "--output-dir", str(runs), "--run-name", "cut"]
    )
    assert result.returncode == 143 and "Traceback" not in result.stderr
    assert "no space left on the disk of" in error_line(result)
    interruption = read_record(runs / "cut")["interruption"]
    assert interruption["checkpoint"] is None and "no space left on the disk of" in interruption["checkpoint_error"]
    assert no_partials(runs / "cut")


# ---------------------------------------------------------------- collectives and the process group


def test_a_collective_that_times_out_ends_in_one_line_and_a_failed_record(runs, monkeypatch):
    """What the NCCL watchdog raises in the training thread once TORCH_NCCL_ASYNC_ERROR_HANDLING=2 aborts the
    communicator (instead of killing the process), planted in a step's loss."""
    import trainscope.workload.step

    real, calls = trainscope.workload.step.F.cross_entropy, []

    def cross_entropy(*args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            raise torch.distributed.DistBackendError(
                "[PG ID 0 PG GUID 0(default_pg) Rank 0] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=7, "
                "OpType=ALLREDUCE, NumelIn=1, NumelOut=1, Timeout(ms)=600000) ran for 600013 milliseconds before timing out."
            )
        return real(*args, **kwargs)

    monkeypatch.setattr(trainscope.workload.step.F, "cross_entropy", cross_entropy)
    result = run_in_process([*TINY, *ONE_THREAD, "--output-dir", str(runs), "--run-name", "hung"])
    line = assert_one_line(result, 1)
    assert "a collective timed out after --distributed-timeout 600 s" in line and "Watchdog caught" in line
    record = read_record(runs / "hung")
    assert record["status"] == "failed" and record["error"] == line.removeprefix("error: ")
    assert record["failed_rank"] is None and record["failed_at_step"] == 2


class RecordingState:
    """Accelerate's PartialState, recording what it would pass to init_process_group."""

    def __init__(self, cpu=False, **kwargs):
        self.cpu, self.kwargs = cpu, kwargs
        self.error_handling = os.environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING")
        self.device = self.local_process_index = None  # no device chosen: nothing shared (test_shared_gpu.py)


@pytest.mark.parametrize(
    "environ, cpu, cuda, expected",
    [
        (
            {"WORLD_SIZE": "2", "LOCAL_RANK": "1"},
            False,
            True,
            {"timeout": timedelta(seconds=90), "device_id": torch.device("cuda", 1)},
        ),
        (
            {"WORLD_SIZE": "2", "LOCAL_RANK": "1", "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1"},
            False,
            True,  # torchrun's
            {"timeout": timedelta(seconds=90), "device_id": torch.device("cuda", 1)},
        ),
        (
            {"WORLD_SIZE": "2", "LOCAL_RANK": "1", "TORCH_NCCL_ASYNC_ERROR_HANDLING": "3"},
            False,
            True,  # the user's
            {"timeout": timedelta(seconds=90), "device_id": torch.device("cuda", 1)},
        ),
        ({"WORLD_SIZE": "2", "LOCAL_RANK": "1"}, True, True, {"timeout": timedelta(seconds=90)}),  # gloo on the CPU
        ({"WORLD_SIZE": "2", "LOCAL_RANK": "0"}, False, False, {"timeout": timedelta(seconds=90)}),  # no GPU
        ({}, False, True, {}),  # one process: no group
    ],
    ids=["nccl", "nccl-torchrun", "nccl-user-handling", "cpu", "no-gpu", "single"],
)
def test_the_process_group_is_opened_with_the_timeout_and_the_ranks_gpu(environ, cpu, cuda, expected, monkeypatch):
    monkeypatch.setattr(startup, "PartialState", RecordingState)
    monkeypatch.setattr(startup, "_cuda", lambda: cuda)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2 if cuda else 0)  # a GPU per process
    for name in ("WORLD_SIZE", "LOCAL_RANK", "TORCH_NCCL_ASYNC_ERROR_HANDLING"):
        monkeypatch.setenv(name, "")  # so that monkeypatch puts back whatever start-up sets
        monkeypatch.delenv(name)
    for name, value in environ.items():
        monkeypatch.setenv(name, value)
    (settings,) = parse_settings(argv=["--distributed-timeout", "90"])
    state, facts = startup.open_process_group(settings, cpu=cpu)
    assert state.kwargs == expected and state.cpu is cpu
    if "device_id" in expected:  # the watchdog aborts the communicator and the run records the error
        assert state.error_handling == ("3" if environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING") == "3" else "2")
        assert facts == {
            "timeout_s": 90,
            "device_id": "cuda:1",
            "nccl_async_error_handling": state.error_handling,
            "shared_device": None,
        }
    else:
        assert state.error_handling is None and facts == (
            {"timeout_s": 90, "device_id": None, "nccl_async_error_handling": None, "shared_device": None}
            if expected
            else {}
        )


class TwoMachines:
    """Two ranks on two machines, played by two threads: Accelerate's broadcast and gather as they behave
    between them (rank 0's objects to every rank; every rank's objects to every rank)."""

    def __init__(self):
        self.barrier, self.slots, self.local = threading.Barrier(2, timeout=10), [None, None], threading.local()

    def state(self, rank: int):
        return SimpleNamespace(
            num_processes=2, process_index=rank, is_main_process=rank == 0, wait_for_everyone=self.barrier.wait
        )

    def broadcast_object_list(self, objects):
        if self.local.rank == 0:
            self.slots[0] = list(objects)
        self.barrier.wait()
        objects[:] = self.slots[0]
        self.barrier.wait()

    def gather_object(self, objects):
        self.slots[self.local.rank] = objects
        self.barrier.wait()
        gathered = self.slots[0] + self.slots[1]
        self.barrier.wait()
        return gathered

    def run(self, action) -> list:
        """`action(rank)` on both ranks at once; what each returned or raised."""
        outcomes = [None, None]

        def play(rank):
            self.local.rank = rank
            try:
                outcomes[rank] = action(rank)
            except Exception as error:
                outcomes[rank] = error

        threads = [threading.Thread(target=play, args=(rank,)) for rank in (0, 1)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=20)
        return outcomes


@pytest.mark.parametrize("shared", [True, False])
def test_checkpoints_on_several_machines_need_one_shared_folder(shared, tmp_path, monkeypatch):
    """Each machine sees --output-dir; where they are not one folder (here: each its own), every machine would keep
    only its own part of each checkpoint: both refuse at start, with the same line (printed once per host)."""
    machines = TwoMachines()
    monkeypatch.setattr(startup, "SHARED_WAIT_S", 0.3)
    monkeypatch.setattr(startup, "broadcast_object_list", machines.broadcast_object_list)
    monkeypatch.setattr(startup, "gather_object", machines.gather_object)

    def check(rank):
        output = tmp_path / ("runs" if shared else f"runs-of-machine{rank}")
        (settings,) = parse_settings(argv=["--save-every", "2", "--output-dir", str(output)])
        return startup.refuse_unshared_checkpoints(settings, machines.state(rank), environ={"GROUP_WORLD_SIZE": "2"})

    outcomes = machines.run(check)
    if shared:
        assert outcomes == [None, None]
    else:
        assert all(isinstance(o, UserError) for o in outcomes) and str(outcomes[0]) == str(outcomes[1])
        assert str(outcomes[0]).startswith(
            "--save-every on several machines needs --output-dir on a filesystem they "
            f"all share: rank 1 on {socket.gethostname()} cannot see "
            f"{tmp_path / 'runs-of-machine0'}"
        )
    assert not list(tmp_path.iterdir())  # the marker, and the folder made for it, removed


# ---------------------------------------------------------------- signals


class RaisingStream:
    def write(self, text):
        raise RuntimeError("reentrant call inside <_io.BufferedWriter name='<stderr>'>")

    def flush(self):
        raise RuntimeError("reentrant call")


def test_the_signal_handler_only_notes_the_signal(monkeypatch):
    """A print in the handler could land in the middle of tqdm's own write to stderr and fail."""
    signals = StopSignals()
    signals.install()
    try:
        monkeypatch.setattr(sys, "stderr", RaisingStream())
        monkeypatch.setattr(sys, "stdout", RaisingStream())
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.01)  # the handler runs in this thread at the next bytecode
    finally:
        signals.restore()
    assert signals.received == signal.SIGINT


def test_a_second_signal_writes_the_prepared_record_with_system_calls_only(tmp_path, monkeypatch, capfd):
    record = RunRecord(tmp_path)
    record.update(status="running", run_name="r")
    lifecycle = object.__new__(RunLifecycle)
    lifecycle.record, lifecycle.signals, lifecycle.rank = record, StopSignals(), 0
    lifecycle.metrics = SimpleNamespace(loop=SimpleNamespace(step=0))
    lifecycle._prepare_forced_exit()
    lifecycle.metrics.loop.step = 17
    (tmp_path / f".record.json.{os.getpid()}.1a2b3c4d").write_text('{"half')  # a write the signal cut short
    monkeypatch.setattr(json, "dumps", lambda *a, **k: pytest.fail("the handler rendered JSON"))
    monkeypatch.setattr("builtins.open", lambda *a, **k: pytest.fail("the handler opened a Python file"))

    def exit_(code):
        raise SystemExit(code)

    monkeypatch.setattr(os, "_exit", exit_)
    signals = lifecycle.signals
    signals._handle(signal.SIGINT, None)
    signals._first_at -= 2 * StopSignals.DUPLICATE_S
    with pytest.raises(SystemExit) as exited:
        signals._handle(signal.SIGINT, None)
    monkeypatch.undo()
    assert exited.value.code == 130 and "SIGINT again: exiting at once" in capfd.readouterr().err
    written = read_record(tmp_path)
    assert written["status"] == "interrupted" and written["finished"]
    assert written["interruption"] == {
        "signal": "SIGINT",
        "step": 17,
        "checkpoint": None,
        "forced": True,
        "received_here": True,
        "received_by": 0,
    }
    assert sorted(p.name for p in tmp_path.iterdir()) == ["record.json"]


def test_the_vote_carries_the_highest_signal_and_the_lowest_rank_that_received_it():
    votes = [
        vote_value(0, 0),
        vote_value(signal.SIGTERM, 3),
        vote_value(signal.SIGTERM, 1),
        vote_value(signal.SIGINT, 0),
    ]
    assert vote_of(max(votes)) == (signal.SIGTERM, 1) and vote_value(0, 5) == 0


# ---------------------------------------------------------------- peers judged through the launcher's store


@pytest.fixture
def store():
    """A TCPStore as the launcher hosts it (the tests' watches beat every 50 ms and wait 0.5 s for a silent peer);
    `del store.server` ends it."""
    watches = []

    def watch(rank: int, world: int = 3) -> PeerWatch:
        watches.append(
            PeerWatch(
                torch.distributed.PrefixStore("default_pg", found.server), rank, world, beat_s=0.05, patience_s=0.5
            )
        )
        return watches[-1]

    found = SimpleNamespace(
        watch=watch,
        server=torch.distributed.TCPStore("127.0.0.1", 0, 1, True, timedelta(seconds=5), wait_for_workers=False),
    )
    yield found
    for each in watches:
        each.stop()


def test_a_peer_that_failed_is_named_with_its_error_and_a_silent_one_vanished(store):
    main, erring, silent = store.watch(0), store.watch(1), store.watch(2)
    erring.publish_error("out of memory at --per-device-batch-size 16 (step 4)")
    silent.stop()  # its heartbeat stops, as when a process is killed or its machine lost
    started = time.monotonic()
    verdicts = main.verdicts()
    assert verdicts[1] == Verdict(1, "failed", error="out of memory at --per-device-batch-size 16 (step 4)")
    assert verdicts[2].state == "vanished" and verdicts[2].where == f"pid {os.getpid()} on {socket.gethostname()}"
    assert verdicts[2].silent_s >= 0.5 and time.monotonic() - started < 3
    assert root_cause(verdicts.values()).rank == 1


def test_a_peer_alive_is_alive_and_the_root_cause_is_the_peer_that_failed_first(store):
    main, _alive = store.watch(0, world=2), store.watch(1, world=2)
    assert main.verdicts() == {1: Verdict(1, "alive")}
    follower = [Verdict(1, "failed", error="rank 2 vanished", caused_by=2), Verdict(2, "vanished", silent_s=3.0)]
    assert root_cause(follower).rank == 2  # the vanished peer, not the rank that failed because of it


def test_a_peer_that_beat_once_more_before_it_was_killed_is_not_called_alive(store):
    """The heartbeat thread's last look predates the peer's last beat: that move is no sign of life now."""
    main, killed = store.watch(0, world=2), store.watch(1, world=2)
    main._last_seen[1] = (b"0", time.monotonic())  # the thread looked before the peer's last beats
    killed.stop()
    assert main.verdicts()[1].state == "vanished"


def test_before_the_loop_a_collective_lost_to_a_failed_peer_is_its_one_line(store, monkeypatch):
    """A rank that fails while loading the data leaves its peers in a collective (prepare, a barrier): they say its
    line, not a traceback of a closed connection."""
    main, erring = store.watch(0, world=2), store.watch(1, world=2)
    monkeypatch.setattr(liveness, "_current", main)
    erring.publish_error("no such dataset file: data/train.csv")
    fault = liveness.explain(RuntimeError("[gloo/transport/tcp/pair.cc:534] Connection closed by peer"), 600)
    assert str(fault) == "no such dataset file: data/train.csv" and fault.rank == 1
    assert liveness.explain(ValueError("a bug"), 600) is None  # not a collective's: its traceback stays


def test_peers_cannot_be_told_when_the_store_is_gone(store):
    main, _ = store.watch(0, world=2), store.watch(1, world=2)
    del store.server  # the launcher's store ended (its host with it)
    verdicts = main.verdicts()
    assert verdicts[1].state == "unknown" and "the launcher's store is unreachable" in verdicts[1].reason


def test_the_heartbeat_thread_reports_a_silent_peer_while_the_training_thread_is_stuck(store):
    main, silent = store.watch(0, world=2), store.watch(1, world=2)
    reported = threading.Event()
    lost = []
    main.watch(lambda verdicts: (lost.extend(verdicts), reported.set()), silence_s=0.5)
    silent.stop()
    time.sleep(1.5)  # the training thread stuck in a collective: nothing here asks
    assert reported.is_set() and [(v.rank, v.state) for v in lost] == [(1, "vanished")]
    assert main.claim("record") and not silent.claim("record")  # one writer, agreed through the store


def test_the_record_written_from_the_heartbeat_thread_names_the_lost_peer_until_the_run_ends(tmp_path):
    record = RunRecord(tmp_path)
    record.update(status="running")
    lifecycle = object.__new__(RunLifecycle)
    lifecycle.record, lifecycle.watch, lifecycle._ended = record, None, False
    lifecycle._ending_lock = threading.Lock()
    lifecycle.metrics = SimpleNamespace(loop=SimpleNamespace(step=7))
    lifecycle._peer_lost([Verdict(1, "vanished", where="pid 9 on node-b", silent_s=10.2)])
    written = read_record(tmp_path)
    assert written["status"] == "failed" and written["failed_rank"] == 1 and written["failed_at_step"] == 7
    assert (
        written["error"] == "rank 1 (pid 9 on node-b) vanished (no heartbeat for 10.2 s: killed, or its machine lost)"
    )
    assert written["lost_ranks"] == ["rank 1 (pid 9 on node-b)"]
    record.update(status="interrupted")
    lifecycle._begin_ending()  # the training thread's own ending: the thread no longer writes
    lifecycle._peer_lost([Verdict(1, "failed", error="late")])
    assert read_record(tmp_path)["status"] == "interrupted"


def test_a_rank_without_a_watch_publishes_nothing():
    assert liveness.current() is None
    liveness.publish_error("nothing to tell")  # a single process: no store, no error


def test_a_checkpoint_that_does_not_fit_the_model_is_refused_in_one_line(saved_run, tmp_path):
    run_dir = copy_of(saved_run, tmp_path)
    line = assert_one_line(resume(run_dir, "--lora"), 2)  # LoRA's parameters are not the checkpoint's
    assert "--resume: step_00000004 cannot be loaded into this run" in line and "resume with the settings" in line
    assert read_record(run_dir)["status"] == "complete"
