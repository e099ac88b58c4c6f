"""``GET /v1/reclaims`` and ``POST /v1/reclaims``: the accounts, and the one a restore closes.

``esi-sidecar restore --released-at T`` on the next machine knows when the previous one
went and, from the manifest of the checkpoint it restored, the state the job resumes from.
It posts those facts here (docs/protection.md, "What each reclaim cost"); the account is
made with the one rule (``sidecar.train.reclaim_cost``) and kept in the ledger like the
daemon's own, so ``/v1/reclaims``, ``/metrics`` and the status page show it. Idempotent:
the same release posted again is not counted twice. Who may post: the daemon's usual rule
for writes (loopback, beyond it the token; with ``--writes-need-token`` the token from
loopback too: ``sidecar.host.auth``). A posted account is attributed to its peer, bounded
(422 naming the field, 429 over the rate: ``ReclaimLedger.record``) and never moves the mean
time between reclaims (``sidecar.host.features.reclaims.releases_seen``).
"""

from __future__ import annotations

import json
import math
from dataclasses import replace
from typing import Any, Callable, Optional

from fastapi import FastAPI, Request
from fastapi.responses import Response

from sidecar.host.features.reclaims.ledger import AccountRefused, ReclaimLedger
from sidecar.host.json_body import BodyRefused, json_object, read_json_body
from sidecar.train.reclaim_cost import ReleaseCost, release_cost

__all__ = ["MAX_BODY_BYTES", "add_reclaim_routes", "cost_of_restore"]

MAX_BODY_BYTES = 4096
_FIELDS = {"released_unix", "state_unix", "resumed_step", "checkpoint",
           "restore_started_unix", "restore_finished_unix"}
Brought = Callable[[object], Optional[tuple[float, float]]]


def _answer(body: Any, status: int = 200) -> Response:
    return Response(json.dumps(body, separators=(",", ":")), status_code=status,
                    media_type="application/json")


def cost_of_restore(raw: bytes, now: float,
                    brought: Brought = lambda name: None) -> ReleaseCost:
    """The account a restore posted, or ValueError naming the problem. Idle and redone
    cannot be told apart from the next machine: the time after the state counts as
    redone. The restore's start and end (optional) open the time to resume; when the
    follower brought the ``checkpoint`` the restore found in place, its copy is the
    restore (``brought(name)``: its start and end)."""
    body = json_object(raw, _FIELDS)
    times = {}
    for name in ("released_unix", "state_unix", "restore_started_unix",
                 "restore_finished_unix"):
        value = body.get(name)
        if value is None and name.startswith("restore_"):
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not (
                math.isfinite(value) and 0 < value <= now + 86400):
            raise ValueError(f"{name}: not a Unix time up to a day ahead: {value!r:.40}")
        times[name] = float(value)
    if ("restore_started_unix" in times) != ("restore_finished_unix" in times):
        raise ValueError("restore_started_unix and restore_finished_unix go together")
    if times.get("restore_started_unix", 0.0) > times.get("restore_finished_unix", 0.0):
        raise ValueError("restore_finished_unix: before restore_started_unix")
    if times["state_unix"] > times["released_unix"]:
        raise ValueError("state_unix: after released_unix (the state restored is newer "
                         "than the release)")
    step = body.get("resumed_step")
    if step is not None and (isinstance(step, bool) or not isinstance(step, int) or step < 0):
        raise ValueError(f"resumed_step: not a step: {step!r:.40}")
    released, state = times["released_unix"], times["state_unix"]
    cost = release_cost(released_unix=released, state_unix=state, resumed_step=step,
                        trained=[(state, released)], closed_by="restore")
    window = brought(body.get("checkpoint"))
    if window is None and "restore_started_unix" in times:
        window = (times["restore_started_unix"], times["restore_finished_unix"])
    if window is None:
        return cost
    return replace(cost, restore_started_unix=max(released, window[0]),
                   restore_finished_unix=max(released, window[0], window[1]))


def add_reclaim_routes(app: FastAPI, ledger: ReclaimLedger,
                       clock: Callable[[], float]) -> None:
    """The accounts (GET) and the account of a restore (POST)."""

    @app.get("/v1/reclaims", summary="What each release cost: GPU time lost, idle, "
             "redone, saves (docs/protection.md)")
    async def reclaim_costs() -> Response:
        return _answer(ledger.body())

    @app.post("/v1/reclaims", status_code=201,
              summary="The account of the previous machine's release, from a restore",
              responses={200: {"description": "that release is accounted already"},
                         413: {"description": "a body over 4 KiB"},
                         422: {"description": "a malformed or impossible account"},
                         429: {"description": "too many accounts: try later"}})
    async def close_account(request: Request) -> Response:
        try:
            cost = await read_json_body(
                request, MAX_BODY_BYTES, lambda raw: cost_of_restore(raw, clock(), ledger.brought))
        except BodyRefused as exc:
            return _answer({"error": exc.message}, exc.status)
        peer = "an unknown peer" if request.client is None else request.client.host
        try:
            recorded = ledger.record(cost, f"restore from {peer}")
        except AccountRefused as exc:
            return _answer({"error": str(exc)}, exc.status)
        return _answer({"recorded": recorded, "reclaim": cost.to_json()},
                       201 if recorded else 200)
