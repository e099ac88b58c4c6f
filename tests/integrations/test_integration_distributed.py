"""torch.distributed: every rank saves at the same step, once, and nobody hangs.

Real gloo process groups of 2 and 4 processes (tests/support/distributed_worker.py), each rank
asking its OWN real daemon on loopback: rank 0's daemon knows a release 100 simulated
seconds ahead, rank 1's knows none, the others' a release far away. Each rank reports a
different step duration (rank 1 the slowest). With the TorchReducer, the MIN deadline and
the MAX step decide for everyone: all ranks enter the collective save at step 7. A
rank-local guard running alongside would have saved on rank 0 only, and at step 8: the
decisions the reducer has to reconcile differ, so this test can fail.

Numbers: step k sets the simulated clock to base + 10 k; save 5 s, redundant 5 s (policy).
Reduced: budget = 20 + 5 + 5 = 30, remaining = 100 - 10 k <= 30 first at k = 7.
Rank 0 alone: budget = 10 + 5 + 5 = 20, so k = 8; the other ranks alone: never.
"""

from __future__ import annotations

import json
import sys
import time
from contextlib import ExitStack
from datetime import timedelta
from pathlib import Path
from typing import Any, Optional

import pytest
from daemon_harness import serve_daemon, wait_for
from rank_launcher import base_environment, run_ranks

pytest.importorskip("torch")

import torch.distributed as dist

from sidecar.integrations.distributed import (
    TorchReducer,
    distributed_guard,
    reducer_if_distributed,
)
from sidecar.train.vote import Vote

pytestmark = pytest.mark.frameworks

WORKER = Path(__file__).resolve().parents[1] / "support" / "distributed_worker.py"
STEP_SECONDS = [10.0, 20.0, 5.0, 15.0]  # per rank; rank 1 is the slowest
RELEASE_AFTER = 100  # simulated seconds after base, on rank 0's daemon only
EXPECTED_SAVE_STEP = 7
RANK0_ALONE_SAVE_STEP = 8
STEPS = 12


def start_daemons(stack: ExitStack, world_size: int, base_unix: float) -> list[str]:
    urls = []
    for rank in range(world_size):
        if rank == 0:
            options: dict[str, Any] = {
                "sources": ("static",),
                "expires_at": str(int(base_unix) + RELEASE_AFTER),
            }
        elif rank == 1:
            options = {"sources": ("env",)}  # no variable set: no deadline known
        else:
            options = {"sources": ("static",), "expires_at": str(int(base_unix) + 10**6)}
        daemon = stack.enter_context(serve_daemon(**options))
        wait_for(lambda d=daemon: d.store.health().ok)
        urls.append(daemon.url)
    return urls


def run_workers(
    tmp_path: Path,
    urls: list[str],
    *,
    base_unix: float,
    reduce: bool = True,
    wait: bool = False,
    top_up: Optional[float] = None,
    group_timeout: float = 20,
    limit: float = 90,
) -> list[tuple[int, Any, str]]:
    """One distributed_worker.py per rank; (exit code, result or None, stderr) per rank."""
    world_size = len(urls)
    init_file = tmp_path / f"init-{world_size}-{reduce}"
    commands, results = [], []
    for rank, url in enumerate(urls):
        result_path = tmp_path / f"result-{rank}.json"
        config: dict[str, Any] = {
            "rank": rank,
            "world_size": world_size,
            "init_method": init_file.as_uri(),
            "group_timeout": group_timeout,
            "url": url,
            "reduce": reduce,
            "wait": wait,
            "top_up": top_up,
            "base_unix": float(int(base_unix)),
            "wall_seconds_per_step": 10.0,
            "step_seconds": STEP_SECONDS[rank % len(STEP_SECONDS)],
            "steps": STEPS,
            "checkpoint": str(tmp_path / "model.pt"),
            "result": str(result_path),
        }
        commands.append([sys.executable, str(WORKER), json.dumps(config)])
        results.append(result_path)
    env = base_environment()
    outcomes = run_ranks(commands, [env] * world_size, tmp_path, limit=limit)
    return [
        (code, json.loads(result.read_text()) if result.exists() else None, stderr)
        for (code, stderr), result in zip(outcomes, results)
    ]


def test_after_the_final_save_every_rank_waits_for_the_release_and_leaves_together(
    tmp_path: Path,
) -> None:
    """The wait after the final save, across real gloo ranks: every rank stays in
    should_stop() (asking the others while the release is far enough) until the earliest
    node's release has passed on the simulated clock, then all leave at the same step."""
    base_unix = time.time()
    with ExitStack() as stack:
        urls = start_daemons(stack, 2, base_unix)
        outcomes = run_workers(tmp_path, urls, base_unix=base_unix, wait=True)
    for code, _body, stderr in outcomes:
        assert code == 0, stderr[-2000:]
    results = [body for _code, body, _stderr in outcomes]
    release = float(int(base_unix)) + RELEASE_AFTER
    for r in results:
        assert r["saves"] == [EXPECTED_SAVE_STEP], r
        assert r["stop_steps"] == [EXPECTED_SAVE_STEP], r  # left the loop at the save
        assert r["released"] is True
        # Waited until the release (rank 0's daemon), not a step more than needed.
        assert release <= r["wall_at_exit"] < release + 2.0, r


