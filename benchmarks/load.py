"""A small keep-alive load generator, and the ceiling it is compared with.

Standard library only at import time: the client processes import nothing else, so the
load generator's own start-up and GIL stay out of the server's way.

    python -m benchmarks.load client --port P --path /v1/expiry --requests N --out FILE
    python -m benchmarks.load ceiling --port P --body-file FILE

``client``: one process = one ``http.client.HTTPConnection`` doing N sequential keep-alive
GETs and recording each request's latency. It warms up, prints ``ready``, waits for a line
on stdin (so several clients start together), runs, and writes JSON to ``--out``.

``ceiling``: a raw ASGI function returning a constant JSON body, served by uvicorn with the
daemon's settings (see ``CEILING_UVICORN_SETTINGS``) on a socket made like the daemon's.
It is the best the daemon could do on this machine with this server stack.

``run_load()`` starts the client processes from the benchmark and sums them up.
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import json
import math
import os
import select
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

__all__ = [
    "CEILING_UVICORN_SETTINGS",
    "LoadResult",
    "median",
    "percentile",
    "run_load",
]

REPO_ROOT = Path(__file__).resolve().parents[1]

# Must match sidecar/host/daemon.py:make_server (bench_daemon checks it at run time). Copied,
# not imported: importing sidecar.host.daemon pulls in FastAPI, which would inflate the
# ceiling's own start-up time and memory that the footprint benchmark compares with.
CEILING_UVICORN_SETTINGS: dict[str, Any] = {
    "log_config": None,
    "access_log": False,
    "timeout_graceful_shutdown": 3,
    "timeout_keep_alive": 30,
    "lifespan": "on",
}

READY_TIMEOUT_SECONDS = 30.0


# ---------------------------------------------------------------------------- statistics


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (``q`` in 0..100): an observed value, never interpolated."""
    if not values:
        return math.nan
    ordered = sorted(values)
    rank = max(1, math.ceil(q / 100.0 * len(ordered)))
    return float(ordered[min(rank, len(ordered)) - 1])


def median(values: Sequence[float]) -> float:
    if not values:
        return math.nan
    ordered = sorted(values)
    middle = len(ordered) // 2
    if len(ordered) % 2:
        return float(ordered[middle])
    return (ordered[middle - 1] + ordered[middle]) / 2.0


# ---------------------------------------------------------------------------- one client


def _connect(host: str, port: int, timeout: float) -> http.client.HTTPConnection:
    connection = http.client.HTTPConnection(host, port, timeout=timeout)
    connection.connect()
    # As sidecar.train.client does: a request is one small write, never held back by Nagle.
    connection.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return connection


def _client_main(args: argparse.Namespace) -> int:
    connection = _connect(args.host, args.port, args.timeout)
    reconnects = 0
    errors = 0

    def one_request() -> None:
        nonlocal connection, reconnects, errors
        connection.request("GET", args.path)
        response = connection.getresponse()
        response.read()
        if response.status != 200:
            errors += 1
        if response.will_close:  # the server ended keep-alive: count it, carry on
            connection.close()
            connection = _connect(args.host, args.port, args.timeout)
            reconnects += 1

    for _ in range(args.warmup):
        one_request()
    reconnects = errors = 0
    print("ready", flush=True)
    if args.wait_go:
        sys.stdin.readline()

    latencies: list[int] = []
    clock = time.perf_counter_ns
    started = time.monotonic()
    deadline = started + args.max_seconds
    for index in range(args.requests):
        before = clock()
        one_request()
        latencies.append(clock() - before)
        if index % 64 == 0 and time.monotonic() > deadline:
            break
    finished = time.monotonic()
    connection.close()
    result = {
        "started": started,
        "finished": finished,
        "latencies_ns": latencies,
        "errors": errors,
        "reconnects": reconnects,
    }
    Path(args.out).write_text(json.dumps(result))
    return 0


# ---------------------------------------------------------------------------- many clients


@dataclass(frozen=True)
class LoadResult:
    connections: int
    requests: int
    seconds: float
    latencies_ns: list[int]
    errors: int
    reconnects: int

    @property
    def throughput(self) -> float:
        """Requests per second over the window in which the clients ran."""
        return self.requests / self.seconds if self.seconds > 0 else math.nan

    def latency_ms(self, q: float) -> float:
        return percentile(self.latencies_ns, q) / 1e6


def _stop(process: subprocess.Popen[bytes]) -> None:
    if process.poll() is None:
        process.kill()
    with contextlib.suppress(subprocess.TimeoutExpired):  # a kill that did not take
        process.wait(5)


def _python_env() -> dict[str, str]:
    path = os.environ.get("PYTHONPATH")
    return {**os.environ, "PYTHONPATH": str(REPO_ROOT) + (os.pathsep + path if path else "")}


