"""Start one process per rank, wait for all with one time limit, fail the test on a hang."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import pytest

DEADLINE_VARIABLES = (
    "MLP_CURRENT_CAPACITY_BLOCK_EXPIRATION_TIMESTAMP",
    "SAGEMAKER_CURRENT_CAPACITY_BLOCK_EXPIRATION_TIMESTAMP",
)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def base_environment() -> dict[str, str]:
    """The test's environment without anything that would change a rank's deadline."""
    env = {k: v for k, v in os.environ.items() if k not in DEADLINE_VARIABLES}
    env.pop("ESI_SIDECAR_URL", None)
    env["OMP_NUM_THREADS"] = "1"  # 2 cores shared by all ranks
    return env


def run_ranks(
    commands: Sequence[Sequence[str]],
    environments: Sequence[Mapping[str, str]],
    logdir: Path,
    *,
    limit: float,
) -> list[tuple[int, str]]:
    """Run the commands concurrently; (exit code, stderr) per rank.

    Every rank still running after ``limit`` seconds is killed and the test fails: a
    collective entered by some ranks only shows up as exactly that.
    """
    processes = []
    for rank, (command, env) in enumerate(zip(commands, environments)):
        stderr = open(logdir / f"stderr-{rank}.txt", "w+")  # noqa: SIM115 (closed below)
        process = subprocess.Popen(
            list(command), env=dict(env), stdout=subprocess.DEVNULL, stderr=stderr
        )
        processes.append((process, stderr))
    deadline = time.monotonic() + limit
    hung = False
    for process, _stderr in processes:
        try:
            process.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            hung = True
    outcomes = []
    for process, stderr in processes:
        if process.poll() is None:
            process.kill()
            process.wait()
        stderr.seek(0)
        outcomes.append((process.returncode, stderr.read()))
        stderr.close()
    if hung:
        tails = [text[-800:] for _code, text in outcomes]
        pytest.fail(f"ranks still running after {limit} s (hang): {tails}")
    return outcomes


def run_framework_ranks(mode: str, tmp_path: Path, *, limit: float = 100) -> list[dict[str, Any]]:
    """framework_ddp_worker.py in 2 ranks (``mode`` "hf" or "lightning"); their results.

    Rank 0's daemon knows a release 100 s ahead: with the default policy (60 s save,
    120 s margin) that is inside the budget from the first step on. Rank 1's daemon knows
    one 10^6 s ahead, so rank 1 alone would never save. Each rank reads its own daemon
    from ESI_SIDECAR_URL, as it would on its own node.
    """
    from daemon_harness import serve_daemon, wait_for

    worker = Path(__file__).with_name("framework_ddp_worker.py")
    now = int(time.time())
    port = free_port()
    with ExitStack() as stack:
        environments, commands, results = [], [], []
        for rank, release_after in enumerate((100, 10**6)):
            daemon = stack.enter_context(
                serve_daemon(sources=("static",), expires_at=str(now + release_after))
            )
            wait_for(lambda d=daemon: d.store.health().ok)
            env = base_environment()
            env.update(
                RANK=str(rank),
                LOCAL_RANK=str(rank),
                WORLD_SIZE="2",
                LOCAL_WORLD_SIZE="2",
                MASTER_ADDR="127.0.0.1",
                MASTER_PORT=str(port),
                ESI_SIDECAR_URL=daemon.url,
            )
            result = tmp_path / f"result-{rank}.json"
            environments.append(env)
            commands.append([sys.executable, str(worker), mode, str(tmp_path), str(result)])
            results.append(result)
        outcomes = run_ranks(commands, environments, tmp_path, limit=limit)
    for code, stderr in outcomes:
        assert code == 0, stderr[-3000:]
    return [json.loads(result.read_text()) for result in results]
