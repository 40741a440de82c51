"""The measured matmul peak (trainscope.measure.peak): cached per machine key, cheap, and harmless to the run it serves."""

import json

import pytest
import torch

from trainscope.core import paths
from trainscope.measure import peak

CPU = torch.device("cpu")
TINY_SHAPES = [(64, 32, 32), (64, 64, 32)]


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv(paths.CACHE_ENV, str(tmp_path / "cache"))
    monkeypatch.setenv(peak.SQUARE_ENV, "96")
    return tmp_path / "cache"


def test_a_rate_is_measured_once_then_read_from_the_cache(cache, monkeypatch):
    first = peak.rate(CPU, "fp32", (64, 48, 32), threads=1, processes=1)
    assert first.tflops > 0 and first.low <= first.tflops <= first.high and first.calls >= peak.MIN_CALLS
    assert first.shape == (64, 48, 32) and first.skipped is None
    files = list((cache / "peak").glob("*.json"))
    assert len(files) == 1 and json.loads(files[0].read_text())["key"]["threads"] == 1

    def no_measuring(*args, **kwargs):
        raise AssertionError("measured again although cached")

    monkeypatch.setattr(peak, "measure", no_measuring)
    assert peak.rate(CPU, "fp32", (64, 48, 32), threads=1, processes=1) == first


def test_the_key_tells_threads_and_processes_apart(cache):
    one, two = peak.machine_key(CPU, threads=1, processes=1), peak.machine_key(CPU, threads=2, processes=1)
    shared = peak.machine_key(CPU, threads=1, processes=2)
    assert len({peak.key_id(one), peak.key_id(two), peak.key_id(shared)}) == 3
    assert one["name"] and one["flags"] and one["torch"] == torch.__version__


def test_measuring_leaves_threads_and_the_random_state_as_they_were(cache):
    threads, state = torch.get_num_threads(), torch.get_rng_state()
    peak.rates(CPU, "bf16", TINY_SHAPES, threads=1 if threads != 1 else 2, processes=1)
    assert torch.get_num_threads() == threads and torch.equal(torch.get_rng_state(), state)


def test_the_machine_peak_block_has_every_precision_and_the_square(cache):
    block = peak.machine_peak(CPU, TINY_SHAPES, threads=1, processes=1)
    assert set(block["precisions"]) >= {"fp32", "bf16"} and not block["from_cache"]
    fp32 = peak.peak_of(block, "fp32")
    assert [r["shape"] for r in fp32["rates"]] == [[64, 32, 32], [64, 64, 32], [96, 96, 96]]
    assert fp32["peak_tflops"] == max(r["tflops"] for r in fp32["rates"]) and fp32["measured"]
    assert peak.machine_peak(CPU, TINY_SHAPES, threads=1, processes=1)["from_cache"]
    assert peak.peak_of(block, "fp16" if "fp16" not in block["precisions"] else "tf32") is None


def test_peers_that_miss_make_everybody_measure_at_once(cache, monkeypatch):
    peak.machine_peak(CPU, TINY_SHAPES, threads=1, processes=2)  # cached now
    asked = []
    block = peak.machine_peak(
        CPU, TINY_SHAPES, threads=1, processes=2, together=lambda missing: asked.append(missing) or True
    )
    assert asked == [False] and not block["from_cache"]  # a peer missed: measured again, beside it


