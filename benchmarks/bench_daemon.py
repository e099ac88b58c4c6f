"""The daemon as a process: ``/v1/expiry`` throughput and latency, and its footprint.

Run alone: ``python -m benchmarks --only throughput`` (or ``footprint``).

Both the daemon (``esi-sidecar serve --source static ...``) and the ceiling it is compared
with (a raw ASGI function under uvicorn with the daemon's settings, see
``benchmarks/load.py``) run as real subprocesses on 127.0.0.1, and the load comes from
separate client processes, so no two of them share a GIL.
"""

from __future__ import annotations

import contextlib
import http.client
import importlib.metadata
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Optional

from benchmarks.load import (
    CEILING_UVICORN_SETTINGS,
    REPO_ROOT,
    LoadResult,
    median,
    run_load,
)

if TYPE_CHECKING:
    from sidecar.tools.emulator import Emulator

__all__ = [
    "ServerProcess",
    "main_footprint",
    "main_throughput",
    "start_ceiling",
    "start_daemon",
    "static_deadline",
    "wait_healthy",
]

HOST = "127.0.0.1"
START_TIMEOUT_SECONDS = 60.0
EMULATOR_ACCESS_KEY = "AKLTbenchmark0000001"
EMULATOR_SECRET_KEY = "YmVuY2htYXJrLXNlY3JldA=="
# For context only (ARCHITECTURE.md "Installs"); never installed here.
ALL_SERVICES_SDK_MB = 630


# ---------------------------------------------------------------------------- processes


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind((HOST, 0))
        return int(sock.getsockname()[1])


def static_deadline(seconds_from_now: float = 86400.0) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(time.time() + seconds_from_now))


@dataclass
class ServerProcess:
    name: str
    process: subprocess.Popen[bytes]
    port: int
    launched: float  # time.monotonic() just before Popen
    log_path: Path

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.port}"

    @property
    def pid(self) -> int:
        return self.process.pid

    def log_tail(self, limit: int = 800) -> str:
        try:
            return self.log_path.read_text(errors="replace").strip()[-limit:]
        except OSError:
            return ""


def _esi_sidecar() -> list[str]:
    script = Path(sys.executable).parent / "esi-sidecar"
    return [str(script)] if script.exists() else [sys.executable, "-m", "sidecar.cli"]


def _stop(server: ServerProcess) -> None:
    process = server.process
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(5)
        except subprocess.TimeoutExpired:
            process.kill()
    with contextlib.suppress(subprocess.TimeoutExpired):  # a kill that did not take
        process.wait(5)


@contextmanager
def _server(name: str, command: list[str], port: int,
            env: Optional[dict[str, str]] = None) -> Iterator[ServerProcess]:
    path = os.environ.get("PYTHONPATH")
    full_env = {**os.environ, **(env or {}),
                "PYTHONPATH": str(REPO_ROOT) + (os.pathsep + path if path else "")}
    with tempfile.NamedTemporaryFile(prefix=f"esi-bench-{name}-", suffix=".log",
                                     delete=False) as log:
        log_path = Path(log.name)
        launched = time.monotonic()
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT,
                                   cwd=REPO_ROOT, env=full_env)
    server = ServerProcess(name, process, port, launched, log_path)
    try:
        yield server
    finally:
        _stop(server)
        log_path.unlink(missing_ok=True)


@contextmanager
def start_daemon(*args: str, env: Optional[dict[str, str]] = None,
                 name: str = "daemon") -> Iterator[ServerProcess]:
    """``esi-sidecar serve --listen 127.0.0.1:PORT ARGS`` as a subprocess (not yet healthy)."""
    port = free_port()
    command = [*_esi_sidecar(), "serve", "--listen", f"{HOST}:{port}",
               "--log-level", "WARNING", *args]
    with _server(name, command, port, env) as server:
        yield server


