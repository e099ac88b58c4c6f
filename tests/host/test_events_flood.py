"""Job events under attack (issue 22, weak points 1 and 5): one process flooding
``POST /v1/events`` cannot drop another job's saves or take its summary, and a body far over
the bound gets a readable 413, or, beyond what the daemon will read, a closed connection.

The real daemon on loopback for the flood and the bodies; ``EventHistory`` itself, with a
still clock, for the bounds that would take minutes of real time.
"""

from __future__ import annotations

import http.client
import json
import socket
import threading
import time
from typing import Any
from urllib.parse import urlsplit

from daemon_harness import wait_for
from test_events import event, events, metrics, post, static_daemon

from sidecar.host.features.events.history import (
    MAX_DISCARDED_BYTES,
    MAX_TRACKED_JOBS,
    RATE_PER_SECOND,
    SAVE_BURST_EVENTS,
    EventHistory,
    JobEvent,
)

HONEST = "train-honest:7"
FLOOD = "flood:666"


def honest(kind: str, **fields: Any) -> dict[str, Any]:
    return event(kind, job=HONEST, **fields)


def test_a_flood_by_one_job_keeps_the_other_jobs_durable_event_and_summary() -> None:
    with static_daemon() as daemon:
        assert post(daemon.url, [honest("step-estimate", step_seconds=2.0, budget_seconds=90.0),
                                 honest("save-finished", step=120, save="final")])[0] == 202
        answers: list[dict[str, Any]] = []
        heard: list[tuple[float, float]] = []  # (sent, answered) of each request accepted from

        def flood() -> None:  # 5,000 events, 100 a request, as fast as the daemon answers
            for _ in range(50):
                sent = time.monotonic()
                answers.append(post(daemon.url, [event("step-estimate", job=FLOOD)] * 100)[1])
                if answers[-1]["accepted"]:
                    heard.append((sent, time.monotonic()))

        started = time.monotonic()
        flooding = threading.Thread(target=flood)
        flooding.start()
        # The flood has spent its allowance before the honest job's durable event goes.
        wait_for(lambda: events(daemon.url, limit=0)["dropped"]["rate"] > 0, timeout=30)
        durable_sent = time.monotonic()
        durable = post(daemon.url, honest("durable", step=120, save="final", lead_seconds=80.0))
        durable_answered = time.monotonic()
        flooding.join(120)
        elapsed = time.monotonic() - started
        body = events(daemon.url, limit=500)
        values = metrics(daemon.url)
    assert durable == (202, {"accepted": 1, "dropped": 0, "flagged": 0})
    kept = [(e["kind"], e.get("step")) for e in body["events"] if e["job"] == HONEST]
    assert kept == [("durable", 120), ("save-finished", 120), ("step-estimate", None)]
    summary = body["summary"]
    assert summary["job"] == HONEST and summary["state"] == "training"
    assert summary["last_durable_step"] == 120 and summary["last_save_step"] == 120
    assert summary["budget_seconds"] == 90.0  # the flood's estimates are its own
    # Newest heard first (a dropped event is not heard): the flood when the rate let one of
    # its requests in after the honest job's durable event, else the honest job; either
    # when the two overlapped.
    order = [job["job"] for job in body["jobs"]]
    if any(sent > durable_answered for sent, _ in heard):
        assert order == [FLOOD, HONEST]
    elif all(answered < durable_sent for _, answered in heard):
        assert order == [HONEST, FLOOD]
    else:
        assert sorted(order) == sorted([FLOOD, HONEST])
    flood_dropped = sum(a["dropped"] for a in answers)
    assert sum(a["accepted"] for a in answers) + flood_dropped == 5000
    assert sum(a["accepted"] for a in answers) <= 200 + RATE_PER_SECOND * elapsed + 1
    assert values['esi_sidecar_events_dropped_total{reason="rate"}'] == flood_dropped > 4000
    assert values["esi_sidecar_job_last_durable_step"] == 120


def test_a_flood_of_saves_is_bounded_per_job_and_leaves_the_others_alone() -> None:
    history = EventHistory(monotonic=lambda: 0.0)  # no refill: the bursts alone
    history.add([JobEvent(kind="durable", job=HONEST, step=120, save="final")])
    counts = history.add([JobEvent(kind="durable", job=FLOOD, step=step, save="final")
                          for step in range(100)])
    assert counts == {"accepted": SAVE_BURST_EVENTS, "dropped": 100 - SAVE_BURST_EVENTS,
                      "flagged": 0}
    # The saves skip the other buckets: a job past its ordinary rate still saves.
    history.add([JobEvent(kind="step-estimate", job=HONEST)] * 1000)
    assert history.add([JobEvent(kind="save-finished", job=HONEST, step=130,
                                 seconds=1.0)])["accepted"] == 1
    jobs = {job["job"]: job for job in history.body()["jobs"]}
    assert jobs[HONEST]["last_durable_step"] == 120 and jobs[HONEST]["last_save_step"] == 130
    assert jobs[FLOOD]["last_durable_step"] == SAVE_BURST_EVENTS - 1


