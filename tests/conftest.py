"""Shared helpers: launch the scripts exactly as the README does, on the tiny model, on the CPU; run
train.py in this process where the launcher is not what a test is about; check that no test leaves
the process changed."""

import atexit
import contextlib
import http.server
import io
import json
import math
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import pytest
import torch
import torch._dynamo  # noqa: F401  importing it sets TORCHINDUCTOR_CACHE_DIR: before any test looks at the environment
import yaml

from trainscope.core.launching import kill_tree

# The files that launch the most processes, longest first (from the suite's --durations on a 2-core EPYC): two workers
# take whole files in this order (pytest.ini turns off xdist's own reordering by test count), so the long ones start
# first and the many short files fill in at the end, leaving no worker idle while the other runs a long launch.
LONGEST_FIRST = (
    "test_report.py",
    "test_launches.py",
    "test_endings.py",
    "test_train.py",
    "test_predict.py",
    "test_communication.py",
    "test_compare_dp.py",
    "test_multinode.py",
    "test_gpu_path.py",
    "test_advisor.py",
    "test_flops_profile.py",
    "test_loaders_bench.py",
    "test_tune.py",
    "test_tune_runs.py",
    "test_faults.py",
    "test_data.py",
    "test_benchmarks.py",
    "test_timing.py",
    "test_report_pdf.py",
    "test_unpad.py",
    "test_compile.py",
    "test_gpu_costs.py",
    "test_secrets.py",
    "test_bench.py",
)


def pytest_collection_modifyitems(items):
    rank = {name: index for index, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(Path(str(item.fspath)).name, len(rank)))  # stable: file order kept


# Tests run on two workers of a 2-core machine: OpenMP threads that spin while waiting would take the
# other worker's core (a 25 s run took 150 s). Set before torch runs its first parallel region.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# Every run measures the machine's matmul peak (trainscope.measure.peak) on a miss of its cache: the session's runs share
# one temporary cache (a miss per thread count, model shape and process count, then hits), and the large square
# is small, so no test pays the full benchmark and no developer's own cache is touched. The first process to load
# this file makes it (pytest's controller, before it starts the workers, which inherit it, as every process they
# start does) and removes it at exit.
SESSION_CACHE = "TRAINSCOPE_TEST_SESSION_CACHE"
if not (os.environ.get(SESSION_CACHE) and Path(os.environ[SESSION_CACHE]).is_dir()):
    os.environ[SESSION_CACHE] = tempfile.mkdtemp(prefix="trainscope-test-cache-")
    atexit.register(shutil.rmtree, os.environ[SESSION_CACHE], ignore_errors=True)
os.environ["TRAINSCOPE_CACHE_DIR"] = os.environ[SESSION_CACHE]
os.environ["TRAINSCOPE_PEAK_SQUARE"] = "256"
os.environ["TRAINSCOPE_PEAK_CACHE_BUSY"] = "any"  # the workers share the cores: the session cache keeps every rate
# No run calibrates the predictor on first use (a minute of short runs): the tests that calibrate say so.
os.environ["TRAINSCOPE_CALIBRATION"] = "off"

ROOT = Path(__file__).resolve().parent.parent
CONFIGS = sorted((ROOT / "accelerate_configs").glob("*.yaml"))
ACCELERATE = str(Path(sys.executable).parent / "accelerate")
# A few seconds a run: 2-layer BERT of width 32, small slices of the embedded tweets. The thread-budget
# tests launch with TINY (--threads auto); behaviour tests add ONE_THREAD so two test workers do not
# oversubscribe the cores.
TINY = [
    "--model",
    "embedded:tiny-bert",
    "--max-train-samples",
    "256",
    "--max-eval-samples",
    "64",
    "--max-test-samples",
    "64",
    "--per-device-batch-size",
    "16",
    "--learning-rate",
    "3e-3",
    "--report-to",
    "none",
    "--log-every",
    "2",
]
ONE_THREAD = ["--threads", "1"]


