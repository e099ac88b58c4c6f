"""The margin the save rule keeps before the release, chosen to lose the least.

Moved to :mod:`sidecar.train.estimates` (issue 37: the rule's pure estimates in one
module); the names stay importable from here.
"""

from __future__ import annotations

from sidecar.train.estimates import (
    AUTO,
    DEFAULT_NOTICE_LATENCY_SECONDS,
    FIXED_MARGIN_SECONDS,
    MIN_SAVES,
    MIN_STEPS,
    MarginChoice,
    choose_margin,
    cut_probability,
    margin_for,
    spread,
)

__all__ = [
    "AUTO",
    "DEFAULT_NOTICE_LATENCY_SECONDS",
    "FIXED_MARGIN_SECONDS",
    "MIN_SAVES",
    "MIN_STEPS",
    "MarginChoice",
    "choose_margin",
    "cut_probability",
    "margin_for",
    "spread",
]
