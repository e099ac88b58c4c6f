"""Each node's deadline handed to Ray as a drain: a real cluster on this machine
(``ray.cluster_utils.Cluster``: a head and one more raylet, on 127.0.0.1), each "node" with
its own daemon and emulated ESI release. Read back through Ray's own drain state (the GCS
node table that Ray Train's ``PreemptionWatcher`` polls) and by that watcher itself."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import ExitStack
from typing import Any

import pytest
from daemon_harness import serve_daemon, wait_for
from ray_cluster import local_cluster, node_index

from sidecar.integrations.ray_drain import drain_supported
from sidecar.tools.emulator import Emulator

AK, SK = "AKLTraydrain0000001", "ray-drain-secret"
NODES = 2


def test_the_drain_call_is_used_from_the_ray_release_it_was_checked_against() -> None:
    assert drain_supported("2.60.0") and drain_supported("2.61.1") and drain_supported("3.0")
    assert not drain_supported("2.59.9") and not drain_supported("1.13.0")
    assert not drain_supported("nightly")


@pytest.fixture(scope="module")
def cluster() -> Iterator[Any]:
    with local_cluster(NODES) as started:
        yield started


@pytest.fixture
def nodes(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[tuple[Emulator, Any]]]:
    """Per node: an emulated ESI (releases in 1 h, 2 h) and its daemon."""
    monkeypatch.setenv("VOLCENGINE_ACCESS_KEY", AK)
    monkeypatch.setenv("VOLCENGINE_SECRET_KEY", SK)
    with ExitStack() as stack:
        made = []
        for index in range(NODES):
            emu = stack.enter_context(Emulator(access_key=AK, secret_key=SK,
                                               instance_id=f"i-drain{index}"))
            emu.set_release_in(3600 * (index + 1))
            daemon = stack.enter_context(serve_daemon(api_endpoint=emu.url,
                                                      metadata_url=emu.url))
            made.append((emu, daemon))
        for _, daemon in made:
            wait_for(lambda daemon=daemon: daemon.store.health().ok)
        yield made


def test_a_close_deadline_drains_its_node_once_and_a_renewal_moves_the_drain(
        cluster: Any, nodes: list[tuple[Emulator, Any]], caplog: pytest.LogCaptureFixture,
) -> None:
    import ray

    from sidecar.integrations.ray_nodes import NodeDeadlines

    ids = {node_index(entry): entry["NodeID"] for entry in ray.nodes() if entry["Alive"]}
    # A 2 s timeout: the machine that runs the tests may be busy (0.5 s in production).
    deadlines = NodeDeadlines(lambda entry: str(nodes[node_index(entry)][1].url),
                              timeout=2.0, drain_within=900)

    def draining() -> dict[str, int]:  # what Ray Train's PreemptionWatcher polls
        return dict(ray._private.state.state.get_draining_nodes())

    watcher = None
    try:
        def everyone() -> Any:
            answer = deadlines.expiry()
            return answer if answer is not None and not answer.stale else None

        wait_for(everyone, timeout=60)
        assert draining() == {}  # 1 h and 2 h away: more than 900 s, no drain yet

        try:  # Ray Train's own watcher, as a Ray Train run starts it for its nodes
            from ray.train.v2._internal.execution.preemption import PreemptionWatcher
        except ImportError:
            PreemptionWatcher = None
        if PreemptionWatcher is not None:
            watcher = PreemptionWatcher({ids[0]: [0], ids[1]: [1]}, poll_interval_s=0.1)

        # The second node's release comes within 900 s: Ray sees that node draining with
        # its own deadline (the first node, an hour away, is left alone).
        with caplog.at_level(logging.WARNING, "sidecar.integrations.ray_drain"):
            nodes[1][0].set_release_in(600)
            def seen() -> Any:
                answer = deadlines.expiry()
                return answer if ids[1] in draining() else None

            moved = wait_for(seen, timeout=60)
            for _ in range(3):  # asked again: the same deadline is not handed over again
                deadlines.expiry()
        expected = round((moved.expires_at_unix or 0) * 1000)
        assert moved.instance_id == "i-drain1"
        assert draining() == {ids[1]: expected}
        assert deadlines.drains is not None and deadlines.drains.published == {ids[1]: expected}
        said = [r.getMessage() for r in caplog.records if "drained for" in r.getMessage()]
        assert len(said) == 1 and ids[1][:8] in said[0], said
        if watcher is not None:
            info = wait_for(watcher.get_latest_preemption_info, timeout=10)
            assert info.deadline_ms == expected and info.preempted_ranks == [1]

        # A renewal moves the release later: Ray's drain deadline follows (Ray overwrites
        # it); the node stays draining, since Ray cannot undo a drain.
        caplog.clear()
        with caplog.at_level(logging.WARNING, "sidecar.integrations.ray_drain"):
            nodes[1][0].set_release_in(1800)

            def renewed() -> Any:
                deadlines.expiry()
                later = draining().get(ids[1], 0)
                return later if later > expected + 1_000_000 else None

            later = wait_for(renewed, timeout=60)
            # The release withdrawn altogether: said once, Ray keeps the last deadline.
            nodes[1][0].set_release(None)
            def withdrawal_said() -> bool:
                deadlines.expiry()
                return any("withdrawn" in r.getMessage() for r in caplog.records)

            wait_for(withdrawal_said, timeout=60)
            for _ in range(3):
                deadlines.expiry()
        assert abs(later - expected - 1_200_000) < 5_000
        assert [r.getMessage() for r in caplog.records if "moved from" in r.getMessage()]
        withdrawn = [r for r in caplog.records if "withdrawn" in r.getMessage()]
        assert len(withdrawn) == 1
        assert draining() == {ids[1]: later}
        if watcher is not None:
            def watcher_follows() -> bool:
                info = watcher.get_latest_preemption_info()
                return info is not None and info.deadline_ms == later

            wait_for(watcher_follows, timeout=10)
    finally:
        if watcher is not None:
            watcher._stop_event.set()
        deadlines.close()
