"""Job events (issue 14, item 1): the guard tells its node's daemon what happens, without a
step ever waiting for it; the daemon validates, bounds, keeps (state file included), serves
``GET /v1/events`` and exports ``/metrics``, and never lets an event touch the deadline.

The real daemon on loopback (``serve_daemon``), the real guard and client over real HTTP.
Fakes only at the outer edge: a closed port, a socket that accepts and never answers, and
a stdlib server standing in for a daemon older than ``/v1/events``.
"""

from __future__ import annotations

import http.client
import http.server
import json
import logging
import socket
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Optional
from urllib.parse import urlsplit

import pytest
from daemon_harness import get_json, serve_daemon, wait_for

from sidecar.host.features.events.history import (
    HISTORY_LENGTH,
    MAX_TRACKED_JOBS,
    EventHistory,
    JobEvent,
)
from sidecar.train import event_sender as sender_module
from sidecar.train.client import SidecarClient
from sidecar.train.guard import CheckpointGuard
from sidecar.train.policy import SavePolicy

TOKEN = "0123456789abcdef0123456789abcdef"
# A step that waited for the daemon would take the client's whole timeout (0.2 s).
STEP_BOUND_SECONDS = 0.05


@pytest.fixture(autouse=True)
def _clean_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("MLP_CURRENT_CAPACITY_BLOCK_EXPIRATION_TIMESTAMP",
                 "SAGEMAKER_CURRENT_CAPACITY_BLOCK_EXPIRATION_TIMESTAMP", "ESI_SIDECAR_URL",
                 "ESI_SIDECAR_TOKEN", "RANK"):
        monkeypatch.delenv(name, raising=False)


def static_daemon(expires_in: float = 3600.0, **overrides: Any) -> Any:
    overrides.setdefault("sources", ("static",))
    overrides.setdefault("expires_at", repr(time.time() + expires_in))
    return serve_daemon(**overrides)


def post(url: str, body: Any = None, raw: Optional[bytes] = None,
         headers: Optional[dict[str, str]] = None) -> tuple[int, Any]:
    data = raw if raw is not None else json.dumps(body).encode()
    request = urllib.request.Request(url + "/v1/events", data=data, method="POST",
                                     headers={"Content-Type": "application/json",
                                              **(headers or {})})
    try:
        with urllib.request.urlopen(request, timeout=5) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read() or b"{}")


def events(url: str, limit: int = 100) -> dict[str, Any]:
    status, body = get_json(f"{url}/v1/events?limit={limit}")
    assert status == 200, body
    return body  # type: ignore[no-any-return]


def metrics(url: str) -> dict[str, float]:
    with urllib.request.urlopen(url + "/metrics", timeout=5) as response:
        text = response.read().decode()
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
            for line in text.splitlines() if line and not line.startswith("#")}


def event(kind: str = "save-finished", **fields: Any) -> dict[str, Any]:
    body: dict[str, Any] = {"kind": kind, "job": "host-a:100", **fields}
    if kind == "save-finished":
        body.setdefault("seconds", 1.5)
    return body


def closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class SilentServer:
    """Accepts connections and never answers (a hung daemon); counts the connections and
    how many were open at once."""

    def __init__(self) -> None:
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._held: list[socket.socket] = []
        self.accepted = 0
        self.url = f"http://127.0.0.1:{self._listener.getsockname()[1]}"
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                connection, _ = self._listener.accept()
            except OSError:
                return
            self.accepted += 1
            self._held.append(connection)

    def open_connections(self) -> int:
        """Connections the peer has not closed yet (a closed one reads as EOF)."""
        still = 0
        for connection in self._held:
            connection.setblocking(False)
            try:
                while True:
                    data = connection.recv(65536)
                    if not data:
                        break
            except BlockingIOError:
                still += 1
            except OSError:
                pass
        return still

    def close(self) -> None:
        self._listener.close()
        for connection in self._held:
            connection.close()


