"""What the client's and the guard's tests share: a clean environment, a hand-moved
monotonic clock, a counting client, a hung listener, a static daemon, a plain guard and an
in-process all-reduce for ranks in threads."""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Sequence
from typing import Callable, Optional

import pytest
from daemon_harness import serve_daemon

from sidecar.models import Expiry
from sidecar.train.client import SidecarClient
from sidecar.train.guard import (
    CheckpointGuard,
    Reducer,
)
from sidecar.train.vote import MIN, Op

MLP = "MLP_CURRENT_CAPACITY_BLOCK_EXPIRATION_TIMESTAMP"
SAGEMAKER = "SAGEMAKER_CURRENT_CAPACITY_BLOCK_EXPIRATION_TIMESTAMP"
# The client, the deadline tracker and the guard log under their own names below this one.
TRAIN_LOGGER = "sidecar.train"


@pytest.fixture(autouse=True)
def clean_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    # The daemon's env source and the client both read these; a developer's shell must
    # not leak into the tests.
    for name in (MLP, SAGEMAKER, "ESI_SIDECAR_URL"):
        monkeypatch.delenv(name, raising=False)


class FakeMonotonic:
    """A monotonic clock the test moves by hand (refresh and retry intervals)."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


class CountingClient(SidecarClient):
    """The real client, counting how often it is asked (each ask is one request per URL)."""

    requests = 0

    def expiry(self) -> Optional[Expiry]:
        self.requests += 1
        return super().expiry()


def closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])




def static_daemon(expires_at: float, **overrides: object):  # type: ignore[no-untyped-def]
    overrides.setdefault("sources", ("static",))
    return serve_daemon(expires_at=repr(expires_at), **overrides)


def simple_guard(client: SidecarClient, **options: object) -> CheckpointGuard:
    options.setdefault("environ", {})
    # These tests pin the save and stop decisions; the wait for the release that follows
    # a stop is tested in test_release_wait.py.
    options.setdefault("wait_for_release", False)
    return CheckpointGuard(client, **options)  # type: ignore[arg-type]


def good_body(**changes: object) -> bytes:
    body: dict[str, object] = {
        "expires_at": None,
        "expires_at_unix": time.time() + 100,
        "remaining_seconds": 100.0,
        "kind": "scheduled-release",
        "source": "static",
        "instance_id": None,
        "scheduled_instance_id": None,
        "observed_at": None,
        "age_seconds": None,
        "stale": False,
        "error": None,
        "server_time_unix": time.time(),
    }
    body.update(changes)
    return json.dumps(body).encode()


class ThreadAllReduce:
    """An in-process all-reduce for N "ranks" running in threads (what gloo would do)."""

    def __init__(self, world_size: int) -> None:
        self.barrier = threading.Barrier(world_size, timeout=10)
        self.slots: list[tuple[float, ...]] = [(0.0,) * 8] * world_size
        self.calls = [0] * world_size

    def for_rank(self, rank: int) -> Reducer:
        def reduce(values: Sequence[float], ops: Sequence[Op], /) -> list[float]:
            self.calls[rank] += 1
            self.slots[rank] = tuple(values)
            self.barrier.wait()
            columns = list(zip(*self.slots))
            self.barrier.wait()  # nobody overwrites a slot before everyone has read
            return [min(column) if op == MIN else max(column)
                    for op, column in zip(ops, columns)]

        return reduce

    def run(self, train: Callable[[int], None], timeout: float = 30) -> list[BaseException]:
        """``train(rank)`` in one thread per rank; what they raised (a failing rank breaks
        the barrier, so the others do not wait for it)."""
        errors: list[BaseException] = []

        def guarded(rank: int) -> None:
            try:
                train(rank)
            except BaseException as exc:  # reported to the main thread
                errors.append(exc)
                self.barrier.abort()

        threads = [threading.Thread(target=guarded, args=(rank,))
                   for rank in range(len(self.calls))]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout)
        return errors