@contextmanager
def start_static_daemon(poll_interval: float = 30.0) -> Iterator[ServerProcess]:
    with start_daemon("--source", "static", "--expires-at", static_deadline(),
                      "--poll-interval", f"{poll_interval:g}", name="static") as server:
        yield server


@contextmanager
def start_ceiling(body_file: Optional[Path] = None) -> Iterator[ServerProcess]:
    """The bare uvicorn app (``benchmarks/load.py``) as a subprocess."""
    port = free_port()
    command = [sys.executable, "-m", "benchmarks.load", "ceiling", "--port", str(port)]
    if body_file is not None:
        command += ["--body-file", str(body_file)]
    with _server("ceiling", command, port) as server:
        yield server


def http_get(url: str, path: str, timeout: float = 2.0) -> tuple[int, bytes]:
    host, _, port = url.removeprefix("http://").partition(":")
    connection = http.client.HTTPConnection(host, int(port), timeout=timeout)
    try:
        connection.request("GET", path)
        response = connection.getresponse()
        return response.status, response.read()
    finally:
        connection.close()


def wait_healthy(server: ServerProcess, path: str = "/healthz",
                 timeout: float = START_TIMEOUT_SECONDS) -> float:
    """Poll ``path`` every 5 ms until 200; seconds from launch to that answer."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.process.poll() is not None:
            raise RuntimeError(f"{server.name} exited with {server.process.returncode}: "
                               f"{server.log_tail()}")
        try:
            status, _ = http_get(server.url, path, timeout=1.0)
        except OSError:
            status = 0
        if status == 200:
            return time.monotonic() - server.launched
        time.sleep(0.005)
    raise RuntimeError(f"{server.name} not healthy within {timeout:g} s: {server.log_tail()}")


def uvicorn_settings_mismatch() -> list[str]:
    """Differences between the ceiling's uvicorn settings and the daemon's make_server()."""
    from sidecar.host.daemon import build_daemon, make_server
    from sidecar.host.settings import Settings

    daemon = build_daemon(Settings(sources=("static",), expires_at=static_deadline()))
    config = make_server(daemon).config
    return [f"{key}: daemon {getattr(config, key)!r}, ceiling {value!r}"
            for key, value in CEILING_UVICORN_SETTINGS.items()
            if getattr(config, key) != value]


# ---------------------------------------------------------------------------- app cost


def _expiry_scope() -> dict[str, Any]:
    return {
        "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "GET",
        "scheme": "http", "path": "/v1/expiry", "raw_path": b"/v1/expiry", "query_string": b"",
        "root_path": "", "headers": [(b"host", b"127.0.0.1")],
        "client": (HOST, 50000), "server": (HOST, 8791),
    }


def app_cost_per_request(calls: int, repeats: int) -> dict[str, float]:
    """CPU seconds per ``GET /v1/expiry`` handled by each ASGI app, called in-process.

    No sockets and no HTTP parsing: this isolates what the application adds on top of
    uvicorn. ``process_time`` counts every thread, so a worker-thread hop is included.
    """
    import asyncio

    from benchmarks.load import make_ceiling_app
    from sidecar.host.daemon import build_daemon
    from sidecar.host.settings import Settings
    from sidecar.models import KIND_SCHEDULED_RELEASE, Observation

    daemon = build_daemon(Settings(sources=("static",), expires_at=static_deadline()))
    daemon.store.record_success(
        "static", Observation(expires_at_unix=time.time() + 86400, kind=KIND_SCHEDULED_RELEASE)
    )
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    async def measure(app: Any) -> float:
        async def run(count: int) -> None:
            for _ in range(count):
                await app(_expiry_scope(), receive, send)
                sent.clear()

        await run(min(calls, 300))  # warm-up
        per_call = []
        for _ in range(repeats):
            started = time.process_time()
            await run(calls)
            per_call.append((time.process_time() - started) / calls)
        return median(per_call)

    async def all_apps() -> dict[str, float]:
        body = b"{}" * 200
        return {"ceiling": await measure(make_ceiling_app(body)),
                "fastapi-async": await measure(_fastapi_app(body, asynchronous=True)),
                "fastapi-sync": await measure(_fastapi_app(body, asynchronous=False)),
                "daemon": await measure(daemon.app)}

    return asyncio.run(all_apps())


def _fastapi_app(body: bytes, *, asynchronous: bool) -> Any:
    """The smallest FastAPI app with one route returning ``body``: the framework's floor."""
    from fastapi import FastAPI
    from fastapi.responses import Response

    app = FastAPI()
    if asynchronous:
        @app.get("/v1/expiry")
        async def expiry_async() -> Response:
            return Response(body, media_type="application/json")
    else:
        @app.get("/v1/expiry")
        def expiry_sync() -> Response:
            return Response(body, media_type="application/json")
    return app


