"""The API's one home for request-body checks: a POST body read within its cap (413
beyond it) and parsed as one JSON object with known fields (422 naming the problem: an
unknown field, a body that is not JSON). Used by drills and reclaims; events check their
fields with pydantic and read the body with ``read_capped`` (the rest of a body too large
is drained, within bounds, so the client can read the 413)."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Collection
from typing import TYPE_CHECKING, Any, Callable, Optional, TypeVar

if TYPE_CHECKING:
    from starlette.requests import Request

__all__ = ["BodyRefused", "json_object", "read_capped", "read_json_body", "too_large"]

T = TypeVar("T")


class BodyRefused(Exception):
    """A body refused whole: ``status`` 413 (over the cap) or 422 (malformed)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


def too_large(limit: int) -> str:
    """The 413's message."""
    return f"body: more than {limit} bytes"


async def read_json_body(request: Request, limit: int, parse: Callable[[bytes], T]) -> T:
    """``parse`` of the body of at most ``limit`` bytes (a declared length over it is
    refused before reading); its ValueError becomes BodyRefused(422), a body over the cap
    BodyRefused(413)."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise BodyRefused(413, too_large(limit))
    raw = await request.body()
    if len(raw) > limit:
        raise BodyRefused(413, too_large(limit))
    try:
        return parse(raw)
    except ValueError as exc:
        raise BodyRefused(422, str(exc)) from None


async def read_capped(request: Request, limit: int, *, discard_bytes: int,
                      discard_seconds: float) -> Optional[bytes]:
    """The request body, or None when it is larger than ``limit``: then the rest is read
    and thrown away, up to ``discard_bytes`` within ``discard_seconds``, and no further (a
    declared length over that is not read at all)."""
    declared = request.headers.get("content-length", "")
    stream = request.stream()  # one stream: Starlette's request gives only one
    if declared.isdigit() and int(declared) > limit:
        if int(declared) <= discard_bytes:
            await _discard(stream, 0, discard_bytes, discard_seconds)
        return None
    chunks, size = [], 0
    async for chunk in stream:
        size += len(chunk)
        if size > limit:
            await _discard(stream, size, discard_bytes, discard_seconds)
            return None
        chunks.append(chunk)
    return b"".join(chunks)


async def _discard(stream: AsyncIterator[bytes], size: int, most: int, seconds: float) -> None:
    """Read the rest of the body and drop it, while it stays within the bounds."""
    async def read_rest() -> None:
        nonlocal size
        async for chunk in stream:
            size += len(chunk)
            if size > most:
                return

    with contextlib.suppress(asyncio.TimeoutError):
        await asyncio.wait_for(read_rest(), seconds)


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
