"""The training side's HTTP client for the daemon (standard library only).

``pip install esi-sidecar`` must work in any training image, and a test fails if
importing this module pulls in a server dependency.

:class:`SidecarClient` asks one or more daemons for the deadline (``GET /v1/expiry``) and
whether a checkpoint is durable (``GET /v1/uploads``). It never raises into the training
loop because the daemon is down, slow or talking nonsense: it answers None and records
``last_error``. What to do with the answer (cache, fallback, the decision) lives in
:mod:`sidecar.train.deadline` and :mod:`sidecar.train.guard`.
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any, Optional, Union

from sidecar.models import DEFAULT_LISTEN, Expiry
from sidecar.train.deadlines import DRILL, Candidate, daemon_kind, earliest
from sidecar.train.endpoint import ENV_TOKEN, Endpoint, FetchError, describe_error
from sidecar.train.event_sender import EventSender

__all__ = ["DEFAULT_TIMEOUT_SECONDS", "DEFAULT_URL", "ENV_TOKEN", "ENV_URL", "SidecarClient"]

logger = logging.getLogger("sidecar.train.client")

DEFAULT_URL = f"http://{DEFAULT_LISTEN}"
# Short: the client is asked from the training loop; on loopback the daemon answers in
# about a millisecond.
DEFAULT_TIMEOUT_SECONDS = 0.2
ENV_URL = "ESI_SIDECAR_URL"
UPLOADS_PATH = "/v1/uploads?limit=0"  # the summary only: last_durable_step
PROTECTION_PATH = "/v1/protection"  # each running source's notice (routine saves)
RECLAIMS_PATH = "/v1/reclaims"  # the releases the daemon accounted (routine saves)


# ---------------------------------------------------------------------------- HTTP client


def _kept(known: Expiry, why: str) -> Expiry:
    """A daemon's last answer with a deadline, served again because it said nothing newer."""
    remaining = None if known.expires_at_unix is None else known.expires_at_unix - time.time()
    return replace(
        known, stale=True, error=f"last known deadline kept; {why}", remaining_seconds=remaining
    )


def _with_slowest_upload(chosen: Expiry, answers: list[Expiry]) -> Expiry:
    """The slowest node's upload counts (every node's checkpoint must be durable; a node
    that stopped answering counts with its last answer), and any node's uploader in
    trouble makes the whole answer say so; the estimate resting on the fewest uploads
    says how far the answer can be trusted."""
    estimates = [a.upload_seconds for a in answers if a.upload_seconds is not None]
    states = [a.upload_status for a in answers if a.upload_status is not None]
    status = next((s for s in ("degraded", "uploading", "ok") if s in states), None)
    counts = [a.upload_measured for a in answers if a.upload_measured is not None]
    return replace(chosen, upload_seconds=max(estimates) if estimates else None,
                   upload_status=status, upload_measured=min(counts) if counts else None)


def _candidate(answer: Expiry, index: int) -> Optional[Candidate]:
    """A daemon's answer as a deadline candidate, its source the answer's index."""
    if answer.expires_at_unix is None:
        return None
    return Candidate(answer.expires_at_unix, str(index),
                     daemon_kind(answer.deadline_kind, answer.source))


def _check_token(token: str) -> str:
    """A token fit for one header line: printable ASCII without spaces, else ValueError
    (which never shows the token itself)."""
    if not isinstance(token, str) or not token or not all(33 <= ord(c) <= 126 for c in token):
        raise ValueError("token must be non-empty printable ASCII without spaces")
    return token


def _token_from_environment() -> Optional[str]:
    value = os.environ.get(ENV_TOKEN, "").strip()
    if not value:
        return None
    try:
        return _check_token(value)
    except ValueError as exc:
        # Outside data: never crash the training loop on it; the daemon will say 401.
        logger.warning("ignoring %s: %s", ENV_TOKEN, exc)
        return None


def _split_urls(value: str) -> list[str]:
    return [part.strip() for part in value.split(",") if part.strip()]