@pytest.mark.parametrize("world_size", [2, 4])
def test_all_ranks_save_at_the_same_step_once(tmp_path: Path, world_size: int) -> None:
    base_unix = time.time()
    with ExitStack() as stack:
        urls = start_daemons(stack, world_size, base_unix)
        started = time.monotonic()
        outcomes = run_workers(tmp_path, urls, base_unix=base_unix)
        elapsed = time.monotonic() - started

    for code, _body, stderr in outcomes:
        assert code == 0, stderr[-2000:]
    results = [body for _code, body, _stderr in outcomes]
    assert all(r["distributed"] for r in results)

    # The reducer alone: MIN remaining (rank 1's "unknown" +inf loses), MAX step (rank 0's
    # "unknown" -1 loses), save unknown everywhere stays -1, one rank's cover wins, the
    # one node's upload estimate wins over the others' "no uploader" -1.
    for r in results:
        assert r["probe"] == [100.0, float(world_size - 1), -1.0, 7.0, 30.0, 1.0,
                              2.0 * (world_size - 1)]

    # Every rank saved exactly once, at the same step, and all ranks were inside the
    # collective save together (the token summed to the world size).
    for r in results:
        assert r["saves"] == [EXPECTED_SAVE_STEP], r
        assert r["save_tokens"] == [float(world_size)]
        assert r["stop_steps"][0] == EXPECTED_SAVE_STEP
    assert len({tuple(r["stop_steps"]) for r in results}) == 1
    assert (tmp_path / "model.pt").exists()
    assert len({tuple(r["weight"]) for r in results}) == 1  # DDP kept replicas identical

    # Without the reducer the ranks disagree: rank 0 alone would save a step later (it
    # does not know rank 1's slower steps), every other rank never.
    local = [r["shadow_saves"] for r in results]
    assert local[0] == [RANK0_ALONE_SAVE_STEP]
    assert all(saves == [] for saves in local[1:])
    assert elapsed < 60


def test_four_nodes_of_two_ranks_each_save_at_the_same_step(tmp_path: Path) -> None:
    """8 gloo processes: 4 simulated nodes, each with its own daemon (node 0 knows the
    release, node 1 knows none, the others a far one) serving its 2 ranks. Every rank
    saves once, at the same step, inside one collective save of all 8."""
    base_unix = time.time()
    with ExitStack() as stack:
        nodes = start_daemons(stack, 4, base_unix)
        urls = [nodes[rank // 2] for rank in range(8)]
        outcomes = run_workers(tmp_path, urls, base_unix=base_unix, group_timeout=60,
                               limit=240)
    for code, _body, stderr in outcomes:
        assert code == 0, stderr[-2000:]
    results = [body for _code, body, _stderr in outcomes]
    for r in results:
        assert r["saves"] == [EXPECTED_SAVE_STEP], r
        assert r["save_tokens"] == [8.0]
        assert r["stop_steps"][0] == EXPECTED_SAVE_STEP
    assert len({tuple(r["weight"]) for r in results}) == 1


def test_all_ranks_make_the_top_up_save_at_the_same_step(tmp_path: Path) -> None:
    """After the final save at step 7 (30 s left), a typical step (rank 1's 20 s, the
    largest median) plus a near-instant save still fits with top_up_seconds=0: every
    rank trains step 8 and enters the collective top-up save there, then stops."""
    base_unix = time.time()
    with ExitStack() as stack:
        urls = start_daemons(stack, 2, base_unix)
        outcomes = run_workers(tmp_path, urls, base_unix=base_unix, top_up=0.0)
    for code, _body, stderr in outcomes:
        assert code == 0, stderr[-2000:]
    for r in [body for _code, body, _stderr in outcomes]:
        assert r["saves"] == [EXPECTED_SAVE_STEP, EXPECTED_SAVE_STEP + 1], r
        assert r["save_tokens"] == [2.0, 2.0]
        assert r["stop_steps"][0] == EXPECTED_SAVE_STEP + 1, r


def test_without_the_reducer_the_collective_save_fails(tmp_path: Path) -> None:
    """The broken setup, run for real: rank 0 enters the save alone and it does not end well.

    Rank 0 decides to save at step 8, rank 1 never: rank 0's save all_reduce meets rank
    1's next DDP gradient all_reduce, or nothing. Whatever gloo makes of it (an error, a
    wait until the group's 5 s timeout, mismatched data), the ranks do not end with one
    save each at the same step.
    """
    base_unix = time.time()
    with ExitStack() as stack:
        urls = start_daemons(stack, 2, base_unix)
        outcomes = run_workers(
            tmp_path, urls, base_unix=base_unix, reduce=False, group_timeout=5
        )
    results = [body for code, body, _stderr in outcomes if code == 0 and body is not None]
    agreed = len(results) == 2 and all(
        r["saves"] == results[0]["saves"] and len(r["saves"]) == 1 for r in results
    )
    assert not agreed, outcomes


def test_reducer_in_one_process_group(tmp_path: Path) -> None:
    """In-process, world size 1: the helper picks the reducer only once the group exists."""
    assert reducer_if_distributed() is None
    assert distributed_guard(client=None)._vote.reducer is None
    dist.init_process_group(
        "gloo",
        init_method=(tmp_path / "init-single").as_uri(),
        rank=0,
        world_size=1,
        timeout=timedelta(seconds=10),
    )
    try:
        reducer = reducer_if_distributed()
        assert isinstance(reducer, TorchReducer)
        unknown = (float("inf"), -1.0, -1.0, float("-inf"), -1.0, float("inf"), -1.0)
        assert tuple(reducer(list(unknown), Vote.ops())) == unknown
        large = 4.0e9 + 0.25  # float64: a Unix-scale number survives exactly
        known = (large, 3.5, 61.0, -2.0, 12.5, -1.0, 3.0)
        assert tuple(reducer(list(known), Vote.ops())) == known
        assert isinstance(distributed_guard()._vote.reducer, TorchReducer)
    finally:
        dist.destroy_process_group()
    assert reducer_if_distributed() is None
