"""The guard takes a deadline's kind from the daemon (issue 37, item 2): the kind served
as ``deadline_kind`` wins over the daemon's source name; only an older daemon, which
serves none, has its kind guessed from that name (sidecar.train.deadlines.daemon_kind).

The kind shows in the rule: a fallback save (one durable save before the final one, when
that rests on an upload longer than the margin) is made before a machine's deadline and
never before a process's (rule row FALLBACK). The daemons here are canned answers on
127.0.0.1: a real one never serves a kind at odds with its source, nor none at all.
"""

from __future__ import annotations

import http.server
import json
import threading
import time
from collections.abc import Iterator
from typing import Any, Callable, Optional

import pytest
from guard_support import (
    clean_environment,  # noqa: F401  (a fixture)
    good_body,
    simple_guard,
)

from sidecar.train.client import SidecarClient
from sidecar.train.policy import SavePolicy

STEP, SAVE, UPLOAD, MARGIN = 20.0, 60.0, 216.0, 120.0
# Inside the fallback's window: one durable save beyond the final save's budget.
REMAINING = (STEP + SAVE + UPLOAD + MARGIN) + (STEP + SAVE + UPLOAD) - 30.0


class _Answer(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def do_GET(self) -> None:
        body: bytes = self.server.body()  # type: ignore[attr-defined]
        if not self.path.startswith("/v1/expiry"):
            body = b"{}"  # no uploads, no protection, no reclaims: nothing else to say
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def daemon_answering() -> Iterator[Callable[[Callable[[], bytes]], str]]:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Answer)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)
    thread.start()

    def serve(body: Callable[[], bytes]) -> str:
        server.body = body  # type: ignore[attr-defined]
        return f"http://127.0.0.1:{server.server_address[1]}"

    try:
        yield serve
    finally:
        server.shutdown()
        server.server_close()


def expiry(source: str, served: Optional[str]) -> Callable[[], bytes]:
    deadline = time.time() + REMAINING
    fields: dict[str, object] = {"source": source, "expires_at_unix": deadline,
                                 "upload_seconds": UPLOAD, "upload_status": "ok",
                                 "upload_measured": 10}
    if served is not None:
        fields["deadline_kind"] = served

    def body() -> bytes:
        raw = json.loads(good_body(**fields))
        raw["remaining_seconds"] = deadline - time.time()
        return json.dumps(raw).encode()

    return body


@pytest.mark.parametrize(("source", "served", "fallback"), [
    ("slurm", "machine", True),  # the name says a process's; the daemon says the machine's
    ("volcengine-esi", "process", False),  # and the other way round
    ("slurm", None, False),  # an older daemon: the name's guess
    ("volcengine-esi", None, True),
])
def test_the_served_kind_wins_over_the_source_s_name(
        daemon_answering: Callable[[Callable[[], bytes]], str], source: str,
        served: Optional[str], fallback: bool) -> None:
    url = daemon_answering(expiry(source, served))
    guard = simple_guard(SidecarClient(url), policy=SavePolicy(
        save_seconds=SAVE, redundant_seconds=MARGIN, top_up_seconds=None))
    for _ in range(int(3600 / STEP)):  # an hour of work at risk
        guard.record_step(STEP)
    assert guard.should_save() is fallback
    decision = guard.last_decision
    assert decision is not None and decision.fallback is fallback
    assert guard.status().deadline_source == "daemon"
