import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from trainscope.measure.timing import (
    ALL_STAGES,
    CATEGORIES,
    EventClock,
    HostClock,
    Nvtx,
    StageTimer,
    make_clock,
    stage_table,
)
from trainscope.workload.step import load_metric

# sleep() never undershoots; on a loaded 2-core machine it can overshoot by tens of milliseconds, so
# delays are long and the upper bound is relative.
DELAY_S = 0.25


def test_a_delay_in_a_stage_is_charged_to_that_stage_and_nothing_else():
    timer = StageTimer()
    timer.start()
    with timer("forward"):
        time.sleep(DELAY_S)
    with timer("data"):
        pass
    timer.stop()
    seconds = timer.summary()["run"]["seconds"]
    assert DELAY_S <= seconds["forward"] < 1.5 * DELAY_S
    assert seconds["data"] < 0.1 * DELAY_S and seconds["other"] < 0.1 * DELAY_S


def test_time_outside_stages_is_other():
    timer = StageTimer()
    timer.start()
    with timer("data"):
        time.sleep(DELAY_S / 5)
    time.sleep(DELAY_S)  # in no stage
    timer.stop()
    seconds = timer.summary()["run"]["seconds"]
    assert DELAY_S <= seconds["other"] < 1.5 * DELAY_S
    assert seconds["data"] < DELAY_S


def test_warmup_steps_are_recorded_apart_from_the_steady_state():
    timer = StageTimer()
    timer.start()
    with timer("forward"):
        time.sleep(DELAY_S)
    timer.set_phase("steady")
    for _ in range(2):
        with timer("forward"):
            time.sleep(DELAY_S / 5)
    timer.stop()
    summary = timer.summary()
    assert DELAY_S <= summary["warmup"]["seconds"]["forward"] < 1.5 * DELAY_S
    assert 2 * DELAY_S / 5 <= summary["steady"]["seconds"]["forward"] < DELAY_S
    assert timer.stage_calls["steady"]["forward"] == 2 and timer.stage_calls["warmup"]["forward"] == 1


def test_a_step_line_interval_takes_stages_and_wall_from_one_clock():
    timer = StageTimer()
    timer.start()
    with timer("forward"):
        time.sleep(DELAY_S / 5)
    time.sleep(DELAY_S / 5)
    first = timer.take_interval()
    with timer("backward"):
        time.sleep(DELAY_S / 5)
    second = timer.take_interval()
    timer.stop()
    assert first["stage_s"]["forward"] >= DELAY_S / 5 and first["stage_s"]["backward"] == 0
    assert first["wall_s"] >= first["stage_s"]["forward"] + DELAY_S / 5
    assert second["stage_s"]["forward"] == 0 and second["wall_s"] >= second["stage_s"]["backward"]
    assert second["wall_s"] < first["wall_s"]  # the interval restarted, it did not accumulate


@pytest.mark.parametrize("misuse", ["nested", "unknown", "other", "not_started", "summary_early", "double_start"])
def test_misuse_raises(misuse):
    timer = StageTimer()
    if misuse == "not_started":
        with pytest.raises(RuntimeError, match="outside start"):
            with timer("forward"):
                pass
        return
    if misuse == "summary_early":
        timer.start()
        with pytest.raises(RuntimeError, match="before stop"):
            timer.summary()
        return
    timer.start()
    if misuse == "double_start":
        with pytest.raises(RuntimeError, match="already started"):
            timer.start()
    elif misuse == "nested":
        with pytest.raises(RuntimeError, match="do not nest"):
            with timer("forward"):
                with timer("backward"):
                    pass
    else:
        with pytest.raises(ValueError, match="unknown stage"):
            with timer("loss" if misuse == "unknown" else "other"):
                pass


class FakeEvent:
    """A device event whose completion the test controls, like a CUDA event still in the queue."""

    def __init__(self, at):
        self.at = at
        self.done = False


