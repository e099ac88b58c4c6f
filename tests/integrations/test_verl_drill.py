"""verl's drop-in on a fire drill (``VerlDrill``, standard library only, so no verl here):
a save that ends after the drill deadline is reported "not-durable", never "durable" with
a negative lead, against the real daemon."""

from __future__ import annotations

import time

from daemon_harness import wait_for
from drill_support import job_heard, start_drill, verdict
from guard_support import static_daemon

from sidecar.integrations.verl_drill import VerlDrill
from sidecar.train.client import SidecarClient
from sidecar.train.deadline import DeadlineTracker

STEP_SECONDS = 0.05


def test_a_verl_save_that_ends_after_the_drill_deadline_is_not_durable() -> None:
    with static_daemon(time.time() + 3600) as daemon:
        drill = VerlDrill(DeadlineTracker(SidecarClient(daemon.url), refresh_seconds=0.05))

        def step() -> bool:  # one verl step: the drop-in asked, as verl does each step
            drill.tracker.deadline()
            return drill.answer(STEP_SECONDS, 0.2, 1.0)

        wait_for(lambda: step() is False and job_heard(daemon.url), timeout=30)
        started = start_drill(daemon.url, 3.0)
        wait_for(step, timeout=20, interval=STEP_SECONDS)  # True: verl saves now
        # verl's save runs 0.5 s past the drill deadline; the next step sees it ended.
        time.sleep(max(0.0, started["expires_at_unix"] - time.time()) + 0.5)
        wait_for(lambda: step() is False and verdict(daemon.url, started["id"]), timeout=20,
                 interval=STEP_SECONDS)
        decided = verdict(daemon.url, started["id"])
        assert decided["figures"]["outcome"] == "not-durable", decided
        assert decided["figures"]["lead_seconds"] < 0, decided
        assert decided["verdict"] == "FAIL" and "after the drill deadline" in decided["reason"]
