from __future__ import annotations

from sidecar.host.store import Store
from sidecar.models import Observation

RELEASE = 2_000_000_000.0


def obs(deadline: float | None, **extra: object) -> Observation:
    return Observation(expires_at_unix=deadline, kind="scheduled-release" if deadline else None,
                       **extra)  # type: ignore[arg-type]


def test_nothing_known_before_the_first_poll() -> None:
    store = Store(["volcengine-esi"], stale_after=90, clock=lambda: 1000.0)
    expiry = store.expiry()
    assert expiry.expires_at is None and expiry.remaining_seconds is None
    assert expiry.stale is True
    assert expiry.server_time_unix == 1000.0
    assert store.health().status == "starting"


def test_success_serves_deadline_and_remaining_time() -> None:
    store = Store(["volcengine-esi"], stale_after=90)
    store.record_success("volcengine-esi", obs(RELEASE, instance_id="i-1",
                                               scheduled_instance_id="esi-1"), at=RELEASE - 500)
    expiry = store.expiry(now=RELEASE - 200)
    assert expiry.expires_at == "2033-05-18T03:33:20Z"
    assert expiry.remaining_seconds == 200
    assert expiry.age_seconds == 300
    assert expiry.kind == "scheduled-release"
    assert (expiry.instance_id, expiry.scheduled_instance_id) == ("i-1", "esi-1")
    assert expiry.stale is True  # 300 s old > 90 s bound
    assert store.expiry(now=RELEASE - 450).stale is False


def test_failure_keeps_last_good_value_and_goes_stale_then_recovers() -> None:
    now = [0.0]
    store = Store(["s"], stale_after=90, clock=lambda: now[0])
    store.record_success("s", obs(RELEASE))
    now[0] = 30
    store.record_failure("s", "HTTP 500 InternalError")
    expiry = store.expiry()
    assert expiry.expires_at_unix == RELEASE and expiry.error == "HTTP 500 InternalError"
    assert expiry.stale is False and store.health().ok
    now[0] = 91
    assert store.expiry().stale is True
    health = store.health()
    assert health.status == "degraded" and "HTTP 500" in (health.reason or "")
    store.record_success("s", obs(RELEASE + 60))
    expiry = store.expiry()
    assert (expiry.stale, expiry.error, expiry.expires_at_unix) == (False, None, RELEASE + 60)
    assert store.health().ok


def test_no_scheduled_release_is_healthy_not_an_error() -> None:
    store = Store(["s"], stale_after=90)
    store.record_success("s", obs(None, instance_id="i-1"))
    expiry = store.expiry()
    assert expiry.expires_at is None and expiry.error is None and not expiry.stale
    assert expiry.instance_id == "i-1"
    assert store.health().ok


def test_restored_state_is_served_as_stale_until_confirmed() -> None:
    store = Store(["s"], stale_after=90, clock=lambda: 1000.0)
    store.restore("s", obs(RELEASE), observed_at_unix=990.0)
    expiry = store.expiry()
    assert expiry.expires_at_unix == RELEASE and expiry.stale is True
    assert store.health().status == "starting"
    store.record_success("s", obs(RELEASE))
    assert store.expiry().stale is False


def test_earliest_deadline_across_sources_wins() -> None:
    store = Store(["volcengine-esi", "env"], stale_after=90, clock=lambda: 0.0)
    store.record_success("volcengine-esi", obs(RELEASE))
    assert store.expiry().stale is True  # env has not answered yet
    store.record_success("env", obs(RELEASE - 100))
    expiry = store.expiry()
    assert (expiry.source, expiry.expires_at_unix, expiry.stale) == ("env", RELEASE - 100, False)
    store.record_failure("volcengine-esi", "timeout")
    assert store.expiry().error == "volcengine-esi: timeout"


def test_poll_counts_by_outcome() -> None:
    store = Store(["s"], stale_after=90)
    store.record_success("s", obs(RELEASE))
    store.record_failure("s", "x")
    store.record_failure("s", "slow down", throttled=True)
    status = store.snapshot().sources[0]
    assert dict(status.polls) == {"ok": 1, "error": 1, "throttled": 1}
    assert status.consecutive_failures == 2


def test_record_success_reports_change() -> None:
    store = Store(["s"], stale_after=90)
    assert store.record_success("s", obs(RELEASE)) is True
    assert store.record_success("s", obs(RELEASE)) is False
    assert store.record_success("s", obs(RELEASE - 1)) is True


