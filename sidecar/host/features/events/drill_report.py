"""What a guard reports on a fire drill: the ``drill`` object of a ``"drill"`` job event.

Part of the event model (``features.events.history``); the drill board
(``features.drills.board``) reads it from the events package. Strict, as every field
of an event: unknown fields and wrong types are refused (docs/drill.md).
"""

from __future__ import annotations

from typing import Annotated, Literal, Optional

from pydantic import BaseModel, ConfigDict, Field

__all__ = ["DRILL_ID_PATTERN", "OUTCOMES", "DrillReport"]

DRILL_ID_PATTERN = r"^drill-[0-9]{1,12}$"
# durable: the drill's checkpoint became durable (the daemon judges it against the
# deadline); not-durable: the drill deadline came first; too-late: the lead could not hold
# a save and its upload, so none was started; no-save: the deadline came and no save
# was asked for it.
OUTCOMES = ("durable", "not-durable", "too-late", "no-save")

_Seconds = Annotated[float, Field(ge=0, le=1e7, allow_inf_nan=False)]
_Signed = Annotated[float, Field(ge=-1e7, le=1e7, allow_inf_nan=False)]


class DrillReport(BaseModel):
    """The guard's figures for one drill, measured on the job's side."""

    model_config = ConfigDict(extra="forbid", strict=True)

    id: Annotated[str, Field(pattern=DRILL_ID_PATTERN)]
    outcome: Literal[OUTCOMES]  # type: ignore[valid-type]
    budget_seconds: Optional[_Seconds] = None  # planned: step + save + upload + margin
    save_seconds: Optional[_Seconds] = None  # the save's blocking part, measured
    upload_seconds: Optional[_Seconds] = None  # from the end of the save until durable
    durable_seconds: Optional[_Seconds] = None  # from the start of the save until durable
    lead_seconds: Optional[_Signed] = None  # how long before the drill deadline it was durable
    remaining_seconds: Optional[_Signed] = None  # left until the drill deadline at the save
