"""The training-side client against the real daemon on loopback.

Fakes only at the outer edge: a closed port, a socket that never answers, and a tiny
stdlib HTTP server standing in for a *broken* peer (garbage the real daemon cannot be made
to send). Everything else talks to the real daemon through ``serve_daemon``. The guard's
own behaviour: test_guard.py.
"""

from __future__ import annotations

import contextlib
import http.server
import logging
import socket
import threading
import time
from collections.abc import Iterator
from typing import Callable

import pytest
from daemon_harness import serve_daemon, wait_for
from guard_support import (  # noqa: F401  (clean_environment: a fixture)
    MLP,
    SAGEMAKER,
    TRAIN_LOGGER,
    CountingClient,
    FakeMonotonic,
    clean_environment,
    closed_port,
    good_body,
    simple_guard,
    static_daemon,
)

from sidecar.models import Expiry
from sidecar.train.client import DEFAULT_URL, SidecarClient
from sidecar.train.deadline import DeadlineTracker, env_deadline
from sidecar.train.guard import (
    CheckpointGuard,
)
from sidecar.train.policy import SavePolicy

# ------------------------------------------------------------------ client: real daemon


def test_expiry_from_the_real_daemon() -> None:
    deadline = time.time() + 200.0
    with static_daemon(deadline) as daemon, SidecarClient(daemon.url) as client:
        answer = client.expiry()
        assert answer is not None
        assert answer.expires_at_unix == pytest.approx(deadline, abs=1e-3)
        assert answer.source == "static"
        assert client.last_error is None
        assert client.deadline_unix() == pytest.approx(deadline, abs=1e-3)


def test_keep_alive_connection_is_reused() -> None:
    with static_daemon(time.time() + 500) as daemon, SidecarClient(daemon.url) as client:
        assert client.expiry() is not None
        first = client._endpoints[0]._connection
        assert first is not None and first.sock is not None
        local_address = first.sock.getsockname()
        for _ in range(5):
            assert client.expiry() is not None
        again = client._endpoints[0]._connection
        assert again is first and again.sock is not None
        assert again.sock.getsockname() == local_address


class ConnectionCounter:
    """A TCP relay on loopback in front of a daemon that counts the connections it accepts.

    Real sockets both ways, so it sees what the daemon would see: a new connection per
    request, or one kept-alive connection for many.
    """

    def __init__(self, target_url: str) -> None:
        host, port = target_url.rsplit("//", 1)[1].rsplit(":", 1)
        self._target = (host, int(port))
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._sockets: list[socket.socket] = []
        self.accepted = 0
        self.url = f"http://127.0.0.1:{self._listener.getsockname()[1]}"
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                downstream, _ = self._listener.accept()
            except OSError:
                return  # closed
            self.accepted += 1
            upstream = socket.create_connection(self._target)
            self._sockets += [downstream, upstream]
            for source, sink in ((downstream, upstream), (upstream, downstream)):
                threading.Thread(target=self._pump, args=(source, sink), daemon=True).start()

    @staticmethod
    def _pump(source: socket.socket, sink: socket.socket) -> None:
        try:
            while data := source.recv(65536):
                sink.sendall(data)
        except OSError:
            pass
        finally:
            with contextlib.suppress(OSError):
                sink.shutdown(socket.SHUT_WR)

    def close(self) -> None:
        self._listener.close()
        for sock in self._sockets:
            sock.close()


def test_keep_alive_one_connection_for_many_requests() -> None:
    # Behaviour, not speed (speed is benchmarks/'s job): twenty requests travel over one
    # TCP connection, with Nagle off so that a small request is never held back.
    with static_daemon(time.time() + 500) as daemon:
        counter = ConnectionCounter(daemon.url)
        try:
            with SidecarClient(counter.url) as client:
                for _ in range(20):
                    assert client.expiry() is not None, client.last_error
                assert counter.accepted == 1
                connection = client._endpoints[0]._connection
                assert connection is not None and connection.sock is not None
                nodelay = connection.sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)
                assert nodelay != 0
                # A peer that drops the connection costs one new connection, not one per
                # request from then on.
                connection.sock.shutdown(socket.SHUT_RDWR)
                for _ in range(5):
                    assert client.expiry() is not None, client.last_error
                assert counter.accepted == 2
        finally:
            counter.close()


def test_reconnects_after_the_daemon_restarts() -> None:
    deadline = time.time() + 300.0
    with static_daemon(deadline) as daemon:
        port = int(daemon.url.rsplit(":", 1)[1])
        client = SidecarClient(daemon.url)
        assert client.expiry() is not None
    # Stopped: refused, not raised.
    assert client.expiry() is None
    assert client.last_error == f"{daemon.url}: connection refused"
    with static_daemon(deadline + 60, listen=(("127.0.0.1", port),)):
        answer = client.expiry()
        assert answer is not None, client.last_error
        assert answer.expires_at_unix == pytest.approx(deadline + 60, abs=1e-3)
        assert client.last_error is None
    client.close()


