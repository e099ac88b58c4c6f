"""The seed rule, kept exactly and by name (verl's ``should_save_ckpt_esi``), and the check
every duration a user passes in goes through. Pure, standard library only.

The seed (``verl/utils/checkpoint/checkpoint_manager.py``)::

    save now  when  0 < T_expire - T_now <= T_max_step + T_save + T_redundant

The verl drop-in, the daemon's ``/v1/decision``, ``esi-sidecar check`` and the
simulator's ``verl`` policy use it as it is; ``SavePolicy`` decides with the table of
``sidecar.train.rule`` (docs/save-rule.md), whose ``WINDOW`` row is this window.
"""

from __future__ import annotations

import math
from typing import Optional

__all__ = [
    "DEFAULT_REDUNDANT_SECONDS",
    "DEFAULT_SAVE_SECONDS",
    "check_seconds",
    "seed_rule",
    "verl_rule",
]

# The ESI guide's defaults: a save is assumed to take 60 s, and 120 s are kept in hand.
DEFAULT_SAVE_SECONDS = 60.0
DEFAULT_REDUNDANT_SECONDS = 120.0


def check_seconds(name: str, value: object) -> float:
    """``value`` as a float if it is a finite number of seconds >= 0, else ValueError naming
    ``name``. Shared with ``sidecar.train.client`` and the integrations: one rule for every
    duration a user passes in."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name} must be a number of seconds, got {value!r}")
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")
    return float(value)


def seed_rule(
    remaining_seconds: Optional[float],
    step_seconds: float,
    save_seconds: float,
    redundant_seconds: float,
) -> tuple[bool, float]:
    """The seed rule: save when ``0 < remaining <= step + save + redundant``.

    Returns ``(save_now, budget_seconds)``. No deadline, or one already passed, never
    asks for a save: there is nothing left to save before. The one implementation, used
    by :class:`SavePolicy`, the daemon's ``/v1/decision``, ``esi-sidecar check`` and
    :func:`verl_rule`.
    """
    budget = step_seconds + save_seconds + redundant_seconds
    save_now = remaining_seconds is not None and 0 < remaining_seconds <= budget
    return save_now, budget


def verl_rule(
    remaining_seconds: Optional[float],
    max_steps_duration: float,
    save_ckpt_duration: float,
    redundant_time: float,
) -> bool:
    """verl's ``should_save_ckpt_esi`` (``verl/utils/checkpoint/checkpoint_manager.py``):
    the seed rule, and False while ``max_steps_duration`` is not > 0 (no step measured).
    Stateless: True at every step inside the window. Used by the verl drop-in and the
    simulator's ``verl`` policy."""
    save_now, _budget = seed_rule(
        remaining_seconds, max_steps_duration, save_ckpt_duration, redundant_time
    )
    return max_steps_duration > 0 and save_now