def sync_handlers() -> list[str]:
    """The daemon's GET routes whose handler is a plain ``def`` (run in a worker thread)."""
    import inspect

    from sidecar.host.daemon import build_daemon
    from sidecar.host.settings import Settings

    app = build_daemon(Settings(sources=("static",), expires_at=static_deadline())).app
    found = []
    for route in app.routes:
        endpoint = getattr(route, "endpoint", None)
        path = getattr(route, "path", "")
        if endpoint is None or not path.startswith(("/v1/", "/healthz", "/metrics")):
            continue
        if not inspect.iscoroutinefunction(endpoint):
            code = endpoint.__code__
            where = Path(code.co_filename)
            with contextlib.suppress(ValueError):
                where = where.relative_to(REPO_ROOT)
            found.append(f"`{path}` (`{where}:{code.co_firstlineno}`)")
    return found


# ---------------------------------------------------------------------------- throughput


def _fmt(value: float, digits: int = 2) -> str:
    return f"{value:,.{digits}f}"


def main_throughput(quick: bool = False) -> dict[str, Any]:
    """``/v1/expiry``: daemon vs the bare uvicorn ceiling, 1 and 4 keep-alive connections."""
    repeats = 1 if quick else 5
    plan = {1: 500, 4: 250} if quick else {1: 3000, 4: 1500}  # requests per connection
    warmup = 100 if quick else 300
    path = "/v1/expiry"
    mismatch = uvicorn_settings_mismatch()
    runs: dict[tuple[str, int], list[LoadResult]] = {}
    with tempfile.TemporaryDirectory(prefix="esi-bench-") as folder, \
            start_static_daemon() as daemon:
        wait_healthy(daemon)
        status, body = http_get(daemon.url, path)
        if status != 200:
            raise RuntimeError(f"daemon answered {status} to {path}")
        body_file = Path(folder) / "expiry.json"
        body_file.write_bytes(body)  # the ceiling serves the very same bytes
        with start_ceiling(body_file) as ceiling:
            wait_healthy(ceiling, path)
            servers = {"ceiling": ceiling, "daemon": daemon}
            for repeat in range(repeats):
                for connections, count in plan.items():
                    order = ["ceiling", "daemon"] if repeat % 2 == 0 else ["daemon", "ceiling"]
                    for name in order:
                        result = run_load(HOST, servers[name].port, path,
                                          connections=connections,
                                          requests_per_connection=count, warmup=warmup)
                        runs.setdefault((name, connections), []).append(result)
                        print(f"    {name:8s} {connections} conn: {result.throughput:8.0f} req/s"
                              f"  p50 {result.latency_ms(50):.3f} ms"
                              f"  p99 {result.latency_ms(99):.3f} ms", flush=True)

    def summary(name: str, connections: int) -> dict[str, float]:
        results = runs[(name, connections)]
        return {
            "throughput": median([r.throughput for r in results]),
            "p50": median([r.latency_ms(50) for r in results]),
            "p99": median([r.latency_ms(99) for r in results]),
            "max": median([r.latency_ms(100) for r in results]),
            "errors": float(sum(r.errors + r.reconnects for r in results)),
        }

    rows: list[list[str]] = []
    targets: list[dict[str, Any]] = []
    figures: dict[str, Any] = {}
    for connections in plan:
        ceiling_figures = summary("ceiling", connections)
        daemon_figures = summary("daemon", connections)
        figures[f"{connections}conn"] = {"ceiling": ceiling_figures, "daemon": daemon_figures}
        for name, values in (("bare uvicorn (ceiling)", ceiling_figures),
                             ("esi-sidecar daemon", daemon_figures)):
            rows.append([
                name, str(connections), _fmt(values["throughput"], 0),
                _fmt(values["p50"], 3), _fmt(values["p99"], 3), _fmt(values["max"], 3),
                str(int(values["errors"])),
            ])
        # Paired: each run's daemon against the ceiling measured next to it, so a burst of
        # load from other processes moves both sides of a ratio together.
        pairs = list(zip(runs[("daemon", connections)], runs[("ceiling", connections)]))

        def paired(get: Callable[[LoadResult], float],
                   pairs: list[tuple[LoadResult, LoadResult]] = pairs) -> float:
            return median([get(daemon_run) / get(ceiling_run)
                           for daemon_run, ceiling_run in pairs])

        ratio = paired(lambda r: r.throughput)
        figures[f"{connections}conn"]["ratio_throughput"] = ratio
        rows.append([
            "**daemon / ceiling**", str(connections), f"**{ratio:.2f}**",
            f"{paired(lambda r: r.latency_ms(50)):.2f}",
            f"{paired(lambda r: r.latency_ms(99)):.2f}",
            f"{paired(lambda r: r.latency_ms(100)):.2f}", "",
        ])
        targets.append({
            "target": f"throughput >= 70% of the ceiling ({connections} connection"
                      f"{'s' if connections > 1 else ''})",
            "measured": f"{ratio:.0%} ({daemon_figures['throughput']:,.0f} vs "
                        f"{ceiling_figures['throughput']:,.0f} req/s)",
            "met": ratio >= 0.70,
        })
        targets.append({
            "target": f"p99 < 2 ms on loopback ({connections} connection"
                      f"{'s' if connections > 1 else ''})",
            "measured": f"{daemon_figures['p99']:.3f} ms (ceiling "
                        f"{ceiling_figures['p99']:.3f} ms"
                        + (", so the machine's noise alone misses it"
                           if ceiling_figures["p99"] >= 2.0 else "") + ")",
            "met": daemon_figures["p99"] < 2.0,
        })
    cost = app_cost_per_request(1000 if quick else 3000, 3 if quick else 5)
    print(f"    in-process app cost: ceiling {cost['ceiling'] * 1e6:.1f} us, daemon "
          f"{cost['daemon'] * 1e6:.1f} us CPU per request", flush=True)
    figures["app_cpu_seconds_per_request"] = cost
    cost_labels = {
        "ceiling": "raw ASGI function (the ceiling)",
        "fastapi-async": "minimal FastAPI app, one `async def` route, same kind of Response",
        "fastapi-sync": "minimal FastAPI app, one plain `def` route, same kind of Response",
        "daemon": "the daemon's app (`sidecar.host.api.create_app`)",
    }
    cost_rows = [
        [label, _fmt(cost[key] * 1e6, 1), f"{cost[key] / cost['fastapi-async']:.2f}"]
        for key, label in cost_labels.items()
    ]
    notes = [
        f"Each client is a separate process holding one `http.client.HTTPConnection` "
        f"(TCP_NODELAY) doing N sequential keep-alive GETs after {warmup} warm-up requests; "
        f"N = {', '.join(f'{n:,} per connection with {c}' for c, n in plan.items())}. "
        f"Throughput is all requests over the window from the first client's start to the "
        f"last one's end. Figures are medians of {repeats} run(s), ceiling and daemon "
        "alternating which goes first; the ratio rows are medians of the per-run ratios "
        "(each daemon run against the ceiling run next to it).",
        "The ceiling serves the daemon's own `/v1/expiry` body (captured at start) as "
        "constant bytes, so both answers are the same size.",
        "Server and load generator share this machine's cores, so absolute figures with 4 "
        "connections are bounded by CPU, not by the network; compare the ratios.",
    ]
    notes.append(
        "App cost: the ASGI app called directly in this process (no socket, no HTTP "
        "parsing), CPU time per request over all threads, median of repeats: what the "
        "application adds on top of uvicorn."
    )
    slow = sync_handlers()
    if slow:
        notes.append(
            "Found: these handlers are plain `def` functions, which FastAPI runs in anyio's "
            "worker-thread pool for every request (a queue hand-off and two GIL switches): "
            + ", ".join(slow) + ". `store.expiry()` only takes a lock and copies a few "
            "fields, so it could run on the event loop (`async def`)."
        )
    if mismatch:
        notes.append("WARNING: ceiling and daemon uvicorn settings differ: " + "; ".join(mismatch))
    else:
        notes.append("uvicorn settings of the ceiling checked equal to "
                     "`sidecar/host/daemon.py:make_server` at run time: "
                     + ", ".join(f"{k}={v!r}" for k, v in CEILING_UVICORN_SETTINGS.items()) + ".")
    return {
        "title": "Daemon `/v1/expiry` throughput and latency",
        "description": "`esi-sidecar serve --source static` as a subprocess vs a bare uvicorn "
                       "app (raw ASGI function, constant JSON body) with the same uvicorn "
                       "settings, same socket set-up, also a subprocess.",
        "tables": [{
            "title": "Keep-alive load on 127.0.0.1",
            "columns": ["server", "connections", "req/s", "p50 ms", "p99 ms", "max ms",
                        "errors"],
            "rows": rows,
        }, {
            "title": "Application cost per request, in-process (CPU)",
            "columns": ["app", "CPU us per request", "vs minimal FastAPI (async)"],
            "rows": cost_rows,
        }],
        "targets": targets,
        "notes": notes,
        "figures": figures,
    }


