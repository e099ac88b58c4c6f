"""Approve a platform's pending event once the job's work is safe, so the platform need
not wait out the whole notice (Azure Scheduled Events: ``StartRequests``).

"Safe" means a checkpoint saved after the event was first seen is durable in storage:
the uploader says so. Both times are the daemon's own observations: when the source first
saw the event, and when the uploader's scans saw the checkpoint appear (it was not there
at a scan after the event). Never the manifest's ``created_at``: the job writes it, with
its own clock, and restore copies it verbatim (issue 22, item 5). A checkpoint already
there when the daemon started counts as older than any event. Without an uploader nothing
is approved (a local checkpoint dies with a preempted VM). Opt-in (``--azure-approve
true``); the platform acts at its ``NotBefore`` anyway, so a missed approval costs nothing
but the wait.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Callable, Optional, Protocol, runtime_checkable

from sidecar.host.sources.base import SourceError

__all__ = ["Approvable", "Approver"]

log = logging.getLogger("sidecar.host.approve")


@runtime_checkable
class Approvable(Protocol):
    """A source whose platform takes approvals (``sidecar.host.sources.azure``)."""

    name: str
    approve_enabled: bool  # --azure-approve

    def pending(self) -> list[tuple[str, float, str]]:
        """(event id, first seen Unix time, event type) not yet approved."""
        ...

    def approve(self, event_ids: Sequence[str]) -> None: ...


class Approver:
    def __init__(self, sources: Callable[[], Sequence[Approvable]],
                 durable_appeared_after: Optional[Callable[[], Optional[float]]]) -> None:
        """``sources``: the approvable sources running now (auto may find one later).
        ``durable_appeared_after``: a time on the daemon's clock after which the newest
        durable checkpoint appeared (None: none durable yet, or it was there at start);
        None when this daemon uploads nothing."""
        self._sources = sources
        self._durable_appeared_after = durable_appeared_after
        self._said_no_uploader = False
        #: Rounds (``check_once`` calls) completed: a test waits on it, never on a clock.
        self.rounds = 0

    def check_once(self) -> list[str]:
        """Approve what may be approved now; return the approved event ids."""
        approved = self._check()
        self.rounds += 1
        return approved

    def _check(self) -> list[str]:
        approved: list[str] = []
        for source in self._sources():
            pending = source.pending()
            if not pending:
                continue
            if self._durable_appeared_after is None:
                if not self._said_no_uploader:
                    log.warning("%s: not approving %s: approval needs the uploader "
                                "(--upload-to), a local checkpoint dies with the VM",
                                source.name, ", ".join(event for event, _, _ in pending))
                    self._said_no_uploader = True
                continue
            appeared = self._durable_appeared_after()
            ready = [event for event, seen, _ in pending
                     if appeared is not None and appeared >= seen]
            if not ready:
                continue
            try:
                source.approve(ready)
            except SourceError as exc:
                log.warning("%s: approving %s failed: %s", source.name, ", ".join(ready), exc)
                continue
            log.info("%s: approved %s: a checkpoint saved after the notice is durable",
                     source.name, ", ".join(ready))
            approved.extend(ready)
        return approved
