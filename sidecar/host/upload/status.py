"""What the uploader is doing, for ``GET /v1/uploads``, ``/healthz`` and ``/metrics``.

The tracker only holds state behind one lock, as the deadline store does: the uploader
writes, the API reads frozen copies. Everything here is read at request or scrape time;
nothing is registered in a global registry. No boto3 here: the API imports nothing of
the upload machinery.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass, replace
from typing import Any, Callable, Optional

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)

from sidecar.host.upload import plan

__all__ = ["STATES", "UploadRecord", "UploadTracker"]

# pending: waiting its turn; uploading; done: durable remotely (manifest written last);
# failed: the last attempt failed, retried after a backoff; skipped: a newer checkpoint
# is durable already, or the local folder went away before it could be uploaded.
STATES = ("pending", "uploading", "done", "failed", "skipped")
DURATION_BUCKETS = (1.0, 5.0, 15.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1200.0, 1800.0, 3600.0)
KEEP_RECORDS = 200  # finished records kept for the status page; the oldest go first


@dataclass(frozen=True)
class UploadRecord:
    """One local checkpoint as the uploader sees it (a copy; the tracker holds the truth)."""

    name: str
    step: int
    created_at_unix: float
    digest: str  # sha256 of the local MANIFEST.json: tells a re-save under the same name
    bytes_total: int
    file_count: int
    state: str = "pending"
    bytes_done: int = 0
    attempts: int = 0
    started_at_unix: Optional[float] = None
    finished_at_unix: Optional[float] = None
    duration_seconds: Optional[float] = None
    error: Optional[str] = None
    note: Optional[str] = None
    retry_at_unix: Optional[float] = None
    # The daemon's clock at the last scan that did not find this checkpoint, so it became
    # complete later; None when the first scan found it. Azure approval reads this, never
    # created_at_unix, which the job writes (issue 22, item 5).
    appeared_after_unix: Optional[float] = None
    # Bytes the upload still had to send once the save had ended (the files not sent while
    # it was written, nor copied from an equal durable file): what the next estimate
    # counts (issue 23). None until uploaded here.
    bytes_after_save: Optional[int] = None
    # bytes_done when this attempt started (sent while the save wrote): what the attempt
    # itself sent, over its time so far, is its throughput while it runs (issue 23).
    bytes_at_start: int = 0

    def newer_than(self, other: UploadRecord) -> bool:
        return (self.step, self.created_at_unix) > (other.step, other.created_at_unix)

    def to_json(self, now: float) -> dict[str, Any]:
        duration = self.duration_seconds
        if self.state == "uploading" and self.started_at_unix is not None:
            duration = max(0.0, now - self.started_at_unix)
        return {
            "name": self.name,
            "step": self.step,
            "state": self.state,
            "bytes_done": self.bytes_done,
            "bytes_total": self.bytes_total,
            "file_count": self.file_count,
            "attempts": self.attempts,
            "started_at_unix": self.started_at_unix,
            "finished_at_unix": self.finished_at_unix,
            "duration_seconds": duration,
            "error": self.error,
            "note": self.note,
            "retry_in_seconds": (
                None if self.retry_at_unix is None or self.state != "failed"
                else max(0.0, self.retry_at_unix - now)
            ),
        }


def _newest_first(record: UploadRecord) -> tuple[int, float, str]:
    return (record.step, record.created_at_unix, record.name)


class UploadTracker:
    def __init__(
        self,
        *,
        source: str,
        destination: str,
        endpoint: Optional[str],
        max_bandwidth: Optional[int] = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._lock = threading.Lock()
        self.max_bandwidth = max_bandwidth  # bytes per second, the configured cap
        # (bytes, seconds) of the uploads the estimate's throughput is measured over
        self._rates: deque[tuple[int, float]] = deque(maxlen=plan.RATE_WINDOW)
        # bytes per second of the link probes since the last upload ended (probe.py)
        self._probes: deque[float] = deque(maxlen=plan.PROBES_TO_AGREE)
        self._last_probe: Optional[dict[str, float]] = None
        self._clock = clock
        self.source = source
        self.destination = destination
        self.endpoint = endpoint
        self._records: dict[str, UploadRecord] = {}
        self._durable: Optional[UploadRecord] = None
        self._durable_at: Optional[float] = None
        self._bytes_sent = 0
        self._completed = 0
        self._failures = 0
        self._consecutive_failures = 0
        self._error: Optional[str] = None
        self._error_since: Optional[float] = None
        self._durations = [0] * (len(DURATION_BUCKETS) + 1)
        self._duration_sum = 0.0

    # ------------------------------------------------------------------ writers

    def put(self, record: UploadRecord) -> None:
        with self._lock:
            self._records[record.name] = record
            self._trim()

    def update(self, name: str, **changes: Any) -> Optional[UploadRecord]:
        with self._lock:
            old = self._records.get(name)
            if old is None:
                return None
            new = replace(old, **changes)
            self._records[name] = new
            return new

    def remove(self, name: str) -> None:
        with self._lock:
            self._records.pop(name, None)

    def add_progress(self, name: str, count: int) -> None:
        """Bytes sent for ``name`` (negative when boto3 rewinds a retried part). A file
        sent again (changed after it was streamed, or a retried part) counts its bytes
        again: ``bytes_done`` stays within ``[0, bytes_total]`` (issue 35)."""
        with self._lock:
            self._bytes_sent += max(0, count)
            old = self._records.get(name)
            if old is not None:
                done = min(old.bytes_total, max(0, old.bytes_done + count))
                self._records[name] = replace(old, bytes_done=done)

    def record_done(self, name: str, *, duration: Optional[float], note: Optional[str],
                    sent_after_save: Optional[int] = None, sent: Optional[int] = None,
                    send_seconds: Optional[float] = None) -> None:
        """``name`` is durable remotely: its manifest is there and matches ours.
        ``duration``: from the end of its save (the scan that found it) to durable;
        ``sent`` bytes in ``send_seconds`` (streamed before the save ended included) give
        the throughput; ``sent_after_save`` is what the next estimate counts."""
        now = self._clock()
        with self._lock:
            old = self._records.get(name)
            if old is None:
                return
            new = replace(
                old, state="done", bytes_done=old.bytes_total, finished_at_unix=now,
                duration_seconds=duration, error=None, note=note, retry_at_unix=None,
                bytes_after_save=sent_after_save,
            )
            self._records[name] = new
            if duration is not None:
                self._probes.clear()  # this upload measured the link: probes count after it
                if sent is not None and send_seconds is not None:
                    if sent > 0 and send_seconds > 0:
                        self._rates.append((sent, send_seconds))
                elif duration > 0 and new.bytes_total > 0:
                    self._rates.append((new.bytes_total, duration))
                self._completed += 1
                self._duration_sum += duration
                index = next((i for i, bound in enumerate(DURATION_BUCKETS) if duration <= bound),
                             len(DURATION_BUCKETS))
                self._durations[index] += 1
            if self._durable is None or new.newer_than(self._durable):
                self._durable, self._durable_at = new, now
            self._consecutive_failures = 0
            self._error = self._error_since = None

    def record_probe(self, sent: int, seconds: float) -> None:
        """A link probe sent ``sent`` bytes in ``seconds`` (``probe.LinkProbe``)."""
        if sent <= 0 or seconds <= 0:
            return
        with self._lock:
            self._probes.append(sent / seconds)
            self._last_probe = {"bytes": float(sent), "seconds": seconds,
                                "at_unix": self._clock()}

    def record_failure(self, name: Optional[str], error: str, *, retry_at: float) -> int:
        """A failed attempt (or a failed storage call outside one). Returns the number of
        failures in a row, for the backoff."""
        now = self._clock()
        with self._lock:
            self._failures += 1
            self._consecutive_failures += 1
            if self._error_since is None:
                self._error_since = now
            self._error = error
            old = self._records.get(name) if name is not None else None
            if old is not None:
                self._records[name] = replace(  # type: ignore[index]
                    old, state="failed", error=error, retry_at_unix=retry_at,
                    duration_seconds=(None if old.started_at_unix is None
                                      else max(0.0, now - old.started_at_unix)),
                )
            return self._consecutive_failures

    def storage_ok(self) -> None:
        """A storage call succeeded: no longer degraded."""
        with self._lock:
            self._consecutive_failures = 0
            self._error = self._error_since = None

    def _trim(self) -> None:
        if len(self._records) <= KEEP_RECORDS:
            return
        finished = sorted(
            (r for r in self._records.values() if r.state in ("done", "skipped")),
            key=_newest_first,
        )
        for record in finished[: len(self._records) - KEEP_RECORDS]:
            del self._records[record.name]

    # ------------------------------------------------------------------ readers

    def get(self, name: str) -> Optional[UploadRecord]:
        with self._lock:
            return self._records.get(name)

    def records(self) -> list[UploadRecord]:
        """Every record, newest first."""
        with self._lock:
            records = list(self._records.values())
        return sorted(records, key=_newest_first, reverse=True)

    def throughput(self) -> Optional[float]:
        """Bytes per second to plan with: the slow tail of the recent uploads' rates (each
        over its sending time, the storage calls around the transfer included; the
        configured cap until one was measured), slower while the upload in progress is
        slower than that (``plan.in_progress_rate``), so a link that slows is seen before
        the upload ends."""
        now = self._clock()
        with self._lock:
            rates = list(self._rates)
            probes = list(self._probes)
            current = next((r for r in self._records.values() if r.state == "uploading"), None)
        rate = plan.with_probe(plan.throughput(rates, self.max_bandwidth),
                               plan.probed_rate(probes))
        if current is None or current.started_at_unix is None:
            return rate
        return plan.in_progress_rate(
            rate, sent=max(0, current.bytes_done - current.bytes_at_start),
            elapsed_seconds=now - current.started_at_unix,
            left=max(0, current.bytes_total - current.bytes_done))

    def next_upload_seconds(self) -> Optional[float]:
        """How long the next checkpoint will take to become durable, once saved locally:
        the largest recent checkpoint over :meth:`throughput` (which an upload in
        progress slows when it is slower), with a margin
        (``plan.next_upload_seconds``). None before a checkpoint was seen, or while no
        throughput is known (no upload measured and no ``--upload-max-bandwidth``)."""
        # The bytes each recent upload had to send after its save ended (streamed and
        # unchanged files not counted; all of a checkpoint not uploaded yet), newest first.
        records = self.records()
        sizes = [r.bytes_total if r.bytes_after_save is None else r.bytes_after_save
                 for r in records]
        # A commit that sends nothing still takes time (fsync, rename, the last requests):
        # never less than the recent measured times from the end of a save to durable.
        measured = [r.duration_seconds if r.bytes_after_save is not None else None
                    for r in records]
        return plan.estimate_seconds(sizes, self.throughput(), measured)

    def durability(self) -> tuple[Optional[float], str, int]:
        """What ``/v1/expiry`` serves: ``(next_upload_seconds, status, measured)``,
        ``measured`` the number of uploads the estimate's rate rests on (at most
        ``plan.RATE_WINDOW``)."""
        with self._lock:
            status = self._state()
            measured = len(self._rates)
        return self.next_upload_seconds(), status, measured

    def _state(self) -> str:
        """"degraded", "uploading" or "ok"; call with the lock held."""
        if self._consecutive_failures:
            return "degraded"
        uploading = any(r.state == "uploading" for r in self._records.values())
        return "uploading" if uploading else "ok"

    def last_probe(self) -> Optional[dict[str, float]]:
        """The newest link probe: bytes, seconds and when (None before the first)."""
        with self._lock:
            return None if self._last_probe is None else dict(self._last_probe)

    def last_durable(self) -> Optional[UploadRecord]:
        with self._lock:
            return self._durable

    @property
    def degraded(self) -> bool:
        with self._lock:
            return self._consecutive_failures > 0

    def summary(self, now: Optional[float] = None) -> dict[str, Any]:
        """The short form, also shown in ``/healthz`` (which upload trouble never fails)."""
        now = self._clock() if now is None else now
        with self._lock:
            durable, durable_at = self._durable, self._durable_at
            error, since = self._error, self._error_since
            failures = self._consecutive_failures
            status = self._state()
            waiting = sum(r.state in ("pending", "failed") for r in self._records.values())
        return {
            "status": status,
            "degraded": bool(failures),
            "error": error,
            "degraded_for_seconds": None if since is None else max(0.0, now - since),
            "consecutive_failures": failures,
            "waiting": waiting,
            "last_durable_step": durable.step if durable else None,
            "last_durable_name": durable.name if durable else None,
            "last_durable_at_unix": durable_at,
            "next_upload_seconds": self.next_upload_seconds(),
        }

    def body(self, now: Optional[float] = None, limit: int = 100) -> dict[str, Any]:
        """The ``GET /v1/uploads`` body: the summary, then the newest ``limit`` records."""
        now = self._clock() if now is None else now
        records = self.records()
        return {
            "enabled": True,
            "source": self.source,
            "destination": self.destination,
            "endpoint": self.endpoint,
            **self.summary(now),
            "checkpoints": [r.to_json(now) for r in records[: max(0, limit)]],
            "last_probe": self.last_probe(),
            "server_time_unix": now,
        }

    def collect(self) -> list[Metric]:
        """Prometheus metrics at scrape time (the API registers the tracker itself)."""
        with self._lock:
            records = list(self._records.values())
            durable, durable_at = self._durable, self._durable_at
            sent, completed, failures = self._bytes_sent, self._completed, self._failures
            degraded = self._consecutive_failures > 0
            counts, total = list(self._durations), self._duration_sum
        sent_metric = CounterMetricFamily(
            "esi_sidecar_upload_bytes", "Checkpoint bytes sent to storage (retries included)")
        sent_metric.add_metric([], sent)
        completed_metric = CounterMetricFamily(
            "esi_sidecar_upload_completed", "Checkpoints this daemon uploaded completely "
            "(manifest written; one found already complete in storage is not counted)")
        completed_metric.add_metric([], completed)
        failure_metric = CounterMetricFamily(
            "esi_sidecar_upload_failures", "Failed upload attempts and failed storage calls "
            "outside one")
        failure_metric.add_metric([], failures)
        cumulative, buckets = 0, []
        for bound, count in zip((*map(str, DURATION_BUCKETS), "+Inf"), counts):
            cumulative += count
            buckets.append((bound, cumulative))
        durations = HistogramMetricFamily(
            "esi_sidecar_upload_duration_seconds", "Seconds to upload one checkpoint "
            "completely (those counted in esi_sidecar_upload_completed_total)",
            buckets=buckets, sum_value=total)
        by_state = GaugeMetricFamily(
            "esi_sidecar_upload_checkpoints", "Local checkpoints the uploader tracks, by "
            f"upload state (at most {KEEP_RECORDS}: the oldest finished ones go first)",
            labels=["state"])
        for state in STATES:
            by_state.add_metric([state], sum(r.state == state for r in records))
        step = GaugeMetricFamily(
            "esi_sidecar_upload_last_durable_step",
            "Step of the newest checkpoint complete in storage (absent before the first)")
        stamp = GaugeMetricFamily(
            "esi_sidecar_upload_last_durable_timestamp_seconds",
            "Unix time this daemon found the newest durable checkpoint complete in storage "
            "(absent before the first)")
        if durable is not None and durable_at is not None:
            step.add_metric([], durable.step)
            stamp.add_metric([], durable_at)
        degraded_metric = GaugeMetricFamily(
            "esi_sidecar_upload_degraded", "1 from a failed upload attempt or storage call "
            "until the next success")
        degraded_metric.add_metric([], 1.0 if degraded else 0.0)
        return [sent_metric, completed_metric, failure_metric, durations, by_state, step, stamp,
                degraded_metric]
