"""The fire drill over HTTP: ``POST``/``GET /v1/drill``, its metrics, and the guards'
reports among the job events handed to the board (docs/drill.md).

Who may start one: a process on this host (loopback), or a peer with the daemon's token
(the token middleware, ``sidecar.host.auth``, already turned the others away; checked here
again, so that no wiring mistake opens drills to the network).
"""

from __future__ import annotations

import hmac
import json
import math
from collections.abc import Iterable
from typing import Any, Callable, Optional

from fastapi import FastAPI, Request
from fastapi.responses import Response
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from sidecar.host.auth import is_loopback
from sidecar.host.features.drills.board import RESULTS, DrillBoard, DrillRefused
from sidecar.host.features.events import EventHistory, JobEvent
from sidecar.host.json_body import BodyRefused, json_object, read_json_body

__all__ = ["DrillCollector", "add_drill_routes", "report_drills"]

MAX_BODY_BYTES = 4096

RealDeadline = Callable[[float], Optional[float]]  # now -> the earliest real deadline


def report_drills(board: DrillBoard, events: Iterable[JobEvent], now: float) -> None:
    """Each guard's ``"drill"`` report among the job events posted, handed to the board
    (an ``EventHistory`` listener)."""
    for event in events:
        if event.kind == "drill" and event.drill is not None:
            board.report(event.drill, job=event.job, rank=event.rank,
                         step=event.step, reason=event.reason, now=now)


def _answer(body: Any, status: int = 200) -> Response:
    return Response(json.dumps(body, separators=(",", ":")), status_code=status,
                    media_type="application/json")


def _refused(status: int, code: str, message: str) -> Response:
    return _answer({"error": message, "reason": code}, status)


def _may_start(request: Request, token: Optional[str]) -> bool:
    peer = None if request.client is None else request.client.host
    if peer is not None and is_loopback(peer):
        return True
    if token is None:
        return False
    scheme, _, credentials = request.headers.get("authorization", "").partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(
        credentials.strip().encode(), token.encode())


def _lead(raw: bytes) -> Optional[float]:
    """``in_seconds`` of the body (None: absent), or ValueError naming the problem."""
    if not raw.strip():
        return None
    body = json_object(raw, {"in_seconds"}, hint=" (send {\"in_seconds\": N} or nothing)")
    lead = body.get("in_seconds")
    if lead is None:
        return None
    if isinstance(lead, bool) or not isinstance(lead, (int, float)) or not math.isfinite(lead):
        raise ValueError(f"in_seconds: not a number of seconds: {lead!r:.40}")
    return float(lead)


def add_drill_routes(app: FastAPI, board: DrillBoard, events: EventHistory,
                     real_deadline: RealDeadline, clock: Callable[[], float],
                     token: Optional[str]) -> None:
    """``POST /v1/drill`` (start one) and ``GET /v1/drill`` (the current and last ones)."""

    @app.post("/v1/drill", status_code=201,
              summary="Start a fire drill: a deadline the job saves for and trains through",
              responses={403: {"description": "neither loopback nor the token"},
                         409: {"description": "refused: a drill runs, a real deadline is "
                               "near, or no job answers (reason says which)"},
                         422: {"description": "a malformed body or a nonsense lead"}})
    async def start_drill(request: Request) -> Response:
        if not _may_start(request, token):
            return _refused(403, "forbidden", "a drill is started from this host (loopback) "
                            "or with Authorization: Bearer <ESI_SIDECAR_TOKEN>")
        try:
            lead = await read_json_body(request, MAX_BODY_BYTES, _lead)
        except BodyRefused as exc:
            return _refused(exc.status, "too-large" if exc.status == 413 else "malformed",
                            exc.message)
        now = clock()
        try:
            drill = board.start(lead, real_deadline=real_deadline(now),
                                jobs=events.body(limit=0, now=now)["jobs"], now=now)
        except DrillRefused as exc:
            return _refused(exc.status, exc.code, exc.message)
        return _answer(drill.to_json(now), 201)

    @app.get("/v1/drill", summary="The fire drill under way, the last ones and their verdicts")
    async def drills() -> Response:
        now = clock()
        return _answer(board.body(real_deadline(now), now))


class DrillCollector:
    """The drills in ``/metrics``, read at scrape time."""

    def __init__(self, board: DrillBoard, clock: Callable[[], float]) -> None:
        self._board = board
        self._clock = clock

    def collect(self) -> list[Metric]:
        counts, last, running = self._board.metrics(self._clock())
        total = CounterMetricFamily("esi_sidecar_drills", "Fire drills decided since the "
                                    "daemon started, by result (pass, fail, no-answer, "
                                    "called-off)", labels=["result"])
        for result in RESULTS:
            total.add_metric([result], counts[result])
        under_way = GaugeMetricFamily("esi_sidecar_drill_running",
                                      "1 while a fire drill waits for its verdict")
        under_way.add_metric([], 1.0 if running else 0.0)
        last_result = GaugeMetricFamily("esi_sidecar_drill_last_result", "1, labelled with the "
                                   "last decided drill's result (absent before one)",
                                   labels=["result"])
        at = GaugeMetricFamily("esi_sidecar_drill_last_timestamp_seconds",
                               "Unix time the last drill was decided (absent before one)")
        lead = GaugeMetricFamily("esi_sidecar_drill_last_lead_seconds", "How long before "
                                 "the last drill's deadline its checkpoint was durable "
                                 "(absent when it was not)")
        if last is not None and last.result is not None and last.decided_at_unix is not None:
            last_result.add_metric([last.result], 1.0)
            at.add_metric([], last.decided_at_unix)
            if last.report.get("lead_seconds") is not None:
                lead.add_metric([], float(last.report["lead_seconds"]))
        return [total, under_way, last_result, at, lead]
