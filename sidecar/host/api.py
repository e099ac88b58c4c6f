"""The local HTTP API: ``create_app(store)`` -> FastAPI. Reads the store, nothing else.

Bodies are serialised with ``json.dumps`` into a plain ``Response``: the training loop may
ask every step, and skipping FastAPI's generic encoder keeps ``/v1/expiry`` close to the
speed of a bare ASGI app. The OpenAPI schema still documents every field.

Handlers are ``async def``: each only copies the store's state under a lock held for
microseconds, and a plain ``def`` would cost a thread-pool hand-off per request (measured:
131 vs 26 us of CPU per request, see docs/benchmarks.md).
"""

from __future__ import annotations

import html
import json
import platform
import time
from collections.abc import Iterable, Mapping
from contextlib import AbstractAsyncContextManager
from typing import Annotated, Any, Callable, Optional

from fastapi import FastAPI, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from prometheus_client import CollectorRegistry, ProcessCollector, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from pydantic import BaseModel

from sidecar import __version__
from sidecar.host.auth import RequireToken
from sidecar.host.features import Part
from sidecar.host.page import CONTENT_SECURITY_POLICY, render_page
from sidecar.host.store import Store, build_expiry, build_health

# The contract's bodies are the shared stdlib dataclasses; FastAPI documents them as-is.
from sidecar.models import Decision, Expiry
from sidecar.train.policy import DEFAULT_REDUNDANT_SECONDS, DEFAULT_SAVE_SECONDS, seed_rule

__all__ = ["create_app", "current_expiry"]

Clock = Callable[[], float]


def current_expiry(store: Store, parts: Iterable[Part], now: float) -> Expiry:
    """The ``/v1/expiry`` body, built in this one place: the store's deadline, then each
    feature's part (the uploader's durability estimate, the fire drill under way)."""
    expiry = store.expiry(now)
    for part in parts:
        if part.expiry is not None:
            expiry = part.expiry(expiry, now)
    return expiry


class HealthBody(BaseModel):
    status: str
    reason: Optional[str] = None
    sources: dict[str, Any] = {}
    skipped: dict[str, str] = {}
    uploads: Optional[dict[str, Any]] = None  # informational: never turns /healthz 503


def _encode(body: Any) -> bytes:
    return json.dumps(body, separators=(",", ":")).encode()


def _json(body: Any, status_code: int = 200) -> Response:
    return Response(
        _encode(body),
        status_code=status_code,
        media_type="application/json",
    )


# A bound on each duration a query may give (about 116 days): their sum stays finite, so
# every answer is valid JSON (1e308 + 1e308 would be Infinity).
MAX_QUERY_SECONDS = 1e7


def _seconds(description: str, default: Any = ...) -> Any:
    return Query(default, ge=0, le=MAX_QUERY_SECONDS, allow_inf_nan=False,
                 description=description)


def create_app(
    store: Store,
    *,
    parts: Optional[Mapping[str, Part]] = None,
    lifespan: Optional[Callable[[FastAPI], AbstractAsyncContextManager[None]]] = None,
    clock: Clock = time.time,
    token: Optional[str] = None,
    writes_need_token: bool = False,
) -> FastAPI:
    """The API over ``store`` and the features built (``parts``, by name:
    ``features.registry.build_features``); with ``token``, peers beyond loopback must send
    it, and with ``writes_need_token`` every write too (``sidecar.host.auth``)."""
    app = FastAPI(
        title="esi-sidecar",
        version=__version__,
        summary="Time left before this machine is released, for training jobs to save in time.",
        lifespan=lifespan,
        # Swagger UI and ReDoc load their JavaScript from a CDN, and a GPU host may have
        # no internet: /docs is a plain page of our own instead (issue 13).
        docs_url=None,
        redoc_url=None,
    )
    app.exception_handler(RequestValidationError)(_invalid_request)
    features = dict(parts or {})

    def served(now: float) -> Expiry:
        return current_expiry(store, features.values(), now)

    def health(now: float) -> tuple[int, dict[str, Any]]:
        return _health_body(store, features, now)

    _add_core_routes(app, served, health, clock)
    for part in features.values():
        if part.routes is not None:
            part.routes(app)
    _add_page_routes(app, store, features, served, health, clock)
    app.add_middleware(_ExpiryFastPath, served=served, clock=clock)
    registry = _registry(store, features, clock)

    @app.get("/metrics", summary="Prometheus metrics", response_class=Response)
    async def metrics() -> Response:
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    app.add_middleware(_HeadAsGet)
    if token is not None:

        def verdict() -> tuple[int, str]:
            current = build_health(store.snapshot(), clock())
            return (200 if current.ok else 503), current.status

        app.add_middleware(RequireToken, token=token, health=verdict,  # outermost
                           writes_need_token=writes_need_token)
    return app