def test_stale_keep_alive_connection_is_retried_once() -> None:
    with static_daemon(time.time() + 300) as daemon, SidecarClient(daemon.url) as client:
        assert client.expiry() is not None
        connection = client._endpoints[0]._connection
        assert connection is not None and connection.sock is not None
        connection.sock.shutdown(socket.SHUT_RDWR)  # as if the peer had dropped it
        assert client.expiry() is not None
        assert client.last_error is None


def test_earliest_deadline_wins_across_urls() -> None:
    now = time.time()
    with static_daemon(now + 900) as late, static_daemon(now + 300) as early:
        client = SidecarClient(f"{late.url}, {early.url}")
        assert client.deadline_unix() == pytest.approx(now + 300, abs=1e-3)
        assert client.urls == (late.url, early.url)
        # One node's daemon down: the others still answer; the error is kept.
        dead = f"http://127.0.0.1:{closed_port()}"
        partial = SidecarClient([late.url, dead])
        assert partial.deadline_unix() == pytest.approx(now + 900, abs=1e-3)
        assert partial.last_error == f"{dead}: connection refused"


def test_a_failing_daemon_keeps_its_last_deadline(caplog: pytest.LogCaptureFixture) -> None:
    # verl's single controller asks every node's daemon. When the node with the earliest
    # deadline stops answering, its deadline must not vanish from the MIN: that node is
    # still released then.
    now = time.time()
    with static_daemon(now + 900) as late:
        with static_daemon(now + 300) as early:
            early_url, port = early.url, int(early.url.rsplit(":", 1)[1])
            client = SidecarClient([late.url, early.url])
            assert client.deadline_unix() == pytest.approx(now + 300, abs=1e-3)
            assert client.last_error is None and client.degraded_urls == ()
        with caplog.at_level(logging.INFO, logger=TRAIN_LOGGER):
            for _ in range(5):  # once per change, not once per request
                answer = client.expiry()
                assert answer is not None
                assert answer.expires_at_unix == pytest.approx(now + 300, abs=1e-3)
                assert answer.stale is True
                assert client.last_error == f"{early_url}: connection refused"
                assert client.degraded_urls == (early_url,)
            with static_daemon(now + 600, listen=(("127.0.0.1", port),)):
                for _ in range(3):
                    assert client.deadline_unix() == pytest.approx(now + 600, abs=1e-3)
                    assert client.last_error is None and client.degraded_urls == ()
    messages = [(r.levelno, r.getMessage()) for r in caplog.records
                if r.name.startswith(TRAIN_LOGGER)]
    assert [level for level, _ in messages] == [logging.WARNING, logging.INFO]
    assert early_url in messages[0][1] and "last known deadline" in messages[0][1]
    client.close()


def test_a_daemon_answering_stale_without_deadline_keeps_its_last_deadline(
    broken_peer: Callable[[int, bytes], str],
) -> None:
    # A daemon restarted without its state file while the cloud API fails answers
    # "stale, no deadline": that says nothing new, so its last deadline still counts.
    deadline = time.time() + 300
    url = broken_peer(200, good_body(expires_at_unix=deadline))
    client = SidecarClient(url)
    assert client.deadline_unix() == pytest.approx(deadline)
    broken_peer(200, good_body(expires_at_unix=None, stale=True, error="API down"))
    answer = client.expiry()
    assert answer is not None and answer.stale is True
    assert answer.expires_at_unix == pytest.approx(deadline)
    assert answer.error is not None and "API down" in answer.error
    assert client.last_error is None  # it did answer
    assert client.degraded_urls == (url,)
    # A fresh "nothing scheduled" is news: the deadline is gone.
    broken_peer(200, good_body(expires_at_unix=None))
    assert client.deadline_unix() is None
    assert client.degraded_urls == ()
    broken_peer(200, good_body(expires_at_unix=None, stale=True))
    assert client.deadline_unix() is None


def test_url_from_environment_list(monkeypatch: pytest.MonkeyPatch) -> None:
    now = time.time()
    with static_daemon(now + 900) as late, static_daemon(now + 300) as early:
        monkeypatch.setenv("ESI_SIDECAR_URL", f"{late.url},{early.url}")
        client = SidecarClient()
        assert client.urls == (late.url, early.url)
        assert client.deadline_unix() == pytest.approx(now + 300, abs=1e-3)


