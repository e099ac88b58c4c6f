"""The deadline to act on (standard library only): the daemon's, cached, with the
platform's environment variables as the fallback.

Shared by :class:`sidecar.train.guard.CheckpointGuard` and the verl drop-in, so that both
cache, retry and fall back alike. The arrows run one way: client <- deadline <- guard.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Mapping
from datetime import timezone
from typing import Callable, Optional

from sidecar.timeparse import VOLCENGINE_TIMEZONE, TimestampError, parse_timestamp
from sidecar.train.client import SidecarClient
from sidecar.train.deadlines import PROCESS, Candidate, daemon_kind, earliest
from sidecar.train.policy import check_seconds
from sidecar.train.rank_log import RankPrefix

__all__ = [
    "DEFAULT_REFRESH_SECONDS",
    "DEFAULT_RETRY_SECONDS",
    "ENV_DEADLINE_VARIABLES",
    "DeadlineTracker",
    "env_deadline",
]

# Ask the daemon at most once a second; after a failure, wait 5 s: a hung daemon then
# costs at most one client timeout per 5 s.
DEFAULT_REFRESH_SECONDS = 1.0
DEFAULT_RETRY_SECONDS = 5.0

logger = logging.getLogger("sidecar.train.deadline")
logger.addFilter(RankPrefix())  # the guard's lines: each says its rank (rank_log.py)

# Set by the platform when the container starts: Volcengine ML platform, then SageMaker
# capacity blocks. Seconds or milliseconds (AWS documents both), or RFC 3339.
ENV_DEADLINE_VARIABLES = (
    "MLP_CURRENT_CAPACITY_BLOCK_EXPIRATION_TIMESTAMP",
    "SAGEMAKER_CURRENT_CAPACITY_BLOCK_EXPIRATION_TIMESTAMP",
)
# A date-time without an offset is read in its platform's zone, as the daemon's env source
# does (issue 13): Beijing time for Volcengine (the earliest reading), UTC for AWS.
_NAIVE_TIMEZONES = {
    "MLP_CURRENT_CAPACITY_BLOCK_EXPIRATION_TIMESTAMP": VOLCENGINE_TIMEZONE,
    "SAGEMAKER_CURRENT_CAPACITY_BLOCK_EXPIRATION_TIMESTAMP": timezone.utc,
}


def env_deadline(environ: Mapping[str, str] = os.environ) -> Optional[float]:
    """The platform's capacity-block deadline from the environment, as Unix seconds.

    Reads ``MLP_CURRENT_CAPACITY_BLOCK_EXPIRATION_TIMESTAMP``, then
    ``SAGEMAKER_CURRENT_CAPACITY_BLOCK_EXPIRATION_TIMESTAMP``: Unix seconds or
    milliseconds (told apart by magnitude) or RFC 3339; without an offset, Beijing time
    for the first, UTC for the second. A value that does not parse is skipped with one
    warning per call, never raised: it is outside data.
    """
    for name in ENV_DEADLINE_VARIABLES:
        value = environ.get(name)
        if value is None or not value.strip():
            continue
        try:
            return parse_timestamp(value, naive_timezone=_NAIVE_TIMEZONES[name]).unix
        except TimestampError as exc:
            logger.warning("ignoring %s: %s", name, exc)
    return None


class DeadlineTracker:
    """The deadline to act on: the daemon's, cached; the environment's as the fallback.

    Shared by :class:`CheckpointGuard` and the verl drop-in, so that both cache, retry and
    fall back alike.

    - ``client``: a :class:`SidecarClient` (anything with ``expiry()``, ``last_error`` and
      ``urls``; ``degraded_urls`` is read when present).
    - ``refresh_seconds``: ask the daemon at most this often; ``daemon_retry_seconds``:
      after a failure (of any of the daemons), wait this long instead, so a hung daemon
      costs at most one ``timeout`` per retry interval.
    - ``clock`` (wall, for deadlines; kept for callers as ``tracker.clock``) and
      ``monotonic`` (refresh timing): injectable for tests.
    - ``environ``: where to read ``ENV_DEADLINE_VARIABLES`` (default ``os.environ``).
      Read once here, unless ``live_environ``: then read at every call, as verl does (a
      value is parsed, and a bad one warned about, once per change).

    :meth:`deadline` answers ``(deadline_unix, "daemon" | "env" | None)``: the daemon's
    deadline while every daemon gives a current answer with one; the environment's when the
    daemon freshly says none is scheduled, or no daemon deadline was ever known; otherwise
    (a daemon unreachable, or answering stale without a deadline) the earlier of the
    daemon's last known deadline and the environment's.

    Never raises on the daemon's or the environment's account. Logs one warning when the
    daemon becomes unreachable and one line when it is back; one when its answers turn
    stale and one when they are fresh again. Thread-safe.
    """

    def __init__(
        self,
        client: SidecarClient,
        *,
        refresh_seconds: float = DEFAULT_REFRESH_SECONDS,
        daemon_retry_seconds: float = DEFAULT_RETRY_SECONDS,
        clock: Callable[[], float] = time.time,
        monotonic: Callable[[], float] = time.monotonic,
        environ: Optional[Mapping[str, str]] = None,
        live_environ: bool = False,
    ) -> None:
        self.refresh_seconds = check_seconds("refresh_seconds", refresh_seconds)
        self.daemon_retry_seconds = check_seconds("daemon_retry_seconds", daemon_retry_seconds)
        self.client = client
        self.clock = clock
        self._monotonic = monotonic
        self._live_environ: Optional[Mapping[str, str]] = environ
        self._environ: Optional[Mapping[str, str]] = None
        if not live_environ:
            source = os.environ if environ is None else environ
            self._environ = {n: source[n] for n in ENV_DEADLINE_VARIABLES if n in source}
        self._env_raw: Optional[tuple[Optional[str], ...]] = None
        self._env_value: Optional[float] = None
        self._lock = threading.Lock()
        self._next_refresh: Optional[float] = None  # monotonic; None: refresh now
        self._reachable = False
        self._current = False  # the daemon deadline is a current answer from every daemon
        self._daemon_deadline: Optional[float] = None  # the last deadline the daemon gave
        self._daemon_source: Optional[str] = None  # the daemon's source of that deadline
        self._daemon_kind: Optional[str] = None  # its kind, as served (None: not served)
        self._last_error: Optional[str] = None
        self._warned_unreachable = False
        self._warned_stale = False
        # The daemons' upload estimate and state, as last answered (kept while unreachable).
        self._upload_seconds: Optional[float] = None
        self._upload_status: Optional[str] = None
        self._upload_measured: Optional[int] = None
        self._drill: Optional[dict[str, object]] = None  # the daemon's drill under way

    @property
    def drill(self) -> Optional[dict[str, object]]:
        """The fire drill the daemon(s) last answered (``Expiry.drill``), None when there
        is none or no daemon answered: a drill never outlives its daemon's word."""
        return self._drill

    @property
    def reachable(self) -> bool:
        """Did every daemon answer the last request?"""
        return self._reachable

    @property
    def last_error(self) -> Optional[str]:
        """Why the last request failed (for some or all daemons), else None."""
        return self._last_error

    @property
    def upload_seconds(self) -> Optional[float]:
        """How long a checkpoint saved now takes to become durable in storage (the slowest
        node's estimate); None without an uploader or before it knows."""
        return self._upload_seconds

    @property
    def daemon_source(self) -> Optional[str]:
        """The daemon's source of the deadline it last gave (``Expiry.source``, e.g.
        ``"volcengine-esi"``, ``"aws"``, ``"slurm"``); None before one answered."""
        return self._daemon_source

    @property
    def daemon_kind(self) -> Optional[str]:
        """The kind of the deadline the daemon last gave, as it served it
        (``Expiry.deadline_kind``: "machine" or "process"); None from a daemon that does
        not serve it (the guard then guesses: ``sidecar.train.deadlines.daemon_kind``)."""
        return self._daemon_kind

    @property
    def upload_measured(self) -> Optional[int]:
        """How many uploads the estimate rests on (``Expiry.upload_measured``, the
        fewest of the nodes'); None when the daemons do not say."""
        return self._upload_measured

    @property
    def upload_status(self) -> Optional[str]:
        """The uploader's state ("ok", "uploading", "degraded"), None without one."""
        return self._upload_status

    def deadline(self, *, refresh: bool = True) -> tuple[Optional[float], Optional[str]]:
        """``(deadline_unix, source)``; asks the daemon first when a refresh is due.

        ``refresh=False`` never asks: for a save that must not wait for the daemon.
        """
        chosen = self.candidate(refresh=refresh)
        return (None, None) if chosen is None else (chosen.unix, chosen.source)

    def candidate(self, *, refresh: bool = True) -> Optional[Candidate]:
        """:meth:`deadline` as a :class:`Candidate` with its kind: the daemon's as it served
        it (``sidecar.train.deadlines.daemon_kind``), the environment's a process's."""
        with self._lock:
            if refresh:
                self._maybe_refresh()
            return self._choose()

    def _env_deadline(self) -> Optional[float]:
        environ = self._environ
        if environ is None:
            environ = os.environ if self._live_environ is None else self._live_environ
        raw = tuple(environ.get(name) for name in ENV_DEADLINE_VARIABLES)
        if raw != self._env_raw:
            self._env_raw = raw
            self._env_value = env_deadline(environ)
        return self._env_value

    def _choose(self) -> Optional[Candidate]:
        daemon, env = self._daemon_deadline, self._env_deadline()
        kind = daemon_kind(self._daemon_kind, self._daemon_source)
        candidates = [None if daemon is None else Candidate(daemon, "daemon", kind)]
        # A current daemon's word stands; a last known one, or none, meets the environment's
        # (sidecar.train.deadlines: on a tie the daemon's, listed first, stays).
        if daemon is None or not self._current:
            candidates.append(None if env is None else Candidate(env, "env", PROCESS))
        return earliest(candidates)

    def _maybe_refresh(self) -> None:
        now = self._monotonic()
        if self._next_refresh is not None and now < self._next_refresh:
            return
        try:
            answer = self.client.expiry()
            error = self.client.last_error
            degraded = tuple(getattr(self.client, "degraded_urls", ()))
        except Exception as exc:  # a client given by the caller may raise
            answer, error, degraded = None, f"{type(exc).__name__}: {exc}", ()
        self._last_error = error
        failed = answer is None or error is not None
        self._next_refresh = now + (self.daemon_retry_seconds if failed else self.refresh_seconds)
        self._drill = None if answer is None else answer.drill
        if answer is None:
            self._reachable = self._current = False
            # Warned only after a request failed: a client that asked no daemon yet (Ray
            # before its nodes are known) answers None without an error.
            if error is not None and not self._warned_unreachable:
                self._warned_unreachable = True
                known = self._choose()
                fallback = (
                    "no deadline known"
                    if known is None
                    else "using the "
                    f"{'last known' if known.source == 'daemon' else known.source} deadline"
                )
                logger.warning(
                    "sidecar daemon unreachable (%s); %s; retrying every %g s",
                    error,
                    fallback,
                    self.daemon_retry_seconds,
                )
            return
        # Stale and without a deadline (restarted without its state file while its source
        # fails): nothing new, so the last known deadline stays, as when unreachable.
        says_nothing = answer.stale and answer.expires_at_unix is None
        if not says_nothing:
            self._daemon_deadline = answer.expires_at_unix
            self._daemon_source = answer.source
            self._daemon_kind = answer.deadline_kind
        self._upload_seconds, self._upload_status = answer.upload_seconds, answer.upload_status
        self._upload_measured = answer.upload_measured
        self._reachable = error is None
        self._current = error is None and not degraded and not says_nothing
        if self._warned_unreachable:
            self._warned_unreachable = False
            logger.info("sidecar daemon reachable again at %s", ", ".join(self.client.urls))
        if error is not None:
            return  # some daemons failed: the client logged that, once per change
        if answer.stale and not self._warned_stale:
            self._warned_stale = True
            kept = (
                "; it gave no deadline, the last known one is kept"
                if says_nothing and self._daemon_deadline is not None
                else ""
            )
            logger.warning(
                "sidecar daemon's deadline is stale (last poll error: %s)%s", answer.error, kept
            )
        elif not answer.stale and self._warned_stale:
            self._warned_stale = False
            logger.info("sidecar daemon's deadline is fresh again")
