"""The guard's drill path against the real daemon: it saves for a drill deadline as for a
release and trains on (never stops), on every rank alike; a real deadline earlier than the
drill wins; a lead that cannot hold a save starts none and reports why."""

from __future__ import annotations

import time
from typing import Any

from daemon_harness import wait_for
from drill_support import job_heard, start_drill, verdict
from guard_support import (  # noqa: F401  (clean_environment: a fixture)
    ThreadAllReduce,
    clean_environment,
    closed_port,
    static_daemon,
)

from sidecar.train.client import SidecarClient
from sidecar.train.guard import CheckpointGuard
from sidecar.train.policy import SavePolicy

STEP_SECONDS = 0.05


def policy() -> SavePolicy:
    return SavePolicy(save_seconds=0.2, redundant_seconds=1.0, top_up_seconds=None)


def test_a_drill_is_saved_for_like_a_release_and_training_goes_on() -> None:
    with static_daemon(time.time() + 3600) as daemon:
        guard = CheckpointGuard(SidecarClient(daemon.url), policy(), environ={},
                                refresh_seconds=0.05)
        saves: list[int] = []
        step = 0

        def train_until(done: Any, timeout: float = 20) -> None:
            nonlocal step
            limit = time.monotonic() + timeout
            while not done():
                assert time.monotonic() < limit, f"not done by step {step}"
                with guard.step():
                    time.sleep(STEP_SECONDS)  # the training step itself
                if guard.should_save():
                    with guard.saving(step):
                        saves.append(step)
                assert guard.should_stop() is False  # never for a drill
                step += 1

        train_until(lambda: job_heard(daemon.url))
        drill = start_drill(daemon.url, 3.0)
        train_until(lambda: verdict(daemon.url, drill["id"]))
        decided = verdict(daemon.url, drill["id"])
        assert decided["verdict"] == "PASS", decided
        figures = decided["figures"]
        assert len(saves) == 1 and figures["step"] == saves[0]
        assert figures["outcome"] == "durable" and 0 < figures["lead_seconds"] <= 3.0
        assert figures["budget_seconds"] > 1.0 and figures["save_seconds"] >= 0
        # Training goes on past the drill, on the real deadline again, with no more saves.
        past = step + 20
        train_until(lambda: step >= past)
        assert len(saves) == 1
        status = guard.status()
        assert status.deadline_unix is not None and status.deadline_unix > time.time() + 3000
        assert guard.released is False


def test_every_rank_saves_for_the_drill_at_the_same_step_though_one_knows_it() -> None:
    reduce = ThreadAllReduce(2)
    saved_at: dict[int, list[int]] = {0: [], 1: []}
    with static_daemon(time.time() + 3600) as daemon:
        urls = [daemon.url, f"http://127.0.0.1:{closed_port()}"]
        drill: dict[str, Any] = {}

        def train(rank: int) -> None:
            guard = CheckpointGuard(SidecarClient(urls[rank]), policy(), environ={},
                                    refresh_seconds=0.05, reducer=reduce.for_rank(rank))
            for step in range(400):
                with guard.step():
                    time.sleep(STEP_SECONDS)
                if rank == 0 and step == 5:
                    wait_for(lambda: job_heard(daemon.url))
                    # Longer than the budget + 5 s: while the deadline is far the ranks
                    # vote at most 5 s apart (vote.MAX_SKIP_SECONDS), as for a notice.
                    drill.update(start_drill(daemon.url, 7.0))
                if guard.should_save():
                    with guard.saving(step):
                        saved_at[rank].append(step)
                assert guard.should_stop() is False
                if saved_at[rank] and step > saved_at[rank][0] + 30:
                    return

        assert reduce.run(train, timeout=60) == []
        assert saved_at[0] == saved_at[1] and len(saved_at[0]) == 1, saved_at
        wait_for(lambda: verdict(daemon.url, drill["id"]), timeout=10)
        assert verdict(daemon.url, drill["id"])["verdict"] == "PASS"


def test_a_real_deadline_earlier_than_the_drill_wins() -> None:
    with static_daemon(time.time() + 3600) as drilled, \
            static_daemon(time.time() + 4.0) as releasing:
        client = SidecarClient(f"{drilled.url},{releasing.url}")
        guard = CheckpointGuard(client, policy(), environ={}, refresh_seconds=0.05,
                                wait_for_release=False)
        guard.record_step(STEP_SECONDS)
        guard.should_save()
        wait_for(lambda: job_heard(drilled.url))
        start_drill(drilled.url, 30.0)
        wait_for(lambda: (client.expiry() or client).drill is not None)  # type: ignore[union-attr]
        stopped = False
        limit = time.monotonic() + 20
        while not stopped:
            assert time.monotonic() < limit
            with guard.step():
                time.sleep(STEP_SECONDS)
            if guard.should_save():
                with guard.saving(1):
                    pass
            stopped = guard.should_stop()
        assert guard.status().deadline_unix is not None
        assert guard.status().deadline_unix < time.time() + 5  # the real one, not the drill's


