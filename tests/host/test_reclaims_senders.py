"""Posted accounts are admitted per sender (issue 35, red team of item 7): one bucket for
every sender let any local process spend the allowance and keep an honest restore's
account out (429). Here a peer on one loopback address floods ``POST /v1/reclaims`` on the
real daemon, and a restore's account from another still goes in, attributed to it.
"""

from __future__ import annotations

import http.client
import json
import time
from typing import Any
from urllib.parse import urlsplit

import pytest
from daemon_harness import get_json, serve_daemon

from sidecar.host.features.reclaims.ledger import (
    ACCOUNTS_BURST,
    SENDERS_KEPT,
    AccountRefused,
    ReclaimLedger,
)
from sidecar.train.reclaim_cost import release_cost


def post_from(url: str, source: str, accounts: list[dict[str, Any]]) -> list[int]:
    """POST each account to /v1/reclaims from the loopback address ``source``."""
    where = urlsplit(url)
    connection = http.client.HTTPConnection(where.hostname or "", where.port, timeout=10,
                                            source_address=(source, 0))
    codes = []
    try:
        for account in accounts:
            connection.request("POST", "/v1/reclaims", json.dumps(account),
                               {"Content-Type": "application/json"})
            response = connection.getresponse()
            response.read()
            codes.append(response.status)
    finally:
        connection.close()
    return codes


def test_a_flooding_peer_cannot_keep_an_honest_restores_account_out() -> None:
    with serve_daemon(sources=("static",), expires_at="2030-01-01T00:00:00Z") as daemon:
        now = time.time()
        forged = [{"released_unix": now - 10 - index, "state_unix": now - 20 - index}
                  for index in range(3 * ACCOUNTS_BURST)]
        flood = post_from(daemon.url, "127.0.0.2", forged)
        honest = post_from(daemon.url, "127.0.0.1", [
            {"released_unix": now - 5, "state_unix": now - 600, "resumed_step": 42}])
        body = get_json(daemon.url + "/v1/reclaims")[1]
    assert flood.count(201) == ACCOUNTS_BURST and flood.count(429) == 2 * ACCOUNTS_BURST
    assert honest == [201]
    assert body["reclaims"][0]["posted_by"] == "restore from 127.0.0.1"
    assert body["reclaims"][0]["resumed_step"] == 42


def test_the_job_events_and_each_peer_have_their_own_allowance_for_a_bounded_few() -> None:
    """Accounts the daemon closes from job events (any process posts those, naming any
    job) share one allowance; a restore's peer has its own; a sender forgotten (beyond
    SENDERS_KEPT) comes back with a full one, no more."""
    moment = [0.0]
    ledger = ReclaimLedger(monotonic=lambda: moment[0])
    now = time.time()

    def account(job: str, index: int) -> Any:
        return release_cost(released_unix=now - index, state_unix=now - index - 60,
                            resumed_step=None, trained=[(now - index - 60, now - index)],
                            job=job)

    for index in range(ACCOUNTS_BURST):
        assert ledger.record(account(f"forged-{index}", index))
    with pytest.raises(AccountRefused) as refused:
        ledger.record(account("forged-again", 0))
    assert refused.value.status == 429
    assert ledger.record(account("", 0), "restore from 127.0.0.1")
    for index in range(SENDERS_KEPT):
        ledger.record(account("", index + 1), f"restore from 127.0.1.{index}")
    assert ledger.record(account("forged-again", 0))  # forgotten: a full allowance again
