"""The HTTP contract (ARCHITECTURE.md, "HTTP contract (v1)") against the running daemon."""

from __future__ import annotations

import html
import http.client
import json
import time
import urllib.error
import urllib.request
from typing import Any
from urllib.parse import quote, urlsplit

import pytest
from daemon_harness import serve_daemon, wait_for

from sidecar.timeparse import format_rfc3339

CONTRACT_FIELDS = {
    "expires_at", "expires_at_unix", "remaining_seconds", "kind", "source", "instance_id",
    "scheduled_instance_id", "observed_at", "age_seconds", "stale", "error", "server_time_unix",
}


def get(url: str) -> tuple[int, Any, str]:
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return response.status, response.read().decode(), response.headers["Content-Type"]
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode(), exc.headers["Content-Type"]


def get_json(url: str) -> tuple[int, Any]:
    status, body, content_type = get(url)
    assert content_type.startswith("application/json")
    return status, json.loads(body)


def test_expiry_serves_every_contract_field() -> None:
    with serve_daemon(sources=("static",), expires_at="2030-01-01T08:00:00+08:00") as daemon:
        wait_for(lambda: daemon.store.health().ok)
        before = time.time()
        status, body = get_json(daemon.url + "/v1/expiry")
        assert status == 200
        assert set(body) >= CONTRACT_FIELDS
        assert body["expires_at"] == "2030-01-01T00:00:00Z"
        assert body["expires_at_unix"] == 1893456000.0
        assert body["remaining_seconds"] == pytest.approx(1893456000.0 - before, abs=2)
        assert body["remaining_seconds"] == pytest.approx(
            body["expires_at_unix"] - body["server_time_unix"], abs=1e-6)
        assert body["kind"] == "scheduled-release"
        assert body["source"] == "static"
        assert body["stale"] is False and body["error"] is None
        assert 0 <= body["age_seconds"] < 5
        assert body["observed_at"].endswith("Z")


def test_no_deadline_known_is_null_not_an_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MLP_CURRENT_CAPACITY_BLOCK_EXPIRATION_TIMESTAMP", raising=False)
    monkeypatch.delenv("SAGEMAKER_CURRENT_CAPACITY_BLOCK_EXPIRATION_TIMESTAMP", raising=False)
    with serve_daemon(sources=("env",)) as daemon:
        wait_for(lambda: daemon.store.health().ok)
        status, body = get_json(daemon.url + "/v1/expiry")
        assert status == 200
        assert body["expires_at"] is None and body["remaining_seconds"] is None
        assert body["kind"] is None and body["error"] is None and body["stale"] is False
        assert get(daemon.url + "/healthz")[0] == 200


def test_worked_example_from_the_esi_docs() -> None:
    """200 s left, 80 s step, 60 s save, 120 s redundant -> 260 > 200 -> save now."""
    deadline = time.time() + 200
    with serve_daemon(sources=("static",), expires_at=format_rfc3339(deadline)) as daemon:
        wait_for(lambda: daemon.store.health().ok)
        query = "step_seconds=80&save_seconds=60&redundant_seconds=120"
        status, body = get_json(daemon.url + "/v1/decision?" + query)
        assert status == 200
        assert body["save_now"] is True
        assert body["budget_seconds"] == 260
        assert 195 < body["remaining_seconds"] <= 200
        assert body["stale"] is False
        assert body["expires_at"] == format_rfc3339(deadline)
        # Defaults: save 60, redundant 120. A 10 s step gives a 190 s budget: not yet.
        status, body = get_json(daemon.url + "/v1/decision?step_seconds=10")
        assert (body["save_now"], body["budget_seconds"]) == (False, 190)


def test_decision_never_asks_to_save_after_the_deadline() -> None:
    with serve_daemon(sources=("static",), expires_at=format_rfc3339(time.time() - 5)) as daemon:
        wait_for(lambda: daemon.store.health().ok)
        _, body = get_json(daemon.url + "/v1/decision?step_seconds=80")
        assert body["save_now"] is False and body["remaining_seconds"] < 0