class FakeEventClock:
    """Device time advances only when the test says; events complete only when released."""

    def __init__(self):
        self.device_now = 0.0
        self.events = []
        self.waited = 0

    def mark(self):
        event = FakeEvent(self.device_now)
        self.events.append(event)
        return event

    @staticmethod
    def elapsed(start, end):
        return end.at - start.at

    @staticmethod
    def ready(event):
        return event.done

    def wait(self, event):
        self.waited += 1
        for e in self.events:
            e.done = True


def test_event_mode_defers_reading_until_events_complete_and_charges_device_time():
    clock = FakeEventClock()
    timer = StageTimer(clock)
    timer.start()
    with timer("forward"):
        clock.device_now += 5.0  # the device spends 5 s although the host returns at once
    with timer("backward"):
        clock.device_now += 7.0
    # Nothing completed yet: nothing is read, and nothing waited (the loop was not stalled).
    assert timer.stage_calls["warmup"]["forward"] == 0
    assert clock.waited == 0
    clock.events[0].done = clock.events[1].done = True  # forward's events complete
    with timer("optimizer"):
        clock.device_now += 1.0
    assert timer.stage_seconds["warmup"]["forward"] == 5.0  # polled without blocking
    assert timer.stage_calls["warmup"]["backward"] == 0
    interval = timer.take_interval()  # a log step: flushes, waiting for the device
    assert clock.waited == 1
    assert interval["stage_s"] == {"data": 0.0, "forward": 5.0, "backward": 7.0, "optimizer": 1.0, "eval": 0.0}
    assert timer.take_interval()["stage_s"]["forward"] == 0.0


class PlantedEvent:
    """Stands in for torch.Event, which this CPU build cannot record (its CPU backend has no events).
    record() stamps the device time the test planted; the event completes when the test says or when
    waited on; elapsed_time() answers in milliseconds, as CUDA's does."""

    device_now_s = 0.0
    made = []

    def __init__(self, device=None, *, enable_timing=False):
        self.device, self.enable_timing = device, enable_timing
        self.recorded_at_s, self.done = None, False
        PlantedEvent.made.append(self)

    def record(self, stream=None):
        self.recorded_at_s = PlantedEvent.device_now_s

    def query(self):
        return self.done

    def synchronize(self):
        self.done = True

    def elapsed_time(self, end):
        assert self.enable_timing and end.enable_timing, "CUDA refuses elapsed_time without enable_timing"
        return (end.recorded_at_s - self.recorded_at_s) * 1000.0


def test_events_mode_builds_timing_events_on_the_device_and_charges_stages_in_seconds(monkeypatch):
    """The events clock as train.py builds it for CUDA (make_clock, StageTimer), through EventClock's own
    code; only torch.Event and the device synchronize are stand-ins. That real CUDA events measure the
    kernels' time: not measured on GPU."""
    device = torch.device("cuda", 0)
    monkeypatch.setattr(PlantedEvent, "made", [])
    monkeypatch.setattr(PlantedEvent, "device_now_s", 0.0)
    monkeypatch.setattr(torch, "Event", PlantedEvent)
    synchronized = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: synchronized.append(device))
    clock, mode = make_clock("events", device)
    assert isinstance(clock, EventClock) and mode == "events"
    timer = StageTimer(clock, device, memory=False, nvtx=Nvtx(device, push=lambda name: None, pop=lambda: None))
    timer.start()
    with timer("forward"):
        PlantedEvent.device_now_s += 0.250  # the device spends 250 ms; the host returns at once
    with timer("backward"):
        PlantedEvent.device_now_s += 0.500
    assert timer.stage_calls["warmup"]["forward"] == 0  # the events have not completed: nothing read yet
    timer.stop()  # waits for the pending events
    seconds = timer.summary()["run"]["seconds"]
    assert seconds["forward"] == pytest.approx(0.250) and seconds["backward"] == pytest.approx(0.500)
    assert len(PlantedEvent.made) == 4  # one event per stage boundary
    assert all(event.device == device and event.enable_timing for event in PlantedEvent.made)
    assert synchronized == [device, device]  # the wall clock's start and stop, nothing per stage


