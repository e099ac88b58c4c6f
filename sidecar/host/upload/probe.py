"""The link probe: a link that slows while nothing uploads is seen before the final save.

The estimate the guard budgets with is measured on uploads. A link that slows between two
uploads (a neighbour, burst credits spent, a throttled bucket) is only seen by the final
upload, too late. So while the uploader is idle it sends a probe (``plan.probe_interval``:
every 10 min, every 30 s once the release is near): ``plan.PROBE_SECONDS`` of bytes at the
rate the estimate assumes, to nowhere visible — on S3 the parts of a multipart upload that
is then aborted (``prepare`` aborts one a kill left behind), on a volume a hidden staging
folder that is removed (``clean_leftovers`` removes one a kill left behind), through the
same throttle as the uploads. A probe gives way at once to a checkpoint (anything the
folder does stops it, unmeasured). Restore, retention and listings never see it. The tracker
counts the probes as ``plan.probed_rate`` and ``plan.with_probe`` say.
"""

from __future__ import annotations

import logging
import time
from typing import Callable, Optional, Protocol

from sidecar.host.upload import plan
from sidecar.host.upload.status import UploadTracker
from sidecar.host.upload.volume_stage import Cancelled

__all__ = ["MAX_PROBE_BYTES", "MIN_PROBE_BYTES", "LinkProbe", "Probed"]

log = logging.getLogger("sidecar.host.upload")

MIN_PROBE_BYTES = 8 << 20  # below this a request's fixed cost is most of a probe
MAX_PROBE_BYTES = 256 << 20  # a fast link's probe is bounded: a few seconds at most


class Probed(Protocol):
    """A destination that can be probed (both of the uploader's)."""

    def probe(self, amount: int, should_stop: Callable[[], Optional[str]]) -> None:
        """Send ``amount`` bytes where nothing reads them, then remove them."""
        ...


class LinkProbe:
    """Decides when a probe is due and sends it (from the upload thread, between uploads)."""

    def __init__(self, destination: Probed, tracker: UploadTracker, *,
                 remaining_seconds: Callable[[], Optional[float]],
                 near_release_seconds: float,
                 monotonic: Callable[[], float] = time.monotonic) -> None:
        self._destination = destination
        self._tracker = tracker
        self._remaining = remaining_seconds
        self._near = near_release_seconds
        self._monotonic = monotonic
        self._last = monotonic()  # the start counts as a measurement: no probe at once
        self._failed_once = False

    def measured(self) -> None:
        """An upload ended: it measured the link, the next probe counts from now."""
        self._last = self._monotonic()

    def due_in(self) -> Optional[float]:
        """Seconds until the next probe (0: now); None while there is nothing to probe
        for (no checkpoint seen)."""
        if not self._tracker.records():
            return None
        interval = plan.probe_interval(self._remaining(), self._near,
                                       self._tracker.next_upload_seconds())
        return max(0.0, self._last + interval - self._monotonic())

    def run_if_due(self, should_stop: Callable[[], Optional[str]]) -> None:
        """Send a probe when one is due; its (bytes, seconds) go to the tracker. A failure
        is logged (once until a probe succeeds) and never counts against the uploads."""
        due = self.due_in()
        if due is None or due > 0:
            return
        rate = self._tracker.throughput() or 0.0
        amount = int(min(MAX_PROBE_BYTES, max(MIN_PROBE_BYTES, plan.probe_amount(rate))))
        started = self._monotonic()
        try:
            self._destination.probe(amount, should_stop)
        except Cancelled:
            return  # gave way to a checkpoint: tried again once the uploader is idle
        except Exception as exc:  # the uploads' own errors are reported by their attempts
            if not self._failed_once:
                log.warning("the link probe failed: %s", exc)
            self._failed_once = True
            self._last = self._monotonic()
            return
        seconds = self._monotonic() - started
        self._last = self._monotonic()
        self._failed_once = False
        self._tracker.record_probe(amount, seconds)
