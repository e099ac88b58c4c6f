"""What a local process posts never changes what the daemon observed (issue 35, item 7).

The real daemon on loopback, attacked as a hostile job would: forged release accounts
through ``POST /v1/events``, a flood of ``POST /v1/reclaims``, an impossible account, and
writes without the token where loopback is shared (``--writes-need-token``, the Helm
chart's hostNetwork)."""

from __future__ import annotations

import http.client
import json
import logging
import time
import urllib.error
import urllib.request
from typing import Any, Optional
from urllib.parse import urlsplit

import pytest
from daemon_harness import get_json, serve_daemon, wait_for

from sidecar.host.features.reclaims.ledger import ACCOUNTS_BURST, CLOSED_KEPT, ReclaimLedger
from sidecar.host.settings import ConfigError, load_settings
from sidecar.timeparse import format_rfc3339
from sidecar.train.client import SidecarClient
from sidecar.train.protection import JobFigures
from sidecar.train.reclaim_cost import release_cost
from sidecar.train.routine import measured_reclaim_every, plan_routine

TOKEN = "hostile-posts-test-token-0123456789"
SIX_HOURS = 6 * 3600.0


def post(url: str, path: str, body: object, token: Optional[str] = None) -> tuple[int, Any]:
    headers = {"Content-Type": "application/json"}
    if token is not None:
        headers["Authorization"] = f"Bearer {token}"
    request = urllib.request.Request(url + path, method="POST", headers=headers,
                                     data=json.dumps(body).encode())
    try:
        with urllib.request.urlopen(request, timeout=5) as response:
            return int(response.status), json.loads(response.read() or b"null")
    except urllib.error.HTTPError as exc:
        with exc:
            return int(exc.code), json.loads(exc.read() or b"null")


def forged_release(job: str, now: float, life_seconds: float) -> list[dict[str, Any]]:
    """A job that 'ran' ``life_seconds`` and 'stopped for the release' now."""
    return [{"kind": "save-started", "job": job, "at_unix": now - life_seconds, "step": 1},
            {"kind": "stop", "job": job, "at_unix": now, "released": True}]


def routine_interval(client: SidecarClient) -> float:
    """The routine interval a job with a 35 s save and a 30 s notice gets from the daemon."""
    lives = client.machine_lives()
    assert lives is not None
    job = JobFigures(step_seconds=5.0, save_seconds=35.0, upload_seconds=None)
    plan = plan_routine("auto", {"gcp": 30.0}, job, machine_seconds=lives)
    assert plan.interval_seconds is not None
    return plan.interval_seconds


def test_fifty_forged_release_accounts_do_not_move_the_mean_time_between_reclaims() -> None:
    deadline = time.time() + 2.0
    with serve_daemon(sources=("static",), expires_at=format_rfc3339(deadline)) as daemon:
        client = SidecarClient(daemon.url, timeout=5)
        # The release comes; the honest job stops for it.
        wait_for(lambda: get_json(daemon.url + "/v1/expiry")[1]["remaining_seconds"] <= 0,
                 timeout=30, interval=0.1)
        now = time.time()
        assert post(daemon.url, "/v1/events", forged_release("honest", now, 30.0))[0] == 202
        wait_for(lambda: get_json(daemon.url + "/v1/reclaims")[1]["count"] == 1
                 and client.machine_lives(), timeout=30, interval=0.2)
        honest = client.machine_lives()
        mean = measured_reclaim_every(honest or [], SIX_HOURS)
        interval = routine_interval(client)
        for index in range(25):  # long lives (the mean up) and short ones (down)
            events = forged_release(f"forged-long-{index}", now, 86_000.0)
            assert post(daemon.url, "/v1/events", events)[0] == 202
            events = forged_release(f"forged-short-{index}", now, 60.0)
            assert post(daemon.url, "/v1/events", events)[0] == 202
        # The daemon closes the accounts it will keep (the rest are over the rate).
        body = wait_for(lambda: (b := get_json(daemon.url + "/v1/reclaims")[1])["count"]
                        >= ACCOUNTS_BURST and b, timeout=30, interval=0.2)
        assert client.machine_lives() == honest
        assert measured_reclaim_every(client.machine_lives() or [], SIX_HOURS) == mean
        assert routine_interval(client) == interval
        client.close()
    assert len(body["releases_seen"]) == 1 and body["releases_seen"][0]["source"] == "static"
    assert body["count"] <= ACCOUNTS_BURST + 1  # bounded, whatever was posted
    assert body["refused"]["rate"] >= 1
    assert {a["posted_by"] for a in body["reclaims"]} == {"job events"}