def test_default_url_and_bad_environment_entries(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    assert SidecarClient().urls == (DEFAULT_URL,)
    monkeypatch.setenv("ESI_SIDECAR_URL", "ftp://nowhere, http://127.0.0.1:9/")
    with caplog.at_level(logging.WARNING, logger=TRAIN_LOGGER):
        client = SidecarClient()
    assert client.urls == ("http://127.0.0.1:9",)
    assert "ignoring ESI_SIDECAR_URL entry" in caplog.text
    monkeypatch.setenv("ESI_SIDECAR_URL", "not a url")
    assert SidecarClient().urls == (DEFAULT_URL,)


@pytest.mark.parametrize(
    ("kwargs", "named"),
    [
        ({"url": "ftp://127.0.0.1:1"}, "http://"),
        ({"url": "http://127.0.0.1:99999"}, "port"),
        ({"url": ""}, "url"),
        ({"timeout": 0}, "timeout"),
        ({"timeout": -1.0}, "timeout"),
        ({"timeout": float("nan")}, "timeout"),
    ],
)
def test_bad_arguments_fail_at_construction(kwargs: dict, named: str) -> None:
    with pytest.raises(ValueError, match=named):
        SidecarClient(**kwargs)


# ------------------------------------------------------------------ client: dead daemon


def test_connection_refused_returns_none() -> None:
    url = f"http://127.0.0.1:{closed_port()}"
    client = SidecarClient(url)
    started = time.monotonic()
    assert client.expiry() is None
    assert client.deadline_unix() is None
    assert time.monotonic() - started < 1.0
    assert client.last_error == f"{url}: connection refused"


def test_hung_daemon_times_out_quickly(silent_listener: str) -> None:
    client = SidecarClient(silent_listener, timeout=0.2)
    started = time.monotonic()
    assert client.expiry() is None
    elapsed = time.monotonic() - started
    assert elapsed < 1.0  # ~0.2 s; a generous bound, not a timing test
    assert client.last_error == f"{silent_listener}: no answer within 0.2 s"


# ------------------------------------------------------------------ client: broken peers


class _BrokenPeer(http.server.BaseHTTPRequestHandler):
    """Answers every GET with whatever the test put in ``server.reply``."""

    protocol_version = "HTTP/1.1"

    def do_GET(self) -> None:
        status, body = self.server.reply  # type: ignore[attr-defined]
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:
        pass


@pytest.fixture
def broken_peer() -> Iterator[Callable[[int, bytes], str]]:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _BrokenPeer)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)
    thread.start()

    def serve(status: int, body: bytes) -> str:
        server.reply = (status, body)  # type: ignore[attr-defined]
        return f"http://127.0.0.1:{server.server_address[1]}"

    try:
        yield serve
    finally:
        server.shutdown()
        server.server_close()


class _ClosingPeer(_BrokenPeer):
    protocol_version = "HTTP/1.0"  # "Connection: close" after every answer


def test_an_answer_that_closes_the_connection_is_read_whole() -> None:
    # http.client closes the connection as soon as the headers say it will close, before
    # the body is read: the body must still arrive (it was "Bad file descriptor").
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _ClosingPeer)
    server.reply = (200, good_body())  # type: ignore[attr-defined]
    threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True).start()
    try:
        with SidecarClient(f"http://127.0.0.1:{server.server_address[1]}") as client:
            for _ in range(3):
                answer = client.expiry()
                assert answer is not None and answer.source == "static", client.last_error
    finally:
        server.shutdown()
        server.server_close()


@pytest.mark.parametrize(
    ("status", "body", "expected"),
    [
        (200, b"<html>not json</html>", "malformed JSON"),
        (200, b"\xff\xfe\x00", "malformed JSON"),
        (200, b"[1, 2, 3]", "expected a JSON object"),
        (200, good_body(expires_at_unix="tomorrow"), "expires_at_unix"),
        (200, good_body(stale="no"), "stale"),
        (200, good_body(server_time_unix=None), "server_time_unix"),
        (200, b'{"expires_at_unix": NaN, "server_time_unix": 1}', "not finite"),
        (500, b'{"detail": "boom"}', "HTTP 500"),
        (503, b"", "HTTP 503"),
        (200, b" " * (70 * 1024), "larger than"),
    ],
)
def test_broken_peer_returns_none(
    broken_peer: Callable[[int, bytes], str], status: int, body: bytes, expected: str
) -> None:
    url = broken_peer(status, body)
    client = SidecarClient(url)
    assert client.expiry() is None
    assert client.last_error is not None
    assert client.last_error.startswith(url)
    assert expected in client.last_error
    # The client is still usable once the peer behaves.
    broken_peer(200, good_body())
    assert client.expiry() is not None
    assert client.last_error is None


def test_guard_survives_a_broken_peer(broken_peer: Callable[[int, bytes], str]) -> None:
    guard = simple_guard(SidecarClient(broken_peer(200, b"garbage")))
    with guard.step():
        pass
    assert guard.should_save() is False
    assert guard.should_stop() is False
    status = guard.status()
    assert status.daemon_reachable is False
    assert status.last_error is not None and "malformed JSON" in status.last_error


