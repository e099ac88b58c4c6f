"""Query values the API takes: a count is written in digits (shared by the endpoints)."""

from __future__ import annotations

import re
from typing import Any

from pydantic_core import PydanticCustomError

__all__ = ["digits"]


def digits(value: Any) -> Any:
    """A count in a query is written in digits: pydantic's int would also take "1.0",
    "1_000", "+5" and " 5" (what int() and float() take), and a client that sent any of
    them meant something else. Use as ``BeforeValidator(digits)`` on an int ``Query``
    with its bounds, so that the OpenAPI schema states them."""
    if isinstance(value, str) and not re.fullmatch(r"[0-9]+", value):
        raise PydanticCustomError("whole_number",
                                  "must be a whole number written in digits, such as 100")
    return value