def test_a_release_long_past_is_served_with_an_error_and_healthz_degraded() -> None:
    past = time.time() - 600
    with serve_daemon(sources=("static",), expires_at=format_rfc3339(past)) as daemon:
        wait_for(lambda: daemon.store.snapshot().sources[0].observed_at_unix)
        _, body = get_json(daemon.url + "/v1/expiry")
        status, health = get_json(daemon.url + "/healthz")
        _, decision = get_json(daemon.url + "/v1/decision?step_seconds=80")
    assert body["expires_at_unix"] == pytest.approx(past) and body["remaining_seconds"] < -590
    assert "passed" in body["error"] and body["stale"] is False
    assert status == 503 and health["status"] == "degraded" and "passed" in health["reason"]
    assert decision["save_now"] is False and decision["remaining_seconds"] < -590


@pytest.mark.parametrize(
    ("query", "fragment"),
    [
        ("", "step_seconds: Field required"),
        ("step_seconds=abc", "step_seconds"),
        ("step_seconds=-1", "step_seconds"),
        ("step_seconds=nan", "step_seconds: Input should be a finite number"),
        ("step_seconds=inf", "step_seconds"),
        ("step_seconds=1&save_seconds=", "save_seconds"),
        ("step_seconds=1&redundant_seconds=-0.5", "redundant_seconds"),
        # Each finite, their sum not: the answer would hold Infinity, which is not JSON.
        ("step_seconds=1e308&save_seconds=1e308", "step_seconds: Input should be less than"),
        ("step_seconds=1&save_seconds=1e8", "save_seconds: Input should be less than"),
    ],
)
def test_decision_rejects_missing_or_invalid_numbers_with_422(query: str, fragment: str) -> None:
    with serve_daemon(sources=("static",), expires_at="2030-01-01T00:00:00Z") as daemon:
        status, body = get_json(daemon.url + "/v1/decision?" + query)
        assert status == 422
        assert fragment in body["error"]


