"""Run by test_auth inside a network namespace of its own (``unshare --net``), as root.

The namespace's loopback gets a second address, 10.203.0.1/32, that is not loopback to
the daemon: a peer connecting to it comes from 10.203.0.1, as a container on a bridge
network would. Nothing leaves the namespace. ``esi-sidecar serve`` runs with a token and
listens on 127.0.0.1 and 10.203.0.1; the answers are printed as one JSON object.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from typing import Any, Optional

from sidecar.train.client import SidecarClient

ADDRESS = "10.203.0.1"
TOKEN = "0123456789abcdef0123456789abcdef"


def free_port(host: str) -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def get(url: str, token: Optional[str] = None, method: str = "GET",
        data: Optional[bytes] = None) -> dict[str, Any]:
    request = urllib.request.Request(url, method=method, data=data)
    if token is not None:
        request.add_header("Authorization", token)
    try:
        with urllib.request.urlopen(request, timeout=5) as response:
            body = response.read()
            code, headers = response.status, dict(response.headers)
    except urllib.error.HTTPError as error:
        body, code, headers = error.read(), error.code, dict(error.headers)
    return {"code": code, "body": json.loads(body) if body else None,
            "www_authenticate": headers.get("www-authenticate")}


def main() -> None:
    subprocess.run(["ip", "link", "set", "lo", "up"], check=True)
    subprocess.run(["ip", "addr", "add", f"{ADDRESS}/32", "dev", "lo"], check=True)
    outer, inner = free_port(ADDRESS), free_port("127.0.0.1")
    env = {**os.environ, "ESI_SIDECAR_TOKEN": TOKEN}
    daemon = subprocess.Popen(
        [sys.executable, "-m", "sidecar.cli", "serve", "--source", "static",
         "--expires-at", "2030-01-01T00:00:00Z", "--listen",
         f"127.0.0.1:{inner},{ADDRESS}:{outer}"],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    remote, local = f"http://{ADDRESS}:{outer}", f"http://127.0.0.1:{inner}"
    result: dict[str, Any] = {}
    try:
        limit = time.monotonic() + 30
        while time.monotonic() < limit:
            try:
                if get(local + "/healthz")["code"] == 200:
                    break
            except OSError:
                pass
            time.sleep(0.1)
        result["remote_no_token"] = get(remote + "/v1/expiry")
        result["remote_metrics_no_token"] = get(remote + "/metrics")["code"]
        result["remote_wrong_token"] = get(remote + "/v1/expiry", "Bearer " + "x" * 32)["code"]
        result["remote_basic"] = get(remote + "/v1/expiry", "Basic " + TOKEN)["code"]
        result["remote_token"] = get(remote + "/v1/expiry", "Bearer " + TOKEN)
        result["remote_token_lowercase_scheme"] = get(remote + "/v1/expiry",
                                                      "bearer " + TOKEN)["code"]
        result["remote_healthz_no_token"] = get(remote + "/healthz")
        result["remote_healthz_head"] = get(remote + "/healthz", method="HEAD")["code"]
        result["remote_healthz_token"] = get(remote + "/healthz", "Bearer " + TOKEN)
        result["local_no_token"] = get(local + "/v1/expiry")
        # Job events (POST) through the same wrapper: refused without the token.
        event = json.dumps({"kind": "stop", "job": "netns:1"}).encode()
        result["remote_post_no_token"] = get(remote + "/v1/events", method="POST",
                                             data=event)["code"]
        result["remote_post_token"] = get(remote + "/v1/events", "Bearer " + TOKEN,
                                          method="POST", data=event)["code"]
        sender = SidecarClient(remote, timeout=2, token=TOKEN)
        sender.send_event({"kind": "stop", "job": "netns:2"})
        sender.close()
        result["client_events_sent"] = sender.events_sent
        result["events_jobs"] = [e["job"] for e in get(local + "/v1/events")["body"]["events"]]
        # A fire drill: only loopback or a token holder may start one (no job here: 409).
        drill = json.dumps({"in_seconds": 60}).encode()
        result["remote_drill_no_token"] = get(remote + "/v1/drill", method="POST", data=drill)
        result["remote_drill_token"] = get(remote + "/v1/drill", "Bearer " + TOKEN,
                                           method="POST", data=drill)
        with_token = SidecarClient(remote, timeout=2, token=TOKEN)
        answer = with_token.expiry()
        result["client_token"] = None if answer is None else answer.expires_at_unix
        without = SidecarClient(remote, timeout=2)
        result["client_no_token"] = [without.expiry(), without.last_error]
        os.environ["ESI_SIDECAR_TOKEN"] = TOKEN  # the container's variable
        from_env = SidecarClient(remote, timeout=2).expiry()
        result["client_env_token"] = None if from_env is None else from_env.expires_at_unix
    finally:
        daemon.terminate()
        output, _ = daemon.communicate(timeout=15)
        result["log"] = output
    print(json.dumps(result, default=str))


if __name__ == "__main__":
    main()