@pytest.fixture
def silent_server() -> Iterator[SilentServer]:
    server = SilentServer()
    try:
        yield server
    finally:
        server.close()


def guard_for(url: str, **options: Any) -> CheckpointGuard:
    options.setdefault("environ", {})
    options.setdefault("wait_for_release", False)
    policy = options.pop("policy", SavePolicy(save_seconds=100.0, top_up_seconds=None))
    return CheckpointGuard(SidecarClient(url), policy, **options)


# ------------------------------------------------------------------ round trip


def test_a_guard_run_reaches_the_history_and_the_metrics() -> None:
    with static_daemon(200) as daemon:
        guard = guard_for(daemon.url, job="train-7")
        guard.record_step(1.0)
        assert guard.should_save() is True  # 200 s left <= 1 + 100 + 120
        with guard.saving(step=7):
            pass
        assert guard.should_stop() is True
        guard.client.close()  # sends what is queued before it returns
        body = events(daemon.url)
        values = metrics(daemon.url)
        scraped = time.time()
    kinds = [e["kind"] for e in body["events"]]
    assert kinds == ["stop", "durable", "save-finished", "save-started", "step-estimate"]
    assert {e["job"] for e in body["events"]} == {"train-7"}
    finished = body["events"][2]
    assert finished["step"] == 7 and finished["save"] == "final" and finished["seconds"] >= 0
    assert 150 < finished["remaining_seconds"] <= 200
    summary = body["summary"]
    assert summary["job"] == "train-7" and summary["state"] == "stopped"
    assert summary["last_save_step"] == 7 and summary["last_save"] == "final"
    assert summary["last_durable_step"] == 7  # no uploader: the local save counts
    assert summary["budget_seconds"] == 221.0 and summary["step_seconds"] == 1.0
    assert 0 <= summary["last_save_age_seconds"] < 5
    assert body["received_total"] == 5 and body["history_length"] == 5
    assert values["esi_sidecar_job_last_save_step"] == 7
    assert values["esi_sidecar_job_last_durable_step"] == 7
    assert 0 <= scraped - values["esi_sidecar_job_last_save_timestamp_seconds"] < 5
    assert values["esi_sidecar_job_last_save_duration_seconds"] == finished["seconds"]
    assert values["esi_sidecar_job_budget_seconds"] == 221.0
    assert 150 < values["esi_sidecar_job_deadline_timestamp_seconds"] - scraped <= 200
    assert values["esi_sidecar_events_received_total"] == 5
    assert values['esi_sidecar_events_dropped_total{reason="rate"}'] == 0


def test_the_wait_for_the_release_and_the_stop_are_told() -> None:
    # A release 1.9 s ahead with a rule scaled to seconds (0.01 + 0.5 + 1.5 s budget): the
    # final save at once, then the wait, then the release.
    with static_daemon(1.9) as daemon:
        guard = guard_for(daemon.url, wait_for_release=True, refresh_seconds=0.1,
                          policy=SavePolicy(save_seconds=0.5, redundant_seconds=1.5,
                                            top_up_seconds=None))
        guard.record_step(0.01)
        assert guard.should_save() is True
        guard.record_save(0.2, step=3, committed=lambda: True)
        assert guard.should_stop() is True and guard.released
        guard.client.close()
        body = events(daemon.url)
    kinds = [e["kind"] for e in body["events"]]
    assert kinds[0] == "stop" and body["events"][0]["released"] is True
    assert "waiting" in kinds and "durable" in kinds
    finished = next(e for e in body["events"] if e["kind"] == "save-finished")
    assert finished["asynchronous"] is True and finished["seconds"] == 0.2
    assert "save-started" not in kinds  # record_save(): the caller timed the save itself


def test_events_off_sends_nothing() -> None:
    with static_daemon(200) as daemon:
        guard = guard_for(daemon.url, events=False)
        guard.record_step(1.0)
        assert guard.should_save() is True
        with guard.saving(step=1):
            pass
        guard.should_stop()
        guard.client.close()
        assert events(daemon.url)["received_total"] == 0
        assert guard.client.events_sent == 0


