"""The metadata sources' one request helper: failures as one line, and the whole request
bounded in time even when the service trickles its answer (issue 22, a weak point)."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import urllib3

from sidecar.host.sources.base import SourceError
from sidecar.host.sources.metadata_http import request


@contextmanager
def trickling_service(byte_every_seconds: float, stop_after_seconds: float) -> Iterator[str]:
    """A metadata service that sends its answer one byte every ``byte_every_seconds``
    (headers first), for at most ``stop_after_seconds``: each read gets a byte well inside
    any read timeout, so only a bound on the whole request ends it sooner."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(4)
    stop = threading.Event()
    answer = (b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: 20\r\n\r\n"
              + b"x" * 20)

    def serve() -> None:
        listener.settimeout(0.2)
        while not stop.is_set():
            try:
                connection, _ = listener.accept()
            except OSError:
                continue
            threading.Thread(target=trickle, args=(connection,), daemon=True).start()

    def trickle(connection: socket.socket) -> None:
        ends = time.monotonic() + stop_after_seconds
        with connection:
            connection.recv(4096)
            for byte in answer:
                if stop.is_set() or time.monotonic() > ends:
                    return
                try:
                    connection.sendall(bytes([byte]))
                except OSError:
                    return
                stop.wait(byte_every_seconds)

    server = threading.Thread(target=serve, daemon=True)
    server.start()
    try:
        yield f"http://127.0.0.1:{listener.getsockname()[1]}"
    finally:
        stop.set()
        server.join(2)
        listener.close()


def test_a_trickling_service_cannot_hold_a_request_past_its_bound() -> None:
    http = urllib3.PoolManager(retries=False)
    timeout = urllib3.Timeout(connect=0.5, read=1.0)
    with trickling_service(byte_every_seconds=0.2, stop_after_seconds=20.0) as url:
        started = time.monotonic()
        with pytest.raises(SourceError, match=r"no whole answer within 2\.5 s"):
            request(http, "GET", url + "/latest/x", place="metadata", cloud="AWS",
                    timeout=timeout)
        took = time.monotonic() - started
        assert took < 2.5 + 1.0  # the bound, not the trickle's 17 s
        # The request left behind is not doubled: the next poll says so at once.
        started = time.monotonic()
        with pytest.raises(SourceError, match="previous request has not ended"):
            request(http, "GET", url + "/latest/x", place="metadata", cloud="AWS",
                    timeout=timeout)
        assert time.monotonic() - started < 0.5


def test_a_refused_connection_is_still_one_line(unused_port: int) -> None:
    http = urllib3.PoolManager(retries=False)
    with pytest.raises(SourceError, match="cannot connect: not on AWS"):
        request(http, "GET", f"http://127.0.0.1:{unused_port}/", place="metadata", cloud="AWS",
                timeout=urllib3.Timeout(connect=0.5, read=0.5))
