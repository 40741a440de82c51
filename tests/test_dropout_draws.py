"""The faster dropout draw (trainscope.workload.dropout_draws): its masks and generator state against an independent
mt19937 (numpy's, started from torch's state) drawn as torch's default CPU bernoulli_ draws; on a machine whose
torch takes that path, against torch's own bernoulli_; torch's draw wherever the loop is not checked; a build
checked in a child process (one that kills it leaves this process alive, once), its verdict kept; the cache key;
the generator state's size."""

import json
import platform
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from trainscope.workload import dropout_draws

N = 624


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> Path:
    """This module's cache: the loop is built and checked once for its tests (a build and its check in a child
    process take seconds)."""
    return tmp_path_factory.mktemp("cache")


@pytest.fixture
def fresh(monkeypatch, tmp_path, cache):
    """A process that has not loaded the loop yet, with this module's cache."""
    monkeypatch.setenv("TRAINSCOPE_CACHE_DIR", str(cache))
    monkeypatch.setattr(dropout_draws, "_loaded", {})
    return tmp_path


def counted(monkeypatch, name: str) -> list:
    """Calls of dropout_draws.<name>, counted."""
    calls, real = [], getattr(dropout_draws, name)
    monkeypatch.setattr(dropout_draws, name, lambda *args: calls.append(args) or real(*args))
    return calls


def torch_state() -> tuple[np.ndarray, int, int]:
    raw = torch.get_rng_state().numpy()
    left = int(raw[8:12].view(np.int32)[0])
    position = int(raw[16:24].view(np.uint64)[0])
    key = raw[24 : 24 + 8 * N].view(np.uint64).astype(np.uint32)
    return key, left, position


def numpy_generator() -> np.random.MT19937:
    """numpy's MT19937 where torch's generator stands: torch twists when `left` would reach 0, numpy at pos 624."""
    key, left, position = torch_state()
    generator = np.random.MT19937()
    generator.state = {"bit_generator": "MT19937", "state": {"key": key, "pos": N if left == 1 else position}}
    return generator


def expected_mask(generator: np.random.MT19937, n: int, keep: float) -> np.ndarray:
    """torch's default CPU bernoulli_: two 32-bit draws an element, the first the high half, kept when the low 53
    bits times 2^-53 are below keep (in double)."""
    words = generator.random_raw(2 * n).astype(np.uint64)
    bits = ((words[0::2] << np.uint64(32)) | words[1::2]) & np.uint64((1 << 53) - 1)
    return bits.astype(np.float64) * 2.0**-53 < keep


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_the_loop_draws_torchs_default_masks_and_leaves_the_generator_where_torch_would(fresh, dtype):
    library = dropout_draws._open(dropout_draws._build())
    torch.manual_seed(3)  # a seeded generator: twisted on its first draw
    for n in (1, 2, 311, 623, 624, 625, 1249, 5000):
        for keep in (0.9, 0.5, 1 / 3, 0.0, 1.0):
            generator = numpy_generator()
            want = expected_mask(generator, n, keep)
            got = dropout_draws._fill(library, (n,), keep, dtype)
            assert got.dtype == dtype and set(got.unique().tolist()) <= {0.0, 1.0}
            assert np.array_equal(got.float().numpy().astype(bool), want), (n, keep)
            key, left, position = torch_state()
            state = generator.state["state"]
            assert np.array_equal(key, state["key"]) and position == state["pos"], (n, keep)
            assert left + position == N + 1  # torch's count of the words left before its next twist


def test_where_torch_draws_on_that_path_the_loop_is_used_and_draws_its_masks(fresh):
    loaded = dropout_draws._load()
    if not loaded["dtypes"]:  # an Intel CPU with MKL: torch draws another way, and so does every run here
        assert "differ from torch's bernoulli_" in dropout_draws.status(torch.device("cpu"))
        pytest.skip("torch's bernoulli_ takes MKL's path on this CPU")
    assert list(dropout_draws.KINDS)[0] in loaded["dtypes"]
    torch.manual_seed(11)
    for shape in [(4, 12, 37, 37), (3, 50, 384)]:
        start = torch.get_rng_state()
        theirs, after = torch.empty(shape).bernoulli_(0.9), torch.get_rng_state()
        torch.set_rng_state(start)
        assert torch.equal(dropout_draws.bernoulli(shape, 0.9, torch.float32, torch.device("cpu")), theirs)
        assert torch.equal(torch.get_rng_state(), after)
    assert dropout_draws.status(torch.device("cpu")).startswith("mt19937_bernoulli.c, checked")


