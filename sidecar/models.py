"""Plain data shared by the daemon and the training side (standard library only).

These mirror the HTTP contract in ARCHITECTURE.md ("HTTP contract (v1)"). ``from_json``
validates what comes off the wire and raises ``ValueError`` with a clear message; the
client turns that into "no answer" rather than an exception in the training loop.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, fields
from typing import Any, Optional

__all__ = [
    "DEADLINE_MACHINE",
    "DEADLINE_PROCESS",
    "DEFAULT_AWS_IMDS_URL",
    "DEFAULT_AZURE_METADATA_URL",
    "DEFAULT_GCP_METADATA_URL",
    "DEFAULT_LISTEN",
    "DEFAULT_METADATA_URL",
    "KIND_MAINTENANCE",
    "KIND_PREEMPTION",
    "KIND_REBALANCE",
    "KIND_SCHEDULED_RELEASE",
    "Decision",
    "Expiry",
    "Notice",
    "Observation",
    "observation_from_notices",
]

# The daemon's default address (ARCHITECTURE.md, "HTTP contract"): the daemon listens on it
# and the client asks it unless told otherwise.
DEFAULT_LISTEN = "127.0.0.1:8791"
# The ECS instance metadata service: the settings table's default and the Volcengine
# source's. Here because both may import this module, and nothing heavier.
DEFAULT_METADATA_URL = "http://100.96.0.96"
DEFAULT_AWS_IMDS_URL = "http://169.254.169.254"  # EC2's instance metadata service
# GCE's metadata server (also metadata.google.internal; the address needs no DNS) and
# Azure's Instance Metadata Service, which serves Scheduled Events.
DEFAULT_GCP_METADATA_URL = "http://169.254.169.254"
DEFAULT_AZURE_METADATA_URL = "http://169.254.169.254"

KIND_SCHEDULED_RELEASE = "scheduled-release"  # ESI AutoReleaseAt, capacity blocks
KIND_PREEMPTION = "preemption-notice"  # spot / preemptible reclaim, early ESI reclaim
KIND_MAINTENANCE = "scheduled-maintenance"  # the platform stops, reboots or moves the VM
KIND_REBALANCE = "rebalance-recommendation"  # advice only (AWS): never a deadline
# Whose end a deadline is (``deadline_kind``): the machine's, or only the process's.
DEADLINE_MACHINE = "machine"
DEADLINE_PROCESS = "process"


def _number(body: Mapping[str, Any], key: str, *, optional: bool = True) -> Optional[float]:
    value = body.get(key)
    if value is None:
        if optional:
            return None
        raise ValueError(f"field {key!r} is missing")
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"field {key!r} is not a number: {value!r}")
    if not math.isfinite(value):
        raise ValueError(f"field {key!r} is not finite: {value!r}")
    return float(value)


def _count(body: Mapping[str, Any], key: str) -> Optional[int]:
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"field {key!r} is not a count (an integer >= 0): {value!r}")
    return value


def _text(body: Mapping[str, Any], key: str) -> Optional[str]:
    value = body.get(key)
    if value is None:
        return None
    if not isinstance(value, str):
        raise ValueError(f"field {key!r} is not a string: {value!r}")
    return value


def _flag(body: Mapping[str, Any], key: str) -> bool:
    value = body.get(key, False)
    if not isinstance(value, bool):
        raise ValueError(f"field {key!r} is not a boolean: {value!r}")
    return value


@dataclass(frozen=True)
class Notice:
    """One thing a source saw coming. ``advisory`` notices (AWS's rebalance advice) are
    shown in ``/v1/expiry``'s ``notices`` but are never a deadline; their time may be None.
    ``detail`` is the platform's own word for it ("spot terminate", "Preempt", ...)."""

    kind: str
    expires_at_unix: Optional[float]
    advisory: bool = False
    detail: Optional[str] = None


@dataclass(frozen=True)
class Observation:
    """One successful poll of a source; ``expires_at_unix`` is None when no release is
    scheduled. Defined here, not in ``sidecar.host.sources``, so the store and the API need
    nothing from the sources.

    A source that can see several things at once (a spot notice and maintenance) lists
    them in ``notices``, and its deadline is the earliest that is not advisory
    (:func:`observation_from_notices`); the others leave ``notices`` empty and the store
    lists their deadline as their one notice."""

    expires_at_unix: Optional[float]
    kind: Optional[str] = None
    instance_id: Optional[str] = None
    scheduled_instance_id: Optional[str] = None
    # Set when the source gave a timestamp without an offset and we assumed this zone.
    assumed_timezone: Optional[str] = None
    notices: tuple[Notice, ...] = ()


def observation_from_notices(notices: Sequence[Notice], **identity: Any) -> Observation:
    """The Observation whose deadline is the earliest non-advisory notice's."""
    deadlines = [n for n in notices if not n.advisory and n.expires_at_unix is not None]
    earliest = min(deadlines, key=lambda n: n.expires_at_unix or 0.0, default=None)
    return Observation(
        expires_at_unix=earliest.expires_at_unix if earliest else None,
        kind=earliest.kind if earliest else None,
        notices=tuple(notices),
        **identity,
    )


@dataclass(frozen=True)
class Expiry:
    """The body of ``GET /v1/expiry``: the earliest known deadline and how fresh it is."""

    expires_at: Optional[str]
    expires_at_unix: Optional[float]
    remaining_seconds: Optional[float]
    kind: Optional[str]
    source: Optional[str]
    instance_id: Optional[str]
    scheduled_instance_id: Optional[str]
    observed_at: Optional[str]
    age_seconds: Optional[float]
    stale: bool
    error: Optional[str]
    server_time_unix: float
    # Set when the deadline came without a UTC offset and was read in this zone.
    assumed_timezone: Optional[str] = None
    # With the checkpoint uploader: how long the next checkpoint takes to become durable
    # once saved locally (None: unknown yet), and the uploader's state ("ok", "uploading",
    # "degraded"). Both None on a daemon that does not upload: a local save is durable.
    upload_seconds: Optional[float] = None
    upload_status: Optional[str] = None
    # How many uploads that estimate's rate rests on (at most the uploader's window of
    # 10; 0: none yet, a probe or the configured cap); None on a daemon that does not
    # say (one from before this field): a guard then trusts the estimate as it is.
    upload_measured: Optional[int] = None
    # Every source's notices (source, kind, expires_at, expires_at_unix, remaining_seconds,
    # advisory, detail, observed_at, stale, detection_lag_seconds, deadline_kind), the
    # earliest deadline first, advice last.
    notices: tuple[dict[str, Any], ...] = ()
    # A fire drill under way (``esi-sidecar drill``, docs/drill.md): its id, deadline
    # (expires_at, expires_at_unix, remaining_seconds) and start. Never in expires_at: a
    # guard that knows no drills goes on training, the real deadline stays the real one.
    drill: Optional[dict[str, Any]] = None
    # How late a moved deadline can be seen now: the longest wait the daemon's poller
    # planned after its last poll of any source (None: unknown, an older daemon).
    detection_lag_seconds: Optional[float] = None
    # Whose end the deadline is: "machine" (a release or reclaim) or "process" (a Slurm
    # limit, the environment's deadline), as its source's spec declares; each notice says
    # its own the same way. None: no deadline, or an older daemon (the guard then guesses
    # from ``source``: sidecar.train.deadlines.daemon_kind).
    deadline_kind: Optional[str] = None

    def to_json(self) -> dict[str, Any]:
        # Not asdict(): its deep copy costs more than the rest of a /v1/expiry answer, and
        # every field but notices is immutable already.
        body = {name: getattr(self, name) for name in _EXPIRY_FIELDS}
        body["notices"] = [dict(notice) for notice in self.notices]
        body["drill"] = None if self.drill is None else dict(self.drill)
        return body

    @classmethod
    def from_json(cls, body: Any) -> Expiry:
        if not isinstance(body, Mapping):
            raise ValueError(f"expected a JSON object, got {type(body).__name__}")
        server_time = _number(body, "server_time_unix", optional=False)
        assert server_time is not None
        return cls(
            expires_at=_text(body, "expires_at"),
            expires_at_unix=_number(body, "expires_at_unix"),
            remaining_seconds=_number(body, "remaining_seconds"),
            kind=_text(body, "kind"),
            source=_text(body, "source"),
            instance_id=_text(body, "instance_id"),
            scheduled_instance_id=_text(body, "scheduled_instance_id"),
            observed_at=_text(body, "observed_at"),
            age_seconds=_number(body, "age_seconds"),
            stale=_flag(body, "stale"),
            error=_text(body, "error"),
            server_time_unix=server_time,
            assumed_timezone=_text(body, "assumed_timezone"),
            upload_seconds=_number(body, "upload_seconds"),
            upload_status=_text(body, "upload_status"),
            upload_measured=_count(body, "upload_measured"),
            notices=_notices(body),
            drill=_drill(body),
            detection_lag_seconds=_number(body, "detection_lag_seconds"),
            deadline_kind=_text(body, "deadline_kind"),
        )


_EXPIRY_FIELDS = tuple(field.name for field in fields(Expiry))


def _drill(body: Mapping[str, Any]) -> Optional[dict[str, Any]]:
    """The drill under way, or None; one without a usable id and deadline is none."""
    drill = body.get("drill")
    if not isinstance(drill, Mapping):
        return None
    try:
        deadline = _number(drill, "expires_at_unix", optional=False)
        identity = _text(drill, "id")
    except ValueError:
        return None
    return None if identity is None or deadline is None else dict(drill)


def _notices(body: Mapping[str, Any]) -> tuple[dict[str, Any], ...]:
    notices = body.get("notices") or []
    if not isinstance(notices, list) or not all(isinstance(n, Mapping) for n in notices):
        raise ValueError(f"field 'notices' is not a list of objects: {notices!r:.80}")
    for notice in notices:
        _number(notice, "expires_at_unix")
        _text(notice, "source")
        _text(notice, "kind")
        _text(notice, "deadline_kind")
    return tuple(dict(notice) for notice in notices)


@dataclass(frozen=True)
class Decision:
    """The body of ``GET /v1/decision``: the fixed rule (save when the time left is at most
    step + save + upload + margin), evaluated once."""

    save_now: bool
    remaining_seconds: Optional[float]
    budget_seconds: float
    expires_at: Optional[str]
    stale: bool
    # The uploader's estimate included in the budget (None: this daemon does not upload).
    upload_seconds: Optional[float] = None

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, body: Any) -> Decision:
        if not isinstance(body, Mapping):
            raise ValueError(f"expected a JSON object, got {type(body).__name__}")
        budget = _number(body, "budget_seconds", optional=False)
        assert budget is not None
        return cls(
            save_now=_flag(body, "save_now"),
            remaining_seconds=_number(body, "remaining_seconds"),
            budget_seconds=budget,
            expires_at=_text(body, "expires_at"),
            stale=_flag(body, "stale"),
            upload_seconds=_number(body, "upload_seconds"),
        )