def test_a_lead_that_cannot_hold_a_save_starts_none_and_fails_with_the_reason() -> None:
    with static_daemon(time.time() + 3600) as daemon:
        guard = CheckpointGuard(SidecarClient(daemon.url), policy(), environ={},
                                refresh_seconds=0.05)
        guard.record_save(3.0)  # a measured routine save: 3 s
        saves = 0
        guard.record_step(STEP_SECONDS)
        guard.should_save()
        wait_for(lambda: job_heard(daemon.url))
        drill = start_drill(daemon.url, 2.0)
        limit = time.monotonic() + 20
        while not verdict(daemon.url, drill["id"]):
            assert time.monotonic() < limit
            with guard.step():
                time.sleep(STEP_SECONDS)
            if guard.should_save():
                saves += 1
            assert guard.should_stop() is False
        decided = verdict(daemon.url, drill["id"])
        assert decided["verdict"] == "FAIL" and saves == 0, decided
        assert "no save started" in decided["reason"]
        assert "for a save" in decided["reason"]  # the rule's own words: remaining < save
        assert decided["figures"]["outcome"] == "too-late"


def test_a_checkpoint_durable_after_the_drill_deadline_is_not_reported_durable() -> None:
    # The save the rule asks for runs past the drill deadline (no uploader: the local save
    # is durable when it ends), so the checkpoint is durable too late: a release would have
    # found none. The guard says so; it must not send "durable" with a negative lead.
    with static_daemon(time.time() + 3600) as daemon:
        guard = CheckpointGuard(SidecarClient(daemon.url), policy(), environ={},
                                refresh_seconds=0.05)
        saves: list[int] = []
        guard.record_step(STEP_SECONDS)
        guard.should_save()
        wait_for(lambda: job_heard(daemon.url))
        drill = start_drill(daemon.url, 3.0)
        step = 0
        limit = time.monotonic() + 20
        while not verdict(daemon.url, drill["id"]):
            assert time.monotonic() < limit, f"no verdict by step {step}"
            with guard.step():
                time.sleep(STEP_SECONDS)
            if guard.should_save():
                with guard.saving(step):
                    saves.append(step)
                    # A save slower than planned: it ends 0.5 s after the drill deadline.
                    time.sleep(max(0.0, drill["expires_at_unix"] - time.time()) + 0.5)
            assert guard.should_stop() is False
            step += 1
        decided = verdict(daemon.url, drill["id"])
        figures = decided["figures"]
        assert len(saves) == 1 and figures["step"] == saves[0], decided
        assert figures["outcome"] == "not-durable", decided
        assert figures["lead_seconds"] < 0 and figures["durable_seconds"] > 0, figures
        assert decided["verdict"] == "FAIL", decided
        assert "after the drill deadline" in decided["reason"], decided


def test_a_drills_save_is_named_as_one_in_the_events_and_on_the_page() -> None:
    # Issue 39, item 5: the page said "final ... durable 5 s before the release" for a
    # drill's save while the real release was 54 min away.
    import urllib.request

    from daemon_harness import get_json

    with static_daemon(time.time() + 3600) as daemon:
        guard = CheckpointGuard(SidecarClient(daemon.url), policy(), environ={},
                                refresh_seconds=0.05)
        step = 0

        def train_until(done: Any, timeout: float = 20) -> None:
            nonlocal step
            limit = time.monotonic() + timeout
            while not done():
                assert time.monotonic() < limit, f"not done by step {step}"
                with guard.step():
                    time.sleep(STEP_SECONDS)
                if guard.should_save():
                    with guard.saving(step):
                        pass
                guard.should_stop()
                step += 1

        train_until(lambda: job_heard(daemon.url))
        drill = start_drill(daemon.url, 3.0)
        train_until(lambda: verdict(daemon.url, drill["id"]))

        def saves() -> list[tuple[str, Any]]:
            events = get_json(daemon.url + "/v1/events")[1]["events"]
            return [(e["kind"], e.get("save")) for e in reversed(events)
                    if e["kind"] in ("save-started", "save-finished", "durable")]

        named = wait_for(lambda: len(said := saves()) == 3 and said)
        page = urllib.request.urlopen(daemon.url + "/", timeout=5).read().decode()
        guard.client.close()
    assert named == [("save-started", "drill"), ("save-finished", "drill"),
                     ("durable", "drill")]
    assert "before the drill deadline" in page and "before the release" not in page
    assert "final save" not in page
