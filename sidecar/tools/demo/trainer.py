"""The demo's training process: a small model, a CheckpointGuard, atomic checkpoints.

Run by ``esi-sidecar demo`` (``python -m sidecar.tools.demo.trainer``), it is what a user's job
looks like: resume from the newest valid checkpoint, train, save when the guard says so,
stop after the final save. It reports each event as one JSON line on stdout so the demo
can draw its progress line and summary.

Training-side code, like the user's; the model is :mod:`sidecar.tools.demo.toy_model` (torch
when installed, else pure Python), the same one ``examples/plain_pytorch.py`` trains.
Steps are padded to ``--step-seconds`` to stand in for a GPU step of known length.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path
from typing import Any, Optional

from sidecar.checkpoint.folders import atomic_checkpoint, latest_valid
from sidecar.tools.demo.toy_model import build_model
from sidecar.train.guard import EXIT_RELEASED, CheckpointGuard
from sidecar.train.policy import SavePolicy

GUARD_STATE = "guard.json"  # the guard's state_dict(), inside each checkpoint


def emit(event: str, **fields: Any) -> None:
    print(json.dumps({"event": event, "time": time.time(), **fields}), flush=True)


def save(guard: CheckpointGuard, model: Any, root: Path, step: int, ballast_mb: int,
         kind: str) -> None:
    """One checkpoint through the guard: the model, the guard's state, and ``ballast_mb`` of
    random bytes standing in for a real model's weights (so that the upload takes time)."""
    started = time.time()
    with guard.saving(step), atomic_checkpoint(root, step, keep_last=3) as folder:
        model.save(folder, step)
        (folder / GUARD_STATE).write_text(json.dumps(guard.state_dict()))
        if ballast_mb:
            (folder / "weights.bin").write_bytes(random.randbytes(ballast_mb << 20))
    status = guard.status()
    emit("save", step=step, kind=kind, seconds=time.time() - started,
         remaining=status.remaining_seconds, upload_seconds=status.upload_seconds)


def train(
    root: Path,
    total_steps: int,
    step_seconds: float,
    save_seconds: float,
    redundant_seconds: float,
    wait_after_stop: bool,
    ballast_mb: int = 0,
) -> int:
    model = build_model(seed=0)
    start = 0
    found = latest_valid(root)
    if found is not None:
        start = model.load(found.path) + 1
    emit("start", resumed_from=None if found is None else found.step, first_step=start,
         total_steps=total_steps, backend=type(model).__name__)
    guard = CheckpointGuard(
        policy=SavePolicy(save_seconds=save_seconds, redundant_seconds=redundant_seconds),
        refresh_seconds=0.5,
    )
    if found is not None and (found.path / GUARD_STATE).is_file():
        # What the guard learned on the last machine (step and save times).
        guard.load_state_dict(json.loads((found.path / GUARD_STATE).read_text()))
    last_step: Optional[int] = None
    for step in range(start, total_steps):
        with guard.step():
            began = time.monotonic()
            loss = model.train_step()
            # Stand-in for a GPU step of a known length.
            time.sleep(max(0.0, step_seconds - (time.monotonic() - began)))
        last_step = step
        status = guard.status()
        emit("step", step=step, loss=loss, remaining=status.remaining_seconds)
        if step == start and found is None:
            # A routine checkpoint at the start, as jobs make: its upload teaches the
            # daemon the throughput, so the final save budgets the upload it needs.
            save(guard, model, root, step, ballast_mb, "routine")
        if guard.should_save():
            decision = guard.last_decision
            top_up = decision is not None and decision.top_up
            save(guard, model, root, step, ballast_mb, "top-up" if top_up else "final")
        if guard.should_stop():  # after the final (and top-up) save: waits for the release
            emit("stop", step=step, released=guard.released)
            if wait_after_stop:
                # The release has come and the machine is being reclaimed: a real job
                # exits (EXIT_RELEASED); the demo keeps the process for the SIGKILL.
                while True:
                    time.sleep(1)
            return EXIT_RELEASED if guard.released else 0
    if last_step is not None:
        with atomic_checkpoint(root, last_step, keep_last=3) as folder:
            model.save(folder, last_step)
        emit("save", step=last_step, kind="end", seconds=0.0, remaining=None)
    emit("done", step=last_step)
    return 0


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--root", type=Path, required=True, help="checkpoint folder")
    parser.add_argument("--total-steps", type=int, required=True)
    parser.add_argument("--step-seconds", type=float, default=0.5)
    parser.add_argument("--save-seconds", type=float, default=3.0)
    parser.add_argument("--redundant-seconds", type=float, default=5.0)
    parser.add_argument("--wait-after-stop", action="store_true")
    parser.add_argument("--ballast-mb", type=int, default=0,
                        help="random MiB in each checkpoint, standing in for real weights")
    args = parser.parse_args(argv)
    return train(args.root, args.total_steps, args.step_seconds, args.save_seconds,
                 args.redundant_seconds, args.wait_after_stop, args.ballast_mb)


if __name__ == "__main__":
    sys.exit(main())