# ---------------------------------------------------------------------------- footprint


def _proc_status(pid: int) -> dict[str, str]:
    values: dict[str, str] = {}
    with open(f"/proc/{pid}/status", encoding="utf-8") as handle:
        for line in handle:
            key, _, value = line.partition(":")
            values[key] = value.strip()
    return values


def rss_mb(pid: int) -> float:
    return int(_proc_status(pid)["VmRSS"].split()[0]) / 1024.0


def threads(pid: int) -> int:
    return int(_proc_status(pid)["Threads"])


def cpu_seconds(pid: int) -> float:
    """utime + stime of the process (all its threads), from /proc/PID/stat."""
    with open(f"/proc/{pid}/stat", encoding="utf-8") as handle:
        fields = handle.read().rsplit(")", 1)[1].split()
    ticks = int(fields[11]) + int(fields[12])  # fields 14 and 15 of proc(5)
    return ticks / os.sysconf("SC_CLK_TCK")


@contextmanager
def emulator_env() -> Iterator[tuple[Emulator, dict[str, str]]]:
    """An in-process emulator (started), and the environment a daemon needs for it."""
    from sidecar.tools.emulator import Emulator

    emulator = Emulator(access_key=EMULATOR_ACCESS_KEY, secret_key=EMULATOR_SECRET_KEY,
                        region="cn-beijing", instance_id="i-bench0001",
                        scheduled_instance_id="esi-bench0001", auto_release_at=None)
    emulator.set_release_in(3600)
    emulator.start()
    try:
        yield emulator, {"VOLCENGINE_ACCESS_KEY": EMULATOR_ACCESS_KEY,
                    "VOLCENGINE_SECRET_KEY": EMULATOR_SECRET_KEY}
    finally:
        emulator.stop()