def test_a_full_history_gives_up_the_events_of_the_job_holding_the_most() -> None:
    history = EventHistory(rate_per_second=1e9, burst=1e9)
    history.add([JobEvent(kind="save-finished", job=HONEST, step=5, seconds=1.0),
                 JobEvent(kind="durable", job=HONEST, step=5, save="final"),
                 JobEvent(kind="waiting", job=HONEST)])
    for _ in range(50):
        history.add([JobEvent(kind="step-estimate", job=FLOOD)] * 100)
    body = history.body(limit=500)
    assert body["history_length"] == 500
    assert [e["kind"] for e in body["events"] if e["job"] == HONEST] == [
        "waiting", "durable", "save-finished"]
    # Within one job, what carries no save goes first.
    history.add([JobEvent(kind="durable", job=FLOOD, step=1, save="final")])
    history.add([JobEvent(kind="step-estimate", job=FLOOD)] * 600)
    kinds = [e["kind"] for e in history.body(limit=500)["events"] if e["job"] == FLOOD]
    assert kinds.count("durable") == 1 and len(kinds) == 497


def test_one_peer_cannot_spread_a_flood_over_many_job_names() -> None:
    history = EventHistory(monotonic=lambda: 0.0)
    answers = [history.add([JobEvent(kind="step-estimate", job=f"name-{index}")], peer="p")
               for index in range(2000)]
    accepted = sum(a["accepted"] for a in answers)
    assert accepted == 4 * 200  # the peer's burst, four jobs' worth
    assert history.add([JobEvent(kind="step-estimate", job="elsewhere")],
                       peer="q")["accepted"] == 1
    assert history.add([JobEvent(kind="durable", job="name-1999", step=3)],
                       peer="p")["accepted"] == 1  # a save skips the peer's bucket too
    jobs = history.body()["jobs"]
    assert len(jobs) == MAX_TRACKED_JOBS  # the least recently heard forgotten
    assert [job["job"] for job in jobs[:2]] == ["name-1999", "elsewhere"]


def test_the_jobs_survive_the_state_file_and_an_older_section_still_loads() -> None:
    history = EventHistory()
    history.add([JobEvent(kind="durable", job=HONEST, step=120, save="final"),
                 JobEvent(kind="step-estimate", job=FLOOD, budget_seconds=3.0)])
    restored = EventHistory()
    restored.load(json.loads(json.dumps(history.dump())))
    now = time.time()
    assert restored.body(now=now)["jobs"] == history.body(now=now)["jobs"]
    assert restored.body()["summary"]["job"] == HONEST
    # A section written before the jobs were kept apart: rebuilt from its history, its
    # summary as its job's.
    older = history.dump()
    del older["jobs"]
    restored = EventHistory()
    restored.load(older)
    assert [job["job"] for job in restored.body()["jobs"]] == [HONEST, FLOOD]
    assert restored.body()["summary"]["last_durable_step"] == 120


# ------------------------------------------------------------------ bodies over the bound


def test_a_10_mb_body_gets_a_readable_413() -> None:
    with static_daemon() as daemon:
        parts = urlsplit(daemon.url)
        connection = http.client.HTTPConnection(parts.hostname, parts.port, timeout=10)
        connection.request("POST", "/v1/events", body=b"[" + b" " * (10 * 2**20) + b"]",
                           headers={"Content-Type": "application/json"})
        response = connection.getresponse()
        answer = json.loads(response.read())
        connection.close()
        # Sent without a length (chunked), read the same way.
        connection = http.client.HTTPConnection(parts.hostname, parts.port, timeout=10)
        connection.request("POST", "/v1/events", body=iter([b" " * 2**20] * 10),
                           encode_chunked=True)
        chunked = connection.getresponse()
        chunked_answer = json.loads(chunked.read())
        connection.close()
        rejected = events(daemon.url)["rejected"]["too-large"]
    assert response.status == 413 and answer["error"] == "body: more than 65536 bytes"
    assert response.getheader("Connection") == "close"
    assert chunked.status == 413 and chunked_answer["error"] == answer["error"]
    assert rejected == 2


def sent_before_the_daemon_closes(url: str, head: bytes, chunk: bytes, total: int) -> int:
    """Send ``head`` then ``chunk`` until ``total`` bytes or the connection breaks; the
    bytes of body sent."""
    parts = urlsplit(url)
    with socket.create_connection((parts.hostname, parts.port), timeout=30) as sock:
        sock.sendall(head)
        sent = 0
        try:
            while sent < total:
                sock.sendall(chunk)
                sent += len(chunk)
        except (BrokenPipeError, ConnectionResetError):
            pass
    return sent


def test_a_100_mb_body_is_closed_without_being_read() -> None:
    total = 100 * 2**20
    with static_daemon() as daemon:
        declared = sent_before_the_daemon_closes(
            daemon.url, b"POST /v1/events HTTP/1.1\r\nHost: x\r\nContent-Length: "
            + str(total).encode() + b"\r\n\r\n", b" " * 2**16, total)
        frame = b"10000\r\n" + b" " * 2**16 + b"\r\n"
        chunked = sent_before_the_daemon_closes(
            daemon.url, b"POST /v1/events HTTP/1.1\r\nHost: x\r\n"
            b"Transfer-Encoding: chunked\r\n\r\n", frame, total)
        wait_for(lambda: events(daemon.url)["rejected"]["too-large"] == 2)
    # What the sockets' buffers hold on loopback is a few MiB: far below the whole body.
    assert declared < total // 2
    assert MAX_DISCARDED_BYTES <= chunked < total // 2