class CountingProbe:
    """A device allocator stand-in: peaks the test sets, resets and reads counted."""

    def __init__(self):
        self.resets = self.reads = 0
        self.allocated = self.reserved = 0

    def reset(self):
        self.resets += 1
        self.allocated = self.reserved = 0

    def read(self):
        self.reads += 1
        return self.allocated, self.reserved


def test_per_stage_memory_costs_one_reset_and_one_read_and_only_on_sampled_steps():
    probe = CountingProbe()
    timer = StageTimer(memory=probe)
    timer.start()
    for stage, peak in (("data", 10), ("forward", 300), ("backward", 500), ("optimizer", 200)):
        with timer(stage):
            probe.allocated, probe.reserved = peak, peak * 2
    assert (probe.resets, probe.reads) == (4, 4)
    timer.set_memory_sampling(False)  # an unsampled step: no allocator calls at all
    with timer("forward"):
        probe.allocated, probe.reserved = 900, 1800  # a peak between samples
    assert (probe.resets, probe.reads) == (4, 4)
    timer.set_memory_sampling(True)  # one read folds the unsampled steps' peak into the run's
    assert (probe.resets, probe.reads) == (4, 5)
    timer.stop()
    assert timer.peak_allocated_bytes["backward"] == 500 and timer.peak_allocated_bytes["forward"] == 300
    assert timer.run_peak_allocated_bytes == 900 and timer.run_peak_reserved_bytes == 1800


def test_stages_are_nvtx_ranges_where_nvtx_is_given():
    pushed, popped = [], []
    timer = StageTimer(nvtx=Nvtx(torch.device("cpu"), push=pushed.append, pop=lambda: popped.append(1)))
    timer.start()
    with timer("data"):
        pass
    with pytest.raises(KeyError):
        with timer("forward"):
            raise KeyError("a failing stage still closes its range")
    timer.stop()
    assert pushed == ["data", "forward"] and len(popped) == 2
    quiet = Nvtx(torch.device("cpu"))  # elsewhere than CUDA: no-ops
    assert quiet.push("data") is None and quiet.pop() is None


def test_cpu_gets_the_host_clock_in_both_modes():
    for mode in ("sync", "events"):
        clock, effective = make_clock(mode, torch.device("cpu"))
        assert isinstance(clock, HostClock) and effective == "host"
    with pytest.raises(ValueError):
        make_clock("sometimes", torch.device("cpu"))


def test_sync_mode_synchronizes_at_every_boundary():
    calls = []
    timer = StageTimer(HostClock(synchronize=lambda: calls.append(1)))
    timer.start()
    with timer("forward"):
        pass
    assert len(calls) == 2  # entry and exit


def test_state_dict_and_restore_continue_the_totals():
    first = StageTimer()
    first.start()
    with first("forward"):
        time.sleep(DELAY_S / 5)
    first.set_phase("steady")
    with first("forward"):
        time.sleep(DELAY_S / 5)
    state = first.state_dict()
    second = StageTimer()
    second.restore(state)
    assert second.phase == "steady"
    second.start()
    with second("forward"):
        time.sleep(DELAY_S / 5)
    second.stop()
    assert second.stage_calls["steady"]["forward"] == 2
    assert 3 * DELAY_S / 5 <= second.summary()["run"]["seconds"]["forward"] < 1.5 * 3 * DELAY_S / 5


def test_the_five_categories_are_sums_of_stages():
    table = stage_table({"data": 1, "forward": 2, "backward": 3, "optimizer": 0.5, "eval": 1.5}, wall_seconds=10)
    assert table["category_seconds"] == pytest.approx(
        {"data loading": 1, "forward": 2, "loss+backward": 3, "evaluation": 1.5, "other": 2.5}
    )
    assert sorted(s for stages in CATEGORIES.values() for s in stages) == sorted(ALL_STAGES)