def cpu_env(**extra) -> dict:
    """The tests' environment: CPU only (GPUs hidden, so a GPU machine runs the same tests), no launcher threads set."""
    env = {
        **os.environ,
        "ACCELERATE_USE_CPU": "1",
        "CUDA_VISIBLE_DEVICES": "",
        "PYTHONUNBUFFERED": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "OMP_WAIT_POLICY": "PASSIVE",
    }
    env.pop("OMP_NUM_THREADS", None)
    env.update(extra)
    return env


def config_processes(config: Path) -> int:
    return int(yaml.safe_load(config.read_text()).get("num_processes", 1)) if config.exists() else 1


def free_port() -> int:
    """A TCP port no process listens on now, for a multi-process launch's rendezvous."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def launch(
    script: str,
    args: list[str],
    config: Path | None = None,
    env: dict | None = None,
    cwd: Path = ROOT,
    timeout: int = 600,
    launcher: str = "accelerate",
) -> subprocess.CompletedProcess:
    """`accelerate launch [--config_file X] script args` (the README's command), `python script args` or torchrun."""
    if launcher == "accelerate":
        command = [ACCELERATE, "launch"] + (["--config_file", str(config)] if config else [])
        if config and config_processes(config) > 1:  # not the fixed 29500: two launches at once would collide on it
            command += ["--main_process_port", str(free_port())]
    elif launcher == "python":
        command = [sys.executable]
    else:
        command = [str(Path(sys.executable).parent / "torchrun"), "--nproc_per_node", "2"]
    command += [str(ROOT / script), *args]
    return run_command(command, cwd=cwd, env=env or cpu_env(), timeout=timeout)


def run_command(command: list[str], cwd: Path = ROOT, env: dict | None = None, timeout: int = 600):
    """subprocess.run that, on timeout, kills the launcher's whole process group, workers included."""
    process = subprocess.Popen(
        command,
        cwd=cwd,
        env=env or cpu_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        stdout, stderr = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_tree(process.pid)
        stdout, stderr = process.communicate()
        raise AssertionError(f"timed out after {timeout}s: {' '.join(command)}\n{stderr[-3000:]}") from None
    return subprocess.CompletedProcess(command, process.returncode, stdout, stderr)


def run_in_process(args: list[str], main=None) -> subprocess.CompletedProcess:
    """train.py's main() (or another script's `main`) in this process (no launcher, no imports to pay again): exit
    code and what it printed to Python's streams.

    What a run changes process-wide is put back: torch threads, TF32 flags, Accelerate's state, the environment.
    """
    from accelerate.state import AcceleratorState

    if main is None:
        import train

        main = train.main
    threads, tf32 = torch.get_num_threads(), (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
    environ = dict(os.environ)
    out, err = io.StringIO(), io.StringIO()
    code = 0
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            main(args)
    except SystemExit as exit_:
        code = exit_.code if isinstance(exit_.code, int) else 1
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)
        torch.set_num_threads(threads)
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = tf32
        os.environ.clear()
        os.environ.update(environ)
    return subprocess.CompletedProcess(
        [getattr(main, "__module__", "train"), *args], code, out.getvalue(), err.getvalue()
    )


_FORK_SERVER = None


def fork_server():
    """This test worker's fork server (multiprocessing's "forkserver" context), which imports train.py's modules
    once: its children start with them."""
    global _FORK_SERVER
    import multiprocessing

    if _FORK_SERVER is None:
        _FORK_SERVER = multiprocessing.get_context("forkserver")
        _FORK_SERVER.set_forkserver_preload(["forked", "train", "evaluate", "trainscope.experiments", "accelerate"])
    return _FORK_SERVER


def run_script_forked(command: list[str], env: dict, timeout: float | None = None) -> subprocess.CompletedProcess:
    """`python <script> [args]` or `python -m <module> [args]` (what trainscope.core.launching.run_captured runs for
    `--launcher python`, and what a one-process `accelerate launch` runs) in a child forked from a fork server that
    has train.py's imports done (a tiny run's own interpreter spends about 85% of its 10 s on them on a 2-core
    machine): for tests whose subject is what the runs do, not how their interpreter starts. The child gets `env`,
    the project's folder, its own session, and its output captured (tests/forked.py); past `timeout` it is killed
    and the result ends in run_captured's timeout line. The server (one a test worker) is not this process: a child
    forked from a process whose torch ran on several threads can hang in its first parallel region."""
    import forked

    return completed(command, *in_fork_server_child(forked.run, (list(command), dict(env)), timeout), timeout)


def completed(command, code: int | None, stdout: str, stderr: str, timeout: float | None):
    """A fork server's child's ending (in_fork_server_child) as subprocess.run gives one back; one killed at its
    timeout ends in run_captured's timeout line."""
    if code is None:
        return subprocess.CompletedProcess(
            command, -signal.SIGKILL, stdout, stderr + f"\nerror: timed out after {timeout:.0f} s"
        )
    return subprocess.CompletedProcess(command, code, stdout, stderr)


def in_fork_server_child(target, args: tuple, timeout: float | None) -> tuple[int | None, str, str]:
    """`target(*args, out, err)` in a child of the fork server, its output written to the files `out` and `err`:
    its exit code (None when it ran past `timeout` and was killed, with its children) and what it printed."""
    with tempfile.TemporaryDirectory() as folder:
        out, err = Path(folder) / "out", Path(folder) / "err"
        child = fork_server().Process(target=target, args=(*args, str(out), str(err)))
        child.start()
        child.join(timeout)
        code = child.exitcode
        if code is None:
            kill_tree(child.pid)
            child.join()
        stdout, stderr = (path.read_text(errors="replace") if path.exists() else "" for path in (out, err))
    return code, stdout, stderr


def planned_launch(command: list[str], env: dict) -> tuple[str, object, dict, str] | None:
    """What `accelerate launch [flags] <script or -m module> [args]` (`command`, run with `env`) would start, by
    Accelerate's own code (its flags and config file read as its launcher reads them), and what it printed doing
    so: ("python", the command, its environment, printed) for its simple launcher (one process); ("torchrun",
    torchrun's arguments, the environment, printed) for its multi-GPU launcher (DDP and FSDP: torch's elastic agent
    starts the ranks). None for any other launch (DeepSpeed, Megatron-LM, TPU, mpirun, several processes on the
    simple launcher, a cloud's)."""
    import torch.distributed.run as distrib_run
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils.launch import _filter_args, prepare_multi_gpu_env, prepare_simple_launcher_cmd_env

    if Path(command[0]).name != "accelerate" or command[1:2] != ["launch"]:
        return None
    environ, printed = dict(os.environ), io.StringIO()
    try:
        os.environ.clear()
        os.environ.update(env)
        with contextlib.redirect_stdout(printed), contextlib.redirect_stderr(printed):
            args, defaults, _ = _validate_launch_command(launch_command_parser().parse_args(command[2:]))
            if defaults is not None and defaults.compute_environment != "LOCAL_MACHINE":
                return None
            others = (args.use_deepspeed, args.use_megatron_lm, args.tpu)
            if args.cpu or not any((*others, args.use_fsdp, args.multi_gpu)):  # launch_command's simple_launcher
                if (args.num_processes or 1) > 1 or args.mpirun_hostfile:
                    return None
                launched, launch_env = prepare_simple_launcher_cmd_env(args)
                plan = ("python", launched, launch_env)
            elif not any(others):  # launch_command's multi_gpu_launcher
                launch_env = prepare_multi_gpu_env(args)
                script = [
                    "--training_script",
                    args.training_script,
                    "--training_script_args",
                    args.training_script_args,
                ]
                plan = ("torchrun", _filter_args(args, distrib_run.get_args_parser(), script), launch_env)
            else:
                return None
    finally:
        os.environ.clear()
        os.environ.update(environ)
    return (*plan, printed.getvalue())


def launch_forked(command: list[str], env: dict, timeout: float | None = None):
    """An `accelerate launch` command run forked with what Accelerate's launcher would start (planned_launch), or a
    `torchrun` command, as subprocess.run would give it back: `args` the command, stderr starting with what the
    launcher printed. One process: run_script_forked. Several (DDP, FSDP, torchrun): torch.distributed.run's code
    with the launcher's arguments and environment in a child of the fork server, its elastic agent forking the
    ranks, each running the script as `python` would (tests/forked.py). None for any other launch: those start
    for real."""
    import forked
    import torch.distributed.run as distrib_run

    if Path(command[0]).name == "torchrun":
        plan = ("torchrun", distrib_run.get_args_parser().parse_args(command[1:]), dict(env), "")
    else:
        plan = planned_launch(command, env)
    if plan is None:
        return None
    kind, launched, launch_env, printed = plan
    if kind == "python":
        result = run_script_forked(launched, launch_env, timeout)
    else:
        result = completed(command, *in_fork_server_child(forked.torchrun, (launched, launch_env), timeout), timeout)
    result.args, result.stderr = command, printed + result.stderr
    return result


def fork_launches(monkeypatch) -> None:
    """Every `python <script>` or `python -m <module>` that trainscope.core.launching.run_captured starts (`--launcher
    python` runs, benchmark arms), every `torchrun` and every `accelerate launch` of one process or of DDP or FSDP
    ranks, runs forked (run_script_forked, launch_forked) with what the launcher would start; other launches start
    as always. For tests of what drivers make of their runs: the launches themselves are tested in
    test_launches.py."""
    from trainscope.core import launching

    launched = launching.run_captured

    def run_captured(command, env, timeout=None, cwd=ROOT):  # forked children run in the project's folder
        if Path(command[0]).name.startswith("python"):
            return run_script_forked(command, env, timeout)
        result = launch_forked(command, env, timeout)
        return launched(command, env, timeout, cwd) if result is None else result

    monkeypatch.setattr(launching, "run_captured", run_captured)


def driven_in_process(target: list[str], env: dict | None = None) -> subprocess.CompletedProcess:
    """A make target's own command (`make -n`, run with `env`): its driver (an experiment's, report.py or
    compare_dp.py) run in this process (run_in_process) with the command it records as its own, the runs it
    launches forked with what their launcher would start (fork_launches)."""
    import compare_dp
    import report
    from trainscope import experiments

    drivers = {"trainscope.experiments": experiments.main, "report.py": report.main, "compare_dp.py": compare_dp.main}
    planned = run_command(["make", "-n", *target], env=env).stdout.replace("\\\n", " ").splitlines()
    (command,) = [shlex.split(line) for line in planned if any(f" {name} " in f"{line} " for name in drivers)]
    script = 3 if command[1] == "-m" else 2  # where the driver's own arguments start
    with pytest.MonkeyPatch.context() as patch:
        fork_launches(patch)
        patch.setattr(sys, "orig_argv", command)  # the command its results record
        patch.setattr(sys, "argv", command[script - 1 :])
        return run_in_process(command[script:], main=drivers[command[script - 1]])


def run_in_forked_ranks(args: list[str], main=None, processes: int = 2, timeout: float = 300, **env) -> int:
    """train.py's main() (or another `main(args)`, importable by name: a fork server's child runs it) on `processes`
    DDP ranks (gloo on the CPU) by Accelerate's notebook_launcher, which runs torch's elastic agent (torchrun's) in a
    child of the fork server of run_script_forked and forks the ranks from it: for the tests of what DDP does, not
    of how `accelerate launch` starts it. The ranks start with train.py's imports done (an `accelerate launch` of
    two ranks pays about 20 s of CPU for its interpreters and imports on a 2-core machine); what they print goes to
    this process's file descriptors once they end (capfd). 0 when every rank succeeded, else 1 (torchrun's
    status). Ranks still running after `timeout` seconds (a hang guard, not a measurement) are killed and the test
    fails. Other keyword arguments: environment variables for the ranks beyond cpu_env()'s."""
    import forked

    if main is None:
        import train

        main = train.main
    environment = cpu_env(**env)
    environment.pop("OMP_NUM_THREADS", None)
    code, stdout, stderr = in_fork_server_child(
        forked.ranks, (main, list(args), processes, str(free_port()), environment), timeout
    )
    os.write(1, stdout.encode())
    os.write(2, stderr.encode())
    assert code is not None, f"the ranks were still running after {timeout} s: killed"
    return code


def signal_at_training_batch(monkeypatch, batch: int, signum: int) -> list:
    """Send `signum` to this process while the `batch`-th batch of the run loads (counted once the run's own
    handler is installed: the predictor collates batches of its own before the run starts). A signal whose handler
    is not the run's would end the test worker itself, so none is sent then: the test sees no interruption."""
    import trainscope.workload.data as data
    from trainscope.run.signals import StopSignals

    build, loaded = data.build_collator, []

    def build_collator(*args, **kwargs):
        collate = build(*args, **kwargs)

        def collate_and_signal(rows):
            if isinstance(getattr(signal.getsignal(signum), "__self__", None), StopSignals):
                loaded.append(len(rows))
                if len(loaded) == batch:
                    os.kill(os.getpid(), signum)
            return collate(rows)

        return collate_and_signal

    monkeypatch.setattr(data, "build_collator", build_collator)
    return loaded


def read_record(run_dir: Path) -> dict:
    return json.loads((run_dir / "record.json").read_text())


def read_steps(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "steps.jsonl").read_text().splitlines()]


def assert_ok(result: subprocess.CompletedProcess) -> None:
    assert result.returncode == 0, f"exit {result.returncode}\n{result.stdout[-3000:]}\n{result.stderr[-5000:]}"


def error_line(result: subprocess.CompletedProcess) -> str:
    lines = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert lines, f"no error line in:\n{result.stderr[-3000:]}"
    return lines[-1]


def rank_tracebacks(log: str) -> list[str]:
    """The exceptions of the tracebacks in a launch's output, less the launcher's own report (ChildFailedError; for
    forked ranks the elastic agent's ProcessExitedException, the exit code of a rank that ended)."""
    raised = []
    for block in log.split("Traceback (most recent call last):")[1:]:
        last = next((line for line in block.splitlines() if line.strip() and not line.startswith(" ")), "")
        if "ChildFailedError" not in last and "ProcessExitedException:" not in block:
            raised.append(last)
    return raised


def error_lines(log: str) -> list[str]:
    """`error: ...` lines of a launch, also where a rank's line follows another rank's progress bar."""
    return re.findall(r"error: .*", log)


@pytest.fixture
def runs(tmp_path) -> Path:
    return tmp_path / "runs"


def _process_state() -> dict:
    import datasets
    import datasets.config
    import huggingface_hub.constants

    return {
        "environment": {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")},
        "cwd": os.getcwd(),
        "torch threads": torch.get_num_threads(),
        "default dtype": torch.get_default_dtype(),
        "TF32 flags": (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32),
        "datasets progress bars": datasets.is_progress_bar_enabled(),
        "datasets offline": datasets.config.HF_HUB_OFFLINE,
        "huggingface_hub offline": huggingface_hub.constants.HF_HUB_OFFLINE,
        "signal handlers": {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)},
    }


@pytest.fixture(autouse=True)
def process_left_as_found():
    """Every test leaves the process as it found it (environment, library switches, threads, dtype, cwd)."""
    before = _process_state()
    yield
    after = _process_state()
    changed = [name for name in before if before[name] != after[name]]
    if "environment" in changed:
        keys = {
            k
            for k in before["environment"].keys() | after["environment"].keys()
            if before["environment"].get(k) != after["environment"].get(k)
        }
        changed[changed.index("environment")] = f"environment ({', '.join(sorted(keys))})"
    assert not changed, f"the test changed process state: {', '.join(changed)}"


def plant(record: dict, **changes) -> dict:
    """`record` with symptoms planted in place: keyword names are key paths joined by `__` (a__b -> record[a][b])."""
    for path, value in changes.items():
        *parents, leaf = path.split("__")
        target = record
        for key in parents:
            target = target[key]
        target[leaf] = value
    return record


# ---------------------------------------------------------------- a GPU's clocks, planted


class PlantedGPU:
    """A host clock and a device stream: a launch costs the host LAUNCH_S and queues its kernel after the work before
    it; a synchronization waits for the queue and costs SYNC_S; an event completes when the work queued before it
    has. A GEMM's kernel takes `kernel_s`, a cache flush FLUSH_S."""

    LAUNCH_S, SYNC_S, FLUSH_S = 10e-6, 20e-6, 50e-6

    def __init__(self, kernel_s: float):
        self.kernel_s, self.now, self.done, self.kernels = kernel_s, 0.0, 0.0, 0

    def launch(self, seconds: float) -> None:
        self.now += self.LAUNCH_S
        self.done = max(self.now, self.done) + seconds

    def perf_counter(self) -> float:
        return self.now

    def synchronize(self, device=None) -> None:
        self.now = max(self.now, self.done) + self.SYNC_S

    def event(self):
        gpu = self

        class Event:
            def record(self):
                self.at = max(gpu.now, gpu.done)

            def elapsed_time(self, end):
                return (end.at - self.at) * 1e3

        return Event()

    def clock(self):
        """trainscope.measure.timing.EventClock's surface over the planted device."""
        gpu = self

        class Clock:
            def mark(self):
                event = gpu.event()
                event.record()
                return event

            def wait(self, event):
                gpu.now = max(gpu.now, event.at)

            def elapsed(self, start, end):
                return start.elapsed_time(end) / 1e3

        return Clock()

    def flush_buffer(self, device):
        gpu = self

        class Buffer:
            def zero_(self):
                gpu.launch(gpu.FLUSH_S)

        return Buffer()

    def matrix(self):
        gpu = self

        class Matrix:
            def __matmul__(self, other):
                gpu.launch(gpu.kernel_s)
                gpu.kernels += 1
                return self

        return Matrix()


# ---------------------------------------------------------------- a dataset URL with credentials

PASSWORD, TOKEN = "s3cretpass-7781", "tok-55419203"


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """An HTTP server on localhost with a small labelled CSV; the URL carries user:password@ and a token."""
    root = tmp_path_factory.mktemp("served")
    rows = "".join(
        f"tweet number {i} is {'good' if i % 2 else 'bad'},{'good' if i % 2 else 'bad'}\n" for i in range(400)
    )
    (root / "data.csv").write_text("text,label\n" + rows)

    class Quiet(http.server.SimpleHTTPRequestHandler):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, directory=str(root), **kwargs)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Quiet)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    base = f"http://reader:{PASSWORD}@127.0.0.1:{server.server_address[1]}"
    yield base
    server.shutdown()