def test_the_rank_comes_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RANK", "3")
    with static_daemon() as daemon:
        guard = guard_for(daemon.url)
        guard.should_save()
        guard.client.close()
        newest = events(daemon.url)["events"][0]
    assert newest["kind"] == "step-estimate" and newest["rank"] == 3
    assert newest["job"].endswith(f":{__import__('os').getpid()}")


# ------------------------------------------------------------------ never waits


def _timed_steps(guard: CheckpointGuard, steps: int) -> list[float]:
    """Each step: a decision and a save (two events), timed on its own."""
    durations = []
    for step in range(steps):
        started = time.perf_counter()
        guard.should_save()
        with guard.saving(step=step):
            pass
        durations.append(time.perf_counter() - started)
    return durations


def test_a_hung_daemon_never_delays_a_step(silent_server: SilentServer) -> None:
    # The deadline is asked once (and times out once, the deadline's own cost); after that
    # every step is the cached path plus two events for the daemon that never answers.
    guard = guard_for(silent_server.url, refresh_seconds=3600, daemon_retry_seconds=3600)
    guard.should_save()
    client = guard.client
    durations = _timed_steps(guard, 300)
    assert max(durations) < STEP_BOUND_SECONDS, max(durations)
    # One request at a time, each ended by the client's timeout: over the run, the first
    # one and at most one more after the 5 s retry, never one per event.
    assert silent_server.accepted <= 3  # the deadline's connection + the sender's
    wait_for(lambda: client.events_dropped > 0, timeout=5)
    # 600 events against a queue of 256: the oldest were dropped and counted, none sent.
    assert client.events_sent == 0
    assert client.events_dropped >= 600 - sender_module.MAX_QUEUED_EVENTS - 50
    started = time.perf_counter()
    client.close()  # bounded: two timeouts at most, though the daemon never answers
    assert time.perf_counter() - started < 2 * client.timeout + 0.3


def test_a_dead_daemon_never_delays_a_step() -> None:
    guard = guard_for(f"http://127.0.0.1:{closed_port()}", refresh_seconds=3600,
                      daemon_retry_seconds=3600)
    guard.should_save()
    durations = _timed_steps(guard, 200)
    assert max(durations) < STEP_BOUND_SECONDS, max(durations)
    client = guard.client
    sender = client._events
    assert sender is not None
    wait_for(lambda: "refused" in (sender.last_error or ""), timeout=5)
    assert client.events_sent == 0 and client.events_dropped > 0
    client.close()


def test_at_most_one_event_request_in_flight(silent_server: SilentServer,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sender_module, "EVENT_RETRY_SECONDS", 0.0)
    client = SidecarClient(silent_server.url)
    for _ in range(40):
        client.send_event({"kind": "step-estimate", "job": "j"})
        time.sleep(0.02)
    # With no pause between tries, each request still waits its timeout out alone.
    assert silent_server.open_connections() <= 1
    assert 2 <= silent_server.accepted <= 8  # about 0.8 s of 0.2 s timeouts, one by one
    client.close()


def test_the_sender_thread_ends_when_idle(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sender_module, "EVENT_IDLE_SECONDS", 0.05)
    with static_daemon() as daemon:
        client = SidecarClient(daemon.url)
        client.send_event(event("step-estimate"))
        wait_for(lambda: client.events_sent == 1)
        sender = client._events
        assert sender is not None
        # This client's thread (others' may live on from earlier tests in the process);
        # it may be gone already.
        first = sender._thread
        if first is not None:
            first.join(10)
            assert not first.is_alive()
        wait_for(lambda: sender._thread is None)
        client.send_event(event("step-estimate"))  # a new thread, started lazily
        wait_for(lambda: client.events_sent == 2)
        client.close()


