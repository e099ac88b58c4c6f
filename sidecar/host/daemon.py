"""Wires settings -> sources -> store -> poller -> API -> uvicorn.

The poller starts and stops inside the FastAPI lifespan, not around ``Server.run()``:
uvicorn re-raises SIGTERM after its own graceful shutdown, so code after ``run()`` may
never execute, and the state file must still be flushed.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Callable, ClassVar, Optional, Protocol, cast, runtime_checkable

import uvicorn
from fastapi import FastAPI
from uvicorn.protocols.http.h11_impl import H11Protocol

from sidecar.host.api import create_app
from sidecar.host.approve import Approvable, Approver
from sidecar.host.connections import (
    MAX_CONNECTIONS,
    ConnectionGuard,
    ListeningSocket,
    connection_limit,
    raise_open_file_limit,
)
from sidecar.host.features import Needs, Part, UploadsView
from sidecar.host.features.registry import build_features
from sidecar.host.logs import hold_back_repeats
from sidecar.host.notify import notify, watchdog_interval
from sidecar.host.poller import Poller
from sidecar.host.schedule import ApiBudget
from sidecar.host.settings import ConfigError, Settings, storage_options
from sidecar.host.sources.auto import AUTO, PROBE_TIMEOUT_SECONDS, ProbedSource
from sidecar.host.sources.base import Source, where
from sidecar.host.sources.registry import (
    auto_candidates,
    create_source,
    probe_source,
    specs,
    traits_of,
)
from sidecar.host.statefile import StateFile
from sidecar.host.store import NO_SOURCE_RUNS, Store
from sidecar.host.store_section import StoreSection

__all__ = [
    "Background", "Daemon", "UploaderLike", "bind_sockets", "build_daemon", "build_sources", "run",
]

log = logging.getLogger("sidecar.host.daemon")

READY_TIMEOUT_SECONDS = 60.0
# Stopping: uvicorn's grace for open requests, then one shared budget for joining the
# uploader and the poll threads. Together well inside the unit's TimeoutStopSec=10.
SHUTDOWN_GRACE_SECONDS = 2.0
SHUTDOWN_JOIN_SECONDS = 3.0
APPROVE_INTERVAL_SECONDS = 1.0
PROTECTION_CHECK_SECONDS = 5.0  # how soon a changed protection verdict is logged


class Background(Protocol):
    """A thread the daemon starts after its sources and stops within its shutdown budget
    (the uploader, the follower)."""

    def start(self) -> None: ...

    def stop(self, timeout: float = 2.0) -> None: ...


class DurableRecord(Protocol):
    @property
    def appeared_after_unix(self) -> Optional[float]:
        """When the daemon's scans saw the checkpoint appear (what approval compares)."""
        ...


class UploadsLike(UploadsView, Protocol):
    """What the API, the protection board and approval read of the uploads."""

    def last_durable(self) -> Optional[DurableRecord]: ...


@runtime_checkable
class RestoreNotes(Protocol):
    """What the follower tells the reclaims feature (its ledger): a copy it brought, from
    the previous machine's checkpoint, opens the time to resume."""

    def note_restore(self, name: str, started_unix: float, finished_unix: float) -> None: ...


class UploaderLike(Background, Protocol):
    """What the daemon needs of the checkpoint uploader (``upload.uploader.Uploader``): a
    protocol, so the daemon loads the upload package only when upload is configured."""

    @property
    def tracker(self) -> UploadsLike: ...


@dataclass
class Daemon:
    settings: Settings
    store: Store
    poller: Poller
    app: FastAPI
    connections: ConnectionGuard
    uploader: Optional[UploaderLike] = None  # when configured (--upload-to)
    approver: Optional[Approver] = None  # --azure-approve
    parts: dict[str, Part] = field(default_factory=dict)  # the features built, by name
    state: Optional[StateFile] = None  # --state-file: what survives a restart
    follower: Optional[Background] = None  # upload.follower.Follower: waits for the job


def build_sources(settings: Settings) -> list[Source]:
    """The sources the settings name; ``auto`` adds every candidate not named otherwise,
    each run only once its probe finds its service (``sidecar.host.sources.auto``)."""
    named = [name for name in settings.sources if name != AUTO]
    sources = [create_source(name, settings) for name in named]
    if AUTO in settings.sources:
        sources.extend(_probed(name, settings) for name in auto_candidates()
                       if name not in named)
    return sources


