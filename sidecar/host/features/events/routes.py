"""The job events' HTTP routes: ``POST /v1/events`` (the body read capped, then
validated; docs/events.md) and ``GET /v1/events``, over an :class:`EventHistory`."""

from __future__ import annotations

import json
import time
from typing import Annotated, Any, Callable, Optional

from fastapi import FastAPI, Query, Request
from fastapi.responses import Response
from pydantic import BeforeValidator, Field, TypeAdapter, ValidationError

from sidecar.host.features.events.history import (
    DISCARD_SECONDS,
    MAX_BODY_BYTES,
    MAX_DISCARDED_BYTES,
    MAX_EVENTS_PER_REQUEST,
    MAX_LIMIT,
    EventHistory,
    JobEvent,
    problem_line,
)
from sidecar.host.json_body import read_capped, too_large
from sidecar.host.query import digits

__all__ = ["add_event_routes"]

_ONE = TypeAdapter(JobEvent)
_BATCH = TypeAdapter(Annotated[list[JobEvent], Field(min_length=1,
                                                     max_length=MAX_EVENTS_PER_REQUEST)])


def _refused(status: int, message: str, detail: Optional[list[Any]] = None,
             close: bool = False) -> Response:
    # The shape of the API's other 422s: one line naming the field, then pydantic's list.
    body = {"error": message, "detail": detail or []}
    return Response(json.dumps(body, separators=(",", ":")), status_code=status,
                    media_type="application/json",
                    headers={"Connection": "close"} if close else None)


# Documented by hand: the body is read here, capped, before pydantic sees it (FastAPI's own
# body parameter would read any size first).
_EVENT_SCHEMA = JobEvent.model_json_schema()
_REQUEST_BODY = {
    "required": True,
    "description": "One event object, or a list of 1 to "
                   f"{MAX_EVENTS_PER_REQUEST}; at most {MAX_BODY_BYTES // 1024} KiB",
    "content": {"application/json": {"schema": {"anyOf": [
        _EVENT_SCHEMA,
        {"type": "array", "items": _EVENT_SCHEMA, "minItems": 1,
         "maxItems": MAX_EVENTS_PER_REQUEST},
    ]}}},
}


def add_event_routes(app: FastAPI, history: EventHistory,
                     clock: Callable[[], float] = time.time) -> None:
    """``POST /v1/events`` and ``GET /v1/events`` on ``app`` (docs/events.md)."""
    @app.post("/v1/events", status_code=202, summary="A job's events: kept, never acted on",
              openapi_extra={"requestBody": _REQUEST_BODY},
              responses={413: {"description": "body over 64 KiB"},
                         422: {"description": "an invalid event: the error names the field"}})
    async def post_events(request: Request) -> Response:
        raw = await read_capped(request, MAX_BODY_BYTES, discard_bytes=MAX_DISCARDED_BYTES,
                                discard_seconds=DISCARD_SECONDS)
        if raw is None:
            history.reject("too-large")
            # Closed after the answer: the rest of a body, if any, is never read.
            return _refused(413, too_large(MAX_BODY_BYTES), close=True)
        now = clock()
        batch = raw.lstrip()[:1] == b"["
        try:
            events = (_BATCH if batch else _ONE).validate_json(raw, context={"now": now})
        except ValidationError as exc:
            history.reject("invalid")
            detail = exc.errors(include_url=False, include_input=False, include_context=False)
            problems = "; ".join(problem_line(e) for e in detail[:5])
            return _refused(422, problems, [dict(e) for e in detail[:20]])
        peer = None if request.client is None else request.client.host
        counts = history.add(events if isinstance(events, list) else [events], now, peer)
        return Response(json.dumps(counts, separators=(",", ":")), status_code=202,
                        media_type="application/json")

    @app.get("/v1/events", summary="Job events on this node, newest first, and a summary")
    async def get_events(
        limit: Annotated[int, Query(ge=0, le=MAX_LIMIT, description=(
            f"newest events to list, 0 to {MAX_LIMIT}, written in digits")),
            BeforeValidator(digits)] = 100,
    ) -> Response:
        return Response(json.dumps(history.body(limit, clock()), separators=(",", ":")),
                        media_type="application/json")