class OldDaemon(http.server.BaseHTTPRequestHandler):
    """A daemon older than /v1/events: it answers POST /v1/events with a 404."""

    posts = 0

    def do_POST(self) -> None:
        type(self).posts += 1
        self.send_response(404)
        self.send_header("Content-Length", "2")
        self.end_headers()
        self.wfile.write(b"{}")

    def log_message(self, *args: Any) -> None:
        pass


def test_a_daemon_without_events_gets_no_more_after_its_404() -> None:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), OldDaemon)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        client = SidecarClient(f"http://127.0.0.1:{server.server_address[1]}")
        client.send_event(event("step-estimate"))
        wait_for(lambda: client.events_dropped == 1)
        for _ in range(20):
            client.send_event(event("step-estimate"))
        time.sleep(0.3)
        assert OldDaemon.posts == 1 and client.events_dropped == 21
        client.close()
    finally:
        server.shutdown()
        server.server_close()


# ------------------------------------------------------------------ bad input


@pytest.mark.parametrize(("body", "named"), [
    (event(seconds=-1.0), "seconds: Input should be greater than or equal to 0"),
    (event(step=-3), "step: Input should be greater than or equal to 0"),
    (event(step=1.5), "step: Input should be a valid integer"),
    (event(step="12"), "step: Input should be a valid integer"),
    (event(job="x" * 10_000), "job: String should have at most 128 characters"),
    (event(reason="y" * 301), "reason: String should have at most 300 characters"),
    (event(reason="two\nlines"), "reason: String should match pattern"),
    (event(kind="exploded"), "kind: Input should be 'step-estimate'"),
    (event(bogus=1), "bogus: Extra inputs are not permitted"),
    (event(at_unix=time.time() - 3 * 86400), "at_unix: Value error, must be within a day"),
    (event(asynchronous=1), "asynchronous: Input should be a valid boolean"),
    ({"kind": "save-finished", "job": "j"}, "save-finished needs seconds"),
    ({"kind": "stop"}, "job: Field required"),
    ([event(), event(seconds=-2.0)], "[1].seconds: Input should be greater than or equal"),
    ([], "List should have at least 1 item"),
    ([event()] * 101, "List should have at most 100 items"),
    ("a string", "Input should be an object"),
])
def test_nonsense_gets_a_422_naming_the_field(body: Any, named: str) -> None:
    with static_daemon() as daemon:
        status, answer = post(daemon.url, body)
        assert status == 422 and named in answer["error"], answer
        assert events(daemon.url)["history_length"] == 0  # a batch is all or nothing
        rejected = metrics(daemon.url)['esi_sidecar_event_requests_rejected_total'
                                       '{reason="invalid"}']
        assert rejected == 1


def test_not_json_and_non_finite_numbers_get_a_422() -> None:
    with static_daemon() as daemon:
        assert post(daemon.url, raw=b"{not json")[0] == 422
        status, answer = post(daemon.url, raw=b'{"kind": "save-finished", "job": "j", '
                                               b'"seconds": NaN}')
        assert status == 422 and "seconds: Input should be a finite number" in answer["error"]
        assert events(daemon.url)["rejected"] == {"invalid": 2, "too-large": 0}


def test_a_body_over_64_kib_gets_a_413_and_is_not_read() -> None:
    with static_daemon() as daemon:
        status, answer = post(daemon.url, raw=b"[" + b" " * (64 * 1024) + b"]")
        assert status == 413 and "body" in answer["error"]
        # A declared length over the bound is refused before any of it is read.
        parts = urlsplit(daemon.url)
        connection = http.client.HTTPConnection(parts.hostname, parts.port, timeout=5)
        connection.putrequest("POST", "/v1/events")
        connection.putheader("Content-Length", str(10**9))
        connection.endheaders()
        assert connection.getresponse().status == 413
        connection.close()
        assert events(daemon.url)["rejected"]["too-large"] == 2


