"""``GET /v1/protection``: each running source's verdict (docs/protection.md)."""

from __future__ import annotations

import json
from typing import Callable

from fastapi import FastAPI
from fastapi.responses import Response

from sidecar.host.features.protection.board import ProtectionBoard

__all__ = ["add_protection_routes"]


def add_protection_routes(app: FastAPI, board: ProtectionBoard,
                          clock: Callable[[], float]) -> None:
    @app.get("/v1/protection", summary="Per running source: does its notice hold the "
             "job's step + save + upload? (docs/protection.md)")
    async def protection_verdicts() -> Response:
        return Response(json.dumps(board.body(clock()), separators=(",", ":")),
                        media_type="application/json")
