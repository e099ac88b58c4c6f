"""Each running source's protection verdict, as the daemon serves, exports and logs it.

The rule is ``sidecar.train.protection`` (pure, shared with the guard); this module
gathers its inputs: the notice of every running source (its spec's, or ``--notice``),
the job's step and save times from its events, the uploader's estimate, and the newest
durable checkpoint (the uploader's, else the job's last save). ``GET /v1/protection``
serves the verdicts (docs/protection.md); ``check()`` logs a line each time one changes,
a warning when a signal cannot be met (issue 24, item 2).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from dataclasses import replace
from typing import Any, Callable, Optional, Protocol

from prometheus_client.core import GaugeMetricFamily, Metric

from sidecar.host.store import Store, not_working
from sidecar.train.protection import (
    DurableCheckpoint,
    JobFigures,
    SaidOnce,
    Verdict,
    judge_one,
    short_duration,
)

__all__ = ["ProtectionBoard", "notice_table"]

log = logging.getLogger("sidecar.host.protection")

# The top-level status: the worst of the sources' verdicts. A source that is not working
# comes first: a release it would announce is not seen at all.
WORST_FIRST = ("not-working", "not-protected", "unknown")


class _Summaries(Protocol):
    def body(self, limit: int = 100, now: Optional[float] = None) -> dict[str, Any]: ...


class _Uploads(Protocol):
    def summary(self, now: Optional[float] = None) -> dict[str, Any]: ...

    def durability(self) -> tuple[Optional[float], str, int]: ...


def notice_table(specs: Mapping[str, Optional[float]],
                 overrides: Mapping[str, Optional[float]]) -> dict[str, Optional[float]]:
    """Source name -> notice seconds: the specs' figures, ``--notice`` over them."""
    return {name: overrides.get(name, notice)
            for name, notice in specs.items()}


class ProtectionBoard:
    """The verdicts now, from the store's running sources, the job events and uploads."""

    def __init__(
        self,
        store: Store,
        notices: Mapping[str, Optional[float]],
        *,
        events: Optional[_Summaries] = None,
        uploads: Optional[_Uploads] = None,
        clock: Callable[[], float] = time.time,
        detected: Mapping[str, Any] = {},
    ) -> None:
        self._store = store
        self._notices = dict(notices)
        # Sources that learn their platform's notice as they run (gcp on a GKE node:
        # ``notice_seconds``), asked at each verdict; --notice leaves them out (daemon.py).
        self._detected = dict(detected)
        self._events = events
        self._uploads = uploads
        self._clock = clock
        self._said = SaidOnce(log)

    def inputs(self, now: float) -> tuple[JobFigures, Optional[DurableCheckpoint]]:
        """What the job measured and its newest durable checkpoint."""
        summary = {} if self._events is None else (
            self._events.body(limit=0, now=now).get("summary") or {})
        upload = None if self._uploads is None else self._uploads.durability()[0]
        save = summary.get("save_seconds")
        if save is None:
            save = summary.get("last_save_seconds")
        job = JobFigures(summary.get("step_seconds"), save, upload)
        durable = None
        if self._uploads is not None:
            uploaded = self._uploads.summary(now)
            if uploaded.get("last_durable_at_unix") is not None:
                durable = DurableCheckpoint(uploaded.get("last_durable_step"),
                                            float(uploaded["last_durable_at_unix"]))
        elif summary.get("last_save_at_unix") is not None:  # no uploader: durable once saved
            durable = DurableCheckpoint(summary.get("last_save_step"),
                                        float(summary["last_save_at_unix"]))
        return job, durable

    def verdicts(self, now: Optional[float] = None) -> list[Verdict]:
        """Each running source's verdict; a source that is not working (no fresh
        successful poll, or a deadline long past) is ``not-working``, never judged on
        its notice: it protects nothing until it polls again."""
        now = self._clock() if now is None else now
        snapshot = self._store.snapshot()
        job, durable = self.inputs(now)
        verdicts = []
        for status in snapshot.present:
            notice = (self._detected[status.name].notice_seconds
                      if status.name in self._detected else self._notices.get(status.name))
            verdict = judge_one(status.name, notice, job, durable, now)
            lag = status.next_poll_seconds
            why = not_working(status, now, snapshot.stale_after)
            if why is not None:
                verdict = replace(verdict, protected=None, working=False, reason=(
                    f"{status.name}: not working ({why}): a deadline it would give "
                    "is not seen"))
            elif lag is not None and notice is None:  # a move of a time known ahead
                verdict = replace(verdict, reason=f"{verdict.reason}; a moved deadline is "
                                  f"seen within {short_duration(lag)} (the poll interval now)")
            verdicts.append(replace(verdict, detection_lag_seconds=None if lag is None
                                    else round(lag, 1)))
        return verdicts

    def body(self, now: Optional[float] = None) -> dict[str, Any]:
        """The ``GET /v1/protection`` body: ``status`` the worst verdict (``not-working``
        also when no source runs), ``protected`` true only when it is ``protected``."""
        now = self._clock() if now is None else now
        verdicts = self.verdicts(now)
        job, durable = self.inputs(now)
        statuses = {v.status for v in verdicts}
        overall = next((s for s in WORST_FIRST if s in statuses), "protected")
        overall = overall if verdicts else "not-working"
        lags = [v.detection_lag_seconds for v in verdicts if v.detection_lag_seconds is not None]
        return {
            "protected": overall == "protected",
            "status": overall,
            "detection_lag_seconds": max(lags) if lags else None,
            "sources": [v.to_json() for v in verdicts],
            "job": {"step_seconds": job.step_seconds, "save_seconds": job.save_seconds,
                    "upload_seconds": job.upload_seconds,
                    "needed_seconds": job.needed_seconds},
            "durable_step": None if durable is None else durable.step,
            "durable_at_unix": None if durable is None else durable.at_unix,
            "server_time_unix": now,
        }

    def check(self, now: Optional[float] = None) -> None:
        """Log each verdict that changed since the last call (``SaidOnce``)."""
        for verdict in self.verdicts(now):
            self._said.say(verdict)

    def collect(self) -> list[Metric]:
        """Prometheus metrics at scrape time (registered in the API's own registry)."""
        protected = GaugeMetricFamily(
            "esi_sidecar_protected", "1 when the source's notice holds the job's step + save + "
            "upload, 0 when it does not (absent while the job's figures are unknown)",
            labels=["source"])
        notice = GaugeMetricFamily(
            "esi_sidecar_notice_seconds", "The notice the source's platform gives before the "
            "machine goes (absent for a time known far ahead, as the ESI release)",
            labels=["source"])
        needed = GaugeMetricFamily(
            "esi_sidecar_protection_needed_seconds", "The job's step + save + upload: the "
            "notice a signal must give (absent before the job reported a save)")
        at_risk = GaugeMetricFamily(
            "esi_sidecar_work_at_risk_seconds", "Age of the newest durable checkpoint: what "
            "a reclaim now would lose (absent before one)")
        verdicts = self.verdicts()
        for verdict in verdicts:
            if verdict.protected is not None:
                protected.add_metric([verdict.source], 1.0 if verdict.protected else 0.0)
            if verdict.notice_seconds is not None:
                notice.add_metric([verdict.source], verdict.notice_seconds)
        if verdicts and verdicts[0].needed_seconds is not None:
            needed.add_metric([], verdicts[0].needed_seconds)
        if verdicts and verdicts[0].at_risk_seconds is not None:
            at_risk.add_metric([], verdicts[0].at_risk_seconds)
        return [protected, notice, needed, at_risk]