def test_steps_going_backwards_are_kept_and_flagged() -> None:
    # A job may roll back to an older checkpoint (a loss spike): what it did is shown,
    # flagged, and counted; another job or rank has steps of its own.
    with static_daemon() as daemon:
        assert post(daemon.url, [event(step=120), event(step=80),
                                 event(step=10, job="other:1"),
                                 event(step=90, rank=1)])[1] == {
            "accepted": 4, "dropped": 0, "flagged": 1}
        body = events(daemon.url)
        values = metrics(daemon.url)
    flagged = [e for e in body["events"] if "flag" in e]
    assert [(e["step"], e["flag"]) for e in flagged] == [(80, "step went backwards: 80 "
                                                          "after 120")]
    assert body["summary"]["last_save_step"] == 90  # the newest, as it happened
    assert values['esi_sidecar_events_flagged_total{reason="step-backwards"}'] == 1


def test_a_flood_is_rate_limited_dropped_and_counted() -> None:
    with static_daemon() as daemon:
        started = time.monotonic()
        answers = [post(daemon.url, [event("step-estimate")] * 100)[1] for _ in range(10)]
        elapsed = time.monotonic() - started
        body = events(daemon.url, limit=0)
        values = metrics(daemon.url)
    accepted = sum(a["accepted"] for a in answers)
    dropped = sum(a["dropped"] for a in answers)
    assert accepted + dropped == 1000
    assert 200 <= accepted <= 200 + 20 * elapsed + 1  # the burst, then 20 a second
    assert body["received_total"] == accepted and body["dropped"] == {"rate": dropped}
    assert body["events"] == [] and body["history_length"] == accepted
    assert values['esi_sidecar_events_dropped_total{reason="rate"}'] == dropped


def test_the_history_and_the_tracked_jobs_stay_bounded() -> None:
    history = EventHistory(rate_per_second=1e9, burst=1e9)
    for index in range(5_000):
        history.add([JobEvent(kind="save-started", job=f"job-{index}", step=index,
                              reason="r" * 300)])
    body = history.body(limit=10_000)
    assert body["history_length"] == HISTORY_LENGTH == len(body["events"])
    assert body["events"][0]["job"] == "job-4999"  # the newest kept, the oldest gone
    assert len(history._last_steps) == MAX_TRACKED_JOBS
    assert body["received_total"] == 5_000


def test_limit_takes_digits_only_and_lists_newest_first() -> None:
    with static_daemon() as daemon:
        post(daemon.url, [event(step=step) for step in range(5)])
        assert [e["step"] for e in events(daemon.url, limit=2)["events"]] == [4, 3]
        assert len(events(daemon.url)["events"]) == 5  # default 100
        for bad in ("1.0", "+5", "-1", "501", "1_000", "%205", "true"):
            status, answer = get_json(f"{daemon.url}/v1/events?limit={bad}")
            assert status == 422 and answer["error"].startswith("limit"), (bad, answer)


# ------------------------------------------------------------------ the deadline


def test_events_never_change_the_deadline() -> None:
    with static_daemon(5000) as daemon:
        wait_for(lambda: daemon.store.health().ok)
        before = get_json(daemon.url + "/v1/expiry")[1]
        post(daemon.url, [event("step-estimate", remaining_seconds=5.0, budget_seconds=1.0),
                          event("stop", released=True, reason="the release time has passed"),
                          event("waiting", remaining_seconds=-100.0)])
        after = get_json(daemon.url + "/v1/expiry")[1]
        _, decision = get_json(daemon.url + "/v1/decision?step_seconds=1")
        values = metrics(daemon.url)
        scraped = time.time()
    assert after["expires_at_unix"] == before["expires_at_unix"]
    assert 4990 < after["remaining_seconds"] <= 5000 and decision["save_now"] is False
    assert values["esi_sidecar_deadline_timestamp_seconds"] == before["expires_at_unix"]
    # the job's word, apart
    assert values["esi_sidecar_job_deadline_timestamp_seconds"] - scraped <= -100.0