def test_three_thousand_posted_accounts_are_bounded_in_count_and_log_lines(
        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, "sidecar.host.reclaims")
    with serve_daemon(sources=("static",), expires_at="2030-01-01T00:00:00Z") as daemon:
        where = urlsplit(daemon.url)
        connection = http.client.HTTPConnection(where.hostname or "", where.port, timeout=10)
        codes: dict[int, int] = {}
        now = time.time()
        for index in range(3000):
            account = {"released_unix": now - index, "state_unix": now - index - 1800.0,
                       "resumed_step": index}
            connection.request("POST", "/v1/reclaims", json.dumps(account),
                               {"Content-Type": "application/json"})
            response = connection.getresponse()
            response.read()
            codes[response.status] = codes.get(response.status, 0) + 1
        connection.close()
        body = get_json(daemon.url + "/v1/reclaims")[1]
    assert codes.get(201, 0) <= ACCOUNTS_BURST + 1 and codes.get(429, 0) >= 2980, codes
    assert body["count"] == codes[201] and len(body["reclaims"]) == codes[201]
    assert body["lost_seconds_total"] == pytest.approx(1800.0 * codes[201])
    assert body["refused"]["rate"] == codes[429]
    assert body["reclaims"][0]["posted_by"] == "restore from 127.0.0.1"
    lines = [r for r in caplog.records if r.name == "sidecar.host.reclaims"]
    assert len(lines) <= 2, [r.getMessage() for r in lines]


def test_the_remembered_releases_are_trimmed_to_a_bound() -> None:
    clock = [1_700_000_000.0]
    ledger = ReclaimLedger(clock=lambda: clock[0], monotonic=lambda: clock[0])
    for index in range(CLOSED_KEPT + 500):
        clock[0] += 120.0  # past the rate: every account is admitted
        cost = release_cost(released_unix=clock[0], state_unix=clock[0] - 60.0,
                            resumed_step=index, trained=[(clock[0] - 60.0, clock[0])])
        assert ledger.record(cost)
    assert len(ledger.dump()["costs"]) == 50
    assert ledger.remembered() == CLOSED_KEPT


def test_an_account_losing_more_than_the_daemons_uptime_plus_a_day_is_refused() -> None:
    with serve_daemon(sources=("static",), expires_at="2030-01-01T00:00:00Z") as daemon:
        now = time.time()
        code, answer = post(daemon.url, "/v1/reclaims",
                            {"released_unix": now, "state_unix": 1.0, "resumed_step": 1})
        body = get_json(daemon.url + "/v1/reclaims")[1]
    assert code == 422 and answer["error"].startswith("lost_seconds: "), answer
    assert body["count"] == 0 and body["lost_seconds_total"] == 0
    assert body["refused"]["implausible"] == 1


def test_where_loopback_is_shared_a_write_needs_the_token_and_reading_stays_open() -> None:
    with serve_daemon(sources=("static",), expires_at="2030-01-01T00:00:00Z", token=TOKEN,
                      writes_need_token=True) as daemon:
        event = {"kind": "resumed", "job": "hostile"}
        account = {"released_unix": time.time(), "state_unix": time.time() - 60.0}
        assert post(daemon.url, "/v1/events", event)[0] == 401
        assert post(daemon.url, "/v1/reclaims", account)[0] == 401
        assert post(daemon.url, "/v1/drill", {})[0] == 401
        assert post(daemon.url, "/v1/events", event, TOKEN)[0] == 202
        assert get_json(daemon.url + "/v1/expiry")[0] == 200
        assert get_json(daemon.url + "/v1/reclaims")[0] == 200
        jobs = [e["job"] for e in get_json(daemon.url + "/v1/events")[1]["events"]]
    assert jobs == ["hostile"]


def test_writes_need_token_without_a_token_stops_with_one_line() -> None:
    with pytest.raises(ConfigError, match="--writes-need-token needs the token"):
        load_settings({}, {"ESI_SIDECAR_WRITES_NEED_TOKEN": "true",
                           "ESI_SIDECAR_SOURCE": "static",
                           "ESI_SIDECAR_EXPIRES_AT": "2030-01-01T00:00:00Z"})