@contextmanager
def start_volcengine_daemon(emulator_url: str, env: dict[str, str],
                            poll_interval: float = 30.0) -> Iterator[ServerProcess]:
    # Every --poll-interval: the notice benchmark moves the release an hour away and back,
    # and measures the latency at P, which is what the adaptive schedule polls at in the
    # final 15 minutes (docs/polling.md); far away it would wait minutes by design.
    with start_daemon("--source", "volcengine-esi", "--api-endpoint", emulator_url,
                      "--metadata-url", emulator_url, "--poll-interval", f"{poll_interval:g}",
                      "--poll-schedule", "fixed", env=env, name="volcengine") as server:
        yield server


def _startup_times(emulator_url: str, env: dict[str, str], starts: int) -> dict[str, list[float]]:
    times: dict[str, list[float]] = {"interpreter": [], "ceiling": [], "static": [],
                                     "volcengine": []}
    for _ in range(starts):
        launched = time.monotonic()
        subprocess.run([sys.executable, "-c", "pass"], check=True, timeout=60)
        times["interpreter"].append(time.monotonic() - launched)
        with start_ceiling() as ceiling:
            times["ceiling"].append(wait_healthy(ceiling, "/"))
        with start_static_daemon() as static:
            times["static"].append(wait_healthy(static))
        with start_volcengine_daemon(emulator_url, env) as volcengine:
            times["volcengine"].append(wait_healthy(volcengine))
    return times