def test_a_paused_span_belongs_to_no_figure_and_keeps_its_memory_out_of_the_run_peak():
    class Probe:
        def __init__(self):
            self.current, self.peak = 0, 0

        def reset(self):
            self.peak = self.current

        def read(self):
            return self.peak, self.peak

    probe = Probe()
    timer = StageTimer(HostClock(), memory=probe)
    timer.start()
    with timer("forward"):
        probe.peak = 100
        time.sleep(0.05)
    with timer.paused():
        probe.peak = 1000  # the measurement's own buffers
        time.sleep(0.3)
    with pytest.raises(RuntimeError):
        with timer("backward"):
            with timer.paused():
                pass
    timer.stop()
    steady_and_warmup = timer.summary()["run"]
    assert steady_and_warmup["wall_s"] < 0.25 and timer.paused_seconds >= 0.3
    assert steady_and_warmup["seconds"]["other"] < 0.2  # the pause is not charged to `other`
    memory = timer.memory_summary()
    assert memory["max_allocated_gib"] * 1024**3 == 100 and memory["measurement_peak_allocated_gib"] * 1024**3 == 1000


class AllocatorProbe:
    """An allocator's peak counter: `allocate(level)` sets what is allocated, the peak follows it up, and reset()
    brings the peak down to what is allocated now (as torch.cuda.reset_peak_memory_stats does)."""

    def __init__(self):
        self.current = self.peak = 0

    def allocate(self, level: int) -> None:
        self.current = level
        self.peak = max(self.peak, level)

    def reset(self):
        self.peak = self.current

    def read(self):
        return self.peak, self.peak


@pytest.mark.parametrize("sampled", [False, True])
def test_a_paused_span_reads_its_own_peak_not_the_backward_before_it(sampled):
    """A backward peaking at 10 (then freed down to 2), a calibration pause peaking at 3: the pause reads 3,
    the run's peak stays 10, whether or not the step's stages were sampled (--memory-every)."""
    probe = AllocatorProbe()
    timer = StageTimer(HostClock(), memory=probe)
    timer.set_memory_sampling(sampled)
    timer.start()
    with timer("backward"):
        probe.allocate(10)
        probe.allocate(2)
    with timer.paused():
        probe.allocate(3)
        probe.allocate(2)
    with timer("optimizer"):
        probe.allocate(4)
    timer.stop()
    memory = timer.memory_summary()
    assert memory["measurement_peak_allocated_gib"] * 1024**3 == 3
    assert memory["max_allocated_gib"] * 1024**3 == 10


def test_a_second_process_evaluating_at_the_same_time_does_not_wait_for_the_first():
    """Two ranks (or two runs on one machine) evaluate at once: `evaluate`'s default cache file has one name for
    all of them, and the second waited a second on the first one's lock per split, charged to `eval`."""
    holder = subprocess.Popen(  # another process that has started its evaluation and holds on to it
        [
            sys.executable,
            "-c",
            "import time; from trainscope.workload.step import load_metric; m = load_metric(); "
            "m.add_batch(predictions=[0], references=[0]); print('holding', flush=True); time.sleep(30)",
        ],
        cwd=Path(__file__).parents[1],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "holding"
        metric = load_metric()
        started = time.perf_counter()
        metric.add_batch(predictions=[1, 2], references=[1, 0])
        waited = time.perf_counter() - started
        assert metric.compute()["accuracy"] == 0.5
    finally:
        holder.kill()
        holder.wait()
    assert waited < 0.5  # a lock wait is evaluate's one-second timeout; an in-memory batch takes milliseconds


# ---------------------------------------------------------------- the device's busy time and idle share


def planted_events(monkeypatch, gpu):
    """torch.Event and the CUDA synchronize on a planted device (conftest.PlantedGPU: a host clock, one stream), and
    the timer's host clock on its host clock: EventClock and StageTimer run their own code over it."""
    import trainscope.measure.timing as timing

    class Event:
        def __init__(self, device=None, *, enable_timing=False):
            self.at = None

        def record(self, stream=None):
            self.at = max(gpu.now, gpu.done)  # completes when the work queued before it has

        def query(self):
            return self.at <= gpu.now

        def synchronize(self):
            gpu.now = max(gpu.now, self.at)

        def elapsed_time(self, end):
            return (end.at - self.at) * 1e3

    monkeypatch.setattr(torch, "Event", Event)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: gpu.synchronize())
    monkeypatch.setattr(timing.time, "perf_counter", gpu.perf_counter)