def test_a_slow_emulated_path_is_timed_once_and_larger_shapes_are_skipped(cache, monkeypatch):
    """Planted call times: the probe runs at 1 GFLOP/s, 768^3 at 0.4 GFLOP/s (estimated 0.9 s a call, it takes
    2.3 s: its warm-up call is its one measurement), and 2048^3 (estimated 17.2 s a call) is not run at all."""
    seconds = []

    def planted(device, product):
        a, b = product.args
        flops = 2 * a.shape[0] * a.shape[1] * b.shape[1]
        seconds.append(flops / (1e9 if a.shape[0] == peak.PROBE_SIDE else 0.4e9))
        return seconds[-1]

    monkeypatch.setattr(peak, "call_seconds", planted)
    monkeypatch.setattr(peak, "_operands", lambda device, p, s: (torch.empty(s[0], s[2]), torch.empty(s[2], s[1])))
    found = peak.rates(CPU, "bf16", [(2048, 2048, 2048), (768, 768, 768)], threads=1, processes=1)
    small, large = found[(768, 768, 768)], found[(2048, 2048, 2048)]
    assert small.calls == 1 and small.tflops == pytest.approx(0.4e-3) and small.skipped is None
    assert large.calls == 0 and "17.2 s per call" in large.skipped and large.tflops == pytest.approx(1e-3)
    probe_call = 2 * peak.PROBE_SIDE**3 / 1e9  # timed calls follow the warm-up until the budget is spent
    probe_calls = max(peak.MIN_CALLS, min(peak.MAX_CALLS, -(-peak.SHAPE_BUDGET_S // probe_call) - 1))
    assert len(seconds) == 1 + probe_calls + 1


def test_the_cache_folder_follows_the_environment(tmp_path):
    assert paths.cache_dir({paths.CACHE_ENV: str(tmp_path)}) == tmp_path
    assert paths.cache_dir({"XDG_CACHE_HOME": str(tmp_path)}) == tmp_path / "trainscope"
    assert paths.cache_dir({}).parts[-2:] == (".cache", "trainscope")


def test_a_rate_measured_while_other_processes_took_a_core_is_not_cached(cache, monkeypatch):
    """A matmul measured while another process kept a core busy reads slow (at 13:00 on this machine, with test
    suites running beside it, 0.001 TFLOP/s at MiniLM's shapes where a quiet measurement gives 0.1): cached, it made
    every later prediction on the machine 70x too slow. Above a quarter of a core of other processes' work it is
    kept for this run only, with the load it was measured under, and measured again next time."""
    monkeypatch.delenv(peak.BUSY_ENV, raising=False)
    monkeypatch.setattr(peak, "other_cores", lambda before, after: 1.0)
    busy = peak.rate(CPU, "fp32", (64, 48, 32), threads=1, processes=1)
    assert busy.others_cores == 1.0 and not list((cache / "peak").glob("*.json"))
    monkeypatch.setattr(peak, "other_cores", lambda before, after: 0.1)
    quiet = peak.rate(CPU, "fp32", (64, 48, 32), threads=1, processes=1)
    (stored,) = (cache / "peak").glob("*.json")
    assert quiet.others_cores == 0.1 and json.loads(stored.read_text())["rates"]["fp32 64x48x32"]["others_cores"] == 0.1


def test_other_processes_cores_are_the_machines_cpu_time_less_this_processs():
    assert peak.other_cores((100.0, 10.0, 0.0), (103.0, 11.0, 2.0)) == 1.0  # 3 s busy, 1 s ours, over 2 s
    assert peak.other_cores((100.0, 10.0, 0.0), (101.0, 11.5, 2.0)) == 0.0  # never negative
    assert peak.other_cores(None, (1.0, 1.0, 1.0)) is None
    reading = peak.cpu_seconds()
    assert reading is None or (reading[0] > 0 and reading[1] >= 0)


def test_a_launchs_peers_measuring_at_once_do_not_keep_its_rates_out_of_the_cache(cache, monkeypatch):
    """Every process of a launch measures the peak at once (machine_peak's `together`): the writer saw its peer's
    core busy and never cached the peak of a multi-process launch (each DDP check on the H200 measured it again).
    Its peers' threads are allowed for, as the operator timings allow for them; more than that is still busy."""
    monkeypatch.delenv(peak.BUSY_ENV, raising=False)
    monkeypatch.setattr(peak, "other_cores", lambda before, after: 1.1)  # one peer of one thread, and a little more
    peak.rate(CPU, "fp32", (64, 48, 32), threads=1, processes=2)
    (stored,) = (cache / "peak").glob("*.json")
    assert json.loads(stored.read_text())["key"]["processes"] == 2
    monkeypatch.setattr(peak, "other_cores", lambda before, after: 1.5)  # beyond the peer's thread by a half core
    peak.rate(CPU, "fp32", (64, 48, 48), threads=1, processes=2)
    assert "fp32 64x48x48" not in json.loads(stored.read_text())["rates"]