def run_load(
    host: str,
    port: int,
    path: str,
    *,
    connections: int,
    requests_per_connection: int,
    warmup: int = 200,
    max_seconds: float = 60.0,
) -> LoadResult:
    """``connections`` client processes, started together, each doing N keep-alive GETs."""
    with tempfile.TemporaryDirectory(prefix="esi-bench-load-") as folder:
        processes: list[subprocess.Popen[bytes]] = []
        outputs = [Path(folder) / f"client-{index}.json" for index in range(connections)]
        errors = [Path(folder) / f"client-{index}.err" for index in range(connections)]
        try:
            for out, err in zip(outputs, errors):
                with err.open("wb") as err_file:
                    processes.append(
                        subprocess.Popen(
                            [sys.executable, "-m", "benchmarks.load", "client",
                             "--host", host, "--port", str(port), "--path", path,
                             "--requests", str(requests_per_connection),
                             "--warmup", str(warmup), "--max-seconds", str(max_seconds),
                             "--out", str(out), "--wait-go"],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err_file,
                            cwd=REPO_ROOT, env=_python_env(),
                        )
                    )
            deadline = time.monotonic() + READY_TIMEOUT_SECONDS
            for process, err in zip(processes, errors):
                assert process.stdout is not None
                readable, _, _ = select.select(
                    [process.stdout], [], [], max(0.0, deadline - time.monotonic())
                )
                line = process.stdout.readline() if readable else b""
                if line.strip() != b"ready":
                    process.poll()
                    raise RuntimeError(
                        f"load client not ready (exit {process.returncode}): "
                        f"{err.read_text(errors='replace').strip()[-500:]}"
                    )
            for process in processes:  # all warmed up and connected: go
                assert process.stdin is not None
                process.stdin.write(b"go\n")
                process.stdin.flush()
            for process, err in zip(processes, errors):
                try:
                    code = process.wait(max_seconds + 30)
                except subprocess.TimeoutExpired:
                    raise RuntimeError("load client did not finish in time") from None
                if code != 0:
                    raise RuntimeError(
                        f"load client failed (exit {code}): "
                        f"{err.read_text(errors='replace').strip()[-500:]}"
                    )
        finally:
            for process in processes:
                _stop(process)
                for pipe in (process.stdin, process.stdout):
                    if pipe is not None:
                        pipe.close()
        results = [json.loads(out.read_text()) for out in outputs]
    latencies = [value for result in results for value in result["latencies_ns"]]
    window = max(r["finished"] for r in results) - min(r["started"] for r in results)
    return LoadResult(
        connections=connections,
        requests=len(latencies),
        seconds=window,
        latencies_ns=latencies,
        errors=sum(r["errors"] for r in results),
        reconnects=sum(r["reconnects"] for r in results),
    )


# ---------------------------------------------------------------------------- the ceiling

Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]


def make_ceiling_app(body: bytes) -> Callable[[dict[str, Any], Receive, Send], Awaitable[None]]:
    """A raw ASGI app: every path answers 200 with ``body`` as JSON. No framework."""
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
    ]

    async def app(scope: dict[str, Any], receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                if message["type"] == "lifespan.startup":
                    await send({"type": "lifespan.startup.complete"})
                elif message["type"] == "lifespan.shutdown":
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        if scope["type"] != "http":
            return
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": body})

    return app


def _listen_socket(host: str, port: int) -> socket.socket:
    """Made like sidecar/host/daemon.py:bind_sockets (IPPROTO_TCP, so asyncio sets NODELAY)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.set_inheritable(True)
    return sock


def _ceiling_main(args: argparse.Namespace) -> int:
    import uvicorn  # only here: the client processes stay stdlib-only

    body = Path(args.body_file).read_bytes() if args.body_file else b'{"ok":true}'
    sock = _listen_socket(args.host, args.port)
    config = uvicorn.Config(make_ceiling_app(body), **CEILING_UVICORN_SETTINGS)
    uvicorn.Server(config).run(sockets=[sock])
    return 0


# ---------------------------------------------------------------------------- entry


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.load", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    client = commands.add_parser("client", help="one keep-alive client")
    client.add_argument("--host", default="127.0.0.1")
    client.add_argument("--port", type=int, required=True)
    client.add_argument("--path", default="/v1/expiry")
    client.add_argument("--requests", type=int, default=1000)
    client.add_argument("--warmup", type=int, default=200)
    client.add_argument("--max-seconds", type=float, default=60.0)
    client.add_argument("--timeout", type=float, default=5.0)
    client.add_argument("--out", required=True)
    client.add_argument("--wait-go", action="store_true", help="wait for a stdin line")
    client.set_defaults(func=_client_main)
    ceiling = commands.add_parser("ceiling", help="bare uvicorn, constant JSON body")
    ceiling.add_argument("--host", default="127.0.0.1")
    ceiling.add_argument("--port", type=int, required=True)
    ceiling.add_argument("--body-file", help="the body to serve (default {\"ok\":true})")
    ceiling.set_defaults(func=_ceiling_main)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = _parser().parse_args(argv)
    func: Callable[[argparse.Namespace], int] = args.func
    return func(args)


if __name__ == "__main__":
    sys.exit(main())
