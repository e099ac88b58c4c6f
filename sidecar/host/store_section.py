"""The store's section of the state file: each source's last good deadline, checked field
by field on the way back in (``sidecar.host.statefile`` reads and writes the file)."""

from __future__ import annotations

import reprlib
import time
from dataclasses import asdict
from typing import Any, Callable

from sidecar.host.store import Store
from sidecar.models import Observation

__all__ = ["StoreSection"]

# What a saved deadline may be: a Unix time between 2000 and the year 5138 (the bounds of
# sidecar.timeparse); an observation may not come from the future (a day of clock skew).
_EARLIEST_UNIX = 946684800.0
_LATEST_UNIX = 1e11
_FUTURE_SKEW_SECONDS = 86400.0
_TEXT_FIELDS = ("kind", "instance_id", "scheduled_instance_id", "assumed_timezone")


class StoreSection:
    """``"sources"``: the last good observation of each source and when it was made;
    restored as stale until a poll confirms it. Required: a bad one sets the file aside."""

    name = "sources"
    what = "the deadline"
    required = True

    def __init__(self, store: Store, clock: Callable[[], float] = time.time) -> None:
        self._store = store
        self._clock = clock

    def dump(self) -> dict[str, Any]:
        sources: dict[str, Any] = {}
        for status in self._store.snapshot().sources:
            if status.observation is not None and status.observed_at_unix is not None:
                observation = asdict(status.observation)
                # Notices are what a source sees now: the next poll brings them back.
                del observation["notices"]
                sources[status.name] = {
                    "observation": observation,
                    "observed_at_unix": status.observed_at_unix,
                }
        return sources

    def load(self, section: Any) -> None:
        """All or nothing: one bad entry refuses the section (ValueError naming it)."""
        for name, observation, observed_at in _parse(section, self._clock()):
            self._store.restore(name, observation, observed_at)


def _parse(sources: Any, now: float) -> list[tuple[str, Observation, float]]:
    if not isinstance(sources, dict):
        raise ValueError("sources must be an object")
    entries = []
    for name, entry in sources.items():
        if not isinstance(entry, dict) or not isinstance(entry.get("observation"), dict):
            raise ValueError(f"{name}: an entry needs an observation object")
        fields = entry["observation"]
        unknown = set(fields) - {"expires_at_unix", *_TEXT_FIELDS}
        if unknown:
            raise ValueError(f"{name}: unknown field(s) {', '.join(sorted(unknown))}")
        expires = fields.get("expires_at_unix")
        if expires is not None:
            expires = _unix(f"{name}.expires_at_unix", expires, _LATEST_UNIX)
        for field in _TEXT_FIELDS:
            value = fields.get(field)
            if value is not None and not isinstance(value, str):
                raise ValueError(f"{name}.{field} must be text or null, got {_shown(value)}")
        observed = _unix(f"{name}.observed_at_unix", entry.get("observed_at_unix"),
                         now + _FUTURE_SKEW_SECONDS)
        observation = Observation(
            expires_at_unix=expires, **{field: fields.get(field) for field in _TEXT_FIELDS}
        )
        entries.append((name, observation, observed))
    return entries


def _unix(name: str, value: Any, latest: float) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name} must be a number, got {_shown(value)}")
    # Compared before any conversion: an integer of 400 digits is no float (OverflowError);
    # NaN fails every comparison.
    if not _EARLIEST_UNIX <= value <= latest:
        raise ValueError(f"{name} is not a plausible Unix time: {_shown(value)}")
    return float(value)


def _shown(value: Any) -> str:
    """A bad value as a log line names it: short, and never deeper than a few levels."""
    return reprlib.repr(value)
