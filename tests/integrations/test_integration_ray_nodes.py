"""Every node's deadline through Ray: a real multi-node cluster on this machine
(``ray.cluster_utils.Cluster``: a head and two more raylets, on 127.0.0.1), each "node"
with its own daemon and emulated ESI release. The controller's guard sees the earliest,
a moved deadline on one node, and keeps a node's last deadline when its daemon dies."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from contextlib import ExitStack
from typing import Any

import pytest
from daemon_harness import serve_daemon, wait_for
from drill_support import DrillScript
from ray_cluster import local_cluster, node_index

from sidecar.tools.emulator import Emulator
from sidecar.train.guard import CheckpointGuard

AK, SK = "AKLTraytest00000001", "ray-test-secret"
NODES = 3
# Each node's release, as set on its emulator (Unix seconds, this machine's clock): the
# served deadline is compared with it, not with a remaining time read seconds later.
RELEASES: dict[str, float] = {}


@pytest.fixture(scope="module")
def cluster() -> Iterator[Any]:
    with local_cluster(NODES) as started:
        yield started


@pytest.fixture
def nodes(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[tuple[Emulator, Any, Any]]]:
    """Per node: an emulated ESI (releases in 1 h, 2 h, 3 h), its daemon, and a way to
    stop that daemon."""
    monkeypatch.setenv("VOLCENGINE_ACCESS_KEY", AK)
    monkeypatch.setenv("VOLCENGINE_SECRET_KEY", SK)
    with ExitStack() as stack:
        made = []
        for index in range(NODES):
            emu = stack.enter_context(Emulator(access_key=AK, secret_key=SK,
                                               instance_id=f"i-node{index}"))
            emu.set_release_in(3600 * (index + 1))
            RELEASES[f"i-node{index}"] = time.time() + 3600 * (index + 1)
            own = stack.enter_context(ExitStack())  # closed early to kill this daemon
            daemon = own.enter_context(serve_daemon(api_endpoint=emu.url,
                                                    metadata_url=emu.url))
            made.append((emu, daemon, own.close))
        for _, daemon, _ in made:
            wait_for(lambda daemon=daemon: daemon.store.health().ok)
        yield made


def url_for(nodes: list[tuple[Emulator, Any, Any]]) -> Any:
    def url(entry: dict[str, Any]) -> str:
        return str(nodes[node_index(entry)][1].url)

    return url


def test_the_earliest_node_wins_a_move_is_seen_and_a_dead_daemon_keeps_its_deadline(
        cluster: Any, nodes: list[tuple[Emulator, Any, Any]], caplog: pytest.LogCaptureFixture,
) -> None:
    from sidecar.integrations.ray_nodes import NodeDeadlines

    deadlines = NodeDeadlines(url_for(nodes))
    try:
        def everyone() -> Any:  # the actors start in a few seconds; until then: stale
            answer = deadlines.expiry()
            return answer if answer is not None and not answer.stale else None

        first = wait_for(everyone, timeout=60)
        assert first.instance_id == "i-node0"
        assert len(deadlines.urls) == NODES and first.stale is False
        placement = deadlines.placement  # one actor on every node, each on its own
        assert len(placement) == NODES and all(k == v for k, v in placement.items())
        assert abs((first.expires_at_unix or 0) - RELEASES["i-node0"]) < 5

        # The third node's release moves before everyone else's: seen on the next ask.
        nodes[2][0].set_release_in(600)
        wait_for(lambda: (deadlines.expiry() or first).instance_id == "i-node2", timeout=15)

        # The guard on the controller takes it as its client.
        guard = CheckpointGuard(deadlines, environ={}, refresh_seconds=0.0,
                                wait_for_release=False)  # type: ignore[arg-type]
        guard.record_step(60.0)
        assert guard.should_save() is False  # 600 s > 60 + 60 + 120
        nodes[2][0].set_release_in(200)
        wait_for(lambda: guard.should_save(), timeout=15)  # 200 s <= 240 s

        # That node's daemon dies: its last deadline still counts, and it is said once.
        emu, _daemon, stop = nodes[2]
        known = deadlines.expiry()
        assert known is not None and known.instance_id == "i-node2"
        stop()
        emu.set_release_in(7200)  # the cloud moved it, but nobody on that node can tell
        with caplog.at_level(logging.WARNING, "sidecar.integrations.ray_nodes"):
            for _ in range(3):
                kept = deadlines.expiry()
                assert kept is not None and kept.expires_at_unix == known.expires_at_unix
                assert kept.stale is True and "ray node" in (kept.error or "")
        said = [r for r in caplog.records if "still counts" in r.getMessage()]
        assert len(said) == 1, [r.getMessage() for r in caplog.records]
        assert guard.should_save() is True  # the node released first is still honoured
    finally:
        deadlines.close()


def test_a_fire_drill_on_every_node_is_saved_for_once_and_each_daemon_records_pass(
        cluster: Any, nodes: list[tuple[Emulator, Any, Any]]) -> None:
    """``esi-sidecar drill --url A --url B --url C`` on a job whose controller asks every
    node through Ray: its events reach every node's daemon (so each sees the job), the
    drill is saved for once, every daemon records PASS, and training goes on."""
    from sidecar.integrations.ray_nodes import NodeDeadlines
    from sidecar.train.policy import SavePolicy

    deadlines = NodeDeadlines(url_for(nodes))
    try:
        wait_for(lambda: (answer := deadlines.expiry()) is not None and not answer.stale,
                 timeout=60)
        guard = CheckpointGuard(deadlines, environ={}, refresh_seconds=0.05,  # type: ignore[arg-type]
                                policy=SavePolicy(save_seconds=0.5, redundant_seconds=1.0,
                                                  top_up_seconds=None))
        script = DrillScript(*(daemon.url for _emu, daemon, _stop in nodes), lead=6.0)
        saves: list[int] = []
        for step in range(1, 3000):
            with guard.step():
                time.sleep(0.05)  # the training step itself
            if guard.should_save():
                with guard.saving(step):
                    saves.append(step)
            assert guard.should_stop() is False
            if script.at_step(step):
                break
        assert script.passed(), script.verdicts
        assert {v["figures"]["step"] for v in script.verdicts} == set(saves)
        assert len(saves) == 1 and step == script.end_step > saves[0]
    finally:
        deadlines.close()
