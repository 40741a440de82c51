"""Dropout masks drawn as torch draws them on a CPU, bit for bit and faster: the padding-free layers' masks (--unpad).

How it works: docs/same-result.md#in-the-code-how-the-dropout-masks-are-drawn-trainscopeworkloaddropout_drawspy.
"""

import ctypes
import hashlib
import json
import os
import platform
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from trainscope.core.paths import ROOT, cache_dir
from trainscope.core.records import write_json_atomic

SOURCE = Path(__file__).parent / "native" / "mt19937_bernoulli.c"
KINDS = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
NAMES = {dtype: str(dtype).removeprefix("torch.") for dtype in KINDS}
# what bernoulli_fill reads and writes of torch.get_rng_state()'s bytes (CPUGeneratorImplState's legacy_pod: seed,
# left, seeded, next, then 624 64-bit words); torch 2.x's state is 5,056 bytes (a normal-distribution cache after)
STATE_BYTES = 24 + 8 * 624
# the build: these flags, with -march=native, else without it (a compiler that knows no -march=native)
FLAGS = ("-O3", "-shared", "-fPIC")
TUNINGS = (("-march=native",), ())
# the lengths the check draws: under one state block, across a twist with an element split over it, several blocks
CHECK_LENGTHS = (3, 311, 625, 7 * 1249)
CHECK_KEEP = (0.9, 0.5, 1 / 3)
CHECK_TIMEOUT_S = 300  # the child's check takes seconds (mostly importing torch)
VERDICTS = ("passed", "differs", "failed", "crashed")
DIFFER = "its masks differ from torch's bernoulli_ here (MKL's path?)"

_loaded: dict = {}  # "lib", "dtypes" (checked ones), "why" (when none), "verdict", "marker", once per process


