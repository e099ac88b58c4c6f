"""The daemon's state file (sidecar.host.statefile.StateFile): its sections, its writes,
and a damaged file of any shape set aside with one log line while the daemon starts."""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from daemon_harness import fetch_json, get_json, serve_daemon, wait_for

from sidecar.host.features.events.history import EventHistory, JobEvent
from sidecar.host.statefile import MAX_BYTES, StateFile
from sidecar.host.store import Store
from sidecar.host.store_section import StoreSection
from sidecar.models import Observation

RELEASE = 1900000000.0
NOW = 1890000000.0


def state_of(path: Path | None, store: Store, events: EventHistory | None = None) -> StateFile:
    state = StateFile(path)
    state.add(StoreSection(store, clock=lambda: NOW + 100))
    if events is not None:
        state.add(events)
    return state


def known_store() -> Store:
    store = Store(["static"], stale_after=90)
    store.record_success("static", Observation(expires_at_unix=RELEASE,
                                               kind="scheduled-release"), at=NOW)
    return store


def saved_event() -> JobEvent:
    return JobEvent(kind="save-finished", job="j", step=7, seconds=1.5, save="final")


# ------------------------------------------------------------------ sections and writes


def test_both_sections_round_trip_in_one_file(tmp_path: Path) -> None:
    path = tmp_path / "state.json"
    events = EventHistory()
    events.add([saved_event()], now=NOW)
    state_of(path, known_store(), events).write()
    data = json.loads(path.read_text())
    assert list(data) == ["version", "sources", "events"] and data["version"] == 1
    assert [p.name for p in tmp_path.iterdir()] == ["state.json"]  # no temp file left

    store, restored = Store(["static"], stale_after=90), EventHistory()
    state_of(path, store, restored).load()
    assert store.expiry(now=NOW + 100).expires_at_unix == RELEASE
    assert store.expiry(now=NOW + 100).stale is True  # until a poll confirms it
    assert restored.body(now=NOW)["summary"]["last_save_step"] == 7


def test_a_file_written_before_the_state_file_had_one_owner_still_loads(
    tmp_path: Path,
) -> None:
    # The poller's save_state and the events' state(), as they wrote it.
    path = tmp_path / "state.json"
    path.write_text(json.dumps({
        "version": 1,
        "sources": {"static": {"observation": {
            "expires_at_unix": RELEASE, "kind": "scheduled-release", "instance_id": None,
            "scheduled_instance_id": None, "assumed_timezone": None},
            "observed_at_unix": NOW}},
        "events": {"version": 1, "history": [{
            "kind": "durable", "job": "j", "step": 3, "at_unix": NOW,
            "received_at_unix": NOW}], "summary": {"last_durable_step": 3}},
    }, indent=1))
    store, events = Store(["static"], stale_after=90), EventHistory()
    state_of(path, store, events).load()
    assert store.expiry(now=NOW).expires_at_unix == RELEASE
    assert events.body(now=NOW)["summary"]["last_durable_step"] == 3


def test_the_order_sections_are_added_in_does_not_matter(tmp_path: Path) -> None:
    path = tmp_path / "state.json"
    events = EventHistory()
    events.add([saved_event()], now=NOW)
    state_of(path, known_store(), events).write()
    store, restored = Store(["static"], stale_after=90), EventHistory()
    state = StateFile(path)
    state.add(restored, StoreSection(store, clock=lambda: NOW))
    state.load()
    assert store.expiry(now=NOW).expires_at_unix == RELEASE
    assert restored.body(now=NOW)["history_length"] == 1


def test_a_change_is_written_within_two_seconds_and_stop_writes_the_last(
    tmp_path: Path,
) -> None:
    path = tmp_path / "state.json"
    state = StateFile(path)
    events = EventHistory(on_change=state.changed)
    state.add(StoreSection(known_store()), events)
    state.start()
    try:
        started = time.monotonic()
        events.add([saved_event()], now=NOW)
        assert not path.exists()  # changed() is cheap: the writer thread writes
        wait_for(lambda: path.exists(), timeout=5)
        assert time.monotonic() - started < 2.0 + 1.0
        events.add([JobEvent(kind="durable", job="j", step=7)], now=NOW)
    finally:
        state.stop()
    assert json.loads(path.read_text())["events"]["summary"]["last_durable_step"] == 7


def test_without_a_path_nothing_is_read_or_written(tmp_path: Path) -> None:
    state = state_of(None, known_store(), EventHistory())
    state.load()
    state.start()
    state.changed()
    state.write()
    state.stop()
    assert list(tmp_path.iterdir()) == []


def test_a_section_name_is_taken_once() -> None:
    state = StateFile(None)
    state.add(EventHistory())
    for taken in (EventHistory(), type("Version", (), {"name": "version"})()):
        with pytest.raises(ValueError, match="is taken"):
            state.add(taken)


def test_a_failed_write_is_logged_not_raised(tmp_path: Path,
                                             caplog: pytest.LogCaptureFixture) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    state_of(blocker / "state.json", known_store()).write()
    assert "could not write state file" in caplog.text