# ------------------------------------------------------------------ env fallback


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("1900000000", 1_900_000_000.0),
        ("1900000000000", 1_900_000_000.0),  # milliseconds
        ("1900000000.5", 1_900_000_000.5),
        ("2030-01-01T08:00:00+08:00", 1_893_456_000.0),
    ],
)
def test_env_deadline_seconds_milliseconds_rfc3339(value: str, expected: float) -> None:
    assert env_deadline({MLP: value}) == pytest.approx(expected)
    assert env_deadline({SAGEMAKER: value}) == pytest.approx(expected)


def test_env_deadline_reads_a_time_without_an_offset_in_its_platforms_zone() -> None:
    # As the daemon's env source does: Volcengine's ML platform writes Beijing time (UTC+8,
    # the earliest reading; as UTC it came 8 h late), SageMaker's AWS writes UTC.
    assert env_deadline({MLP: "2030-01-01 08:00:00"}) == 1_893_456_000.0
    assert env_deadline({SAGEMAKER: "2030-01-01 08:00:00"}) == 1_893_484_800.0


def test_env_deadline_order_and_absence() -> None:
    assert env_deadline({}) is None
    assert env_deadline({MLP: "  "}) is None
    both = {MLP: "1900000000", SAGEMAKER: "1800000000"}
    assert env_deadline(both) == 1_900_000_000.0  # the Volcengine variable first


def test_env_deadline_bad_value_warns_once(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger=TRAIN_LOGGER):
        assert env_deadline({MLP: "next tuesday"}) is None
    warnings = [r for r in caplog.records
                if r.name.startswith(TRAIN_LOGGER)]
    assert len(warnings) == 1
    assert MLP in warnings[0].getMessage() and "next tuesday" in warnings[0].getMessage()
    # A bad first variable does not hide a good second one.
    assert env_deadline({MLP: "-5", SAGEMAKER: "1900000000000"}) == 1_900_000_000.0


def test_env_deadline_reads_os_environ_by_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(SAGEMAKER, "1900000000000")
    assert env_deadline() == 1_900_000_000.0


def test_guard_falls_back_to_env_when_the_daemon_is_down() -> None:
    now = time.time()
    guard = CheckpointGuard(
        SidecarClient(f"http://127.0.0.1:{closed_port()}"),
        SavePolicy(save_seconds=100.0),
        environ={MLP: str(int((now + 200) * 1000))},  # milliseconds
    )
    with guard.step():
        pass
    assert guard.should_save() is True
    status = guard.status()
    assert status.deadline_source == "env"
    assert status.daemon_reachable is False
    assert status.deadline_unix == pytest.approx(int((now + 200) * 1000) / 1000)


def test_guard_uses_env_when_the_daemon_knows_no_deadline(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The daemon's env source with no variable set answers "no deadline" (a real null).
    with serve_daemon(sources=("env",)) as daemon:
        client = SidecarClient(daemon.url)
        wait_for(lambda: (client.expiry() or Expiry.from_json({"server_time_unix": 1})).source)
        assert client.deadline_unix() is None
        guard = CheckpointGuard(client, environ={SAGEMAKER: str(time.time() + 100)})
        with guard.step():
            pass
        assert guard.should_save() is True
        assert guard.status().deadline_source == "env"
        assert guard.status().daemon_reachable is True

        nothing = CheckpointGuard(SidecarClient(daemon.url), environ={})
        assert nothing.should_save() is False
        assert nothing.status().reason == "no deadline known"
        assert nothing.status().deadline_source is None


def test_tracker_keeps_its_deadline_on_stale_answer_without_one(
    broken_peer: Callable[[int, bytes], str],
) -> None:
    # Also when the client knows nothing (a client replaced, or not a SidecarClient): the
    # tracker itself keeps the last deadline it was given.
    deadline = time.time() + 300
    monotonic = FakeMonotonic()
    url = broken_peer(200, good_body(expires_at_unix=deadline))
    tracker = DeadlineTracker(SidecarClient(url), monotonic=monotonic, environ={})
    assert tracker.deadline() == (pytest.approx(deadline), "daemon")
    tracker.client = SidecarClient(url)  # no memory of its own
    broken_peer(200, good_body(expires_at_unix=None, stale=True, error="API down"))
    monotonic.advance(1.0)
    assert tracker.deadline() == (pytest.approx(deadline), "daemon")
    assert tracker.reachable is True and tracker.last_error is None
    broken_peer(200, good_body(expires_at_unix=None))  # fresh: nothing scheduled
    monotonic.advance(1.0)
    assert tracker.deadline() == (None, None)
