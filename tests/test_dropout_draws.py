"""The faster dropout draw (trainscope.dropout_draws): its masks and generator state against an independent
mt19937 (numpy's, started from torch's state) drawn as torch's default CPU bernoulli_ draws; on a machine whose
torch takes that path, against torch's own bernoulli_; and torch's draw wherever the loop is not checked."""

import shutil

import numpy as np
import pytest
import torch

from trainscope import dropout_draws

N = 624


@pytest.fixture
def fresh(monkeypatch, tmp_path):
    """A process that has not loaded the loop yet, with its own cache."""
    monkeypatch.setenv("TRAINSCOPE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(dropout_draws, "_loaded", {})
    return tmp_path


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
    library = dropout_draws._build()
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


def test_a_loop_that_disagrees_or_cannot_be_built_leaves_the_draw_to_torch(fresh, monkeypatch):
    monkeypatch.setattr(dropout_draws, "_agrees", lambda library, dtype: False)
    assert not dropout_draws.drawn_here(torch.float32, torch.device("cpu"))
    assert "differ from torch's bernoulli_" in dropout_draws.status(torch.device("cpu"))
    torch.manual_seed(1)
    theirs = torch.empty(100).bernoulli_(0.7)
    torch.manual_seed(1)
    assert torch.equal(dropout_draws.bernoulli((100,), 0.7, torch.float32, torch.device("cpu")), theirs)

    built = sorted((fresh / "cache").rglob("*"))
    monkeypatch.setattr(dropout_draws, "_loaded", {})
    monkeypatch.setenv("CC", str(fresh / "no-such-compiler"))
    assert not dropout_draws.drawn_here(torch.float32, torch.device("cpu"))
    assert dropout_draws.status(torch.device("cpu")).startswith("torch's bernoulli_ (the faster loop not used:")
    assert sorted((fresh / "cache").rglob("*")) == built  # nothing half-built left behind


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
    library = dropout_draws._build()
    torch.manual_seed(2)
    generator = numpy_generator()
    assert np.array_equal(
        dropout_draws._fill(library, (999,), 0.9, torch.float32).numpy().astype(bool),
        expected_mask(generator, 999, 0.9),
    )