def test_a_bad_required_section_sets_the_file_aside_and_loads_nothing(
    tmp_path: Path, caplog: pytest.LogCaptureFixture,
) -> None:
    path = tmp_path / "state.json"
    events = EventHistory()
    events.add([saved_event()], now=NOW)
    state_of(path, known_store(), events).write()
    data = json.loads(path.read_text())
    data["sources"]["static"]["observed_at_unix"] = "yesterday"
    path.write_text(json.dumps(data))
    store, restored = Store(["static"], stale_after=90), EventHistory()
    state_of(path, store, restored).load()
    assert store.expiry(now=NOW).expires_at_unix is None
    assert restored.body(now=NOW)["history_length"] == 0  # nothing of a file set aside
    assert (tmp_path / "state.json.bad").exists() and not path.exists()
    said = [r.getMessage() for r in caplog.records if "state file" in r.getMessage()]
    assert len(said) == 1 and "observed_at_unix must be a number" in said[0]


# ------------------------------------------------------------------ damaged files


def nested(depth: int) -> str:
    return "[" * depth + "]" * depth


def good_state(**sections: Any) -> str:
    """A state file as the daemon writes it, with ``sections`` replaced (JSON texts)."""
    entry = {"observation": {"expires_at_unix": RELEASE, "kind": "scheduled-release"},
             "observed_at_unix": time.time() - 10}
    parts = {"version": "1", "sources": json.dumps({"static": entry}), **sections}
    return "{" + ", ".join(f'"{key}": {value}' for key, value in parts.items()) + "}"


def with_entry(text: str) -> str:
    return good_state(sources='{"static": ' + text + "}")


def with_field(field: str, value: str) -> str:
    observed = json.dumps(time.time() - 10)
    if field == "observed_at_unix":
        return with_entry('{"observation": {"expires_at_unix": 1900000000}, '
                          f'"observed_at_unix": {value}}}')
    return with_entry(f'{{"observation": {{"{field}": {value}}}, "observed_at_unix": {observed}}}')


def write(text: str | bytes) -> Callable[[Path], None]:
    def make(path: Path) -> None:
        path.write_bytes(text.encode() if isinstance(text, str) else text)
    return make


def directory(path: Path) -> None:
    path.mkdir()
    (path / "inside").write_text("{}")


def directory_and_a_full_bad_one(path: Path) -> None:
    directory(path)  # and its .bad name taken by a folder that is not empty
    directory(path.with_name(path.name + ".bad"))


def fifo(path: Path) -> None:
    os.mkfifo(path)  # a plain read would wait for a writer for ever


def unix_socket(path: Path) -> None:
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(str(path))  # open() answers ENXIO; the socket file stays after close
    listener.close()


def symlink_loop(path: Path) -> None:
    path.symlink_to(path.name)  # open() answers ELOOP


def unreadable(path: Path) -> None:
    path.write_text(good_state())
    path.chmod(0)


def oversized(path: Path) -> None:
    with open(path, "wb") as handle:
        handle.write(b"{" + b" " * MAX_BYTES + b"}")


DAMAGED: dict[str, Callable[[Path], None]] = {
    # Nesting deeper than the JSON decoder's recursion limit, at every level.
    "events nested 2,000 deep": write(good_state(events=nested(2000))),
    "the whole file nested 2,000 deep": write(nested(2000)),
    "sources nested 2,000 deep": write(good_state(sources=nested(2000))),
    "an observation field nested 100,000 deep": write(with_field("kind", nested(100_000))),
    "an observation field nested 900 deep": write(with_field("kind", nested(900))),
    "a version nested 900 deep": write('{"version": ' + nested(900) + "}"),
    # Wrong types at each level.
    "a list": write("[]"),
    "a string": write('"state"'),
    "null": write("null"),
    "a version as text": write(good_state(version='"1"')),
    "no version": write('{"sources": {}}'),
    "no sources": write('{"version": 1}'),
    "sources as a list": write(good_state(sources="[]")),
    "an entry as a number": write(with_entry("5")),
    "an observation as a list": write(with_entry('{"observation": [], "observed_at_unix": 1}')),
    "a deadline as an object": write(with_field("expires_at_unix", '{"at": 1}')),
    "a kind as a list": write(with_field("kind", "[1, 2]")),
    "a time as a boolean": write(with_field("observed_at_unix", "true")),
    # Numbers no deadline can be.
    "a deadline of 400 digits": write(with_field("expires_at_unix", "9" * 400)),
    "a time of 400 digits": write(with_field("observed_at_unix", "9" * 400)),
    "a deadline of 5,000 digits": write(with_field("expires_at_unix", "9" * 5000)),
    "a deadline of 1e999": write(with_field("expires_at_unix", "1e999")),
    "a deadline of -1e999": write(with_field("expires_at_unix", "-1e999")),
    "a NaN deadline": write(with_field("expires_at_unix", "NaN")),
    "an Infinity time": write(with_field("observed_at_unix", "Infinity")),
    # Not JSON at all.
    "empty": write(b""),
    "whitespace": write(b" \n\t "),
    "cut short": write(good_state()[:40]),
    "binary garbage": write(bytes(range(256)) * 64),
    "a NUL byte inside": write(good_state().encode()[:20] + b"\x00" + good_state().encode()),
    "UTF-8 cut in a character": write(b'{"version": 1, "x": "\xe2\x82"}'),
    "larger than the bound": oversized,
    # Not a file this daemon can read.
    "a directory": directory,
    "a directory, and its .bad name taken": directory_and_a_full_bad_one,
    "a FIFO": fifo,
    "a unix socket": unix_socket,
    "a symbolic link to itself": symlink_loop,
    **({} if os.geteuid() == 0 else {"no read permission": unreadable}),  # root reads all
}


