"""``rank N/W: `` before each line of the guard's logger in a job of several ranks.

Standard library only. Every rank of a distributed job logs the same decisions; without
the rank a reader cannot tell whose line is whose. The rank and the world size are read
from ``$RANK`` and ``$WORLD_SIZE`` (torchrun, Lightning and DeepSpeed set both) when a
line is logged; a single process (no world size, or 1) logs its lines as they are.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from typing import Optional

__all__ = ["RankPrefix", "rank_prefix"]


def _number(value: Optional[str]) -> Optional[int]:
    value = (value or "").strip()
    return int(value) if value.isascii() and value.isdigit() and len(value) <= 7 else None


def rank_prefix(environ: Optional[Mapping[str, str]] = None) -> str:
    """``"rank N/W: "`` when the world has more than one rank, else ``""``."""
    environ = os.environ if environ is None else environ
    rank, world = _number(environ.get("RANK")), _number(environ.get("WORLD_SIZE"))
    if rank is None or world is None or world < 2:
        return ""
    return f"rank {rank}/{world}: "


class RankPrefix(logging.Filter):
    """A logger's filter that puts :func:`rank_prefix` before the message; drops nothing."""

    def filter(self, record: logging.LogRecord) -> bool:
        prefix = rank_prefix()
        if prefix and not str(record.msg).startswith(prefix):
            record.msg = prefix + str(record.msg)
        return True
