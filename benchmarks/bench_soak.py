"""Soak: the daemon for ten minutes under honest clients, hostile connections and cloud faults.

Run alone: ``python -m benchmarks --only soak`` (``--quick``: 60 s).

The real ``esi-sidecar serve --source volcengine-esi`` runs as a subprocess at an
open-file limit of 1,024 (soft and hard: the tightest case, where it holds at most 896
connections), polling the Volcengine emulator in this process every second through the
real SDK. For the whole run:

- 64 honest clients, in two processes of their own, each holding one keep-alive
  connection (as ``SidecarClient`` does) and asking ``/v1/expiry`` every 100 ms, with
  every 10th request ``/healthz`` and every 40th ``/metrics``;
- 200 hostile connections at a time, renewed as the daemon closes them: idle ones that
  never send a byte, slowloris ones sending a header line a second, garbage bytes,
  half-closed requests and connections reset at once;
- a fault on the emulator every 30 s, 20 s of it and then 10 s clear: throttling, server
  errors, answers slower than the SDK's timeout, cut-off JSON, an empty release time for
  two polls, an unparseable one, the account's rate limit, and a release that moves.

Measured: the honest clients' errors and latencies, whether every ``/v1/expiry`` answer
carried the emulator's current release (or the one before, just after a move), the
daemon's RSS every 10 s, its open descriptors, threads, CPU and log. ``--quick`` runs
60 s, a fault every 7.5 s (4 s of it), RSS every 5 s.
"""

from __future__ import annotations

import argparse
import errno
import http.client
import json
import math
import os
import random
import resource
import selectors
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Optional

if TYPE_CHECKING:
    from benchmarks.bench_daemon import ServerProcess
    from sidecar.tools.emulator import Emulator

__all__ = ["main"]

HOST = "127.0.0.1"
HONEST_CLIENTS = 64
CLIENT_PROCESSES = 2  # 32 threads each: no one process's GIL holds back the answers' reads
PAUSE_SECONDS = 0.1  # between a client's requests (see the notes: 50 ms took a core)
CLIENT_TIMEOUT_SECONDS = 2.0  # an answer later than this counts as an error
HEALTHZ_EVERY = 10
METRICS_EVERY = 40
HOSTILE = 200
HOSTILE_KINDS = ("idle", "slowloris", "garbage", "half-close", "reset")
HOSTILE_RENEW_SECONDS = 1.0  # a closed hostile slot is opened again this much later
HOSTILE_HELD_TOO_LONG_SECONDS = 15.0  # 3 x the header timeout: we close it and count it
FD_LIMIT = 1024  # soft and hard, set before exec: start-up cannot raise it to 8,192
POLL_INTERVAL_SECONDS = 1.0
SLOW_DELAY_SECONDS = 7.0  # longer than the source's 5 s read timeout
MOVE_GRACE_SECONDS = 5.0  # after a move, the release before it may still be served
ACCOUNT_LIMIT_PER_SECOND = 0.3
# (seconds, fault seconds, clear seconds, RSS sample seconds, RSS warm-up seconds)
FULL = (600.0, 20.0, 10.0, 10.0, 120.0)
QUICK = (60.0, 4.0, 3.5, 5.0, 20.0)
PROGRESS_SECONDS = 30.0
FAULTS = ("throttle", "server-error", "slow", "malformed-json", "empty-release",
          "bad-release", "account-limit", "release-move")
TARGET_RSS_SLOPE_MB_PER_MINUTE = 0.5
TARGET_LOG_BYTES_PER_10_MINUTES = 1_000_000
EMULATOR_ACCESS_KEY = "AKLTsoak000000000001"
EMULATOR_SECRET_KEY = "c29hay1zZWNyZXQtc29haw=="
# The honest clients' tally for each second of the run, by index.
_ANSWERS, _MAX_US, _ERRORS, _EXPIRY, _STALE, _WITH_ERROR, _HEALTHZ, _DEGRADED = range(8)
_TCP_QUICKACK = getattr(socket, "TCP_QUICKACK", None)
_HEADERS = {"Accept": "application/json", "User-Agent": "esi-sidecar-soak"}


# ---------------------------------------------------------------------------- honest clients