def _probed(name: str, settings: Settings) -> ProbedSource:
    return ProbedSource(name, partial(probe_source, name, settings, PROBE_TIMEOUT_SECONDS),
                        partial(create_source, name, settings),
                        optional=traits_of([name])[name].optional)


def build_daemon(settings: Settings) -> Daemon:
    sources = build_sources(settings)
    store = Store([source.name for source in sources], stale_after=settings.effective_stale_after,
                  deadline_kinds={spec.name: spec.deadline_kind for spec in specs()})
    # One state file, its sections loaded together: a deadline that changed is written at
    # once, the job events within 2 s (sidecar.host.statefile).
    state = StateFile(settings.state_file)
    state.add(StoreSection(store))
    uploader = _build_uploader(settings, store, state) if settings.upload_to is not None else None
    # The features (sidecar.host.features.registry), each with its state-file section.
    needs = Needs(store, token=settings.token, on_change=state.changed, sources=sources,
                  uploads=uploader.tracker if uploader is not None else None,
                  notices={s.name: s.notice_seconds for s in specs()},
                  notice_overrides=settings.notices)
    parts = build_features(needs)
    state.add(*(part.state for part in parts.values() if part.state is not None))
    # The reclaims feature's ledger: the time to resume opens when the follower brings a copy.
    ledger = parts["reclaims"].owner if "reclaims" in parts else None
    reclaims = ledger if isinstance(ledger, RestoreNotes) else None
    rate = settings.effective_max_api_rate
    poller = Poller(
        sources, store, interval=settings.poll_interval, on_change=state.write,
        adaptive=settings.poll_schedule == "adaptive",
        budget=None if rate is None else ApiBudget(rate),
        traits=traits_of(source.name for source in sources),
    )
    follower = _build_follower(settings, reclaims) if uploader is not None else None
    approver = _build_approver(sources, uploader) if settings.azure_approve else None
    checks = {name: part.check for name, part in parts.items() if part.check is not None}

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        state.load()
        state.start()
        poller.start()
        if uploader is not None:
            uploader.start()
        if follower is not None:
            follower.start()
        tasks = [asyncio.create_task(_announce_ready(poller, store)),
                 asyncio.create_task(_check_features(checks))]
        if approver is not None:
            tasks.append(asyncio.create_task(_approve(approver)))
        interval = watchdog_interval()
        if interval is not None:
            tasks.append(asyncio.create_task(_watchdog(poller, interval)))
        try:
            yield
        finally:
            notify("STOPPING=1")
            for task in tasks:
                task.cancel()
            stop_by = time.monotonic() + SHUTDOWN_JOIN_SECONDS
            poller.request_stop()  # both wind down at once; the joins share one budget

            def left() -> float:
                return max(0.1, stop_by - time.monotonic())

            if follower is not None:
                follower.stop(timeout=left())  # a copy in progress is removed next start
            if uploader is not None:
                uploader.stop(timeout=left())  # an upload in progress restarts cleanly
            poller.stop(timeout=left())
            state.stop()  # the last write, after the last poll
            log.info("stopped; state flushed")

    app = create_app(store, parts=parts, lifespan=lifespan, token=settings.token,
                     writes_need_token=settings.writes_need_token)
    # The cap fits the open-file limit in force now (run() raises it first).
    connections = ConnectionGuard(connection_limit())
    return Daemon(settings, store, poller, app, connections, uploader, approver, parts, state,
                  follower)


def _build_uploader(settings: Settings, store: Store, state: StateFile) -> UploaderLike:
    """The checkpoint uploader (docs/upload.md). Imported here, only when configured, so
    a daemon without upload settings never loads the upload package, and only an s3://
    destination loads boto3 (a volume's needs the [server] extra alone)."""
    from sidecar.host.upload.location import parse_destination
    from sidecar.host.upload.storage_config import StorageConfig
    from sidecar.host.upload.uploader import Uploader, UploaderConfig
    from sidecar.host.upload.volume import VolumeDestination
    from sidecar.host.upload.volume_section import VolumeSection

    def remaining_seconds() -> Optional[float]:
        return store.expiry().remaining_seconds

    where = parse_destination(settings.upload_to or "")
    storage = StorageConfig(**storage_options(settings))
    config = UploaderConfig(
        root=Path(settings.upload_from or "."),
        location=None if isinstance(where, Path) else where,
        storage=storage,
        keep_local=settings.upload_keep_local,
        near_release_seconds=settings.upload_near_release,
        scan_interval_seconds=settings.upload_scan_interval,
    )
    if isinstance(where, Path):
        volume = VolumeDestination(where, storage.max_bandwidth)
        state.add(VolumeSection(volume.identity, on_change=state.write))  # kept (issue 35)
        return Uploader(config, remaining_seconds=remaining_seconds, destination=volume)
    try:
        return Uploader(config, remaining_seconds=remaining_seconds)  # S3: loads boto3
    except ImportError as exc:  # a [server]-only install (or image) given s3://
        raise ConfigError(
            f"--upload-to s3:// needs the [upload] extra ({exc.name or exc} is not "
            "installed): pip install 'esi-sidecar[server,upload]', install.sh --upload, or "
            "the image built with --build-arg UPLOAD=1") from None


