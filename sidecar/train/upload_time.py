"""How long a save needs after its blocking part to become durable: its asynchronous
write, then the daemon's upload.

Standard library only. The upload estimate is the daemon's (``/v1/expiry``'s
``upload_seconds``), or the one saved in the checkpoint while a new uploader knows no
rate yet; the asynchronous part is measured by the caller (``record_async_write``).

The saved estimate also stays a floor while the daemon's rests on fewer than
:data:`TRUSTED_UPLOADS` uploads (``upload_measured``): a new machine's first upload or two
say little about the slow tail (a fast one among lognormal upload times made the next
estimate half the true p90, and the final save was made too late: 3 of 200 releases on the
simulator's ``upload-lognormal`` once a fallback save had uploaded once), while the
estimate carried in the checkpoint is the previous uploader's over its whole window. It
errs long only: a job moved to a faster link idles a little more for its first uploads.
"""

from __future__ import annotations

import logging
from collections import deque
from typing import Optional

from sidecar.train.deadline import DeadlineTracker
from sidecar.train.policy import check_seconds

__all__ = ["ASYNC_WRITES_KEPT", "TRUSTED_UPLOADS", "UploadTime"]

# The guard's own voice: these lines are the guard's, as users filter them.
logger = logging.getLogger("sidecar.train.guard")

# The largest of this many recent asynchronous parts is budgeted.
ASYNC_WRITES_KEPT = 3

# Uploads the daemon's estimate must rest on before it replaces the saved one as the floor:
# the uploader's rate window (sidecar.host.upload.plan.RATE_WINDOW; a test pins the two).
TRUSTED_UPLOADS = 10


class UploadTime:
    """The seconds to budget after a save's blocking part, and the uploader's health."""

    def __init__(self, tracker: DeadlineTracker) -> None:
        self._tracker = tracker
        self.saved_seconds: Optional[float] = None  # from the checkpoint (load_state_dict)
        # The asynchronous part of recent saves: it runs after the blocking part, before
        # any upload can start. A deque: appended from any thread.
        self._async_writes: deque[float] = deque(maxlen=ASYNC_WRITES_KEPT)
        self._warned: Optional[str] = None  # the upload state last warned about

    def record_async_write(self, seconds: float) -> None:
        self._async_writes.append(check_seconds("async write seconds", seconds))

    def async_write_estimate(self) -> Optional[float]:
        """The largest of the last few asynchronous parts, None before one finished."""
        writes = list(self._async_writes)
        return max(writes) if writes else None

    def seconds(self) -> Optional[float]:
        """After the blocking part: the asynchronous write plus the upload; None when
        neither is known."""
        upload = self.upload_estimate()
        async_write = self.async_write_estimate()
        if async_write is not None:  # written after the blocking part, before any upload
            upload = async_write + (upload or 0.0)
        return upload

    def upload_estimate(self) -> Optional[float]:
        """The upload to budget: the daemon's; the saved one while the daemon knows no
        rate yet, or the larger of the two while the daemon's rests on fewer than
        :data:`TRUSTED_UPLOADS` uploads; None without an uploader."""
        tracker, saved = self._tracker, self.saved_seconds
        upload = tracker.upload_seconds
        if upload is None:
            return saved if tracker.upload_status is not None else None
        measured = tracker.upload_measured
        if saved is not None and measured is not None and measured < TRUSTED_UPLOADS:
            return max(upload, saved)
        return upload

    def to_save(self) -> Optional[float]:
        """The upload estimate to keep in the checkpoint."""
        return self.upload_estimate() or self.saved_seconds

    def warn_on_change(self) -> None:
        """One line when the uploader starts failing, one when it is back."""
        state = self._tracker.upload_status
        if state == "degraded" and self._warned != "degraded":
            logger.warning("checkpoint uploads are failing (the daemon's /v1/uploads says "
                           "why): a checkpoint saved now may not become durable before the "
                           "release")
            self._warned = "degraded"
        elif state != "degraded" and self._warned == "degraded":
            logger.info("checkpoint uploads work again")
            self._warned = state
