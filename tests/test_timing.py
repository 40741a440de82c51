import time

import pytest
import torch

from trainscope.timing import ALL_STAGES, CATEGORIES, STAGES, HostClock, StageTimer, make_clock, stage_table

TOLERANCE_S = 0.03  # sleep() overshoots by scheduler noise; never undershoots


def test_sleep_in_a_stage_is_measured_within_tolerance():
    timer = StageTimer()
    timer.start()
    with timer("forward"):
        time.sleep(0.2)
    timer.stop()
    measured = timer.summary()["run"]["seconds"]["forward"]
    assert 0.2 <= measured < 0.2 + TOLERANCE_S


def test_time_outside_stages_is_other_and_stages_sum_to_wall():
    timer = StageTimer()
    timer.start()
    with timer("data"):
        time.sleep(0.05)
    time.sleep(0.1)  # in no stage
    with timer("optimizer"):
        time.sleep(0.05)
    timer.stop()
    run = timer.summary()["run"]
    assert 0.1 <= run["seconds"]["other"] < 0.1 + TOLERANCE_S
    assert sum(run["seconds"].values()) == pytest.approx(run["wall_s"], abs=1e-9)
    assert sum(run["shares"].values()) == pytest.approx(1.0)
    assert sum(run["category_seconds"].values()) == pytest.approx(run["wall_s"])
    assert run["category_seconds"]["other"] == pytest.approx(run["seconds"]["optimizer"] + run["seconds"]["other"])


def test_warmup_steps_are_recorded_apart_from_the_steady_state():
    timer = StageTimer()
    timer.start()
    with timer("forward"):
        time.sleep(0.1)
    timer.set_phase("steady")
    with timer("forward"):
        time.sleep(0.03)
    with timer("forward"):
        time.sleep(0.03)
    timer.stop()
    summary = timer.summary()
    assert summary["warmup"]["seconds"]["forward"] == pytest.approx(0.1, abs=TOLERANCE_S)
    assert summary["steady"]["seconds"]["forward"] == pytest.approx(0.06, abs=TOLERANCE_S)
    assert timer.stage_calls["steady"]["forward"] == 2
    assert summary["run"]["wall_s"] == pytest.approx(summary["warmup"]["wall_s"] + summary["steady"]["wall_s"])
    for phase in ("warmup", "steady", "run"):
        assert sum(summary[phase]["shares"].values()) == pytest.approx(1.0)


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

    def __init__(self, device_clock):
        self.device_clock = device_clock
        self.at = None
        self.done = False

    def elapsed(self, end):
        return end.at - self.at


class FakeEventClock:
    """Device time advances only when the test says; events complete only when released."""

    def __init__(self):
        self.device_now = 0.0
        self.events = []
        self.waited = 0

    def mark(self):
        event = FakeEvent(self)
        event.at = self.device_now
        self.events.append(event)
        return event

    @staticmethod
    def elapsed(start, end):
        return start.elapsed(end)

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
    assert interval == {"data": 0.0, "forward": 5.0, "backward": 7.0, "optimizer": 1.0, "eval": 0.0}
    assert timer.take_interval()["forward"] == 0.0


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
        time.sleep(0.02)
    first.set_phase("steady")
    with first("forward"):
        time.sleep(0.02)
    state = first.state_dict()
    second = StageTimer()
    second.restore(state)
    assert second.phase == "steady"
    second.start()
    with second("forward"):
        time.sleep(0.02)
    second.stop()
    assert second.stage_calls["steady"]["forward"] == 2
    assert second.summary()["run"]["seconds"]["forward"] == pytest.approx(0.06, abs=TOLERANCE_S)


def test_stage_table_derives_the_five_categories_exactly():
    table = stage_table({"data": 1, "forward": 2, "backward": 3, "optimizer": 0.5, "eval": 1.5}, wall_seconds=10)
    assert table["seconds"]["other"] == pytest.approx(2.0)
    assert table["category_seconds"] == pytest.approx(
        {"data loading": 1, "forward": 2, "loss+backward": 3, "evaluation": 1.5, "other": 2.5})
    assert set(table["shares"]) == set(ALL_STAGES)
    assert set(CATEGORIES) == {"data loading", "forward", "loss+backward", "evaluation", "other"}
    assert sorted(s for stages in CATEGORIES.values() for s in stages) == sorted(ALL_STAGES)
    assert set(STAGES) < set(ALL_STAGES)
