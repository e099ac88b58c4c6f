"""The adaptive poll schedule and the per-host API cap (sidecar.host.schedule), and the
emulator's account-wide rate limit, through the real Volcengine SDK over HTTP."""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Iterator
from typing import Any

import pytest
from daemon_harness import get_json, serve_daemon, wait_for

from sidecar.host.poller import Poller
from sidecar.host.schedule import (
    FAR_FRACTION,
    MAX_INTERVAL_SECONDS,
    NEAR_SECONDS,
    NO_DEADLINE_INTERVAL_SECONDS,
    ApiBudget,
    adaptive_interval,
    jittered,
)
from sidecar.host.settings import Settings
from sidecar.host.sources.registry import create_source, traits_of
from sidecar.host.store import Store, build_health
from sidecar.tools.emulator import Emulator

ACCESS_KEY = "AKLTscheduletest0000"
SECRET_KEY = "c2NoZWR1bGUtc2VjcmV0LXZhbHVl"
BASE = 30.0


@pytest.fixture
def emulator(monkeypatch: pytest.MonkeyPatch) -> Iterator[Emulator]:
    monkeypatch.setenv("VOLCENGINE_ACCESS_KEY", ACCESS_KEY)
    monkeypatch.setenv("VOLCENGINE_SECRET_KEY", SECRET_KEY)
    monkeypatch.delenv("VOLCENGINE_SESSION_TOKEN", raising=False)
    with Emulator(access_key=ACCESS_KEY, secret_key=SECRET_KEY, region="cn-beijing",
                  instance_id="i-sched0001", scheduled_instance_id="esi-sched0001") as emu:
        yield emu


# ---------------------------------------------------------------------- the schedule


@pytest.mark.parametrize(("remaining", "expected"), [
    (None, NO_DEADLINE_INTERVAL_SECONDS),
    (-5.0, BASE),  # past: as often as ever
    (60.0, BASE),
    (NEAR_SECONDS, BASE),  # the final 15 minutes: --poll-interval
    (NEAR_SECONDS + 10, BASE),  # a far interval would step over the window's start
    (NEAR_SECONDS + 50, 50.0),  # lands exactly at the window's start
    (NEAR_SECONDS + 200, 1100 / 12),  # 1/12 of the time left
    (3600.0, 300.0),  # an hour: 1/12 of it
    (7200.0, 600.0),
    (6 * 3600.0, MAX_INTERVAL_SECONDS),  # capped
])
def test_the_interval_follows_the_time_left(remaining: Any, expected: float) -> None:
    assert adaptive_interval(remaining, BASE) == pytest.approx(expected)


def test_a_far_poll_never_steps_over_the_start_of_the_final_window() -> None:
    rng = random.Random(7)
    for remaining in [NEAR_SECONDS + x for x in range(1, 30000, 7)]:
        interval = adaptive_interval(remaining, BASE)
        delay = jittered(interval, BASE, rng)
        if remaining - NEAR_SECONDS >= BASE * 1.1:
            assert remaining - delay >= NEAR_SECONDS - 1e-9, (remaining, delay)
        assert delay >= BASE * 0.9


def walk(start_remaining: float, end_remaining: float, seed: int) -> list[float]:
    """The remaining times at which one host polls, as its poller would schedule them."""
    rng = random.Random(seed)
    remaining, polls = start_remaining, []
    while remaining > end_remaining:
        polls.append(remaining)
        remaining -= jittered(adaptive_interval(remaining, BASE), BASE, rng)
    return polls


def test_at_most_12_calls_per_host_hour_while_the_release_is_over_an_hour_away() -> None:
    for seed in range(20):
        polls = walk(12 * 3600.0, 0.0, seed)
        for hour in range(1, 12):  # each whole hour of remaining time above one hour
            inside = [r for r in polls if hour * 3600 < r <= (hour + 1) * 3600]
            assert len(inside) <= 12, (seed, hour, len(inside))
        # The final 15 minutes: every --poll-interval, as before (900 s / 30 s +-10 %).
        final = [r for r in polls if 0 < r <= NEAR_SECONDS]
        assert 27 <= len(final) <= 34, len(final)
    assert abs(FAR_FRACTION * 3600 - 300) < 1e-9


def test_the_base_interval_keeps_its_jitter_and_a_far_one_only_shortens() -> None:
    rng = random.Random(3)
    near = [jittered(BASE, BASE, rng) for _ in range(300)]
    assert min(near) >= 27 and max(near) <= 33 and max(near) - min(near) > 3
    far = [jittered(600.0, BASE, rng) for _ in range(300)]
    assert min(far) >= 540 and max(far) <= 600 and max(far) - min(far) > 30


# ---------------------------------------------------------------------- the API budget


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_the_budget_allows_a_minute_of_burst_then_its_rate() -> None:
    clock = Clock()
    budget = ApiBudget(3600, monotonic=clock)  # one a second, bursts of 60
    assert [budget.take() for _ in range(60)] == [0.0] * 60
    assert budget.take() == pytest.approx(1.0)  # the 61st waits a second
    assert budget.take() == pytest.approx(2.0)
    clock.now += 10  # refilled: 10 tokens back, 2 already promised
    assert budget.take() == pytest.approx(0.0, abs=1e-9)
    assert budget.deferred == 2 and budget.deferred_seconds == pytest.approx(3.0)
    with pytest.raises(ValueError, match="calls per hour"):
        ApiBudget(0)