def test_healthz_starting_then_degraded_then_ok(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MLP_CURRENT_CAPACITY_BLOCK_EXPIRATION_TIMESTAMP", "not-a-time")
    with serve_daemon(sources=("env",), poll_interval=0.1, stale_after=0.5) as daemon:
        status, body = get_json(daemon.url + "/healthz")
        assert status == 503 and body["status"] == "starting"
        wait_for(lambda: get_json(daemon.url + "/healthz")[1]["status"] == "degraded")
        status, body = get_json(daemon.url + "/healthz")
        assert status == 503 and "not-a-time" in body["reason"]
        _, expiry = get_json(daemon.url + "/v1/expiry")
        assert expiry["stale"] is True and "not-a-time" in expiry["error"]

        monkeypatch.setenv("MLP_CURRENT_CAPACITY_BLOCK_EXPIRATION_TIMESTAMP", "1900000000")
        wait_for(lambda: get(daemon.url + "/healthz")[0] == 200, timeout=10)
        _, body = get_json(daemon.url + "/healthz")
        assert body["status"] == "ok" and body["sources"]["env"]["error"] is None


def test_metrics_exposes_remaining_deadline_polls_and_staleness() -> None:
    with serve_daemon(sources=("static",), expires_at="2030-01-01T00:00:00Z") as daemon:
        wait_for(lambda: daemon.store.health().ok)
        status, text, content_type = get(daemon.url + "/metrics")
        assert status == 200 and content_type.startswith("text/plain")
        values = {
            line.split(" ")[0]: float(line.split(" ")[1])
            for line in text.splitlines() if line and not line.startswith("#")
        }
        assert values["esi_sidecar_deadline_timestamp_seconds"] == 1893456000.0
        assert 0 < values["esi_sidecar_remaining_seconds"] < 1893456000.0 - time.time() + 5
        assert values['esi_sidecar_polls_total{outcome="ok",source="static"}'] >= 1
        assert values['esi_sidecar_polls_total{outcome="error",source="static"}'] == 0
        assert values["esi_sidecar_stale"] == 0
        assert values["esi_sidecar_healthy"] == 1
        assert 'esi_sidecar_last_success_timestamp_seconds{source="static"}' in values


def test_openapi_documents_the_endpoints() -> None:
    with serve_daemon(sources=("static",), expires_at="2030-01-01T00:00:00Z") as daemon:
        _, schema = get_json(daemon.url + "/openapi.json")
        assert {"/v1/expiry", "/v1/decision", "/healthz", "/metrics"} <= set(schema["paths"])
        assert "remaining_seconds" in json.dumps(schema["components"])
        status, page, content_type = get(daemon.url + "/docs")
        redoc = get(daemon.url + "/redoc")[0]
    # Hosts may have no internet: the page loads nothing (Swagger UI took its JavaScript
    # and CSS from a CDN), and lists every endpoint with a link to the schema.
    assert status == 200 and content_type.startswith("text/html")
    assert "<script" not in page and "http://" not in page and "https://" not in page
    assert all(path in page for path in schema["paths"]) and 'href="/openapi.json"' in page
    assert "step_seconds" in page  # the query parameters too
    assert redoc == 404  # ReDoc, from the same CDN, is gone


def test_the_docs_page_is_styled_and_names_the_fixed_rule() -> None:
    """Issue 39: /docs was bare HTML and called /v1/decision "the seed rule", a name from
    the project's history that no reader knows."""
    with serve_daemon(sources=("static",), expires_at="2030-01-01T00:00:00Z") as daemon:
        _, schema = get_json(daemon.url + "/openapi.json")
        page = get(daemon.url + "/docs")[1]
    assert "<style>" in page and 'name="viewport"' in page
    decision = schema["paths"]["/v1/decision"]["get"]
    assert "seed rule" not in json.dumps(schema) and "seed rule" not in page
    assert "the fixed rule" in decision["summary"].lower()
    assert "step_seconds + save_seconds + upload_seconds + redundant_seconds" in (
        decision["description"])
    assert html.escape(decision["description"]) in page  # the page explains it too


def test_keep_alive_connection_serves_many_requests() -> None:
    with serve_daemon(sources=("static",), expires_at="2030-01-01T00:00:00Z") as daemon:
        address = urlsplit(daemon.url)
        connection = http.client.HTTPConnection(address.hostname, address.port, timeout=5)
        for _ in range(50):
            connection.request("GET", "/v1/expiry")
            response = connection.getresponse()
            assert response.status == 200
            json.loads(response.read())
        connection.close()


def test_fast_path_answers_exactly_like_the_routed_handler() -> None:
    import asyncio
    from dataclasses import fields

    from fastapi.routing import APIRoute

    from sidecar.host.api import create_app
    from sidecar.host.store import Store
    from sidecar.models import Expiry, Observation

    store = Store(["static"], stale_after=90, clock=lambda: 1000.0)
    store.record_success("static", Observation(expires_at_unix=1900000000.0, kind="k"))
    app = create_app(store, clock=lambda: 1000.0)
    route = next(r for r in app.routes if isinstance(r, APIRoute) and r.path == "/v1/expiry")
    routed = json.loads(asyncio.run(route.endpoint()).body)
    with serve_daemon(sources=("static",), expires_at="2030-01-01T00:00:00Z") as daemon:
        wait_for(lambda: daemon.store.health().ok)
        _, served = get_json(daemon.url + "/v1/expiry")
    assert set(routed) == set(served) == {field.name for field in fields(Expiry)}
    assert routed["expires_at_unix"] == 1900000000.0 and routed["server_time_unix"] == 1000.0


@pytest.mark.parametrize("path", ["/v1/expiry", "/healthz", "/metrics", "/v1/uploads",
                                  "/v1/decision?step_seconds=80"])
def test_head_answers_like_get_without_a_body(path: str) -> None:
    # curl -I and load-balancer probes use HEAD; it used to be a 405.
    with serve_daemon(sources=("static",), expires_at=format_rfc3339(time.time() + 300)) as d:
        wait_for(lambda: d.store.health().ok)
        parts = urlsplit(d.url)
        connection = http.client.HTTPConnection(parts.hostname, parts.port, timeout=5)
        try:
            connection.request("HEAD", path)
            head = connection.getresponse()
            body = head.read()
            connection.request("GET", path)
            got = connection.getresponse()
            got.read()
        finally:
            connection.close()
    assert (head.status, got.status) == (200, 200)
    assert body == b""
    assert head.getheader("content-type") == got.getheader("content-type")


def test_uploads_limit_takes_only_a_plain_whole_number() -> None:
    # The int query used to take what int() takes: "1.0", "1_000", "+5", " 5".
    bad = ["true", "false", "1.0", "1_000", "+5", " 5", "0x10", "5.5", "-1", "", "1001"]
    with serve_daemon(sources=("static",), expires_at="2030-01-01T00:00:00Z") as daemon:
        answers = {value: get_json(daemon.url + "/v1/uploads?limit=" + quote(value))
                   for value in [*bad, "0", "7", "1000"]}
    for value in bad:
        status, body = answers[value]
        assert status == 422, value
        assert body["error"].startswith("limit: "), body
    assert all(answers[value][0] == 200 for value in ("0", "7", "1000"))
