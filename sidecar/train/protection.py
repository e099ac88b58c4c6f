"""The protection verdict: whether a signal's notice holds the job's step + save + upload.

Pure (no clock, no I/O) and standard library only: the daemon judges every source it
runs with it (``sidecar.host.features.protection.board``), the guard its own SIGTERM grace and the
sources the daemon serves (issue 24, item 2). A notice of None is a time known far ahead
(an ESI release): the guard saves before it whatever the save takes.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Optional

__all__ = ["DurableCheckpoint", "JobFigures", "SaidOnce", "Verdict", "judge", "judge_one",
           "parse_notice", "short_duration"]


@dataclass(frozen=True)
class JobFigures:
    """What the job measured: its longest recent step, its save (the blocking part) and
    what follows it before the checkpoint is durable (asynchronous write + upload)."""

    step_seconds: Optional[float] = None
    save_seconds: Optional[float] = None
    upload_seconds: Optional[float] = None

    @property
    def needed_seconds(self) -> Optional[float]:
        """step + save + upload; None until the job reported a save time."""
        if self.save_seconds is None:
            return None
        return (self.step_seconds or 0.0) + self.save_seconds + (self.upload_seconds or 0.0)


@dataclass(frozen=True)
class DurableCheckpoint:
    """The newest checkpoint that survives the machine: its step and when it was made."""

    step: Optional[int]
    at_unix: float


@dataclass(frozen=True)
class Verdict:
    """One signal, judged: ``protected`` None when the job's figures are not known yet."""

    source: str
    notice_seconds: Optional[float]  # None: known far ahead
    protected: Optional[bool]
    needed_seconds: Optional[float]
    at_risk_seconds: Optional[float]  # age of the newest durable checkpoint (None: none)
    at_risk_step: Optional[int]
    reason: str
    # The source polls successfully now (the daemon's judgement: a fresh success and no
    # deadline long past). A source not working protects nothing: ``protected`` is None.
    working: bool = True
    # How late a moved deadline can be seen now (the source's poll interval now).
    detection_lag_seconds: Optional[float] = None

    @property
    def status(self) -> str:
        if not self.working:
            return "not-working"
        if self.protected is None:
            return "unknown"
        return "protected" if self.protected else "not-protected"

    def to_json(self) -> dict[str, Any]:
        return {"source": self.source, "status": self.status, "protected": self.protected,
                "working": self.working,
                "notice_seconds": self.notice_seconds, "needed_seconds": self.needed_seconds,
                "at_risk_seconds": self.at_risk_seconds, "at_risk_step": self.at_risk_step,
                "detection_lag_seconds": self.detection_lag_seconds,
                "reason": self.reason}


def short_duration(seconds: float) -> str:
    """``41 min``, ``140 s``, ``3.2 h``: the figures of a verdict's line (seconds below
    ten minutes, as notices and saves are counted)."""
    if seconds >= 7200:
        return f"{seconds / 3600:.1f} h"
    if seconds >= 600:
        return f"{seconds / 60:.0f} min"
    return f"{seconds:.0f} s"


def judge_one(source: str, notice_seconds: Optional[float], job: JobFigures,
              durable: Optional[DurableCheckpoint], now: float) -> Verdict:
    """The verdict of one signal, at ``now`` (Unix seconds) for the work at risk."""
    needed = job.needed_seconds
    at_risk = None if durable is None else max(0.0, now - durable.at_unix)
    step = None if durable is None else durable.step
    what = "step + save + upload" if job.upload_seconds else "step + save"
    if notice_seconds is None:
        return Verdict(source, None, True, needed, at_risk, step,
                       f"{source}: the time is known far ahead: the guard saves before it")
    notice = f"{source}: {short_duration(notice_seconds)} notice"
    if needed is None:
        return Verdict(source, notice_seconds, None, None, at_risk, step,
                       f"{notice}: no job has reported its save time yet")
    if notice_seconds >= needed:
        return Verdict(source, notice_seconds, True, needed, at_risk, step,
                       f"{notice} >= {short_duration(needed)} {what}")
    if durable is None:
        loses = "everything since the job started (no durable checkpoint)"
    else:
        since = "" if step is None else f" since step {step}"
        loses = f"the {short_duration(at_risk or 0.0)}{since}"
    return Verdict(source, notice_seconds, False, needed, at_risk, step,
                   f"{notice} < {short_duration(needed)} {what}: a reclaim now loses {loses}")


def judge(notices: Mapping[str, Optional[float]], job: JobFigures,
          durable: Optional[DurableCheckpoint], now: float) -> list[Verdict]:
    """Every signal's verdict, in the order given."""
    return [judge_one(source, notice, job, durable, now) for source, notice in notices.items()]


def parse_notice(text: str) -> Optional[float]:
    """``30``, ``30s``, ``2m`` or ``ahead`` -> seconds (None: ahead); ValueError else."""
    value = text.strip().lower()
    if value == "ahead":
        return None
    scale = 1.0
    if value.endswith("min") or value.endswith("m"):
        value, scale = value.rstrip("min").rstrip(), 60.0
    elif value.endswith("s"):
        value = value[:-1].rstrip()
    try:
        seconds = float(value) * scale
    except ValueError:
        raise ValueError(f"{text.strip()!r} is not a number of seconds (or 'ahead')") from None
    if not 0 < seconds <= 86400 * 30:
        raise ValueError(f"{text.strip()!r} must be more than 0 and at most 30 days")
    return seconds


class SaidOnce:
    """Logs a signal's verdict when it changes (its status, its notice, or the figures
    it was held against, to the second), never again while it holds: a warning when the
    signal cannot be met. The age of the work at risk grows every second and is no change."""

    def __init__(self, logger: logging.Logger) -> None:
        self._logger = logger
        self._said: dict[str, tuple[str, Optional[float], Optional[float]]] = {}

    def say(self, verdict: Verdict) -> bool:
        """True when it logged."""
        needed = None if verdict.needed_seconds is None else round(verdict.needed_seconds)
        key = (verdict.status, verdict.notice_seconds, needed)
        if self._said.get(verdict.source) == key:
            return False
        self._said[verdict.source] = key
        # Not working: the poller has warned about the source's failing polls already.
        level = logging.WARNING if verdict.protected is False else logging.INFO
        self._logger.log(level, "%s", verdict.reason)
        return True
