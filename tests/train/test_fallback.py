"""The fallback save (sidecar.train.fallback) and the saved upload estimate as a floor while
the daemon's rests on few uploads (sidecar.train.upload_time): pure, no clock, no I/O.

The guard against the real daemon and uploader: tests/train/test_durability.py; the
figures: docs/simulation.md ("Heavy checkpoints").
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import pytest

from sidecar.models import Expiry
from sidecar.train.fallback import AT_RISK_SAVES, fallback_reason
from sidecar.train.policy import SavePolicy
from sidecar.train.upload_time import TRUSTED_UPLOADS, UploadTime
from sidecar.train.vote import Vote

NOW = 1_800_000_000.0
STEP, SAVE, UPLOAD, MARGIN = 20.0, 60.0, 216.0, 120.0
BUDGET = STEP + SAVE + UPLOAD + MARGIN  # 416 s
LEAD = STEP + SAVE + UPLOAD  # 296 s


def reason(remaining: float, *, upload: Optional[float] = UPLOAD, at_risk: float = 7200.0,
           save: float = SAVE, margin: float = MARGIN) -> Optional[str]:
    return fallback_reason(remaining, budget_seconds=STEP + save + (upload or 0.0) + margin,
                           step_seconds=STEP, save_seconds=save, upload_seconds=upload,
                           margin_seconds=margin, at_risk_seconds=at_risk)


def test_the_window_is_one_durable_save_beyond_the_final_budget() -> None:
    assert reason(BUDGET + LEAD + 0.1) is None  # not yet
    line = reason(BUDGET + LEAD)
    assert line is not None and line.startswith(
        f"remaining {BUDGET + LEAD:.1f} s <= {BUDGET + LEAD:.1f} s: fallback save now")
    assert "216 s upload is longer than the 120 s margin" in line and "2.0 h trained" in line
    assert reason(BUDGET + UPLOAD + 0.1) is not None
    # Nearer (a deadline learned or brought forward that late), its upload would still
    # run when the final checkpoint lands: none.
    assert reason(BUDGET + UPLOAD) is None
    assert reason(BUDGET + 1.0) is None


@pytest.mark.parametrize("upload", [None, 0.0, 60.0, MARGIN])
def test_no_fallback_where_the_margin_holds_the_upload(upload: Optional[float]) -> None:
    assert reason(STEP + SAVE + (upload or 0.0) + MARGIN + 1.0, upload=upload) is None


def test_no_fallback_right_after_a_save_however_short() -> None:
    # Ten saves' worth of training at least (600 s with 60 s saves, above the 296 s lead)...
    inside = BUDGET + UPLOAD + 10.0
    assert reason(inside, at_risk=AT_RISK_SAVES * SAVE - 1.0) is None
    assert reason(inside, at_risk=AT_RISK_SAVES * SAVE) is not None
    # ...and at least the lead, with a save of 1 s (ten of them are only 10 s): no second
    # fallback fits in one window.
    lead = STEP + 1.0 + UPLOAD
    inside = STEP + 1.0 + UPLOAD + MARGIN + UPLOAD + 10.0
    assert reason(inside, save=1.0, at_risk=lead - 1.0) is None
    assert reason(inside, save=1.0, at_risk=lead) is not None


def trained(policy: SavePolicy, seconds: float, step: float = STEP) -> None:
    for _ in range(int(seconds // step)):
        policy.record_step(step)


def test_the_policy_makes_one_fallback_then_the_final_save_and_its_top_up() -> None:
    policy = SavePolicy(save_seconds=SAVE, top_up_seconds=5.0)
    trained(policy, 3600.0)
    deadline = NOW + BUDGET + LEAD - 1.0
    fallback = policy.evaluate(NOW, deadline, UPLOAD)
    assert fallback.save_now and fallback.fallback and not fallback.top_up
    assert fallback.budget_seconds == pytest.approx(BUDGET)
    policy.record_save(SAVE, started_unix=NOW, deadline_unix=deadline,
                       budget_seconds=fallback.budget_seconds, fallback=True)
    now = NOW + SAVE
    assert policy.covered_seconds(now) is None  # it covers nothing, not even for now
    assert policy.at_risk_seconds() == 0.0
    after = policy.evaluate(now, deadline, UPLOAD)
    assert not after.save_now and not after.stop and not after.fallback
    while not policy.evaluate(now, deadline, UPLOAD).save_now:
        policy.record_step(STEP)
        now += STEP
    final = policy.evaluate(now, deadline, UPLOAD)
    assert not final.fallback and not final.top_up and deadline - now <= BUDGET
    policy.record_save(SAVE, started_unix=now, deadline_unix=deadline,
                       budget_seconds=final.budget_seconds)
    assert policy.steps_after_final() == 0  # this one is the final save


def test_no_fallback_before_the_process_end() -> None:
    # A SIGTERM grace or a Slurm time limit: one save and leave (the guard passes False).
    policy = SavePolicy(save_seconds=SAVE)
    trained(policy, 3600.0)
    remaining = BUDGET + LEAD - 1.0
    decide = {machine: policy.decide(remaining, step_seconds=STEP, save_seconds=SAVE,
                                     covered_seconds=None, upload_seconds=UPLOAD,
                                     machine_deadline=machine)
              for machine in (True, None, False)}
    assert decide[True].fallback and decide[None].fallback
    assert not decide[False].save_now and not decide[False].fallback


def test_fallback_saves_off_is_the_policy_before() -> None:
    policy = SavePolicy(save_seconds=SAVE, fallback_saves=False)
    trained(policy, 3600.0)
    decision = policy.evaluate(NOW, NOW + BUDGET + UPLOAD + 10.0, UPLOAD)
    assert not decision.save_now and not decision.fallback
    with pytest.raises(ValueError, match="fallback_saves must be True or False"):
        SavePolicy(fallback_saves="yes")  # type: ignore[arg-type]


def test_ranks_agree_on_the_training_at_risk_by_its_minimum() -> None:
    # Rank 0 records the saves; rank 1 times only steps, so its own count never resets.
    # The reduced vote takes rank 0's: no second fallback on any rank.
    saver, other = Vote(at_risk_seconds=20.0), Vote(at_risk_seconds=7200.0)
    agreed = Vote.unpack([min(a, b) if op == "min" else max(a, b) for a, b, op in zip(
        saver.pack(), other.pack(), Vote.ops())])
    assert agreed.at_risk_seconds == 20.0
    policy = SavePolicy(save_seconds=SAVE)
    trained(policy, 3600.0)  # this rank alone would make a fallback
    decision = policy.decide(BUDGET + UPLOAD + 10.0, step_seconds=STEP, save_seconds=SAVE,
                             covered_seconds=None, upload_seconds=UPLOAD,
                             at_risk_seconds=agreed.at_risk_seconds)
    assert not decision.save_now


@dataclass
class Answer:
    """The three numbers UploadTime reads from the deadline tracker, as last answered."""

    upload_seconds: Optional[float]
    upload_status: Optional[str] = "ok"
    upload_measured: Optional[int] = None


def upload_time(answer: Answer, saved: Optional[float]) -> UploadTime:
    upload = UploadTime(answer)  # type: ignore[arg-type]  # the tracker's three fields
    upload.saved_seconds = saved
    return upload


def test_the_saved_estimate_is_a_floor_until_the_daemon_measured_its_window() -> None:
    assert upload_time(Answer(100.0, upload_measured=1), saved=300.0).seconds() == 300.0
    few = upload_time(Answer(400.0, upload_measured=1), saved=300.0)
    assert few.seconds() == 400.0 and few.to_save() == 400.0
    enough = upload_time(Answer(100.0, upload_measured=TRUSTED_UPLOADS), saved=300.0)
    assert enough.seconds() == 100.0 and enough.to_save() == 100.0
    # A daemon from before upload_measured: its estimate as it is.
    assert upload_time(Answer(100.0, upload_measured=None), saved=300.0).seconds() == 100.0
    # No rate known yet: the saved one; no uploader: none.
    assert upload_time(Answer(None), saved=300.0).seconds() == 300.0
    assert upload_time(Answer(None, upload_status=None), saved=300.0).seconds() is None


def test_trusted_uploads_is_the_uploaders_rate_window() -> None:
    plan = pytest.importorskip("sidecar.host.upload.plan")
    assert TRUSTED_UPLOADS == plan.RATE_WINDOW


@pytest.mark.parametrize("value", [-1, 1.5, "3", True])
def test_a_bad_upload_measured_is_a_clear_error(value: object) -> None:
    with pytest.raises(ValueError, match=r"upload_measured.*not a count"):
        Expiry.from_json({"server_time_unix": 1.0, "upload_measured": value})
    assert Expiry.from_json({"server_time_unix": 1.0, "upload_measured": 4}).upload_measured == 4