def test_the_history_survives_a_restart(tmp_path: Path) -> None:
    state = tmp_path / "state.json"
    with static_daemon(state_file=state) as daemon:
        post(daemon.url, [event(step=5, save="final"), event("durable", step=5)])
    with static_daemon(state_file=state) as daemon:
        body = events(daemon.url)
        post(daemon.url, event(step=4))  # the restored steps still count: flagged
        flagged = events(daemon.url)["events"][0].get("flag")
    assert [e["kind"] for e in body["events"]] == ["durable", "save-finished"]
    assert body["summary"]["last_durable_step"] == 5 and body["summary"]["last_save"] == "final"
    assert flagged == "step went backwards: 4 after 5"
    assert json.loads(state.read_text())["sources"]["static"]  # the deadline's part is there


def test_events_reach_the_state_file_while_the_daemon_runs(tmp_path: Path) -> None:
    # Not only at shutdown: a crash loses at most the last couple of seconds.
    state = tmp_path / "state.json"
    with static_daemon(state_file=state) as daemon:
        post(daemon.url, event(step=9))
        wait_for(lambda: state.exists() and json.loads(state.read_text()).get(
            "events", {}).get("summary", {}).get("last_save_step") == 9, timeout=10)


@pytest.mark.parametrize("section", [
    "not an object",
    {"version": 99, "history": []},
    {"version": 1, "history": [{"kind": "save-finished", "job": "j", "seconds": -1,
                                "at_unix": 1.8e9, "received_at_unix": 1.8e9}]},
    {"version": 1, "history": [{"kind": "stop", "job": "j"}]},  # no received_at_unix
    {"version": 1, "history": [], "summary": {"last_save_step": "7"}},
    {"version": 1, "history": [], "surprise": True},
])
def test_a_bad_events_section_is_dropped_and_the_deadline_kept(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, section: Any
) -> None:
    state = tmp_path / "state.json"
    with static_daemon(state_file=state) as daemon:
        wait_for(lambda: daemon.store.health().ok)
        post(daemon.url, event(step=1))
        deadline = get_json(daemon.url + "/v1/expiry")[1]["expires_at_unix"]
    data = json.loads(state.read_text())
    data["events"] = section
    state.write_text(json.dumps(data))
    caplog.set_level(logging.INFO, logger="sidecar.host")
    # The source fails now, so only the state file can give the deadline.
    with static_daemon(state_file=state, expires_at="not-a-time") as daemon:
        expiry = get_json(daemon.url + "/v1/expiry")[1]
        body = events(daemon.url)
    assert expiry["expires_at_unix"] == deadline and expiry["stale"] is True
    assert body["history_length"] == 0 and body["summary"]["last_save_step"] is None
    said = [r.getMessage() for r in caplog.records if "job events in state file" in
            r.getMessage()]
    assert len(said) == 1 and "the deadline is kept" in said[0]
    assert not (tmp_path / "state.json.bad").exists()  # the deadline's part was good


# ------------------------------------------------------------------ auth and HEAD


def test_post_works_through_the_token_wrapper_and_head_answers() -> None:
    # Loopback needs no token even when one is set (beyond loopback: tests/host/test_auth.py).
    with static_daemon(token=TOKEN) as daemon:
        assert post(daemon.url, event(step=1))[0] == 202
        assert post(daemon.url, event(step=2),
                    headers={"Authorization": f"Bearer {TOKEN}"})[0] == 202
        client = SidecarClient(daemon.url, token=TOKEN)
        client.send_event(event(step=3))
        client.close()
        parts = urlsplit(daemon.url)
        connection = http.client.HTTPConnection(parts.hostname, parts.port, timeout=5)
        connection.request("HEAD", "/v1/events")
        head = connection.getresponse()
        assert head.status == 200 and head.read() == b""
        connection.close()
        assert [e["step"] for e in events(daemon.url)["events"]] == [3, 2, 1]
        _, schema = get_json(daemon.url + "/openapi.json")
    assert {"get", "post"} <= set(schema["paths"]["/v1/events"])
    request_body = schema["paths"]["/v1/events"]["post"]["requestBody"]
    assert "seconds" in json.dumps(request_body)
