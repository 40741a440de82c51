"""Several machines: the README's two-node command run on one host (machine ranks 0 and 1 meeting at
127.0.0.1), and how a run counts its machines."""

import re
import socket
import subprocess
import time

import pytest

from conftest import ACCELERATE, ONE_THREAD, ROOT, TINY, cpu_env, read_record
from trainscope.environment import machine_count
from trainscope.launching import kill_tree

# 8 steps put two communication calibration steps (4 and 6) after the 2 warm-up steps.
SHORT = [*TINY, *ONE_THREAD, "--max-steps", "8", "--communication-samples", "2"]


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def launch_machines(args: list[str], logs, machines: int = 2, timeout: float = 180) -> list[int]:
    """The README's multi-node command once per machine rank, all at once, as on separate nodes; the
    exit codes. Output goes to files (a full pipe would stall one rank and with it the others); on timeout
    every launch is killed, workers included (torchrun starts them in sessions of their own)."""
    port = free_port()
    processes = []
    for rank in range(machines):
        command = [ACCELERATE, "launch", "--config_file", str(ROOT / "accelerate_configs" / "ddp.yaml"),
                   "--num_machines", str(machines), "--num_processes", str(machines), "--machine_rank", str(rank),
                   "--main_process_ip", "127.0.0.1", "--main_process_port", str(port), str(ROOT / "train.py"), *args]
        with open(logs / f"machine{rank}.log", "w") as log:
            processes.append(subprocess.Popen(command, cwd=ROOT, env=cpu_env(), stdout=log, stderr=subprocess.STDOUT,
                                              start_new_session=True))
    deadline = time.monotonic() + timeout
    try:
        return [process.wait(timeout=max(0.0, deadline - time.monotonic())) for process in processes]
    except subprocess.TimeoutExpired:
        for process in processes:
            kill_tree(process.pid)
        raise AssertionError(f"timed out after {timeout}s\n{tails(logs, machines)}") from None


def tails(logs, machines: int) -> str:
    return "\n".join(f"--- machine {rank}\n{(logs / f'machine{rank}.log').read_text()[-3000:]}" for rank in range(machines))


def test_two_machines_train_one_run(tmp_path):
    runs = tmp_path / "runs"
    codes = launch_machines([*SHORT, "--output-dir", str(runs), "--run-name", "multinode"], tmp_path)
    assert codes == [0, 0], tails(tmp_path, 2)

    # one record, written by the main process of machine 0; the other machine trained beside it
    assert sorted(runs.rglob("record.json")) == [runs / "multinode" / "record.json"]
    record = read_record(runs / "multinode")
    assert record["status"] == "complete"
    assert "--machine_rank 0" in record["provenance"]["command"]
    machine1 = (tmp_path / "machine1.log").read_text()
    assert "training: 100%" in machine1 and "record:" not in machine1  # its local main process's progress bar

    # two machines of one process each, not one machine's two processes
    env, summary = record["environment"], record["summary"]
    assert summary["world_size"] == env["world_size"] == 2
    assert env["num_machines"] == 2
    assert env["threads"]["local_processes"] == 1
    assert env["distributed_type"] == "MULTI_CPU" and env["backend"] == "gloo"
    assert sorted(r["rank"] for r in summary["timing"]["per_rank"]) == [0, 1]

    communication = summary["communication"]
    assert communication["measured"] is True and communication["world_size"] == 2
    assert communication["calibration_samples"] == 2
    assert len(communication["per_rank"]) == 2


def test_an_existing_run_is_refused_on_every_machine(tmp_path):
    """Every machine refuses before joining any collective, so no machine is left waiting for the others."""
    runs = tmp_path / "runs"
    (runs / "multinode").mkdir(parents=True)
    codes = launch_machines([*SHORT, "--output-dir", str(runs), "--run-name", "multinode"], tmp_path, timeout=120)
    assert all(code != 0 for code in codes), tails(tmp_path, 2)
    logs = [(tmp_path / f"machine{rank}.log").read_text() for rank in (0, 1)]
    # the error line is printed once per host and launch (trainscope.errors), here by one of the two ranks;
    # torchrun's report shows that the other one exited with the same user-error code
    assert sum(log.count("already exists: pass --overwrite") for log in logs) == 1
    assert all(re.search(r"exitcode\s*:\s*2 ", log) for log in logs), tails(tmp_path, 2)
    assert not any((runs / "multinode").iterdir())


# What torchrun (under accelerate launch) exports to each rank, as printed by both ranks of the
# two-machine launch above and of the single-machine ddp.yaml launch; the MPI case is what Accelerate sets.
@pytest.mark.parametrize("environ, machines", [
    ({"RANK": "0", "GROUP_RANK": "0", "GROUP_WORLD_SIZE": "2", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "1"}, 2),
    ({"RANK": "1", "GROUP_RANK": "1", "GROUP_WORLD_SIZE": "2", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "1"}, 2),
    ({"RANK": "1", "GROUP_RANK": "0", "GROUP_WORLD_SIZE": "1", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2"}, 1),
    ({"RANK": "5", "WORLD_SIZE": "16", "LOCAL_WORLD_SIZE": "8"}, 2),  # mpirun: no torchrun agent
    ({}, 1),                                                           # python train.py
    ({"GROUP_WORLD_SIZE": ""}, 1),
], ids=["node0", "node1", "one-node-ddp", "mpi", "plain", "empty"])
def test_every_rank_counts_the_machines(environ, machines):
    assert machine_count(environ) == machines