async def _invalid_request(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, RequestValidationError)
    problems = []
    for error in exc.errors():
        where = ".".join(str(part) for part in error.get("loc", ()) if part != "query")
        problems.append(f"{where}: {error.get('msg')}")
    return _json({"error": "; ".join(problems), "detail": exc.errors()}, 422)


def _health_body(store: Store, parts: Mapping[str, Part],
                 now: float) -> tuple[int, dict[str, Any]]:
    snapshot = store.snapshot()  # one read: the verdict and the details agree
    health = build_health(snapshot, now)
    sources = {
        status.name: {
            "last_success_age_seconds": status.age(now),
            "restored": status.restored,
            "error": status.error,
            "consecutive_failures": status.consecutive_failures,
        }
        for status in snapshot.present
    }
    body: dict[str, Any] = {
        "status": health.status, "reason": health.reason, "sources": sources,
        # --source auto: the services not found here, and why (asked again later).
        "skipped": {status.name: status.absent for status in snapshot.sources
                    if status.absent is not None},
    }
    # A feature's part is shown, never judged (the uploads: storage down is not a reason
    # to restart the daemon).
    body.update({name: part.health(now) for name, part in parts.items()
                 if part.health is not None})
    return (200 if health.ok else 503), body


def _add_core_routes(app: FastAPI, served: Callable[[float], Expiry],
                     health: Callable[[float], tuple[int, dict[str, Any]]],
                     clock: Clock) -> None:
    """``/v1/expiry``, ``/v1/decision`` and ``/healthz``."""

    @app.get("/v1/expiry", response_model=Expiry, summary="The earliest known deadline")
    async def expiry() -> Response:
        return _json(served(clock()).to_json())

    @app.get("/v1/decision", response_model=Decision,
             summary="Save now? The fixed rule: save when the time left is at most one step "
             "+ one save (+ its upload) + the margin",
             description="A stateless answer for a job that measures its own step and save "
             "times (verl's rule): save_now is true when 0 < remaining_seconds <= "
             "step_seconds + save_seconds + upload_seconds + redundant_seconds. The guard "
             "in the training process (CheckpointGuard) decides with more: measured "
             "quantiles, routine saves, the upload's progress (docs/save-rule.md).")
    async def decision(
        step_seconds: float = _seconds("longest recent step, seconds"),
        save_seconds: float = _seconds("time one save takes, seconds", DEFAULT_SAVE_SECONDS),
        redundant_seconds: float = _seconds("safety margin, seconds", DEFAULT_REDUNDANT_SECONDS),
    ) -> Response:
        current = served(clock())
        # With the uploader, a save counts once it is durable: local save + upload.
        durable_save = save_seconds + (current.upload_seconds or 0.0)
        save_now, budget = seed_rule(
            current.remaining_seconds, step_seconds, durable_save, redundant_seconds
        )
        return _json(
            {
                "save_now": save_now,
                "remaining_seconds": current.remaining_seconds,
                "budget_seconds": budget,
                "expires_at": current.expires_at,
                "stale": current.stale,
                "upload_seconds": current.upload_seconds,
            }
        )

    @app.get(
        "/healthz",
        response_model=HealthBody,
        summary="200 when the last successful poll is fresh, 503 otherwise",
        responses={503: {"model": HealthBody}},
    )
    async def healthz() -> Response:
        code, body = health(clock())
        return _json(body, code)


