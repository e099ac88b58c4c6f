"""Auth beyond loopback: the daemon refuses to listen off loopback without a token, and with
one, peers off loopback must send it; loopback stays open.

The HTTP checks run the real ``esi-sidecar serve`` inside a network namespace made for the
test (``unshare --net``): there a second address on the namespace's loopback device is a
peer that is not loopback, and nothing can leave the namespace.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from sidecar.host.auth import check_exposure, check_token, is_loopback

ROOT = Path(__file__).resolve().parents[2]
TOKEN = "0123456789abcdef0123456789abcdef"


@pytest.mark.parametrize(("host", "expected"), [
    ("127.0.0.1", True), ("127.8.9.10", True), ("::1", True), ("::ffff:127.0.0.1", True),
    ("localhost", True), ("0.0.0.0", False), ("::", False), ("10.203.0.1", False),
    ("172.17.0.1", False), ("::ffff:10.0.0.1", False), ("example.internal", False),
])
def test_what_counts_as_loopback(host: str, expected: bool) -> None:
    assert is_loopback(host) is expected


def test_exposure_names_only_the_addresses_beyond_loopback() -> None:
    why = check_exposure((("127.0.0.1", 1), ("0.0.0.0", 2)), None)
    assert why is not None and why.startswith("--listen 0.0.0.0:2 is beyond loopback")
    assert check_exposure((("127.0.0.1", 1), ("0.0.0.0", 2)), TOKEN) is None
    assert check_exposure((("127.0.0.1", 1),), None) is None
    with pytest.raises(ValueError, match="openssl rand -hex 16"):
        check_token("too-short")


def test_serve_beyond_loopback_without_a_token_stops_with_one_line() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ESI_SIDECAR_")}
    result = subprocess.run(
        [sys.executable, "-m", "sidecar.cli", "serve", "--source", "static",
         "--expires-at", "2030-01-01T00:00:00Z", "--listen", "0.0.0.0:0"],
        env=env, capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert result.returncode != 0
    lines = [line for line in (result.stdout + result.stderr).splitlines() if line.strip()]
    assert len(lines) == 1, lines
    assert "--listen 0.0.0.0:0 is beyond loopback" in lines[0]
    assert "ESI_SIDECAR_TOKEN" in lines[0]


def _namespace_command() -> list[str]:
    if os.geteuid() != 0 or not shutil.which("unshare") or not shutil.which("ip"):
        pytest.skip("needs root, unshare and ip (iproute2) for a network namespace")
    check = Path(__file__).resolve().parents[1] / "support" / "auth_netns_check.py"
    return ["unshare", "--net", sys.executable, str(check)]


def test_peers_beyond_loopback_need_the_token_and_loopback_stays_open() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ESI_SIDECAR_")}
    env["PYTHONPATH"] = str(ROOT)
    done = subprocess.run(_namespace_command(), env=env, capture_output=True, text=True,
                          timeout=120, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.splitlines()[-1])
    log = result["log"]
    # Without the token: 401, and it says how to authenticate; /metrics too.
    assert result["remote_no_token"]["code"] == 401, log
    assert "Bearer" in result["remote_no_token"]["www_authenticate"]
    assert "ESI_SIDECAR_TOKEN" in result["remote_no_token"]["body"]["error"]
    assert result["remote_metrics_no_token"] == 401
    assert result["remote_wrong_token"] == 401
    assert result["remote_basic"] == 401
    # With it (the scheme in any case): the full answer.
    assert result["remote_token"]["code"] == 200
    assert result["remote_token"]["body"]["expires_at"] == "2030-01-01T00:00:00Z"
    assert result["remote_token_lowercase_scheme"] == 200
    # /healthz: the status for a probe without the token, the details with it.
    assert result["remote_healthz_no_token"] == {"code": 200, "body": {"status": "ok"},
                                                 "www_authenticate": None}
    assert result["remote_healthz_head"] == 200
    assert result["remote_healthz_token"]["code"] == 200
    assert "sources" in result["remote_healthz_token"]["body"]
    # Loopback needs none.
    assert result["local_no_token"]["code"] == 200
    # POST /v1/events too: 401 without the token, 202 with it (the client sends it).
    assert result["remote_post_no_token"] == 401
    assert result["remote_post_token"] == 202
    assert result["client_events_sent"] == 1
    assert result["events_jobs"] == ["netns:2", "netns:1"]
    # POST /v1/drill: 401 without the token; with it, the drill's own refusal (no job).
    assert result["remote_drill_no_token"]["code"] == 401
    assert result["remote_drill_token"]["code"] == 409
    assert result["remote_drill_token"]["body"]["reason"] == "no-job"
    # The client sends it (argument or ESI_SIDECAR_TOKEN) and says what a 401 means.
    assert result["client_token"] == 1893456000.0
    assert result["client_env_token"] == 1893456000.0
    answer, error = result["client_no_token"]
    assert answer is None and "HTTP 401" in error and "set ESI_SIDECAR_TOKEN" in error
    assert "peers beyond loopback must send the token" in log
    assert TOKEN not in log