class SidecarClient:
    """Asks one or more daemons for the deadline; never raises on network or data errors.

    ``url``: a URL, a comma-separated list or a sequence of URLs; default
    ``$ESI_SIDECAR_URL``, else ``http://127.0.0.1:8791``. With several (one daemon per
    node), the earliest deadline wins. Each URL keeps one keep-alive connection, so a
    refresh costs one round trip on loopback, and a short ``timeout`` (0.2 s) bounds
    the stall when a daemon hangs. ``http.client`` reads no proxy variables, so an
    ``http_proxy`` set for downloads never captures loopback traffic.

    ``token``: sent as ``Authorization: Bearer <token>`` to every daemon; default
    ``$ESI_SIDECAR_TOKEN`` (unset: none). A daemon listening beyond loopback requires it
    (docs/deploy.md, "Containers"); on loopback none is needed.

    Not thread-safe: use one client per thread.
    """

    def __init__(
        self, url: Union[str, Sequence[str], None] = None,
        timeout: float = DEFAULT_TIMEOUT_SECONDS,
        token: Optional[str] = None,
    ) -> None:
        if (
            isinstance(timeout, bool)
            or not isinstance(timeout, (int, float))
            or not (math.isfinite(timeout) and timeout > 0)
        ):
            raise ValueError(f"timeout must be a number of seconds > 0, got {timeout!r}")
        self.timeout = float(timeout)
        if token is not None:
            # The caller's own argument: refuse a bad one here, at start-up.
            self._token: Optional[str] = _check_token(token)
        else:
            self._token = _token_from_environment()
        if url is not None:
            urls = _split_urls(url) if isinstance(url, str) else [u.strip() for u in url]
            if not urls:
                raise ValueError(f"url names no daemon: {url!r}")
            # The caller's own argument: a typo should fail here, at start-up.
            self._endpoints = [Endpoint(u, self.timeout, self._token) for u in urls]
        else:
            self._endpoints = self._endpoints_from_environment()
        self.last_error: Optional[str] = None
        # URLs whose part of the last expiry() was not a current deadline (no answer, or a
        # stale answer without one): the caller should take the result as last known.
        self.degraded_urls: tuple[str, ...] = ()
        self._failing: tuple[str, ...] = ()  # for logging once per change
        self._warned_partial = False
        self._events: Optional[EventSender] = None  # started by the first send_event()

    def _endpoints_from_environment(self) -> list[Endpoint]:
        endpoints = []
        for candidate in _split_urls(os.environ.get(ENV_URL, "")):
            try:
                endpoints.append(Endpoint(candidate, self.timeout, self._token))
            except ValueError as exc:
                # The environment is outside data: never crash the training loop on it.
                logger.warning("ignoring %s entry: %s", ENV_URL, exc)
        return endpoints or [Endpoint(DEFAULT_URL, self.timeout, self._token)]

    @property
    def urls(self) -> tuple[str, ...]:
        return tuple(endpoint.url for endpoint in self._endpoints)

    def expiry(self) -> Optional[Expiry]:
        """``GET /v1/expiry`` from every URL; the answer with the earliest deadline.

        None when no daemon answered properly; ``last_error`` then says why (one line
        per failed URL, joined by "; "). ``last_error`` is also set when some URLs
        answered and others did not (logged once per change of the failing set), and is
        None when all answered.

        Each URL's last deadline is kept while that daemon gives nothing newer: while it
        fails, and while it answers stale without a deadline (a daemon restarted without
        its state file while the cloud API fails). A node that stops answering is still
        released on time, so its deadline stays in the MIN. Such a kept deadline comes
        back as that daemon's last answer marked ``stale``, with ``error`` saying why,
        and its URL is listed in ``degraded_urls``. A fresh answer without a deadline
        ("nothing scheduled") forgets it.
        """
        answered: list[Expiry] = []
        candidates: list[Expiry] = []
        errors: list[str] = []
        failing: list[str] = []
        degraded: list[str] = []
        for endpoint in self._endpoints:
            try:
                answer = endpoint.expiry()
            except FetchError as exc:
                why = str(exc)
            except Exception as exc:  # never into the training loop, whatever it was
                endpoint.close()
                why = f"{endpoint.url}: {describe_error(exc, self.timeout)}"
            else:
                answered.append(answer)
                if answer.expires_at_unix is not None:
                    endpoint.known = answer
                elif not answer.stale:
                    endpoint.known = None  # the daemon says, freshly: nothing scheduled
                else:
                    degraded.append(endpoint.url)
                    if endpoint.known is not None:
                        reason = f"stale answer without a deadline ({answer.error})"
                        candidates.append(_kept(endpoint.known, f"{endpoint.url}: {reason}"))
                        continue
                candidates.append(answer)
                continue
            errors.append(why)
            failing.append(endpoint.url)
            degraded.append(endpoint.url)
            if endpoint.known is not None:
                candidates.append(_kept(endpoint.known, why))
        self.last_error = "; ".join(errors) or None
        self.degraded_urls = tuple(degraded)
        self._log_failing(tuple(failing), any_answered=bool(answered))
        if not answered:
            return None
        # The earliest deadline across the daemons (on a tie, the first URL's).
        earliest_one = earliest(_candidate(a, index) for index, a in enumerate(candidates))
        if earliest_one is not None:
            chosen = candidates[int(earliest_one.source)]
        else:
            chosen = next((a for a in answered if a.stale), answered[0])
        if len(self._endpoints) < 2:
            return chosen
        chosen = _with_slowest_upload(chosen, [*answered, *candidates])
        # A drill on any node is the job's drill: the earliest one answered.
        drills = [a.drill for a in answered if a.drill is not None]
        first = earliest(Candidate(float(d["expires_at_unix"]), str(i), DRILL)
                         for i, d in enumerate(drills))
        drill = None if first is None else drills[int(first.source)]
        return chosen if drill is chosen.drill else replace(chosen, drill=drill)

    def _log_failing(self, failing: tuple[str, ...], *, any_answered: bool) -> None:
        """One line per change of the set of daemons that do not answer, while others do.

        When none answers, the caller (the guard) says so; with a single URL there is no
        partial failure.
        """
        if failing == self._failing or len(self._endpoints) < 2:
            return
        self._failing = failing
        if not any_answered:
            self._warned_partial = False  # "unreachable" is the caller's to say
        elif failing:
            self._warned_partial = True
            logger.warning(
                "no answer from %d of %d sidecar daemons (%s); keeping the last known"
                " deadline of each",
                len(failing),
                len(self._endpoints),
                self.last_error,
            )
        elif self._warned_partial:
            self._warned_partial = False
            logger.info("every sidecar daemon answers again (%s)", ", ".join(self.urls))

    def deadline_unix(self) -> Optional[float]:
        """The earliest ``expires_at_unix`` across the daemons, or None (none / no answer)."""
        answer = self.expiry()
        return None if answer is None else answer.expires_at_unix

    def _durable_steps(self) -> Optional[list[Optional[int]]]:
        """``last_durable_step`` of every daemon that uploads (``GET /v1/uploads``); None
        when any daemon did not answer properly (``last_error`` says why)."""
        steps: list[Optional[int]] = []
        errors: list[str] = []
        for endpoint in self._endpoints:
            try:
                body = endpoint.get_json(UPLOADS_PATH)
                if not isinstance(body, dict):
                    raise FetchError(f"{endpoint.url}: bad {UPLOADS_PATH} body")
                if not body.get("enabled"):
                    continue
                step = body.get("last_durable_step")
                if step is not None and (isinstance(step, bool) or not isinstance(step, int)):
                    raise FetchError(f"{endpoint.url}: bad last_durable_step {step!r}")
                steps.append(step)
            except FetchError as exc:
                errors.append(str(exc))
            except Exception as exc:  # never into the training loop, whatever it was
                endpoint.close()
                errors.append(f"{endpoint.url}: {describe_error(exc, self.timeout)}")
        self.last_error = "; ".join(errors) or None
        return None if errors else steps

    def last_durable_step(self) -> Optional[int]:
        """The step of the newest checkpoint the daemon's uploader made durable in storage
        (its remote manifest is written). Never raises.

        With several daemons (one per node, each uploading its own files), the smallest
        among those that upload: a step is durable only when every node's part is. None
        when nothing is durable yet, no daemon uploads, or a daemon did not answer.
        """
        steps = self._durable_steps()
        if not steps or any(step is None for step in steps):
            return None
        return min(step for step in steps if step is not None)

    def is_durable(self, step: int) -> Optional[bool]:
        """Is a checkpoint at ``step`` or newer durable in storage? Never raises.

        True or False when the uploader(s) answered; None when unknown (no daemon
        uploads, or one did not answer). Once a newer checkpoint is durable the uploader
        skips older ones, so this asks "is my progress up to ``step`` safe", not "was
        that exact folder uploaded".
        """
        steps = self._durable_steps()
        if not steps:
            return None
        if any(durable is None for durable in steps):
            return False
        return min(durable for durable in steps if durable is not None) >= step

    def _bodies(self, path: str, key: str) -> Optional[list[Mapping[str, Any]]]:
        """The ``key`` list of every daemon's ``path``; None when none answered it. A
        daemon without the route (an older one) is no error: ``last_error`` is left alone."""
        items: list[Mapping[str, Any]] = []
        answered = False
        for endpoint in self._endpoints:
            try:
                body = endpoint.get_json(path)
            except Exception:
                continue
            listed = body.get(key) if isinstance(body, dict) else None
            if isinstance(listed, list):
                answered = True
                items.extend(item for item in listed if isinstance(item, Mapping))
        return items if answered else None

    def source_notices(self) -> Optional[dict[str, Optional[float]]]:
        """Each running source's notice in seconds (None: a time known far ahead), from
        ``GET /v1/protection`` on every daemon (the shortest per source); None when no
        daemon answered it. Never raises."""
        sources = self._bodies(PROTECTION_PATH, "sources")
        if sources is None:
            return None
        notices: dict[str, Optional[float]] = {}
        for item in sources:
            name, notice = item.get("source"), item.get("notice_seconds")
            if not isinstance(name, str) or isinstance(notice, bool) or not (
                    notice is None or (isinstance(notice, (int, float)) and notice > 0)):
                continue
            known = notices.get(name)
            if notice is None:
                notices.setdefault(name, None)
            else:  # a short notice on any node is the job's
                notices[name] = float(notice) if known is None else min(known, float(notice))
        return notices

    def machine_lives(self) -> Optional[list[float]]:
        """How long each machine the daemons saw released themselves had run (seconds),
        from ``GET /v1/reclaims``'s ``releases_seen``; None when no daemon answered it.
        Never the accounts: any local process can post those (issue 35, item 7). Never
        raises."""
        seen = self._bodies(RECLAIMS_PATH, "releases_seen")
        if seen is None:
            return None
        lives = []
        for item in seen:
            life = item.get("life_seconds")
            if isinstance(life, (int, float)) and not isinstance(life, bool) and life > 0:
                lives.append(float(life))
        return lives

    def send_event(self, event: Mapping[str, Any]) -> None:
        """Queue a job event for this node's daemon (``POST /v1/events``) and return at
        once: a background thread sends it, one request at a time within ``timeout``, so
        a slow or dead daemon never delays the caller. Never raises; an event that cannot
        be sent is dropped and counted in :attr:`events_dropped`. Safe from any thread.

        One daemon gets the events, this node's own: the first URL on loopback, else
        the first URL (list this node's daemon first). Its history is this node's; with
        several daemons the others are still asked for their deadlines, as before."""
        try:
            sender = self._events
            if sender is None:
                own = next((e for e in self._endpoints if e.on_loopback), self._endpoints[0])
                sender = self._events = EventSender(own.url, self.timeout, self._token)
            sender.put(dict(event))
        except Exception:  # never into the training loop, whatever it was
            pass

    @property
    def events_sent(self) -> int:
        """Events the daemon accepted (202) so far."""
        return 0 if self._events is None else self._events.sent

    @property
    def events_dropped(self) -> int:
        """Events never sent: the queue was full, the request failed, or the daemon has no
        ``/v1/events``."""
        return 0 if self._events is None else self._events.dropped

    def close(self) -> None:
        """Close the connections; send the queued events first (within two timeouts)."""
        if self._events is not None:
            self._events.close()
        for endpoint in self._endpoints:
            endpoint.close()

    def __enter__(self) -> SidecarClient:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"SidecarClient(url={','.join(self.urls)!r}, timeout={self.timeout!r})"
