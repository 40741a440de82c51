"""Dropout masks drawn as torch draws them on a CPU, bit for bit and faster: the padding-free layers' masks (--unpad).

A padding-free layer must draw the padded model's dropout masks -- the padded shape, the same random numbers -- or
its run is not the same run. On a CPU torch draws a mask with `empty(shape).bernoulli_(1 - p)`: outside MKL's path
(taken only on Intel's CPUs), a serial loop over a 32-bit mt19937 at 6-10 ns an element (machines A and B), which
made dropout 15% of a padding-free step on machine A and 28% of a padding-free bf16 step on machine B.
`native/mt19937_bernoulli.c` is that loop, vectorizable: the same generator, the same two draws an element, the
same comparison (on integers), reading and writing back torch's generator state (`torch.get_rng_state()`).

It is used only where it is checked: on first use in a process it is compiled (the C compiler, `-O3
-march=native`, or without `-march` where the compiler refuses it, into the trainscope cache, keyed by the source,
the compiler and this CPU) and checked against torch's own `bernoulli_` -- masks of several lengths, each dtype,
with the generator state after each -- and a dtype whose masks or state differ (MKL's path, another torch) keeps
torch's draw. Without a compiler, on other devices, or while torch.compile traces, torch draws. `status()` says
which happened (the record's `model.unpad.dropout_draws`).
"""

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

SOURCE = Path(__file__).parent / "native" / "mt19937_bernoulli.c"
KINDS = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
# the lengths the check draws: under one state block, across a twist with an element split over it, several blocks
CHECK_LENGTHS = (3, 311, 625, 7 * 1249)
CHECK_KEEP = (0.9, 0.5, 1 / 3)

_loaded: dict = {}  # "lib", "dtypes" (checked ones), "why" (when none), once per process


def _cpu_signature() -> str:
    """What -march=native compiles for: the CPU's model and flags (a cache shared by other machines must not hand
    this one code built for another)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        wanted = [line for line in lines if line.startswith(("model name", "flags"))][:2]
        return "\n".join(wanted) or platform.processor()
    except OSError:
        return platform.processor() or platform.machine()


def _library_path(compiler: str) -> Path:
    from trainscope.peak import cache_dir

    digest = hashlib.sha256()
    for part in (SOURCE.read_bytes(), compiler.encode(), _cpu_signature().encode(), platform.machine().encode()):
        digest.update(part)
    return cache_dir() / "native" / f"mt19937_bernoulli-{digest.hexdigest()[:16]}.so"


def _build() -> ctypes.CDLL:
    """The compiled loop, from the cache or built now (written under a temporary name, then renamed: processes
    building it at once each leave a whole file). Raises RuntimeError saying why not."""
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not compiler:
        raise RuntimeError("no C compiler (cc, gcc or $CC)")
    target = _library_path(compiler)
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        handle, partial = tempfile.mkstemp(suffix=".so", dir=target.parent)
        os.close(handle)
        try:
            for tuning in (["-march=native"], []):  # a compiler that knows no -march=native builds it portable
                done = subprocess.run(
                    [compiler, "-O3", *tuning, "-shared", "-fPIC", "-o", partial, str(SOURCE)],
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
    library = ctypes.CDLL(str(target))
    library.bernoulli_fill.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_double, ctypes.c_int]
    library.bernoulli_fill.restype = ctypes.c_int
    return library


def _fill(library, shape, keep: float, dtype: torch.dtype) -> torch.Tensor:
    out = torch.empty(shape, dtype=dtype)
    state = torch.get_rng_state()
    if library.bernoulli_fill(state.data_ptr(), out.data_ptr(), out.numel(), float(keep), KINDS[dtype]):
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


def _load() -> dict:
    if not _loaded:
        try:
            library = _build()
            dtypes = [dtype for dtype in KINDS if _agrees(library, dtype)]
            why = None if dtypes else "its masks differ from torch's bernoulli_ here (MKL's path?)"
        except (OSError, RuntimeError, subprocess.SubprocessError) as error:
            library, dtypes, why = None, [], str(error)
        _loaded.update(lib=library, dtypes=dtypes, why=why)
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