def _idle(emulator_url: str, env: dict[str, str], window: float) -> dict[str, dict[str, float]]:
    """RSS after start-up and after ``window / 2`` s, CPU % of one core over ``window`` s."""
    figures: dict[str, dict[str, float]] = {}
    with start_ceiling() as ceiling, start_static_daemon() as static, \
            start_volcengine_daemon(emulator_url, env) as volcengine:
        servers = {"ceiling": ceiling, "static": static, "volcengine": volcengine}
        for name, server in servers.items():
            wait_healthy(server, "/" if name == "ceiling" else "/healthz")
        time.sleep(0.5)  # let the first poll's threads finish
        cpu_start = {name: cpu_seconds(s.pid) for name, s in servers.items()}
        started = time.monotonic()
        for name, server in servers.items():
            figures[name] = {"rss_start": rss_mb(server.pid), "threads": threads(server.pid)}
        time.sleep(window / 2)
        for name, server in servers.items():
            figures[name]["rss_idle"] = rss_mb(server.pid)
        time.sleep(max(0.0, started + window - time.monotonic()))
        elapsed = time.monotonic() - started
        for name, server in servers.items():
            used = cpu_seconds(server.pid) - cpu_start[name]
            figures[name]["cpu_percent"] = 100.0 * used / elapsed
            figures[name]["rss_end"] = rss_mb(server.pid)
    return figures


def _dist_size(dist: importlib.metadata.Distribution) -> int:
    total = 0
    for file in dist.files or ():
        try:
            total += Path(str(file.locate())).stat().st_size
        except OSError:
            continue
    return total


def dependency_closure(name: str, extras: Sequence[str] = ()) -> tuple[
        dict[str, importlib.metadata.Distribution], list[str]]:
    """Installed distributions required by ``name[extras]``, recursively (not ``name``)."""
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    found: dict[str, importlib.metadata.Distribution] = {}
    missing: set[str] = set()
    done: dict[str, set[str]] = {}  # distribution -> extras already walked ("" = base)
    queue: list[tuple[str, frozenset[str]]] = [(name, frozenset(extras))]
    root = canonicalize_name(name)
    for _ in range(10_000):  # bounded: a closure is a few dozen distributions
        if not queue:
            break
        current, wanted = queue.pop()
        key = canonicalize_name(current)
        todo = ({""} | set(wanted)) - done.get(key, set())
        if not todo:
            continue
        done.setdefault(key, set()).update(todo)
        try:
            dist = importlib.metadata.distribution(current)
        except importlib.metadata.PackageNotFoundError:
            missing.add(current)
            continue
        if key != root:
            found[key] = dist
        for text in dist.requires or ():
            requirement = Requirement(text)
            marker = requirement.marker
            base = marker is None or marker.evaluate({"extra": ""})
            # A base requirement is taken with "", an extra's only with that extra.
            if ("" in todo and base) or any(
                marker is not None and not base and marker.evaluate({"extra": extra})
                for extra in todo - {""}
            ):
                queue.append((requirement.name, frozenset(requirement.extras)))
    return found, sorted(missing)


