"""SIGTERM as a deadline: GCP and Azure preemption, Kubernetes eviction and SLURM's
``--signal`` all end with SIGTERM to the job, and SIGKILL a grace period later.

Standard library only. The handler does no I/O and takes no lock: it records when the
first SIGTERM came, nothing else (a signal handler runs between two bytecodes of
whatever the main thread was doing, the training step included). The guard turns that
into a deadline, ``received + grace``, at its next decision.
"""

from __future__ import annotations

import logging
import signal
import threading
from typing import Any, Callable, Optional

from sidecar.train.deadlines import PROCESS, Candidate, earliest
from sidecar.train.policy import check_seconds

__all__ = ["SigtermDeadline", "with_sigterm"]

logger = logging.getLogger("sidecar.train.guard")


class SigtermDeadline:
    """The time of the first SIGTERM, plus ``grace_seconds``; None before one came."""

    def __init__(self, grace_seconds: float, clock: Callable[[], float]) -> None:
        self.grace_seconds = check_seconds("sigterm_grace_seconds", grace_seconds)
        self._clock = clock
        self.received_at: Optional[float] = None
        #: The handler this one replaced (not called: the default one would end the
        #: process before the save, which is what this is here to prevent).
        self.previous_handler: Any = None
        self.installed = False
        self._said = False

    def install(self) -> bool:
        """Handle SIGTERM from now on. Python only lets the main thread do that: from
        another thread this logs a warning and returns False (the guard then works
        without it)."""
        if threading.current_thread() is not threading.main_thread():
            logger.warning("sigterm_grace_seconds needs the guard to be built in the main "
                           "thread (Python installs signal handlers there only): SIGTERM "
                           "is not watched")
            return False
        self.previous_handler = signal.signal(signal.SIGTERM, self._handle)
        self.installed = True
        return True

    def uninstall(self) -> None:
        """Put the replaced handler back (tests, or a guard that is done)."""
        if self.installed and threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, self.previous_handler)
            self.installed = False

    def _handle(self, signum: int, frame: Any) -> None:
        if self.received_at is None:  # the first one starts the grace period
            self.received_at = self._clock()

    def deadline(self) -> Optional[float]:
        received = self.received_at
        return None if received is None else received + self.grace_seconds

    def earlier(self, held: Optional[Candidate]) -> Optional[Candidate]:
        """The earlier of the deadline ``held`` and the SIGTERM's (source ``"sigterm"``, a
        process's; ``sidecar.train.deadlines.earliest``), said once when it came."""
        term = self.deadline()
        if term is None:
            return held
        if not self._said:
            self._said = True
            logger.warning("SIGTERM received: the machine goes in %.0f s; saving at the next "
                           "decision", max(0.0, term - self._clock()))
        return earliest([held, Candidate(term, "sigterm", PROCESS)])


def with_sigterm(sigterm: Optional[SigtermDeadline],
                 held: Optional[Candidate]) -> Optional[Candidate]:
    """The deadline ``held``, or the SIGTERM's when one is watched and came earlier."""
    return held if sigterm is None else sigterm.earlier(held)
