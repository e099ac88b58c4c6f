"""The daemon's features, each a package that declares what it adds (docs/architecture.md).

A feature (``events``, ``drills``, ``protection``, ``reclaims``, ``uploads``) is one package
under ``sidecar/host/features/`` whose ``__init__`` defines ``FEATURE``: a :class:`Feature`,
its name, how it is built from the daemon's shared parts (:class:`Needs`) and how the status
page shows it. Built, it is a :class:`Part`: its routes, its metrics, its body on the page,
its state-file section, its part of ``/v1/expiry`` and ``/healthz``, its periodic check; any
of them may be left out. ``registry.FEATURES`` lists the features, in the order they are
built (a feature may read those before it); ``create_app``, the page and the daemon loop
over them. Adding one: its package, and one line in ``registry.py``.

This module holds the types only: every feature imports it, and it imports no feature.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Protocol, TypeVar

from fastapi import FastAPI
from prometheus_client.core import Metric

from sidecar.host.statefile import Section
from sidecar.host.store import Store
from sidecar.models import Expiry

__all__ = ["Collector", "Feature", "Needs", "PageSection", "Part", "UploadsView"]

T = TypeVar("T")
Body = dict[str, Any]


class UploadsView(Protocol):
    """What the features read of the checkpoint uploader's tracker (``sidecar.host.upload.
    status.UploadTracker``): a protocol, so no feature imports the upload package."""

    def body(self, now: Optional[float] = None, limit: int = 100) -> dict[str, Any]: ...

    def summary(self, now: Optional[float] = None) -> dict[str, Any]: ...

    def collect(self) -> list[Metric]: ...

    def durability(self) -> tuple[Optional[float], str, int]: ...


class Collector(Protocol):
    """What ``/metrics`` reads of a feature, at scrape time."""

    def collect(self) -> Iterable[Metric]: ...


def _nothing() -> None:
    return None


@dataclass
class Needs:
    """What a feature is built from: the daemon's shared parts, and the features built
    before it (``built``, filled by ``registry.build_features``)."""

    store: Store
    clock: Callable[[], float] = time.time
    token: Optional[str] = None  # the daemon's token (who may start a drill beyond loopback)
    uploads: Optional[UploadsView] = None  # the uploader's tracker, when the daemon uploads
    on_change: Callable[[], None] = _nothing  # a state-file section changed: write it soon
    notices: Mapping[str, Optional[float]] = field(default_factory=dict)  # per source spec
    notice_overrides: Mapping[str, Optional[float]] = field(default_factory=dict)  # --notice
    sources: Sequence[Any] = ()  # the sources that run (some learn their notice as they run)
    built: dict[str, Part] = field(default_factory=dict)

    def owner(self, name: str, kind: type[T]) -> Optional[T]:
        """The object of the feature ``name`` built before this one, if it is a ``kind``."""
        part = self.built.get(name)
        owner = None if part is None else part.owner
        return owner if isinstance(owner, kind) else None


@dataclass(frozen=True)
class Part:
    """What one built feature adds to the daemon; every field may be left out."""

    owner: object = None  # its object, for the features built after it and the wiring
    routes: Optional[Callable[[FastAPI], None]] = None  # adds its endpoints to the app
    metrics: Optional[Collector] = None  # registered in the app's /metrics registry
    page: Optional[Callable[[float, Body], Optional[Body]]] = None  # (now, expiry) -> body
    state: Optional[Section] = None  # its section of the state file (--state-file)
    expiry: Optional[Callable[[Expiry, float], Expiry]] = None  # its part of /v1/expiry
    health: Optional[Callable[[float], Any]] = None  # shown in /healthz under its name
    check: Optional[Callable[[], None]] = None  # run every few seconds (logs what changed)


@dataclass(frozen=True)
class PageSection:
    """Where the status page shows a feature (``order`` among the page's own sections:
    header 10, countdown 20, the job 30, timeline 50, sources 60, deadline history 70) and
    how: ``render(body, now)``, the body its part gave (None: the feature is off)."""

    order: int
    render: Callable[[Optional[Body], float], str]


@dataclass(frozen=True)
class Feature:
    """One feature, as the registry lists it."""

    name: str  # the key of its page body and of its /healthz part
    build: Callable[[Needs], Optional[Part]]  # None: off in this daemon
    page: Optional[PageSection] = None