def test_a_loop_that_disagrees_or_cannot_be_built_leaves_the_draw_to_torch(fresh, cache, monkeypatch):
    monkeypatch.setattr(dropout_draws, "_agrees", lambda library, dtype: False)
    assert not dropout_draws.drawn_here(torch.float32, torch.device("cpu"))
    assert "differ from torch's bernoulli_" in dropout_draws.status(torch.device("cpu"))
    torch.manual_seed(1)
    theirs = torch.empty(100).bernoulli_(0.7)
    torch.manual_seed(1)
    assert torch.equal(dropout_draws.bernoulli((100,), 0.7, torch.float32, torch.device("cpu")), theirs)

    built = sorted(cache.rglob("*"))
    monkeypatch.setattr(dropout_draws, "_loaded", {})
    monkeypatch.setenv("CC", str(fresh / "no-such-compiler"))
    assert not dropout_draws.drawn_here(torch.float32, torch.device("cpu"))
    assert dropout_draws.status(torch.device("cpu")).startswith("torch's bernoulli_ (the faster loop not used:")
    assert sorted(cache.rglob("*")) == built  # nothing half-built left behind


def test_a_compiler_that_refuses_march_native_builds_the_loop_portable(fresh, monkeypatch):
    gcc = shutil.which("gcc") or shutil.which("cc")
    if gcc is None:
        pytest.skip("no C compiler here")
    picky = fresh / "picky-cc"
    picky.write_text(
        f'#!/bin/sh\ncase "$*" in *-march=native*) echo "unsupported: -march=native" >&2; exit 1;; esac\nexec {gcc} "$@"\n'
    )
    picky.chmod(0o755)
    monkeypatch.setenv("CC", str(picky))
    library = dropout_draws._open(dropout_draws._build())
    torch.manual_seed(2)
    generator = numpy_generator()
    assert np.array_equal(
        dropout_draws._fill(library, (999,), 0.9, torch.float32).numpy().astype(bool),
        expected_mask(generator, 999, 0.9),
    )


def test_a_passing_build_keeps_its_verdict_and_a_later_process_loads_it_without_a_child(fresh, monkeypatch):
    loaded = dropout_draws._load()
    if loaded["verdict"] is None:
        pytest.skip(f"the loop is not built here: {loaded['why']}")
    kept = json.loads(Path(loaded["marker"]).read_text())
    assert Path(loaded["marker"]).parent == Path(loaded["lib"]._name).parent  # next to the library
    assert kept["library"] == Path(loaded["lib"]._name).name and kept["torch"] == str(torch.__version__)
    assert kept["verdict"] == "passed" and kept["returncode"] == 0 and kept["signal"] is None
    assert kept["dtypes"] == [dropout_draws.NAMES[dtype] for dtype in loaded["dtypes"]]

    monkeypatch.setattr(dropout_draws, "_loaded", {})
    checks = counted(monkeypatch, "_check_in_child")
    assert dropout_draws._load()["dtypes"] == loaded["dtypes"] and not checks


TRAPS = "#include <signal.h>\n#include <stddef.h>\n#include <stdint.h>\n"
FILL = "int bernoulli_fill(uint8_t *r, size_t b, void *o, size_t n, double p, int k)"
PLANTED = {
    # an illegal instruction, as a build for another CPU would meet one (raise: the same signal on any CPU)
    "crashed": TRAPS + FILL + " { raise(SIGILL); return 0; }",
    # a state it does not know: _fill raises, the child exits 1
    "failed": TRAPS + FILL + " { return -1; }",
}


@pytest.mark.parametrize("verdict", list(PLANTED))
def test_a_build_that_kills_or_fails_its_check_leaves_this_process_alive_drawing_with_torch_once(
    fresh, monkeypatch, verdict
):
    if not (shutil.which("cc") or shutil.which("gcc")):
        pytest.skip("no C compiler here")
    planted = fresh / f"{verdict}.c"
    planted.write_text(PLANTED[verdict])
    monkeypatch.setattr(dropout_draws, "SOURCE", planted)
    checks, opened = counted(monkeypatch, "_check_in_child"), counted(monkeypatch, "_open")

    loaded = dropout_draws._load()  # the check, in a child: this process lives
    assert len(checks) == 1 and not opened  # never loaded here
    assert loaded["verdict"] == verdict and loaded["lib"] is None and loaded["dtypes"] == []
    said = {"crashed": "killed a child process (SIGILL)", "failed": "failed in a child process (exit 1"}[verdict]
    assert said in dropout_draws.status(torch.device("cpu")) and loaded["marker"] in loaded["why"]
    kept = json.loads(Path(loaded["marker"]).read_text())
    assert kept["verdict"] == verdict and kept["dtypes"] == [] and said in kept["why"]
    assert (kept["signal"], kept["returncode"]) == ({"crashed": ("SIGILL", -4), "failed": (None, 1)}[verdict])
    assert not list(Path(loaded["marker"]).parent.glob("tmp*"))  # the marker written whole, by a rename
    torch.manual_seed(1)
    theirs = torch.empty(100).bernoulli_(0.7)
    torch.manual_seed(1)
    assert torch.equal(dropout_draws.bernoulli((100,), 0.7, torch.float32, torch.device("cpu")), theirs)

    monkeypatch.setattr(dropout_draws, "_loaded", {})  # a later run: the marker's verdict, no child
    assert dropout_draws._load()["why"] == loaded["why"] and len(checks) == 1 and not opened
    if verdict == "crashed":  # another torch checks it again, once
        monkeypatch.setattr(torch, "__version__", "0.0.0+another")
        monkeypatch.setattr(dropout_draws, "_loaded", {})
        assert dropout_draws._load()["verdict"] == "crashed" and len(checks) == 2 and not opened
        monkeypatch.setattr(dropout_draws, "_loaded", {})
        assert dropout_draws._load()["verdict"] == "crashed" and len(checks) == 2


