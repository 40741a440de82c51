"""Several machines: the documented two-node command (docs/running.md) run on one host (machine ranks 0 and 1 meeting at
127.0.0.1), how a run counts its machines, and the SLURM batch script that launches it on a cluster."""

import multiprocessing
import os
import re
import socket
import stat
import subprocess
import tempfile
import time
from pathlib import Path

import pytest
from conftest import ACCELERATE, ONE_THREAD, ROOT, TINY, cpu_env, read_record

from trainscope.core.environment import machine_count
from trainscope.core.launching import kill_tree

SBATCH = ROOT / "docs" / "slurm" / "train.sbatch"
# 8 steps: 6 steady steps measured on both machines, DDP's logger read for iterations 1-7.
SHORT = [*TINY, *ONE_THREAD, "--max-steps", "8", "--communication-samples", "2"]


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def launch_machines(args: list[str], logs, machines: int = 2, timeout: float = 180) -> list[int]:
    """The documented multi-node command (docs/running.md) once per machine rank, all at once, as on separate nodes; the
    exit codes. Output goes to files (a full pipe would stall one rank and with it the others); on timeout
    every launch is killed, workers included (torchrun starts them in sessions of their own)."""
    port = free_port()
    processes = []
    for rank in range(machines):
        command = [
            ACCELERATE,
            "launch",
            "--config_file",
            str(ROOT / "accelerate_configs" / "ddp.yaml"),
            "--num_machines",
            str(machines),
            "--num_processes",
            str(machines),
            "--machine_rank",
            str(rank),
            "--main_process_ip",
            "127.0.0.1",
            "--main_process_port",
            str(port),
            str(ROOT / "train.py"),
            *args,
        ]
        with open(logs / f"machine{rank}.log", "w") as log:
            processes.append(
                subprocess.Popen(
                    command, cwd=ROOT, env=cpu_env(), stdout=log, stderr=subprocess.STDOUT, start_new_session=True
                )
            )
    deadline = time.monotonic() + timeout
    try:
        return [process.wait(timeout=max(0.0, deadline - time.monotonic())) for process in processes]
    except subprocess.TimeoutExpired:
        for process in processes:
            kill_tree(process.pid)
        raise AssertionError(f"timed out after {timeout}s\n{tails(logs, machines)}") from None


def tails(logs, machines: int) -> str:
    return "\n".join(
        f"--- machine {rank}\n{(logs / f'machine{rank}.log').read_text()[-3000:]}" for rank in range(machines)
    )


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
    assert communication["steps"] == 6 and len(communication["per_rank"]) == 2
    # each machine's own clock: only durations are compared across hosts, and they pair with DDP's logger
    assert communication["agreement"]["ddp"]["iterations"] == list(range(1, 8))


def one_machine(rank: int, machines: int, port: int, args: list[str], temporary: Path):
    """Machine `rank`'s one process, with what its torchrun exports (docs/running.md's command, one process a
    machine) and a temporary folder of its own (machines do not share /tmp), forked from the test worker with its
    imports done."""
    from accelerate.state import AcceleratorState

    import train

    AcceleratorState._reset_state(reset_partial_state=True)  # the worker's in-process runs leave theirs
    (temporary / str(rank)).mkdir()
    tempfile.tempdir = str(temporary / str(rank))
    os.environ.update(cpu_env(), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(machines))
    os.environ.update(RANK=str(rank), GROUP_RANK=str(rank), GROUP_WORLD_SIZE=str(machines))
    os.environ.update(LOCAL_RANK="0", LOCAL_WORLD_SIZE="1")
    train.main(args)


def forked_machines(args: list[str], temporary: Path, machines: int = 2, timeout: float = 120) -> list[int]:
    """Each machine's process forked on its own and waited for on its own, as separate machines' launchers wait
    for theirs (one torchrun agent would end the others at the first failure); the exit codes."""
    context = multiprocessing.get_context("fork")
    port = free_port()
    processes = [
        context.Process(target=one_machine, args=(rank, machines, port, args, temporary)) for rank in range(machines)
    ]
    for process in processes:
        process.start()
    deadline = time.monotonic() + timeout
    for process in processes:
        process.join(max(0.0, deadline - time.monotonic()))
    hung = [process for process in processes if process.is_alive()]
    for process in hung:
        process.kill()
    assert not hung, f"still running after {timeout} s: killed"
    return [process.exitcode for process in processes]


def test_an_existing_run_is_refused_on_every_machine(tmp_path, capfd):
    """Every machine refuses before joining any collective, so no machine is left waiting for the others."""
    runs = tmp_path / "runs"
    (runs / "multinode").mkdir(parents=True)
    codes = forked_machines([*SHORT, "--output-dir", str(runs), "--run-name", "multinode"], tmp_path)
    assert codes == [2, 2]  # a usage error on both machines
    # the error line is printed once per machine and launch (trainscope.core.errors): here each machine's one process
    printed = "".join(capfd.readouterr())
    assert printed.count("already exists: pass --overwrite") == 2, printed[-3000:]
    assert not any((runs / "multinode").iterdir())