def leaks(printed: str, folder: Path) -> list[str]:
    """Where either secret shows: what a script printed, or any file under `folder`."""
    found = [f"console ({secret})" for secret in (PASSWORD, TOKEN) if secret in printed]
    for path in folder.rglob("*") if folder.exists() else []:
        if path.is_file():
            content = path.read_bytes()
            found += [f"{path} ({secret})" for secret in (PASSWORD, TOKEN) if secret.encode() in content]
    return found


def binomial_quantile(rate: float, trials: int, level: float) -> int:
    """The smallest c with P(X <= c) >= level, X ~ Binomial(trials, rate), summed exactly. A simulation's count of
    an event whose true rate is at most `rate` stays at or below the quantile at level 0.99 in 99% of seeds (the
    upper bound its null simulations assert); a count below the quantile at level 0.01 happens under 1% of the time
    to an event whose rate is at least `rate` (the lower bound of a coverage)."""
    if rate <= 0 or rate >= 1:
        return 0 if rate <= 0 else trials

    def log_pmf(k: int) -> float:  # in logs: P(X = 0) alone underflows at thousands of trials
        return (
            math.lgamma(trials + 1)
            - math.lgamma(k + 1)
            - math.lgamma(trials - k + 1)
            + k * math.log(rate)
            + (trials - k) * math.log1p(-rate)
        )

    total, count = math.exp(log_pmf(0)), 0
    while total < level and count < trials:
        count += 1
        total += math.exp(log_pmf(count))
    return count