def _own_source_size() -> int:
    """The ``sidecar`` package's files as a wheel ships them (no caches)."""
    package = REPO_ROOT / "sidecar"
    return sum(p.stat().st_size for p in package.rglob("*")
               if p.is_file() and "__pycache__" not in p.parts)


def install_sizes() -> dict[str, Any]:
    closure, missing = dependency_closure("esi-sidecar", ["server"])
    upload_closure, upload_missing = dependency_closure("esi-sidecar", ["server", "upload"])
    base_closure, _ = dependency_closure("esi-sidecar")
    sizes = {key: _dist_size(dist) for key, dist in closure.items()}
    upload_sizes = {key: _dist_size(dist) for key, dist in upload_closure.items()}
    versions = {key: dist.version for key, dist in closure.items()}
    return {
        "own_bytes": _own_source_size(),
        "base_dependencies": len(base_closure),
        "server_dependency_bytes": sum(sizes.values()),
        "upload_dependencies": len(upload_sizes),
        "upload_dependency_bytes": sum(upload_sizes.values()),
        "upload_missing": upload_missing,
        "sizes": sizes,
        "versions": versions,
        "missing": missing,
    }


def main_footprint(quick: bool = False) -> dict[str, Any]:
    """Idle memory and CPU, start-up to the first healthy answer, install size."""
    starts = 1 if quick else 5
    window = 2.0 if quick else 10.0
    with emulator_env() as (emulator, env):
        emulator_url = emulator.url
        print(f"    start-up: {starts} start(s) of each", flush=True)
        startup = _startup_times(emulator_url, env, starts)
        print(f"    idle: {window:g} s window, three servers side by side", flush=True)
        idle = _idle(emulator_url, env, window)
    sizes = install_sizes()

    labels = {
        "ceiling": "bare uvicorn app (baseline)",
        "static": "daemon, `--source static`",
        "volcengine": "daemon, `--source volcengine-esi` (emulator)",
    }
    base_start = median(startup["ceiling"])
    start_rows = [["`python -c pass` (interpreter only)",
                   _fmt(median(startup["interpreter"]) * 1000, 0),
                   _fmt(max(startup["interpreter"]) * 1000, 0),
                   f"{median(startup['interpreter']) / base_start:.2f}"]]
    for name, label in labels.items():
        start_rows.append([label, _fmt(median(startup[name]) * 1000, 0),
                           _fmt(max(startup[name]) * 1000, 0),
                           f"{median(startup[name]) / base_start:.2f}"])
    base_rss = idle["ceiling"]["rss_idle"]
    idle_rows = []
    for name, label in labels.items():
        values = idle[name]
        idle_rows.append([
            label, _fmt(values["rss_start"], 1), _fmt(values["rss_idle"], 1),
            _fmt(values["rss_end"], 1), f"{values['rss_idle'] / base_rss:.2f}",
            _fmt(values["cpu_percent"], 2), str(int(values["threads"])),
        ])
    own_mb = sizes["own_bytes"] / 1e6
    dependency_mb = sizes["server_dependency_bytes"] / 1e6
    server_mb = own_mb + dependency_mb
    upload_mb = own_mb + sizes["upload_dependency_bytes"] / 1e6
    size_rows = [
        ["`esi-sidecar` (base, 0 dependencies)", str(sizes["base_dependencies"]),
         _fmt(own_mb, 2), "1.00"],
        ["`esi-sidecar[server]` (itself + the closure below)", str(len(sizes["sizes"])),
         _fmt(server_mb, 1), f"{server_mb / own_mb:.0f}"],
        ["`esi-sidecar[server,upload]` (+ boto3, watchdog: the checkpoint uploader)",
         str(sizes["upload_dependencies"]), _fmt(upload_mb, 1), f"{upload_mb / own_mb:.0f}"],
        ["`volcengine-python-sdk` (all services; not installed, for context)", "",
         f"~{ALL_SERVICES_SDK_MB}", f"~{ALL_SERVICES_SDK_MB / own_mb:.0f}"],
    ]
    dependency_rows = [
        [f"`{key}`", sizes["versions"][key], _fmt(size / 1e6, 2)]
        for key, size in sorted(sizes["sizes"].items(), key=lambda item: -item[1])
    ]
    volc_bytes = sum(size for key, size in sizes["sizes"].items() if key.startswith("volcengine"))
    static_start = median(startup["static"])
    notes = [
        f"Start-up: from `Popen` to the first `/healthz` 200 (the ceiling: first 200 on `/`), "
        f"probed every 5 ms; median and max of {starts} start(s), kinds interleaved. A daemon "
        "is healthy only after its first successful poll, so the volcengine-esi figure "
        "includes the metadata look-ups and two signed OpenAPI calls to the local emulator.",
        f"Idle: the three servers run side by side with `--poll-interval 30`; RSS from "
        f"`/proc/PID/status` VmRSS right after start-up, after {window / 2:g} s and after "
        f"{window:g} s; CPU is utime+stime from `/proc/PID/stat` over the {window:g} s window "
        "as % of one core (tick resolution 10 ms).",
        "Install size: the files listed in each installed distribution's RECORD (so including "
        "the `.pyc` files pip compiled), summed over the dependency closure of "
        "`esi-sidecar[server]` walked with `importlib.metadata` in this `.venv`; the base "
        "install is the `sidecar` package itself (the wheel's files), with no dependencies. "
        f"The two Volcengine SDK distributions (`volcenginesdk-core`, `volcenginesdk-ecs`) "
        f"take {volc_bytes / 1e6:.1f} MB of the total; the all-services meta package "
        f"`volcengine-python-sdk` is about {ALL_SERVICES_SDK_MB} MB and is not required.",
    ]
    if sizes["missing"]:
        notes.append("Required but not installed (not counted): " + ", ".join(sizes["missing"]))
    targets = [{
        "target": "daemon start-up to first healthy answer (static), for information",
        "measured": f"{static_start * 1000:,.0f} ms ({static_start / base_start:.1f}x the "
                    "bare uvicorn app)",
        "met": None,
    }]
    return {
        "title": "Daemon footprint",
        "description": "Memory, idle CPU and start-up of `esi-sidecar serve` as a subprocess, "
                       "against a bare uvicorn app measured alike; the size of the installs.",
        "tables": [
            {"title": "Start-up to the first healthy answer",
             "columns": ["process", "median ms", "max ms", "vs bare uvicorn"],
             "rows": start_rows},
            {"title": "Idle memory and CPU",
             "columns": ["process", "RSS at start MB", f"RSS after {window / 2:g} s MB",
                         f"RSS after {window:g} s MB", "RSS vs bare uvicorn",
                         f"CPU % of a core over {window:g} s", "threads"],
             "rows": idle_rows},
            {"title": "Install size",
             "columns": ["install", "dependencies", "MB on disk", "vs base"],
             "rows": size_rows},
            {"title": "`[server]` dependency closure, largest first",
             "columns": ["distribution", "version", "MB"],
             "rows": dependency_rows},
        ],
        "targets": targets,
        "notes": notes,
        "figures": {"startup_seconds": startup, "idle": idle,
                    "install": {k: v for k, v in sizes.items() if k != "versions"}},
    }


def _print(result: dict[str, Any]) -> None:
    print(json.dumps(result.get("figures", {}), indent=1, default=str)[:4000])


if __name__ == "__main__":
    _print(main_throughput(quick="--quick" in sys.argv))
    _print(main_footprint(quick="--quick" in sys.argv))
