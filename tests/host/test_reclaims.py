"""What each release cost (issue 24, item 3), with real parts: the daemon with its
uploader to a volume, a real guard training and saving with atomic_checkpoint until the
release, then `esi-sidecar restore --released-at` on the "next machine". The GPU time it
reports matches the simulator's accounting of the same timeline within a second."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from daemon_harness import get_json, serve_daemon, wait_for
from guard_support import closed_port

from sidecar.checkpoint.folders import atomic_checkpoint
from sidecar.host.features.reclaims.ledger import (
    SLACK_SECONDS,
    AccountRefused,
    ReclaimLedger,
    account_from_events,
)
from sidecar.timeparse import format_rfc3339, parse_timestamp
from sidecar.train.reclaim_cost import ReleaseCost, lost_seconds, redone_seconds


def test_an_account_from_events_splits_idle_and_redone() -> None:
    events: list[dict[str, Any]] = [
        {"kind": "step-estimate", "job": "j", "at_unix": 1000.0},
        {"kind": "save-started", "job": "j", "at_unix": 1100.0, "step": 10},
        {"kind": "save-finished", "job": "j", "at_unix": 1110.0, "step": 10, "seconds": 10.0},
        {"kind": "durable", "job": "j", "at_unix": 1115.0, "step": 10},
        {"kind": "save-started", "job": "j", "at_unix": 1150.0, "step": 20},
        {"kind": "save-finished", "job": "j", "at_unix": 1160.0, "step": 20, "seconds": 10.0},
        {"kind": "waiting", "job": "j", "at_unix": 1170.0},
        {"kind": "stop", "job": "j", "at_unix": 1200.0, "released": True},
    ]
    cost = account_from_events(events, uploads=True)  # step 20 never became durable
    assert cost is not None and cost.resumed_step == 10
    assert cost.lost_seconds == 100.0 and cost.idle_seconds == 30.0
    assert cost.redone_seconds == redone_seconds([(1110.0, 1150.0), (1160.0, 1170.0)], 1100.0)
    assert cost.saves == 2 and cost.started_unix == 1000.0
    without = account_from_events(events, uploads=False)  # a local save is durable at once
    assert without is not None and without.resumed_step == 20 and without.lost_seconds == 50.0
    assert account_from_events(events[:-1], uploads=True) is None


def test_the_ledger_keeps_its_accounts_across_a_restart() -> None:
    events = [{"kind": "save-started", "job": "j", "at_unix": 1100.0, "step": 1},
              {"kind": "save-finished", "job": "j", "at_unix": 1101.0, "step": 1, "seconds": 1.0},
              {"kind": "stop", "job": "j", "at_unix": 1200.0, "released": True}]
    ledger = ReclaimLedger()
    cost = account_from_events(events, uploads=False)
    assert cost is not None and ledger.record(cost) and not ledger.record(cost)
    saved = json.loads(json.dumps(ledger.dump()))
    again = ReclaimLedger()
    again.load(saved)
    assert again.body() == ledger.body()
    assert not again.record(cost)  # still accounted once
    broken = ReclaimLedger()
    try:
        broken.load({**saved, "costs": [{"saves": "many"}]})
    except ValueError as exc:
        assert "costs[0]" in str(exc)
    else:
        raise AssertionError("a bad section was loaded")


def account_of(released: float, lost: float) -> ReleaseCost:
    """A restore's account of ``lost`` seconds before a release at ``released``."""
    return ReleaseCost(released_unix=released, state_unix=released - lost, resumed_step=None,
                       lost_seconds=lost, redone_seconds=0.0, idle_seconds=0.0, saves=0,
                       job="j:1")


def test_an_account_longer_than_the_daemon_ran_plus_a_day_is_refused_and_counted() -> None:
    clock = [1_700_000_000.0]
    ledger = ReclaimLedger(clock=lambda: clock[0])
    clock[0] += 3600.0  # the daemon has run an hour: no release it saw cost more than 25 h
    bound = 3600.0 + SLACK_SECONDS

    assert ledger.record(account_of(1_700_003_000.0, bound))  # exactly the bound: kept
    for n, released in enumerate((1_700_003_100.0, 1_700_003_200.0), start=1):
        with pytest.raises(AccountRefused, match="more than this daemon has run") as refused:
            ledger.record(account_of(released, bound + 1.0))
        assert refused.value.status == 422
        assert ledger.body()["refused"] == {"implausible": n, "rate": 0}
    assert ledger.body()["count"] == 1


