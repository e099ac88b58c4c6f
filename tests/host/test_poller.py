from __future__ import annotations

import json
import logging
import os
import random
from pathlib import Path

import pytest

from sidecar.host.poller import Poller, next_delay
from sidecar.host.sources.env import EnvSource
from sidecar.host.statefile import StateFile
from sidecar.host.store import Store
from sidecar.host.store_section import StoreSection
from sidecar.models import Observation

MLP = "MLP_CURRENT_CAPACITY_BLOCK_EXPIRATION_TIMESTAMP"


def test_success_waits_the_interval_with_ten_percent_jitter() -> None:
    rng = random.Random(1)
    delays = [next_delay(30, 0, rng=rng) for _ in range(500)]
    assert min(delays) >= 27 and max(delays) <= 33
    assert max(delays) - min(delays) > 3  # jitter is really there


def test_failures_back_off_from_one_second_doubling_capped_at_interval() -> None:
    rng = random.Random(2)
    for failures, centre in [(1, 1), (2, 2), (3, 4), (4, 8), (5, 16), (6, 30), (40, 30)]:
        delay = next_delay(30, failures, rng=rng)
        assert centre * 0.8 <= delay <= centre * 1.2, (failures, delay)


def test_throttling_backs_off_from_a_higher_start() -> None:
    rng = random.Random(3)
    assert 3.2 <= next_delay(30, 1, throttled=True, rng=rng) <= 4.8
    assert 24 <= next_delay(30, 9, throttled=True, rng=rng) <= 36


def state_of(path: Path | None, store: Store, now: float | None = None) -> StateFile:
    """The daemon's state file with the store's section (sidecar.host.statefile)."""
    state = StateFile(path)
    state.add(StoreSection(store) if now is None else StoreSection(store, clock=lambda: now))
    return state


def load_state(path: Path, store: Store, *, now: float | None = None) -> None:
    state_of(path, store, now).load()


def save_state(path: Path, store: Store) -> None:
    state_of(path, store).write()


def make(environ: dict[str, str], tmp_path: Path | None = None) -> tuple[Poller, Store]:
    source = EnvSource(environ=environ)
    store = Store([source.name], stale_after=90)
    state_file = tmp_path / "state.json" if tmp_path else None
    poller = Poller([source], store, interval=30, on_change=state_of(state_file, store).write,
                    rng=random.Random(0))
    return poller, store


def test_poll_once_records_failure_then_recovery_logging_once_per_change(
    caplog: pytest.LogCaptureFixture,
) -> None:
    environ = {MLP: "garbage"}
    poller, store = make(environ)
    source = poller._sources[0]
    caplog.set_level(logging.INFO, logger="sidecar.host.poller")
    delays = [poller.poll_once(source) for _ in range(3)]
    assert delays[0] < delays[1] < delays[2] < 30  # backing off
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "'garbage'" in warnings[0].getMessage()
    assert store.expiry().error is not None and "garbage" in store.expiry().error  # type: ignore[operator]
    assert poller.first_attempt_done.is_set()

    environ[MLP] = "1900000000"
    assert poller.poll_once(source) >= 27
    expiry = store.expiry()
    assert expiry.expires_at_unix == 1900000000 and expiry.error is None
    assert any("recovered" in r.getMessage() for r in caplog.records)


def test_state_file_round_trip(tmp_path: Path) -> None:
    poller, _ = make({MLP: "1900000000"}, tmp_path)
    poller.poll_once(poller._sources[0])  # a change: written at once
    data = json.loads((tmp_path / "state.json").read_text())
    assert data["sources"]["env"]["observation"]["expires_at_unix"] == 1900000000
    assert [p.name for p in tmp_path.iterdir()] == ["state.json"]  # no temp files left

    fresh = Store(["env"], stale_after=90)
    load_state(tmp_path / "state.json", fresh)
    expiry = fresh.expiry()
    assert expiry.expires_at_unix == 1900000000 and expiry.stale is True


