"""How the daemon's log lines look: syslog priorities under systemd's journal, plain lines
with a timestamp elsewhere.

journald reads a ``<N>`` prefix on each line of a service's stderr as that line's syslog
priority (sd-daemon(3)), so ``journalctl -p warning`` finds poll failures, and it stamps
every line itself, so a second timestamp only takes room (issue 26, item 5). A service's
stderr is the journal when ``$JOURNAL_STREAM`` names its device and inode (systemd.exec(5):
a child that inherited the variable but writes elsewhere must not prefix). Standard
library only: ``serve`` sets logging up before it imports the daemon.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Mapping
from typing import IO, Any, Optional

__all__ = ["JournalFormatter", "configure_logging", "stderr_is_journal", "syslog_priority"]

PLAIN_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
JOURNAL_FORMAT = "%(levelname)s %(name)s: %(message)s"


def syslog_priority(levelno: int) -> int:
    """3 error (and critical: 2), 4 warning, 6 info, 7 debug, as sd-daemon(3) numbers them."""
    if levelno >= logging.CRITICAL:
        return 2
    if levelno >= logging.ERROR:
        return 3
    if levelno >= logging.WARNING:
        return 4
    if levelno >= logging.INFO:
        return 6
    return 7


def stderr_is_journal(environ: Optional[Mapping[str, str]] = None,
                      stream: Optional[IO[Any]] = None) -> bool:
    """True when ``$JOURNAL_STREAM`` (``DEVICE:INODE``, decimal) is ``stream``'s own."""
    environ = os.environ if environ is None else environ
    device, colon, inode = environ.get("JOURNAL_STREAM", "").partition(":")
    if not colon:
        return False
    try:
        status = os.fstat((sys.stderr if stream is None else stream).fileno())
        return (int(device), int(inode)) == (status.st_dev, status.st_ino)
    except (OSError, ValueError, AttributeError):
        return False  # no descriptor (a test's buffer), a closed one, or not numbers


class JournalFormatter(logging.Formatter):
    """Every line of a record (a traceback's too) starts with its priority: journald
    splits the record into lines and would file the rest under the default, info."""

    def format(self, record: logging.LogRecord) -> str:
        prefix = f"<{syslog_priority(record.levelno)}>"
        return "\n".join(prefix + line for line in super().format(record).splitlines())


def configure_logging(level: int | str, *, journal: Optional[bool] = None) -> bool:
    """``logging.basicConfig`` for ``serve``: the journal's format when stderr is the
    journal (``journal`` None: detected), the plain one otherwise. Returns which."""
    journal = stderr_is_journal() if journal is None else journal
    handler = logging.StreamHandler()
    handler.setFormatter(JournalFormatter(JOURNAL_FORMAT) if journal
                         else logging.Formatter(PLAIN_FORMAT))
    logging.basicConfig(level=level, handlers=[handler])
    return journal