class _Honest:
    """One keep-alive client: ``/v1/expiry`` in a loop, ``/healthz`` and ``/metrics`` now
    and then. Every answer is checked; a connection that fails is opened again."""

    def __init__(self, port: int, start: float, until: float, seed: int) -> None:
        self.port = port
        self.start = start
        self.until = until
        self.rng = random.Random(seed)
        self.requests = 0
        self.connects = 0
        self.closed_by_server = 0
        self.latency_us: dict[str, Counter[int]] = {
            "/v1/expiry": Counter(), "/healthz": Counter(), "/metrics": Counter()}
        self.errors: Counter[str] = Counter()
        self.error_samples: list[list[Any]] = []
        # Runs of the same served deadline: [expires_at_unix, first seen, last seen, answers]
        self.runs: list[list[Any]] = []
        self.seconds: dict[int, list[int]] = {}  # second of the run -> tally (_ANSWERS...)
        self._connection: Optional[http.client.HTTPConnection] = None

    def _connect(self) -> http.client.HTTPConnection:
        connection = http.client.HTTPConnection(HOST, self.port,
                                                timeout=CLIENT_TIMEOUT_SECONDS)
        connection.connect()
        connection.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.connects += 1
        return connection

    def _quick_ack(self, connection: http.client.HTTPConnection) -> None:
        # As sidecar.train.client does: ACK the answer at once, not after up to 40 ms.
        if _TCP_QUICKACK is not None and connection.sock is not None:
            with suppress(OSError):
                connection.sock.setsockopt(socket.IPPROTO_TCP, _TCP_QUICKACK, 1)

    def _get(self, path: str) -> tuple[int, bytes]:
        connection = self._connection or self._connect()
        self._connection = connection
        self._quick_ack(connection)
        connection.request("GET", path, headers=_HEADERS)
        self._quick_ack(connection)
        response = connection.getresponse()
        body = response.read()
        if response.will_close:
            self.closed_by_server += 1
            self._drop()
        return response.status, body

    def _drop(self) -> None:
        if self._connection is not None:
            self._connection.close()
            self._connection = None

    def _error(self, kind: str, when: float, detail: str) -> None:
        self.errors[kind] += 1
        if len(self.error_samples) < 10:
            self.error_samples.append([round(when - self.start, 3), kind, detail[:200]])

    def run(self) -> None:
        time.sleep(max(0.0, self.start - time.monotonic()) + self.rng.uniform(0, PAUSE_SECONDS))
        index = 0
        while time.monotonic() < self.until:
            index += 1
            path = ("/metrics" if index % METRICS_EVERY == 0 else
                    "/healthz" if index % HEALTHZ_EVERY == 0 else "/v1/expiry")
            self.one(path)
            time.sleep(PAUSE_SECONDS)
        self._drop()

    def one(self, path: str) -> None:
        started = time.perf_counter_ns()
        try:
            status, body = self._get(path)
        except (OSError, http.client.HTTPException) as exc:
            status, body = 0, f"{type(exc).__name__}: {exc}".encode()
            self._drop()
        latency_us = (time.perf_counter_ns() - started) // 1000
        now = time.monotonic()
        self.requests += 1
        self.latency_us[path][latency_us] += 1
        second = self.seconds.setdefault(int(now - self.start), [0] * 8)
        second[_ANSWERS] += 1
        second[_MAX_US] = max(second[_MAX_US], latency_us)
        problem = self._check(path, status, body, now, second)
        if problem is None and latency_us > CLIENT_TIMEOUT_SECONDS * 1e6:
            problem = ("slower than the timeout", f"{latency_us / 1000:.0f} ms")
        if problem is not None:
            second[_ERRORS] += 1
            self._error(problem[0], now, problem[1])

    def _check(self, path: str, status: int, body: bytes, now: float,
               second: list[int]) -> Optional[tuple[str, str]]:
        """None for a good answer, else (kind, detail)."""
        if status == 0:
            return body.decode().partition(":")[0], body.decode()
        if path == "/metrics":
            if status != 200 or b"esi_sidecar_remaining_seconds" not in body:
                return f"/metrics {status}", body[:200].decode(errors="replace")
            return None
        try:
            answer = json.loads(body)
        except ValueError:
            return f"{path} not JSON ({status})", body[:200].decode(errors="replace")
        if path == "/healthz":
            second[_HEALTHZ] += 1
            if status == 503 and isinstance(answer, dict) and "status" in answer:
                second[_DEGRADED] += 1  # degraded while the cloud fails: the answer it should give
                return None
            if status != 200:
                return f"/healthz {status}", body[:200].decode(errors="replace")
            return None
        if status != 200 or not isinstance(answer, dict) or "expires_at_unix" not in answer:
            return f"/v1/expiry {status}", body[:200].decode(errors="replace")
        second[_EXPIRY] += 1
        second[_STALE] += bool(answer.get("stale"))
        second[_WITH_ERROR] += answer.get("error") is not None
        value = answer["expires_at_unix"]
        if self.runs and self.runs[-1][0] == value:
            self.runs[-1][2] = now
            self.runs[-1][3] += 1
        else:
            self.runs.append([value, now, now, 1])
        return None

    def result(self) -> dict[str, Any]:
        return {
            "requests": self.requests, "connects": self.connects,
            "closed_by_server": self.closed_by_server,
            "latency_us": {path: dict(c) for path, c in self.latency_us.items()},
            "errors": dict(self.errors), "error_samples": self.error_samples,
            "runs": self.runs, "seconds": self.seconds,
        }


def _clients_main(args: argparse.Namespace) -> int:
    """``python -m benchmarks.bench_soak clients``: N honest clients in this process; a
    progress line a second on stdout, the results as JSON in ``--out`` at the end."""
    clients = [_Honest(args.port, args.start, args.until, args.seed * 1000 + index)
               for index in range(args.clients)]
    threads = [threading.Thread(target=c.run, name=f"honest-{i}", daemon=True)
               for i, c in enumerate(clients)]
    for thread in threads:
        thread.start()
    while any(t.is_alive() for t in threads) and time.monotonic() < args.until + 10:
        time.sleep(1.0)  # a client stuck past its timeout is given up 10 s after the end
        print(f"progress {sum(c.requests for c in clients)} "
              f"{sum(sum(c.errors.values()) for c in clients)}", flush=True)
    merged: dict[str, Any] = {"clients": [c.result() for c in clients],
                              "stuck": sum(t.is_alive() for t in threads)}
    Path(args.out).write_text(json.dumps(merged))
    return 0


@dataclass
class _ClientProcess:
    process: subprocess.Popen[str]
    out: Path
    requests: int = 0
    errors: int = 0

    def __post_init__(self) -> None:
        self.reader = threading.Thread(target=self._read_progress, daemon=True)
        self.reader.start()

    def _read_progress(self) -> None:  # the latest progress line, until the process ends
        assert self.process.stdout is not None
        with self.process.stdout:
            for line in self.process.stdout:
                words = line.split()
                if len(words) == 3 and words[0] == "progress":
                    self.requests, self.errors = int(words[1]), int(words[2])


def _start_clients(port: int, start: float, until: float, folder: Path) -> list[_ClientProcess]:
    path = os.environ.get("PYTHONPATH")
    env = {**os.environ, "PYTHONPATH": str(_repo_root()) + (os.pathsep + path if path else "")}
    started = []
    per_process = HONEST_CLIENTS // CLIENT_PROCESSES
    for index in range(CLIENT_PROCESSES):
        out = folder / f"clients-{index}.json"
        process = subprocess.Popen(
            [sys.executable, "-m", "benchmarks.bench_soak", "clients", "--port", str(port),
             "--clients", str(per_process), "--start", repr(start), "--until", repr(until),
             "--seed", str(index), "--out", str(out)],
            stdout=subprocess.PIPE, text=True, cwd=_repo_root(), env=env)
        started.append(_ClientProcess(process, out))
    return started