@pytest.mark.parametrize(
    "content",
    [b"", b"{not json", b'{"version": 99, "sources": {}}',
     b'{"version": 1, "sources": {"env": {"observation": {"bogus": 1}}}}',
     b'{"version": 1, "sources": {"env": {"observation": {"expires_at_unix": "x"}, '
     b'"observed_at_unix": 1}}}'],
)
def test_damaged_state_file_is_ignored_with_a_warning(
    tmp_path: Path, content: bytes, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "state.json"
    path.write_bytes(content)
    store = Store(["env"], stale_after=90)
    load_state(path, store)
    assert store.expiry().expires_at is None
    assert "ignoring state file" in caplog.text


GOOD_ENTRY = {"observation": {"expires_at_unix": 1900000000, "kind": "scheduled-release"},
              "observed_at_unix": 1890000000}


@pytest.mark.parametrize(
    ("field", "value", "named"),
    [
        ("expires_at_unix", "1900000000", "expires_at_unix must be a number"),
        ("expires_at_unix", 1e300, "expires_at_unix is not a plausible"),
        ("expires_at_unix", float("nan"), "expires_at_unix is not a plausible"),
        ("expires_at_unix", float("inf"), "expires_at_unix is not a plausible"),
        ("expires_at_unix", True, "expires_at_unix must be a number"),
        ("expires_at_unix", -5, "expires_at_unix is not a plausible"),
        ("kind", 123, "kind must be text"),
        ("observed_at_unix", 1e300, "observed_at_unix is not a plausible"),
        ("observed_at_unix", float("nan"), "observed_at_unix is not a plausible"),
        ("observed_at_unix", "yesterday", "observed_at_unix must be a number"),
    ],
)
def test_a_state_file_with_a_wrong_field_is_set_aside_not_served(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, field: str, value: object, named: str
) -> None:
    """It parses, but one field is wrong: before, such a file made /v1/expiry, /v1/decision
    and /metrics fail with 500 while the cloud was unreachable, and was written back."""
    entry = json.loads(json.dumps(GOOD_ENTRY))
    if field == "observed_at_unix":
        entry[field] = value
    else:
        entry["observation"][field] = value
    path = tmp_path / "state.json"
    path.write_text(json.dumps({"version": 1, "sources": {"env": entry}}))  # NaN, Infinity
    store = Store(["env"], stale_after=90)
    load_state(path, store, now=1890000100)
    expiry = store.expiry()  # builds: nothing of the file is served
    assert expiry.expires_at is None
    assert not path.exists() and (tmp_path / "state.json.bad").exists()  # set aside
    warnings = [r.getMessage() for r in caplog.records if "state file" in r.getMessage()]
    assert len(warnings) == 1 and named in warnings[0] and "state.json.bad" in warnings[0]
    # The good entry itself restores (the test's bad value is what is refused).
    path.write_text(json.dumps({"version": 1, "sources": {"env": GOOD_ENTRY}}))
    load_state(path, store, now=1890000100)
    assert store.expiry().expires_at_unix == 1900000000


def test_state_writes_survive_a_leftover_temp_file_of_the_same_pid(tmp_path: Path) -> None:
    # A container's daemon is always PID 1: the temporary file its last crash left behind
    # has the name the next write would pick, if the name came from the PID alone.
    path = tmp_path / "state.json"
    leftover = tmp_path / f".state.json.{os.getpid()}.tmp"
    leftover.write_text("half")
    store = Store(["static"], stale_after=90)
    store.record_success("static", Observation(expires_at_unix=1900000000.0))
    save_state(path, store)
    assert json.loads(path.read_text())["sources"]["static"]
    load_state(path, Store(["static"], stale_after=90))
    assert not leftover.exists()  # leftovers are removed when the state is loaded


def test_missing_state_file_is_fine(tmp_path: Path) -> None:
    store = Store(["env"], stale_after=90)
    load_state(tmp_path / "absent.json", store)
    assert store.expiry().expires_at is None


def test_unwritable_state_file_is_logged_not_raised(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    source = EnvSource(environ={MLP: "1900000000"})
    store = Store(["env"], stale_after=90)
    poller = Poller([source], store, interval=30,
                    on_change=state_of(blocker / "state.json", store).write)
    poller.poll_once(source)
    assert store.expiry().expires_at_unix == 1900000000
    assert "could not write state file" in caplog.text


def test_save_state_skips_sources_without_a_good_poll(tmp_path: Path) -> None:
    store = Store(["env", "static"], stale_after=90)
    store.record_success("static", Observation(expires_at_unix=5.0))
    save_state(tmp_path / "s.json", store)
    assert list(json.loads((tmp_path / "s.json").read_text())["sources"]) == ["static"]


def test_start_and_stop_promptly() -> None:
    poller, store = make({MLP: "1900000000"})
    poller.start()
    assert poller.first_attempt_done.wait(5)
    threads = list(poller._threads)
    assert threads and all(t.is_alive() for t in threads)
    poller.stop(timeout=2)
    assert not any(t.is_alive() for t in threads)
    assert store.expiry().expires_at_unix == 1900000000


class BrokenSource:
    """A source with a bug: it raises something other than SourceError."""

    name = "env"

    def poll(self) -> Observation:
        raise RuntimeError("token=AKLTsecret123 leaked into a message")


def test_a_buggy_source_is_reported_by_type_and_place_never_by_its_text(
    caplog: pytest.LogCaptureFixture,
) -> None:
    store = Store(["env"], stale_after=90)
    poller = Poller([BrokenSource()], store, interval=30, rng=random.Random(0))
    delay = poller.poll_once(BrokenSource())
    assert delay < 30  # backing off, the thread lives on
    error = store.expiry().error or ""
    assert "RuntimeError" in error and "test_poller.py:" in error
    assert "AKLTsecret123" not in error and "AKLTsecret123" not in caplog.text


def test_a_time_without_an_offset_is_read_in_its_platforms_zone_and_said_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # MLP_... is the Volcengine ML platform's (UTC+8, the earliest plausible reading);
    # SageMaker's AWS writes UTC.
    poller, store = make({MLP: "2030-01-01 08:00:00"})
    source = poller._sources[0]
    caplog.set_level(logging.INFO, logger="sidecar.host.poller")
    for _ in range(3):
        poller.poll_once(source)
    expiry = store.expiry()
    assert expiry.expires_at == "2030-01-01T00:00:00Z" and expiry.assumed_timezone == "UTC+08:00"
    said = [r.getMessage() for r in caplog.records if "without a UTC offset" in r.getMessage()]
    assert len(said) == 1 and "UTC+08:00" in said[0] and "--timezone" in said[0], said
    sagemaker = EnvSource(environ={"SAGEMAKER_CURRENT_CAPACITY_BLOCK_EXPIRATION_TIMESTAMP":
                                   "2030-01-01 08:00:00"}).poll()
    assert sagemaker.expires_at_unix == 1893484800.0 and sagemaker.assumed_timezone == "UTC"


def test_a_deadline_long_past_is_said_once(caplog: pytest.LogCaptureFixture) -> None:
    import time

    poller, store = make({MLP: str(int(time.time()) - 600)})
    caplog.set_level(logging.INFO, logger="sidecar.host.poller")
    for _ in range(3):
        poller.poll_once(poller._sources[0])
    said = [r for r in caplog.records if "passed" in r.getMessage()]
    assert len(said) == 1 and said[0].levelno == logging.WARNING
    assert "clock" in said[0].getMessage(), said[0].getMessage()
    assert store.expiry().remaining_seconds is not None and store.health().status == "degraded"
