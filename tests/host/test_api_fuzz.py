"""Schemathesis against the real daemon: every GET operation in its /openapi.json, with
inputs generated from the schema (valid ones, and invalid ones), over HTTP on loopback.

Checked on every answer: no 5xx; a status the schema documents, with the documented
content type, headers and body schema; valid inputs accepted (2xx) and invalid ones
refused (4xx). Bounded: at most EXAMPLES requests per operation and mode, each with a
5 s timeout; no example database (CI derandomizes through hypothesis's own ``ci``
profile, loaded when ``CI`` is set).
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from typing import Any, Optional

import pytest
import requests
import schemathesis
from daemon_harness import RunningDaemon, fetch_json, get_json, serve_daemon, wait_for
from hypothesis import HealthCheck, given, settings
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    negative_data_rejection,
    positive_data_acceptance,
    response_headers_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from sidecar.timeparse import format_rfc3339

EXAMPLES = 50
TIMEOUT_SECONDS = 5.0


def not_a_server_error_but_health(ctx: Any, response: Any, case: Any) -> Optional[bool]:
    """not_a_server_error, except /healthz's documented 503 (starting or degraded, with a
    reason), which is its answer and not a failure."""
    if case.operation.path == "/healthz" and response.status_code == 503:
        body = response.json()
        assert body["status"] in ("starting", "degraded") and body["reason"], body
        return None
    result: Optional[bool] = not_a_server_error(ctx, response, case)
    return result


CONFORMANCE = [not_a_server_error_but_health, status_code_conformance,
               content_type_conformance, response_headers_conformance,
               response_schema_conformance]
CHECKS = {
    GenerationMode.POSITIVE: [*CONFORMANCE, positive_data_acceptance],
    GenerationMode.NEGATIVE: [*CONFORMANCE, negative_data_rejection],
}
# The deadline states whose answers differ: ahead; passed a moment ago (negative
# remaining_seconds); passed long ago (/healthz degraded: a wrong answer or clock).
DEADLINES = {"ahead": 3600.0, "just-passed": -30.0, "long-passed": -600.0}


@pytest.fixture(scope="module", params=list(DEADLINES))
def daemon(request: pytest.FixtureRequest) -> Iterator[RunningDaemon]:
    expires_at = format_rfc3339(time.time() + DEADLINES[request.param])
    with serve_daemon(sources=("static",), expires_at=expires_at) as running:
        # Polled once first: until then /healthz answers 503 "starting".
        wait_for(lambda: (fetch_json(running.url + "/healthz") or (0, {}))[1].get("status")
                 not in (None, "starting"))
        yield running


@pytest.fixture(scope="module")
def schema(daemon: RunningDaemon) -> Any:
    return schemathesis.openapi.from_url(daemon.url + "/openapi.json")


def get_operations(schema: Any) -> list[Any]:
    operations = [result.ok() for result in schema.get_all_operations()]
    return [op for op in operations if op.method.upper() == "GET"]


def test_every_endpoint_of_the_contract_is_in_the_schema(schema: Any) -> None:
    paths = {op.path for op in get_operations(schema)}
    assert {"/v1/expiry", "/v1/decision", "/healthz", "/v1/uploads", "/metrics"} <= paths


def fuzz(operation: Any, mode: GenerationMode, url: str, session: requests.Session) -> int:
    """Run one operation in one mode; the number of requests made."""
    made = 0

    # Shrinking a failure is worth its time; "too slow" would only flag a loaded CI machine
    # (each example is one HTTP request).
    @settings(max_examples=EXAMPLES, deadline=None, database=None,
              suppress_health_check=[HealthCheck.too_slow])
    @given(case=operation.as_strategy(generation_mode=mode))
    def exchange(case: Any) -> None:
        nonlocal made
        made += 1
        case.call_and_validate(base_url=url, session=session, checks=CHECKS[mode],
                               timeout=TIMEOUT_SECONDS)

    exchange()
    return made


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE],
                         ids=["valid", "invalid"])
def test_every_get_operation_answers_as_its_schema_says(
    daemon: RunningDaemon, schema: Any, mode: GenerationMode
) -> None:
    made = {}
    with requests.Session() as session:
        for operation in get_operations(schema):
            if mode is GenerationMode.NEGATIVE and not operation.query:
                continue  # nothing to make invalid
            made[operation.path] = fuzz(operation, mode, daemon.url, session)
    assert made and all(made.values()), made


def admitted(declared: dict[str, Any], value: str) -> bool:
    """Whether a query value written ``value`` fits the parameter schema ``declared``
    (the keywords FastAPI writes for a query parameter)."""
    if "pattern" in declared and not re.search(declared["pattern"], value):
        return False
    if declared.get("type") in ("integer", "number"):
        if not value.isdigit():
            return False
        number = int(value)
        return bool(declared.get("minimum", number) <= number <= declared.get("maximum", number))
    return True


def test_every_events_limit_the_schema_admits_is_taken(
    daemon: RunningDaemon, schema: Any
) -> None:
    (limit,) = [p for p in schema["/v1/events"]["GET"].definition.raw["parameters"]
                if p["name"] == "limit"]
    for value in ("0", "500", "501", "9999"):
        status, _body = get_json(f"{daemon.url}/v1/events?limit={value}")
        assert status == (200 if admitted(limit["schema"], value) else 422), (value, status)
