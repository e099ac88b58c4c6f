"""torch.distributed.checkpoint through the guard: real gloo ranks, FSDP2 shards, real DCP.

Each test runs ``dcp_worker.py`` in several processes (one per rank) with one time limit:
a rank left inside a collective fails the test as a hang. What each rank saw comes back as
JSON; the checkpoint folders are then read here as a resuming job would read them.
"""

from __future__ import annotations

import json
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from daemon_harness import serve_daemon, wait_for
from rank_launcher import base_environment, run_ranks

from sidecar.checkpoint.folders import MANIFEST_NAME, latest_valid, list_checkpoints
from sidecar.host.upload.uploader import Uploader, UploaderConfig
from sidecar.host.upload.volume import VolumeDestination

pytest.importorskip("torch")
pytestmark = pytest.mark.frameworks

WORKER = Path(__file__).resolve().parents[1] / "support" / "dcp_worker.py"


def run_scenario(tmp_path: Path, scenario: str, world_size: int = 2,
                 **extra: Any) -> list[dict[str, Any]]:
    root = tmp_path / "ckpt"
    commands = []
    for rank in range(world_size):
        config = {
            "rank": rank, "world_size": world_size, "scenario": scenario,
            "init_method": (tmp_path / "init").as_uri(), "root": str(root),
            "gate": str(tmp_path / "gate"), "result": str(tmp_path / f"result-{rank}.json"),
            **extra,
        }
        commands.append([sys.executable, str(WORKER), json.dumps(config)])
    outcomes = run_ranks(commands, [base_environment()] * world_size, tmp_path, limit=150)
    results = []
    for rank, (code, stderr) in enumerate(outcomes):
        assert code == 0, f"rank {rank} exited {code}:\n{stderr[-3000:]}"
        results.append(json.loads((tmp_path / f"result-{rank}.json").read_text()))
    return results


def test_every_rank_writes_its_shards_and_rank_0_commits_them_atomically(
    tmp_path: Path,
) -> None:
    results = run_scenario(tmp_path, "commit", world_size=3)
    root = tmp_path / "ckpt"
    # The blocking save: one folder with every rank's shard file and DCP's metadata, all
    # listed in the manifest that rank 0 wrote last.
    blocking = {json.dumps(r["blocking"]) for r in results}
    assert len(blocking) == 1, blocking  # every rank returned the same checkpoint
    files = results[0]["blocking"]["files"]
    assert {".metadata", "__0_0.distcp", "__1_0.distcp", "__2_0.distcp"} <= set(files), files
    assert results[0]["blocking"]["name"] == "step_00000002"
    # The async save while its write was held: training went on, nothing new was visible.
    for r in results:
        assert r["during"] == {"latest": 2, "committed": False, "done": False}, r
        assert r["after"] == {"latest": 4, "committed": True, "temporary": []}, r
    # Resume: the newest valid checkpoint is the async one, complete; a fresh job (the
    # worker's second load, from step 4's folder) restored the weights it held.
    newest = latest_valid(root)
    assert newest is not None and newest.step == 4
    assert newest.metadata["format"] == "torch.distributed.checkpoint"
    assert newest.metadata["world_size"] == 3
    assert (root / "latest").read_text().strip() == "step_00000004"
    for r in results:
        assert r["loaded"] == {"step": 4, "name": "step_00000004"}, r
        assert r["loaded_weights"] != r["saved_weights"]  # trained on after step 2
    assert [(c.step, c.valid) for c in list_checkpoints(root)] == [(4, True), (2, True)]


def test_a_rank_that_fails_makes_every_rank_raise_and_nothing_is_committed(
    tmp_path: Path,
) -> None:
    results = run_scenario(tmp_path, "fault")
    for r in results:
        outcomes = r["outcomes"]
        # Rank 1's state_dict() raised before DCP started: every rank was told, by name.
        assert "rank 1: preparing its state failed" in outcomes["state"], outcomes
        # Rank 1's write failed inside DCP, blocking and asynchronous: every rank raised.
        assert "No space left on device" in outcomes["write"], outcomes
        assert "No space left on device" in outcomes["async"], outcomes
        assert r["async_committed"] is False
        assert r["latest"] == 5  # and the next save worked
    # Only the good saves exist; the failed ones left no folder and no temporary.
    assert results[0]["folders"] == ["latest", "step_00000001", "step_00000005"]
    assert [(c.step, c.valid) for c in list_checkpoints(tmp_path / "ckpt")] == [
        (5, True), (1, True)]


def test_a_folder_that_not_every_rank_sees_is_refused_before_writing(tmp_path: Path) -> None:
    results = run_scenario(tmp_path, "unshared")
    for r in results:
        assert "rank 1 cannot see" in r["outcome"], r
        assert "storage every rank shares" in r["outcome"], r
    assert results[0]["folders"] == []  # rank 0's temporary folder was removed
    assert results[1]["folders"] == []