def test_the_daemon_never_exceeds_its_api_rate(emulator: Emulator,
                                               caplog: pytest.LogCaptureFixture) -> None:
    emulator.set_release_in(600)
    caplog.set_level(logging.WARNING, logger="sidecar.host.poller")
    # A fast fixed poll (10 a second) against a cap of 360 an hour: a burst of 6, then
    # one every 10 s. Without the cap the emulator would see ~30 polls in 3 s.
    with serve_daemon(api_endpoint=emulator.url, metadata_url=emulator.url,
                      poll_interval=0.1, stale_after=60.0, max_api_rate=360.0) as daemon:
        wait_for(lambda: get_json(daemon.url + "/healthz")[0] == 200, timeout=30)
        time.sleep(3.0)
        made = emulator.request_count("DescribeScheduledInstances")
        assert daemon.poller.budget is not None and daemon.poller.budget.deferred >= 1
    assert 1 <= made <= 7, made  # the burst of 6, and at most one more refilled
    said = [r.getMessage() for r in caplog.records if "--max-api-rate" in r.getMessage()]
    assert len(said) == 1 and "360 calls per hour" in said[0], said


# ---------------------------------------------------------------------- through the SDK


def esi_source(emulator: Emulator) -> Any:
    settings = Settings(sources=("volcengine-esi",), api_endpoint=emulator.url,
                        metadata_url=emulator.url, region="cn-beijing", poll_interval=BASE)
    return create_source("volcengine-esi", settings)


def test_a_far_release_is_polled_rarely_and_stays_fresh_between_polls(
    emulator: Emulator,
) -> None:
    emulator.set_release_in(2 * 3600)
    source = esi_source(emulator)
    store = Store([source.name], stale_after=3 * BASE)
    poller = Poller([source], store, interval=BASE, rng=random.Random(0),
                    traits=traits_of([source.name]))
    delay = poller.poll_once(source)
    assert 540 <= delay <= 600  # 1/12 of two hours, less up to 10 %
    # Fresh until the planned poll is late, not after 3 x 30 s as with the fixed schedule.
    later = time.time() + delay + 60
    assert build_health(store.snapshot(), later).ok
    assert not build_health(store.snapshot(), time.time() + 600 + 3 * BASE + 5).ok
    # Ten minutes before the release: every --poll-interval again.
    emulator.set_release_in(600)
    delay = poller.poll_once(source)
    assert 27 <= delay <= 33
    assert not build_health(store.snapshot(), time.time() + 3 * BASE + 5).ok

    fixed = Poller([source], store, interval=BASE, rng=random.Random(0),
                   traits=traits_of([source.name]), adaptive=False)
    emulator.set_release_in(2 * 3600)
    assert 27 <= fixed.poll_once(source) <= 33


def test_the_account_limit_throttles_as_the_service_does(emulator: Emulator) -> None:
    emulator.set_release_in(3600)
    source = esi_source(emulator)
    store = Store([source.name], stale_after=3 * BASE)
    poller = Poller([source], store, interval=BASE, rng=random.Random(0),
                    traits=traits_of([source.name]))
    poller.poll_once(source)  # DescribeInstances + DescribeScheduledInstances, unthrottled
    limit = emulator.set_account_limit(1.0, burst=2)
    assert limit is not None
    delays = [poller.poll_once(source) for _ in range(5)]
    status = store.snapshot().sources[0]
    assert limit.throttled >= 3 and limit.allowed <= 2
    assert status.error is not None and "Throttling.User" in status.error
    assert dict(status.polls)["throttled"] >= 3
    assert delays[-1] >= 3.2  # throttling backs off from 4 s, not 1 s
    emulator.set_account_limit(None)
    assert poller.poll_once(source) > 27  # back to its schedule


def test_a_far_host_that_is_throttled_retries_at_its_planned_interval(
    emulator: Emulator,
) -> None:
    emulator.set_release_in(2 * 3600)
    source = esi_source(emulator)
    store = Store([source.name], stale_after=3 * BASE)
    poller = Poller([source], store, interval=BASE, rng=random.Random(0),
                    traits=traits_of([source.name]))
    poller.poll_once(source)
    emulator.inject_fault("throttle", count=7)
    delays = [poller.poll_once(source) for _ in range(7)]
    # 4 s doubling (+-20 %), past the 30 s cap of the fixed schedule, up to the planned
    # interval of a release two hours away (600 s).
    assert 3.2 <= delays[0] <= 4.8
    assert delays[4] >= 64 * 0.8 and max(delays) <= 600 * 1.2, delays
    fixed = Poller([source], store, interval=BASE, rng=random.Random(0),
                   traits=traits_of([source.name]), adaptive=False)
    emulator.inject_fault("throttle", count=7)
    assert max(fixed.poll_once(source) for _ in range(7)) <= BASE * 1.2


def test_the_cap_applies_to_the_real_api_and_not_to_the_emulator() -> None:
    from sidecar.host.schedule import DEFAULT_MAX_API_RATE

    assert Settings().effective_max_api_rate == DEFAULT_MAX_API_RATE
    assert Settings(api_endpoint="https://open.volcengineapi.com").effective_max_api_rate == (
        DEFAULT_MAX_API_RATE)
    assert Settings(api_endpoint="http://127.0.0.1:9000").effective_max_api_rate is None
    assert Settings(api_endpoint="http://127.0.0.1:9000",
                    max_api_rate=60.0).effective_max_api_rate == 60.0
