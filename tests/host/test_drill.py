"""The fire drill on the daemon: ``POST``/``GET /v1/drill`` on the real daemon (port 0),
the drill in ``/v1/expiry`` beside the real deadline, the verdict from a guard's report,
every refusal, and the board's state machine on a clock of its own (no answer, a real
deadline that wins, a failing rank after a passing one)."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any, Optional

import pytest
from daemon_harness import get_json, serve_daemon, wait_for

from sidecar.host.features.drills.board import DrillBoard, DrillRefused, default_lead, verdict_of
from sidecar.host.features.events.drill_report import DrillReport


def post(url: str, body: Any = None, raw: Optional[bytes] = None) -> tuple[int, Any]:
    data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
    request = urllib.request.Request(url, data=data if data is not None else b"",
                                     method="POST",
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=5) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        with exc:
            return exc.code, json.loads(exc.read())


def a_job_trains(url: str, budget: float = 20.0, job: str = "trainer:1") -> None:
    status, _ = post(url + "/v1/events", {"kind": "step-estimate", "job": job,
                                          "step_seconds": 0.1, "save_seconds": 1.0,
                                          "budget_seconds": budget, "remaining_seconds": 3600.0})
    assert status == 202


def static(seconds: float) -> dict[str, Any]:
    return {"sources": ("static",), "expires_at": repr(time.time() + seconds)}


def test_a_drill_is_served_beside_the_real_deadline_and_decided_by_the_guards_report() -> None:
    with serve_daemon(**static(3600)) as daemon:
        wait_for(lambda: daemon.store.health().ok)
        a_job_trains(daemon.url)
        status, drill = post(daemon.url + "/v1/drill", {"in_seconds": 30})
        assert status == 201, drill
        assert drill["id"] == "drill-1" and drill["state"] == "running"
        assert drill["lead_seconds"] == 30.0 and drill["verdict"] is None
        expiry = get_json(daemon.url + "/v1/expiry")[1]
        # The real deadline stays the real one; the drill travels beside it.
        assert expiry["expires_at_unix"] == pytest.approx(time.time() + 3600, abs=30)
        assert expiry["drill"]["id"] == "drill-1"
        assert expiry["drill"]["expires_at_unix"] == drill["expires_at_unix"]
        assert 0 < expiry["drill"]["remaining_seconds"] <= 30
        # The guard's report decides it: PASS, with its figures.
        report = {"kind": "drill", "job": "trainer:1", "step": 41, "drill": {
            "id": "drill-1", "outcome": "durable", "budget_seconds": 20.0,
            "save_seconds": 1.5, "upload_seconds": 3.0, "durable_seconds": 4.5,
            "lead_seconds": 12.5, "remaining_seconds": 17.0}}
        assert post(daemon.url + "/v1/events", report)[0] == 202
        body = get_json(daemon.url + "/v1/drill")[1]
        last = body["drills"][0]
        assert last["verdict"] == "PASS" and last["result"] == "pass", last
        assert last["reason"] == "durable 12.5 s before the drill deadline"
        assert last["figures"]["step"] == 41 and last["figures"]["job"] == "trainer:1"
        assert last["figures"]["upload_seconds"] == 3.0
        assert body["counts"]["pass"] == 1 and body["drill"] is None
        with urllib.request.urlopen(daemon.url + "/metrics", timeout=5) as response:
            metrics = response.read().decode()
        assert 'esi_sidecar_drills_total{result="pass"} 1.0' in metrics
        assert 'esi_sidecar_drill_last_result{result="pass"} 1.0' in metrics
        assert "esi_sidecar_drill_last_lead_seconds 12.5" in metrics
        assert "esi_sidecar_drill_running 0.0" in metrics
        with urllib.request.urlopen(daemon.url + "/", timeout=5) as response:
            page = response.read().decode()
        assert "Fire drills" in page and "drill-1" in page and "PASS" in page
        # The job events keep the guard's report.
        events = get_json(daemon.url + "/v1/events")[1]["events"]
        assert events[0]["kind"] == "drill" and events[0]["drill"]["id"] == "drill-1"
        # A decided drill lets the next one start.
        status, second = post(daemon.url + "/v1/drill", {"in_seconds": 20})
        assert status == 201 and second["id"] == "drill-2"
        assert get_json(daemon.url + "/v1/expiry")[1]["drill"]["id"] == "drill-2"


@pytest.mark.parametrize(("body", "raw", "status", "says"), [
    (None, b"{not json", 422, "body: not JSON"),
    (None, b"[1]", 422, "not a JSON object"),
    ({"in_seconds": 30, "extra": 1}, None, 422, "unknown field(s) extra"),
    ({"in_seconds": "thirty"}, None, 422, "in_seconds: not a number"),
    ({"in_seconds": True}, None, 422, "in_seconds: not a number"),
    ({"in_seconds": -5}, None, 422, "in_seconds must be a number from 1 to 86400"),
    ({"in_seconds": 0.2}, None, 422, "in_seconds must be a number from 1 to 86400"),
    ({"in_seconds": 1e9}, None, 422, "in_seconds must be a number from 1 to 86400"),
    (None, b"x" * 5000, 413, "more than 4096 bytes"),
])
def test_a_malformed_or_nonsense_request_is_refused_naming_the_problem(
    body: Any, raw: Optional[bytes], status: int, says: str,
) -> None:
    with serve_daemon(**static(3600)) as daemon:
        a_job_trains(daemon.url)
        code, answer = post(daemon.url + "/v1/drill", body, raw)
        assert code == status and says in answer["error"], answer
        assert get_json(daemon.url + "/v1/expiry")[1]["drill"] is None


def test_refused_without_a_job_while_one_runs_and_with_a_real_deadline_in_the_window() -> None:
    with serve_daemon(**static(40)) as daemon:
        wait_for(lambda: daemon.store.health().ok)
        code, answer = post(daemon.url + "/v1/drill", {"in_seconds": 5})
        assert code == 409 and answer["reason"] == "no-job", answer
        assert "no job answers this daemon" in answer["error"]
        a_job_trains(daemon.url, budget=12.0)
        # The real deadline (40 s) falls inside a 30 s drill + 30 s grace.
        code, answer = post(daemon.url + "/v1/drill", {"in_seconds": 30})
        assert code == 409 and answer["reason"] == "real-deadline", answer
        assert "falls inside the drill's window" in answer["error"]
    with serve_daemon(**static(3600)) as daemon:
        a_job_trains(daemon.url, budget=12.0)
        code, first = post(daemon.url + "/v1/drill")  # no lead: just over the job's budget
        assert code == 201 and first["lead_seconds"] == 17.0, first
        code, answer = post(daemon.url + "/v1/drill", {"in_seconds": 60})
        assert code == 409 and answer["reason"] == "drill-running"
        assert answer["error"].startswith("drill-1 runs"), answer


def test_a_restart_mid_drill_leaves_no_drill_behind(tmp_path: Path) -> None:
    state = tmp_path / "state.json"
    settings = {**static(3600), "state_file": state}
    with serve_daemon(**settings) as daemon:
        a_job_trains(daemon.url)
        assert post(daemon.url + "/v1/drill", {"in_seconds": 60})[0] == 201
        assert get_json(daemon.url + "/v1/expiry")[1]["drill"] is not None
        wait_for(lambda: state.exists())
    with serve_daemon(**settings) as daemon:
        assert get_json(daemon.url + "/v1/expiry")[1]["drill"] is None
        assert get_json(daemon.url + "/v1/drill")[1]["drills"] == []
        # The job events came back with the state file: the job's word is kept.
        assert get_json(daemon.url + "/v1/events")[1]["jobs"]


# -- the board alone, on a clock of its own ------------------------------------------

JOB = [{"job": "j:1", "state": "training", "last_event_at_unix": 1000.0, "budget_seconds": 50.0}]


def report(outcome: str, **figures: float) -> DrillReport:
    return DrillReport(id="drill-1", outcome=outcome, **figures)


def test_no_report_by_the_deadline_and_the_grace_is_no_answer() -> None:
    board = DrillBoard(grace_seconds=5.0)
    drill = board.start(10.0, real_deadline=None, jobs=JOB, now=1000.0)
    assert board.served(None, 1009.0) is not None
    assert board.served(None, 1010.0) is None  # the deadline passed: no longer served
    assert board.body(None, 1014.0)["drill"]["state"] == "waiting"
    body = board.body(None, 1015.0)
    assert body["drills"][0]["result"] == "no-answer" and body["counts"]["no-answer"] == 1
    assert body["drills"][0]["reason"].startswith("no answer: no job reported")
    assert drill.result == "no-answer"


def test_durable_at_the_drill_deadline_itself_passes_and_each_failure_says_why() -> None:
    assert verdict_of(report("durable", lead_seconds=0.0), None) == (
        "pass", "durable 0.0 s before the drill deadline")
    assert verdict_of(report("durable", lead_seconds=0.5), None)[0] == "pass"
    assert verdict_of(report("no-save"), None) == (
        "fail", "no save was made for the drill deadline")
    assert verdict_of(report("too-late"), "remaining 4.0 s") == (
        "fail", "the lead could not hold a save and its upload: no save started "
        "(remaining 4.0 s)")
    # Durable, but the report gives no figure to place it: a FAIL that says so plainly.
    assert verdict_of(report("durable"), None) == (
        "fail", "durable, but the report says not when: no lead to hold it against")
    assert verdict_of(report("durable", lead_seconds=-2.5), None) == (
        "fail", "durable 2.5 s after the drill deadline")


def test_a_report_for_a_drill_this_board_never_started_changes_nothing() -> None:
    board = DrillBoard()
    board.start(60.0, real_deadline=None, jobs=[{**JOB[0], "last_event_at_unix": 1000.0}],
                now=1000.0)
    before = board.body(None, 1010.0)
    board.report(DrillReport(id="drill-99", outcome="durable", lead_seconds=8.0), job="j:1",
                 rank=0, step=7, reason=None, now=1010.0)
    assert board.body(None, 1010.0) == before


def test_every_reported_drill_is_counted_not_only_the_first_of_its_result() -> None:
    board = DrillBoard()
    for n, (drill_id, now) in enumerate((("drill-1", 1000.0), ("drill-2", 1100.0)), start=1):
        jobs = [{**JOB[0], "last_event_at_unix": now}]
        board.start(60.0, real_deadline=None, jobs=jobs, now=now)
        board.report(DrillReport(id=drill_id, outcome="durable", lead_seconds=8.0), job="j:1",
                     rank=0, step=7, reason=None, now=now + 52.0)
        assert board.body(None, now + 52.0)["counts"]["pass"] == n


def test_every_decided_drill_is_counted_not_only_the_first_of_its_result() -> None:
    board = DrillBoard(grace_seconds=5.0)
    board.start(10.0, real_deadline=None, jobs=JOB, now=1000.0)
    assert board.body(None, 1015.0)["counts"]["no-answer"] == 1
    board.start(10.0, real_deadline=None, jobs=[{**JOB[0], "last_event_at_unix": 1016.0}],
                now=1016.0)
    assert board.body(None, 1031.0)["counts"]["no-answer"] == 2


def test_an_earlier_real_deadline_wins_and_calls_the_drill_off() -> None:
    board = DrillBoard(grace_seconds=5.0)
    board.start(100.0, real_deadline=5000.0, jobs=JOB, now=1000.0)
    assert board.served(5000.0, 1001.0) is not None
    assert board.served(1050.0, 1002.0) is None  # a notice: 48 s away, before the drill
    last = board.body(1050.0, 1002.0)["drills"][0]
    assert last["result"] == "called-off" and last["verdict"] == "FAIL"
    assert "came before the drill's: it wins" in last["reason"]


def test_a_failing_rank_turns_a_pass_into_a_fail_and_reasons_name_what_happened() -> None:
    board = DrillBoard()
    board.start(60.0, real_deadline=None, jobs=JOB, now=1000.0)
    board.report(report("durable", lead_seconds=8.0), job="j:1", rank=0, step=7, reason=None,
                 now=1052.0)
    assert board.body(None, 1052.0)["drills"][0]["verdict"] == "PASS"
    board.report(report("not-durable"), job="j:1", rank=1, step=7, reason="upload uploading",
                 now=1060.0)
    last = board.body(None, 1060.0)["drills"][0]
    assert last["verdict"] == "FAIL" and last["figures"]["rank"] == 1
    assert last["reason"] == ("the checkpoint was not durable by the drill deadline "
                              "(upload uploading)")
    assert board.body(None, 1060.0)["counts"] == {"pass": 0, "fail": 1, "no-answer": 0,
                                                  "called-off": 0}
    board.start(5.0, real_deadline=None, jobs=[{**JOB[0], "last_event_at_unix": 1060.0}],
                now=1061.0)
    board.report(DrillReport(id="drill-2", outcome="too-late"), job="j:1", rank=0, step=None,
                 reason="remaining 4.0 s < 9.0 s for a save and its upload", now=1062.0)
    last = board.body(None, 1062.0)["drills"][0]
    assert last["verdict"] == "FAIL" and "no save started" in last["reason"]
    assert "remaining 4.0 s < 9.0 s" in last["reason"]


def test_the_default_lead_is_just_over_the_budget_and_a_stopped_job_is_no_job() -> None:
    assert default_lead(JOB) == 55  # 50 s + 10 %
    assert default_lead([{**JOB[0], "budget_seconds": 12.0}]) == 17  # + at least 5 s
    assert default_lead([{**JOB[0], "budget_seconds": None}]) is None
    board = DrillBoard()
    with pytest.raises(DrillRefused, match="no job answers"):
        board.start(30.0, real_deadline=None, jobs=[{**JOB[0], "state": "stopped"}],
                    now=1000.0)
    with pytest.raises(DrillRefused, match="no job answers"):
        board.start(30.0, real_deadline=None, jobs=JOB, now=1000.0 + 91)  # silent 91 s
    with pytest.raises(DrillRefused, match="give in_seconds"):
        board.start(None, real_deadline=None, jobs=[{**JOB[0], "budget_seconds": None}],
                    now=1000.0)


def test_a_checkpoint_durable_after_the_drill_deadline_fails_whatever_the_guard_called_it(
) -> None:
    board = DrillBoard()
    board.start(60.0, real_deadline=None, jobs=JOB, now=1000.0)
    board.report(report("durable", lead_seconds=-2.0, remaining_seconds=3.0,
                        durable_seconds=5.0), job="j:1", rank=0, step=7, reason=None,
                 now=1062.0)
    last = board.body(None, 1062.0)["drills"][0]
    assert last["verdict"] == "FAIL" and last["result"] == "fail", last
    assert last["reason"] == "durable 2.0 s after the drill deadline"
    # A report whose lead says "in time" while its save says otherwise (3 s left at the
    # save, durable 5 s after it): the later figure wins.
    board.start(60.0, real_deadline=None, jobs=[{**JOB[0], "last_event_at_unix": 1062.0}],
                now=1063.0)
    board.report(DrillReport(id="drill-2", outcome="durable", lead_seconds=1.0,
                             remaining_seconds=3.0, durable_seconds=5.0),
                 job="j:1", rank=0, step=8, reason=None, now=1070.0)
    last = board.body(None, 1070.0)["drills"][0]
    assert last["verdict"] == "FAIL" and last["reason"] == "durable 2.0 s after the drill deadline"
    # "durable" with no figure to judge it by is no PASS either.
    board.start(60.0, real_deadline=None, jobs=[{**JOB[0], "last_event_at_unix": 1070.0}],
                now=1071.0)
    board.report(DrillReport(id="drill-3", outcome="durable"), job="j:1", rank=0, step=9,
                 reason=None, now=1080.0)
    assert board.body(None, 1080.0)["drills"][0]["verdict"] == "FAIL"
    assert board.body(None, 1080.0)["counts"]["pass"] == 0


def test_the_daemon_fails_a_late_durable_report_sent_over_http() -> None:
    with serve_daemon(**static(3600)) as daemon:
        a_job_trains(daemon.url)
        assert post(daemon.url + "/v1/drill", {"in_seconds": 30})[0] == 201
        late = {"kind": "drill", "job": "trainer:1", "step": 41, "drill": {
            "id": "drill-1", "outcome": "durable", "save_seconds": 1.5,
            "upload_seconds": 31.0, "durable_seconds": 32.5, "lead_seconds": -2.5,
            "remaining_seconds": 30.0}}
        assert post(daemon.url + "/v1/events", late)[0] == 202
        last = get_json(daemon.url + "/v1/drill")[1]["drills"][0]
        assert last["verdict"] == "FAIL" and last["result"] == "fail", last
        assert last["reason"] == "durable 2.5 s after the drill deadline"
        with urllib.request.urlopen(daemon.url + "/metrics", timeout=5) as response:
            assert 'esi_sidecar_drills_total{result="pass"} 0.0' in response.read().decode()


def test_the_first_verdict_stands_against_later_reports_of_the_same_result() -> None:
    """A second rank's PASS (or FAIL after a FAIL) changes nothing: the verdict, its time
    and the figures stay the first report's, and the figures carry only what it said."""
    for outcome, lead, result in (("durable", 8.0, "pass"), ("not-durable", None, "fail")):
        board = DrillBoard()
        board.start(60.0, real_deadline=None, jobs=JOB, now=1000.0)
        board.report(report(outcome, **({} if lead is None else {"lead_seconds": lead})),
                     job="j:1", rank=0, step=7, reason=None, now=1052.0)
        first = board.body(None, 1052.0)["drills"][0]
        board.report(report(outcome, lead_seconds=3.0, save_seconds=2.0), job="j:1", rank=1,
                     step=8, reason=None, now=1055.0)
        last = board.body(None, 1055.0)["drills"][0]
        assert last["result"] == result and last["reason"] == first["reason"]
        assert last["decided_at_unix"] == 1052.0
        assert last["figures"] == {"id": "drill-1", "outcome": outcome, "job": "j:1",
                                   "rank": 0, "step": 7,
                                   **({} if lead is None else {"lead_seconds": lead})}
        assert board.body(None, 1055.0)["counts"][result] == 1