# What torchrun (under accelerate launch) exports to each rank, as printed by both ranks of the
# two-machine launch above and of the single-machine ddp.yaml launch; the MPI case is what Accelerate sets.
@pytest.mark.parametrize(
    "environ, machines",
    [
        ({"RANK": "0", "GROUP_RANK": "0", "GROUP_WORLD_SIZE": "2", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "1"}, 2),
        ({"RANK": "1", "GROUP_RANK": "1", "GROUP_WORLD_SIZE": "2", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "1"}, 2),
        ({"RANK": "1", "GROUP_RANK": "0", "GROUP_WORLD_SIZE": "1", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2"}, 1),
        ({"RANK": "5", "WORLD_SIZE": "16", "LOCAL_WORLD_SIZE": "8"}, 2),  # mpirun: no torchrun agent
        ({}, 1),  # python train.py
        ({"GROUP_WORLD_SIZE": ""}, 1),
    ],
    ids=["node0", "node1", "one-node-ddp", "mpi", "plain", "empty"],
)
def test_every_rank_counts_the_machines(environ, machines):
    assert machine_count(environ) == machines


# ---------------------------------------------------------------- the SLURM batch script

FAKE_SLURM = {
    # the allocation's hosts, in SLURM_NODEID order
    "scontrol": 'printf "gpu-a17\\ngpu-b03\\n"\n',
    # one task per node, each with its own SLURM_NODEID, as `srun` in a --ntasks-per-node=1 job
    "srun": 'for node in $(seq 0 $((SLURM_NNODES - 1))); do SLURM_NODEID=$node SLURM_PROCID=$node "$@" || exit; done\n',
    # records what each task launched: its arguments, one a line, and the variables torchrun reads
    "accelerate": 'printf "%s\\n" "$@" > "$FAKE_OUT/launch-$SLURM_NODEID"\n'
    'echo "$PET_SIGNALS_TO_HANDLE $TORCH_ELASTIC_SHUTDOWN_TIMEOUT $SRUN_CPUS_PER_TASK" '
    '> "$FAKE_OUT/env-$SLURM_NODEID"\n',
}


def submit(tmp_path, *args: str) -> dict[int, list[str]]:
    """Run the batch script as sbatch would on a two-node job of 8 GPUs a node, with srun, scontrol and
    accelerate replaced by recorders; the arguments each node's `accelerate` received."""
    bin_dir, out = tmp_path / "bin", tmp_path / "out"
    bin_dir.mkdir(exist_ok=True)
    out.mkdir(exist_ok=True)
    for name, body in FAKE_SLURM.items():
        (bin_dir / name).write_text("#!/bin/bash\n" + body)
        (bin_dir / name).chmod(stat.S_IRWXU)
    env = {
        "PATH": f"{bin_dir}:{os.environ['PATH']}",
        "FAKE_OUT": str(out),
        "SLURM_JOB_NAME": "trainscope",
        "SLURM_JOB_ID": "4242",
        "SLURM_NNODES": "2",
        "SLURM_JOB_NODELIST": "gpu-a17,gpu-b03",
        "SLURM_CPUS_PER_TASK": "32",
        "SLURM_GPUS_ON_NODE": "8",
    }
    result = subprocess.run(
        ["bash", str(SBATCH), *args], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=30
    )
    assert result.returncode == 0, result.stderr
    return {node: (out / f"launch-{node}").read_text().splitlines() for node in (0, 1)}


def option(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


def test_the_slurm_script_is_valid_bash_with_the_pieces_a_cluster_needs():
    subprocess.run(["bash", "-n", str(SBATCH)], check=True)
    text = SBATCH.read_text()
    directives = re.findall(r"^#SBATCH (\S+)", text, flags=re.M)
    assert re.fullmatch(r"--signal=USR1@\d+", [d for d in directives if d.startswith("--signal")][0])
    assert "--ntasks-per-node=1" in directives
    assert re.search(r"^srun bash -c 'exec accelerate launch", text, flags=re.M)
    assert '--machine_rank "$SLURM_NODEID"' in text
    assert 'scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1' in text
    assert "--save-on-interrupt" in text and '--run-name "$RUN_NAME"' in text


def test_the_slurm_script_launches_every_node_with_its_own_rank(tmp_path):
    launches = submit(tmp_path, "--model", "roberta-base", "--dataset", "glue/sst2")
    for node, argv in launches.items():
        assert argv[:3] == ["launch", "--config_file", "accelerate_configs/ddp.yaml"]
        assert option(argv, "--machine_rank") == str(node)  # expanded by the task, not the batch shell
        assert option(argv, "--num_machines") == "2" and option(argv, "--num_processes") == "16"
        assert option(argv, "--main_process_ip") == "gpu-a17" and option(argv, "--main_process_port") == "29500"
        assert argv[argv.index("train.py") :] == [
            "train.py",
            "--output-dir",
            "runs",
            "--run-name",
            "trainscope-4242",
            "--save-on-interrupt",
            "--model",
            "roberta-base",
            "--dataset",
            "glue/sst2",
        ]
        assert (tmp_path / "out" / f"env-{node}").read_text().split() == [
            "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1",
            "100",
            "32",
        ]


def test_a_requeued_slurm_job_resumes_from_its_checkpoint(tmp_path):
    (tmp_path / "runs" / "trainscope-4242" / "checkpoints" / "step_00000040").mkdir(parents=True)
    for argv in submit(tmp_path, "--model", "roberta-base").values():
        assert argv[argv.index("--save-on-interrupt") :] == [
            "--save-on-interrupt",
            "--resume",
            "--model",
            "roberta-base",
        ]