def _cpu_signature() -> str:
    """The CPU's model and flags: the cache key's stand-in for what -march=native compiles for, where the compiler
    does not say."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        wanted = [line for line in lines if line.startswith(("model name", "flags"))][:2]
        return "\n".join(wanted) or platform.processor()
    except OSError:
        return platform.processor() or platform.machine()


def _ask(command: list[str]) -> str | None:
    """A compiler query's output (stdout, then stderr), or None where it cannot run or fails."""
    try:
        done = subprocess.run(
            command,
            capture_output=True,
            text=True,
            timeout=60,
            stdin=subprocess.DEVNULL,
            env={**os.environ, "LC_ALL": "C"},  # the same words whatever the language: the same key
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return None if done.returncode else done.stdout + done.stderr


def _listed_target(compiler: str) -> str | None:
    """gcc's own list of its target options under -march=native (the CPU it chose, each instruction set on or off)."""
    listed = _ask([compiler, "-march=native", "-Q", "--help=target"])
    return listed if listed and "-march=" in listed else None


def _passed_target(compiler: str) -> str | None:
    """The target options the driver passes its compiler proper under -march=native (`-###`: clang's -target-cpu
    and -target-features, gcc's expanded -m options), without the temporary file names."""
    shown = _ask([compiler, "-###", "-march=native", "-x", "c", "-c", "-o", os.devnull, os.devnull])
    if not shown:
        return None
    kept = []
    for line in shown.splitlines():
        if not line.startswith(" "):
            continue
        try:
            words = shlex.split(line)
        except ValueError:
            continue
        for index, word in enumerate(words):
            if word in ("-triple", "-target-cpu", "-target-feature", "-target-abi", "--param", "-tune-cpu"):
                kept.append(f"{word} {words[index + 1] if index + 1 < len(words) else ''}")
            elif word.startswith("-m") and word != "-mllvm":
                kept.append(word)
        if kept:
            break  # the compiler proper's line; the assembler's and linker's lines follow
    return "\n".join(kept) or None


def _key_facts(compiler: str) -> dict:
    """What the cache key is made of: a build is shared only by processes that would build the same bytes."""
    version = _ask([compiler, "--version"])
    target = _listed_target(compiler) or _passed_target(compiler)
    return {
        "source": hashlib.sha256(SOURCE.read_bytes()).hexdigest(),
        "compiler": compiler,
        "version": version.strip().splitlines()[0] if version and version.strip() else None,
        "flags": [list(FLAGS), *map(list, TUNINGS)],
        "target": target if target is not None else _cpu_signature(),
        "machine": platform.machine(),
    }


def _library_path(compiler: str) -> Path:
    digest = hashlib.sha256(json.dumps(_key_facts(compiler), sort_keys=True).encode()).hexdigest()
    return cache_dir() / "native" / f"mt19937_bernoulli-{digest[:16]}.so"


def _marker_path(library: Path) -> Path:
    return library.with_suffix(".check.json")


def _build() -> Path:
    """The compiled loop's path, from the cache or built now (written under a temporary name, then renamed:
    processes building it at once each leave a whole file). Not loaded here: see `_verdict`. Raises RuntimeError
    saying why not."""
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not compiler:
        raise RuntimeError("no C compiler (cc, gcc or $CC)")
    target = _library_path(compiler)
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        handle, partial = tempfile.mkstemp(suffix=".so", dir=target.parent)
        os.close(handle)
        try:
            for tuning in TUNINGS:
                done = subprocess.run(
                    [compiler, FLAGS[0], *tuning, *FLAGS[1:], "-o", partial, str(SOURCE)],
                    capture_output=True,
                    text=True,
                    timeout=120,
                )
                if not done.returncode:
                    break
            if done.returncode:
                raise RuntimeError(f"{Path(compiler).name} failed: {done.stderr.strip().splitlines()[-1:]}")
            os.replace(partial, target)
        finally:
            if os.path.exists(partial):
                os.unlink(partial)
    return target


def _open(path: Path) -> ctypes.CDLL:
    """The library loaded into this process. `_load` opens only one whose check in a child process passed (the tests
    open theirs to check the loop itself)."""
    library = ctypes.CDLL(str(path))
    library.bernoulli_fill.argtypes = [
        ctypes.c_void_p,
        ctypes.c_size_t,
        ctypes.c_void_p,
        ctypes.c_size_t,
        ctypes.c_double,
        ctypes.c_int,
    ]
    library.bernoulli_fill.restype = ctypes.c_int
    return library


def _fill(library, shape, keep: float, dtype: torch.dtype) -> torch.Tensor:
    out = torch.empty(shape, dtype=dtype)
    state = torch.get_rng_state()
    if state.dtype != torch.uint8 or state.device.type != "cpu" or not state.is_contiguous():
        raise RuntimeError(f"torch's generator state is not the bytes this loop knows ({state.dtype}, {state.device})")
    if state.numel() < STATE_BYTES:  # the loop reads and writes STATE_BYTES of it: never past its end
        raise RuntimeError(f"torch's generator state is {state.numel()} bytes; this loop reads {STATE_BYTES}")
    if library.bernoulli_fill(state.data_ptr(), state.numel(), out.data_ptr(), out.numel(), float(keep), KINDS[dtype]):
        raise RuntimeError("torch's generator state is not the one this loop knows")
    torch.set_rng_state(state)
    return out


def _agrees(library, dtype: torch.dtype) -> bool:
    """Does the loop draw what torch's bernoulli_ draws for this dtype, and leave the generator where it does? The
    generator is left as it was found."""
    start = torch.get_rng_state()
    try:
        for length in CHECK_LENGTHS:
            for keep in CHECK_KEEP:
                before = torch.get_rng_state()
                theirs = torch.empty(length, dtype=dtype).bernoulli_(keep)
                after = torch.get_rng_state()
                torch.set_rng_state(before)
                mine = _fill(library, (length,), keep, dtype)
                if not (torch.equal(theirs, mine) and torch.equal(torch.get_rng_state(), after)):
                    return False
        return True
    finally:
        torch.set_rng_state(start)


def _child(path: str) -> int:
    """The check in a child process (`_check_in_child`): loads the library, prints the dtypes that agree."""
    library = _open(Path(path))
    print(json.dumps({"dtypes": [NAMES[dtype] for dtype in KINDS if _agrees(library, dtype)]}), flush=True)
    return 0


CHILD = "import sys; sys.path.insert(0, sys.argv[1]); from trainscope.workload.dropout_draws import _child; sys.exit(_child(sys.argv[2]))"


def _check_in_child(library: Path) -> dict:
    """The library loaded and checked in a child process, so an illegal instruction (a build for another CPU) or
    a crash ends the child, not this process: the verdict, as the marker keeps it."""
    verdict = {"verdict": "failed", "dtypes": [], "why": None, "returncode": None, "signal": None}
    verdict.update(library=library.name, sha256=_digest(library), torch=str(torch.__version__))
    root = str(ROOT)
    try:
        done = subprocess.run(
            [sys.executable, "-c", CHILD, root, str(library)],
            capture_output=True,
            text=True,
            timeout=CHECK_TIMEOUT_S,
            stdin=subprocess.DEVNULL,
            cwd=library.parent,  # where a crash's core file, if the system writes one, lands
        )
    except subprocess.TimeoutExpired:
        verdict["why"] = f"its check in a child process ran past {CHECK_TIMEOUT_S} s"
        return verdict
    verdict["returncode"] = done.returncode
    if done.returncode < 0:
        try:
            verdict["signal"] = signal.Signals(-done.returncode).name
        except ValueError:
            verdict["signal"] = f"signal {-done.returncode}"
        verdict.update(verdict="crashed", why=f"loading and checking it killed a child process ({verdict['signal']})")
    elif done.returncode:
        last = (done.stderr.strip().splitlines() or ["no message"])[-1]
        verdict["why"] = f"its check failed in a child process (exit {done.returncode}: {last})"
    else:
        try:
            said = json.loads((done.stdout.strip().splitlines() or ["null"])[-1])
            dtypes = [name for name in NAMES.values() if name in said["dtypes"]]
        except (ValueError, TypeError, KeyError):
            verdict["why"] = "its check in a child process said nothing readable"
            return verdict
        verdict.update(verdict="passed" if dtypes else "differs", dtypes=dtypes, why=None if dtypes else DIFFER)
    return verdict


def _digest(library: Path) -> str:
    return hashlib.sha256(library.read_bytes()).hexdigest()


def _read_marker(library: Path) -> dict | None:
    """The kept verdict, where it is whole, of these bytes, and was reached with this torch (another torch is
    checked again)."""
    try:
        kept = json.loads(_marker_path(library).read_text())
    except (OSError, ValueError):
        return None
    if not (
        isinstance(kept, dict)
        and kept.get("verdict") in VERDICTS
        and isinstance(kept.get("dtypes"), list)
        and isinstance(kept.get("why"), (str, type(None)))
        and kept.get("torch") == str(torch.__version__)
        and kept.get("sha256") == _digest(library)
    ):
        return None
    return kept


def _verdict(library: Path) -> dict:
    """The library's check: kept in its marker, else run in a child process and kept (written under a temporary
    name, then renamed). A marker that cannot be written leaves the verdict to this process."""
    marker = _marker_path(library)
    kept = _read_marker(library)
    if kept is not None:
        return kept
    verdict = _check_in_child(library)
    try:
        write_json_atomic(marker, verdict)
    except OSError:
        pass
    return verdict


def _load() -> dict:
    if not _loaded:
        library, marker, verdict = None, None, None
        try:
            path = _build()
            marker = _marker_path(path)
            kept = _verdict(path)
            verdict = kept["verdict"]
            if verdict == "passed":
                library = _open(path)  # the check in this process too: milliseconds
                dtypes = [dtype for dtype in KINDS if NAMES[dtype] in kept["dtypes"] and _agrees(library, dtype)]
                why = None if dtypes else DIFFER
            else:
                dtypes, why = [], f"{kept['why'] or DIFFER} (kept in {marker}: delete it to check again)"
        except (OSError, RuntimeError, subprocess.SubprocessError) as error:
            library, dtypes, why = None, [], str(error)
        _loaded.update(lib=library, dtypes=dtypes, why=why, verdict=verdict, marker=marker and str(marker))
    return _loaded


def drawn_here(dtype: torch.dtype, device: torch.device) -> bool:
    """Would `bernoulli` draw this mask with the checked loop (else with torch's bernoulli_)?"""
    if device.type != "cpu" or dtype not in KINDS or torch.compiler.is_compiling():
        return False
    return dtype in _load()["dtypes"]


def bernoulli(shape, keep: float, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """`torch.empty(shape, dtype=dtype, device=device).bernoulli_(keep)`: the same values and generator state."""
    if drawn_here(dtype, device):
        return _fill(_loaded["lib"], shape, keep, dtype)
    return torch.empty(shape, dtype=dtype, device=device).bernoulli_(keep)


def status(device: torch.device) -> str:
    """What the record says of how the masks are drawn."""
    if device.type != "cpu":
        return f"torch's dropout on {device.type}"
    loaded = _load()
    if not loaded["dtypes"]:
        return f"torch's bernoulli_ (the faster loop not used: {loaded['why']})"
    names = ", ".join(str(dtype).removeprefix("torch.") for dtype in loaded["dtypes"])
    return f"mt19937_bernoulli.c, checked against torch's bernoulli_ ({names})"