def _repo_root() -> Path:
    return Path(__file__).resolve().parents[1]


# ---------------------------------------------------------------------------- hostile


@dataclass
class _Slot:
    kind: str
    sock: Optional[socket.socket] = None
    opened: float = 0.0
    renew_at: float = 0.0
    outbox: bytes = b""
    next_header: float = 0.0


@dataclass
class _Hostile:
    """``HOSTILE`` connections at a time, each kind in equal share, each opened again a
    second after it ends. One thread, one selector."""

    port: int
    count: int = HOSTILE
    opened: Counter[str] = field(default_factory=Counter)
    closed_by_daemon: Counter[str] = field(default_factory=Counter)
    held_too_long: Counter[str] = field(default_factory=Counter)
    connect_failed: Counter[str] = field(default_factory=Counter)
    held_seconds: dict[str, list[float]] = field(default_factory=dict)
    stop: threading.Event = field(default_factory=threading.Event)

    def __post_init__(self) -> None:
        self.slots = [_Slot(HOSTILE_KINDS[i % len(HOSTILE_KINDS)]) for i in range(self.count)]
        self.selector = selectors.DefaultSelector()
        self.rng = random.Random(7)

    def run(self) -> None:
        try:
            while not self.stop.is_set():
                self._tick()
        finally:
            for slot in self.slots:
                self._close(slot, time.monotonic(), reset=True)
            self.selector.close()

    def _open(self, slot: _Slot, now: float) -> None:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setblocking(False)
        code = sock.connect_ex((HOST, self.port))
        if code not in (0, errno.EINPROGRESS):
            sock.close()
            self.connect_failed[os.strerror(code)] += 1
            slot.renew_at = now + HOSTILE_RENEW_SECONDS
            return
        self.opened[slot.kind] += 1
        slot.sock, slot.opened, slot.next_header = sock, now, now + 1.0
        slot.outbox = {
            "idle": b"",
            "slowloris": b"GET /v1/expiry HTTP/1.1\r\nHost: x\r\n",
            "garbage": self.rng.randbytes(256) + b"\r\n\r\n",
            "half-close": b"GET /v1/expiry HTTP/1.1\r\nHo",
            "reset": b"",
        }[slot.kind]
        if slot.kind == "reset":  # gone before the daemon sees it: an RST, no FIN
            self._close(slot, now, reset=True)
            return
        self.selector.register(sock, selectors.EVENT_READ, slot)

    def _close(self, slot: _Slot, now: float, *, reset: bool = False) -> None:
        sock = slot.sock
        if sock is None:
            return
        if reset:
            with suppress(OSError):
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        with suppress(KeyError, ValueError):
            self.selector.unregister(sock)
        sock.close()
        slot.sock = None
        slot.renew_at = now + HOSTILE_RENEW_SECONDS

    def _send(self, slot: _Slot, now: float) -> None:
        assert slot.sock is not None
        try:
            if slot.outbox:
                sent = slot.sock.send(slot.outbox)
                slot.outbox = slot.outbox[sent:]
                if not slot.outbox and slot.kind == "half-close":
                    slot.sock.shutdown(socket.SHUT_WR)
            if slot.kind == "slowloris" and now >= slot.next_header:
                slot.sock.send(b"X-Slow: 1\r\n")
                slot.next_header = now + 1.0
        except BlockingIOError:  # not connected yet, or a full buffer: next tick
            pass
        except OSError:  # closed by the daemon: the selector says so next
            pass

    def _tick(self) -> None:
        """Open, feed and expire the slots, then read what comes for 0.1 s."""
        now = time.monotonic()
        for slot in self.slots:
            if slot.sock is None:
                if now >= slot.renew_at:
                    self._open(slot, now)
            elif now - slot.opened > HOSTILE_HELD_TOO_LONG_SECONDS:
                self.held_too_long[slot.kind] += 1
                self._close(slot, now, reset=True)
            else:
                self._send(slot, now)
        scan_at = now + 0.1
        while (left := scan_at - time.monotonic()) > 0:
            for key, _ in self.selector.select(timeout=left):
                self._read(key.data)

    def _read(self, slot: _Slot) -> None:
        assert slot.sock is not None
        try:
            data = slot.sock.recv(65536)
        except BlockingIOError:
            return
        except OSError:  # reset by the daemon
            data = b""
        if not data:  # any answer first (a 400) is read and dropped
            now = time.monotonic()
            self.closed_by_daemon[slot.kind] += 1
            self.held_seconds.setdefault(slot.kind, []).append(now - slot.opened)
            self._close(slot, now)


# ---------------------------------------------------------------------------- the daemon


def _limit_open_files() -> None:  # in the daemon's process, before exec
    resource.setrlimit(resource.RLIMIT_NOFILE, (FD_LIMIT, FD_LIMIT))