def test_the_cache_key_is_what_the_compiler_targets_its_version_and_flags(fresh, monkeypatch):
    answers = {
        "--version": "cc (Debian 12.2.0-14) 12.2.0\nCopyright (C) 2022",
        "--help=target": "  -march=  \t\tznver3\n  -mavx512bf16  \t\t[enabled]\n",
        "-###": None,
    }
    monkeypatch.setattr(dropout_draws, "_ask", lambda command: next(a for w, a in answers.items() if w in command))
    keys = [dropout_draws._library_path("cc")]

    def changed(key_part: str, answer) -> None:
        answers[key_part] = answer
        keys.append(dropout_draws._library_path("cc"))
        assert keys[-1] not in keys[:-1], key_part

    assert dropout_draws._library_path("cc") == keys[0]  # the same compiler and target: one build, shared
    changed("--help=target", "  -march=  \t\tznver3\n  -mavx512bf16  \t\t[disabled]\n")  # another CPU, one flag
    changed("--help=target", "  -march=  \t\tznver4\n  -mavx512bf16  \t\t[disabled]\n")
    changed("--version", "cc (Debian 12.3.0-1) 12.3.0\nCopyright (C) 2023")
    monkeypatch.setattr(dropout_draws, "FLAGS", ("-O2", "-shared", "-fPIC"))
    keys.append(dropout_draws._library_path("cc"))
    assert keys[-1] not in keys[:-1]

    # a compiler without gcc's list (clang): the target options its -### line passes on, not its temporary files
    line = ' "/usr/bin/clang-17" "-cc1" "-triple" "aarch64-unknown-linux-gnu" "-target-cpu" "{}" "-o" "/tmp/{}.o"\n'
    answers["-###"] = "clang version 17\n" + line.format("neoverse-v1", "null-3f2a1b")
    assert dropout_draws._library_path("cc") == keys[-1]  # gcc's list, where it answers
    changed("--help=target", None)
    answers["-###"] = "clang version 17\n" + line.format("neoverse-v1", "null-9c0d7e")
    assert dropout_draws._library_path("cc") == keys[-1]
    changed("-###", "clang version 17\n" + line.format("neoverse-n1", "null-9c0d7e"))

    # a compiler that says neither: the CPU's model and flags, and the architecture
    changed("-###", None)
    monkeypatch.setattr(dropout_draws, "_cpu_signature", lambda: "model name\t: another CPU")
    keys.append(dropout_draws._library_path("cc"))
    monkeypatch.setattr(platform, "machine", lambda: "riscv64")
    keys.append(dropout_draws._library_path("cc"))
    assert len(set(keys)) == len(keys)


def test_the_compilers_target_description_here_is_the_same_each_time(fresh):
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        pytest.skip("no C compiler here")
    passed = dropout_draws._passed_target(compiler)  # gcc's and clang's -### line, its temporary file names left out
    assert passed and passed == dropout_draws._passed_target(compiler)
    assert "-march=" in passed or "-target-cpu" in passed
    assert dropout_draws._library_path(compiler) == dropout_draws._library_path(compiler)


def test_a_generator_state_shorter_than_the_loop_reads_is_refused(fresh, monkeypatch):
    calls = []

    class Planted:  # the library, counting its calls (a short state must never reach the loop: it reads past it)
        @staticmethod
        def bernoulli_fill(*args):
            calls.append(args)
            return 0

    whole = torch.get_rng_state()
    assert dropout_draws.STATE_BYTES == 24 + 8 * N == 5016 <= whole.numel()
    monkeypatch.setattr(torch, "get_rng_state", lambda: whole.clone())
    dropout_draws._fill(Planted, (10,), 0.5, torch.float32)
    assert len(calls) == 1
    monkeypatch.setattr(torch, "get_rng_state", lambda: whole[: dropout_draws.STATE_BYTES - 1].clone())
    with pytest.raises(RuntimeError, match="5015 bytes; this loop reads 5016"):
        dropout_draws._fill(Planted, (10,), 0.5, torch.float32)
    assert len(calls) == 1

    # the loop itself refuses a short state, and leaves it as it was
    if not (shutil.which("cc") or shutil.which("gcc")):
        return
    library, out = dropout_draws._open(dropout_draws._build()), torch.zeros(10)
    short = whole[: dropout_draws.STATE_BYTES - 1].clone()
    assert library.bernoulli_fill(short.data_ptr(), short.numel(), out.data_ptr(), 10, 0.5, 0) == -1
    assert torch.equal(short, whole[: dropout_draws.STATE_BYTES - 1]) and not out.any()