def test_the_guards_final_async_save_counts_only_once_committed(tmp_path: Path) -> None:
    redundant = 3.0
    # The rule fires about 4 s after a rank starts its loop.
    results = run_scenario(tmp_path, "guard", redundant=redundant,
                           deadline_in=redundant + 1.0 + 4.0)
    deadline = min(r["deadline_unix"] for r in results)
    saved_at = {tuple(r["saved_at"]) for r in results}
    assert len(saved_at) == 1, saved_at  # every rank saved at the same step, once
    (steps,) = saved_at
    assert len(steps) == 1
    for r in results:
        assert r["stopped_at"] == steps[0]
        # Saved (the blocking part is over) but not committed: not the final checkpoint yet.
        assert r["before_commit"] == {"final_step": steps[0], "durable": None,
                                      "committed": False}, r
        after = r["after_commit"]
        assert after["committed"] is True and after["final_step"] == steps[0]
        assert after["durable"] is not None and after["durable"] <= deadline
        assert after["async_write"] is not None and after["async_write"] > 0
    newest = latest_valid(tmp_path / "ckpt")
    assert newest is not None and newest.step == steps[0]
    assert (newest.path / MANIFEST_NAME).is_file()


def test_the_uploader_sends_each_rank_s_shard_while_the_save_is_held_and_commits_after(
    tmp_path: Path,
) -> None:
    """Streaming through DCP (issue 23, item 1): both ranks' shards reach the volume's
    hidden staging while rank 0's final step (``.metadata``, then the commit) is held;
    nothing is visible there until the commit, and then the checkpoint is complete."""
    root, volume, release = tmp_path / "ckpt", tmp_path / "volume", tmp_path / "release"
    root.mkdir()
    volume.mkdir()
    config = UploaderConfig(root=root, location=None, scan_interval_seconds=0.2,
                            settle_seconds=0.2, backoff_base_seconds=0.05,
                            backoff_cap_seconds=0.3)
    uploader = Uploader(config, destination=VolumeDestination(volume, None))

    def staged() -> set[str]:
        return {path.name for path in volume.glob(".tmp-*/*") if path.is_file()}

    def visible() -> list[str]:
        return sorted(path.name for path in volume.iterdir() if not path.name.startswith("."))

    outcome: dict[str, Any] = {}

    def save() -> None:
        try:
            outcome["results"] = run_scenario(tmp_path, "stream", release=str(release))
        except BaseException as error:  # reported by the test's thread below
            outcome["error"] = error

    uploader.start()
    ranks = threading.Thread(target=save)
    try:
        ranks.start()
        wait_for(lambda: {"__0_0.distcp", "__1_0.distcp"} <= staged() or "error" in outcome,
                 timeout=60)
        assert "error" not in outcome, outcome
        assert visible() == []  # the shards went ahead; the checkpoint is not visible
        assert ".metadata" not in staged() and MANIFEST_NAME not in staged()
        release.touch()
        ranks.join(timeout=120)
        assert not ranks.is_alive() and "error" not in outcome, outcome
        wait_for(lambda: latest_valid(volume, verify_checksums=True, clean=False) is not None,
                 timeout=60)
    finally:
        release.touch()
        ranks.join(timeout=120)
        uploader.stop(timeout=5)
    durable = latest_valid(volume, verify_checksums=True, clean=False)
    assert durable is not None and durable.step == 1
    names = {f.path for f in durable.files}
    assert {".metadata", "__0_0.distcp", "__1_0.distcp"} <= names
    assert names == set(outcome["results"][0]["committed"]["files"])
    for name in names:
        assert (volume / durable.name / name).read_bytes() == \
            (root / durable.name / name).read_bytes(), name


def test_a_fire_drill_is_saved_for_by_every_rank_through_dcp_and_training_goes_on(
    tmp_path: Path,
) -> None:
    """Two gloo ranks against the real daemon: the drill's checkpoint is written through
    DCP at the same step on every rank and committed, the daemon records PASS, no rank
    stops, and both train on past the verdict."""
    with serve_daemon(sources=("static",), expires_at=repr(time.time() + 3600)) as daemon:
        wait_for(lambda: daemon.store.health().ok)
        # The budget + 5 s: while the deadline is far, the ranks vote at most 5 s apart.
        results = run_scenario(tmp_path, "drill", url=daemon.url, lead=8.0)
    (verdict,) = results[0]["verdicts"]
    assert verdict["verdict"] == "PASS", verdict
    (saved_at,) = {tuple(r["saved_at"]) for r in results}  # the same steps on every rank
    assert saved_at == (verdict["figures"]["step"],)
    for r in results:
        assert r["stopped"] is False and r["last_step"] > saved_at[0], r
    newest = latest_valid(tmp_path / "ckpt")
    assert newest is not None and newest.step == saved_at[0]
    assert newest.metadata["world_size"] == 2