def _add_page_routes(app: FastAPI, store: Store, parts: Mapping[str, Part],
                     served: Callable[[float], Expiry],
                     health: Callable[[float], tuple[int, dict[str, Any]]],
                     clock: Clock) -> None:
    """The status page at ``/`` (each feature's body by its name) and ``/docs``."""

    @app.get("/", summary="The status page (HTML): countdown, sources, saves, uploads",
             response_class=Response)
    async def status_page(
        fragment: Annotated[bool, Query(description="only the page's content (its script "
                                         "fetches it every 5 s)")] = False,
    ) -> Response:
        now = clock()
        current = served(now).to_json()
        _code, healthy = health(now)
        bodies: dict[str, Any] = {name: part.page(now, current) for name, part in parts.items()
                  if part.page is not None}
        text = render_page(expiry=current, health=healthy, moves=store.moves(), now=now,
                           fragment=fragment, **bodies)
        return Response(text, media_type="text/html; charset=utf-8", headers={
            "Content-Security-Policy": CONTENT_SECURITY_POLICY, "Cache-Control": "no-store",
            "X-Content-Type-Options": "nosniff", "Referrer-Policy": "no-referrer",
        })

    @app.get("/docs", include_in_schema=False)
    async def docs() -> Response:
        return Response(_endpoints_page(app.openapi()), media_type="text/html")


def _registry(store: Store, parts: Mapping[str, Part], clock: Clock) -> CollectorRegistry:
    """The app's own registry, never prometheus_client's global one: two apps in one
    process (the tests, the demo) each export their own daemon. process_* reads /proc."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_StoreCollector(store, clock))
    registry.register(_BuildInfo())
    ProcessCollector(registry=registry)
    for part in parts.values():
        if part.metrics is not None:
            registry.register(part.metrics)
    return registry


def _endpoints_page(schema: dict[str, Any]) -> str:
    """Every operation of the OpenAPI schema with its query parameters, as one HTML page
    that loads nothing: it works on a host without internet. The schema is /openapi.json."""
    info = schema.get("info", {})
    rows = []
    for path, operations in schema.get("paths", {}).items():
        for method, operation in operations.items():
            parameters = "".join(
                f"<li><code>{html.escape(p['name'])}</code> "
                f"{html.escape(p.get('description', ''))}</li>"
                for p in operation.get("parameters", ()))
            rows.append(
                f"<tr><td><code>{html.escape(method.upper())} {html.escape(path)}</code></td>"
                f"<td>{html.escape(operation.get('summary', ''))}"
                + (f"<br><small>{html.escape(operation['description'])}</small>"
                   if operation.get("description") else "")
                + (f"<ul>{parameters}</ul>" if parameters else "") + "</td></tr>")
    title = html.escape(f"{info.get('title', '')} {info.get('version', '')}")
    return (f"<!doctype html><html><head><meta charset=\"utf-8\"><title>{title}</title>"
            "<meta name=\"viewport\" content=\"width=device-width, initial-scale=1\">"
            f"<style>{_DOCS_STYLE}</style>"
            f"</head><body><h1>{title}</h1><p>{html.escape(info.get('summary', ''))}</p>"
            f"<table>{''.join(rows)}</table>"
            "<p>Schema: <a href=\"/openapi.json\">/openapi.json</a></p></body></html>\n")


# /docs loads nothing (hosts without internet): its few rules inline, readable at 390 px.
_DOCS_STYLE = (
    "body{font:15px/1.5 system-ui,sans-serif;max-width:60rem;margin:1.5rem auto;"
    "padding:0 1rem;color:#1d2330}h1{font-size:1.4rem}"
    "table{border-collapse:collapse;width:100%}td{border-top:1px solid #d8dce3;"
    "padding:.5rem;vertical-align:top;overflow-wrap:anywhere}"
    "td:first-child{white-space:nowrap;width:1%}code{font-size:.9em;background:#f1f3f6;"
    "padding:0 .2em;border-radius:3px}ul{margin:.3rem 0;padding-left:1.2rem}"
    "@media (max-width:40rem){td{display:block;width:auto!important;white-space:normal}"
    "td:first-child{border-top:1px solid #d8dce3;padding-bottom:0}"
    "td+td{border-top:0}}"
)


class _HeadAsGet:
    """HEAD wherever GET is (``curl -I`` and load-balancer probes use it; FastAPI answers
    405 otherwise): the GET's status and headers, no body. An ASGI wrapper rather than a
    second method on each route, so the OpenAPI document keeps one operation per path."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope.get("type") != "http" or scope.get("method") != "HEAD":
            await self.app(scope, receive, send)
            return

        async def without_body(message: Any) -> None:
            if message.get("type") == "http.response.body":
                message = {**message, "body": b""}
            await send(message)

        await self.app({**scope, "method": "GET"}, receive, without_body)