def test_a_daemon_just_started_allows_a_day_and_not_a_second_more() -> None:
    clock = [1_700_000_000.0]
    ledger = ReclaimLedger(clock=lambda: clock[0])  # asked at the instant it started

    with pytest.raises(AccountRefused, match="more than this daemon has run"):
        ledger.record(account_of(1_699_999_000.0, SLACK_SECONDS + 0.5))
    assert ledger.record(account_of(1_699_999_100.0, SLACK_SECONDS))
    assert ledger.body()["refused"] == {"implausible": 1, "rate": 0}


def test_a_restore_posts_its_account_once_and_a_bad_one_is_refused() -> None:
    import json as _json
    import urllib.error
    import urllib.request

    from daemon_harness import get_json, serve_daemon

    def post(url: str, body: object) -> int:
        request = urllib.request.Request(url + "/v1/reclaims", method="POST",
                                         data=_json.dumps(body).encode())
        try:
            with urllib.request.urlopen(request, timeout=5) as response:
                return int(response.status)
        except urllib.error.HTTPError as exc:
            with exc:
                return int(exc.code)

    with serve_daemon(sources=("static",), expires_at="2030-01-01T00:00:00Z") as daemon:
        account = {"released_unix": 1_700_000_100.0, "state_unix": 1_700_000_000.0,
                   "resumed_step": 12}
        assert post(daemon.url, account) == 201
        assert post(daemon.url, account) == 200  # the same release: not counted twice
        assert post(daemon.url, {**account, "state_unix": "x"}) == 422
        assert post(daemon.url, {**account, "extra": 1}) == 422
        body = get_json(daemon.url + "/v1/reclaims")[1]
    assert body["count"] == 1 and body["lost_seconds_total"] == 100.0
    assert body["reclaims"][0]["closed_by"] == "restore"
    assert body["reclaims"][0]["resumed_step"] == 12


def _restore(volume: Path, into: Path, released: float, url: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "sidecar.cli", "restore", "--from", volume.as_uri(), "--to",
         str(into), "--released-at", format_rfc3339(released), "--url", url],
        capture_output=True, text=True, timeout=60)


def _dead_url() -> str:
    """A loopback URL no daemon listens on."""
    return f"http://127.0.0.1:{closed_port()}"


def test_restore_posts_the_account_to_the_next_machines_daemon_once(tmp_path: Path) -> None:
    checkpoints, volume, fresh = tmp_path / "ckpt", tmp_path / "volume", tmp_path / "next"
    checkpoints.mkdir()
    volume.mkdir()
    # The first machine: its daemon uploads the job's checkpoint to the volume.
    with serve_daemon(sources=("static",), expires_at="2030-01-01T00:00:00Z",
                      upload_from=checkpoints, upload_to=volume.as_uri(),
                      upload_scan_interval=0.2) as first:
        with atomic_checkpoint(checkpoints, 40) as folder:
            (folder / "model.bin").write_bytes(b"x" * 4096)
        wait_for(lambda: list(volume.glob("*/MANIFEST.json")), timeout=20)
        assert get_json(first.url + "/v1/reclaims")[1]["count"] == 0
    manifest = json.loads(next(volume.glob("*/MANIFEST.json")).read_text())
    released = time.time()

    # The next machine: its own daemon, told by the restore what the release cost.
    with serve_daemon(sources=("static",), expires_at="2030-01-01T00:00:00Z") as second:
        restored = _restore(volume, fresh, released, second.url)
        assert restored.returncode == 0, restored.stderr
        assert f"the account is recorded on {second.url}" in restored.stdout, restored.stdout
        again = _restore(volume, fresh, released, second.url)  # the same release again
        assert again.returncode == 0, again.stderr
        assert "accounted already: not counted again" in again.stdout, again.stdout
        body = get_json(second.url + "/v1/reclaims")[1]
    assert body["count"] == 1
    account = body["reclaims"][0]
    assert account["closed_by"] == "restore" and account["resumed_step"] == 40
    state = parse_timestamp(manifest["started_at"]).when.timestamp()
    assert abs(account["lost_seconds"] - lost_seconds(released, state)) < 0.01
    assert (fresh / manifest["name"] / "model.bin").read_bytes() == b"x" * 4096


def test_restore_without_a_daemon_still_restores_and_says_so_in_one_line(
        tmp_path: Path) -> None:
    checkpoints, fresh = tmp_path / "volume", tmp_path / "next"
    with atomic_checkpoint(checkpoints, 7) as folder:
        (folder / "model.bin").write_bytes(b"y" * 100)
    dead = _dead_url()
    restored = _restore(checkpoints, fresh, time.time(), dead)
    assert restored.returncode == 0, restored.stderr
    assert restored.stdout.splitlines()[-1].startswith("the release cost ")
    said = [line for line in restored.stderr.splitlines() if dead in line]
    assert len(said) == 1 and "no daemon to record the account on" in said[0], restored.stderr
    assert list(fresh.glob("*/model.bin"))
