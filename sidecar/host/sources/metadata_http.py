"""Helpers shared by the sources that read a cloud's instance metadata service over HTTP
(aws, gcp, azure): one-line excerpts of what a service answered, and why a probe failed."""

from __future__ import annotations

import json
from typing import Any

import urllib3

__all__ = ["clip", "probe_failure"]


def clip(value: Any, limit: int = 120) -> str:
    """``value`` as one line of at most ``limit`` characters, for an error message."""
    text = value if isinstance(value, str) else json.dumps(value)
    text = " ".join(text.split())
    return text if len(text) <= limit else text[:limit] + "..."


def probe_failure(exc: Exception, timeout: float) -> str:
    """Why a probe's request failed, in a few words."""
    if isinstance(exc, urllib3.exceptions.NewConnectionError):
        return "cannot connect"
    if isinstance(exc, urllib3.exceptions.TimeoutError):
        return f"no answer within {timeout:g} s"
    return type(exc).__name__