def run_planted_steps(gpu, steps, data_wait_s, copy_s, kernels, bookkeeping_s=0.0):
    """A steady phase of `steps` training steps on the planted device: the data stage waits `data_wait_s` on the
    host for the loader, then launches the copy; each other stage launches its `kernels` {stage: [seconds]}; between
    steps the host spends `bookkeeping_s` outside the stages. Returns (per_rank, kernel seconds launched)."""
    device = torch.device("cuda", 0)
    clock, mode = make_clock("events", device)
    timer = StageTimer(clock, device, memory=False, nvtx=Nvtx(device, push=lambda name: None, pop=lambda: None))
    launched = 0.0
    timer.start()
    timer.set_phase("steady")
    for _ in range(steps):
        with timer("data"):
            gpu.now += data_wait_s
            gpu.launch(copy_s)
        launched += copy_s
        for stage in ("forward", "backward", "optimizer"):
            with timer(stage):
                for seconds in kernels[stage]:
                    gpu.launch(seconds)
                    launched += seconds
        gpu.now += bookkeeping_s
    timer.stop()
    counts = {"steady": {"optimizer_steps": steps, "micro_batches": steps}}
    return mode, [{"rank": 0, "timing": timer.summary(), "counts": counts}], launched


def test_the_device_busy_time_is_the_stages_event_spans_and_its_idle_share_a_lower_bound(monkeypatch):
    """Device-bound (5 ms kernels, 10 us launches): the queue never empties, each span is its kernels, and the idle
    share is the device's real one. Host-bound (2 us kernels, 10 us launches, the host 3 ms on the loader and 1 ms
    between steps): the spans hold the device's gaps, so the share is below the real idle (the bound is loose) --
    what the kernel estimate is for."""
    from conftest import PlantedGPU

    from trainscope.measure import summary

    gpu = PlantedGPU(kernel_s=0.0)
    planted_events(monkeypatch, gpu)
    heavy = {"forward": [5e-3] * 4, "backward": [5e-3] * 8, "optimizer": [1e-3]}
    mode, per_rank, launched = run_planted_steps(gpu, 20, data_wait_s=1e-3, copy_s=1e-4, kernels=heavy)
    block = summary.device_time(per_rank, "steady", mode)
    wall = per_rank[0]["timing"]["steady"]["wall_s"] / 20
    assert mode == "events" and block["reason"] is None and block["step_wall_s"] == pytest.approx(wall)
    busy = launched / 20
    assert block["busy_at_most_s"] == pytest.approx(busy, rel=1e-3)  # one launch's gap at the phase's start
    assert block["idle_share_at_least"] == pytest.approx(1 - busy / wall, abs=1e-3)
    assert block["idle_share_at_least"] < 0.05 and block["host_bound"] is None  # no estimate, and the bound says no

    gpu = PlantedGPU(kernel_s=0.0)
    planted_events(monkeypatch, gpu)
    light = {"forward": [2e-6] * 400, "backward": [2e-6] * 800, "optimizer": [2e-6] * 50}
    mode, per_rank, launched = run_planted_steps(
        gpu, 20, data_wait_s=3e-3, copy_s=2e-6, kernels=light, bookkeeping_s=1e-3
    )
    block = summary.device_time(per_rank, "steady", mode)
    spans = per_rank[0]["timing"]["steady"]["seconds"]
    wall = per_rank[0]["timing"]["steady"]["wall_s"]
    assert block["busy_at_most_s"] == pytest.approx(sum(spans[s] for s in summary.STEP_STAGES) / 20)
    real_idle = 1 - launched / wall
    assert real_idle > 0.8  # the device works 2.5 ms of each 16 ms step
    assert block["idle_share_at_least"] <= real_idle  # a lower bound...
    assert block["idle_share_at_least"] == pytest.approx(1e-3 * 20 / wall, rel=0.01)  # ...of the host's time outside
    assert block["host_bound"] is None  # 6% at least: not decided without the kernel estimate


