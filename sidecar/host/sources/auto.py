"""``--source auto``: run every source whose service answers on this machine.

Each candidate is wrapped in a :class:`ProbedSource`. Until its probe finds the service,
a poll asks the probe (a short timeout; every candidate has its own poll thread, so the
probes run in parallel and start-up takes at most one timeout) and raises
:class:`SourceAbsent`, which leaves the source out of the deadline and of health. An
absent service is asked again every ``REPROBE_SECONDS``: a metadata service that was
slow at boot is picked up later rather than missed for good. Once found, the wrapper
polls the real source on its own cadence and never probes again. An optional source
(its traits say so) whose calls are refused for good (:class:`SourceRefused`: the
account may not call the action, the endpoint does not offer it) is skipped the same
way, with the refusal as the reason, and asked again every ``REPROBE_SECONDS``: it adds
to another source, and a policy written for that one must not degrade the daemon
(issue 22, item 7).
"""

from __future__ import annotations

import logging
from typing import Callable, Optional

from sidecar.host.sources.base import Observation, Source, SourceAbsent, SourceRefused

__all__ = ["AUTO", "PROBE_TIMEOUT_SECONDS", "REPROBE_SECONDS", "ProbedSource"]

log = logging.getLogger("sidecar.host.sources.auto")

AUTO = "auto"
# The candidates are the sources whose spec has a probe (registry.auto_candidates).
PROBE_TIMEOUT_SECONDS = 0.8
REPROBE_SECONDS = 60.0


class ProbedSource:
    """A source that runs only once its probe found the service it reads."""

    def __init__(self, name: str, probe: Callable[[], Optional[str]],
                 build: Callable[[], Source], *, optional: bool = False) -> None:
        self.name = name
        self._probe = probe
        self._build = build
        self._optional = optional
        self._source: Optional[Source] = None

    @property
    def found(self) -> bool:
        return self._source is not None

    @property
    def source(self) -> Optional[Source]:
        """The real source once found (the daemon's wiring reaches the azure approver)."""
        return self._source

    @property
    def poll_interval_seconds(self) -> Optional[float]:
        if self._source is None:
            return REPROBE_SECONDS
        return getattr(self._source, "poll_interval_seconds", None)

    def poll(self) -> Observation:
        if self._source is None:
            reason = self._probe()
            if reason is not None:
                raise SourceAbsent(reason, retry_after=REPROBE_SECONDS)
            self._source = self._build()
            log.info("source %s found: its service answers on this machine", self.name)
        if not self._optional:
            return self._source.poll()
        try:
            return self._source.poll()
        except SourceRefused as exc:
            raise SourceAbsent(f"refused: {exc} (asked again every {REPROBE_SECONDS:g} s)",
                               retry_after=REPROBE_SECONDS) from None