def _build_follower(settings: Settings,
                    reclaims: Optional[RestoreNotes]) -> Optional[Background]:
    """The follower (issue 40, item 2), unless --upload-prefetch false."""
    if not settings.upload_prefetch or settings.upload_from is None:
        return None
    from sidecar.host.upload.follow_sources import S3Source, VolumeSource
    from sidecar.host.upload.follower import Brought, Follower
    from sidecar.host.upload.location import parse_destination
    from sidecar.host.upload.storage_config import StorageConfig

    where = parse_destination(settings.upload_to or "")
    storage = StorageConfig(**storage_options(settings))
    source = VolumeSource(where, storage.max_bandwidth) if isinstance(where, Path) else \
        S3Source(storage, where)

    def brought(copy: Brought) -> None:  # a copy it brought opens the time to resume
        if reclaims is not None:
            reclaims.note_restore(copy.name, copy.started_unix, copy.finished_unix)

    return Follower(Path(settings.upload_from), source, on_brought=brought)


def _build_approver(sources: list[Source], uploader: Optional[UploaderLike]) -> Approver:
    def approvable() -> list[Approvable]:
        running: list[object] = [s.source if isinstance(s, ProbedSource) else s
                                 for s in sources]
        return [s for s in running if isinstance(s, Approvable) and s.approve_enabled]

    if uploader is None:
        return Approver(approvable, None)
    tracker = uploader.tracker

    def durable_appeared_after() -> Optional[float]:
        # When the daemon saw it appear, not the manifest's created_at (issue 22, item 5).
        record = tracker.last_durable()
        return None if record is None else record.appeared_after_unix

    return Approver(approvable, durable_appeared_after)


async def _approve(approver: Approver) -> None:
    while True:
        try:
            await asyncio.to_thread(approver.check_once)
        except Exception as exc:  # a bug here must not stop the daemon; say where
            log.error("approving scheduled events failed: %s %s", type(exc).__name__,
                      where(exc))
        await asyncio.sleep(APPROVE_INTERVAL_SECONDS)


async def _check_features(checks: dict[str, Callable[[], None]]) -> None:
    """Each feature's periodic check: a line each time a source's protection verdict
    changes (features.protection), the account of each release the job stopped for
    (features.reclaims)."""
    while True:
        for name, check in checks.items():
            try:
                check()
            except Exception as exc:  # a bug here must not stop the daemon; say where
                log.error("checking %s failed: %s %s", name, type(exc).__name__, where(exc))
        await asyncio.sleep(PROTECTION_CHECK_SECONDS)


async def _announce_ready(poller: Poller, store: Store) -> None:
    """READY=1 once every source was polled once (issue: run it as a host service).

    Waiting for the first attempt, not the first success, keeps start-up bounded when the
    cloud is unreachable: the service is up and says so on /healthz.
    """
    await asyncio.to_thread(poller.first_attempt_done.wait, READY_TIMEOUT_SECONDS)
    health = store.health()
    if health.reason is not None and health.reason.startswith(NO_SOURCE_RUNS):
        # Said once, as a warning: each source's own line is INFO (issue 26, item 4).
        log.warning("%s", health.reason)
    notify(f"READY=1\nSTATUS={health.status}" + (f": {health.reason}" if health.reason else ""))


async def _watchdog(poller: Poller, interval: float) -> None:
    """WATCHDOG=1 from the event loop while the poll threads live: a hung loop or a dead
    poller stops the pings and systemd restarts the service."""
    while True:
        if poller.alive():
            notify("WATCHDOG=1")
        await asyncio.sleep(interval)


