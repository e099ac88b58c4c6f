"""A POST body read as one JSON object with known fields, or ValueError naming the problem."""

from __future__ import annotations

import json
from collections.abc import Collection
from typing import Any

__all__ = ["json_object"]


def json_object(raw: bytes, fields: Collection[str], hint: str = "") -> dict[str, Any]:
    """``raw`` as a JSON object whose keys are all in ``fields``; ``hint`` ends the
    "not JSON" message (what to send instead)."""
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        raise ValueError(f"body: not JSON{hint}") from None
    if not isinstance(body, dict):
        raise ValueError("body: not a JSON object")
    unknown = set(body) - set(fields)
    if unknown:
        raise ValueError(f"body: unknown field(s) {', '.join(sorted(unknown))[:100]}")
    return body
