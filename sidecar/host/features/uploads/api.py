"""``GET /v1/uploads``: per checkpoint state, and the last durable step (docs/upload.md)."""

from __future__ import annotations

import json
from typing import Annotated, Any, Callable, Optional

from fastapi import FastAPI, Query
from fastapi.responses import Response
from pydantic import BaseModel, BeforeValidator

from sidecar.host.features import UploadsView
from sidecar.host.query import digits

__all__ = ["UploadsBody", "add_upload_routes"]

# Without an uploader (no --upload-to): the same fields, saying so.
DISABLED: dict[str, Any] = {"enabled": False, "status": None, "degraded": False, "error": None,
            "last_durable_step": None, "checkpoints": []}


class UploadsBody(BaseModel):
    """Schema of ``GET /v1/uploads`` (docs/upload.md)."""

    enabled: bool
    status: Optional[str] = None  # ok | uploading | degraded
    degraded: bool = False
    error: Optional[str] = None
    last_durable_step: Optional[int] = None
    last_durable_name: Optional[str] = None
    last_durable_at_unix: Optional[float] = None
    checkpoints: list[dict[str, Any]] = []
    last_probe: Optional[dict[str, float]] = None  # the newest link probe (upload/probe.py)


def add_upload_routes(app: FastAPI, uploads: Optional[UploadsView],
                      clock: Callable[[], float]) -> None:
    @app.get("/v1/uploads", response_model=UploadsBody,
             summary="Checkpoint uploads: per checkpoint state, and the last durable step")
    async def upload_status(
        limit: Annotated[int, Query(ge=0, le=1000, description="newest checkpoints to list"),
                         BeforeValidator(digits)] = 100,
    ) -> Response:
        body = DISABLED if uploads is None else uploads.body(clock(), limit)
        return Response(json.dumps(body, separators=(",", ":")),
                        media_type="application/json")