@pytest.mark.parametrize("make", DAMAGED.values(), ids=list(DAMAGED))
def test_a_damaged_state_file_is_set_aside_and_the_daemon_starts(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, make: Callable[[Path], None],
) -> None:
    state = tmp_path / "state.json"
    make(state)
    caplog.set_level(logging.INFO, logger="sidecar.host")
    with serve_daemon(sources=("static",), expires_at="2030-01-01T00:00:00Z",
                      state_file=state) as daemon:
        assert wait_for(lambda: get_json(daemon.url + "/healthz")[0] == 200)
        expiry = get_json(daemon.url + "/v1/expiry")[1]
    assert expiry["expires_at"] == "2030-01-01T00:00:00Z"  # the source's, not the file's
    said = [r.getMessage() for r in caplog.records if "ignoring state file" in r.getMessage()]
    assert len(said) == 1, said
    aside = tmp_path / "state.json.bad"
    if "kept as state.json.bad" in said[0]:
        assert aside.exists() or aside.is_symlink()
        # Set aside, not written back: the daemon's own write took its place.
        assert json.loads(state.read_text())["sources"]["static"]
    else:
        assert "could not set it aside" in said[0]


BAD_EVENTS: dict[str, str] = {
    "a number": "5",
    "nested 900 deep": nested(900),
    "a history nested 900 deep": '{"version": 1, "history": ' + nested(900) + "}",
    "a version nested 900 deep": '{"version": ' + nested(900) + "}",
    "a summary of the wrong type": '{"version": 1, "history": [], "summary": []}',
    "a step of 400 digits": '{"version": 1, "summary": {"last_save_step": ' + "9" * 400 + "}}",
    "a NaN time": '{"version": 1, "summary": {"last_save_at_unix": NaN}}',
    "an event as a string": '{"version": 1, "history": ["stop"]}',
}


@pytest.mark.parametrize("section", BAD_EVENTS.values(), ids=list(BAD_EVENTS))
def test_a_bad_events_section_of_any_shape_is_ignored_and_the_deadline_kept(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, section: str,
) -> None:
    state = tmp_path / "state.json"
    state.write_text(good_state(events=section))
    caplog.set_level(logging.INFO, logger="sidecar.host")
    # The source fails, so only the state file can give the deadline.
    with serve_daemon(sources=("static",), expires_at="not-a-time",
                      state_file=state) as daemon:
        expiry = get_json(daemon.url + "/v1/expiry")[1]
        body = get_json(daemon.url + "/v1/events")[1]
    assert expiry["expires_at_unix"] == RELEASE and expiry["stale"] is True
    assert body["history_length"] == 0
    said = [r.getMessage() for r in caplog.records if "state file" in r.getMessage()
            and "ignoring" in r.getMessage()]
    assert len(said) == 1 and "the deadline is kept" in said[0], said
    assert not (tmp_path / "state.json.bad").exists()


# ------------------------------------------------------------------ the real process


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def test_a_state_file_nested_too_deeply_no_longer_crash_loops_the_daemon(
    tmp_path: Path,
) -> None:
    """Issue 22, item 6: 2,000 nested '[' in the events section made the loader raise
    RecursionError; ``serve`` exited with code 3, the file still in place, so systemd
    restarted it into the same crash."""
    state = tmp_path / "state.json"
    state.write_text(good_state(events=nested(2000)))
    port = free_port()
    process = subprocess.Popen(
        [sys.executable, "-m", "sidecar.cli", "serve", "--source", "static",
         "--expires-at", "2030-01-01T00:00:00Z", "--listen", f"127.0.0.1:{port}",
         "--state-file", str(state)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    try:
        def healthy() -> bool:
            if process.poll() is not None:
                raise AssertionError(f"serve exited with code {process.returncode}")
            answer = fetch_json(f"http://127.0.0.1:{port}/healthz")
            return answer is not None and answer[0] == 200
        wait_for(healthy, timeout=30)
        assert (tmp_path / "state.json.bad").read_text().count("[") == 2000
        process.send_signal(signal.SIGTERM)
        process.wait(10)
    finally:
        if process.poll() is None:
            process.kill()
        process.wait(10)
    output = process.stdout.read() if process.stdout else ""
    said = [line for line in output.splitlines() if "ignoring state file" in line]
    assert len(said) == 1 and "kept as state.json.bad" in said[0], output
    assert json.loads(state.read_text())["sources"]["static"]  # a good file in its place