def bind_sockets(addresses: tuple[tuple[str, int], ...]) -> list[socket.socket]:
    """Bind every listen address up front so a bad one stops start-up with a clear line.
    ListeningSocket: its accept() asks the server's connection guard."""
    bound: list[socket.socket] = []
    try:
        for host, port in addresses:
            family = socket.AF_INET6 if ":" in host else socket.AF_INET
            # IPPROTO_TCP explicitly: asyncio disables Nagle only on sockets whose proto says TCP;
            # with proto 0 every keep-alive answer waits ~40 ms for a delayed ACK.
            sock = ListeningSocket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            try:
                sock.bind((host, port))
            except OSError as exc:
                sock.close()
                raise OSError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
            sock.set_inheritable(True)
            bound.append(sock)
    except OSError:
        for opened in bound:
            opened.close()
        raise
    return bound


class _GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol, telling the connection guard when each connection starts,
    begins and ends a request, and goes away (sidecar.host.connections). uvicorn arms its
    own keep-alive timer only after a response, so a connection that never finishes its
    first request would otherwise be held for ever."""

    guard: ClassVar[ConnectionGuard]

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self.guard.started(self)

    def data_received(self, data: bytes) -> None:
        cycle = self.cycle
        super().data_received(data)
        if self.cycle is not cycle:  # the request's headers are complete
            self.guard.request_started(self)
        else:
            self.guard.data_while_waiting(self)

    def on_response_complete(self) -> None:
        cycle = self.cycle
        super().on_response_complete()
        # A new cycle here is a pipelined request already under way.
        if self.cycle is cycle and not self.transport.is_closing():
            self.guard.request_done(self)

    def connection_lost(self, exc: Optional[Exception]) -> None:
        self.guard.lost(self)
        super().connection_lost(exc)

    def close_now(self) -> None:
        self.transport.abort()


class _Server(uvicorn.Server):
    """Serves only on sockets from bind_sockets(), whose accept() asks the guard."""

    def __init__(self, config: uvicorn.Config, guard: ConnectionGuard) -> None:
        super().__init__(config)
        self.guard = guard

    async def serve(self, sockets: Optional[list[socket.socket]] = None) -> None:
        if not sockets or not all(isinstance(sock, ListeningSocket) for sock in sockets):
            raise TypeError("serve on the sockets bind_sockets() returns")
        for sock in sockets:
            cast(ListeningSocket, sock).guard = self.guard
        await super().serve(sockets=sockets)


def make_server(daemon: Daemon) -> uvicorn.Server:
    guard = daemon.connections
    protocol = type("GuardedH11Protocol", (_GuardedH11Protocol,), {"guard": guard})
    config = uvicorn.Config(
        daemon.app,
        log_config=None,  # our logging setup; no access log: clients ask every step
        access_log=False,
        timeout_graceful_shutdown=int(SHUTDOWN_GRACE_SECONDS),
        timeout_keep_alive=30,
        lifespan="on",
        # The guard hooks asyncio's accept loop and the h11 protocol: never uvloop (its
        # accept bypasses ListeningSocket) nor httptools, even where they are installed.
        loop="asyncio",
        http=protocol,
    )
    return _Server(config, guard)


def run(settings: Settings, sockets: Optional[list[socket.socket]] = None) -> None:
    """Serve until SIGTERM/SIGINT. Raises OSError for an address that cannot be bound."""
    hold_back_repeats()  # a flood of one error (accept() failing, say) is one line a minute
    open_files = raise_open_file_limit()
    sockets = sockets if sockets is not None else bind_sockets(settings.listen)
    daemon = build_daemon(settings)
    addresses = ", ".join(_format_address(sock) for sock in sockets)
    log.info("serving on %s (sources: %s)", addresses, ", ".join(settings.sources))
    if settings.token is not None:
        log.info("peers beyond loopback must send the token (Authorization: Bearer); %s",
                 "writes from loopback too (--writes-need-token)" if settings.writes_need_token
                 else "loopback needs none")
    if daemon.connections.limit < MAX_CONNECTIONS:
        log.warning("open-file limit %d: at most %d connections at once (LimitNOFILE= "
                    "raises it)", open_files, daemon.connections.limit)
    make_server(daemon).run(sockets=sockets)


def _format_address(sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