def test_a_deadline_long_past_is_reported_not_served_and_a_good_one_wins() -> None:
    from sidecar.models import KIND_MAINTENANCE, KIND_PREEMPTION, Notice, observation_from_notices

    store = Store(["aws", "volcengine-esi"], stale_after=90)
    now = RELEASE
    spot = Notice(KIND_PREEMPTION, now - 300, detail="spot terminate")  # 5 min ago
    maintenance = Notice(KIND_MAINTENANCE, now + 3600, detail="system-reboot")
    store.record_success("aws", observation_from_notices([spot, maintenance]), at=now)
    store.record_success("volcengine-esi", obs(now + 7200), at=now)
    expiry = store.expiry(now=now)
    assert expiry.expires_at_unix == now + 3600 and expiry.kind == KIND_MAINTENANCE
    assert expiry.error is not None and expiry.error.startswith("aws: preemption-notice")
    assert "passed 300 s ago" in expiry.error
    health = store.health(now=now)
    assert health.status == "degraded" and "spot terminate" in (health.reason or "")
    # every notice is still listed, the past one with its negative time left
    assert [n["remaining_seconds"] for n in expiry.notices] == [-300, 3600, 7200]


def test_a_deadline_long_past_with_nothing_better_is_served_but_never_as_healthy() -> None:
    # The machine should be gone: the source's answer or this host's clock is wrong. The
    # deadline is still served (it used to be hidden, which a client reads as "nothing
    # scheduled"), and the answer and /healthz say what is wrong.
    store = Store(["volcengine-esi"], stale_after=90)
    store.record_success("volcengine-esi", obs(RELEASE), at=RELEASE + 600)
    expiry = store.expiry(now=RELEASE + 600)
    assert expiry.expires_at_unix == RELEASE and expiry.remaining_seconds == -600
    assert expiry.kind == "scheduled-release" and expiry.source == "volcengine-esi"
    assert expiry.error is not None and "passed 600 s ago" in expiry.error
    assert "clock" in expiry.error and "not served" not in expiry.error
    health = store.health(now=RELEASE + 600)
    assert health.status == "degraded" and "passed 600 s ago" in (health.reason or "")


def test_a_deadline_that_just_passed_is_still_served() -> None:
    store = Store(["volcengine-esi"], stale_after=90)
    store.record_success("volcengine-esi", obs(RELEASE), at=RELEASE + 30)
    expiry = store.expiry(now=RELEASE + 30)
    assert expiry.remaining_seconds == -30 and expiry.error is None
    assert store.health(now=RELEASE + 30).ok


def test_notices_list_every_source_the_earliest_first_and_advice_last() -> None:
    from sidecar.models import KIND_REBALANCE, Notice, observation_from_notices

    store = Store(["aws", "volcengine-esi", "static"], stale_after=90)
    advice = Notice(KIND_REBALANCE, None, advisory=True, detail="rebalance recommended")
    store.record_success("aws", observation_from_notices([advice]), at=RELEASE - 310)
    store.record_success("volcengine-esi", obs(RELEASE), at=RELEASE - 310)
    store.record_success("static", obs(RELEASE - 100), at=RELEASE - 500)
    expiry = store.expiry(now=RELEASE - 300)
    assert [(n["source"], n["advisory"]) for n in expiry.notices] == [
        ("static", False), ("volcengine-esi", False), ("aws", True)]
    assert expiry.source == "static"
    first = expiry.notices[0]
    assert first["expires_at"] == "2033-05-18T03:31:40Z" and first["remaining_seconds"] == 200
    assert first["observed_at"] == "2033-05-18T03:25:00Z" and first["stale"] is True
    assert expiry.notices[1]["stale"] is False
    assert expiry.notices[2]["expires_at"] is None


def test_a_source_auto_did_not_find_counts_for_nothing() -> None:
    store = Store(["aws", "static"], stale_after=90)
    store.record_absent("aws", "no EC2 metadata service at http://169.254.169.254")
    store.record_success("static", obs(RELEASE), at=RELEASE - 10)
    assert store.health(now=RELEASE - 10).ok
    expiry = store.expiry(now=RELEASE - 10)
    assert expiry.stale is False and expiry.error is None and expiry.source == "static"
