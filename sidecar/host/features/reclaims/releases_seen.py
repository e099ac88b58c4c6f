"""The releases this daemon saw itself: the one input of the mean time between reclaims.

A job's routine-save interval rests on how often machines here are reclaimed
(``sidecar.train.routine``). What a job or any local process posts (its events, a
restore's account) can say anything, so none of it counts here (issue 35, item 7). A
release counts only when one of the daemon's own sources served its deadline and the
daemon saw it come: its clock passed the deadline while it was still the one served, or a
job stopped for the release while that deadline was at most :data:`NEAR_SECONDS` away.
One deadline is one release however many jobs stopped for it. The machine's life is from
the later of the previous release seen and the time the daemon began watching (kept
across restarts) to the release: a restart without its state errs short, towards more
saves. Not thread-safe: the ledger (``sidecar.host.features.reclaims.ledger``) holds its lock.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from typing import Any, Optional

__all__ = ["KEPT", "NEAR_SECONDS", "ReleasesSeen", "SeenRelease"]

KEPT = 50  # releases remembered: the newest, enough for a mean
# A job's stop counts for the served deadline when the deadline is this close: the longest
# notice a source gives (Volcengine's 5 min spot reclaim). A deadline this close to one seen
# already, from the same source, is that release moved by a re-poll, not another one.
NEAR_SECONDS = 300.0


@dataclass(frozen=True)
class SeenRelease:
    source: str
    released_unix: float
    started_unix: float  # the previous release seen, or when the daemon began watching

    @property
    def life_seconds(self) -> float:
        return self.released_unix - self.started_unix

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "life_seconds": self.life_seconds}


class ReleasesSeen:
    """The newest :data:`KEPT` releases the daemon saw, oldest first."""

    def __init__(self, watching_since_unix: float) -> None:
        self.watching_since_unix = watching_since_unix
        self._seen: deque[SeenRelease] = deque(maxlen=KEPT)

    def see(self, source: str, deadline_unix: float) -> Optional[SeenRelease]:
        """Record the release at ``deadline_unix`` from ``source``; None when it is one seen
        already (or not after the newest seen)."""
        if not math.isfinite(deadline_unix):
            return None
        for seen in self._seen:
            if seen.source == source and abs(seen.released_unix - deadline_unix) <= NEAR_SECONDS:
                return None
        start = max([self.watching_since_unix, *(s.released_unix for s in self._seen)])
        if deadline_unix <= start:
            return None
        release = SeenRelease(source, deadline_unix, start)
        self._seen.append(release)
        return release

    def lives(self) -> list[float]:
        return [s.life_seconds for s in self._seen]

    def to_json(self) -> list[dict[str, Any]]:
        """Newest first."""
        return [s.to_json() for s in reversed(self._seen)]

    def dump(self) -> dict[str, Any]:
        return {"watching_since_unix": self.watching_since_unix,
                "seen": [asdict(s) for s in self._seen]}

    def load(self, section: Any) -> None:
        """A section written by :meth:`dump` (absent: nothing to load); ValueError naming
        the first bad field. The earlier start of watching wins."""
        if section is None:
            return
        if not isinstance(section, dict):
            raise ValueError("seen: not an object")
        since = section.get("watching_since_unix")
        if not isinstance(since, (int, float)) or not _is_time(since):
            raise ValueError("seen.watching_since_unix: not a Unix time")
        raw = section.get("seen", [])
        if not isinstance(raw, list):
            raise ValueError("seen.seen: not a list")
        releases = list(_parsed(raw[-KEPT:]))
        self.watching_since_unix = min(self.watching_since_unix, float(since))
        self._seen.extend(releases)


def _is_time(value: object) -> bool:
    return (not isinstance(value, bool) and isinstance(value, (int, float))
            and math.isfinite(value) and 0 < value < 1e11)


def _parsed(raw: Iterable[object]) -> Iterable[SeenRelease]:
    for index, item in enumerate(raw):
        if not isinstance(item, dict) or not isinstance(item.get("source"), str):
            raise ValueError(f"seen.seen[{index}]: not a release")
        for name in ("released_unix", "started_unix"):
            if not _is_time(item.get(name)):
                raise ValueError(f"seen.seen[{index}].{name}: not a Unix time")
        if item["started_unix"] >= item["released_unix"]:
            raise ValueError(f"seen.seen[{index}]: started after it was released")
        yield SeenRelease(item["source"], float(item["released_unix"]),
                          float(item["started_unix"]))