def planted_rank(wall_s, seconds, steps=10, micro_batches=None, rank=0):
    return {
        "rank": rank,
        "timing": {"steady": {"wall_s": wall_s, "seconds": {"eval": 0.0, **seconds}}},
        "counts": {"steady": {"optimizer_steps": steps, "micro_batches": micro_batches or steps}},
    }


def device_time_record(block, device="cuda:0"):
    return {"environment": {"device": device}, "summary": {"device_time": block}}


@pytest.mark.parametrize(
    "busy_s,fires",
    [
        (1.0 + 0.009, False),  # above the wall by less than 1% of it: the clocks agree, the idle share is 0
        (1.0 + 0.02, True),  # 2% above: impossible, a warning and no idle share
    ],
)
def test_device_time_above_the_wall_beyond_the_tolerance_is_a_warning_never_a_clamp(busy_s, fires):
    from trainscope.core.record_view import RunView
    from trainscope.measure import health, summary
    from trainscope.run.table import device_time_lines

    stages = {"data": 0.1 * busy_s, "forward": 0.3 * busy_s, "backward": 0.5 * busy_s, "optimizer": 0.1 * busy_s}
    block = summary.device_time([planted_rank(1.0, stages)], "steady", "events")
    assert block["busy_at_most_s"] == pytest.approx(busy_s / 10)  # as measured, either way
    warnings = [w["code"] for w in health.check(device_time_record(block))]
    (line,) = device_time_lines(RunView(device_time_record(block)))
    if fires:
        assert block["idle_share_at_least"] is None and block["host_bound"] is None
        assert [r["rank"] for r in block["over_wall"]] == [0] and warnings == ["device_busy_above_wall"]
        assert "no idle share" in line and "device_busy_above_wall" in line and "idle at least" not in line
    else:
        assert block["idle_share_at_least"] == 0.0 and block["over_wall"] == [] and warnings == []
        assert "idle at least 0.0%" in line


def test_the_device_idle_share_is_not_applicable_on_host_clocks_and_the_table_line_absent_on_a_cpu():
    from trainscope.core.record_view import RunView
    from trainscope.measure import summary
    from trainscope.run.table import device_time_lines

    _, mode = make_clock("events", torch.device("cpu"))
    stages = {"data": 0.01, "forward": 0.3, "backward": 0.5, "optimizer": 0.1}
    block = summary.device_time([planted_rank(1.0, stages)], "steady", mode)
    assert block["busy_at_most_s"] is None and block["idle_share_at_least"] is None and block["host_bound"] is None
    assert block["reason"].startswith("not applicable: host clocks")
    assert device_time_lines(RunView(device_time_record(block, device="cpu"))) == []
    synced = summary.device_time([planted_rank(1.0, stages)], "steady", "sync")
    assert synced["idle_share_at_least"] is None and "--timing sync" in synced["reason"]
    (line,) = device_time_lines(RunView(device_time_record(synced)))
    assert line.startswith("device idle share: not applicable: --timing sync")


LAYER = {"window_s": 0.8e-3, "basis": "self device time"}