class _ExpiryFastPath:
    """Answers ``GET /v1/expiry`` before routing: it is the one endpoint a training loop
    may ask every step, and the router and dependency machinery cost more than the answer.
    The body is exactly what the routed handler returns (tests compare both)."""

    def __init__(self, app: Any, served: Callable[[float], Expiry], clock: Clock) -> None:
        self.app = app
        self.served = served
        self.clock = clock

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["path"] == "/v1/expiry" and (
            scope["method"] == "GET"
        ):
            body = _encode(self.served(self.clock()).to_json())
            await send({"type": "http.response.start", "status": 200, "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
            ]})
            await send({"type": "http.response.body", "body": body})
            return
        await self.app(scope, receive, send)


class _StoreCollector:
    """Reads the store at scrape time; registered in the app's own registry only."""

    def __init__(self, store: Store, clock: Callable[[], float]) -> None:
        self._store = store
        self._clock = clock

    def collect(self) -> list[Metric]:
        now = self._clock()
        snapshot = self._store.snapshot()  # one read for every metric of this scrape
        current = build_expiry(snapshot, now)
        remaining = GaugeMetricFamily(
            "esi_sidecar_remaining_seconds",
            "Seconds from this scrape to the earliest known deadline, negative once it has "
            "passed: /v1/expiry's remaining_seconds (absent when none is known)",
        )
        deadline = GaugeMetricFamily(
            "esi_sidecar_deadline_timestamp_seconds",
            "Unix time of the earliest known deadline (absent when none is known)",
        )
        if current.expires_at_unix is not None and current.remaining_seconds is not None:
            remaining.add_metric([], current.remaining_seconds)
            deadline.add_metric([], current.expires_at_unix)
        stale = GaugeMetricFamily(
            "esi_sidecar_stale", "1 when a running source's last successful poll by this "
            "process is missing or older than --stale-after (plus the adaptive schedule's "
            "slack): /v1/expiry's stale")
        stale.add_metric([], 1.0 if current.stale else 0.0)
        polls = CounterMetricFamily(
            "esi_sidecar_polls", "Polls since the daemon started, by source and outcome "
            "(ok, error, throttled)", labels=["source", "outcome"]
        )
        last_success = GaugeMetricFamily(
            "esi_sidecar_last_success_timestamp_seconds",
            "Unix time of the source's last successful poll by this process (absent before "
            "one)",
            labels=["source"],
        )
        failures = GaugeMetricFamily(
            "esi_sidecar_consecutive_failures",
            "Failed polls of the source since its last success", labels=["source"]
        )
        running = GaugeMetricFamily(
            "esi_sidecar_source_running",
            "1 for a source that runs, 0 for one --source auto did not find here",
            labels=["source"],
        )
        for status in snapshot.sources:
            running.add_metric([status.name], 0.0 if status.absent is not None else 1.0)
            for outcome, count in status.polls:
                polls.add_metric([status.name, outcome], count)
            if status.observed_at_unix is not None and not status.restored:
                last_success.add_metric([status.name], status.observed_at_unix)
            failures.add_metric([status.name], status.consecutive_failures)
        healthy = GaugeMetricFamily("esi_sidecar_healthy", "1 when /healthz answers 200")
        healthy.add_metric([], 1.0 if build_health(snapshot, now).ok else 0.0)
        return [remaining, deadline, stale, polls, last_success, failures, healthy, running]


class _BuildInfo:
    """``esi_sidecar_build_info{version, python} 1``: which release and Python a host runs
    (joined onto other series with ``* on (instance) group_left(version)``)."""

    def collect(self) -> list[Metric]:
        info = GaugeMetricFamily("esi_sidecar_build_info",
                                 "Always 1: the esi-sidecar version and the Python it runs on",
                                 labels=["version", "python"])
        info.add_metric([__version__, platform.python_version()], 1.0)
        return [info]