@contextmanager
def _daemon(emulator_url: str, folder: Path) -> Iterator[ServerProcess]:
    from benchmarks.bench_daemon import ServerProcess, free_port

    port = free_port()
    log_path = folder / "daemon.log"
    path = os.environ.get("PYTHONPATH")
    env = {**os.environ, "VOLCENGINE_ACCESS_KEY": EMULATOR_ACCESS_KEY,
           "VOLCENGINE_SECRET_KEY": EMULATOR_SECRET_KEY,
           "PYTHONPATH": str(_repo_root()) + (os.pathsep + path if path else "")}
    env.pop("VOLCENGINE_SESSION_TOKEN", None)
    command = [sys.executable, "-m", "sidecar.cli", "serve", "--source", "volcengine-esi",
               "--api-endpoint", emulator_url, "--metadata-url", emulator_url,
               "--listen", f"{HOST}:{port}", "--poll-interval", f"{POLL_INTERVAL_SECONDS:g}",
               "--poll-schedule", "fixed", "--max-api-rate", "36000",
               "--state-file", str(folder / "state.json")]
    with log_path.open("wb") as log:  # a file: a pipe nobody reads would stall the daemon
        launched = time.monotonic()
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT,
                                   cwd=folder, env=env, preexec_fn=_limit_open_files)
    try:
        yield ServerProcess("soak", process, port, launched, log_path)
    finally:
        if process.poll() is None:
            process.terminate()
            try:
                process.wait(10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(5)


def _proc_status(pid: int) -> dict[str, str]:
    values = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        values[key] = value.strip()
    return values


def _kilobytes(status: dict[str, str], key: str) -> int:
    return int(status[key].split()[0])


def _open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def _release_unix(text: str) -> float:
    return datetime.fromisoformat(text).timestamp()


# ---------------------------------------------------------------------------- faults


@dataclass
class _Phase:
    kind: str
    start: float  # seconds from the run's start
    clear: float
    end: float


def _phases(seconds: float, fault_seconds: float, clear_seconds: float) -> list[_Phase]:
    phases, at, index = [], 0.0, 0
    while at + fault_seconds <= seconds:
        phases.append(_Phase(FAULTS[index % len(FAULTS)], at, at + fault_seconds,
                             min(seconds, at + fault_seconds + clear_seconds)))
        at += fault_seconds + clear_seconds
        index += 1
    return phases


@dataclass
class _Cloud:
    """The emulator's faults and releases; ``releases`` [(monotonic set at, unix)]."""

    emulator: Emulator
    releases: list[tuple[float, float]] = field(default_factory=list)
    moves: int = 0

    def set_release(self, seconds: float) -> None:
        at = time.monotonic()  # before: no answer can carry it earlier
        self.releases.append((at, _release_unix(self.emulator.set_release_in(seconds))))

    def apply(self, kind: str) -> None:
        emulator = self.emulator
        if kind == "slow":
            emulator.inject_fault("slow", delay=SLOW_DELAY_SECONDS)
        elif kind == "empty-release":  # a glitch: fewer polls than confirm a release gone
            emulator.inject_fault("empty-release", count=2)
        elif kind == "account-limit":
            emulator.set_account_limit(ACCOUNT_LIMIT_PER_SECOND, burst=1)
        elif kind == "release-move":
            self.moves += 1
            self.set_release(7200 + 60 * self.moves * (-1) ** self.moves)
        else:
            emulator.inject_fault(kind)

    def clear(self) -> None:
        self.emulator.clear_faults()
        self.emulator.set_account_limit(None)


# ---------------------------------------------------------------------------- analysis


def _percentile(histogram: Counter[int], q: float) -> float:
    """Nearest rank over a {value: count} histogram."""
    total = sum(histogram.values())
    if not total:
        return math.nan
    rank = max(1, math.ceil(q / 100 * total))
    seen = 0
    for value in sorted(histogram):
        seen += histogram[value]
        if seen >= rank:
            return float(value)
    return float(max(histogram))


def _slope_per_minute(points: Sequence[tuple[float, float]]) -> float:
    """Least-squares slope of (seconds, value) in value per minute."""
    if len(points) < 2:
        return math.nan
    mean_t = sum(t for t, _ in points) / len(points)
    mean_v = sum(v for _, v in points) / len(points)
    spread = sum((t - mean_t) ** 2 for t, _ in points)
    return 60 * sum((t - mean_t) * (v - mean_v) for t, v in points) / spread if spread else 0.0


def _check_deadlines(runs: list[list[Any]], releases: list[tuple[float, float]]
                     ) -> dict[str, Any]:
    """Each run of one served deadline against the emulator's releases: the current one,
    or the one before for ``MOVE_GRACE_SECONDS`` after a move."""
    index = {value: k for k, (_, value) in enumerate(releases)}
    wrong = null = 0
    lag = [0.0] * len(releases)  # per move: how long after it the old release was seen
    samples: list[str] = []
    for value, first, last, answers in runs:
        k = index.get(value)
        if k is None:
            if value is None:
                null += answers
            else:
                wrong += answers
            if len(samples) < 5:
                samples.append(f"{value!r} served {answers} times")
            continue
        if first < releases[k][0]:  # served before it was set: cannot be, but say so
            wrong += answers
        if k + 1 < len(releases):
            moved = releases[k + 1][0]
            lag[k + 1] = max(lag[k + 1], last - moved)
            if last > moved + MOVE_GRACE_SECONDS:
                wrong += answers
                if len(samples) < 5:
                    samples.append(f"release {k} served {last - moved:.1f} s after a move")
    return {"wrong": wrong, "null": null, "move_lag_seconds": lag[1:], "samples": samples}


def _log_summary(path: Path, since: int) -> dict[str, Any]:
    data = path.read_bytes()
    during = data[since:]
    messages: Counter[str] = Counter()
    for line in during.decode(errors="replace").splitlines():
        # "2026-01-01 00:00:00,000 LEVEL logger: message" -> "LEVEL logger: message"
        words = line.split(" ", 2)
        text = words[2] if len(words) == 3 and words[0][:2].isdigit() else line
        messages["".join("#" if c.isdigit() else c for c in text)[:140]] += 1
    return {"bytes": len(data), "lines": data.count(b"\n"), "bytes_during": len(during),
            "lines_during": during.count(b"\n"), "top": messages.most_common(8)}


def _add_tally(total: list[int], values: Sequence[int]) -> None:
    for i, value in enumerate(values):
        total[i] = max(total[i], value) if i == _MAX_US else total[i] + value


def _merge(outputs: list[dict[str, Any]]) -> dict[str, Any]:
    clients = [c for output in outputs for c in output["clients"]]
    latency: dict[str, Counter[int]] = {}
    for client in clients:
        for path, histogram in client["latency_us"].items():
            latency.setdefault(path, Counter()).update(
                {int(k): v for k, v in histogram.items()})
    seconds: dict[int, list[int]] = {}
    for client in clients:
        for key, values in client["seconds"].items():
            _add_tally(seconds.setdefault(int(key), [0] * len(values)), values)
    errors: Counter[str] = Counter()
    for client in clients:
        errors.update(client["errors"])
    return {
        "requests": sum(c["requests"] for c in clients),
        "connects": sum(c["connects"] for c in clients),
        "closed_by_server": sum(c["closed_by_server"] for c in clients),
        "latency_us": latency, "seconds": seconds, "errors": errors,
        "error_samples": [s for c in clients for s in c["error_samples"]][:10],
        "runs": [run for c in clients for run in c["runs"]],
        "stuck": sum(output["stuck"] for output in outputs),
    }


# ---------------------------------------------------------------------------- the run


@dataclass
class _Soak:
    """What one run measured (``_run``), for the report (``main``)."""

    seconds: float
    fault_seconds: float
    clear_seconds: float
    rss_every: float
    warmup: float
    phases: list[_Phase]
    before: dict[str, float] = field(default_factory=dict)  # at the first healthy answer
    rss: list[tuple[float, int]] = field(default_factory=list)  # (seconds in, VmRSS kB)
    fds: list[int] = field(default_factory=list)  # every second
    threads: list[int] = field(default_factory=list)
    cpu: float = 0.0
    api_calls: int = 0
    peak_kb: int = 0
    fds_after: int = 0
    recovered: Optional[float] = None  # seconds to a healthy answer once the faults stop
    final_ok: bool = False
    log: dict[str, Any] = field(default_factory=dict)
    clients: dict[str, Any] = field(default_factory=dict)
    releases: list[tuple[float, float]] = field(default_factory=list)
    moves: int = 0
    load: list[float] = field(default_factory=list)  # 1-min load average, start and end


def _drive(soak: _Soak, daemon: ServerProcess, cloud: _Cloud, clients: list[_ClientProcess],
           hostile: _Hostile, start: float) -> None:
    """The faults on their schedule, the samples, a progress line every 30 s."""
    pending = list(soak.phases)
    active: Optional[_Phase] = None
    next_rss = next_fd = start
    next_progress = start + PROGRESS_SECONDS
    while (now := time.monotonic()) < start + soak.seconds:
        if daemon.process.poll() is not None:
            raise RuntimeError(f"the daemon exited with {daemon.process.returncode}: "
                               f"{daemon.log_tail()}")
        elapsed = now - start
        if active is not None and elapsed >= active.clear:
            cloud.clear()
            active = None
        if pending and elapsed >= pending[0].start:
            active = pending.pop(0)
            cloud.apply(active.kind)
        if now >= next_fd:
            soak.fds.append(_open_fds(daemon.pid))
            next_fd += 1.0
        if now >= next_rss:
            status = _proc_status(daemon.pid)
            soak.rss.append((elapsed, _kilobytes(status, "VmRSS")))
            soak.threads.append(int(status["Threads"]))
            next_rss += soak.rss_every
        if now >= next_progress:
            print(f"    {elapsed:3.0f}/{soak.seconds:.0f} s: "
                  f"{sum(c.requests for c in clients):,} requests, "
                  f"{sum(c.errors for c in clients)} errors, "
                  f"RSS {soak.rss[-1][1] / 1024:.1f} MB, {soak.fds[-1]} fds, "
                  f"{sum(hostile.opened.values()):,} hostile connections so far"
                  + (f", fault: {active.kind}" if active else ""), flush=True)
            next_progress += PROGRESS_SECONDS
        time.sleep(0.1)
    soak.rss.append((time.monotonic() - start, _kilobytes(_proc_status(daemon.pid), "VmRSS")))


def _collect(clients: list[_ClientProcess]) -> list[dict[str, Any]]:
    outputs = []
    for client in clients:
        try:
            code = client.process.wait(CLIENT_TIMEOUT_SECONDS + 30)
        except subprocess.TimeoutExpired:
            client.process.kill()
            raise RuntimeError("an honest client process did not finish") from None
        client.reader.join(5)
        if code != 0:
            raise RuntimeError(f"an honest client process exited with {code}")
        outputs.append(json.loads(client.out.read_text()))
    return outputs


def _after(soak: _Soak, daemon: ServerProcess, cloud: _Cloud) -> None:
    """Faults cleared, load gone: healthy again, the last release served, the
    descriptors given back."""
    from benchmarks.bench_daemon import http_get

    started = time.monotonic()
    while soak.recovered is None and time.monotonic() - started < 30:
        with suppress(OSError):
            if http_get(daemon.url, "/healthz")[0] == 200:
                soak.recovered = time.monotonic() - started
        time.sleep(0.1)
    status, body = http_get(daemon.url, "/v1/expiry")
    soak.final_ok = (status == 200
                     and json.loads(body).get("expires_at_unix") == cloud.releases[-1][1])
    settle = time.monotonic() + 10.0  # closed on our side: the daemon sees it next
    while _open_fds(daemon.pid) > soak.before["fds"] + 2 and time.monotonic() < settle:
        time.sleep(0.2)
    soak.fds_after = _open_fds(daemon.pid)
    soak.peak_kb = _kilobytes(_proc_status(daemon.pid), "VmHWM")
    soak.log = _log_summary(daemon.log_path, int(soak.before["log"]))


def _run(quick: bool) -> tuple[_Soak, _Hostile]:
    from benchmarks.bench_daemon import cpu_seconds, wait_healthy
    from sidecar.tools.emulator import Emulator

    seconds, fault_seconds, clear_seconds, rss_every, warmup = QUICK if quick else FULL
    soak = _Soak(seconds, fault_seconds, clear_seconds, rss_every, warmup,
                 _phases(seconds, fault_seconds, clear_seconds))
    emulator = Emulator(access_key=EMULATOR_ACCESS_KEY, secret_key=EMULATOR_SECRET_KEY,
                        region="cn-beijing", instance_id="i-soak0001",
                        scheduled_instance_id="esi-soak0001")
    cloud = _Cloud(emulator)
    cloud.set_release(7200)
    with tempfile.TemporaryDirectory(prefix="esi-bench-soak-") as name, emulator, \
            _daemon(emulator.url, Path(name)) as daemon:
        wait_healthy(daemon)
        soak.before = {"fds": _open_fds(daemon.pid), "cpu": cpu_seconds(daemon.pid),
                       "threads": int(_proc_status(daemon.pid)["Threads"]),
                       "log": daemon.log_path.stat().st_size,
                       "api_calls": emulator.request_count()}
        soak.load.append(os.getloadavg()[0])
        start = time.monotonic() + 2.0  # the client processes start and connect by then
        clients = _start_clients(daemon.port, start, start + seconds, Path(name))
        hostile = _Hostile(daemon.port)
        thread = threading.Thread(target=hostile.run, name="hostile", daemon=True)
        try:
            time.sleep(max(0.0, start - time.monotonic()))
            thread.start()
            _drive(soak, daemon, cloud, clients, hostile, start)
            soak.cpu = cpu_seconds(daemon.pid) - soak.before["cpu"]
            soak.load.append(os.getloadavg()[0])
            soak.api_calls = emulator.request_count() - int(soak.before["api_calls"])
        except BaseException:
            for client in clients:
                client.process.kill()
            raise
        finally:
            cloud.clear()
            hostile.stop.set()
            if thread.is_alive():
                thread.join(10)
        outputs = _collect(clients)
        _after(soak, daemon, cloud)
    soak.clients = _merge(outputs)
    soak.releases, soak.moves = cloud.releases, cloud.moves
    return soak, hostile


# ---------------------------------------------------------------------------- the report


def _ms(value_us: float) -> str:
    return f"{value_us / 1000:,.2f}"


def _latency_rows(latency: dict[str, Counter[int]]) -> tuple[list[list[str]], Counter[int]]:
    every: Counter[int] = Counter()
    for histogram in latency.values():
        every.update(histogram)
    rows = []
    for label, histogram in (*((f"`{p}`", h) for p, h in latency.items()), ("**all**", every)):
        rows.append([label, f"{sum(histogram.values()):,}",
                     *(_ms(_percentile(histogram, q)) for q in (50, 90, 99, 99.9)),
                     _ms(max(histogram, default=0))])
    return rows, every


def _window(per_second: dict[int, list[int]], lo: float, hi: float) -> list[int]:
    """The honest clients' per-second tallies summed over [lo, hi) (the max for µs)."""
    total = [0] * 8
    for second, values in per_second.items():
        if lo <= second < hi:
            _add_tally(total, values)
    return total


def _share(rows: list[list[int]], part: int, whole: int) -> str:
    count = sum(r[whole] for r in rows)
    return f"{100 * sum(r[part] for r in rows) / count:.0f} %" if count else "n/a"


def _phase_rows(soak: _Soak) -> list[list[str]]:
    """Per fault: what the honest clients saw in its fault windows and the clear ones after."""
    per_second = soak.clients["seconds"]
    rows = []
    for kind in FAULTS:
        phases = [p for p in soak.phases if p.kind == kind]
        if not phases:
            continue
        fault = [_window(per_second, p.start, p.clear) for p in phases]
        after = [_window(per_second, p.clear, p.end) for p in phases]
        both = fault + after
        rows.append([kind, str(len(phases)), f"{sum(r[_ANSWERS] for r in both):,}",
                     str(sum(r[_ERRORS] for r in both)), _ms(max(r[_MAX_US] for r in both)),
                     _share(fault, _WITH_ERROR, _EXPIRY), _share(fault, _STALE, _EXPIRY),
                     _share(fault, _DEGRADED, _HEALTHZ), _share(after, _WITH_ERROR, _EXPIRY)])
    return rows


def _hostile_rows(hostile: _Hostile) -> list[list[str]]:
    rows = []
    for kind in HOSTILE_KINDS:
        held = sorted(hostile.held_seconds.get(kind, []))
        rows.append([kind, f"{hostile.opened[kind]:,}", f"{hostile.closed_by_daemon[kind]:,}",
                     f"{held[len(held) // 2]:.2f}" if held else "",
                     f"{held[-1]:.2f}" if held else "", str(hostile.held_too_long[kind])])
    return rows


def _rss_figures(soak: _Soak) -> dict[str, float]:
    settled = [(t, kb / 1024) for t, kb in soak.rss if t >= soak.warmup]
    return {
        "first": soak.rss[0][1] / 1024, "last": soak.rss[-1][1] / 1024,
        "max": max(kb for _, kb in soak.rss) / 1024, "peak": soak.peak_kb / 1024,
        "slope_per_minute": _slope_per_minute(settled),
        "growth_after_warmup": settled[-1][1] - settled[0][1] if settled else math.nan,
    }


def _notes(soak: _Soak, rate: float) -> list[str]:
    clients = soak.clients
    notes = [
        f"The daemon: `esi-sidecar serve --source volcengine-esi --poll-interval "
        f"{POLL_INTERVAL_SECONDS:g} --poll-schedule fixed --max-api-rate 36000 --state-file "
        "...` at the default log level (INFO), its output to a file, started with "
        f"RLIMIT_NOFILE {FD_LIMIT}/{FD_LIMIT} (soft/hard) before exec: the hard limit keeps "
        "start-up from raising it to 8,192 as it does under the unit (LimitNOFILE=8192) or "
        "under systemd's default hard limit, so this is the tightest case, a cap of "
        f"{FD_LIMIT - 128} connections. The API rate cap is lifted so that a 1 s poll is "
        "one call a second.",
        f"Honest clients: `http.client` keep-alive connections with TCP_NODELAY and "
        f"TCP_QUICKACK, one each, as `SidecarClient` holds one per daemon URL, with a "
        f"{CLIENT_TIMEOUT_SECONDS:g} s timeout (the client's default is 0.2 s). "
        f"{PAUSE_SECONDS * 1000:.0f} ms between requests keeps the soak's own processes at "
        "about half of this machine's two cores, which it shares with other work; at 50 ms "
        "(a 60 s trial when this benchmark was written: 1,071 req/s, the daemon at 58 % of "
        "a core, the clients at 40 %) "
        "they took a whole core and the latency was the run queue's. An error is any "
        "answer that is not 200 (a 503 from `/healthz` with its JSON status while the "
        "cloud fails is its contract and not counted), a body that is not what the path "
        "serves, a failed connection or an answer slower than the timeout; none is retried. "
        "Latency is from the request's first byte to the body read, in the clients' own "
        "processes, on cores shared with other work (the load average in the summary): its "
        "tail includes waits for a core.",
        f"Deadline check: every `/v1/expiry` answer's `expires_at_unix` must be the "
        f"emulator's current release, or the one before it for {MOVE_GRACE_SECONDS:g} s "
        "after a move; null is wrong (the empty release lasts two polls, fewer than the "
        "three that confirm a release gone).",
        "Faults, in turn: `throttle` (429 Throttling.User), `server-error` (500), `slow` "
        f"({SLOW_DELAY_SECONDS:g} s, beyond the SDK's 5 s read timeout), `malformed-json` "
        "(the body cut in half), `empty-release` (two answers), `bad-release` "
        f"(\"not-a-time\"), `account-limit` (the account's rate at "
        f"{ACCOUNT_LIMIT_PER_SECOND:g} calls/s, burst 1) and `release-move` (the release "
        "moves by minutes, no fault). The shares count the `/v1/expiry` answers (the 503s: "
        "the `/healthz` ones) in each fault's windows, and in the clear windows after them.",
        f"Hostile connections, {HOSTILE} at a time in equal shares, each opened again "
        f"{HOSTILE_RENEW_SECONDS:g} s after it ends: `idle` (never a byte), `slowloris` (a "
        "request line, then a header a second), `garbage` (256 random bytes and a blank "
        "line), `half-close` (half a request, then shutdown(SHUT_WR)), `reset` (an RST "
        "right after connecting, so the daemon never closes it itself). 'Closed after' "
        "runs from our connect to the daemon's FIN or RST.",
        f"RSS target: the slope of a least-squares line through the {soak.rss_every:g} s "
        f"VmRSS samples after a {soak.warmup:g} s warm-up, below "
        f"{TARGET_RSS_SLOPE_MB_PER_MINUTE:g} MB/min (5 MB over ten minutes). A slope uses "
        "every sample, so one step of the allocator (an arena taken or given back) moves it "
        "little, where last minus first weighs one sample against one other. A leak of 100 "
        f"bytes per honest request would show as {100 * rate * 60 / 1e6:.1f} MB/min.",
        "Log: what the daemon wrote from its first healthy answer to the end (the target "
        "scaled to 10 minutes); its most frequent lines, digits as #: "
        + "; ".join(f"{count} x `{text}`" for text, count in soak.log["top"]),
    ]
    if clients["error_samples"]:
        notes.append("First errors (seconds in, kind, detail): " + "; ".join(
            f"{s[0]} s {s[1]}: {s[2]}" for s in clients["error_samples"]))
    if clients["stuck"]:
        notes.append(f"{clients['stuck']} honest client thread(s) were stuck at the end.")
    return notes


def main(quick: bool = False) -> dict[str, Any]:
    soak, hostile = _run(quick)
    clients = soak.clients
    seconds, requests = soak.seconds, clients["requests"]
    rate = requests / seconds
    errors: Counter[str] = clients["errors"]
    error_count = sum(errors.values())
    check = _check_deadlines(clients["runs"], soak.releases)
    mismatches = check["wrong"] + check["null"]
    lags = check["move_lag_seconds"]
    latency_rows, every = _latency_rows(clients["latency_us"])
    rss = _rss_figures(soak)
    log = soak.log
    log_per_10_min = log["bytes_during"] * 600 / seconds
    step = max(1, round(seconds / 10 / soak.rss_every))  # about ten columns
    shown = soak.rss[:-1:step] + soak.rss[-1:]
    per_path = ", ".join(f"`{p}` {sum(h.values()):,}" for p, h in clients["latency_us"].items())
    summary = [
        ["duration", f"{seconds:.0f} s: {len(soak.phases)} faults of {soak.fault_seconds:g} s, "
                     f"each followed by {soak.clear_seconds:g} s clear"],
        ["honest requests", f"{requests:,}, {rate:,.0f} req/s ({per_path}) from "
                            f"{HONEST_CLIENTS} keep-alive connections"],
        ["honest errors", str(error_count) + "".join(f"; {k}: {v}" for k, v in errors.items())],
        ["honest connections opened", f"{clients['connects']} (closed by the daemon: "
                                      f"{clients['closed_by_server']})"],
        ["honest latency", f"p50 {_ms(_percentile(every, 50))} ms, p99 "
                           f"{_ms(_percentile(every, 99))} ms, max {_ms(max(every))} ms"],
        ["`/v1/expiry` deadline", f"{mismatches} answers not the current or previous release "
                                  f"(null: {check['null']}); {soak.moves} moves, the old "
                                  "release served at most "
                                  + (f"{max(lags):.2f} s after one" if lags else "n/a")],
        ["hostile connections", f"{HOSTILE} at a time; {sum(hostile.opened.values()):,} "
                                f"opened, {sum(hostile.closed_by_daemon.values()):,} closed "
                                "by the daemon"],
        ["daemon RSS", f"first {rss['first']:.1f} MB, last {rss['last']:.1f} MB, max "
                       f"{rss['max']:.1f} MB (VmHWM {rss['peak']:.1f} MB); after "
                       f"{soak.warmup:g} s: slope {rss['slope_per_minute']:+.3f} MB/min, "
                       f"growth {rss['growth_after_warmup']:+.2f} MB"],
        ["daemon CPU", f"{soak.cpu:.1f} s, {100 * soak.cpu / seconds:.1f} % of a core "
                       f"({1e6 * soak.cpu / max(1, requests):.0f} us per honest request, "
                       "hostile connections and polls included)"],
        ["daemon open files", f"{soak.before['fds']:.0f} before, max {max(soak.fds)} during, "
                              f"{soak.fds_after} after (limit {FD_LIMIT})"],
        ["daemon threads", f"{soak.before['threads']:.0f} before, max {max(soak.threads)}"],
        ["daemon log", f"{log['bytes_during']:,} bytes, {log['lines_during']} lines during "
                       f"the soak ({log_per_10_min:,.0f} bytes per 10 min); with start-up "
                       f"{log['bytes']:,} bytes, {log['lines']} lines"],
        ["OpenAPI calls", f"{soak.api_calls:,} ({soak.api_calls / seconds:.2f} a second)"],
        ["load average (1 min), start / end", " / ".join(f"{v:.2f}" for v in soak.load)],
        ["after the soak", ("healthy after " + (f"{soak.recovered:.1f} s"
                                                if soak.recovered is not None else "> 30 s"))
                           + (", serving the last release" if soak.final_ok
                              else ", NOT serving the last release")],
    ]
    notes = _notes(soak, rate)
    if check["samples"]:
        notes.append("Deadline mismatches: " + "; ".join(check["samples"]))
    if hostile.connect_failed:
        notes.append("Hostile connects that failed: " + ", ".join(
            f"{k}: {v}" for k, v in hostile.connect_failed.items()))
    targets = [
        {"target": "0 errors to honest clients (not 200, failed, or slower than 2 s)",
         "measured": f"{error_count} in {requests:,} requests ({rate:,.0f} req/s, "
                     f"{seconds:.0f} s)",
         "met": error_count == 0 and not clients["stuck"]},
        {"target": "`/v1/expiry` serves the current or last good release through the faults",
         "measured": f"{mismatches} wrong answers ({soak.moves} moves)",
         "met": mismatches == 0},
        {"target": f"RSS flat after warm-up: slope < {TARGET_RSS_SLOPE_MB_PER_MINUTE:g} MB/min",
         "measured": f"{rss['slope_per_minute']:+.3f} MB/min ({rss['growth_after_warmup']:+.2f}"
                     f" MB from {soak.warmup:g} s to the end; max {rss['max']:.1f} MB)",
         "met": rss["slope_per_minute"] < TARGET_RSS_SLOPE_MB_PER_MINUTE},
        {"target": "log volume < 1 MB over 10 minutes",
         "measured": f"{log_per_10_min / 1e6:.3f} MB per 10 min ({log['lines_during']} lines "
                     f"in {seconds:.0f} s)",
         "met": log_per_10_min < TARGET_LOG_BYTES_PER_10_MINUTES},
    ]
    return {
        "title": "Soak: honest clients, hostile connections and cloud faults at once",
        "description": "\n\n".join((__doc__ or "").strip().split("\n\n")[2:]),
        "tables": [
            {"title": "Summary", "columns": ["figure", "value"], "rows": summary},
            {"title": "Honest clients' latency (ms)",
             "columns": ["path", "requests", "p50", "p90", "p99", "p99.9", "max"],
             "rows": latency_rows},
            {"title": "Per fault: what the honest clients saw",
             "columns": ["fault", "times", "requests", "errors", "max ms",
                         "`error` set (fault)", "stale (fault)", "`/healthz` 503 (fault)",
                         "`error` set (clear after)"],
             "rows": _phase_rows(soak)},
            {"title": "Hostile connections",
             "columns": ["kind", "opened", "closed by the daemon", "closed after, median s",
                         "max s", f"held > {HOSTILE_HELD_TOO_LONG_SECONDS:g} s (closed by us)"],
             "rows": _hostile_rows(hostile)},
            {"title": "Daemon RSS over the run (every sample in the figures)",
             "columns": ["seconds", *(f"{t:.0f}" for t, _ in shown)],
             "rows": [["VmRSS MB", *(f"{kb / 1024:.1f}" for _, kb in shown)]]},
        ],
        "targets": targets,
        "notes": notes,
        "figures": {
            "seconds": seconds, "requests": requests, "rate": rate, "errors": dict(errors),
            "latency_ms": {"p50": _percentile(every, 50) / 1000,
                           "p99": _percentile(every, 99) / 1000, "max": max(every) / 1000},
            "deadline": check, "rss_mb": rss, "rss_samples_kb": soak.rss,
            "cpu_seconds": soak.cpu,
            "fds": {"before": soak.before["fds"], "max": max(soak.fds),
                    "after": soak.fds_after},
            "log": {k: v for k, v in log.items() if k != "top"},
            "hostile_opened": dict(hostile.opened),
        },
    }


# ---------------------------------------------------------------------------- entry


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.bench_soak")
    commands = parser.add_subparsers(dest="command", required=True)
    clients = commands.add_parser("clients", help="honest keep-alive clients (internal)")
    clients.add_argument("--port", type=int, required=True)
    clients.add_argument("--clients", type=int, required=True)
    clients.add_argument("--start", type=float, required=True, help="time.monotonic() to start")
    clients.add_argument("--until", type=float, required=True, help="time.monotonic() to stop")
    clients.add_argument("--seed", type=int, default=0)
    clients.add_argument("--out", required=True)
    clients.set_defaults(func=_clients_main)
    run = commands.add_parser("run", help="the soak alone; prints its figures as JSON")
    run.add_argument("--quick", action="store_true")
    run.set_defaults(func=_run_main)
    return parser


def _run_main(args: argparse.Namespace) -> int:
    print(json.dumps(main(args.quick)["figures"], indent=1, default=str))
    return 0


if __name__ == "__main__":
    arguments = _parser().parse_args()
    command: Callable[[argparse.Namespace], int] = arguments.func
    sys.exit(command(arguments))