def test_the_kernel_estimate_counts_the_layers_kernels_and_the_other_stages_spans_and_decides_host_bound():
    from trainscope.core.record_view import RunView
    from trainscope.measure import summary
    from trainscope.run.table import device_time_lines

    # a 40 ms step, 48 steps: data 5.5 ms, forward 13.4, backward 15.0, optimizer 4.7 (the H200 bf16 run's shape)
    stages = {"data": 0.0055 * 48, "forward": 0.0134 * 48, "backward": 0.015 * 48, "optimizer": 0.0047 * 48}
    rank = planted_rank(0.040 * 48, stages, steps=48)
    shapes = {"layers": 12, "layer": LAYER}
    block = summary.device_time([rank], "steady", "events", shapes)
    estimate = block["kernel_estimate"]
    assert estimate["forward_backward_s"] == pytest.approx(12 * 0.8e-3)
    assert estimate["busy_s"] == pytest.approx(12 * 0.8e-3 + 0.0055 + 0.0047)
    assert estimate["idle_share"] == pytest.approx(1 - (12 * 0.8e-3 + 0.0055 + 0.0047) / 0.040)
    assert block["idle_share_at_least"] == pytest.approx(1 - 0.0386 / 0.040)
    assert block["host_bound"] is True and block["host_bound_by"] == "kernel estimate"
    (line,) = device_time_lines(RunView(device_time_record(block)))
    assert line == (
        "device busy at most 38.6 ms of each step's 40.0 ms (the stages' CUDA event spans): idle at least 3.5%; "
        "by kernel time about 19.8 ms (estimate): idle about 50% -- host-bound (idle above 30%, by the kernel "
        "estimate)"
    )
    # two micro-batches a step: twice the layers' kernels; never above the forward and backward spans
    accumulated = summary.device_time([planted_rank(0.040 * 48, stages, 48, 96)], "steady", "events", shapes)
    assert accumulated["kernel_estimate"]["forward_backward_s"] == pytest.approx(2 * 12 * 0.8e-3)
    slow_layer = {"layers": 12, "layer": {**LAYER, "window_s": 0.01}}
    capped = summary.device_time([rank], "steady", "events", slow_layer)["kernel_estimate"]
    assert capped["forward_backward_s"] == pytest.approx(0.0134 + 0.015)
    # device-bound: the layers' kernels fill the step, the estimate says so
    busy = summary.device_time([rank], "steady", "events", {"layers": 12, "layer": {**LAYER, "window_s": 2.2e-3}})
    assert busy["host_bound"] is False and "host-bound" not in device_time_lines(RunView(device_time_record(busy)))[0]
    # no estimate where the layer's profile cannot stand for the step
    assert summary.device_time([rank], "steady", "events", shapes, recomputed=True)["kernel_estimate"] is None
    two = [rank, {**rank, "rank": 1}]
    unresolved = summary.device_time(two, "steady", "events", shapes, communication={"measured": True})
    assert unresolved["kernel_estimate"] is None and "all-reduce" in unresolved["kernel_estimate_reason"]
    resolved = {"measured": True, "exposed_resolved": True, "exposed_s": 0.002}
    found = summary.device_time(two, "steady", "events", shapes, communication=resolved)["kernel_estimate"]
    assert found["forward_backward_s"] == pytest.approx(12 * 0.8e-3 + 0.002)
    host_profile = {"layers": 12, "layer": {**LAYER, "basis": "self CPU time, main thread"}}
    assert summary.device_time([rank], "steady", "events", host_profile)["kernel_estimate"] is None


def test_a_measured_idle_share_above_the_threshold_is_host_bound_by_the_event_spans():
    from trainscope.measure import summary

    stages = {"data": 0.1, "forward": 0.2, "backward": 0.2, "optimizer": 0.1}  # 0.6 s of spans in a 1 s wall
    block = summary.device_time([planted_rank(1.0, stages)], "steady", "events")
    assert block["idle_share_at_least"] == pytest.approx(0.4)
    assert block["host_bound"] is True and block["host_bound_by"] == "event spans"
    evaluated = planted_rank(1.5, stages)
    evaluated["timing"]["steady"]["seconds"]["eval"] = 0.5  # evaluation is not a training step's
    assert summary.device_time([evaluated], "steady", "events")["idle_share_at_least"] == pytest.approx(0.4)
